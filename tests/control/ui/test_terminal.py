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
