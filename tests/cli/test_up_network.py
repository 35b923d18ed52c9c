"""``dsec up`` takes the network flags ``dsec edge`` takes and hands them to its edges
(--net-default, --net-max, --net-uplink, --net-dns-upstream): a create naming no network
gets the default (and its router really carries it), one beyond ``--net-max`` is refused
naming the entry, through the ``dsec sandbox`` CLI against a real ``dsec up``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

from dsec.net.testinternet import ALLOWED, CIDR_IN, DNS_UPSTREAM, internet, links_in
from dsec.net.uplink import uplink_ifname
from tests.conftest import requires_root

from .test_up_topology import Up

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]
pytestmark = [requires_root]


def cli(up: Up, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSEC_URL": up.local["url"], "DSEC_API_KEY": up.local["api_key"]}
    return subprocess.run([*DSEC, *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def js(r: subprocess.CompletedProcess[str]) -> Any:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_up_passes_network_flags_to_its_edges(tmp_path: Any) -> None:
    default = tmp_path / "default.json"
    default.write_text(json.dumps({"mode": "policy", "allow": ["allowed.test:80/tcp"]}))
    ceiling = tmp_path / "max.json"
    ceiling.write_text(json.dumps({"mode": "policy", "allow": [
        "allowed.test:80/tcp", "203.0.113.16/30:80/tcp"]}))
    with internet() as inet:
        up = Up(str(tmp_path / "state"), "--backend", "container", "--disk-pool", "1GiB",
                "--edges", "2",
                "--net-uplink", f"netns:/proc/{os.getpid()}/fd/{inet.fd}",
                "--net-dns-upstream", DNS_UPSTREAM, "--net-default", f"@{default}",
                "--net-max", f"@{ceiling}").start()
        try:
            # each edge its own router, its uplink on its own /30 in the same namespace
            assert sorted(n for n in links_in(inet.fd) if n.startswith("dsu")) == sorted(
                uplink_ifname(f"edge-{i}") for i in range(2))
            made = js(cli(up, "sandbox", "create", "--json", "-n", "4"))
            assert {m["node"] for m in made} == {"edge-0", "edge-1"}, made
            for m in made:  # every one, on either edge, gets out (replies not astray)
                r = cli(up, "sandbox", "exec", m["id"], "--", "sh", "-c",
                        "echo hi | nc -w 2 allowed.test 80")
                assert f"ok {ALLOWED}:80" in r.stdout, (m, r)
            # --net-ipv6 auto (the default) and an uplink with IPv6: each has its /127
            r = cli(up, "sandbox", "exec", made[0]["id"], "--", "cat", "/proc/net/if_inet6")
            assert "fd00d5ec" in r.stdout, r
            assert cli(up, "sandbox", "rm", *(m["id"] for m in made)).returncode == 0
            [info] = js(cli(up, "sandbox", "create", "--json"))
            sid = info["id"]
            view = js(cli(up, "sandbox", "network", sid, "--json"))
            assert view["policy"]["mode"] == "policy"
            assert view["policy"]["allow"] == ["allowed.test:80/tcp"], view
            r = cli(up, "sandbox", "exec", sid, "--", "sh", "-c",
                    f"echo hi | nc -w 2 allowed.test 80; echo hi | nc -w 2 {CIDR_IN} 80; "
                    "echo end")
            assert f"ok {ALLOWED}:80" in r.stdout and "ok 203.0.113.17" not in r.stdout, r
            # inside the node ceiling: fine; beyond it: refused, the entry named
            ok = js(cli(up, "sandbox", "create", "--json", "--allow", "203.0.113.16/30:80/tcp"))
            assert ok[0]["id"]
            bad = cli(up, "sandbox", "create", "--json", "--allow", "allowed.test:80/tcp",
                      "--allow", "sibling.test:443/tcp")
            assert bad.returncode != 0
            assert re.search(r"network.allow\[1\] 'sibling.test:443/tcp' is outside the "
                             r"network ceiling of node edge-[01]", bad.stderr), bad.stderr
            listed = js(cli(up, "sandbox", "ls", "--json"))
            assert len(listed) == 2, listed  # the refused create made nothing
        finally:
            assert up.stop() == 0
        assert [n for n in links_in(inet.fd) if n.startswith("dsu")] == []


def test_up_net_ipv6_off_reaches_its_edges(tmp_path: Any) -> None:
    """``dsec up --net-ipv6 off`` (formerly a ``dsec edge``-only flag): its edges'
    sandboxes get no IPv6 address at all, though the uplink has IPv6."""
    with internet() as inet:
        up = Up(str(tmp_path / "state"), "--backend", "container", "--disk-pool", "1GiB",
                "--net-uplink", f"netns:/proc/{os.getpid()}/fd/{inet.fd}",
                "--net-dns-upstream", DNS_UPSTREAM, "--net-default", "open",
                "--net-ipv6", "off").start()
        try:
            [info] = js(cli(up, "sandbox", "create", "--json"))
            r = cli(up, "sandbox", "exec", info["id"], "--", "sh", "-c",
                    "cat /proc/net/if_inet6 2>/dev/null; echo hi | nc -w 2 allowed.test 80")
            assert f"ok {ALLOWED}:80" in r.stdout, r  # IPv4 still carried
            assert "fd00d5ec" not in r.stdout and "2001" not in r.stdout, r
        finally:
            assert up.stop() == 0
