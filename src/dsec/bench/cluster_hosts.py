"""Figures of the multi-host cluster on one machine (issue 16, stream ``hosts``): called
by suite ``cluster`` (:mod:`dsec.bench.cluster`), which imports this module by name.

- ``cluster_partition_resurrected`` (count, must be 0): sandboxes written off during a
  partition of one test host (:func:`dsec.cluster.drills.partition`) alive again after
  the heal;
- ``cluster_idempotent_duplicates`` (count, must be 0): sandboxes beyond one per
  Idempotency-Key after an apiserver replica was killed with -9 mid-creates
  (:func:`dsec.cluster.drills.replica_kill`);
- ``create_e2e_p50`` / ``exec_e2e_p50`` (ms) and ``create_e2e`` (sandboxes/s) with real
  container sandboxes, on 3 test hosts and on 1, in the same run (params ``hosts``):
  what crossing the bridge to an edge in another namespace costs against one host
  (both go through the same relay and apiserver-in-a-namespace, so the difference is
  the hosts, not the harness).
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import tempfile
import threading
import time
from typing import Any

from dsec.bench import Result

__all__ = ["run"]

SUITE = "cluster"
# Small enough that the samples fit one host (8 cores x8 overcommit, 8 GiB x4).
SIZE: dict[str, Any] = {"cpu": 0.1, "memory": "64MiB", "ttl": 600}


def _cluster(state_dir: str, **kw: Any) -> Any:
    from dsec.cluster.hosts import HostCluster, HostsConfig

    return HostCluster(HostsConfig(state_dir=state_dir, **kw))


def _latencies(quick: bool, hosts: int, out: list[Result]) -> None:
    n = 10 if quick else 60           # sequential creates (p50)
    m = 24 if quick else 120          # concurrent creates (rate)
    k = 30 if quick else 300          # execs (p50)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-hosts-") as d, \
            _cluster(d, hosts=hosts, cpus_per_host=8.0) as hc, hc.client(timeout=60) as c:
        # warm: the base layer mounted on every host (placement spreads the first few)
        made = [c.sandboxes.create(**SIZE) for _ in range(2 * hosts)]
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            made.append(c.sandboxes.create(**SIZE))
            lat.append(time.perf_counter() - t0)
        spread = len({hc.host_of(s.id) for s in made})
        out.append(Result(SUITE, "create_e2e_p50", statistics.median(lat) * 1000, "ms",
                          {"hosts": hosts, "backend": "container", "n": n,
                           "hosts_used": spread}))
        per_thread, threads, lock = m // 8, [], threading.Lock()
        more: list[Any] = []

        def creates() -> None:
            for _ in range(per_thread):
                sb = c.sandboxes.create(**SIZE)
                with lock:
                    more.append(sb)
        t0 = time.perf_counter()
        for _ in range(8):
            threads.append(threading.Thread(target=creates))
            threads[-1].start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        out.append(Result(SUITE, "create_e2e", len(more) / dt, "sandboxes/s",
                          {"hosts": hosts, "backend": "container", "n": len(more),
                           "concurrency": 8}))
        for sb in more:
            sb.kill()
        # one sandbox per host (as far as placement spread them), execs round-robin
        targets: dict[str, Any] = {}
        for sb in made:
            targets.setdefault(hc.host_of(sb.id), sb)
        boxes = list(targets.values())
        lat = []
        for i in range(k):
            sb = boxes[i % len(boxes)]
            t0 = time.perf_counter()
            sb.exec(["true"], timeout=10)
            lat.append(time.perf_counter() - t0)
        out.append(Result(SUITE, "exec_e2e_p50", statistics.median(lat) * 1000, "ms",
                          {"hosts": hosts, "backend": "container", "n": k,
                           "hosts_used": len(boxes)}))
        for sb in made:
            sb.kill()


def run(quick: bool) -> list[Result]:
    """The figures above; ``quick`` shrinks the sample sizes, not the scenarios."""
    from dsec.cluster.drills import partition, replica_kill

    out: list[Result] = []
    for hosts in (1, 3):
        _latencies(quick, hosts, out)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-hosts-") as d, \
            _cluster(d, hosts=3, backends=("simulated",), default_backend="simulated",
                     node_ttl_s=3.0) as hc:
        p = partition(hc)
        out.append(Result(SUITE, "cluster_partition_resurrected", p.resurrected, "count", {
            "hosts": 3, "written_off": len(p.written_off), "duplicate_ids": p.duplicate_ids,
            "ghosts_at_heal": p.ghosts_at_heal, "duplicate_keys": p.duplicate_keys,
            "ghosts_open_sessions": p.ghosts_open_sessions, "ghosts_after_sweep": p.ghosts_after_sweep,
            "loss_s": round(p.loss_seconds, 1), "overdue_calls": len(p.overdue),
            "node_ttl_s": 3.0}))
    with contextlib.ExitStack() as stack:
        url, kind = _store(stack)
        d = stack.enter_context(tempfile.TemporaryDirectory(prefix="dsec-bench-hosts-"))
        hc = stack.enter_context(_cluster(d, hosts=2, replicas=2, backends=("simulated",),
                                          default_backend="simulated", store=url))
        r = replica_kill(hc, per_client=6 if quick else 25)
        out.append(Result(SUITE, "cluster_idempotent_duplicates", r.duplicates, "count", {
            "replicas": 2, "store": kind, "keys": r.keys, "answered": r.answered,
            "orphans": r.orphans, "overdue_calls": len(r.overdue)}))
    return out


def _store(stack: contextlib.ExitStack) -> tuple[str | None, str]:
    """The replicas' store: a throwaway PostgreSQL server (the ``pg`` stream's
    ``dsec.cluster.pgserver``) where that exists, else the SQLite file they share."""
    try:
        pgserver = importlib.import_module("dsec.cluster.pgserver")
    except ModuleNotFoundError:
        return None, "sqlite"
    d = stack.enter_context(tempfile.TemporaryDirectory(prefix="dsec-pg-", dir="/tmp"))
    server = pgserver.PgServer(d, fsync=False, remove=True)
    server.start()
    stack.callback(server.stop)
    return str(server.dsn), "postgresql"
