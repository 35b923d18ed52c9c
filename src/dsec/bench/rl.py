"""Suite ``rl``: env stepping, GAE, replay-buffer enqueue and sandbox-env step rates."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from dsec.bench import BenchContext, suite


def _rate(fn: Callable[[], int], budget_s: float) -> float:
    """Units per second of ``fn`` (which returns the units it did) over ``budget_s``."""
    fn()  # warm-up (JIT, caches)
    done, t0 = 0, time.perf_counter()
    while True:
        done += fn()
        dt = time.perf_counter() - t0
        if dt >= budget_s:
            return done / dt


def env_steps(ctx: BenchContext) -> None:
    from dsec.rl.envpool import EnvPool
    from dsec.rl.trivial import TrivialBatchEnv, TrivialEnv

    budget = 0.3 if ctx.quick else 2.0
    n_envs, shards = 64, 4
    acts = np.zeros(n_envs, dtype=np.int64)

    def run(pool: EnvPool, ticks: int) -> Callable[[], int]:
        pool.reset(seed=0)

        def go() -> int:
            for _ in range(ticks):
                pool.step_async(acts)
                pool.step_wait()
            return ticks * n_envs
        return go

    for workers in (None, shards):
        with EnvPool([TrivialBatchEnv(n_envs // shards) for _ in range(shards)],
                     workers=workers) as pool:
            ctx.record("rl_env_steps_fast", _rate(run(pool, 200), budget), "steps/s",
                       envs=n_envs, shards=shards, workers=workers or "inline",
                       path="vectorised numpy")
    with EnvPool([TrivialBatchEnv(n_envs)]) as pool:
        ctx.record("rl_env_steps_fast", _rate(run(pool, 200), budget), "steps/s",
                   envs=n_envs, shards=1, workers="inline", path="vectorised numpy")
    with EnvPool.from_envs([TrivialEnv] * n_envs, workers=shards) as pool:
        ctx.record("rl_env_steps_per_env", _rate(run(pool, 20), budget), "steps/s",
                   envs=n_envs, shards=shards, workers=shards, path="gymnasium.Env loop")
    ctx.note("rl_env_steps_fast: 64 trivial envs in 4 shards. Threads cannot run numpy "
             "ufuncs on 16-element arrays in parallel (GIL-bound per-call overhead), so "
             "the inline path is the fast one; workers pay off for I/O-bound shards.")


def gae_rate(ctx: BenchContext) -> None:
    from dsec.rl.gae import gae, numba_available

    t_len, n = (1024, 64) if ctx.quick else (8192, 64)
    rng = np.random.default_rng(0)
    r = rng.normal(size=(t_len, n)).astype(np.float32)
    v = rng.normal(size=(t_len, n)).astype(np.float32)
    d = rng.random((t_len, n)) < 0.01
    lv = np.zeros(n, np.float32)
    out = np.empty_like(r)
    budget = 0.3 if ctx.quick else 1.5
    backends = ["numba", "numpy"] if numba_available() else ["numpy"]
    for b in backends:
        def go(b: str = b) -> int:
            gae(r, v, d, lv, 0.99, 0.95, backend=b, out=out)  # type: ignore[arg-type]
            return t_len * n
        ctx.record("rl_gae", _rate(go, budget), "transitions/s", T=t_len, N=n, backend=b,
                   dtype="float32")


def buffer_enqueue(ctx: BenchContext) -> None:
    from dsec.rl.buffer import ReplayBuffer

    n, hidden = 64, 128
    buf = ReplayBuffer(num_envs=n, capacity=1024, obs_shape=(16,), hidden_size=hidden)
    obs = np.ones((n, 16), np.float32)
    act = np.ones(n, np.int64)
    rew = np.ones(n, np.float32)
    done = np.zeros(n, bool)
    done[::17] = True
    lp = np.ones(n, np.float32)
    val = np.ones(n, np.float32)
    h = np.ones((n, hidden), np.float32)
    budget = 0.3 if ctx.quick else 1.5

    def go() -> int:
        for _ in range(256):
            buf.add(obs, act, rew, done, lp, val, h, h, h, h)
        return 256 * n

    ctx.record("rl_buffer_enqueue", _rate(go, budget), "transitions/s", envs=n,
               obs_dim=16, lstm_hidden=hidden, lstm_states=4)
    buf2 = ReplayBuffer(num_envs=n, capacity=1024, obs_shape=(16,), hidden_size=None)

    def go2() -> int:
        for _ in range(256):
            buf2.add(obs, act, rew, done, lp, val)
        return 256 * n

    ctx.record("rl_buffer_enqueue", _rate(go2, budget), "transitions/s", envs=n,
               obs_dim=16, lstm_hidden=0, lstm_states=0)


@suite("rl", "RL toolkit: env steps/s, GAE transitions/s, buffer enqueue, sandbox env steps/s")
def run(ctx: BenchContext) -> None:
    env_steps(ctx)
    gae_rate(ctx)
    buffer_enqueue(ctx)
