"""The rollout loop: policy forward, env step, buffer write, recurrent-state bookkeeping.

One tick of :meth:`Driver.rollout`:

1. snapshot the model inputs (observation and LSTM state) - the pool's arrays are reused
   by the next step, and the buffer must hold exactly what the policy saw;
2. call the policy (any callable, see :class:`Policy`): a scripted deterministic one in
   tests, a model endpoint in training;
3. step every env through the :class:`~dsec.rl.envpool.EnvPool` (auto-reset);
4. write the step into the :class:`~dsec.rl.buffer.ReplayBuffer`;
5. take the policy's new LSTM state and zero the rows of envs that just finished, so the
   next forward of a new episode starts from zeros (the buffer checks the same rule).

Preemption (GPU taken away mid-rollout): :meth:`Driver.preempt` pauses every sandbox the
pool owns and returns a :class:`RolloutHandle` holding everything the loop needs to go
on - observations, LSTM states, episode counters and the pool's own state.
:func:`resume` continues from it with the same pool (same process) or, for sandbox pools,
with a pool rebuilt from the handle in a new trainer process
(``dsec.rl.sandbox.SandboxEnvPool.restore``). The handle serialises with
:meth:`RolloutHandle.to_bytes` (msgpack; arrays as raw bytes, text as strings).

A preemption notice arrives while a rollout runs (another thread, a SIGTERM handler):
call :meth:`Driver.request_preempt`, which only sets a flag (safe from a signal handler
and from any thread); the rollout honours it at the next tick boundary, preempts, and
returns early with ``stats.preempted`` and the handle in ``stats.handle``. ``preempt()``
itself is refused while a rollout is running: pausing the pool under a tick in flight
hung the tick or, from a signal handler, kept stepping a paused pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from dsec.errors import Conflict, InvalidArgument
from dsec.rl.buffer import ReplayBuffer
from dsec.rl.envpool import EnvPool
from dsec.rl.gae import gae

__all__ = ["Driver", "LstmState", "Policy", "PolicyOutput", "RolloutHandle", "RolloutStats",
           "resume"]

Array = npt.NDArray[Any]
LstmState = tuple[Array, Array]   # (h, c), each (num_envs, hidden)


@dataclass(slots=True)
class PolicyOutput:
    """What the policy returns for one batch of observations (one row per env)."""

    action: Array
    logprob: Array | None = None
    value: Array | None = None
    actor_state: LstmState | None = None    # state after this step (None: stateless)
    critic_state: LstmState | None = None


class Policy(Protocol):
    def __call__(self, obs: Array, actor_state: LstmState | None,
                 critic_state: LstmState | None) -> PolicyOutput: ...


@dataclass(slots=True)
class RolloutStats:
    steps: int = 0                                  # env steps (ticks * num_envs)
    episodes: int = 0
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    preempted: bool = False                         # stopped early by request_preempt()
    handle: RolloutHandle | None = None             # ... with this handle (paused)


class _ArrayBlob(msgspec.Struct, frozen=True):
    dtype: str
    shape: tuple[int, ...]
    data: bytes = b""
    text: list[str] | None = None       # object arrays (text observations)


def _pack(a: Array) -> _ArrayBlob:
    if a.dtype == object:
        return _ArrayBlob("object", a.shape, text=[str(x) for x in a.reshape(-1)])
    return _ArrayBlob(a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes())


def _unpack(b: _ArrayBlob) -> Array:
    if b.text is not None:
        out = np.empty(len(b.text), dtype=object)
        out[:] = b.text
        return out.reshape(b.shape)
    return np.frombuffer(b.data, dtype=np.dtype(b.dtype)).reshape(b.shape).copy()


class RolloutHandle(msgspec.Struct, kw_only=True):
    """Everything needed to continue a preempted rollout (see the module docstring)."""

    ticks: int
    obs: _ArrayBlob
    actor: list[_ArrayBlob] | None
    critic: list[_ArrayBlob] | None
    episode_return: _ArrayBlob
    episode_length: _ArrayBlob
    pool_state: bytes | None = None       # opaque; from the pool's export_state()
    paused: bool = False                  # taken by preempt(): resume() resumes sandboxes

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> RolloutHandle:
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"not a rollout handle ({len(data)} bytes): {exc}") from exc


class Driver:
    """Runs ``policy`` against ``pool`` and fills ``buffer`` (see the module docstring).

    ``bootstrap_gamma``: when set, a truncated (not terminated) episode's last reward gets
    ``gamma * V(final_obs)`` added, computed by one extra policy call on ticks with
    truncations (the standard fix for time-limit truncation). ``None`` leaves rewards as
    the env gave them.
    """

    def __init__(self, pool: EnvPool, policy: Policy, buffer: ReplayBuffer, *,
                 bootstrap_gamma: float | None = None) -> None:
        if buffer.num_envs != pool.num_envs:
            raise InvalidArgument(f"buffer holds {buffer.num_envs} envs but the pool steps "
                                  f"{pool.num_envs}; size them equally")
        self.pool = pool
        self.policy = policy
        self.buffer = buffer
        self.bootstrap_gamma = bootstrap_gamma
        n = pool.num_envs
        self.obs: Array = pool.obs.copy()
        self.actor: LstmState | None = None
        self.critic: LstmState | None = None
        if buffer.hidden_size is not None:
            self.actor = (np.zeros((n, buffer.hidden_size), np.float32),
                          np.zeros((n, buffer.hidden_size), np.float32))
        if buffer.critic_hidden_size is not None:
            self.critic = (np.zeros((n, buffer.critic_hidden_size), np.float32),
                           np.zeros((n, buffer.critic_hidden_size), np.float32))
        self.episode_return = np.zeros(n, dtype=np.float64)
        self.episode_length = np.zeros(n, dtype=np.int64)
        self.ticks = 0
        self.preempted = False
        self.started = False
        self.preempt_requested = False      # set by request_preempt(); a plain attribute
        self._rolling = threading.Lock()    # held by rollout(): preempt() is refused then

    def start(self, seed: int | None = None) -> None:
        """Reset every env and zero the recurrent state."""
        obs, _ = self.pool.reset(seed=seed)
        self.obs = obs.copy()
        for st in (self.actor, self.critic):
            if st is not None:
                st[0][:] = 0.0
                st[1][:] = 0.0
        self.episode_return[:] = 0.0
        self.episode_length[:] = 0
        self.started = True

    def rollout(self, ticks: int) -> RolloutStats:
        """Run ``ticks`` steps of every env; returns what finished meanwhile."""
        if self.preempted:
            raise Conflict("driver was preempted; continue with dsec.rl.driver.resume(handle)")
        if not self.started:
            raise Conflict("driver not started: call start(seed) before rollout()")
        if not self._rolling.acquire(blocking=False):
            raise Conflict("a rollout is already running on this driver")
        try:
            return self._rollout(ticks)
        finally:
            self._rolling.release()

    def _rollout(self, ticks: int) -> RolloutStats:
        stats = RolloutStats()
        buf = self.buffer
        for _ in range(ticks):
            if self.preempt_requested:                  # the tick boundary
                stats.handle = self._preempt()
                stats.preempted = True
                return stats
            obs = self.obs                              # driver-owned snapshot
            actor, critic = self.actor, self.critic
            out = self.policy(obs, actor, critic)
            next_obs, rew, term, trunc, _ = self.pool.step(out.action)
            done = self.pool.done                       # = infos["_final_obs"] if any
            reward = rew
            if self.bootstrap_gamma is not None and trunc.any():
                reward = self._bootstrap(rew, term, trunc, self.pool.final_obs, out)
            buf.add(obs, out.action, reward, done,
                    0.0 if out.logprob is None else out.logprob,
                    0.0 if out.value is None else out.value,
                    *(actor if actor is not None else (None, None)),
                    *(critic if critic is not None else (None, None)))
            self._advance_state(out, done)
            self.episode_return += rew
            self.episode_length += 1
            if done.any():
                idx = np.flatnonzero(done)
                stats.episodes += len(idx)
                stats.episode_returns += self.episode_return[idx].tolist()
                stats.episode_lengths += self.episode_length[idx].tolist()
                self.episode_return[idx] = 0.0
                self.episode_length[idx] = 0
            # Copy: the pool overwrites next_obs on its next step.
            self.obs = next_obs.copy()
            self.ticks += 1
            stats.steps += len(done)
        if self.preempt_requested:       # asked during the last tick: honour it now
            stats.handle = self._preempt()
            stats.preempted = True
        return stats

    def _advance_state(self, out: PolicyOutput, done: Array) -> None:
        for mine, new in ((self.actor, out.actor_state), (self.critic, out.critic_state)):
            if mine is None:
                continue
            if new is None:
                raise InvalidArgument("the buffer stores LSTM state but the policy returned "
                                      "none; return actor_state/critic_state from the policy")
            np.copyto(mine[0], new[0])
            np.copyto(mine[1], new[1])
            if done.any():        # zero before the next forward of the new episode
                mine[0][done] = 0.0
                mine[1][done] = 0.0

    def _bootstrap(self, rew: Array, term: Array, trunc: Array, final_obs: Array,
                   out: PolicyOutput) -> Array:
        boot = self.policy(final_obs, out.actor_state, out.critic_state)
        if boot.value is None:
            raise InvalidArgument("bootstrap_gamma is set but the policy returns no value")
        mask = trunc & ~term
        reward = rew.copy()
        reward[mask] += self.bootstrap_gamma * np.asarray(boot.value)[mask]
        return reward

    def last_value(self) -> Array:
        """The value of the current observations: GAE's bootstrap for the last step."""
        out = self.policy(self.obs, self.actor, self.critic)
        if out.value is None:
            return np.zeros(self.pool.num_envs, dtype=np.float32)
        return np.asarray(out.value, dtype=np.float32)

    def advantages(self, gamma: float = 0.99, lam: float = 0.95) -> tuple[Array, Array]:
        """``(advantages, returns)`` for the buffer's steps (step-major ``(T, N)``)."""
        sm = self.buffer.step_major()
        adv = gae(sm.reward, sm.value, sm.done, self.last_value(), gamma, lam)
        return adv, adv + sm.value

    # -- preemption ------------------------------------------------------------------

    def request_preempt(self) -> None:
        """Ask the running (or next) :meth:`rollout` to preempt at its next tick boundary.

        Only sets an attribute, so it is safe from a signal handler and from any thread;
        the rollout then returns early with ``stats.preempted`` and ``stats.handle``.
        """
        self.preempt_requested = True

    def preempt(self) -> RolloutHandle:
        """Pause every sandbox of the pool and capture the loop's state.

        Call between :meth:`rollout` calls. While a rollout is running (from another
        thread, or a signal handler that interrupted it mid-tick) it is refused with
        :class:`Conflict`: use :meth:`request_preempt` there. This driver refuses to
        step afterwards: continue with :func:`resume`.
        """
        if not self._rolling.acquire(blocking=False):
            raise Conflict("preempt() while a rollout is running (mid-tick) is refused: "
                           "call request_preempt(); the rollout preempts at the next tick "
                           "boundary and returns the handle in stats.handle")
        try:
            return self._preempt()
        finally:
            self._rolling.release()

    def _preempt(self) -> RolloutHandle:
        if self.preempted:
            raise Conflict("driver already preempted; resume the handle it returned")
        self.preempt_requested = False
        self.pool.pause()
        handle = self.checkpoint()
        handle.paused = True
        self.preempted = True
        return handle

    def checkpoint(self) -> RolloutHandle:
        """The loop's state as a handle, without pausing anything (the rollout goes on).

        A trainer that checkpoints periodically and later dies resumes from the last
        handle; with a :class:`~dsec.rl.commandlog.LoggedAccess` the commands issued
        since the checkpoint are answered from the log instead of running twice.
        """
        export = getattr(self.pool, "export_state", None)
        return RolloutHandle(
            ticks=self.ticks,
            obs=_pack(self.obs),
            actor=None if self.actor is None else [_pack(self.actor[0]), _pack(self.actor[1])],
            critic=None if self.critic is None else [_pack(self.critic[0]),
                                                     _pack(self.critic[1])],
            episode_return=_pack(self.episode_return),
            episode_length=_pack(self.episode_length),
            pool_state=export() if export is not None else None,
        )


