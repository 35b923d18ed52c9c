"""``dsec edge --net-uplink``: the whole path through the edge's Aether door.

A real ``dsec edge`` process with the container backend and a router whose uplink leads
into the fake internet of this test; sandboxes created, updated and probed through
EdgeClient (the door the apiserver uses). Inside, busybox only: ``nc`` and ``nslookup``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import pytest

from dsec.edge.client import EdgeClient
from dsec.errors import DsecError
from dsec.image import LayerStore, ensure_busybox_base
from dsec.net.testinternet import ALLOWED, ALLOWED6, DNS_UPSTREAM, SIBLING, Internet, links_in
from dsec.wire import ops
from dsec.wire.calls import NetworkUpdateOnNode, SandboxRef
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import SandboxSpec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


async def start_edge(root: str, internet: Internet, *, env: dict[str, str] | None = None,
                     wait: bool = True) -> tuple[subprocess.Popen[bytes], str]:
    """``dsec edge`` with the container backend and a router into ``internet``; returns
    the process and its socket (the layer store is made once under ``root``). ``env``:
    added to the edge's environment; ``wait=False``: return at once (an edge meant to
    die before it serves)."""
    store = LayerStore(os.path.join(root, "layers"))
    store.tag(ensure_busybox_base(store).digest, "base")
    sock = os.path.join(root, "edge.sock")
    proc = subprocess.Popen(  # noqa: ASYNC220
        [*DSEC, "edge", "--listen", f"unix:{sock}", "--state-dir", os.path.join(root, "state"),
         "--layer-store", os.path.join(root, "layers"), "--backend", "container",
         "--node-id", "netdoor", "--log-level", "warning", "--disk-pool", "1GiB",
         "--net-uplink", f"netns:/proc/{os.getpid()}/fd/{internet.fd}",
         "--net-dns-upstream", DNS_UPSTREAM, "--net-max", "open"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})})
    if not wait:
        return proc, sock
    for _ in range(600):
        assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
        if os.path.exists(sock):
            return proc, sock
        await asyncio.sleep(0.05)
    proc.kill()
    raise AssertionError("dsec edge did not start")


async def destroy_all(sock: str) -> None:
    """Best effort: destroy every sandbox of the edge at ``sock`` (a failed test must not
    leave sandboxes, cgroups or the disk pool mounted behind it)."""
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            for info in await c.list():
                with contextlib.suppress(DsecError):
                    await c.destroy(info.id)
    except DsecError:
        pass


async def shut(proc: subprocess.Popen[bytes], sock: str) -> None:
    """Destroy what the edge still holds, then stop it (a test's cleanup)."""
    await destroy_all(sock)
    stop_edge(proc)


def stop_edge(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def no_uplink_peers(internet: Internet) -> list[str]:
    """The router's uplink peers left in ``internet`` (waits up to 10 s for none)."""
    peers = [n for n in links_in(internet.fd) if n.startswith("dsu")]
    for _ in range(200):
        if not peers:
            break
        await asyncio.sleep(0.05)
        peers = [n for n in links_in(internet.fd) if n.startswith("dsu")]
    return peers


async def test_policies_hold_through_the_edge_door(tmp_path: object,
                                                   internet: Internet) -> None:
    proc, sock = await start_edge(str(tmp_path), internet)
    try:
        await _door(sock, internet)
    finally:
        await destroy_all(sock)
        stop_edge(proc)
    assert await no_uplink_peers(internet) == []  # the edge's router went with it


async def _door(sock: str, internet: Internet) -> None:
    async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
        spec = SandboxSpec(backend="container", memory_bytes=128 << 20, network=NetworkPolicy(
            mode="policy", allow=("allowed.test:80/tcp",)))
        info = await c.create(spec)
        r = await c.exec(info.id, "nslookup allowed.test; echo hi | nc -w 2 "
                         f"{ALLOWED} 80; echo hi | nc -w 2 {SIBLING} 80; echo rc=$?")
        out = r.stdout.decode()
        assert f"Address: {ALLOWED}" in out and f"ok {ALLOWED}:80" in out, out
        assert f"ok {SIBLING}" not in out
        # --net-ipv6 auto, and the fake internet has IPv6: the sandbox has it too (the
        # name's AAAA answered, its address pinned)
        assert (await c.call(ops.NETWORK_GET, SandboxRef(id=info.id))).ipv6 is True
        assert f"Address: {ALLOWED6}" in out, out
        # live update through the door: the sibling by CIDR, the name gone
        view = await c.network_update(NetworkUpdateOnNode(
            id=info.id, policy=NetworkPolicy(mode="policy", allow=(f"{SIBLING}:80/tcp",))))
        assert view.generation == 2
        r = await c.exec(info.id, f"echo hi | nc -w 2 {SIBLING} 80; "
                         f"echo hi | nc -w 2 {ALLOWED} 80; nslookup allowed.test; echo end")
        out = r.stdout.decode() + r.stderr.decode()
        assert f"ok {SIBLING}:80" in out and f"ok {ALLOWED}" not in out, out
        assert f"Address: {ALLOWED}" not in out
        # a sandbox without a policy has no slot: lo only
        plain = await c.create(SandboxSpec(backend="container", memory_bytes=128 << 20))
        r = await c.exec(plain.id, "ls /sys/class/net")
        assert r.stdout.decode().split() == ["lo"]
        await c.destroy(info.id)
        await c.destroy(plain.id)
    # A and AAAA of the one allowed name, nothing else
    assert set(internet.dns_queries) == {"allowed.test."}
