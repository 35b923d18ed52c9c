"""A hostile agent in a container sandbox on a router slot, probing IP/port egress.

Real sandboxes (native container backend, busybox + a static ``nettool``), a real router
netns with nftables, and the fake internet of tests/net/internet.py. The agent is root in
its sandbox with the container's default capabilities (CAP_NET_RAW among them); "refused"
means the internet's log shows nothing arrived, not only that the sandbox timed out.

Policies are the wire's (``NetworkPolicy``), compiled by net/compile.py and loaded
through net/attach.py, as on a node.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.testimage import build_busybox_root
from dsec.errors import BackendError, InvalidArgument
from dsec.ids import NodeId, SandboxId, new_sandbox_id
from dsec.net import netns
from dsec.net.attach import SandboxNetwork
from dsec.net.router import Router
from dsec.net.testinternet import (
    ALLOWED,
    CIDR_IN,
    CIDR_OUT,
    OTHER,
    SIBLING,
    TCP_ECHO_PORT,
    UDP_ECHO_PORT,
    Internet,
)
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import ExecRequest, SandboxSpec

from ..edge.container.conftest import _cleanup

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256)


def policy(*allow: str, deny: tuple[str, ...] = (), mode: str = "policy",
           **kw: object) -> SandboxSpec:
    net = NetworkPolicy(mode=mode, allow=allow, deny=deny).validate()  # type: ignore[arg-type]
    return msgspec.structs.replace(SPEC, network=net, **kw)


@pytest.fixture(scope="session")
def images_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("needs gcc (and glibc's static libc.a) to build nettool")
    d = tmp_path_factory.mktemp("netimages")
    base = build_busybox_root(str(d / "base"))
    r = subprocess.run([cc, "-static", "-O1", "-o", os.path.join(base, "bin", "nettool"),
                        os.path.join(HERE, "nettool.c")], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, f"nettool.c did not compile: {r.stderr[-2000:]}"
    yield str(d)


@dataclass
class Env:
    backend: ContainerBackend
    router: Router
    net: SandboxNetwork
    internet: Internet
    notices: list[tuple[str, str, str]] = field(default_factory=list)

    async def create(self, spec: SandboxSpec) -> SandboxId:
        sid = new_sandbox_id(NodeId("t1"))
        await self.backend.create(sid, spec)
        return sid

    async def sh(self, sid: str, cmd: str, timeout_s: float = 30) -> str:
        r = await self.backend.exec(sid, ExecRequest(shell=cmd, timeout_s=timeout_s))
        return (r.stdout + r.stderr).decode(errors="replace")

    async def tool(self, sid: str, *args: str) -> str:
        return (await self.sh(sid, "nettool " + " ".join(args))).strip()


@pytest.fixture
async def env(tmp_path: object, images_dir: str, router: Router,
              internet: Internet) -> AsyncIterator[Env]:
    net = SandboxNetwork(router)
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), network=net, limits_poll_s=0.2)
    e = Env(b, router, net, internet)
    b.watch(lambda sid, reason, detail: e.notices.append((sid, reason, detail)))
    try:
        yield e
    finally:
        await _cleanup(b)


def ok(reply: str, host: str, port: int) -> bool:
    return reply == f"OK ok {host}:{port}"


async def test_allowed_destination_only(env: Env) -> None:
    sid = await env.create(policy(f"{ALLOWED}:80/tcp", "203.0.113.16/30:80/tcp",
                                  f"{ALLOWED}:{UDP_ECHO_PORT}/udp"))
    assert ok(await env.tool(sid, "tcp", ALLOWED, "80", "hi"), ALLOWED, 80)
    assert ok(await env.tool(sid, "tcp", CIDR_IN, "80", "hi"), CIDR_IN, 80)
    for host, port in ((ALLOWED, 8080), (SIBLING, 80), (CIDR_OUT, 80), (OTHER, 443)):
        out = await env.tool(sid, "tcp", host, str(port), f"denied-{host}-{port}")
        assert out.startswith("ERR connect"), (host, port, out)
    await env.tool(sid, "udp", ALLOWED, str(UDP_ECHO_PORT), "udp-ok")
    await env.tool(sid, "udp", SIBLING, str(UDP_ECHO_PORT), "udp-denied")
    await env.tool(sid, "udp", ALLOWED, "9998", "udp-other-port")
    assert env.internet.wait_for(data=b"udp-ok")
    await asyncio.sleep(0.2)
    assert env.internet.arrived(data=b"denied-") == []
    assert env.internet.arrived(dst=SIBLING) == [] and env.internet.arrived(dst=CIDR_OUT) == []
    assert env.internet.arrived(data=b"udp-denied") == []
    # every packet seen by the internet came from the router's uplink (masquerade)
    assert {h.src for h in env.internet.arrived()} == {str(env.router.uplink.router_ip)}
    slot = env.net.slot(sid)
    assert slot is not None and env.router.counters()[slot.index] >= 5


async def test_root_cannot_change_its_address_routes_or_sysctls(env: Env) -> None:
    sid = await env.create(policy(f"{ALLOWED}:80/tcp"))
    slot = env.net.slot(sid)
    assert slot is not None
    out = await env.tool(sid, "setaddr", "10.213.0.99")
    assert out.startswith("ERR SIOCSIFADDR: Operation not permitted"), out
    out = await env.sh(sid, "ip addr add 10.213.0.99/31 dev eth0; ip route add 1.2.3.0/24 "
                       "via 10.213.0.0; ip link set eth0 down; echo done")
    assert out.count("Operation not permitted") == 3, out
    out = await env.tool(sid, "sysctl", "net/ipv6/conf/all/disable_ipv6", "0")
    assert out.startswith("ERR open"), out
    assert env.router.check(slot) == ""  # the netns is exactly as built
    assert ok(await env.tool(sid, "tcp", ALLOWED, "80", "hi"), ALLOWED, 80)


async def test_spoofed_source_raw_socket_and_icmp_never_arrive(env: Env) -> None:
    other = await env.create(policy(f"{SIBLING}:80/tcp"))
    sid = await env.create(policy(f"{ALLOWED}:{UDP_ECHO_PORT}/udp"))
    me, them = env.net.slot(sid), env.net.slot(other)
    assert me is not None and them is not None
    forged = (str(them.addr.sandbox_ip), "198.51.100.99", str(env.router.uplink.router_ip))
    for src in (*forged, str(me.addr.sandbox_ip)):
        out = await env.tool(sid, "spoof", src, ALLOWED, str(UDP_ECHO_PORT), f"spoof-{src}")
        assert out == "OK sent", out  # CAP_NET_RAW: the kernel lets it send
    assert env.internet.wait_for(data=f"spoof-{me.addr.sandbox_ip}".encode())  # control
    await asyncio.sleep(0.2)
    for src in forged:
        assert env.internet.arrived(data=f"spoof-{src}".encode()) == [], src
    assert (await env.tool(sid, "icmp", ALLOWED)).startswith("ERR recv")


async def test_never_reachable_node_router_metadata_other_sandboxes(env: Env) -> None:
    other = await env.create(policy(f"{SIBLING}:80/tcp"))
    sid = await env.create(policy(mode="open"))
    them = env.net.slot(other)
    assert them is not None
    assert ok(await env.tool(sid, "tcp", OTHER, "80", "hi"), OTHER, 80)  # open: public
    for host in (str(env.router.uplink.peer_ip), str(env.router.uplink.router_ip),
                 str(them.addr.sandbox_ip), str(them.addr.router_ip), "169.254.169.254",
                 "10.1.2.3", "192.168.1.1", str(env.router.pool.resolver)):
        out = await env.tool(sid, "tcp", host, "80", "x")
        assert out.startswith("ERR connect"), (host, out)


async def test_ipv6_is_off(env: Env) -> None:
    sid = await env.create(policy(mode="open"))
    out = await env.tool(sid, "tcp6", "2001:db8::1", "80")
    assert out.startswith("ERR"), out
    assert "1" == (await env.sh(sid, "cat /proc/sys/net/ipv6/conf/all/disable_ipv6")).strip()


async def test_update_cuts_a_live_connection(env: Env) -> None:
    sid = await env.create(policy(f"{ALLOWED}:{TCP_ECHO_PORT}/tcp", f"{CIDR_IN}:80/tcp"))
    # one connection, two lines 1.5 s apart; the policy changes in between
    cmd = (f"(echo before-update; sleep 1.5; echo after-update) | nc {ALLOWED} "
           f"{TCP_ECHO_PORT} > /tmp/out 2>&1; echo rc=$? >> /tmp/out")
    run = asyncio.ensure_future(env.sh(sid, cmd))
    for _ in range(500):  # the loop must keep running: the exec is a task on it
        if env.internet.arrived(data=b"before-update"):
            break
        await asyncio.sleep(0.01)
    assert env.internet.arrived(data=b"before-update")
    gen_before = env.net.slot(sid).generation  # type: ignore[union-attr]
    gen = env.net.update(sid, policy(f"{CIDR_IN}:80/tcp"))
    assert gen is not None and gen > gen_before
    await run
    await asyncio.sleep(0.3)
    assert env.internet.arrived(data=b"after-update") == []
    out = await env.sh(sid, "cat /tmp/out")
    assert "before-update" in out and "after-update" not in out, out
    # new connections follow the new policy too
    assert (await env.tool(sid, "tcp", ALLOWED, str(TCP_ECHO_PORT), "x")).startswith("ERR")
    assert ok(await env.tool(sid, "tcp", CIDR_IN, "80", "hi"), CIDR_IN, 80)
    # the same policy again is a no-op: no new generation, nothing cut
    assert env.net.update(sid, policy(f"{CIDR_IN}:80/tcp")) == gen


async def test_destroy_recycles_the_slot_clean(env: Env) -> None:
    sid = await env.create(policy(f"{ALLOWED}:80/tcp"))
    slot = env.net.slot(sid)
    assert slot is not None
    index = slot.index
    await env.backend.destroy(sid)
    assert env.net.slot(sid) is None
    assert env.router.table.state[index] == "free"
    listing = env.router.nft(f"list set inet dsec s{index}a4")
    assert "elements" not in listing
    # a later tenant on the same slot gets its own policy only
    while env.router.table._free and env.router.table._free[0] != index:
        env.router.take()
    sid2 = await env.create(policy(f"{SIBLING}:80/tcp"))
    assert env.net.slot(sid2).index == index  # type: ignore[union-attr]
    assert (await env.tool(sid2, "tcp", ALLOWED, "80", "t1-policy")).startswith("ERR")
    assert ok(await env.tool(sid2, "tcp", SIBLING, "80", "hi"), SIBLING, 80)
    assert env.internet.arrived(data=b"t1-policy") == []


async def test_loopback_sandboxes_take_no_slot(env: Env) -> None:
    free = env.router.table.count("free")
    sid = await env.create(SPEC)
    assert env.net.slot(sid) is None
    assert env.router.table.count("free") == free
    out = await env.sh(sid, "ls /sys/class/net")
    assert out.split() == ["lo"]


async def test_failed_policy_load_takes_no_slot_and_leaves_nothing(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    free, assigned = env.router.table.count("free"), env.router.table.count("assigned")

    def refused(*_a: object, **_k: object) -> int:  # the kernel's answer, e.g. ENOMEM
        raise BackendError("policy of slot 0: the kernel refused it: ENOMEM")
    monkeypatch.setattr(env.router, "load", refused)
    with pytest.raises(BackendError, match="kernel refused"):
        await env.create(policy(f"{ALLOWED}:80/tcp"))
    assert env.backend.sandbox_ids() == []
    assert env.router.table.count("assigned") == assigned
    assert env.router.table.count("free") >= free
    assert env.net.by_sandbox == {}


async def test_overlapping_entries_are_split_not_refused(env: Env) -> None:
    sid = await env.create(policy("203.0.113.0/24:80-90/tcp", f"{ALLOWED}:85-100/tcp",
                                  f"{CIDR_IN}:80/tcp"))
    assert ok(await env.tool(sid, "tcp", ALLOWED, "80", "hi"), ALLOWED, 80)
    assert ok(await env.tool(sid, "tcp", SIBLING, "80", "hi"), SIBLING, 80)
    assert (await env.tool(sid, "tcp", SIBLING, "443", "x")).startswith("ERR")


async def test_without_a_router_policies_are_refused_as_before(
        tmp_path: object, images_dir: str) -> None:
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "plain"),
                         images=DirectoryImages(images_dir))
    try:
        with pytest.raises(InvalidArgument, match="needs this node's network router"):
            await b.create(new_sandbox_id(NodeId("t1")), policy(f"{ALLOWED}:80/tcp"))
    finally:
        await _cleanup(b)


async def test_user_namespace_sandbox_on_a_slot(env: Env) -> None:
    sid = await env.create(policy(f"{ALLOWED}:80/tcp", user_namespace=True))
    assert ok(await env.tool(sid, "tcp", ALLOWED, "80", "hi"), ALLOWED, 80)
    assert (await env.tool(sid, "tcp", SIBLING, "80", "x")).startswith("ERR connect")
    # root of its own user namespace, but the netns belongs to the host's: no
    # CAP_NET_ADMIN over it (plan-14 E13: today's own-netns path would accept this)
    out = await env.tool(sid, "setaddr", "10.213.0.99")
    assert out.startswith("ERR SIOCSIFADDR: Operation not permitted"), out
    slot = env.net.slot(sid)
    assert slot is not None and env.router.check(slot) == ""


async def test_denied_packets_become_a_notice_per_sandbox(env: Env) -> None:
    quiet = await env.create(policy(f"{ALLOWED}:80/tcp"))
    sid = await env.create(policy(f"{ALLOWED}:80/tcp"))
    for port in ("80", "81"):
        await env.tool(sid, "tcp", SIBLING, port, "x")
    for _ in range(100):
        if any(r == "network_denied" for _s, r, _d in env.notices):
            break
        await asyncio.sleep(0.05)
    # one notice per interval (60 s): the second refusal is folded into the next one
    [(who, _r, detail)] = [n for n in env.notices if n[1] == "network_denied"]
    assert who == sid
    assert f"{SIBLING}:80/tcp" in detail and "dropped" in detail, detail
    # the next tenant of this slot starts from zero
    slot = env.net.slot(sid)
    assert slot is not None
    index = slot.index
    await env.backend.destroy(sid)
    while env.router.table._free and env.router.table._free[0] != index:
        env.router.take()
    sid2 = await env.create(policy(f"{ALLOWED}:80/tcp"))
    assert env.net.slot(sid2).index == index  # type: ignore[union-attr]
    assert env.net.denied.total(index, env.router.counters()) == 0
    await asyncio.sleep(0.5)
    assert [n for n in env.notices if n[0] in (sid2, quiet)] == []


async def test_the_pool_is_topped_up_off_the_create_path(env: Env) -> None:
    built = env.router.stats.built
    for _ in range(3):  # the router fixture keeps 2 free
        await env.create(policy(f"{ALLOWED}:80/tcp"))
    for _ in range(200):
        if env.router.table.count("free") >= env.router.table.pool_min:
            break
        await asyncio.sleep(0.05)
    assert env.router.table.count("free") >= env.router.table.pool_min
    assert env.router.stats.built > built


async def test_caps_are_in_the_kernel_and_leave_with_the_tenant(env: Env) -> None:
    """max_connections is the slot's ct count cap, rate_mbit a tbf on both veth ends
    (tests/net/test_caps.py shows them hold); a recycled slot's next tenant gets
    neither (the node's default flow cap, no shaping)."""
    spec = msgspec.structs.replace(SPEC, network=NetworkPolicy(
        mode="policy", allow=(f"{ALLOWED}:80/tcp",), max_connections=8,
        rate_mbit=10).validate())
    sid = await env.create(spec)
    slot = env.net.slot(sid)
    assert slot is not None
    index = slot.index
    assert "ct count over 8 " in env.router.nft(f"list chain inet dsec s{index}k")
    assert "tbf" in _qdiscs(env.router.fd, slot.addr.ifname)
    assert "tbf" in _qdiscs(slot.fd, "eth0")
    await env.backend.destroy(sid)
    while env.router.table._free and env.router.table._free[0] != index:
        env.router.take()
    b = await env.create(policy(f"{ALLOWED}:80/tcp"))
    got = env.net.slot(b)
    assert got is not None and got.index == index
    assert "ct count over 4096 " in env.router.nft(f"list chain inet dsec s{index}k")
    assert "tbf" not in _qdiscs(env.router.fd, got.addr.ifname)
    assert "tbf" not in _qdiscs(got.fd, "eth0")


def _qdiscs(fd: int, dev: str) -> str:
    out: list[str] = []

    def run() -> None:  # setns moves the calling thread: a thread of its own
        with netns.entered(fd):
            out.append(subprocess.run(["tc", "qdisc", "show", "dev", dev],
                                      capture_output=True, text=True, check=True).stdout)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]
