"""EnvPool is a gymnasium.vector.VectorEnv (issue 18, section 5): checked step for step
against Gymnasium's own SyncVectorEnv (same-step autoreset), through Gymnasium's vector
wrappers, and with the sandbox pool's verdicts in final_info."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.wrappers.vector import ClipReward, RecordEpisodeStatistics

from dsec.errors import InvalidArgument
from dsec.rl.access import EdgeAccess
from dsec.rl.envpool import EnvPool
from dsec.rl.judges import RegexJudge
from dsec.rl.sandbox import SandboxEnvPool, Task
from dsec.rl.trivial import TrivialBatchEnv, TrivialEnv

N = 6


def _cartpoles(n: int = N) -> list[Any]:
    return [lambda: gym.make("CartPole-v1", max_episode_steps=40)] * n


def _pair() -> tuple[VectorEnv, VectorEnv]:
    ours = EnvPool.from_envs(_cartpoles(), envs_per_shard=4)        # two shards: 4 + 2
    theirs = SyncVectorEnv(_cartpoles(), autoreset_mode=AutoresetMode.SAME_STEP)
    return ours, theirs


def _same_infos(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b), (sorted(a), sorted(b))
    for k, v in a.items():
        if k == "episode":          # RecordEpisodeStatistics: r, l equal; t is wall time
            for f in ("r", "l"):
                np.testing.assert_array_equal(v[f], b[k][f], err_msg=f"episode.{f}")
        elif k == "final_obs":
            mask = a["_final_obs"]
            np.testing.assert_array_equal(np.stack(v[mask]), np.stack(b[k][mask]))
        elif isinstance(v, dict):
            _same_infos(v, b[k])
        else:
            np.testing.assert_array_equal(v, b[k], err_msg=k)


@pytest.mark.parametrize("seed", [3, [10, 11, 12, 13, 14, 15]], ids=["int", "list"])
def test_step_for_step_equal_to_gymnasium_sync_vector_env(seed: Any) -> None:
    ours, theirs = (RecordEpisodeStatistics(e) for e in _pair())
    try:
        assert ours.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
        assert ours.observation_space == theirs.observation_space
        assert ours.action_space == theirs.action_space
        assert ours.single_observation_space == theirs.single_observation_space
        o1, i1 = ours.reset(seed=seed)
        o2, i2 = theirs.reset(seed=seed)
        np.testing.assert_array_equal(o1, o2)
        _same_infos(i1, i2)
        rng = np.random.default_rng(0)
        episodes = 0
        for _ in range(120):
            acts = rng.integers(0, 2, N)
            a = ours.step(acts)
            b = theirs.step(acts)
            for x, y in zip(a[:4], b[:4]):
                np.testing.assert_array_equal(x, y)
            assert a[0] in ours.observation_space
            _same_infos(a[4], b[4])
            episodes += int(a[4].get("_episode", np.zeros(N, bool)).sum())
        assert episodes >= 10            # many episode ends (terminations and time limits)
        assert list(ours.return_queue) == list(theirs.return_queue)
    finally:
        ours.close()
        theirs.close()


def test_partial_reset_and_attribute_access_like_gymnasium() -> None:
    ours, theirs = _pair()
    try:
        ours.reset(seed=1)
        theirs.reset(seed=1)
        mask = np.array([True, False, False, False, True, False])
        o1, i1 = ours.reset(seed=[7, None, None, None, 9, None],
                            options={"reset_mask": mask})
        o2, i2 = theirs.reset(seed=[7, None, None, None, 9, None],
                              options={"reset_mask": mask.copy()})
        np.testing.assert_array_equal(o1, o2)
        _same_infos(i1, i2)
        assert ours.get_attr("spec") == theirs.get_attr("spec")
        assert ours.call("get_wrapper_attr", "np_random_seed") == \
            theirs.call("get_wrapper_attr", "np_random_seed")
        ours.set_attr("dsec_tag", [f"t{i}" for i in range(N)])
        assert ours.get_attr("dsec_tag") == tuple(f"t{i}" for i in range(N))
        with pytest.raises(InvalidArgument, match="seeds for 6"):
            ours.reset(seed=[1, 2])
        with pytest.raises(InvalidArgument, match="reset_mask"):
            ours.reset(options={"reset_mask": np.ones(3, bool)})
    finally:
        ours.close()
        theirs.close()
    assert ours.closed


def test_vector_wrappers_and_batched_envs() -> None:
    pool = ClipReward(RecordEpisodeStatistics(EnvPool([TrivialBatchEnv(4, episode_len=3)])),
                      min_reward=0.0, max_reward=0.5)
    try:
        pool.reset(seed=0)
        for t in range(3):
            _, rew, term, _, infos = pool.step(np.full(4, (t + 1) & 1))
        assert term.all() and rew.tolist() == [0.5] * 4
        assert infos["episode"]["r"].tolist() == [3.0] * 4 and infos["_episode"].all()
        assert infos["_final_info"].all() and infos["final_info"] == {}
        assert pool.unwrapped.get_attr("episode_len") == (3, 3, 3, 3)   # one per shard
    finally:
        pool.close()
    single = EnvPool.from_envs([lambda: TrivialEnv(2)] * 2)
    try:
        obs, _ = single.reset(seed=0)
        assert obs in single.observation_space
        _, _, term, _, infos = single.step(np.array([1, 1]))
        assert "_final_info" not in infos and not term.any()
    finally:
        single.close()


def test_sandbox_pool_verdicts_are_in_final_info(sim_access: EdgeAccess) -> None:
    tasks = [Task(prompt="say ok", max_turns=2,
                  judge=RegexJudge(r"ok", field="last_observation"))]
    pool = RecordEpisodeStatistics(SandboxEnvPool(sim_access, tasks, 3))
    try:
        _, infos = pool.reset(seed=0)
        assert infos["_sandbox_id"].all() and len(set(infos["sandbox_id"])) == 3
        _, rew, _, _, infos = pool.step(["echo ok", "echo no", "echo ok"])
        assert "final_info" not in infos and infos["infra_error"].tolist() == [False] * 3
        _, rew, _, trunc, infos = pool.step(["echo ok", "echo no", "echo no"])
        assert trunc.all() and rew.tolist() == [1.0, 0.0, 0.0]
        fin = infos["final_info"]
        assert fin["_verdict"].all() and [v.passed for v in fin["verdict"]] == \
            [True, False, False]
        assert fin["infra_error"].tolist() == [False] * 3
        assert infos["episode"]["r"].tolist() == [1.0, 0.0, 0.0]
        assert infos["_sandbox_id"].all()             # the new episodes' reset infos
        assert pool.unwrapped.get_attr("turn") == (0, 0, 0)
        with pytest.raises(InvalidArgument, match="no per-env attribute"):
            pool.unwrapped.get_attr("nope")
        with pytest.raises(InvalidArgument, match="not \\['seed_me'\\]"):
            pool.reset(options={"seed_me": 1})
        with pytest.raises(InvalidArgument, match="names 0 of the tasks"):
            pool.reset(options={"task": "x"})
    finally:
        pool.close()


def test_reset_option_picks_the_task(sim_access: EdgeAccess) -> None:
    tasks = [Task(prompt=f"task {k}", name=f"t{k}", max_turns=2) for k in range(4)]
    pool = SandboxEnvPool(sim_access, tasks, 3)
    try:
        obs, infos = pool.reset(seed=0, options={"task": "t2"})
        assert list(obs) == ["task 2"] * 3 and list(infos["task"]) == ["t2"] * 3
        mask = np.array([False, True, False])
        obs, infos = pool.reset(options={"reset_mask": mask, "task": 3})
        assert list(obs) == ["task 2", "task 3", "task 2"]
        assert infos["_task"].tolist() == [False, True, False]
        with pytest.raises(InvalidArgument, match="out of range"):
            pool.reset(options={"task": 9})
    finally:
        pool.close()
