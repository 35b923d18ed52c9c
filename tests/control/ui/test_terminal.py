"""The dashboard's terminal, driven in the browser: xterm.js over the dashboard's
WebSocket (session cookie, this origin), handed to the REST process WebSocket, a real
shell on a pty in a container sandbox. Typing ``echo hi`` shows ``hi``; another
project's key and a cross-origin handshake get nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.bench._browser import Browser
from dsec.cluster.local import LocalCluster
from dsec.control.ui.session import csrf_token
from tests.control.ui.conftest import login

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="container") as cl:
        yield cl


def _rows(page: object) -> str:
    return str(page.eval(  # type: ignore[attr-defined]
        "(() => { const b = window.dsecTerminal.buffer.active; const out = [];"
        " for (let i = 0; i < b.length; i++) out.push(b.getLine(i).translateToString(true));"
        " return out.join('\\n'); })()"))


def test_typing_in_the_terminal_runs_in_the_sandbox(browser: Browser, cluster: LocalCluster,
                                                    tmp_path: Path) -> None:
    with httpx.Client(base_url=cluster.url, timeout=60,
                      headers={"authorization": f"Bearer {cluster.api_key}"}) as rest:
        r = rest.post("/v1/sandboxes", json={"backend": "container"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            with browser.context() as page:
                login(page, cluster.url, cluster.api_key)
                page.goto(f"{cluster.url}/ui/sandboxes/{sid}")
                page.act("document.getElementById('open-terminal').click()")
                assert f"/ui/sandboxes/{sid}/terminal/" in page.url
                page.wait_for("document.getElementById('term-status').textContent"
                              " === 'connected'")
                page.wait_for("""(() => { const b = window.dsecTerminal.buffer.active;
                    for (let i = 0; i < b.length; i++)
                      if (b.getLine(i).translateToString(true).includes('#')) return true;
                    return false; })()""")   # the prompt
                page.eval("window.dsecTerminal.focus()")
                page.key("echo hi$((40+2))\r")
                page.wait_for("""(() => { const b = window.dsecTerminal.buffer.active;
                    for (let i = 0; i < b.length; i++)
                      if (b.getLine(i).translateToString(true).trim() === 'hi42') return true;
                    return false; })()""")
                shot = page.screenshot(tmp_path / "terminal.png")
                print(f"screenshot: {shot}")
                # the size the browser's terminal has is the shell's
                page.key("stty size\r")
                page.wait_for("""(() => { const t = window.dsecTerminal, b = t.buffer.active;
                    for (let i = 0; i < b.length; i++)
                      if (b.getLine(i).translateToString(true).trim() === t.rows + ' ' + t.cols)
                        return true;
                    return false; })()""")
                # output is terminal data, never markup (an OSC 8 link to javascript:
                # is a link's text, nothing runs)
                page.key("printf '<img src=x onerror=window.__pwned=1>\\033]8;;"
                         "javascript:window.__pwned=2\\033\\\\click\\033]8;;\\033\\\\\\n'\r")
                page.wait_for("""(() => { const b = window.dsecTerminal.buffer.active;
                    for (let i = 0; i < b.length; i++)
                      if (b.getLine(i).translateToString(true).startsWith('<img src=x'))
                        return true;
                    return false; })()""")
                assert page.eval("typeof window.__pwned") == "undefined"
                assert page.eval("document.querySelectorAll('#term img').length") == 0
                page.key("exit 3\r")
                page.wait_for("document.getElementById('term-status').textContent"
                              " === 'exited with code 3'")
                assert "hi42" in _rows(page)
        finally:
            rest.delete(f"/v1/sandboxes/{sid}")


ATTACK = """<!doctype html><title>waiting</title><script>
(async () => {
  const out = [];
  try { const r = await fetch('/ui/sandboxes', {credentials: 'include'});
        out.push('read ' + (await r.text()).length); } catch (e) { out.push('fetch blocked'); }
  try { const r = await fetch('/ui/sandboxes/SID/destroy', {method: 'POST',
          credentials: 'include', body: 'csrf=x'}); out.push('post ' + r.status); }
  catch (e) { out.push('post blocked'); }
  await new Promise((done) => {
    const ws = new WebSocket('ws://' + location.host + '/ui/sandboxes/SID/processes/PID/ws');
    ws.onmessage = () => { out.push('ws read'); done(); };
    ws.onerror = () => { out.push('ws blocked'); done(); };
    setTimeout(done, 5000);
  });
  document.title = 'done: ' + out.join(', ');
})();
</script>"""


def test_a_sandboxs_page_behind_the_proxy_cannot_use_the_session(
        browser: Browser, cluster: LocalCluster) -> None:
    """Exposed ports share the apiserver's origin (docs/ports.md): a hostile sandbox's
    page, opened by a logged-in user, must neither read the dashboard, nor act through
    it, nor open its terminal socket (the proxy's CSP sandbox gives it an opaque origin:
    no SameSite cookie, no readable answer, Origin: null)."""
    with httpx.Client(base_url=cluster.url, timeout=60,
                      headers={"authorization": f"Bearer {cluster.api_key}"}) as rest:
        victim = rest.post("/v1/sandboxes", json={"backend": "container"}).json()["id"]
        evil = rest.post("/v1/sandboxes", json={"backend": "container"}).json()["id"]
        try:
            with httpx.Client(base_url=cluster.url, timeout=60) as ui:
                ui.post("/ui/login", data={"key": cluster.api_key},
                        headers={"origin": cluster.url})
                r = ui.post(f"/ui/sandboxes/{victim}/terminal",
                            data={"csrf": csrf_token(cluster.api_key)},
                            headers={"origin": cluster.url})
                pid = r.headers["location"].rsplit("/", 1)[1]
            page_html = ATTACK.replace("SID", victim).replace("PID", pid)
            w = rest.put(f"/v1/sandboxes/{evil}/files", params={"path": "/tmp/www/index.html"},
                         content=page_html.encode(),
                         headers={"content-type": "application/octet-stream"})
            assert w.status_code in (200, 204), w.text
            x = rest.post(f"/v1/sandboxes/{evil}/exec",
                          json={"shell": "httpd -p 127.0.0.1:8000 -h /tmp/www", "timeout_s": 10})
            assert x.json()["exit_code"] == 0, x.text
            url = rest.post(f"/v1/sandboxes/{evil}/ports", json={"port": 8000}).json()["url"]
            if url.startswith("/"):
                url = cluster.url + url
            assert url.startswith(f"{cluster.url}/v1/proxy/"), url    # the dashboard's origin
            with browser.context() as page:
                login(page, cluster.url, cluster.api_key)
                page.goto(url)
                title = page.wait_for("document.title.startsWith('done') && document.title",
                                      timeout=30)
                assert title == "done: fetch blocked, post blocked, ws blocked", title
            assert rest.get(f"/v1/sandboxes/{victim}").json()["state"] == "running"
        finally:
            for sid in (victim, evil):
                rest.delete(f"/v1/sandboxes/{sid}")