def resume(handle: RolloutHandle, *, pool: EnvPool, policy: Policy,
           buffer: ReplayBuffer, bootstrap_gamma: float | None = None) -> Driver:
    """A driver that continues the preempted rollout ``handle`` on ``pool``.

    ``pool`` is the pool the rollout ran on (same process) or one rebuilt from
    ``handle.pool_state`` (sandbox pools: ``SandboxEnvPool.restore``); its sandboxes are
    resumed here.
    """
    d = Driver(pool, policy, buffer, bootstrap_gamma=bootstrap_gamma)
    obs = _unpack(handle.obs)
    if obs.shape[0] != pool.num_envs:
        raise InvalidArgument(f"rollout handle has {obs.shape[0]} envs but the pool has "
                              f"{pool.num_envs}; resume on the pool the rollout ran on")
    if handle.paused:
        pool.resume()
    d.obs = obs
    for name, blobs in (("actor", handle.actor), ("critic", handle.critic)):
        mine = getattr(d, name)
        if (blobs is None) != (mine is None):
            raise InvalidArgument(f"rollout handle {name} LSTM state does not match the "
                                  "buffer's hidden sizes; use the same buffer configuration")
        if blobs is not None:
            setattr(d, name, (_unpack(blobs[0]), _unpack(blobs[1])))
    d.episode_return = _unpack(handle.episode_return)
    d.episode_length = _unpack(handle.episode_length)
    d.ticks = handle.ticks
    d.started = True
    return d
