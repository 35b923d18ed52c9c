"""Generalised advantage estimation (GAE) with done resets.

Convention (the one the :class:`~dsec.rl.buffer.ReplayBuffer` stores): ``dones[t]`` is True
when the episode ended *after* the action of step ``t``, so step ``t`` must not bootstrap
from ``values[t + 1]`` (which belongs to the next episode) and the backward recursion
restarts there::

    delta[t] = rewards[t] + gamma * V[t + 1] * (1 - dones[t]) - values[t]
    adv[t]   = delta[t] + gamma * lam * (1 - dones[t]) * adv[t + 1]

with ``V[T] = last_value`` (the value of the observation after the last step).

Two implementations compute the same thing:

- a numba kernel (numba is the optional extra ``dsec[rl]``, imported lazily on first use
  and compiled with ``cache=True`` so later processes skip the ~1 s JIT);
- a numpy fallback that loops over T and vectorises over the N environments.

Measured on the 2-core dev VM (T=8192, N=64, float32; bench suite ``rl``; the range is
machine load): numba 0.44-0.81G transitions/s, numpy 21-38M/s (its cost is two numpy
calls per time step, not arithmetic).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from dsec.errors import InvalidArgument

__all__ = ["GaeBackend", "gae", "gae_reference", "numba_available"]

GaeBackend = Literal["auto", "numba", "numpy"]
Kernel = Callable[[Any, Any, Any, Any, Any, float, float], None]

_lock = threading.Lock()
_kernel: Kernel | None = None
_kernel_error: str | None = None


def _load_numba_kernel() -> Kernel | None:
    """Compile (or load from numba's on-disk cache) the kernel; None if numba is absent."""
    global _kernel, _kernel_error
    if _kernel is not None or _kernel_error is not None:
        return _kernel
    with _lock:
        if _kernel is not None or _kernel_error is not None:
            return _kernel
        try:
            numba = importlib.import_module("numba")
        except ImportError as exc:
            _kernel_error = f"numba is not installed ({exc}); install dsec[rl]"
            return None

        # cache=True: the compiled kernel is stored next to this file's __pycache__, so
        # only the first process on a machine pays the compile (~1 s); later ones ~50 ms.
        # No fastmath: results must match the numpy path and the reference bit-for-bit
        # up to float rounding order, and reassociation buys nothing in this loop.
        @numba.njit(cache=True, nogil=True)  # type: ignore[untyped-decorator]
        def kernel(rewards: Any, values: Any, dones: Any, last_value: Any, out: Any,
                   gamma: float, lam: float) -> None:
            t_len, n = rewards.shape
            next_adv = np.zeros(n, dtype=out.dtype)
            next_val = last_value.astype(out.dtype)
            for t in range(t_len - 1, -1, -1):
                for i in range(n):
                    nonterminal = 0.0 if dones[t, i] else 1.0
                    delta = rewards[t, i] + gamma * next_val[i] * nonterminal - values[t, i]
                    a = delta + gamma * lam * nonterminal * next_adv[i]
                    out[t, i] = a
                    next_adv[i] = a
                    next_val[i] = values[t, i]

        _kernel = kernel
        return _kernel


def numba_available() -> bool:
    """True when the numba kernel can be used (numba importable)."""
    return _load_numba_kernel() is not None


def _gae_numpy(rewards: npt.NDArray[Any], values: npt.NDArray[Any], dones: npt.NDArray[Any],
               last_value: npt.NDArray[Any], out: npt.NDArray[Any], gamma: float,
               lam: float) -> None:
    # The TD errors need no recursion, so they are computed for all T at once; the loop
    # over T is left with one multiply-add per step (3x faster than doing it all per step).
    dt = out.dtype.type
    nonterminal = 1.0 - dones.astype(out.dtype)
    next_values = np.empty_like(out)
    next_values[:-1] = values[1:]
    next_values[-1] = last_value
    delta = rewards + dt(gamma) * next_values * nonterminal - values
    decay = dt(gamma * lam) * nonterminal
    out[-1] = delta[-1]
    for t in range(rewards.shape[0] - 2, -1, -1):
        np.multiply(decay[t], out[t + 1], out=out[t])
        out[t] += delta[t]


def gae(
    rewards: npt.ArrayLike,
    values: npt.ArrayLike,
    dones: npt.ArrayLike,
    last_value: npt.ArrayLike,
    gamma: float = 0.99,
    lam: float = 0.95,
    *,
    backend: GaeBackend = "auto",
    out: npt.NDArray[np.floating[Any]] | None = None,
) -> npt.NDArray[np.floating[Any]]:
    """Advantages for step-major ``(T, N)`` (or ``(T,)``) rewards/values/dones.

    ``last_value`` has shape ``(N,)`` (or is a scalar for 1-D input). The result has the
    float dtype of ``rewards`` (float32 stays float32). ``backend="auto"`` uses numba when
    it is installed and numpy otherwise; naming a backend that is unavailable raises.
    Returns = advantages + values.
    """
    r = np.asarray(rewards)
    one_d = r.ndim == 1
    if one_d:
        r = r[:, None]
    if r.ndim != 2:
        raise InvalidArgument(f"gae: rewards must be (T,) or (T, N), got shape {r.shape}")
    dtype = r.dtype if r.dtype in (np.float32, np.float64) else np.dtype(np.float64)
    # Shapes, not sizes: (N, T) values with (T, N) rewards have the right size and give
    # silently wrong advantages (each env's values read across time of another).
    want = r.shape[:1] if one_d else r.shape
    for name, arr in (("values", values), ("dones", dones)):
        if np.shape(arr) != want:
            raise InvalidArgument(
                f"gae: {name} has shape {np.shape(arr)}, rewards {want}; pass every array "
                "step-major (T, N) (or (T,)), e.g. transpose episode-major (N, T) input")
    v = np.asarray(values, dtype=dtype).reshape(r.shape)
    d = np.asarray(dones).reshape(r.shape).astype(np.bool_, copy=False)
    lv_shape = np.shape(last_value)
    if lv_shape not in (((), (1,)) if one_d else ((r.shape[1],),)):
        raise InvalidArgument(f"gae: last_value has shape {lv_shape}, expected "
                              + ("a scalar for (T,) input" if one_d else f"({r.shape[1]},)"))
    lv = np.asarray(last_value, dtype=dtype).reshape(-1)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise InvalidArgument(f"gae: gamma={gamma} and lam={lam} must both lie in [0, 1]")
    r = np.ascontiguousarray(r, dtype=dtype)
    v = np.ascontiguousarray(v)
    if out is None:
        res = np.empty(r.shape, dtype=dtype)
    else:
        if out.shape != (r.shape if not one_d else r.shape[:1]) or out.dtype != dtype:
            raise InvalidArgument(
                f"gae: out has shape {out.shape} dtype {out.dtype}, expected {r.shape} {dtype}")
        res = out.reshape(r.shape)
    if backend not in ("auto", "numba", "numpy"):
        raise InvalidArgument(f"gae: backend={backend!r}; use 'auto', 'numba' or 'numpy'")
    kernel = _load_numba_kernel() if backend != "numpy" else None
    if backend == "numba" and kernel is None:
        raise InvalidArgument(f"gae: backend='numba' requested but {_kernel_error}")
    if kernel is not None:
        kernel(r, v, np.ascontiguousarray(d), lv, res, float(gamma), float(lam))
    else:
        _gae_numpy(r, v, d, lv, res, float(gamma), float(lam))
    return res[:, 0] if one_d else res


def gae_reference(rewards: list[list[float]], values: list[list[float]],
                  dones: list[list[bool]], last_value: list[float], gamma: float,
                  lam: float) -> list[list[float]]:
    """Plain-Python GAE over ``[t][env]`` lists: the specification the kernels are tested
    against. Deliberately written per environment as the textbook recursion."""
    t_len = len(rewards)
    n = len(last_value)
    adv = [[0.0] * n for _ in range(t_len)]
    for i in range(n):
        running = 0.0
        for t in reversed(range(t_len)):
            next_value = last_value[i] if t == t_len - 1 else values[t + 1][i]
            if dones[t][i]:
                running = rewards[t][i] - values[t][i]
            else:
                delta = rewards[t][i] + gamma * next_value - values[t][i]
                running = delta + gamma * lam * running
            adv[t][i] = running
    return adv
