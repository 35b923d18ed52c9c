"""The same SDK program against plain ``dsec up`` (one machine) and against a cluster of
three test hosts (network namespaces, a real ``dsec edge`` with its own layer store and
container backend in each, the apiserver in a namespace of its own): same results, and
on the hosts the sandboxes really are spread over the hosts' edges."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from dsec import Client
from dsec.cluster import DSEC_ARGV
from dsec.cluster.hosts import RECORDS_DIR, HostCluster
from dsec.cluster.local import LocalCluster
from dsec.statedir import read_local
from tests.cluster.hosts_program import sdk_program
from tests.conftest import requires_root

pytestmark = requires_root


def _check(seen: dict[str, object], n: int) -> None:
    assert len(set(seen["ids"])) == n  # type: ignore[arg-type]
    assert seen["outputs"] == [(3, f"hello-{i}".encode(), b"err") for i in range(n)]
    assert seen["files"] == [f"note {i}\n" for i in range(n)]
    assert seen["paused_state"] == "paused" and seen["resumed_state"] == "running"
    assert seen["after_resume"] == b"note 0\n"
    assert seen["snapshot"] is True
    assert seen["gone"] == ["destroyed"] * n


def test_sdk_program_on_dsec_up() -> None:
    with LocalCluster(backend="container", subprocess=True) as cl, cl.client() as c:
        seen = sdk_program(c)
    _check(seen, 3)


def test_sdk_program_on_three_hosts(host_cluster: Callable[..., HostCluster]) -> None:
    hc = host_cluster(hosts=3)
    with hc.client(timeout=30) as c:
        seen = sdk_program(c, n=6)
    _check(seen, 6)
    hosts = {hc.host_of(i) for i in seen["ids"]}  # type: ignore[attr-defined]
    assert hosts <= set(hc.node_ids) and len(hosts) >= 2, hosts
    # the edges agree: nothing is left on any host
    assert {n: hc.edge_ids(n) for n in hc.node_ids} == {n: [] for n in hc.node_ids}


def _record_of(pid: int) -> dict[str, object] | None:
    for name in os.listdir(RECORDS_DIR) if os.path.isdir(RECORDS_DIR) else []:
        if name.endswith(".json"):
            try:
                with open(os.path.join(RECORDS_DIR, name)) as f:
                    rec: dict[str, object] = json.load(f)
            except (OSError, ValueError):
                continue
            if rec.get("pid") == pid:
                return rec
    return None


def test_sdk_program_on_dsec_up_hosts(tmp_path: Path) -> None:
    """``dsec up --hosts 3``, the demo command: found through local.json like plain
    ``dsec up``; SIGTERM stops it and leaves no namespace behind."""
    state = str(tmp_path / "st")
    proc = subprocess.Popen([*DSEC_ARGV, "up", "--hosts", "3", "--backend", "container",
                             "--listen", "127.0.0.1:0", "--state-dir", state, "--quiet"],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 60
        while (local := read_local(state)) is None:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < end, "dsec up --hosts did not start"
            time.sleep(0.1)
        rec = _record_of(proc.pid)
        assert rec is not None and len(rec["netns"]) == 5  # type: ignore[arg-type]
        with Client(local["url"], local["api_key"], timeout=30) as c:
            assert sorted(n.id for n in c.nodes()) == ["h0", "h1", "h2"]
            seen = sdk_program(c)
        _check(seen, 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              check=False).stdout
        assert not [n for n in rec["netns"] if n in left]  # type: ignore[attr-defined]
        assert _record_of(proc.pid) is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
