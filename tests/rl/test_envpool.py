"""EnvPool: vectorised and per-env paths agree, auto-reset keeps final obs, state guard."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import pytest

from dsec.errors import Conflict, InvalidArgument
from dsec.rl.envpool import EnvPool, GymShard
from dsec.rl.trivial import TrivialBatchEnv, TrivialEnv


def _actions(t: int, n: int) -> np.ndarray:
    return (np.arange(n) + t) % 2


def _trajectory(pool: EnvPool, ticks: int) -> list[tuple[Any, ...]]:
    obs, _ = pool.reset(seed=0)
    out = [("reset", obs.copy())]
    for t in range(ticks):
        o, r, te, tr, info = pool.step(_actions(t, pool.num_envs))
        out.append((o.copy(), r.copy(), te.copy(), tr.copy(),
                    pool.final_obs[pool.done].copy(), sorted(info)))
    return out


@pytest.mark.parametrize("workers", [None, 3])
def test_batched_matches_per_env(workers: int | None) -> None:
    n, ticks = 12, 25
    ref = EnvPool.from_envs([lambda: TrivialEnv(episode_len=5)] * n)
    fast = EnvPool([TrivialBatchEnv(4, episode_len=5) for _ in range(3)], workers=workers)
    try:
        a, b = _trajectory(ref, ticks), _trajectory(fast, ticks)
        for x, y in zip(a, b):
            for u, v in zip(x, y):
                if isinstance(u, np.ndarray):
                    np.testing.assert_array_equal(u, v)
    finally:
        ref.close()
        fast.close()


def test_auto_reset_keeps_final_obs() -> None:
    with EnvPool([TrivialBatchEnv(2, episode_len=3)]) as pool:
        pool.reset()
        for _ in range(2):
            _, _, term, _, info = pool.step([1, 0])
            assert not term.any() and "_final_obs" not in info
        obs, rew, term, trunc, info = pool.step([1, 1])
        assert term.all() and not trunc.any()
        # Returned obs already belong to the new episode; the final one is kept aside.
        np.testing.assert_array_equal(obs, [0.0, 0.0])
        np.testing.assert_allclose(info["final_obs"], [1.0, 1.0])
        assert info["_final_obs"].all()
        assert rew.tolist() == [1.0, 1.0]
        obs, *_ = pool.step([1, 1])
        np.testing.assert_allclose(obs, [1 / 3, 1 / 3], rtol=1e-6)


def test_state_guard_messages() -> None:
    pool = EnvPool([TrivialBatchEnv(2)])
    with pytest.raises(Conflict, match=r"cannot step_async\(\) while the pool is 'new': call reset"):
        pool.step_async([0, 0])
    with pytest.raises(Conflict, match="step_wait"):
        pool.step_wait()
    pool.reset()
    with pytest.raises(Conflict, match=r"call step_async\(actions\) before step_wait"):
        pool.step_wait()
    with pytest.raises(InvalidArgument, match="got 3 actions for 2 environments"):
        pool.step_async([0, 0, 0])
    assert pool.state == "ready"
    pool.step_async([0, 1])
    with pytest.raises(Conflict, match="collect the pending step"):
        pool.step_async([0, 1])
    with pytest.raises(Conflict, match="collect the pending step"):
        pool.reset()
    pool.step_wait()
    pool.close()
    pool.close()
    with pytest.raises(Conflict, match="closed"):
        pool.reset()


class _Exploding(gym.Env[np.int64, np.int64]):
    observation_space = gym.spaces.Discrete(3)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        return np.int64(0), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if action == 1:
            raise RuntimeError("env bug")
        return np.int64(1), 0.0, False, True, {}


@pytest.mark.parametrize("workers", [None, 2])
def test_failed_step_requires_reset(workers: int | None) -> None:
    pool = EnvPool([GymShard([_Exploding()]), GymShard([_Exploding()])], workers=workers)
    try:
        pool.reset()
        _, _, _, trunc, info = pool.step([0, 0])
        assert trunc.all() and info["final_obs"].tolist() == [1, 1]
        with pytest.raises(RuntimeError, match="env bug"):
            pool.step([0, 1])
        assert pool.state == "failed"
        with pytest.raises(Conflict, match="previous step raised"):
            pool.step([0, 0])
        pool.reset()
        pool.step([0, 0])
    finally:
        pool.close()


class _SlowIoShard(TrivialBatchEnv):
    """Records which threads stepped it: the threaded path really uses workers."""

    threads: ClassVar[set[str]] = set()
    barrier = threading.Barrier(2, timeout=10)

    def step(self, actions: np.ndarray) -> None:
        _SlowIoShard.threads.add(threading.current_thread().name)
        self.barrier.wait()   # both shards must be in flight at once
        super().step(actions)


def test_threaded_shards_overlap() -> None:
    with EnvPool([_SlowIoShard(2), _SlowIoShard(2)], workers=2) as pool:
        pool.reset()
        pool.step_async([0, 1, 0, 1])
        _, rew, *_ = pool.step_wait()
        assert rew.tolist() == [0, 1, 0, 1]
    assert len(_SlowIoShard.threads) == 2
    assert all(t.startswith("dsec-envpool") for t in _SlowIoShard.threads)
