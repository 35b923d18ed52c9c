"""Suite ``edge``: sandbox creation rates, burst lifecycles, pause/resume, fncall handout.

What each figure measures (targets from issue 3; the Rust reference in brackets):
- ``creation`` sandboxes/s, simulated zero profile, N creates by C concurrent callers:
  ``transport=uds`` through EdgeService in a separate server process (one core each),
  ``transport=uds-same-process`` with client and server sharing one event loop, and
  ``transport=in-process`` calling EdgeNode directly. Target >= 13,000/s at C=64 [13.2-13.4k].
  Param ``journal``: ``none`` (no state dir: what this figure measured before issue 12),
  ``tick`` (journal written once per 50 ms tick, a crash loses that tick) and ``durable``
  (the default: intent and running record group-committed with write+fsync before the
  answer; ``fsyncs`` in params counts them). The state dir is under ``$TMPDIR``.
- ``creation_paper``: the same with the paper (container) latency profile, C=256.
  Target >= 6,300/s.
- ``burst``: 100,000 create+destroy lifecycles in-process, batched (create_many /
  destroy_many of 1,000) and one call at a time, with ``journal: tick`` (the target's
  setting: creates and destroys within one tick cost no I/O) and ``journal: durable``
  (every lifecycle waits for 3 group commits; one call at a time that is 3 fsyncs per
  lifecycle, so that variant runs n/10). Target >= 56,700 lifecycles/s with 0 errors.
- ``pause_resume``: latency p50/p99 of pause and of resume through EdgeNode under the
  paper profile (4 s pause, 1 s resume, real sleeps), many sandboxes at once; the
  overhead figure is the latency minus the profile's sleep.
- ``fncall_handout``: from asking the pool for a worker to the call's first line running
  in it (for ``isolated: true`` that includes admission into the sandbox's jail: the
  work dir's detached mount, cgroup join, privilege drop, seccomp), p50/p99, plus
  end-to-end latency of a trivial call and the pool hit rate, paced (below the refill
  rate) and saturating; jailed and unjailed (the old workers) side by side.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

from dsec.bench import BenchContext, suite

BIG: dict[str, Any] = {"cpu_milli": 10**12, "memory_bytes": 2**62, "max_sandboxes": 10**7}


def _profile(name: str) -> Any:
    from dsec.edge.backends.simulated import NodeLatencyProfile

    return NodeLatencyProfile.zero() if name == "zero" else NodeLatencyProfile.paper("container")


JOURNALS = ("none", "tick", "durable")


def _node(profile: str, state_dir: str | None = None, journal: str = "durable") -> Any:
    """A bench node; ``journal`` none (no state dir), tick or durable (fsync)."""
    from dsec.edge.admission import Capacity
    from dsec.edge.backends.simulated import SimulatedBackend
    from dsec.edge.node import EdgeNode, NodeConfig

    if journal == "none":
        state_dir = None
    cfg = NodeConfig(node_id="bench", capacity=Capacity(**BIG), state_dir=state_dir,
                     journal_sync="tick" if journal == "tick" else "fsync")
    return EdgeNode(cfg, SimulatedBackend(profile=_profile(profile)))


def _serve(path: str, profile: str, ready: Any, journal: str = "none") -> None:
    import uvloop

    from dsec.edge.service import serve_edge

    async def main() -> None:
        async with _node(profile, os.path.join(os.path.dirname(path), "state"),
                         journal) as node:
            srv = await serve_edge(node, f"unix:{path}")
            ready.set()
            await asyncio.Event().wait()
            await srv.close()

    uvloop.run(main())


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def _create_rate(create: Any, n: int, conc: int) -> tuple[float, int]:
    from dsec.wire.spec import SandboxSpec

    spec = SandboxSpec()
    errors = 0
    per = n // conc

    async def worker() -> None:
        nonlocal errors
        for _ in range(per):
            try:
                await create(spec)
            except Exception:  # noqa: BLE001 - counted
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return per * conc / (time.perf_counter() - t0), errors


def _runs(ctx: BenchContext) -> int:
    # The dev VM is shared with other work; the median of 3 runs is the figure, the best
    # run is kept as a parameter.
    return 1 if ctx.quick else 3


def _record_rate(ctx: BenchContext, name: str, rates: list[float], errors: int, unit: str,
                 **params: Any) -> None:
    ctx.record(name, statistics.median(rates), unit, **params, errors=errors, runs=len(rates),
               best=round(max(rates)))


async def _over_uds(ctx: BenchContext, path: str, name: str, n: int, concs: tuple[int, ...],
                    transport: str, profile: str, journal: str = "none") -> None:
    from dsec.edge.service import EdgeClient

    async with await EdgeClient.connect(f"unix:{path}") as c:
        await _create_rate(c.create, 512, 64)  # warm up
        for conc in concs:
            rates, errors = [], 0
            for _ in range(_runs(ctx)):
                rate, err = await _create_rate(c.create, n, conc)
                rates.append(rate)
                errors += err
                ids = [i.id for i in await c.list()]
                for k in range(0, len(ids), 1000):
                    await c.destroy_many(ids[k:k + 1000])
            _record_rate(ctx, name, rates, errors, "sandboxes/s", concurrency=conc, n=n,
                         transport=transport, profile=profile, journal=journal)


def _separate_process(ctx: BenchContext, name: str, n: int, concs: tuple[int, ...],
                      profile: str, journal: str = "none") -> None:
    import uvloop

    with tempfile.TemporaryDirectory(prefix="dsec-bench-edge-") as d:
        path = os.path.join(d, "edge.sock")
        mpctx = mp.get_context("spawn")
        ready = mpctx.Event()
        proc = mpctx.Process(target=_serve, args=(path, profile, ready, journal), daemon=True)
        proc.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("edge benchmark server did not start within 60 s")
            uvloop.run(_over_uds(ctx, path, name, n, concs, "uds", profile, journal))
        finally:
            proc.terminate()
            proc.join(10)


async def _same_process(ctx: BenchContext, name: str, n: int, concs: tuple[int, ...],
                        profile: str, journal: str = "none") -> None:
    from dsec.edge.service import serve_edge

    with tempfile.TemporaryDirectory(prefix="dsec-bench-edge-") as d:
        async with _node(profile, os.path.join(d, "s1"), journal) as node:
            srv = await serve_edge(node, f"unix:{d}/edge.sock")
            try:
                await _over_uds(ctx, f"{d}/edge.sock", name, n, concs, "uds-same-process",
                                profile, journal)
            finally:
                await srv.close()
        async with _node(profile, os.path.join(d, "s2"), journal) as node:
            for conc in concs:
                rates, errors = [], 0
                syncs0 = node.journal.syncs if node.journal is not None else 0
                for _ in range(_runs(ctx)):
                    rate, err = await _create_rate(node.create, n, conc)
                    rates.append(rate)
                    errors += err
                    await node.destroy_many([i.id for i in node.list()])
                extra = {}
                if journal == "durable":  # per run: n creates + n destroys
                    extra["fsyncs"] = (node.journal.syncs - syncs0) // len(rates)
                _record_rate(ctx, name, rates, errors, "sandboxes/s", concurrency=conc, n=n,
                             transport="in-process", profile=profile, journal=journal, **extra)


def creation(ctx: BenchContext) -> None:
    import uvloop

    n = ctx.scale(5000, 2000)
    for journal in JOURNALS:
        _separate_process(ctx, "creation", n, (64, 256), "zero", journal)
        uvloop.run(_same_process(ctx, "creation", n, (64, 256), "zero", journal))
    _separate_process(ctx, "creation_paper", n, (256,), "paper")
    uvloop.run(_same_process(ctx, "creation_paper", n, (256,), "paper"))
    _separate_process(ctx, "creation_paper", n, (256,), "paper", "durable")


async def _burst_batched(node: Any, n: int) -> tuple[float, int]:
    from dsec.wire.spec import SandboxSpec

    spec = SandboxSpec()
    errors = 0
    t0 = time.perf_counter()
    for _ in range(n // 1000):
        made = await node.create_many([spec] * 1000)
        ok = [m.id for m in made if not isinstance(m, Exception)]
        errors += len(made) - len(ok)
        gone = await node.destroy_many(ok)
        errors += sum(isinstance(g, Exception) for g in gone)
    return n / (time.perf_counter() - t0), errors


async def _burst_single(node: Any, n: int) -> tuple[float, int]:
    from dsec.wire.spec import SandboxSpec

    spec = SandboxSpec()
    errors = 0
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            info = await node.create(spec)
            await node.destroy(info.id)
        except Exception:  # noqa: BLE001 - counted
            errors += 1
    return n / (time.perf_counter() - t0), errors


async def _burst(ctx: BenchContext, n: int) -> None:
    total_errors = 0
    with tempfile.TemporaryDirectory(prefix="dsec-bench-edge-") as d:
        for journal in ("tick", "durable"):
            for batch, fn in ((1000, _burst_batched), (1, _burst_single)):
                m = n // 10 if journal == "durable" and batch == 1 else n
                rates, errors, syncs = [], 0, 0
                for k in range(_runs(ctx)):
                    async with _node("zero", os.path.join(d, f"{journal}-{batch}-{k}"),
                                     journal) as node:
                        rate, err = await fn(node, m)
                        rates.append(rate)
                        errors += err + node.live_count
                        syncs += node.journal.syncs
                _record_rate(ctx, "burst", rates, errors, "lifecycles/s", n=m, batch=batch,
                             journal=journal, fsyncs=syncs // len(rates))
                total_errors += errors
    print(f"burst: {total_errors} errors")


async def _pause_resume(ctx: BenchContext, n: int) -> None:
    from dsec.wire.spec import SandboxSpec

    prof = _profile("paper")
    async with _node("paper") as node:
        ids = [i.id for i in await node.create_many([SandboxSpec()] * n)]

        async def timed(coro: Any) -> float:
            t0 = time.perf_counter()
            await coro
            return time.perf_counter() - t0

        p = await asyncio.gather(*(timed(node.pause(i)) for i in ids))
        r = await asyncio.gather(*(timed(node.resume(i)) for i in ids))
    for what, xs, base in (("pause", p, prof.pause_s), ("resume", r, prof.resume_s)):
        for q in (50, 99):
            ctx.record(f"{what}_latency", _pct(xs, q) * 1000, "ms", pct=f"p{q}", n=n,
                       profile=prof.name)
        ctx.record(f"{what}_overhead", (_pct(xs, 99) - base) * 1000, "ms", pct="p99", n=n,
                   profile=prof.name)


async def _fncall(ctx: BenchContext, calls: int) -> None:
    """fncall handout and call latency, jailed (``isolated: true``, needs root) and the
    old unjailed workers (``isolated: false``) in the same run, through the same path
    (``FncallBackend.call`` of a pickled ``operator.add``)."""
    import operator

    from dsec.edge.backends.fncall import FncallBackend
    from dsec.wire.spec import SandboxSpec

    sid = "sb-000000000be0-bench"
    modes = [False, True] if os.geteuid() == 0 else [False]
    for load, conc, gap in (("paced", 1, 0.05), ("saturating", 4, 0.0)):
        for isolated in modes:
            backend = FncallBackend(pool_size=8, isolate=isolated)
            try:
                await backend.create(sid, SandboxSpec(backend="fncall"))  # type: ignore[arg-type]
                await backend.pool.wait_ready()
                handout: list[float] = []
                total: list[float] = []
                per = calls // conc

                async def worker(b: FncallBackend = backend, per: int = per, gap: float = gap,
                                 handout: list[float] = handout,
                                 total: list[float] = total) -> None:
                    for _ in range(per):
                        res = await b.call(sid, operator.add, 1, 1, timeout_s=30.0)  # type: ignore[arg-type]
                        if res.value != 2:
                            raise RuntimeError(f"fncall bench call failed: {res}")
                        handout.append(res.handout_s)
                        total.append(res.duration_s)
                        if gap:
                            await asyncio.sleep(gap)

                await asyncio.gather(*(worker() for _ in range(conc)))
                pool = backend.pool
                for q in (50, 99):
                    ctx.record("fncall_handout", _pct(handout, q) * 1000, "ms", pct=f"p{q}",
                               isolated=isolated, load=load, concurrency=conc, pool=8,
                               calls=per * conc)
                    ctx.record("fncall_call", _pct(total, q) * 1000, "ms", pct=f"p{q}",
                               isolated=isolated, load=load, concurrency=conc)
                ctx.record("fncall_hit_rate", pool.hit_rate * 100, "%", isolated=isolated,
                           load=load, concurrency=conc, hits=pool.hits, misses=pool.misses)
            finally:
                await backend.destroy(sid)  # type: ignore[arg-type]
                await backend.close()
    if len(modes) == 1:
        ctx.note("fncall isolated=true was not measured: the jail needs root.")


@suite("edge", "edge node: creation/s (UDS, in-process), burst lifecycles/s, pause/resume, fncall")
def run(ctx: BenchContext) -> None:
    import uvloop

    creation(ctx)
    uvloop.run(_burst(ctx, ctx.scale(100_000, 20_000)))
    uvloop.run(_pause_resume(ctx, ctx.scale(500, 100)))
    uvloop.run(_fncall(ctx, ctx.scale(200, 40)))
    ctx.note("creation transport=uds: EdgeService in a separate process (spawned, uvloop), "
             "client in the bench process, one UDS connection, each caller awaiting one "
             "create at a time; uds-same-process shares one event loop for both ends.")
    ctx.note("burst runs with the journal on (state dir under $TMPDIR): journal=tick writes "
             "once per 50 ms tick (creates and destroys within one tick cost no I/O); "
             "journal=durable group-commits intent, running record and tombstone with "
             "write+fsync before each answer (batched: ~3-6 fsyncs per 1,000; one call at "
             "a time: 3 per lifecycle, so it runs n/10).")
    ctx.note("creation journal=none has no state dir (the pre-issue-12 figure); tick writes "
             "once per tick; durable (the default) answers a create only after its intent "
             "and its running record were fsynced, shared by every create in flight.")
    ctx.note("Figures are the median of 3 runs (best in params) because the 2-core VM is "
             "shared. What bounds creation over UDS (cProfile, same process): Aether framing "
             "and dispatch ~35%, EdgeNode.create incl. the simulated backend ~33%, msgpack "
             "decode of spec and info ~14%; i.e. Python per-request work, no waits.")
    ctx.note("fncall_handout ends when the call's first line runs, so isolated=true "
             "includes admission into the jail (cgroup joins ~0.1-0.3 ms in 5 v1 "
             "hierarchies, cgroup ns + move_mount ~0.1 ms, uid drop ~0.06 ms, the stacked "
             "second seccomp filter ~0.04 ms); the rest is waking the worker and, on a busy "
             "machine, the time slice lost when it moves into the sandbox's cpu cgroup "
             "(the kernel reschedules there) and waits for the global cgroup mutex. fncall_call "
             "returns only once the worker's pid namespace is gone (every process the call "
             "started reaped): ~2-6 ms of process teardown on this VM, off the handout.")
    ctx.note("pause_resume uses real sleeps of the paper profile (pause 4 s, resume 1 s), all "
             "sandboxes at once; overhead = p99 latency minus the profile's sleep.")
