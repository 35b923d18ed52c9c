"""``e2b``: the E2B-compatible layer (issue 20) against dsec's native SDK, same run.

- ``e2b_create_p50_ms``: the stock SDK's ``Sandbox.create`` through the layer (REST
  create, 201, the SDK's own set-up), container backend;
- ``e2b_exec_p50_ms``: ``commands.run("true")`` through the layer (envd ``Start``:
  Connect streaming over HTTP/1.1 onto dsec's process table: one ``process_run``
  stream since issue 20, before it ``process_start`` then ``process_connect``), and
  ``native_exec_p50_ms``: dsec's ``sb.exec`` of the very argv E2B sends
  (``/bin/bash -l -c true``) over the Aether gateway, on the same sandbox, interleaved;
  ``native_process_p50_ms`` beside them: dsec's own ``sb.processes.start(argv).wait()``
  (two calls on the process table: what the layer did before ``process_run``);
- ``e2b_calls_compatible_ratio``: the fraction of the stock SDK calls of
  :data:`dsec.bench._e2b_calls.CALLS` that behaved as E2B documents in this run
  (documented gaps count against it).

The cluster is ``dsec up --e2b`` in its own process (``LocalCluster(subprocess=True)``),
as users run it, and the SDKs are the clients in the bench's process. The choice does not
move the figure: alternating runs of 300 rounds on a quiet machine (2026-12-02 18:48 UTC,
load < 1) put the E2B overhead at 0.56 / 0.44 ms with the cluster in the bench's process
(a thread: one GIL for the server and both clients) and 0.40 / 0.42 ms with ``dsec up``
in its own.

Needs root (container sandboxes) and the ``e2b`` extra.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from dsec.bench import BenchContext, suite


@suite("e2b")
def bench_e2b(ctx: BenchContext) -> None:
    """E2B layer: create and exec p50 vs native, share of stock-SDK calls compatible."""
    try:
        import e2b
    except ImportError:
        ctx.note("e2b suite skipped: the e2b extra is not installed "
                 "(pip install -e '.[e2b]')")
        return
    import tempfile

    from dsec.bench._e2b_calls import (
        TEMPLATE_SETUP,
        E2BTarget,
        run_calls,
        stage_python_root,
    )
    from dsec.client.build import Image
    from dsec.cluster.local import LocalCluster

    n_create = ctx.scale(40, 10)
    n_exec = ctx.scale(300, 60)
    with LocalCluster(backend="container", e2b="127.0.0.1:0", subprocess=True) as cl, \
            tempfile.TemporaryDirectory(prefix="dsec-e2b-python-") as pyroot:
        with cl.client(session_lease_s=None) as c:
            Image.from_image("base").run(TEMPLATE_SETUP).build(c, name="e2b-base")
            # the code interpreter's template: base + the host's python3
            Image.from_image("base").copy(stage_python_root(pyroot), "/").build(
                c, name="e2b-python")
            target = E2BTarget(
                url=str(cl.e2b_url), api_key=cl.api_key,
                reader_key=cl.create_key("e2b-bench-reader", "default", "reader"),
                stranger_key=cl.create_key("e2b-bench-stranger", "e2b-bench-other",
                                           "admin"),
                template="e2b-base", python_template="e2b-python")
            opts = target.opts()
            creates: list[float] = []
            for _ in range(n_create):
                t0 = time.perf_counter()
                sb = e2b.Sandbox.create("e2b-base", timeout=300, **opts)
                creates.append(time.perf_counter() - t0)
                sb.kill()
            ctx.record("e2b_create_p50_ms", statistics.median(creates) * 1e3, "ms",
                       n=n_create)
            sb = e2b.Sandbox.create("e2b-base", timeout=600, **opts)
            native = c.sandboxes.get(sb.sandbox_id)
            try:
                e2b_t, nat_t, proc_t = _exec_rounds(sb, native, n_exec)
            finally:
                sb.kill()
            ctx.record("e2b_exec_p50_ms", statistics.median(e2b_t) * 1e3, "ms", n=n_exec)
            ctx.record("native_exec_p50_ms", statistics.median(nat_t) * 1e3, "ms",
                       n=n_exec, argv="/bin/bash -l -c true")
            ctx.record("native_process_p50_ms", statistics.median(proc_t) * 1e3, "ms",
                       n=n_exec, what="sb.processes.start(argv).wait(): the path E2B's "
                       "commands.run takes (dsec's process table)")
            ctx.record("e2b_exec_overhead_ms",
                       (statistics.median(e2b_t) - statistics.median(nat_t)) * 1e3, "ms",
                       target="<= 1", vs="native_exec")
            ctx.record("e2b_layer_overhead_ms",
                       (statistics.median(e2b_t) - statistics.median(proc_t)) * 1e3, "ms",
                       vs="native_process (the same process-table path, dsec's SDK)")
        outcomes = run_calls(target)
        ok = sum(o.compatible for o in outcomes)
        ctx.record("e2b_calls_compatible_ratio", ok / len(outcomes), "ratio",
                   compatible=ok, tested=len(outcomes))
        off = [o.name for o in outcomes if not o.compatible]
        ctx.note(f"e2b: {ok}/{len(outcomes)} stock-SDK calls behave as E2B documents; "
                 f"not: {', '.join(off) or 'none'}")


def _exec_rounds(sb: Any, native: Any, n: int
                 ) -> tuple[list[float], list[float], list[float]]:
    """E2B's commands.run, dsec's exec and dsec's process start+wait of the same argv,
    interleaved, so load drifts hit all three alike."""
    argv = ["/bin/bash", "-l", "-c", "true"]
    for _ in range(5):   # warm every path (connections, caches)
        sb.commands.run("true")
        native.exec(argv)
        native.processes.start(argv).wait()
    e2b_t: list[float] = []
    nat_t: list[float] = []
    proc_t: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb.commands.run("true")
        t1 = time.perf_counter()
        native.exec(argv)
        t2 = time.perf_counter()
        native.processes.start(argv).wait()
        t3 = time.perf_counter()
        e2b_t.append(t1 - t0)
        nat_t.append(t2 - t1)
        proc_t.append(t3 - t2)
    return e2b_t, nat_t, proc_t
