"""Driver: rollout loop with a scripted recurrent policy, state zeroing, preempt/resume."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from dsec.errors import Conflict, InvalidArgument
from dsec.rl.buffer import ReplayBuffer
from dsec.rl.driver import Driver, LstmState, PolicyOutput, RolloutHandle, resume
from dsec.rl.envpool import EnvPool, GymShard
from dsec.rl.trivial import TrivialBatchEnv

H = 3


class ScriptedPolicy:
    """Deterministic 'LSTM': h' = 0.5 h + obs, c' = c + 1; records the inputs it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def __call__(self, obs: np.ndarray, actor: LstmState | None,
                 critic: LstmState | None) -> PolicyOutput:
        assert actor is not None and critic is not None
        h, c = actor
        self.seen.append((obs.copy(), h.copy(), c.copy()))
        nh = 0.5 * h + obs[:, None]
        nc = c + 1.0
        action = (np.floor(nc[:, 0]).astype(np.int64)) % 2
        return PolicyOutput(action=action, logprob=np.full(len(obs), -0.69, np.float32),
                            value=obs.astype(np.float32) * 2, actor_state=(nh, nc),
                            critic_state=(nh * 2, nc * 2))


def _setup(n: int = 4, capacity: int = 32) -> tuple[EnvPool, ReplayBuffer, ScriptedPolicy]:
    pool = EnvPool([TrivialBatchEnv(2, episode_len=5), TrivialBatchEnv(n - 2, episode_len=3)])
    buf = ReplayBuffer(num_envs=n, capacity=capacity, hidden_size=H)
    return pool, buf, ScriptedPolicy()


def test_rollout_fills_buffer_and_zeroes_state_on_done() -> None:
    pool, buf, pol = _setup()
    d = Driver(pool, pol, buf)
    d.start(seed=1)
    stats = d.rollout(12)
    assert stats.steps == 48 and buf.size == 12
    # env 0 has 5-step episodes (2 finished in 12), envs 2-3 have 3-step ones (4 each).
    assert stats.episodes == 2 * 2 + 2 * 4
    assert sorted(set(stats.episode_lengths)) == [3, 5]
    assert buf.check() == []
    sm = buf.step_major()
    # The policy saw a zero state exactly at episode starts (zeroed before the forward).
    for t, (_, h, c) in enumerate(pol.seen):
        starts = sm.start[t]
        assert (h[starts] == 0).all() and (c[starts] == 0).all()
        assert (c[~starts] != 0).all()
        np.testing.assert_array_equal(sm.actor_h[t], h)  # type: ignore[index]
        np.testing.assert_array_equal(sm.obs[t], pol.seen[t][0])
    adv, ret = d.advantages(0.9, 0.8)
    assert adv.shape == (12, 4)
    np.testing.assert_allclose(ret, adv + sm.value)


def _uninterrupted(ticks: int) -> ReplayBuffer:
    pool, buf, pol = _setup()
    d = Driver(pool, pol, buf)
    d.start(seed=1)
    d.rollout(ticks)
    return buf


def test_preempt_resume_matches_uninterrupted_run() -> None:
    ref = _uninterrupted(11)
    pool, buf, pol = _setup()
    d = Driver(pool, pol, buf)
    d.start(seed=1)
    d.rollout(4)                      # mid-episode for every env
    handle = RolloutHandle.from_bytes(d.preempt().to_bytes())
    with pytest.raises(Conflict, match="preempted"):
        d.rollout(1)
    with pytest.raises(Conflict, match="already preempted"):
        d.preempt()
    d2 = resume(handle, pool=pool, policy=ScriptedPolicy(), buffer=buf)
    d2.rollout(7)
    assert d2.ticks == 11
    for name, a in ref.step_major().arrays().items():
        np.testing.assert_array_equal(buf.step_major().arrays()[name], a, err_msg=name)


def test_misuse() -> None:
    pool, buf, pol = _setup()
    with pytest.raises(InvalidArgument, match="buffer holds 3 envs"):
        Driver(pool, pol, ReplayBuffer(num_envs=3, capacity=4))
    d = Driver(pool, pol, buf)
    with pytest.raises(Conflict, match="start"):
        d.rollout(1)
    d.start()
    handle = d.preempt()
    with pytest.raises(InvalidArgument, match="LSTM"):
        resume(handle, pool=pool, policy=pol, buffer=ReplayBuffer(num_envs=4, capacity=4))
    with pytest.raises(InvalidArgument, match="not a rollout handle"):
        RolloutHandle.from_bytes(b"\x01\x02")


class _TimeLimited(gym.Env[np.float32, np.int64]):
    observation_space = gym.spaces.Box(0, 10, shape=(), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        self.t = 0
        return np.float32(0), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self.t += 1
        return np.float32(self.t), 1.0, False, self.t == 2, {}


def test_truncation_bootstrap_uses_final_obs() -> None:
    pool = EnvPool([GymShard([_TimeLimited()])])
    buf = ReplayBuffer(num_envs=1, capacity=4)

    def policy(obs: np.ndarray, a: Any, c: Any) -> PolicyOutput:
        return PolicyOutput(action=np.zeros(1, np.int64), value=obs.astype(np.float32) * 10)

    d = Driver(pool, policy, buf, bootstrap_gamma=0.5)
    d.start()
    d.rollout(3)
    # Step 2 was truncated with final obs 2.0 -> V = 20, reward 1 + 0.5 * 20.
    assert buf.step_major().reward[:, 0].tolist() == [1.0, 11.0, 1.0]
    assert buf.step_major().done[:, 0].tolist() == [False, True, False]
