"""The production ``host`` uplink (net/uplink.py ``HostUplink``), run for real inside a
network namespace that plays the host (net/testhost.py): never the real host's
interfaces, routes, sysctls or tables.

Cases (plan-14 §4.5, §11.2): a sandbox reaches the test internet through the host-mode
uplink, masqueraded to the host's egress address; every address of the fake host and its
decoy listeners (apiserver/edge/sshd ports on 0.0.0.0) stay unreachable, from a sandbox
with policy ``open`` and from the router itself (so the host table, not the router's
never-set, is what holds); teardown leaves no table, link or sysctl change; a drop-policy
forward chain (Docker-style) is refused with the rules to add, and those rules work.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.errors import BackendError
from dsec.ids import NodeId, new_sandbox_id
from dsec.net import netns
from dsec.net.attach import SandboxNetwork
from dsec.net.kernel import Nft
from dsec.net.router import Router, RouterConfig
from dsec.net.testhost import DECOY_PORTS, EGRESS, EGRESS_IP, EXTRA_IP, FakeHost, fakehost
from dsec.net.testinternet import ALLOWED, Internet
from dsec.net.uplink import HostUplink, uplink_ifname
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import ExecRequest, SandboxSpec

from ..edge.container.conftest import _cleanup
from .conftest import host_tables
from .test_egress_hostile import images_dir  # noqa: F401  (the session's busybox+nettool)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


def state(h: FakeHost) -> tuple[str, list[str], dict[str, str]]:
    """What the host-mode code may change on a host: its ruleset, links, sysctls."""
    nft = Nft(h.fd)
    try:
        ruleset = nft("list ruleset")
    finally:
        nft.close()
    with netns.entered(h.fd):
        links = sorted(name for _i, name in socket.if_nameindex())
        sysctls = {}
        for dev in ("all", "default", EGRESS, "lo"):
            for key in ("forwarding", "rp_filter"):
                with open(f"/proc/sys/net/ipv4/conf/{dev}/{key}") as f:
                    sysctls[f"{dev}.{key}"] = f.read().strip()
        with open("/proc/sys/net/ipv4/ip_forward") as f:
            sysctls["ip_forward"] = f.read().strip()
    return ruleset, links, sysctls


@pytest.fixture
def host(internet: Internet) -> Iterator[FakeHost]:
    with fakehost(internet) as h:
        yield h


def host_router(h: FakeHost, node: str = "t1", link: str = "169.254.213.0/30") -> Router:
    return Router.create(RouterConfig(pool_min=2, build_batch=2),
                         HostUplink(h.fd, node, egress=None, link=link))


def connect_from(fd: int, ip: str, port: int, data: bytes = b"", timeout: float = 0.4) -> str:
    """A TCP exchange from inside netns ``fd``: the reply, or ``ERR <why>``."""
    with netns.entered(fd):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((ip, port))
        if data:
            s.sendall(data)
        return s.recv(256).decode(errors="replace")
    except OSError as exc:
        return f"ERR {exc}"
    finally:
        s.close()


def test_teardown_leaves_nothing_and_egress_forwarding_restored(host: FakeHost,
                                                                 internet: Internet) -> None:
    before = state(host)
    real_before = host_tables()
    assert before[2][f"{EGRESS}.forwarding"] == "0"
    r = host_router(host)
    try:
        ruleset, links, sysctls = state(host)
        assert "table inet dsec_t1" in ruleset
        assert uplink_ifname("t1") in links
        assert sysctls[f"{EGRESS}.forwarding"] == "1"
        assert sysctls["all.forwarding"] == "0"  # per device, never all
        with netns.entered(host.fd), \
                open(f"/proc/sys/net/ipv4/conf/{uplink_ifname('t1')}/forwarding") as f:
            assert f.read().strip() == "1"
        # traffic from the router itself goes out, masqueraded to the host's egress address
        assert connect_from(r.fd, ALLOWED, 80, b"from-router") == f"ok {ALLOWED}:80\n"
        [hit] = internet.wait_for(dst=ALLOWED, port=80, data=b"from-router")
        assert hit.src == EGRESS_IP
    finally:
        r.close()
    assert state(host) == before
    assert host_tables() == real_before  # the real host's ruleset untouched


def test_two_uplinks_on_one_host_last_one_out_restores(host: FakeHost) -> None:
    before = state(host)
    r1 = host_router(host, "t1")
    try:
        with pytest.raises(BackendError, match=r"169.254.213.0/30 is in use .* --net-link"):
            host_router(host, "t2")  # the same /30 as t1's: replies would go astray
        assert "dsec_t2" not in state(host)[0]
        r2 = host_router(host, "t2", "169.254.213.4/30")
        try:
            assert state(host)[2][f"{EGRESS}.forwarding"] == "1"
        finally:
            r2.close()
        # t1 still routes: the sysctl stays, t2's table and link are gone
        ruleset, links, sysctls = state(host)
        assert sysctls[f"{EGRESS}.forwarding"] == "1"
        assert "dsec_t2" not in ruleset and uplink_ifname("t2") not in links
        assert connect_from(r1.fd, ALLOWED, 80, b"x").startswith("ok ")
    finally:
        r1.close()
    assert state(host) == before


def test_router_itself_never_reaches_a_host_address(host: FakeHost) -> None:
    """The host table's ``fib daddr type local`` drop, without the router's own rules in
    the way (the router's output is not filtered)."""
    addrs = host.addresses()
    assert {EGRESS_IP, EXTRA_IP, "127.0.0.1"} <= set(addrs)
    r = host_router(host)
    try:
        for ip in addrs:
            for port in DECOY_PORTS:
                out = connect_from(r.fd, ip, port, timeout=0.3)
                assert out.startswith("ERR"), (ip, port, out)
        assert host.decoy_hits() == []
        nft = Nft(host.fd)
        try:
            pre = nft("list chain inet dsec_t1 pre")
        finally:
            nft.close()
        assert "counter packets 0 " not in pre  # the drops were counted there
    finally:
        r.close()


def test_docker_style_forward_drop_refused_with_the_rule_to_add(host: FakeHost,
                                                                internet: Internet) -> None:
    nft = Nft(host.fd)
    try:
        nft("add table ip filter\n"
            "add chain ip filter FORWARD { type filter hook forward priority 0; policy drop; }\n")
        before = state(host)
        with pytest.raises(BackendError) as ei:
            host_router(host)
        msg = str(ei.value)
        up = uplink_ifname("t1")
        assert "policy drop (ip filter FORWARD)" in msg
        fix = [line.strip().removeprefix("nft ") for line in msg.splitlines()
               if line.strip().startswith("nft insert rule")]
        assert fix == [f'insert rule ip filter FORWARD iifname "{up}" accept',
                       (f'insert rule ip filter FORWARD oifname "{up}" ct state '
                        "established,related accept")]
        assert state(host) == before  # refused before anything was made
        for line in fix:  # the operator does what the message says ...
            nft(line)
        r = host_router(host)  # ... and the uplink works through that chain
        try:
            assert connect_from(r.fd, ALLOWED, 80, b"via-docker") == f"ok {ALLOWED}:80\n"
        finally:
            r.close()
        nft("delete table ip filter")
    finally:
        nft.close()


SPEC = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256,
                   network=NetworkPolicy(mode="open"))


