"""The dashboard in a real browser (headless Chromium from Debian, over CDP) against a
real in-process cluster (two simulated edges): every page rendered and screenshotted,
server-side paging and filters over the registry, tenancy exactly as REST's, hostile
strings shown as text, the session key out of reach of scripts and URLs, CSRF and
cross-origin refusals."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from dsec.bench._browser import Browser
from dsec.control.ui.app import CSP
from dsec.control.ui.session import csrf_token
from tests.control.ui.conftest import Tenants, login

PAYLOADS = ('<img src=x onerror="window.__pwned=1">',
            '"><script>window.__pwned=2</script>',
            "<svg/onload=window.__pwned=3>")


def _ids_on_page(page: object) -> list[str]:
    return list(page.eval(  # type: ignore[attr-defined]
        "[...document.querySelectorAll('#sandboxes td.id a')].map(a => a.textContent)"))


def test_every_page_renders_in_a_browser(browser: Browser, tenants: Tenants,
                                         tmp_path: Path) -> None:
    t = tenants
    ids = t.create(t.a_key, t.a_project, 3, labels={"app": "web"})
    with t.rest(t.a_key) as c:
        assert c.post(f"/v1/sandboxes/{ids[0]}/pause").status_code == 200
    shots: list[Path] = []
    with browser.context() as page:
        login(page, t.url, t.a_key)
        assert page.url.endswith("/ui/sandboxes")
        # the key is nowhere a script or a URL could carry it
        assert page.eval("document.cookie") == ""
        assert t.a_key not in page.url
        assert t.a_key not in page.eval("document.documentElement.outerHTML")
        assert page.eval("localStorage.length + sessionStorage.length") == 0
        listed = _ids_on_page(page)
        assert set(ids) <= set(listed)
        assert page.text("#sandboxes").count("app=web") >= 3
        shots.append(page.screenshot(tmp_path / "sandboxes.png"))

        page.goto(f"{t.url}/ui/nodes")
        nodes = page.text("#nodes")
        assert "edge-0" in nodes and "edge-1" in nodes and "healthy" in nodes
        assert page.eval("document.querySelectorAll('#nodes meter').length") == 4
        shots.append(page.screenshot(tmp_path / "nodes.png"))

        page.goto(f"{t.url}/ui/sandboxes?state=paused")
        assert _ids_on_page(page) == [ids[0]]
        page.act("document.querySelector('#sandboxes td.id a').click()")
        assert page.text("#sid") == ids[0]
        assert page.text("#state").startswith("paused")
        assert "app=web" in page.text("#labels")
        events = page.text("#events")
        assert "running" in events and "paused" in events
        shots.append(page.screenshot(tmp_path / "sandbox-paused.png"))
        page.act("document.getElementById('resume').click()")
        assert page.text("#state").startswith("running")
        assert "memory_bytes" in page.text("#stats")
        shots.append(page.screenshot(tmp_path / "sandbox.png"))

        page.goto(f"{t.url}/ui/rate")
        assert int(page.text("#total")) >= 3
        assert page.eval("document.querySelectorAll('#chart rect').length") == 60
        shots.append(page.screenshot(tmp_path / "rate.png"))

        page.goto(f"{t.url}/ui/sandboxes/sb-000000000000-edge-0")
        assert "sandbox_not_found" in page.text("h1")
        shots.append(page.screenshot(tmp_path / "not-found.png"))
    for s in shots:
        assert s.stat().st_size > 1000
        print(f"screenshot: {s}")


def test_every_response_carries_a_strict_csp(tenants: Tenants) -> None:
    t = tenants
    sid = t.create(t.a_key, t.a_project)[0]
    with httpx.Client(base_url=t.url, timeout=30) as c:
        r = c.post("/ui/login", data={"key": t.a_key}, headers={"origin": t.url})
        assert r.status_code == 303
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ui" in cookie
        for path in ("/ui/login", "/ui/nodes", "/ui/sandboxes", f"/ui/sandboxes/{sid}",
                     "/ui/rate", "/ui/sandboxes/nope"):
            r = c.get(path)
            assert r.headers["content-security-policy"] == CSP, path
            assert "'unsafe-inline'" not in r.headers["content-security-policy"]
            assert r.headers["x-frame-options"] == "DENY"
            assert r.headers["x-content-type-options"] == "nosniff"
            assert t.a_key not in r.text
        for path in ("/ui/static/term.js", "/ui/static/ui.js", "/ui/static/vendor/xterm.js"):
            r = c.get(path)
            assert r.status_code == 200 and "javascript" in r.headers["content-type"]
            assert r.headers["x-content-type-options"] == "nosniff"
        assert c.get("/ui/static/../app.py").status_code == 404


def test_hostile_strings_are_shown_as_text(browser: Browser, tenants: Tenants,
                                           tmp_path: Path) -> None:
    t = tenants
    sid = t.create(t.a_key, t.a_project, labels={f"x{i}": p for i, p in enumerate(PAYLOADS)})[0]
    other = t.create(t.a_key, t.a_project)[0]
    # an event detail chosen by the edge (a network peer): destroyed with a hostile one
    node = _node_of(t, other)
    t.on_loop(node.destroy(other, reason="requested", detail=PAYLOADS[2] + PAYLOADS[0]))
    with browser.context() as page:
        login(page, t.url, t.a_key)
        page.goto(f"{t.url}/ui/sandboxes?label={quote('x0=' + PAYLOADS[0])}")
        assert _ids_on_page(page) == [sid]
        labels = page.text("#sandboxes td.labels")
        for p in PAYLOADS:
            assert p in labels
        page.goto(f"{t.url}/ui/sandboxes/{sid}")
        for p in PAYLOADS:
            assert p in page.text("#labels")
        page.screenshot(tmp_path / "hostile-labels.png")
        page.goto(f"{t.url}/ui/sandboxes/{other}")
        assert PAYLOADS[2] + PAYLOADS[0] in page.text("#events")
        page.screenshot(tmp_path / "hostile-event.png")
        assert page.eval("typeof window.__pwned") == "undefined"
        assert page.eval("document.querySelectorAll('main img, main script, main svg').length") == 0
        print(f"screenshot: {tmp_path / 'hostile-labels.png'}")


def _node_of(t: Tenants, sid: str) -> Any:
    for n in t.cluster.runtime.nodes:
        if sid.endswith("-" + n.config.node_id):
            return n
    raise AssertionError(f"no edge for {sid}")


def test_another_projects_key_sees_nothing(browser: Browser, tenants: Tenants) -> None:
    t = tenants
    mine = t.create(t.a_key, t.a_project)[0]
    theirs = t.create(t.b_key, t.b_project, 2)
    with t.rest(t.b_key) as rest:
        rest_missing = rest.get(f"/v1/sandboxes/{mine}").json()
        rest_list_a = rest.get("/v1/sandboxes", params={"project": t.a_project})
    with browser.context() as page:
        login(page, t.url, t.b_key)
        listed = _ids_on_page(page)
        assert set(theirs) <= set(listed)
        assert mine not in listed and t.a_project not in page.text("#sandboxes")
        # filtering on the other project: REST's refusal, word for word
        page.goto(f"{t.url}/ui/sandboxes?project={t.a_project}")
        assert rest_list_a.json()["message"] in page.text("#error")
        assert str(rest_list_a.status_code) in page.text("h1")
        # the other project's sandbox: exactly the 404 of an id that never existed
        page.goto(f"{t.url}/ui/sandboxes/{mine}")
        assert page.text("#error") == rest_missing["message"]
        page.goto(f"{t.url}/ui/sandboxes/{mine}/terminal/1")
        assert page.text("#error") == rest_missing["message"]
        # the creation rate counts only what this key may see
        page.goto(f"{t.url}/ui/rate")
        with t.rest(t.b_key) as rest:
            b_total = len(rest.get("/v1/sandboxes", params={"limit": 1000}).json()["items"])
        assert int(page.text("#total")) == b_total
        # an action on it, with this session's valid token: the same 404, nothing done
        csrf = page.eval("document.querySelector('input[name=csrf]').value")
        page.act(f"""(() => {{ const f = document.createElement('form'); f.method = 'post';
            f.action = '/ui/sandboxes/{mine}/destroy'; const i = document.createElement('input');
            i.name = 'csrf'; i.value = {json.dumps(csrf)}; f.appendChild(i);
            document.body.appendChild(f); f.submit(); }})()""")
        assert page.text("#error") == rest_missing["message"]
    with t.rest(t.a_key) as rest:
        assert rest.get(f"/v1/sandboxes/{mine}").json()["state"] == "running"


def test_csrf_token_and_origin_are_required(browser: Browser, tenants: Tenants) -> None:
    t = tenants
    sid = t.create(t.a_key, t.a_project)[0]
    pause = f"/ui/sandboxes/{sid}/pause"
    with httpx.Client(base_url=t.url, timeout=30) as c:
        # a login posted from another origin sets nothing
        r = c.post("/ui/login", data={"key": t.a_key}, headers={"origin": "http://evil.test"})
        assert r.status_code == 403 and "set-cookie" not in r.headers
        r = c.post("/ui/login", data={"key": t.a_key}, headers={"origin": t.url})
        assert r.status_code == 303
        good = csrf_token(t.a_key)
        refused = [
            ({"origin": t.url}, {}),                                    # no token
            ({"origin": t.url}, {"csrf": "0" * 64}),                    # wrong token
            ({"origin": "http://evil.test"}, {"csrf": good}),           # other origin
            ({}, {"csrf": good}),                                       # no Origin
            ({"origin": t.url, "sec-fetch-site": "cross-site"}, {"csrf": good}),
        ]
        for headers, form in refused:
            r = c.post(pause, data=form, headers=headers)
            assert r.status_code == 403, (headers, form, r.status_code)
        assert _state(t, sid) == "running"
        r = c.post(pause, data={"csrf": good}, headers={"origin": t.url})
        assert r.status_code == 303
        assert _state(t, sid) == "paused"
    # in the browser: a cross-site page that auto-submits the form does nothing (the
    # SameSite=Strict cookie stays home; its Origin is not ours)
    with browser.context() as page:
        login(page, t.url, t.a_key)
        attack = (f'<form method="post" action="{t.url}/ui/sandboxes/{sid}/resume">'
                  f'<input name="csrf" value="{csrf_token(t.a_key)}"></form>'
                  "<script>document.forms[0].submit()</script>")
        page.goto("data:text/html," + quote(attack))
        page.wait_for("location.href.indexOf('/ui/') >= 0")
        page.wait_for("document.readyState === 'complete'")
        assert "/ui/login" in page.url
    assert _state(t, sid) == "paused"


def _state(t: Tenants, sid: str) -> str:
    with t.rest(t.admin) as c:
        return str(c.get(f"/v1/sandboxes/{sid}").json()["state"])


def test_paging_and_filters_match_rest(browser: Browser, tenants: Tenants) -> None:
    t = tenants
    ids = t.create(t.a_key, t.a_project, 24)
    grp = t.create(t.a_key, t.a_project, 5, labels={"grp": "x y"})
    with t.rest(t.a_key) as rest:
        for sid in ids[:4]:
            assert rest.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        every = rest.get("/v1/sandboxes", params={"limit": 1000}).json()["items"]
    assert len(every) >= 29
    with browser.context() as page:
        login(page, t.url, t.a_key)
        # all pages, 10 a page: every sandbox exactly once, in id order
        page.goto(f"{t.url}/ui/sandboxes?limit=25")
        seen: list[str] = []
        pages = 0
        while True:
            seen += _ids_on_page(page)
            pages += 1
            if not page.eval("!!document.getElementById('next')"):
                break
            page.act("document.getElementById('next').click()")
        assert seen == [s["id"] for s in every]
        assert pages == -(-len(every) // 25)
        page.goto(f"{t.url}/ui/sandboxes?state=paused&limit=200")
        assert set(_ids_on_page(page)) == {s["id"] for s in every if s["state"] == "paused"}
        page.goto(f"{t.url}/ui/sandboxes?limit=200&label={quote('grp=x y')}")
        assert _ids_on_page(page) == sorted(grp)
        for node in ("edge-0", "edge-1"):
            page.goto(f"{t.url}/ui/sandboxes?limit=200&node={node}")
            assert _ids_on_page(page) == [s["id"] for s in every if s["node"] == node]
        # the node filter pages too: never more than the limit a page, nothing twice
        page.goto(f"{t.url}/ui/sandboxes?limit=5&node=edge-1")
        on_node: list[str] = []
        while True:
            rows = _ids_on_page(page)
            assert len(rows) <= 5
            on_node += rows
            if not page.eval("!!document.getElementById('next')"):
                break
            page.act("document.getElementById('next').click()")
        assert on_node == [s["id"] for s in every if s["node"] == "edge-1"]
        page.goto(f"{t.url}/ui/sandboxes?limit=200&project={t.a_project}")
        assert _ids_on_page(page) == [s["id"] for s in every]
        page.goto(f"{t.url}/ui/sandboxes?label=nonsense")
        assert "key=value" in page.text("#error")


def test_a_revoked_key_ends_the_session(browser: Browser, tenants: Tenants) -> None:
    t = tenants
    with t.rest(t.a_key) as rest:
        me = rest.get("/v1/info").json()["principal"]     # a second key of alice's own
        r = rest.post("/v1/keys", json={"name": me, "project": t.a_project, "role": "member"})
        assert r.status_code in (200, 201), r.text
        extra = r.json()
    with browser.context() as page:
        login(page, t.url, extra["api_key"])
        assert page.url.endswith("/ui/sandboxes")
        with t.rest(extra["api_key"]) as rest:
            assert rest.delete(f"/v1/keys/{extra['key_id']}").status_code == 204
        page.goto(f"{t.url}/ui/nodes")
        assert page.url.endswith("/ui/login")
        # log out: the cookie is gone
        login(page, t.url, t.a_key)
        page.act("document.querySelector('form.logout button').click()")
        assert page.url.endswith("/ui/login")
        page.goto(f"{t.url}/ui/sandboxes")
        assert page.url.endswith("/ui/login")


def _ws(url: str, path: str, headers: dict[str, str]) -> list[str | bytes]:
    """Every frame the dashboard's WebSocket at ``path`` sends, and how it closed."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect
    frames: list[str | bytes] = []
    try:
        with connect("ws" + url[4:] + path, additional_headers=headers,
                     open_timeout=20) as ws:
            try:
                while True:
                    frames.append(ws.recv(timeout=20))
            except ConnectionClosed as exc:
                frames.append(f"close {exc.rcvd.code if exc.rcvd else None}")
    except InvalidStatus as exc:      # refused at the handshake
        frames.append(f"http {exc.response.status_code}")
    return frames


