"""Stable-Baselines3 adapter: an :class:`~dsec.rl.envpool.EnvPool` as an SB3 ``VecEnv``.

SB3's algorithms (PPO, A2C, DQN...) take a ``VecEnv`` whose contract differs from
Gymnasium's vector API; :class:`SB3VecEnv` translates, exactly as SB3's own
``DummyVecEnv`` behaves, so an algorithm cannot tell them apart (tested: PPO trained on
this adapter and on ``DummyVecEnv`` with the same seeds ends with bit-identical weights):

- ``reset()`` takes its seeds and options from ``seed()``/``set_options()`` and uses them
  once (then forgets them, as SB3 does); the per-env reset infos are in ``reset_infos``;
- ``step_wait()`` returns ``(obs, rewards, dones, infos)``: ``dones = terminated |
  truncated``, ``infos`` a list of one dict per env holding that env's step info, with
  ``terminal_observation`` (the last observation of a finished episode; the returned
  observation is already the new episode's) and ``TimeLimit.truncated`` (truncated and
  not terminated, for bootstrapping);
- observations, rewards and dones are copies (the pool reuses its arrays; SB3 keeps
  ``_last_obs`` across steps);
- ``get_attr``/``set_attr``/``env_method``/``env_is_wrapped`` reach the pool's envs
  (``GymShard`` envs one by one; other shards through the pool's ``get_attr``/``call``).

SB3 and PyTorch are the optional extra ``dsec[sb3]``; this module imports them on use.
On this machine class ``torch==2.13.0`` resolves to a CPU wheel on local disk (192 MB,
no download); from PyPI, an unpinned ``torch`` is a multi-GB CUDA build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from dsec.errors import InvalidArgument
from dsec.rl.envpool import EnvPool, GymShard

try:
    from stable_baselines3.common.vec_env import VecEnv
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"dsec.rl.sb3 needs stable-baselines3 (pip install 'dsec[sb3]'): "
                      f"{exc}") from exc

__all__ = ["SB3VecEnv"]

Array = npt.NDArray[Any]


def _per_env(infos: dict[str, Any], i: int) -> dict[str, Any]:
    """Env ``i``'s entries of a Gymnasium vector info dict (keys with a ``_key`` mask)."""
    out: dict[str, Any] = {}
    for k, v in infos.items():
        if k.startswith("_"):
            continue
        mask = infos.get(f"_{k}")
        if mask is not None and not mask[i]:
            continue
        if isinstance(v, dict):          # e.g. RecordEpisodeStatistics' "episode"
            sub = _per_env(v, i)
            if sub or mask is not None:
                out[k] = sub
            continue
        out[k] = v[i]
    return out


class SB3VecEnv(VecEnv):
    """An :class:`EnvPool` (or :class:`~dsec.rl.sandbox.SandboxEnvPool`) as an SB3
    ``VecEnv``; see the module docstring. Closing it closes the pool."""

    def __init__(self, pool: EnvPool) -> None:
        if not isinstance(pool, EnvPool):
            raise InvalidArgument(f"SB3VecEnv wraps a dsec EnvPool, not {type(pool).__name__}")
        self.pool = pool
        self._actions: Array | None = None
        # (gym env or None, shard, index in shard) for each env, for per-env attributes
        self._where: list[tuple[Any, Any, int]] = []
        for shard in pool.shards:
            for k in range(shard.num_envs):
                env = shard.envs[k] if isinstance(shard, GymShard) else None
                self._where.append((env, shard, k))
        super().__init__(pool.num_envs, pool.single_observation_space,
                         pool.single_action_space)

    # -- the VecEnv contract ---------------------------------------------------------

    def reset(self) -> Array:
        seeds = list(self._seeds)
        options = self._options
        if any(options):
            if any(o != options[0] for o in options):
                raise InvalidArgument("SB3VecEnv: per-env reset options differ; an EnvPool "
                                      "resets with one options dict for every env")
            opts: dict[str, Any] | None = dict(options[0])
        else:
            opts = None
        obs, infos = self.pool.reset(
            seed=seeds if any(s is not None for s in seeds) else None, options=opts)
        self.reset_infos = [_per_env(infos, i) for i in range(self.num_envs)]
        self._reset_seeds()       # seeds and options are used once, as in DummyVecEnv
        self._reset_options()
        return np.array(obs)

    def step_async(self, actions: Array) -> None:
        self._actions = actions
        self.pool.step_async(actions)

    def step_wait(self) -> tuple[Array, Array, Array, list[dict[str, Any]]]:
        obs, rew, term, trunc, infos = self.pool.step_wait()
        dones = term | trunc
        final = infos.get("final_info", {})
        out: list[dict[str, Any]] = []
        for i in range(self.num_envs):
            if dones[i]:
                info = _per_env(final, i)
                info["TimeLimit.truncated"] = bool(trunc[i] and not term[i])
                info["terminal_observation"] = np.array(self.pool.final_obs[i])
                reset_info = _per_env({k: v for k, v in infos.items()
                                       if k not in ("final_info", "_final_info",
                                                    "final_obs", "_final_obs")}, i)
                self.reset_infos[i] = reset_info
            else:
                info = _per_env(infos, i)
                info["TimeLimit.truncated"] = False
            out.append(info)
        return np.array(obs), rew.astype(np.float32), dones.copy(), out

    def close(self) -> None:
        self.pool.close()

    # -- per-env attributes ----------------------------------------------------------

    def _targets(self, indices: Any) -> list[int]:
        return list(self._get_indices(indices))

    def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
        idx = self._targets(indices)
        if all(self._where[i][0] is not None for i in idx):
            return [self._where[i][0].get_wrapper_attr(attr_name) for i in idx]
        try:
            every = self.pool.get_attr(attr_name)
        except InvalidArgument as exc:
            if attr_name == "render_mode":      # asked by VecEnv.__init__: none
                return [None] * len(idx)
            raise AttributeError(str(exc)) from exc   # what SB3's has_attr expects
        return [every[i] for i in idx]

    def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
        for i in self._targets(indices):
            env = self._where[i][0]
            if env is None:
                raise InvalidArgument(f"SB3VecEnv: env {i} is not a Gymnasium env (its shard "
                                      f"is {type(self._where[i][1]).__name__}); cannot set "
                                      f"{attr_name!r} on it")
            setattr(env, attr_name, value)

    def env_method(self, method_name: str, *method_args: Any, indices: Any = None,
                   **method_kwargs: Any) -> list[Any]:
        idx = self._targets(indices)
        if all(self._where[i][0] is not None for i in idx):
            return [self._where[i][0].get_wrapper_attr(method_name)(*method_args,
                                                                     **method_kwargs)
                    for i in idx]
        every = self.pool.call(method_name, *method_args, **method_kwargs)
        return [every[i] for i in idx]

    def env_is_wrapped(self, wrapper_class: type, indices: Any = None) -> list[bool]:
        from stable_baselines3.common import env_util

        return [self._where[i][0] is not None and
                env_util.is_wrapped(self._where[i][0], wrapper_class)
                for i in self._targets(indices)]

    def get_images(self) -> Sequence[Array | None]:
        return [None] * self.num_envs
