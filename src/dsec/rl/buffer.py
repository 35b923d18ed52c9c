"""Step-major replay buffer for recurrent on-policy training (PPO with LSTM policies).

Layout: every field is a numpy ring of shape ``(capacity, num_envs, ...)``, so step ``t``
of all environments is one contiguous row. That is the order the rollout produces data
in (one :meth:`ReplayBuffer.add` per tick writes one row with a handful of ``memcpy``\\ s)
and the order :func:`~dsec.rl.gae.gae` walks backwards.

Episodes are cut continuously: the buffer never waits for an episode to end. A row
records, per environment, whether that step *starts* an episode (the first step ever, or
the step after a ``done``); the LSTM state stored for a start row is all zeros, because
that is the state the policy must have been given there. :meth:`ReplayBuffer.check` finds
rows that break those rules (a writer bug, a resumed rollout that forgot to reset its
state) and repairs what can be repaired.

Training reads an *episode-major* view, ``(num_envs, T, ...)`` (each env's trajectory is a
row, as PufferLib's trainer expects). :meth:`ReplayBuffer.episode_major` returns numpy
views that share memory with the ring - no copy - when

- the valid window does not wrap around the end of the ring (always true in the usual
  PPO pattern: fill ``capacity`` steps, train, :meth:`clear`), and
- the caller accepts a strided (transposed) array.

It must copy when the window wraps (the chronological order is two pieces of the ring)
or when ``contiguous=True`` is asked for (e.g. a framework that needs C-contiguous
memory to ``view``/pin it, or flattening ``(num_envs, T)`` into one axis: a transposed
array cannot be reshaped without a copy).

LSTM state at sequence starts only (``state_interval=K``, as R2D2 stores it): the four
state arrays then hold one row per ``K`` steps (physical rows ``0, K, 2K, ...``) and a
batch says which chronological steps they belong to (``Batch.state_steps``). A trainer
recomputes the states in between by running its LSTM from the stored one, resetting to
zeros at ``start`` rows - exactly what it does anyway to get gradients through time - and
gets bit-identical states (tests/rl/test_buffer.py checks that against ``K=1``). Measured
(64 envs, hidden 128, four states, one run on the loaded 2-core VM, load 7): every step
0.87M transitions/s, every 16th step 9.3M/s (10.8x): a per-step row is 2 KiB of state per
env, so ``K=1`` is bound by memory bandwidth; with ``K=16`` an ``add`` writes 128 B of
state per env on average and Python overhead dominates. A float16 ``state_dtype`` halves
the bytes but was slower still (0.35M/s: the float32->float16 conversion costs more than
the bytes it saves) and rounds the state (relative error ~5e-4); it is there for memory,
not speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from dsec.errors import InvalidArgument

__all__ = ["Batch", "ReplayBuffer", "Violation", "ViolationKind"]

Array = npt.NDArray[Any]
ViolationKind = Literal["hidden_at_start", "start_mismatch", "nonfinite"]

_SCALAR_FIELDS = ("reward", "done", "start", "logprob", "value")
_HIDDEN_FIELDS = ("actor_h", "actor_c", "critic_h", "critic_c")


@dataclass(slots=True, frozen=True)
class Violation:
    """One broken invariant at chronological row ``step`` (0 = oldest) of env ``env``."""

    kind: ViolationKind
    step: int
    env: int
    detail: str
    repaired: bool


@dataclass(slots=True)
class Batch:
    """Arrays of one layout (step-major ``(T, N, ...)`` or episode-major ``(N, T, ...)``).

    ``copied`` says whether the arrays are fresh copies or views into the ring (which the
    next :meth:`ReplayBuffer.add` may overwrite).
    """

    obs: Array
    action: Array
    reward: Array
    done: Array
    start: Array
    logprob: Array
    value: Array
    actor_h: Array | None
    actor_c: Array | None
    critic_h: Array | None
    critic_c: Array | None
    copied: bool
    extra: dict[str, Array] = field(default_factory=dict)
    # With ``state_interval > 1``: the step index (along T) of each stored state row;
    # ``None`` means one state row per step.
    state_steps: Array | None = None

    def arrays(self) -> dict[str, Array]:
        out = {k: getattr(self, k) for k in ("obs", "action", *_SCALAR_FIELDS)}
        out.update({k: getattr(self, k) for k in _HIDDEN_FIELDS if getattr(self, k) is not None})
        return out


class ReplayBuffer:
    """A ring of ``capacity`` steps for ``num_envs`` environments.

    ``hidden_size`` is the LSTM width of the actor (``None``: no recurrent state stored);
    ``critic_hidden_size`` defaults to the actor's (``None`` with an actor size means the
    critic shares the actor's state and nothing extra is stored). ``state_interval`` (steps,
    default 1 = every step) stores the state only at every ``state_interval``-th physical
    row, the start of a training sequence (R2D2); it must divide ``capacity``.
    ``state_dtype`` (default float32) is the dtype the state is stored in.
    """

    def __init__(
        self,
        *,
        num_envs: int,
        capacity: int,
        obs_shape: tuple[int, ...] = (),
        obs_dtype: npt.DTypeLike = np.float32,
        action_shape: tuple[int, ...] = (),
        action_dtype: npt.DTypeLike = np.int64,
        hidden_size: int | None = None,
        critic_hidden_size: int | None | Literal["same"] = "same",
        state_interval: int = 1,
        state_dtype: npt.DTypeLike = np.float32,
    ) -> None:
        if num_envs < 1 or capacity < 1:
            raise InvalidArgument(
                f"replay buffer needs num_envs >= 1 and capacity >= 1, got {num_envs}, {capacity}")
        if hidden_size is not None and hidden_size < 1:
            raise InvalidArgument(f"hidden_size={hidden_size} must be >= 1 or None")
        if state_interval < 1 or capacity % state_interval:
            raise InvalidArgument(
                f"state_interval={state_interval} must be >= 1 and divide "
                f"capacity={capacity} (states are kept at rows 0, K, 2K, ... of the ring)")
        self.state_interval = state_interval
        self.num_envs = num_envs
        self.capacity = capacity
        shape = (capacity, num_envs)
        self.obs: Array = np.zeros(shape + tuple(obs_shape), dtype=obs_dtype)
        self.action: Array = np.zeros(shape + tuple(action_shape), dtype=action_dtype)
        self.reward: Array = np.zeros(shape, dtype=np.float32)
        self.done: Array = np.zeros(shape, dtype=np.bool_)
        self.start: Array = np.zeros(shape, dtype=np.bool_)
        self.logprob: Array = np.zeros(shape, dtype=np.float32)
        self.value: Array = np.zeros(shape, dtype=np.float32)
        ch = hidden_size if critic_hidden_size == "same" else critic_hidden_size
        self.hidden_size = hidden_size
        self.critic_hidden_size = ch
        self.actor_h: Array | None = None
        self.actor_c: Array | None = None
        self.critic_h: Array | None = None
        self.critic_c: Array | None = None
        sshape = (capacity // state_interval, num_envs)
        if hidden_size is not None:
            self.actor_h = np.zeros(sshape + (hidden_size,), dtype=state_dtype)
            self.actor_c = np.zeros(sshape + (hidden_size,), dtype=state_dtype)
        if ch is not None:
            self.critic_h = np.zeros(sshape + (ch,), dtype=state_dtype)
            self.critic_c = np.zeros(sshape + (ch,), dtype=state_dtype)
        self._hidden = [a for a in (self.actor_h, self.actor_c, self.critic_h, self.critic_c)
                        if a is not None]
        self.ptr = 0                    # next physical row to write
        self.size = 0                   # valid rows (<= capacity)
        self.steps_added = 0            # rows ever written
        # Whether each env's *next* added step starts an episode: True before the first
        # step, then the done flag of the env's latest step.
        self.next_start: Array = np.ones(num_envs, dtype=np.bool_)

    # -- writing ---------------------------------------------------------------------

    def add(
        self,
        obs: npt.ArrayLike,
        action: npt.ArrayLike,
        reward: npt.ArrayLike,
        done: npt.ArrayLike,
        logprob: npt.ArrayLike = 0.0,
        value: npt.ArrayLike = 0.0,
        actor_h: npt.ArrayLike | None = None,
        actor_c: npt.ArrayLike | None = None,
        critic_h: npt.ArrayLike | None = None,
        critic_c: npt.ArrayLike | None = None,
    ) -> int:
        """Write one step of every env; returns the physical row written.

        The LSTM state is the *input* the policy saw at this step. At rows that start an
        episode it is stored as zeros whatever was passed (and the driver zeroes its own
        copy on done, so both agree); :meth:`check` reports rows where they would differ.
        With ``state_interval > 1`` the state is stored only at sequence-start rows and
        ignored at the others.
        """
        row = self.ptr
        k = self.state_interval
        srow = -1 if k > 1 and row % k else row // k
        try:
            self.obs[row] = obs
            self.action[row] = action
            self.reward[row] = reward
            self.done[row] = done
            self.logprob[row] = logprob
            self.value[row] = value
            if srow >= 0 and self.actor_h is not None:
                self.actor_h[srow] = 0.0 if actor_h is None else actor_h
                self.actor_c[srow] = 0.0 if actor_c is None else actor_c  # type: ignore[index]
            if srow >= 0 and self.critic_h is not None:
                ch = critic_h if critic_h is not None else actor_h
                cc = critic_c if critic_c is not None else actor_c
                self.critic_h[srow] = 0.0 if ch is None else ch
                self.critic_c[srow] = 0.0 if cc is None else cc  # type: ignore[index]
        except ValueError as exc:
            raise InvalidArgument(
                f"replay buffer add: an input does not fit a row of shape "
                f"(num_envs={self.num_envs}, ...): {exc}") from exc
        start = self.next_start
        self.start[row] = start
        if srow >= 0 and self._hidden and start.any():
            # Integer indices once, reused per state array: ~2x cheaper than a boolean
            # mask per array (measured at 64 envs x 128 hidden).
            idx = np.flatnonzero(start)
            for a in self._hidden:
                a[srow, idx] = 0.0
        np.copyto(self.next_start, self.done[row])
        self.ptr = row + 1 if row + 1 < self.capacity else 0
        if self.size < self.capacity:
            self.size += 1
        self.steps_added += 1
        return row

    def clear(self) -> None:
        """Drop the stored steps but keep episode continuity (``next_start``)."""
        self.ptr = 0
        self.size = 0

    # -- reading ---------------------------------------------------------------------

    @property
    def oldest(self) -> int:
        """Physical row of the oldest valid step."""
        return (self.ptr - self.size) % self.capacity

    @property
    def wrapped(self) -> bool:
        """True when the valid window is split across the end of the ring."""
        return self.size > 0 and self.oldest + self.size > self.capacity

    def _chrono(self, a: Array) -> tuple[Array, bool]:
        lo = self.oldest
        if lo + self.size <= self.capacity:
            return a[lo:lo + self.size], False
        return np.concatenate((a[lo:], a[: self.ptr])), True

    def _state_window(self) -> tuple[Array, Array]:
        """(state-ring slots, chronological step of each) for the valid window, oldest
        first (``state_interval > 1``)."""
        k, lo = self.state_interval, self.oldest
        t = np.arange(self.size)
        phys = (lo + t) % self.capacity
        keep = phys % k == 0
        return phys[keep] // k, t[keep]

    def _chrono_states(self, a: Array) -> tuple[Array, bool]:
        slots, _ = self._state_window()
        if len(slots) == 0 or int(slots[-1]) - int(slots[0]) == len(slots) - 1:
            lo = int(slots[0]) if len(slots) else 0
            return a[lo:lo + len(slots)], False
        return a[slots], True

    def step_major(self) -> Batch:
        """The valid steps, oldest first, as ``(T, N, ...)``; views unless wrapped.

        With ``state_interval > 1`` the state arrays are ``(S, N, H)``: the states stored
        at the sequence starts inside the window, at steps ``Batch.state_steps``.
        """
        fields: dict[str, Array | None] = {}
        copied = False
        sparse = self.state_interval > 1
        for name in ("obs", "action", *_SCALAR_FIELDS, *_HIDDEN_FIELDS):
            a = getattr(self, name)
            if a is None:
                fields[name] = None
                continue
            if sparse and name in _HIDDEN_FIELDS:
                fields[name], c = self._chrono_states(a)
                copied = copied or c
                continue
            fields[name], copied = self._chrono(a)
        steps = self._state_window()[1] if sparse else None
        return Batch(copied=copied, state_steps=steps, **fields)  # type: ignore[arg-type]

    def episode_major(self, *, contiguous: bool = False) -> Batch:
        """The valid steps as ``(N, T, ...)`` (env-major rows).

        Without ``contiguous`` these are transposed views of the ring (no copy) unless
        the window wraps; with it, C-contiguous copies (see the module docstring).
        """
        sm = self.step_major()
        copied = sm.copied or contiguous
        out: dict[str, Array | None] = {}
        for name in ("obs", "action", *_SCALAR_FIELDS, *_HIDDEN_FIELDS):
            a = getattr(sm, name)
            if a is None:
                out[name] = None
                continue
            t = np.swapaxes(a, 0, 1)
            out[name] = np.ascontiguousarray(t) if contiguous else t
        return Batch(copied=copied, state_steps=sm.state_steps,
                     **out)  # type: ignore[arg-type]

    def segments(self, horizon: int) -> Batch:
        """Episode-major data cut into BPTT segments: ``(N, T // horizon, horizon, ...)``.

        Still a view (a transposed ring split along T) when :meth:`episode_major` is;
        ``T`` must be a multiple of ``horizon``. With ``state_interval > 1`` the state
        arrays are ``(N, T // horizon, H)``: the state each segment starts from, so
        ``horizon`` must be a multiple of ``state_interval`` and the window must start at
        a sequence start.
        """
        if horizon < 1 or self.size % horizon:
            raise InvalidArgument(
                f"segments: horizon={horizon} must divide the {self.size} stored steps")
        k = self.state_interval
        if k > 1 and (horizon % k or self.oldest % k):
            raise InvalidArgument(
                f"segments: with state_interval={k} the horizon ({horizon}) must be a "
                f"multiple of it and the stored window must start at a sequence start "
                f"(it starts at ring row {self.oldest}); read after a multiple of "
                f"{k} steps, or use step_major() and Batch.state_steps")
        em = self.episode_major()
        out: dict[str, Array | None] = {}
        for name in ("obs", "action", *_SCALAR_FIELDS, *_HIDDEN_FIELDS):
            a = getattr(em, name)
            if a is not None and k > 1 and name in _HIDDEN_FIELDS:
                out[name] = a[:, :: horizon // k]
                continue
            out[name] = None if a is None else a.reshape(
                (self.num_envs, self.size // horizon, horizon) + a.shape[2:])
        return Batch(copied=em.copied, **out)  # type: ignore[arg-type]

    # -- invariants ------------------------------------------------------------------

    def check(self, *, repair: bool = False) -> list[Violation]:
        """Find rows breaking the buffer's invariants; with ``repair``, fix what can be.

        - ``start_mismatch``: a step's start flag disagrees with the previous step's
          done (repair: take the done flag, which is what the env reported);
        - ``hidden_at_start``: a start row holds a non-zero LSTM state (repair: zero it);
        - ``nonfinite``: NaN/inf in reward, value or logprob (reported, not repaired:
          there is no right value to put there; drop the rollout).
        """
        if self.size == 0:
            return []
        lo = self.oldest
        rows = (lo + np.arange(self.size)) % self.capacity   # chronological -> physical
        found: list[Violation] = []
        start = self.start[rows]
        done = self.done[rows]
        # The oldest row's predecessor may have been overwritten; only check t >= 1.
        bad_t, bad_n = np.nonzero(start[1:] != done[:-1])
        for t, n in zip(bad_t.tolist(), bad_n.tolist()):
            t += 1
            want = bool(done[t - 1, n])
            found.append(Violation("start_mismatch", t, n,
                                   f"start={not want} but the previous step's done={want}",
                                   repair))
            if repair:
                self.start[rows[t], n] = want
        if self._hidden:
            slots, steps = self._state_window()  # every step when k == 1
            start = self.start[rows][steps]  # after repair; only steps with a stored state
            nz = np.zeros(start.shape, dtype=np.bool_)
            for a in self._hidden:
                nz |= np.any(a[slots] != 0, axis=-1)
            bad_i, bad_n = np.nonzero(nz & start)
            for i, n in zip(bad_i.tolist(), bad_n.tolist()):
                found.append(Violation("hidden_at_start", int(steps[i]), n,
                                       "LSTM state is non-zero at an episode start", repair))
                if repair:
                    for a in self._hidden:
                        a[slots[i], n] = 0.0
        for name in ("reward", "value", "logprob"):
            vals = getattr(self, name)[rows]
            bad_t, bad_n = np.nonzero(~np.isfinite(vals))
            for t, n in zip(bad_t.tolist(), bad_n.tolist()):
                found.append(Violation("nonfinite", t, n,
                                       f"{name}={vals[t, n]!r} is not finite", False))
        return found
