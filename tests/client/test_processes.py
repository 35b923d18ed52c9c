"""Processes and terminals end to end (issue 19): the SDK (sync and async, over the Aether
gateway and REST), the REST WebSocket, the CLI (``dsec sandbox shell`` in a real tmux,
stdin forwarded by ``dsec sandbox exec``), and the project rule at every door: another
project's key can neither list, read, type into nor signal a sandbox's processes.

One container cluster for the module (real sandboxes, real ptys)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsec.aether import connect
from dsec.client.core import AsyncClient
from dsec.cluster.local import LocalCluster
from dsec.errors import DsecError, InvalidTransition, SandboxNotFound
from dsec.wire.spec import ExecChunk, ExecResult

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="container") as cl:
        yield cl


@pytest.fixture(scope="module")
def sid(cluster: LocalCluster) -> str:
    with cluster.client(protocol="http", session_lease_s=None) as c:
        return c.sandboxes.create(backend="container", memory="256MiB", detached=True).id


@pytest.fixture(scope="module")
def stranger(cluster: LocalCluster) -> str:
    """A member key of another project."""
    return cluster.create_key(f"mallory-{uuid.uuid4().hex[:6]}", "other19", "member")


@pytest.mark.parametrize("protocol", ["aether", "http"])
def test_sync_sdk_processes(cluster: LocalCluster, sid: str, protocol: str) -> None:
    with cluster.client(protocol=protocol, session_lease_s=None) as c:
        sb = c.sandboxes.get(sid)
        # exec with streaming callbacks, as E2B's commands.run(on_stdout=...)
        seen: list[bytes] = []
        r = sb.exec("for i in 1 2 3; do echo line$i; done; echo oops >&2; exit 4",
                    on_stdout=seen.append, on_stderr=seen.append)
        assert r.exit_code == 4 and r.stdout == b"line1\nline2\nline3\n"
        assert r.stderr == b"oops\n" and b"".join(seen).count(b"line") == 3
        # background exec: a handle (pid kept), its output read after the fact
        h = sb.exec("echo started; sleep 0.3; echo done", background=True)
        assert h.pid > 1
        res = h.wait(timeout=30)
        assert res.exit_code == 0 and res.stdout == b"started\ndone\n" and h.exit_code == 0
        # start with stdin open; another client connects by pid and reads + writes
        p = sb.processes.start(["cat"], stdin=True, tag=f"cat-{protocol}")
        p.send_stdin(b"from-first\n")
    with cluster.client(protocol=protocol, session_lease_s=None) as c2:
        sb2 = c2.sandboxes.get(sid)
        assert any(i.pid == p.pid and i.tag == f"cat-{protocol}" and i.running
                   for i in sb2.processes.list())
        got: list[bytes] = []
        q = sb2.processes.connect(p.pid, on_stdout=got.append)
        q.send_stdin("from-second\n")
        q.close_stdin()
        res = q.wait(timeout=30)
        assert res.exit_code == 0 and res.stdout == b"from-first\nfrom-second\n"
        assert b"".join(got) == res.stdout
        # kill(): the signal and its exit code
        k = sb2.processes.start("sleep 100")
        k.kill(signal.SIGTERM)
        assert k.wait(timeout=30).exit_code == 128 + signal.SIGTERM
        # iteration
        it = sb2.processes.start("printf 'a\\nb\\n'")
        assert b"".join(ch.data for ch in it) == b"a\nb\n"


@pytest.mark.parametrize("protocol", ["aether", "http"])
async def test_process_run_disconnect_keeps_the_process(cluster: LocalCluster, sid: str,
                                                        protocol: str) -> None:
    """process_run (issue 20) through the gateway and REST: the entry first, the output
    as it comes; the reader leaving mid-stream ends the reader only, and another client
    connects by the entry's pid, types into it and reads everything it printed."""
    from dsec.wire import ops
    from dsec.wire.calls import ExecCall
    from dsec.wire.process import ProcessRunItem
    from dsec.wire.spec import ExecRequest

    req = ExecRequest(argv=("sh", "-c", "echo ready; read x; echo got-$x"),
                      stdin_open=True, tag=f"run-{protocol}")
    async with AsyncClient(cluster.url, cluster.api_key, protocol=protocol,
                           gateway=cluster.gateway, session_lease_s=None) as c:
        t = await c._transport()
        stream = t.stream(ops.PROCESS_RUN, ExecCall(id=sid, req=req), timeout=None)
        first = await anext(stream)
        assert isinstance(first, ProcessRunItem) and first.started is not None
        pid = first.started.pid
        assert pid > 1 and first.started.tag == f"run-{protocol}" and first.started.running
        out = b""
        while b"ready\n" not in out:
            item = await asyncio.wait_for(anext(stream), 30)
            assert isinstance(item, ProcessRunItem) and item.started is None, item
            out += item.data
        await stream.aclose()                 # the client goes away mid-stream
    async with AsyncClient(cluster.url, cluster.api_key, protocol=protocol,
                           gateway=cluster.gateway, session_lease_s=None) as c2:
        sb = await c2.sandboxes.get(sid)
        info = next(p for p in await sb.processes.list() if p.pid == pid)
        assert info.running, info                      # it outlived its first reader
        q = await sb.processes.connect(pid)
        await q.send_stdin(b"yo\n")
        res = await q.wait(timeout=30)
        assert res.exit_code == 0 and res.stdout == b"ready\ngot-yo\n", res


