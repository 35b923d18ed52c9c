"""Per-sandbox stats and OOM kills in exec results (issue 19), on real containers: CPU
usage over an interval, memory current/peak/limit, pids, disk used vs cap, network bytes
of the sandbox's own netns, and a real memory hog's OOM kill in that exec's result."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import time
from collections.abc import AsyncIterator

import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.edge.usage import CpuUsage, net_bytes, parse_net_dev
from dsec.wire.spec import ExecRequest, SandboxSpec

from .conftest import _cleanup

pytestmark = pytest.mark.root


@pytest.fixture
async def node(tmp_path: object, images_dir: str) -> AsyncIterator[EdgeNode]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    backend = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                               images=DirectoryImages(images_dir))
    cfg = NodeConfig(node_id="t1", capacity=Capacity(cpu_milli=64_000, memory_bytes=64 << 30,
                                                     max_sandboxes=64))
    n = EdgeNode(cfg, backend)
    await n.start()
    try:
        yield n
    finally:
        await n.close()
        await _cleanup(backend)


async def test_a_memory_hog_s_oom_kill_shows_in_its_exec_result(node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(backend="container", memory_bytes=64 << 20))
    r = await node.exec(info.id, ExecRequest(
        shell="head -c 500m /dev/zero | tail > /dev/null; echo survived", timeout_s=60))
    assert b"survived" in r.stdout and r.oom_killed is True
    ok = await node.exec(info.id, ExecRequest(shell="echo fine"))
    assert ok.stdout == b"fine\n" and ok.oom_killed is False
    # the stream's final result carries it too
    items = [x async for x in node.exec_stream(info.id, ExecRequest(
        shell="head -c 500m /dev/zero | tail > /dev/null", timeout_s=60))]
    assert getattr(items[-1], "oom_killed", None) is True
    st = await node.stats(info.id)
    assert st.oom_kills >= 2 and st.memory_limit_bytes == 64 << 20
    await node.destroy(info.id)


async def test_stats_cpu_usage_memory_pids_disk_network(node: EdgeNode) -> None:
    info = await node.create(SandboxSpec(backend="container", memory_bytes=128 << 20,
                                         pids_max=64, disk_bytes=64 << 20))
    idle = await node.stats(info.id)              # first call: a short sample of its own
    assert idle.cpu_percent is not None and idle.cpu_percent < 50
    assert idle.cpu_interval_s is not None and idle.cpu_interval_s >= 0.2
    await node.exec(info.id, ExecRequest(
        shell="(while :; do :; done) & head -c 20m /dev/urandom > /tmp/blob; "
              "dd if=/dev/zero of=/root/f bs=1M count=8 2>/dev/null; sync"))
    await node.stats(info.id)
    await asyncio.sleep(1.0)
    busy = await node.stats(info.id)              # over the second since the last call
    assert busy.cpu_interval_s is not None and 0.8 <= busy.cpu_interval_s < 5
    assert busy.cpu_percent is not None and busy.cpu_percent > 5   # a spinning loop
    assert busy.cpu_seconds > idle.cpu_seconds
    assert busy.memory_bytes >= 20 << 20                 # the tmpfs blob is memory
    assert busy.memory_peak_bytes >= busy.memory_bytes
    assert busy.memory_limit_bytes == 128 << 20 and busy.pids_max == 64
    assert busy.pids >= 2                                # init + the loop
    assert busy.disk_cap_bytes == 64 << 20 and busy.disk_bytes >= 8 << 20
    # its own network namespace (mode none: loopback only, which is not counted)
    assert (busy.net_rx_bytes, busy.net_tx_bytes) == (0, 0)
    await node.destroy(info.id)


def test_cpu_usage_is_over_the_interval_between_readings() -> None:
    u = CpuUsage(min_interval_s=0.2, max_age_s=60)
    assert u.update("a", 100.0, 5.0) == (None, None)         # no previous reading
    assert u.update("a", 100.1, 5.05) == (None, None)        # too close: keeps 100.0
    assert u.update("a", 102.0, 6.0) == (50.0, 2.0)          # 1 s of cpu over 2 s
    assert u.update("a", 300.0, 7.0) == (None, None)         # too old to mean "now"
    u.forget("a")
    assert u.update("a", 301.0, 7.0) == (None, None)


def test_net_bytes_counts_a_namespace_s_interfaces_but_loopback() -> None:
    text = ("Inter-|   Receive  |  Transmit\n face |bytes packets|bytes\n"
            "    lo: 999 9 0 0 0 0 0 0 999 9 0 0 0 0 0 0\n"
            "  eth0: 1500 3 0 0 0 0 0 0 700 2 0 0 0 0 0 0\n"
            "  veth1: 10 1 0 0 0 0 0 0 20 1 0 0 0 0 0 0\n")
    assert parse_net_dev(text) == (1510, 720)
    assert net_bytes(os.getpid()) == (None, None)   # the edge's own namespace: not counted
    if os.geteuid() != 0:
        pytest.skip("needs root for a network namespace")
    ns = f"dsec-t-{secrets.token_hex(4)}"
    a, b = f"dl{secrets.token_hex(3)}", f"dm{secrets.token_hex(3)}"
    x = 1 + secrets.randbelow(250)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    proc = None
    try:
        for cmd in (["ip", "link", "add", a, "type", "veth", "peer", "name", b],
                    ["ip", "link", "set", b, "netns", ns],
                    ["ip", "addr", "add", f"10.251.{x}.1/30", "dev", a],
                    ["ip", "link", "set", a, "up"],
                    ["ip", "-n", ns, "addr", "add", f"10.251.{x}.2/30", "dev", b],
                    ["ip", "-n", ns, "link", "set", b, "up"]):
            subprocess.run(cmd, check=True)
        # nsenter: no mount namespace copy (which would pin every host mount while it ran)
        proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "--", "sleep", "60"])
        for _ in range(100):
            if net_bytes(proc.pid)[0] is not None:
                break
            time.sleep(0.02)
        before = net_bytes(proc.pid)
        assert before[0] is not None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(10):       # into the namespace: its rx; ARP and ICMP back: tx
                s.sendto(b"x" * 1000, (f"10.251.{x}.2", 9))
        time.sleep(0.2)
        after = net_bytes(proc.pid)
        assert after[0] is not None and after[1] is not None
        assert after[0] - before[0] >= 10_000 and after[1] - (before[1] or 0) > 0
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", a], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
