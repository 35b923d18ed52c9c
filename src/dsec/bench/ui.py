"""The dashboard's page load with 10,000 sandboxes listed (paged): suite ``features``.

An in-process cluster of two simulated edges (sized so 10,000 tiny sandboxes fit) is
filled through ``POST /v1/batch/create``; then headless Chromium (Debian's, over CDP:
:mod:`dsec.bench._browser`), logged in through the form, loads the sandboxes page and
the figure is the time from navigation to the load event (HTML, CSS and script from
this apiserver), median of ``rounds`` loads: the first page, a page 5,000 sandboxes in
(a cursor), a state filter and a node filter (which scans list pages). The server's
share alone (one HTTP GET with the session cookie, no browser) is recorded beside it.
"""

from __future__ import annotations

import statistics
import time

import httpx

from dsec.bench import BenchContext

__all__ = ["ui_page_load"]


def _fill(url: str, key: str, n: int, batch: int = 500) -> list[str]:
    ids: list[str] = []
    spec = {"backend": "simulated", "cpu_milli": 1, "memory_bytes": 1 << 20,
            "labels": {"bench": "ui"}}
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"},
                      timeout=120) as c:
        while len(ids) < n:
            k = min(batch, n - len(ids))
            r = c.post("/v1/batch/create", json={"items": [spec] * k})
            r.raise_for_status()
            for o in r.json()["items"]:
                if "value" in o and o["value"] is not None:
                    ids.append(o["value"]["id"])
                else:
                    raise RuntimeError(f"create failed: {o}")
    return sorted(ids)


def ui_page_load(ctx: BenchContext) -> None:
    """Dashboard: sandboxes page load with 10,000 sandboxes listed (paged)."""
    from dsec.bench._browser import Browser, chromium_path
    from dsec.cluster.local import LocalCluster
    from dsec.control.ui.session import COOKIE

    n = 10_000
    rounds = ctx.scale(20, 5)
    limit = 50
    c = LocalCluster(edges=2, gateway=False, cpu_milli=10**8, memory_bytes=1 << 46).start()
    try:
        t0 = time.perf_counter()
        ids = _fill(c.url, c.api_key, n)
        fill_s = time.perf_counter() - t0
        import base64
        mid = base64.urlsafe_b64encode(ids[n // 2 - 1].encode()).decode().rstrip("=")
        pages: dict[str, str] = {
            "first": f"/ui/sandboxes?limit={limit}",
            "middle": f"/ui/sandboxes?limit={limit}&cursor={mid}",
            "state=running": f"/ui/sandboxes?limit={limit}&state=running",
            "node=edge-1": f"/ui/sandboxes?limit={limit}&node=edge-1",
        }
        # the server's share: the page's HTML over HTTP, no browser
        with httpx.Client(base_url=c.url, timeout=60) as h:
            r = h.post("/ui/login", data={"key": c.api_key}, headers={"origin": c.url})
            assert r.status_code == 303, r.text
            h.cookies.set(COOKIE, c.api_key, path="/ui")
            for name, path in pages.items():
                times = []
                for _ in range(rounds):
                    t = time.perf_counter()
                    r = h.get(path)
                    times.append(time.perf_counter() - t)
                    assert r.status_code == 200 and r.text.count('class="id"') >= 1, r.text[:300]
                ctx.record("ui_sandboxes_page_server_ms", statistics.median(times) * 1e3, "ms",
                           n=n, page=name, limit=limit)
        if chromium_path() is None:
            ctx.note("ui_sandboxes_page_load_ms not measured: chromium is not installed")
            return
        b = Browser()
        try:
            with b.context() as page:
                page.goto(f"{c.url}/ui/login")
                page.eval(f"document.getElementById('key').value = {c.api_key!r}")
                page.act("document.getElementById('login').click()")
                for name, path in pages.items():
                    page.goto(c.url + path)           # warm: CSS and script cached
                    times = [page.goto(c.url + path) for _ in range(rounds)]
                    rows = page.eval("document.querySelectorAll('#sandboxes td.id').length")
                    ctx.record("ui_sandboxes_page_load_ms", statistics.median(times) * 1e3,
                               "ms", n=n, page=name, limit=limit, rows=rows)
        finally:
            b.close()
        ctx.note(f"ui_sandboxes_page_*: {n} simulated sandboxes on 2 in-process edges "
                 f"(filled in {fill_s:.1f} s through /v1/batch/create); page_load: headless "
                 "Chromium navigation to the load event (CSS and script cached), page_server: "
                 f"the HTML over HTTP alone; median of {rounds}; {limit} rows a page.")
    finally:
        c.stop()
