"""Faults part ``overload``: idle-connection floods and slow senders against a real
``dsec up`` (issue 12).

The cluster under test runs as ``dsec up`` in a child process whose RLIMIT_NOFILE is
raised (only there) to :data:`SERVER_NOFILE`; this process is the load generator. Figures:

- ``faults_idle_conns_sandboxes_lost`` (count; target 0): sandboxes not running at the
  end of a flood of ``connections`` idle connection attempts (never a byte sent) spread
  over the gateway, the REST port and the edge's Unix socket, from 16 loopback source
  addresses (one address has ~28k ephemeral ports), while execs run in the sandboxes;
  beside it the exec failures, the refusals and the attempt rate.
- ``faults_slow_senders_rss_mb``: growth of the server's RSS while 1,000 authenticated
  gateway connections each announce a 16 MiB frame and send 1 MiB of it (bounded by the
  process's buffer budget, 256 MiB by default); ``faults_slow_senders_unauth_rss_mb`` the
  same from unauthenticated peers (cut at the frame header: 4 KiB limit before
  authentication); ``faults_slow_senders_rss_after_mb`` after they hang up, per round
  (CPython/glibc may keep freed memory mapped, so the trend over rounds is the figure
  to read, not one value).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from dsec.bench import BenchContext
from dsec.bench.faults import part

SERVER_NOFILE = 65536
SOURCES = [f"127.0.0.{i}" for i in range(2, 18)]
# As high as allowed: without CAP_SYS_RESOURCE the hard limit caps it (20,000 on the CI VM).
_UP = ("import resource, sys\n"
       "try:\n    resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n}))\n"
       "except (ValueError, OSError):\n    h = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
       "    resource.setrlimit(resource.RLIMIT_NOFILE, (h, h))\n"
       "from dsec.cli.main import main; sys.argv[0] = 'dsec'; main()")


@contextlib.contextmanager
def _dsec_up(backend: str) -> Iterator[dict[str, Any]]:
    """``dsec up`` in a child with RLIMIT_NOFILE raised there; yields local.json plus
    ``pid`` and ``edge_sock``."""
    state = tempfile.mkdtemp(prefix="dsec-bench-overload-")
    proc = subprocess.Popen(
        [sys.executable, "-c", _UP.format(n=SERVER_NOFILE), "up", "--state-dir", state,
         "--listen", "127.0.0.1:0", "--backend", backend, "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        local = os.path.join(state, "local.json")
        deadline = time.monotonic() + 120
        while not os.path.exists(local):
            if proc.poll() is not None:
                raise RuntimeError(f"dsec up exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
            if time.monotonic() > deadline:
                raise RuntimeError("dsec up did not start within 120 s")
            time.sleep(0.1)
        with open(local) as f:
            info = json.load(f)
        info["pid"] = proc.pid
        info["edge_sock"] = os.path.join(state, "edges", "edge-0.sock")
        # drain its stderr (refusal summaries) so a full pipe never blocks it
        threading.Thread(target=lambda: proc.stderr and proc.stderr.read(),
                         daemon=True).start()
        yield info
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        subprocess.run(["rm", "-rf", state], check=False)


def _nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    return 0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _backend() -> str:
    return "container" if os.geteuid() == 0 else "simulated"


def _own_nofile(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


# ------------------------------------------------------------------ idle flood
class _Flood:
    def __init__(self, up: dict[str, Any], attempts: int) -> None:
        gw_host, _, gw_port = up["gateway"].removeprefix("tcp:").rpartition(":")
        rest_host, _, rest_port = up["url"].removeprefix("http://").rpartition(":")
        self.targets: list[tuple[str, Any]] = [
            ("gateway", (gw_host, int(gw_port)))] * 7 + [
            ("rest", (rest_host, int(rest_port)))] * 2 + [("edge", up["edge_sock"])]
        self.attempts = attempts
        self.started = 0
        self.refused = 0
        self.connect_errors = 0
        self.parked: list[socket.socket] = []
        self.held_max = 0

    async def _one(self, i: int) -> None:
        loop = asyncio.get_running_loop()
        kind, addr = self.targets[i % len(self.targets)]
        if kind == "edge":
            s = socket.socket(socket.AF_UNIX)
        else:
            s = socket.socket()
            s.bind((SOURCES[i % len(SOURCES)], 0))
        s.setblocking(False)
        try:
            await loop.sock_connect(s, addr)
        except OSError:
            self.connect_errors += 1
            s.close()
            return
        try:
            async with asyncio.timeout(0.25):
                data = await loop.sock_recv(s, 4096)
        except TimeoutError:
            self.parked.append(s)   # admitted, waiting to authenticate: hold it idle
            self.held_max = max(self.held_max, len(self.parked))
            return
        except OSError:
            data = b""
        if data:
            self.refused += 1
        s.close()

    async def _worker(self) -> None:
        while self.started < self.attempts:
            i = self.started
            self.started += 1
            await self._one(i)

    async def _sweep(self, stop: asyncio.Event) -> None:
        """Close parked connections the server has cut (EOF or a GOAWAY/408 then EOF)."""
        while not stop.is_set():
            keep = []
            for s in self.parked:
                try:
                    if s.recv(65536) == b"":
                        s.close()
                        continue
                    keep.append(s)
                except BlockingIOError:
                    keep.append(s)
                except OSError:
                    s.close()
            self.parked = keep
            await asyncio.sleep(0.5)

    async def run(self, concurrency: int = 64) -> float:
        stop = asyncio.Event()
        sweeper = asyncio.create_task(self._sweep(stop))
        t0 = time.monotonic()
        await asyncio.gather(*(self._worker() for _ in range(concurrency)))
        took = time.monotonic() - t0
        stop.set()
        await sweeper
        return took

    def close(self) -> None:
        for s in self.parked:
            s.close()
        self.parked = []


def _exec_loop(up: dict[str, Any], ids: list[str], stop: threading.Event,
               out: dict[str, int]) -> None:
    import httpx

    h = {"authorization": f"Bearer {up['api_key']}"}
    with httpx.Client(base_url=up["url"], headers=h, timeout=30) as http:
        while not stop.is_set():
            for sid in ids:
                try:
                    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", "ok"]})
                    ok = r.status_code == 200 and r.json().get("stdout") == "ok\n"
                except httpx.HTTPError:
                    ok = False
                out["ok" if ok else "failed"] += 1
            stop.wait(0.5)


@part("overload_idle_conns")
def idle_conns(ctx: BenchContext) -> None:
    import httpx
    import uvloop

    attempts = ctx.scale(100_000, 10_000)
    backend = _backend()
    _own_nofile(20_000)
    with _dsec_up(backend) as up:
        h = {"authorization": f"Bearer {up['api_key']}"}
        with httpx.Client(base_url=up["url"], headers=h, timeout=60) as http:
            ids = []
            for _ in range(3):
                r = http.post("/v1/sandboxes", json={"project": "default", "backend": backend})
                r.raise_for_status()
                ids.append(r.json()["id"])
            stop = threading.Event()
            execs = {"ok": 0, "failed": 0}
            t = threading.Thread(target=_exec_loop, args=(up, ids, stop, execs), daemon=True)
            t.start()
            flood = _Flood(up, attempts)
            rss0 = _rss_mb(up["pid"])
            nofile = _nofile(up["pid"])
            try:
                took = uvloop.run(flood.run())
                rss_peak = _rss_mb(up["pid"])
                time.sleep(12.0)     # past the node TTL (10 s) and the auth deadline
            finally:
                flood.close()
                stop.set()
                t.join(60)
            lost = 0
            for sid in ids:
                info = http.get(f"/v1/sandboxes/{sid}").json()
                events = http.get(f"/v1/sandboxes/{sid}/events").json().get("items", [])
                if info.get("state") != "running" or any(
                        e.get("reason") == "node_lost" for e in events):
                    lost += 1
            nodes = http.get("/v1/nodes").json()["items"]
    ctx.record("faults_idle_conns_sandboxes_lost", lost, "count", connections=attempts,
               sandboxes=len(ids), backend=backend, server_nofile=nofile,
               sources=len(SOURCES),
               node_status=",".join(n.get("status", "healthy") for n in nodes))
    ctx.record("faults_idle_conns_exec_failures", execs["failed"], "count",
               execs=execs["ok"] + execs["failed"], connections=attempts)
    ctx.record("faults_idle_conns_refused", flood.refused, "count", connections=attempts,
               held_max=flood.held_max, connect_errors=flood.connect_errors)
    ctx.record("faults_idle_conns_attempts_per_s", attempts / took, "1/s",
               connections=attempts)
    ctx.record("faults_idle_conns_server_rss_growth_mb", rss_peak - rss0, "MB",
               connections=attempts)
    ctx.note(f"idle flood: {attempts} attempts in {took:.1f}s against gateway/REST/edge "
             f"socket; {flood.refused} refused at once, at most {flood.held_max} held "
             "waiting to authenticate (cut at 10 s); "
             f"{execs['failed']} of {execs['ok'] + execs['failed']} execs failed.")


# ------------------------------------------------------------------ slow senders
def _auth_frame(key: str) -> bytes:
    from dsec.aether.connection import AUTH_METHOD
    from dsec.aether.frame import FrameType, encode_parts
    from dsec.aether.messages import encode_request

    payload = encode_request(AUTH_METHOD, msgspec.msgpack.encode(key.encode()))
    return encode_parts(FrameType.REQUEST, 1, payload) + payload


def _big_frame_start(sent: int) -> bytes:
    from dsec.aether.frame import FrameType, encode_parts

    head = encode_parts(FrameType.REQUEST, 3, b"\0" * (16 << 20))   # announces 16 MiB
    return head + b"\0" * sent


async def _slow_senders(up: dict[str, Any], n: int, *, authed: bool,
                        hold: list[socket.socket]) -> None:
    loop = asyncio.get_running_loop()
    host, _, port = up["gateway"].removeprefix("tcp:").rpartition(":")
    chunk = _big_frame_start(1 << 20)
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with sem:
            s = socket.socket()
            s.bind((SOURCES[i % len(SOURCES)], 0))
            s.setblocking(False)
            try:
                await loop.sock_connect(s, (host, int(port)))
                if authed:
                    await loop.sock_sendall(s, _auth_frame(up["api_key"]))
                    async with asyncio.timeout(10):
                        await loop.sock_recv(s, 4096)
                async with asyncio.timeout(10):
                    await loop.sock_sendall(s, chunk)
            except (OSError, TimeoutError):
                pass    # refused or cut: what the server does not hold
            hold.append(s)

    await asyncio.gather(*(one(i) for i in range(n)))


@part("overload_slow_senders")
def slow_senders(ctx: BenchContext) -> None:
    import uvloop

    n = 1000
    rounds = ctx.scale(3, 2)
    _own_nofile(20_000)
    with _dsec_up("simulated") as up:
        pid = up["pid"]
        time.sleep(1.0)
        base = _rss_mb(pid)
        hold: list[socket.socket] = []
        uvloop.run(_slow_senders(up, n, authed=False, hold=hold))
        time.sleep(0.5)
        unauth = _rss_mb(pid) - base
        for s in hold:
            s.close()
        ctx.record("faults_slow_senders_unauth_rss_mb", unauth, "MB", senders=n,
                   announced_mb=16, sent_mb=1, authenticated=False)
        for r in range(rounds):
            hold = []
            before = _rss_mb(pid)
            uvloop.run(_slow_senders(up, n, authed=True, hold=hold))
            time.sleep(0.5)
            held = _rss_mb(pid)
            for s in hold:
                s.close()
            time.sleep(2.0)
            after = _rss_mb(pid)
            if r == 0:
                ctx.record("faults_slow_senders_rss_mb", held - base, "MB", senders=n,
                           announced_mb=16, sent_mb=1, authenticated=True,
                           budget_mb=256)
            ctx.record("faults_slow_senders_rss_after_mb", after - base, "MB", senders=n,
                       round=r + 1, held_mb=round(held - before, 1))
    ctx.note("slow senders: RSS of the dsec up process over its idle baseline; "
             "authenticated senders are bounded by the process buffer budget (256 MiB: "
             "the senders past it are refused with GOAWAY overloaded), unauthenticated "
             "ones are cut at the frame header. 'after' figures are per round: freed "
             "buffers may stay mapped by glibc, the trend over rounds shows no growth.")
