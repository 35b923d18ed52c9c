"""Headless Chromium over the DevTools protocol, for the dashboard's tests and its bench.

Debian's ``chromium`` package, started with ``--remote-debugging-port=0`` (it writes the
port it chose to ``DevToolsActivePort`` in its profile dir) and driven with the
``websockets`` client this project already uses: no chromedriver, no selenium, no
download. One :class:`Browser` per test session; :meth:`Browser.context` gives each
simulated user its own cookie jar (a CDP browser context), so two logins never share a
session. Only what the tests need: navigate and wait for the load event, evaluate
JavaScript, type keys, screenshots.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

__all__ = ["Browser", "BrowserError", "Page", "chromium_path"]


class BrowserError(RuntimeError):
    pass


def chromium_path() -> str | None:
    """Debian's browser binary (the real one, not the /usr/bin wrapper script)."""
    for p in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "",
              shutil.which("chromium-browser") or ""):
        if p and os.access(p, os.X_OK):
            return p
    return None


class _Conn:
    """One DevTools WebSocket: numbered commands, events queued until asked for."""

    def __init__(self, url: str) -> None:
        # entered as a context manager (websockets 17.1 deprecates the bare form);
        # close() leaves it
        self.ws: ClientConnection = connect(url, max_size=64 << 20,
                                            open_timeout=30).__enter__()
        self._n = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self._n += 1
        n = self._n
        self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if msg.get("id") == n:
                if "error" in msg:
                    raise BrowserError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            if "method" in msg:
                self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e["method"] == method:
                    del self.events[: i + 1]
                    params: dict[str, Any] = e.get("params", {})
                    return params
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"no {method} within {timeout} s")
            try:
                msg = json.loads(self.ws.recv(timeout=left))
            except TimeoutError:
                raise BrowserError(f"no {method} within {timeout} s") from None
            if "method" in msg:
                self.events.append(msg)

    def close(self) -> None:
        self.ws.close()


class Page:
    """One tab."""

    def __init__(self, browser: Browser, target_id: str) -> None:
        self.browser = browser
        self.target_id = target_id
        self.conn = _Conn(f"ws://127.0.0.1:{browser.port}/devtools/page/{target_id}")
        self.conn.send("Page.enable")
        self.conn.send("Runtime.enable")
        self.dialogs: list[str] = []

    def goto(self, url: str, timeout: float = 30.0) -> float:
        """Navigate and wait for the load event; the seconds it took."""
        self.conn.events.clear()
        t0 = time.perf_counter()
        res = self.conn.send("Page.navigate", url=url)
        if res.get("errorText"):
            raise BrowserError(f"navigate {url}: {res['errorText']}")
        self.conn.wait_event("Page.loadEventFired", timeout)
        return time.perf_counter() - t0

    def act(self, js: str, timeout: float = 30.0) -> None:
        """Run ``js`` (a click, a submit) and wait for the page it loads."""
        self.conn.events.clear()
        self.eval(js)
        self.conn.wait_event("Page.loadEventFired", timeout)

    def eval(self, expr: str) -> Any:
        res = self.conn.send("Runtime.evaluate", expression=expr, returnByValue=True,
                             awaitPromise=True)
        if "exceptionDetails" in res:
            raise BrowserError(f"{expr[:80]}: {res['exceptionDetails'].get('text')} "
                               f"{res['exceptionDetails'].get('exception', {}).get('description', '')}")
        return res.get("result", {}).get("value")

    def text(self, selector: str = "body") -> str:
        return str(self.eval(f"(document.querySelector({json.dumps(selector)}) || "
                             "{innerText: ''}).innerText"))

    @property
    def url(self) -> str:
        return str(self.eval("location.href"))

    def wait_for(self, expr: str, timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            v = self.eval(expr)
            if v:
                return v
            if time.monotonic() > deadline:
                raise BrowserError(f"{expr[:100]} still false after {timeout} s")
            time.sleep(0.05)

    def key(self, text: str) -> None:
        """Type ``text`` into the focused element as key events (Enter for \\r/\\n)."""
        for ch in text:
            if ch in "\r\n":
                self.conn.send("Input.dispatchKeyEvent", type="keyDown", key="Enter",
                               code="Enter", windowsVirtualKeyCode=13, text="\r")
                self.conn.send("Input.dispatchKeyEvent", type="keyUp", key="Enter",
                               code="Enter", windowsVirtualKeyCode=13)
            else:
                self.conn.send("Input.dispatchKeyEvent", type="keyDown", text=ch, key=ch)
                self.conn.send("Input.dispatchKeyEvent", type="keyUp", key=ch)

    def screenshot(self, path: Path) -> Path:
        data = self.conn.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        try:
            self.browser.conn.send("Target.closeTarget", targetId=self.target_id)
        finally:
            self.conn.close()


class Browser:
    """A headless Chromium process of our own (own profile dir, port 0)."""

    def __init__(self, binary: str | None = None, *, width: int = 1280, height: int = 900
                 ) -> None:
        binary = binary or chromium_path()
        if binary is None:
            raise BrowserError("chromium is not installed (Debian package 'chromium')")
        self.profile = tempfile.mkdtemp(prefix="dsec-chromium-")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={self.profile}", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--disable-sync",
             "--disable-component-update", "--disable-default-apps",
             "--password-store=basic", "--use-mock-keychain",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        try:
            self.port, path = self._devtools_port()
            self.conn = _Conn(f"ws://127.0.0.1:{self.port}{path}")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, timeout: float = 60.0) -> tuple[int, str]:
        f = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self.proc.returncode}")
            try:
                port, path = f.read_text().split("\n")[:2]
                return int(port), path
            except (OSError, ValueError):
                time.sleep(0.05)
        raise BrowserError(f"chromium wrote no DevToolsActivePort within {timeout} s")

    @contextmanager
    def context(self) -> Iterator[Page]:
        """A page in a fresh browser context (its own cookies), closed afterwards."""
        ctx = self.conn.send("Target.createBrowserContext")["browserContextId"]
        try:
            tid = self.conn.send("Target.createTarget", url="about:blank",
                                 browserContextId=ctx)["targetId"]
            page = Page(self, tid)
            try:
                yield page
            finally:
                page.close()
        finally:
            self.conn.send("Target.disposeBrowserContext", browserContextId=ctx)

    def close(self) -> None:
        try:
            if getattr(self, "conn", None) is not None:
                with contextlib.suppress(BrowserError, OSError, TimeoutError,
                                         ConnectionError):
                    self.conn.send("Browser.close", timeout=5)   # else terminate below
                self.conn.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