@pytest.mark.parametrize("protocol", ["aether", "http"])
def test_sdk_start_followed_is_one_call(cluster: LocalCluster, sid: str, protocol: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """processes.start / exec(background=True) with a callback follow the process from its
    start on the stream that started it (process_run): no process_connect, every byte
    seen once; without one, a plain process_start."""
    calls = {"run": 0, "connect": 0, "start": 0}
    for node in cluster.runtime.nodes:
        for name in calls:
            real = getattr(node.processes, name)

            def wrap(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                calls[_name] += 1
                return _real(*a, **kw)
            monkeypatch.setattr(node.processes, name, wrap)
    with cluster.client(protocol=protocol, session_lease_s=None) as c:
        sb = c.sandboxes.get(sid)
        seen: list[bytes] = []
        h = sb.processes.start("echo a; sleep 0.2; echo b >&2; echo c", on_stdout=seen.append,
                               on_stderr=seen.append)
        res = h.wait(timeout=30)
        assert (res.exit_code, res.stdout, res.stderr) == (0, b"a\nc\n", b"b\n")
        assert sorted(b"".join(seen).splitlines()) == [b"a", b"b", b"c"]
        assert calls == {"run": 1, "connect": 0, "start": 1}, calls
        bg = sb.exec("echo bg", background=True, on_stdout=seen.append)
        assert bg.wait(timeout=30).stdout == b"bg\n" and seen[-1] == b"bg\n"
        plain = sb.processes.start("echo plain")
        assert plain.wait(timeout=30).stdout == b"plain\n"
        assert calls == {"run": 2, "connect": 1, "start": 3}, calls


def test_process_run_is_refused_as_process_start(cluster: LocalCluster,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A full table refuses a run as it refuses a start, at every door: REST answers the
    start's 429 (not a 200 with an error line), the gateway and the SDK raise it."""
    import dataclasses

    from dsec.errors import RateLimited
    from dsec.wire import ops
    from dsec.wire.calls import ExecCall
    from dsec.wire.spec import ExecRequest

    for node in cluster.runtime.nodes:
        monkeypatch.setattr(node.processes, "limits",
                            dataclasses.replace(node.processes.limits, per_sandbox=1))
    with cluster.client(protocol="aether", session_lease_s=None) as c:
        sb = c.sandboxes.create(backend="container", memory="128MiB", detached=True)
        try:
            held = sb.processes.start("sleep 60")
            r = httpx.post(f"{cluster.url}/v1/sandboxes/{sb.id}/processes/run",
                           json={"shell": "echo no"}, timeout=30,
                           headers={"authorization": f"Bearer {cluster.api_key}"})
            assert r.status_code == 429 and r.json()["code"] == "rate_limited", r.text
            assert "per-sandbox limit" in r.json()["message"]
            with pytest.raises(RateLimited, match="per-sandbox limit"):
                sb.processes.start("echo no", on_stdout=print)

            async def gateway() -> None:
                t = await c._a._transport()
                async for _ in t.stream(ops.PROCESS_RUN, ExecCall(
                        id=sb.id, req=ExecRequest(shell="echo no")), timeout=30):
                    pass
            with pytest.raises(RateLimited, match="per-sandbox limit"):
                c._run(gateway())
            assert [p.pid for p in sb.processes.list()] == [held.pid]
            held.kill()
        finally:
            sb.kill()


async def test_async_sdk_pty(cluster: LocalCluster, sid: str) -> None:
    async with AsyncClient(cluster.url, cluster.api_key, session_lease_s=None) as c:
        sb = await c.sandboxes.get(sid)
        out = bytearray()
        term = await sb.pty.create(cols=90, rows=20, on_data=out.extend)
        await term.send_stdin(b"stty size; echo m-$((40+2))\n")
        for _ in range(400):
            if b"m-42" in out:
                break
            await asyncio.sleep(0.025)
        assert b"20 90" in out, out
        await term.resize(120, 33)
        await term.send_stdin(b"stty size; echo m-$((3+4))\n")
        for _ in range(400):
            if b"m-7" in out:
                break
            await asyncio.sleep(0.025)
        assert b"33 120" in out, out
        await term.send_stdin(b"exit 9\n")
        res = await term.wait(timeout=30)
        assert res.exit_code == 9 and term.exit_code == 9
        # a handle's iteration: the ring, then its end
        h = await sb.processes.start(["sh", "-c", "echo x; echo y >&2"])
        items = [i async for i in h.stream()]
        assert isinstance(items[-1], ExecResult) and items[-1].exit_code == 0
        assert {(i.stream, i.data) for i in items[:-1] if isinstance(i, ExecChunk)} == {
            ("stdout", b"x\n"), ("stderr", b"y\n")}


def test_websocket_attach(cluster: LocalCluster, sid: str) -> None:
    from websockets.sync.client import connect as ws_connect

    with cluster.client(protocol="http", session_lease_s=None) as c:
        p = c.sandboxes.get(sid).pty.create(cols=80, rows=24)
    base = cluster.url.replace("http://", "ws://")
    url = f"{base}/v1/sandboxes/{sid}/processes/{p.pid}/ws?token={cluster.api_key}"
    with ws_connect(url) as ws:
        ws.send(json.dumps({"resize": [101, 31]}))
        ws.send(b"stty size; echo w-$((5*5))\n")
        buf = b""
        deadline = time.monotonic() + 30
        while b"w-25" not in buf and time.monotonic() < deadline:
            m = ws.recv(timeout=30)
            if isinstance(m, bytes):
                buf += m
        assert b"31 101" in buf, buf
        ws.send(json.dumps({"bogus": 1}))           # a bad control: an error, still open
        ws.send(b"exit 3\n")
        texts = []
        while True:
            m = ws.recv(timeout=30)
            if isinstance(m, str):
                texts.append(json.loads(m))
                if "exit_code" in texts[-1]:
                    break
        assert any("error" in t for t in texts)
        assert texts[-1]["exit_code"] == 3


def test_another_project_cannot_touch_the_processes(cluster: LocalCluster, sid: str,
                                                    stranger: str) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect as ws_connect

    with cluster.client(protocol="http", session_lease_s=None) as c:
        p = c.sandboxes.get(sid).processes.start(["cat"], stdin=True)
    h = {"authorization": f"Bearer {stranger}"}
    base = f"{cluster.url}/v1/sandboxes/{sid}/processes"
    # REST: every process route is the same 404 as an unknown sandbox
    for method, path, kw in [("GET", "", {}), ("GET", f"/{p.pid}/output", {}),
                             ("POST", f"/{p.pid}/stdin", {"content": b"evil"}),
                             ("DELETE", f"/{p.pid}/stdin", {}),
                             ("POST", f"/{p.pid}/signal", {"json": {"signal": 9}}),
                             ("POST", f"/{p.pid}/resize", {"json": {"cols": 1, "rows": 1}}),
                             ("POST", "", {"json": {"shell": "id"}}),
                             ("POST", "/run", {"json": {"shell": "id"}})]:
        r = httpx.request(method, base + path, headers=h, timeout=30, **kw)
        assert r.status_code == 404 and r.json()["code"] == "sandbox_not_found", (path, r.text)
    # the Aether gateway, raw
    async def gateway() -> list[str]:
        assert cluster.gateway is not None
        conn = await connect(cluster.gateway, token=stranger)
        codes = []
        try:
            for method, body in [("api.process_list", {"id": sid}),
                                 ("api.process_input", {"id": sid, "pid": p.pid,
                                                        "data": b"evil"}),
                                 ("api.process_signal", {"id": sid, "pid": p.pid,
                                                         "signal": 9})]:
                try:
                    await conn.call(method, body, timeout=30)
                    codes.append("ok")
                except DsecError as exc:
                    codes.append(exc.code)
            for method, body in [("api.process_connect", {"id": sid, "pid": p.pid}),
                                 ("api.process_run", {"id": sid, "req": {"shell": "id"}})]:
                s = conn.stream(method, body, timeout=30)
                try:
                    async with s:
                        async for _ in s:
                            pass
                    codes.append("ok")
                except DsecError as exc:
                    codes.append(exc.code)
        finally:
            await conn.close()
        return codes
    assert cluster._on_loop(gateway(), timeout=60) == ["sandbox_not_found"] * 5
    # the SDK says so too
    from dsec.client.sync import Client
    from dsec.wire import ops
    from dsec.wire.calls import SandboxRef
    with Client(cluster.url, stranger, gateway=cluster.gateway, protocol="aether",
                session_lease_s=None) as other, pytest.raises(SandboxNotFound):
        other.call(ops.PROCESS_LIST, SandboxRef(id=sid))
    # the WebSocket: refused before anything is read or written
    with ws_connect(f"{cluster.url.replace('http://', 'ws://')}/v1/sandboxes/{sid}/processes/"
                    f"{p.pid}/ws?token={stranger}") as ws:
        first = json.loads(ws.recv(timeout=30))
        assert first["error"]["code"] == "sandbox_not_found"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
    # nothing reached the process: it still runs, its output is empty
    with cluster.client(protocol="http", session_lease_s=None) as c:
        q = c.sandboxes.get(sid).processes.connect(p.pid)
        assert q.info.running
        q.close_stdin()
        assert q.wait(timeout=30).stdout == b""


def test_pause_freezes_processes_and_destroy_ends_them(cluster: LocalCluster) -> None:
    with cluster.client(protocol="aether", session_lease_s=None) as c:
        sb = c.sandboxes.create(backend="container", memory="256MiB", detached=True)
        h = sb.processes.start("i=0; while true; do i=$((i+1)); echo $i; sleep 0.05; done")
        time.sleep(0.5)
        sb.pause()
        n1 = _last(h)
        time.sleep(0.6)
        n2 = _last(h)
        assert n1 == n2 > 0                  # frozen: nothing printed while paused
        sb.resume()
        time.sleep(0.4)
        assert _last(h) > n2
        sb.kill()
        with pytest.raises(InvalidTransition, match="destroyed"):
            sb.processes.list()


def _last(h: Any) -> int:
    """The last number a counting process printed so far: a connect read up to its live
    edge (no output for 0.3 s, or 1 s in all), then dropped."""
    out = bytearray()

    async def read() -> None:
        agen = h._a.stream()
        deadline = time.monotonic() + 1.0
        try:
            while time.monotonic() < deadline:
                item = await asyncio.wait_for(agen.__anext__(), 0.3)
                if not isinstance(item, ExecChunk):
                    return
                out.extend(item.data)
        except TimeoutError:
            pass
        finally:
            await agen.aclose()
    h._c._run(read())
    return int(bytes(out).split()[-1])


def test_cli_exec_forwards_piped_stdin(cluster: LocalCluster, sid: str, tmp_path: Any) -> None:
    env = {**os.environ, "DSEC_URL": cluster.url, "DSEC_API_KEY": cluster.api_key}
    r = subprocess.run([*DSEC, "sandbox", "exec", sid, "cat"], input=b"data\n",
                       capture_output=True, env=env, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout == b"data\n", r.stderr
    big = os.urandom(3 << 20)
    src = tmp_path / "big"
    src.write_bytes(big)
    with open(src, "rb") as f:
        r = subprocess.run([*DSEC, "sandbox", "exec", sid, "--", "sh", "-c", "wc -c; exit 6"],
                           stdin=f, capture_output=True, env=env, timeout=120, check=False)
    assert r.returncode == 6 and r.stdout.strip() == str(len(big)).encode(), r.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (APT_PACKAGES)")
def test_cli_shell_in_tmux(cluster: LocalCluster, sid: str, tmp_path: Any) -> None:
    """A real terminal: keys typed in tmux reach the sandbox's shell, the pane shows its
    output, a resize of the window reaches ``stty size`` inside, Ctrl-C interrupts the
    sandbox's foreground process, and the command exits with the shell's code."""
    sock = str(tmp_path / "tmux.sock")
    name = f"dsec{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "DSEC_URL": cluster.url, "DSEC_API_KEY": cluster.api_key,
           "TERM": "xterm"}
    result = tmp_path / "exit"
    cmd = (f"{' '.join(DSEC[:2])} '{DSEC[2]}' sandbox shell {sid}; "
           f"echo $? > {result}; sleep 60")
    tm = ["tmux", "-S", sock, "-f", "/dev/null"]

    def pane() -> str:
        return subprocess.run([*tm, "capture-pane", "-p", "-t", name], capture_output=True,
                              text=True, check=True).stdout

    def wait_for(text: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = pane()
            if text in p:
                return p
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never showed; pane:\n{pane()}")

    def keys(*k: str) -> None:
        subprocess.run([*tm, "send-keys", "-t", name, *k], check=True)

    subprocess.run([*tm, "new-session", "-d", "-s", name, "-x", "100", "-y", "30", cmd],
                   env=env, check=True)
    try:
        wait_for("#", timeout=60)                  # the sandbox's root prompt
        keys("echo in-$((20+3))", "Enter")
        wait_for("in-23")
        keys("stty size", "Enter")
        wait_for("30 100")
        subprocess.run([*tm, "resize-window", "-t", name, "-x", "120", "-y", "40"], check=True)
        time.sleep(0.5)
        keys("clear; stty size", "Enter")
        wait_for("40 120")
        keys("sleep 300", "Enter")
        time.sleep(0.5)
        keys("C-c")
        keys("echo rc-$?", "Enter")
        wait_for("rc-130")                         # SIGINT reached the sleep inside
        keys("exit 42", "Enter")
        deadline = time.monotonic() + 30
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert result.read_text().strip() == "42"
    finally:
        subprocess.run([*tm, "kill-server"], check=False, capture_output=True)
