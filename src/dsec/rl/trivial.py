"""A trivial environment, as a Gymnasium env and as a vectorised :class:`BatchEnv`.

Used to measure the pool's own overhead (bench ``rl_env_steps_fast``) and in tests: the
observation is the step counter scaled to ``[0, 1]``, the action is 0 or 1, the reward is
1 when the action equals the parity of the step counter, and an episode terminates after
``episode_len`` steps. Both forms produce identical trajectories, so tests can check the
vectorised path against the per-env path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from dsec.errors import Conflict, InvalidArgument

__all__ = ["TrivialBatchEnv", "TrivialEnv"]

Array = npt.NDArray[Any]


def _spaces(episode_len: int) -> tuple[gym.spaces.Box, gym.spaces.Discrete]:
    return (gym.spaces.Box(0.0, 1.0, shape=(), dtype=np.float32), gym.spaces.Discrete(2))


class TrivialEnv(gym.Env[Any, Any]):
    """One trivial environment (see the module docstring)."""

    def __init__(self, episode_len: int = 16) -> None:
        if episode_len < 1:
            raise InvalidArgument(f"episode_len={episode_len} must be >= 1")
        self.episode_len = episode_len
        self.observation_space, self.action_space = _spaces(episode_len)
        self._t = 0

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return np.zeros((), dtype=np.float32), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        # Types as the spaces say (Gymnasium's checker): the observation is a 0-d float32
        # ndarray of the Box (not a numpy scalar), reward a Python float, flags Python bools.
        self._t += 1
        reward = 1.0 if int(action) == (self._t & 1) else 0.0
        # float32(t) * float32(1/L), exactly what the vectorised form computes.
        obs = np.array(np.float32(self._t) * np.float32(1.0 / self.episode_len),
                       dtype=np.float32)
        return obs, reward, bool(self._t >= self.episode_len), False, {}


class TrivialBatchEnv:
    """``num_envs`` trivial environments stepped with a handful of numpy ufuncs.

    Every operation writes into preallocated arrays (``out=``): at 16-64 envs a tick is
    dominated by per-call overhead (~0.5 us per ufunc), not by arithmetic.
    """

    def __init__(self, num_envs: int, episode_len: int = 16) -> None:
        if num_envs < 1 or episode_len < 1:
            raise InvalidArgument(
                f"TrivialBatchEnv needs num_envs >= 1 and episode_len >= 1, "
                f"got {num_envs}, {episode_len}")
        self.num_envs = num_envs
        self.episode_len = episode_len
        self.single_observation_space, self.single_action_space = _spaces(episode_len)
        self._t = np.zeros(num_envs, dtype=np.int64)
        self._parity = np.zeros(num_envs, dtype=np.int64)
        self._match = np.zeros(num_envs, dtype=np.bool_)
        self._scale = np.float32(1.0 / episode_len)
        self._out: tuple[Array, Array, Array, Array] | None = None

    def bind(self, obs: Array, rewards: Array, terminated: Array, truncated: Array) -> None:
        self._out = (obs, rewards, terminated, truncated)

    def reset_all(self, seed: int | Sequence[int | None] | None) -> None:
        obs = self._bound()[0]
        self._t[:] = 0
        obs[:] = 0.0

    def step(self, actions: Array) -> None:
        obs, rew, term, _ = self._bound()
        t = self._t
        t += 1
        np.bitwise_and(t, 1, out=self._parity)
        np.equal(actions, self._parity, out=self._match)
        np.copyto(rew, self._match)
        np.greater_equal(t, self.episode_len, out=term)
        np.multiply(t, self._scale, out=obs, casting="unsafe")

    def reset_envs(self, mask: Array) -> None:
        obs = self._bound()[0]
        self._t[mask] = 0
        obs[mask] = 0.0

    def close(self) -> None:
        pass

    def _bound(self) -> tuple[Array, Array, Array, Array]:
        if self._out is None:
            raise Conflict("TrivialBatchEnv is not bound to a pool; create it through EnvPool")
        return self._out