@pytest.fixture
async def sandbox_env(tmp_path: object, images_dir: str,  # noqa: F811
                      host: FakeHost) -> AsyncIterator[tuple[ContainerBackend, Router]]:
    r = host_router(host)
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), network=SandboxNetwork(r),
                         limits_poll_s=0.2)
    try:
        yield b, r
    finally:
        await _cleanup(b)
        r.close()


async def test_sandbox_reaches_internet_never_the_host(
        sandbox_env: tuple[ContainerBackend, Router], host: FakeHost,
        internet: Internet) -> None:
    b, _r = sandbox_env
    sid = new_sandbox_id(NodeId("t1"))
    await b.create(sid, msgspec.structs.replace(SPEC))

    async def tool(*args: str) -> str:
        res = await b.exec(sid, ExecRequest(shell="nettool " + " ".join(args), timeout_s=30))
        return (res.stdout + res.stderr).decode(errors="replace").strip()

    assert await tool("tcp", ALLOWED, "80", "sb-hello") == f"OK ok {ALLOWED}:80"
    [hit] = internet.wait_for(dst=ALLOWED, port=80, data=b"sb-hello")
    assert hit.src == EGRESS_IP  # masqueraded by the host table
    addrs = host.addresses()
    for ip in addrs:
        for port in DECOY_PORTS:
            out = await tool("tcp", ip, str(port), "x")
            assert out.startswith("ERR"), (ip, port, out)
    assert host.decoy_hits() == []
    # and policy "open" does reach a public address that is not the host's
    assert (await tool("tcp", ALLOWED, "8080", "y")).startswith("OK ")


