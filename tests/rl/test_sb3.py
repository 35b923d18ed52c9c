"""The SB3 VecEnv adapter (issue 18, section 5): the VecEnv contract checked step for step
against SB3's own DummyVecEnv, SB3's wrappers on top, and PPO trained on both with the
same seeds ends with identical weights. Needs the extra dsec[sb3] (stable-baselines3 and
torch; `make setup` installs it: torch==2.13.0 is a CPU wheel on this machine's disk)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is absent: install dsec[sb3] "
                            "(make setup does; CPU wheel torch==2.13.0)")
pytest.importorskip("stable_baselines3", reason="stable-baselines3 is absent: dsec[sb3]")

from stable_baselines3 import PPO
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import (
    DummyVecEnv,
    VecEnv,
    VecMonitor,
    VecNormalize,
)

from dsec.rl.access import EdgeAccess
from dsec.rl.envpool import EnvPool
from dsec.rl.judges import RegexJudge
from dsec.rl.sandbox import SandboxEnvPool, Task
from dsec.rl.sb3 import SB3VecEnv

N = 4


def _fns(n: int = N, steps: int = 30) -> list[Any]:
    return [lambda: gym.make("CartPole-v1", max_episode_steps=steps)] * n


def _pair(n: int = N, steps: int = 30) -> tuple[VecEnv, VecEnv]:
    ours = SB3VecEnv(EnvPool.from_envs(_fns(n, steps), envs_per_shard=3))   # shards 3 + 1
    return ours, DummyVecEnv(_fns(n, steps))


def _same_infos(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y), (x, y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_vecenv_contract_step_for_step_like_dummy_vec_env() -> None:
    ours, theirs = _pair()
    try:
        assert ours.observation_space == theirs.observation_space
        assert ours.action_space == theirs.action_space and ours.num_envs == N
        assert ours.seed(7) == theirs.seed(7)
        o1, o2 = ours.reset(), theirs.reset()
        np.testing.assert_array_equal(o1, o2)
        assert o1.dtype == o2.dtype
        _same_infos(ours.reset_infos, theirs.reset_infos)
        rng = np.random.default_rng(1)
        ends = truncs = 0
        for _ in range(150):
            acts = rng.integers(0, 2, N)
            a, b = ours.step(acts), theirs.step(acts)
            for x, y in zip(a[:3], b[:3]):
                np.testing.assert_array_equal(x, y)
                assert x.dtype == y.dtype
            _same_infos(a[3], b[3])
            _same_infos(ours.reset_infos, theirs.reset_infos)
            ends += int(a[2].sum())
            truncs += sum(i["TimeLimit.truncated"] for i in a[3])
        assert ends >= 15 and truncs >= 1      # terminations and time-limit truncations
        # the returned observation is a copy: the pool's next step does not change it
        keep = ours.step(np.zeros(N, np.int64))[0]
        before = keep.copy()
        ours.step(np.ones(N, np.int64))
        np.testing.assert_array_equal(keep, before)
    finally:
        ours.close()
        theirs.close()


def test_attributes_methods_and_wrappers() -> None:
    ours = SB3VecEnv(EnvPool.from_envs([lambda: Monitor(gym.make("CartPole-v1"))] * 3))
    try:
        assert ours.get_attr("spec", indices=[1])[0].id == "CartPole-v1"
        assert ours.env_is_wrapped(Monitor) == [True] * 3
        assert ours.env_is_wrapped(gym.wrappers.RecordVideo, indices=0) == [False]
        ours.set_attr("dsec_tag", "x", indices=[0, 2])
        assert ours.get_attr("dsec_tag", indices=[0, 2]) == ["x", "x"]
        assert ours.env_method("get_wrapper_attr", "np_random_seed", indices=[0]) == \
            ours.get_attr("np_random_seed", indices=[0])
        assert ours.has_attr("spec")
    finally:
        ours.close()


def test_sb3_wrappers_see_the_same_env() -> None:
    ours, theirs = _pair()
    w1 = VecNormalize(VecMonitor(ours), gamma=0.9)
    w2 = VecNormalize(VecMonitor(theirs), gamma=0.9)
    try:
        w1.seed(3)
        w2.seed(3)
        np.testing.assert_allclose(w1.reset(), w2.reset())
        rng = np.random.default_rng(2)
        for _ in range(80):
            acts = rng.integers(0, 2, N)
            a, b = w1.step(acts), w2.step(acts)
            for x, y in zip(a[:3], b[:3]):
                np.testing.assert_array_equal(x, y)
            assert [i.get("episode", {}).get("r") for i in a[3]] == \
                [i.get("episode", {}).get("r") for i in b[3]]
    finally:
        w1.close()
        w2.close()


def _ppo_weights(env: VecEnv) -> dict[str, Any]:
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=64, n_epochs=2, seed=0,
                device="cpu", policy_kwargs={"net_arch": [16]})
    model.learn(total_timesteps=32 * N * 3)
    return {k: v.clone() for k, v in model.policy.state_dict().items()}


def test_ppo_trains_identically_to_dummy_vec_env() -> None:
    torch.set_num_threads(1)
    ours, theirs = _pair()
    try:
        w_theirs = _ppo_weights(theirs)
        w_ours = _ppo_weights(ours)
    finally:
        ours.close()
        theirs.close()
    assert w_ours.keys() == w_theirs.keys()
    for k in w_ours:
        assert torch.equal(w_ours[k], w_theirs[k]), k
    # ... and training moved the weights (the comparison is not between two untouched
    # initialisations): a fresh model with the same seed differs
    ref = PPO("MlpPolicy", DummyVecEnv(_fns()), seed=0, device="cpu",
              policy_kwargs={"net_arch": [16]}).policy.state_dict()
    assert any(not torch.equal(ref[k], w_ours[k]) for k in w_ours)


def test_sandbox_pool_through_the_adapter(sim_access: EdgeAccess) -> None:
    tasks = [Task(prompt="say ok", max_turns=2,
                  judge=RegexJudge(r"ok", field="last_observation"))]
    venv = SB3VecEnv(SandboxEnvPool(sim_access, tasks, 2))
    try:
        obs = venv.reset()
        assert list(obs) == ["say ok"] * 2 and venv.reset_infos[0]["task"] == "task"
        venv.step_async(np.array(["echo ok", "echo no"], dtype=object))
        obs, rew, dones, infos = venv.step_wait()
        assert not dones.any() and infos[0] == {"infra_error": False,
                                                "TimeLimit.truncated": False}
        obs, rew, dones, infos = venv.step(np.array(["echo ok", "echo no"], dtype=object))
        assert dones.all() and rew.tolist() == [1.0, 0.0]
        assert [i["verdict"].passed for i in infos] == [True, False]
        assert [i["terminal_observation"] for i in infos] == ["ok\n[exit 0]", "no\n[exit 0]"]
        assert all(i["TimeLimit.truncated"] for i in infos)
        assert list(obs) == ["say ok"] * 2
        assert venv.get_attr("turn") == [0, 0]
    finally:
        venv.close()


def test_vector_infos_become_per_env_dicts() -> None:
    from dsec.rl.sb3 import _per_env

    infos = {"episode": {"r": np.array([1.0, 0.0]), "l": np.array([3, 0])},
             "_episode": np.array([True, False]),
             "x": np.array([5, 6]), "_x": np.array([False, True]), "plain": np.array([7, 8])}
    assert _per_env(infos, 0) == {"episode": {"r": 1.0, "l": 3}, "plain": 7}
    assert _per_env(infos, 1) == {"x": 6, "plain": 8}
