"""Denied packets in Prometheus and in events (plan-14 §4.7), from a real sandbox: a
``dsec edge --metrics-listen`` process with a router into the test internet; a sandbox
whose policy allows one name sends packets elsewhere and asks for a name it may not.

Then: ``dsec_net_denied_packets_total{sandbox_id}`` counts them (and the series goes
away with the sandbox), ``dsec_net_dns_refused_total`` counts the refused name, and the
sandbox's events hold one ``network_denied`` with an example destination - one, however
many refusals follow within 10 s."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys

import httpx
import pytest

from dsec.edge.client import EdgeClient
from dsec.edge.metrics import denied_samples
from dsec.image import LayerStore, ensure_busybox_base
from dsec.net.testinternet import DNS_UPSTREAM, SIBLING, Internet
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import SandboxSpec

from .test_edge_door import destroy_all, no_uplink_peers, stop_edge

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]


def test_denied_samples() -> None:
    assert denied_samples({3: ("b", 10, 15), 1: ("a", 0, 0), 7: ("c", 9, 4)}) == [
        ("a", 0), ("b", 5), ("c", 0)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(text: str, name: str, sid: str | None = None) -> float | None:
    label = f'{{sandbox_id="{sid}"}}' if sid is not None else ""
    m = re.search(rf"^{re.escape(name + label)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


async def test_denied_packets_in_metrics_and_events(tmp_path: object,
                                                    internet: Internet) -> None:
    root = str(tmp_path)
    store = LayerStore(os.path.join(root, "layers"))
    store.tag(ensure_busybox_base(store).digest, "base")
    sock = os.path.join(root, "edge.sock")
    port = _free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", "from dsec.cli.main import main; main()", "edge",
         "--listen", f"unix:{sock}", "--state-dir", os.path.join(root, "state"),
         "--layer-store", os.path.join(root, "layers"), "--backend", "container",
         "--node-id", "netmetrics", "--log-level", "warning", "--disk-pool", "1GiB",
         "--net-uplink", f"netns:/proc/{os.getpid()}/fd/{internet.fd}",
         "--net-dns-upstream", DNS_UPSTREAM, "--metrics-listen", f"127.0.0.1:{port}", "--metrics-public"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            if os.path.exists(sock):
                break
            await asyncio.sleep(0.05)
        async with await EdgeClient.connect(f"unix:{sock}", timeout=30) as c, \
                httpx.AsyncClient(timeout=10) as http:
            spec = SandboxSpec(backend="container", memory_bytes=128 << 20,
                               network=NetworkPolicy(mode="policy",
                                                     allow=("allowed.test:80/tcp",)))
            info = await c.create(spec)
            quiet = await c.create(spec)
            text = (await http.get(url)).text
            assert _metric(text, "dsec_net_denied_packets_total", info.id) == 0
            assert _metric(text, "dsec_net_dns_refused_total") == 0
            assert _metric(text, "dsec_edge_sandboxes") == 2
            await c.exec(info.id, f"echo x | nc -w 1 {SIBLING} 80; "
                         "nslookup sibling.test; echo done")
            assert internet.arrived(dst=SIBLING) == []
            denied = None
            for _ in range(100):  # the counters are read every second
                text = (await http.get(url)).text
                denied = _metric(text, "dsec_net_denied_packets_total", info.id)
                if denied:
                    break
                await asyncio.sleep(0.1)
            assert denied is not None and denied >= 1, text
            assert _metric(text, "dsec_net_denied_packets_total", quiet.id) == 0
            assert (_metric(text, "dsec_net_dns_refused_total") or 0) >= 1, text
            events = []
            for _ in range(100):
                events = [e for e in await c.events(info.id) if e.reason == "network_denied"]
                if events:
                    break
                await asyncio.sleep(0.1)
            [ev] = events
            assert f"{SIBLING}:80/tcp" in ev.detail and "dropped" in ev.detail, ev.detail
            # more refusals within 10 s: counted, but no second event
            await c.exec(info.id, f"echo x | nc -w 1 {SIBLING} 81; echo done")
            for _ in range(30):
                text = (await http.get(url)).text
                if (_metric(text, "dsec_net_denied_packets_total", info.id) or 0) > denied:
                    break
                await asyncio.sleep(0.1)
            assert (_metric(text, "dsec_net_denied_packets_total", info.id) or 0) > denied
            await asyncio.sleep(1.2)
            assert len([e for e in await c.events(info.id)
                        if e.reason == "network_denied"]) == 1
            assert [e for e in await c.events(quiet.id) if e.reason == "network_denied"] == []
            # destroyed: its series is gone
            await c.destroy(info.id)
            text = (await http.get(url)).text
            assert _metric(text, "dsec_net_denied_packets_total", info.id) is None, text
            assert _metric(text, "dsec_net_denied_packets_total", quiet.id) == 0
            assert (await http.get(url.replace("/metrics", "/other"))).status_code == 404
            await c.destroy(quiet.id)
    finally:
        await destroy_all(sock)
        stop_edge(proc)
    err = proc.stderr.read().decode()  # type: ignore[union-attr]
    assert f"metrics on http://127.0.0.1:{port}/metrics" in err, err
    assert await no_uplink_peers(internet) == []