def test_real_host_untouched_by_the_suite() -> None:
    """No dsec_ host table on the real host (tests run host mode in a fake host only)."""
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                         check=True).stdout
    assert "dsec_t1" not in out and "dsec_t2" not in out


async def test_dsec_edge_net_uplink_host(tmp_path: object, host: FakeHost,
                                         internet: Internet) -> None:
    """``dsec edge --net-uplink host`` run in the fake host's netns (its "own" netns, as in
    production): says what it changes, routes a sandbox's policy, undoes it all on exit."""
    import asyncio
    import sys

    from dsec.edge.client import EdgeClient
    from dsec.image import LayerStore, ensure_busybox_base
    from dsec.net.testinternet import DNS_UPSTREAM

    from .test_edge_door import destroy_all, stop_edge

    before = state(host)
    root = str(tmp_path)
    store = LayerStore(os.path.join(root, "layers"))
    store.tag(ensure_busybox_base(store).digest, "base")
    sock = os.path.join(root, "edge.sock")
    hostfd = host.fd
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", "from dsec.cli.main import main; main()", "edge",
         "--listen", f"unix:{sock}", "--state-dir", os.path.join(root, "state"),
         "--layer-store", os.path.join(root, "layers"), "--backend", "container",
         "--node-id", "hostup", "--log-level", "warning", "--disk-pool", "1GiB",
         "--net-uplink", "host", "--net-dns-upstream", DNS_UPSTREAM, "--net-max", "open"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(hostfd,),
        preexec_fn=lambda: netns.setns_net(hostfd))  # noqa: PLW1509 - single-threaded child
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            if os.path.exists(sock):
                break
            await asyncio.sleep(0.05)
        ruleset, links, _ = state(host)
        assert "table inet dsec_hostup" in ruleset and uplink_ifname("hostup") in links
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            info = await c.create(SandboxSpec(
                backend="container", memory_bytes=128 << 20, network=NetworkPolicy(
                    mode="policy", allow=("allowed.test:80/tcp",))))
            r = await c.exec(info.id, f"echo hi | nc -w 2 allowed.test 80; "
                             f"echo hi | nc -w 2 {EGRESS_IP} 22; echo end")
            out = r.stdout.decode()
            assert f"ok {ALLOWED}:80" in out, out
            await c.destroy(info.id)
        [hit] = internet.wait_for(dst=ALLOWED, port=80, data=b"hi")
        assert hit.src == EGRESS_IP
    finally:
        await destroy_all(sock)
        stop_edge(proc)
    err = proc.stderr.read().decode()  # type: ignore[union-attr]
    assert "nft table inet dsec_hostup" in err and f"{EGRESS}}}.forwarding=1" in err, err
    assert proc.returncode == 0, err
    assert host.decoy_hits() == []
    assert state(host) == before  # a clean exit undid every host change