def test_the_terminal_socket_checks_session_origin_and_project(tenants: Tenants) -> None:
    t = tenants
    sid = t.create(t.a_key, t.a_project)[0]
    with httpx.Client(base_url=t.url, timeout=30) as c:
        r = c.post("/ui/login", data={"key": t.a_key}, headers={"origin": t.url})
        r = c.post(f"/ui/sandboxes/{sid}/terminal", data={"csrf": csrf_token(t.a_key)},
                   headers={"origin": t.url})
        assert r.status_code == 303, r.text
        path = r.headers["location"].replace("/terminal/", "/processes/") + "/ws"
        assert re.fullmatch(rf"/ui/sandboxes/{sid}/processes/\d+/ws", path)
    mine = {"cookie": f"dsec_ui={t.a_key}", "origin": t.url}
    # the owner: the process's output (the simulated shell has no /bin/sh), its exit
    frames = _ws(t.url, path, mine)
    assert b"".join(f for f in frames if isinstance(f, bytes)).startswith(b"sh: /bin/sh")
    assert json.loads(str(frames[-2]))["exit_code"] == 127 and frames[-1] == "close 1000"
    # the sandbox page lists the process (any client's connect finds it there)
    with httpx.Client(base_url=t.url, timeout=30) as c:
        c.cookies.set("dsec_ui", t.a_key, path="/ui")
        procs = html.unescape(c.get(f"/ui/sandboxes/{sid}").text.split('id="processes"')[1])
        pid = path.split("/")[-2]
        assert f"<td>{pid}</td>" in procs and "/bin/sh" in procs and "exited 127" in procs
        assert f'href="/ui/sandboxes/{sid}/terminal/{pid}"' in procs
    # no session, another origin, no origin: refused before anything is handed on
    for headers in ({"origin": t.url}, {**mine, "origin": "http://evil.test"},
                    {"cookie": mine["cookie"]}):
        assert _ws(t.url, path, headers) == ["http 403"], headers
    # another project's session: the REST socket's own 404, nothing of the process
    frames = _ws(t.url, path, {"cookie": f"dsec_ui={t.b_key}", "origin": t.url})
    assert json.loads(str(frames[0]))["error"]["code"] == "sandbox_not_found"
    assert frames[1:] == ["close 4404"]
    # nor may it start a terminal there
    with httpx.Client(base_url=t.url, timeout=30) as c:
        c.cookies.set("dsec_ui", t.b_key, path="/ui")
        r = c.post(f"/ui/sandboxes/{sid}/terminal", data={"csrf": csrf_token(t.b_key)},
                   headers={"origin": t.url})
        assert r.status_code == 404


