"""Dashboard shells do not pile up (red team 19, noted): each "Terminal" click used to
start another ``/bin/sh`` with no timeout, left running when the tab closed (a ring and
one of the sandbox's process slots each, forever). Now a click reuses the caller's
running dashboard shell, and a shell whose terminal nobody has had open for
``terminal_idle_s`` is killed; another process viewed through the dashboard's socket is
never touched. Real in-process cluster (simulated edge); the shell is ``sleep 3600`` on
a terminal (the simulated backend has no /bin/sh), which runs until it is ended."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import dsec.control.ui.app as ui_app
from dsec.cluster.local import LocalCluster
from dsec.control.ui.session import csrf_token

IDLE_S = 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ui_app, "TERMINAL_ARGV", ("sleep", "3600"))
        mp.setattr(ui_app, "TERMINAL_IDLE_S", IDLE_S)   # read when the dashboard is made
        with LocalCluster(edges=1) as cl:
            yield cl


def _procs(c: httpx.Client, sid: str) -> dict[int, dict[str, Any]]:
    r = c.get(f"/v1/sandboxes/{sid}/processes")
    assert r.status_code == 200, r.text
    # the JSON form leaves defaults out (running: true, pty: false)
    return {p["pid"]: {"running": True, "pty": False, **p} for p in r.json()["items"]}


def _click(cl: LocalCluster, sid: str) -> int:
    with httpx.Client(base_url=cl.url, timeout=30) as c:
        c.cookies.set("dsec_ui", cl.api_key, path="/ui")
        r = c.post(f"/ui/sandboxes/{sid}/terminal", data={"csrf": csrf_token(cl.api_key)},
                   headers={"origin": cl.url})
        assert r.status_code == 303, r.text
        return int(r.headers["location"].rsplit("/", 1)[1])


def _ended_within(c: httpx.Client, sid: str, pid: int, s: float) -> bool:
    deadline = time.monotonic() + s
    while time.monotonic() < deadline:
        if not _procs(c, sid)[pid]["running"]:
            return True
        time.sleep(0.1)
    return False


def test_a_click_reuses_the_shell_and_an_unviewed_shell_ends(cluster: LocalCluster) -> None:
    from websockets.sync.client import connect
    with httpx.Client(base_url=cluster.url, timeout=30,
                      headers={"authorization": f"Bearer {cluster.api_key}"}) as c:
        sid = c.post("/v1/sandboxes", json={"backend": "simulated"}).json()["id"]
        try:
            pid = _click(cluster, sid)
            assert _click(cluster, sid) == pid            # reused, not a second shell
            shells = [p for p in _procs(c, sid).values() if p["pty"] and p["running"]]
            assert [p["pid"] for p in shells] == [pid], shells
            assert shells[0]["tag"].startswith("dashboard:")
            # a viewer keeps it alive past the idle time; once it leaves, it ends
            ws_url = f"ws{cluster.url[4:]}/ui/sandboxes/{sid}/processes/{pid}/ws"
            hdrs = {"cookie": f"dsec_ui={cluster.api_key}", "origin": cluster.url}
            with connect(ws_url, additional_headers=hdrs, open_timeout=20):
                time.sleep(IDLE_S * 2)
                assert _procs(c, sid)[pid]["running"]
            assert _ended_within(c, sid, pid, IDLE_S + 10), (
                "the dashboard shell still runs after its last viewer left")
            assert _procs(c, sid)[pid].get("signal") == 9
            # a click nobody follows up with a terminal: ended too
            pid2 = _click(cluster, sid)
            assert pid2 != pid
            assert _ended_within(c, sid, pid2, IDLE_S + 10)
            # another process, viewed and left through the dashboard's socket: untouched
            r = c.post(f"/v1/sandboxes/{sid}/processes",
                       json={"argv": ["sleep", "3600"]})
            assert r.status_code == 201, r.text
            other = r.json()["pid"]
            ws_url = f"ws{cluster.url[4:]}/ui/sandboxes/{sid}/processes/{other}/ws"
            with connect(ws_url, additional_headers=hdrs, open_timeout=20):
                time.sleep(0.3)
            time.sleep(IDLE_S * 2)
            assert _procs(c, sid)[other]["running"]
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