def test_restart_after_a_crash_reconciles_and_restores(host: FakeHost) -> None:
    """A crashed edge leaves its host table and the egress sysctl; the next start of the
    same node replaces the table, learns the original value from it, and its clean exit
    puts the host back as it was before the first run."""
    before = state(host)
    r = host_router(host)

    class Crashed:  # the process died: nothing of the host's undone
        def detach(self) -> None:
            pass

    r.uplink = Crashed()  # type: ignore[assignment]
    r.close()
    ruleset, _links, sysctls = state(host)
    assert "table inet dsec_t1" in ruleset and sysctls[f"{EGRESS}.forwarding"] == "1"
    # a later process of the node that never attached can still undo it (the host holds
    # the record) ...
    HostUplink(host.fd, "t1").detach()
    assert state(host)[0] == before[0] and state(host)[2] == before[2]
    r = host_router(host)
    r.uplink = Crashed()  # type: ignore[assignment]
    r.close()
    r2 = host_router(host)  # ... and a new start replaces the crashed run's table  # forwarding is 1 now, but the stale table says it was 0
    try:
        assert state(host)[0].count("table inet dsec_t1") == 1
        assert connect_from(r2.fd, ALLOWED, 80, b"again").startswith("ok ")
    finally:
        r2.close()
    assert state(host) == before


def test_bad_egress_refused_and_nothing_made(host: FakeHost) -> None:
    before = state(host)
    for bad in ('eth0" accept', "nosuchdev0"):
        with pytest.raises(BackendError, match="egress device"):
            Router.create(RouterConfig(pool_min=2, build_batch=2),
                          HostUplink(host.fd, "t1", egress=bad))
        assert state(host) == before


async def test_edge_restart_keeps_the_host_uplink_for_live_sandboxes(
        tmp_path: object, host: FakeHost, internet: Internet) -> None:
    """A stop with a live sandbox keeps the pinned router and the host's objects; the
    next edge's reconcile checks the host again and puts them back (here: a sysctl reset
    meanwhile); the last stop with no sandbox removes everything."""
    import asyncio
    import sys

    from dsec.edge.client import EdgeClient
    from dsec.image import LayerStore, ensure_busybox_base
    from dsec.net.testinternet import DNS_UPSTREAM

    from .test_edge_door import destroy_all, stop_edge

    before = state(host)
    root = str(tmp_path)
    store = LayerStore(os.path.join(root, "layers"))
    store.tag(ensure_busybox_base(store).digest, "base")
    sock = os.path.join(root, "edge.sock")
    hostfd = host.fd

    async def start() -> subprocess.Popen[bytes]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)
        proc = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-c", "from dsec.cli.main import main; main()", "edge",
             "--listen", f"unix:{sock}", "--state-dir", os.path.join(root, "state"),
             "--layer-store", os.path.join(root, "layers"), "--backend", "container",
             "--node-id", "hostup", "--log-level", "warning", "--disk-pool", "1GiB",
             "--net-uplink", "host", "--net-dns-upstream", DNS_UPSTREAM],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(hostfd,),
            preexec_fn=lambda: netns.setns_net(hostfd))  # noqa: PLW1509
        for _ in range(600):
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            if os.path.exists(sock):
                return proc
            await asyncio.sleep(0.05)
        raise AssertionError("dsec edge did not start")

    spec = SandboxSpec(backend="container", memory_bytes=128 << 20, network=NetworkPolicy(
        mode="policy", allow=("allowed.test:80/tcp",)))
    proc = await start()
    try:
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            sid = (await c.create(spec)).id
        stop_edge(proc)
        assert proc.returncode == 0
        ruleset, links, sysctls = state(host)  # kept for the live sandbox
        assert "table inet dsec_hostup" in ruleset and uplink_ifname("hostup") in links
        assert sysctls[f"{EGRESS}.forwarding"] == "1"
        netns.write_sysctl(host.fd, f"net/ipv4/conf/{EGRESS}/forwarding", "0")  # drift
        proc = await start()
        assert state(host)[2][f"{EGRESS}.forwarding"] == "1"  # put back by reconcile
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c:
            r = await c.exec(sid, "echo after | nc -w 2 allowed.test 80; echo end")
            assert f"ok {ALLOWED}:80" in r.stdout.decode(), r.stdout
            await c.destroy(sid)
    finally:
        await destroy_all(sock)
        stop_edge(proc)
    assert proc.returncode == 0
    assert state(host) == before