def test_a_reader_may_look_but_not_act(tenants: Tenants) -> None:
    t = tenants
    sid = t.create(t.a_key, t.a_project)[0]
    with t.rest(t.admin) as admin:
        r = admin.post("/v1/keys", json={"name": f"reader-{t.a_project}",
                                         "project": t.a_project, "role": "reader"})
        assert r.status_code in (200, 201), r.text
        key = r.json()["api_key"]
    with t.rest(key) as rest:
        refused = rest.post(f"/v1/sandboxes/{sid}/pause").json()
    with httpx.Client(base_url=t.url, timeout=30) as c:
        assert c.post("/ui/login", data={"key": key},
                      headers={"origin": t.url}).status_code == 303
        assert sid in c.get(f"/ui/sandboxes/{sid}").text
        for action in ("pause", "destroy", "terminal"):
            r = c.post(f"/ui/sandboxes/{sid}/{action}", data={"csrf": csrf_token(key)},
                       headers={"origin": t.url})
            assert r.status_code == 403, (action, r.status_code)
            assert refused["message"] in html.unescape(r.text)     # REST's words
    assert _state(t, sid) == "running"


def test_the_sandbox_page_keeps_its_events_charged_until_it_is_sent(tenants: Tenants) -> None:
    """Red team 21, B2: the sandbox page is a door of the reply budget (its events are a
    budgeted reply): the events' lease is held while the page's body is written, given
    back after."""
    from starlette.applications import Starlette

    from dsec.control.ui import Dashboard
    t = tenants
    sid = t.create(t.a_key, t.a_project)[0]
    service = t.cluster.runtime.service
    app = Starlette(routes=Dashboard(service).routes())
    seen: dict[str, Any] = {}

    async def call() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and "held" not in seen:
                seen["held"] = service.replies.budget.held(t.a_project)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "GET", "scheme": "http", "path": f"/ui/sandboxes/{sid}",
                 "raw_path": b"", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"127.0.0.1"),
                             (b"cookie", f"dsec_ui={t.a_key}".encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
    t.on_loop(call())
    assert seen["status"] == 200, seen
    assert seen["held"] > 0, "the page was written with its events' lease given back"
    assert service.replies.budget.held(t.a_project) == 0
