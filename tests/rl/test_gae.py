"""GAE: both kernels against the plain-Python reference, including dones everywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dsec.errors import InvalidArgument
from dsec.rl.gae import gae, gae_reference, numba_available

finite = st.floats(-10.0, 10.0, allow_nan=False, width=32)


@st.composite
def rollouts(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    t = draw(st.integers(1, 40))
    n = draw(st.integers(1, 5))
    rewards = draw(hnp.arrays(np.float64, (t, n), elements=finite))
    values = draw(hnp.arrays(np.float64, (t, n), elements=finite))
    dones = draw(hnp.arrays(np.bool_, (t, n)))
    last = draw(hnp.arrays(np.float64, (n,), elements=finite))
    return rewards, values, dones, last


def _ref(r: np.ndarray, v: np.ndarray, d: np.ndarray, lv: np.ndarray, g: float,
         lam: float) -> np.ndarray:
    return np.array(gae_reference(r.tolist(), v.tolist(), d.tolist(), lv.tolist(), g, lam))


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@settings(max_examples=150, deadline=None)
@given(data=rollouts(), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
def test_matches_reference(backend: str, data: tuple, gamma: float, lam: float) -> None:
    r, v, d, lv = data
    got = gae(r, v, d, lv, gamma, lam, backend=backend)  # type: ignore[arg-type]
    np.testing.assert_allclose(got, _ref(r, v, d, lv, gamma, lam), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_done_at_every_position(backend: str) -> None:
    """A done at step k cuts the recursion exactly there, for every k."""
    rng = np.random.default_rng(0)
    t, n = 12, 3
    r = rng.normal(size=(t, n)).astype(np.float32)
    v = rng.normal(size=(t, n)).astype(np.float32)
    lv = rng.normal(size=n).astype(np.float32)
    for k in range(t):
        d = np.zeros((t, n), dtype=bool)
        d[k] = True
        got = gae(r, v, d, lv, 0.97, 0.9, backend=backend)  # type: ignore[arg-type]
        assert got.dtype == np.float32
        want = _ref(r.astype(np.float64), v.astype(np.float64), d, lv.astype(np.float64),
                    0.97, 0.9)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # At the done step the advantage is the one-step TD error without bootstrap.
        np.testing.assert_allclose(got[k], r[k] - v[k], rtol=1e-6)
    all_done = gae(r, v, np.ones((t, n), bool), lv, 0.97, 0.9,
                   backend=backend)  # type: ignore[arg-type]
    np.testing.assert_allclose(all_done, r - v, rtol=1e-6)


def test_one_dimensional_and_out() -> None:
    r = np.array([1.0, 0.0, 2.0])
    v = np.array([0.5, 0.5, 0.5])
    d = np.array([False, True, False])
    got = gae(r, v, d, 1.0, 0.9, 0.8)
    want = _ref(r[:, None], v[:, None], d[:, None], np.array([1.0]), 0.9, 0.8)[:, 0]
    np.testing.assert_allclose(got, want)
    out = np.empty(3)
    assert gae(r, v, d, 1.0, 0.9, 0.8, out=out) is not None
    np.testing.assert_allclose(out, want)


def test_numba_and_numpy_agree_float32_large() -> None:
    rng = np.random.default_rng(1)
    r = rng.normal(size=(512, 16)).astype(np.float32)
    v = rng.normal(size=(512, 16)).astype(np.float32)
    d = rng.random((512, 16)) < 0.05
    lv = rng.normal(size=16).astype(np.float32)
    a = gae(r, v, d, lv, backend="numba")
    b = gae(r, v, d, lv, backend="numpy")
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"rewards": np.zeros((2, 2, 2))}, "must be"),
    ({"values": np.zeros(3)}, "values has shape"),
    ({"dones": np.zeros(5)}, "dones has shape"),
    ({"last_value": np.zeros(3)}, "last_value"),
    ({"gamma": 1.5}, "gamma"),
    ({"backend": "cuda"}, "backend"),
])
def test_bad_input(kwargs: dict, match: str) -> None:
    args = {"rewards": np.zeros((4, 2)), "values": np.zeros((4, 2)),
            "dones": np.zeros((4, 2), bool), "last_value": np.zeros(2)}
    args.update(kwargs)
    with pytest.raises(InvalidArgument, match=match):
        gae(**args)


def test_numba_present_here() -> None:
    # The dev/CI environment installs dsec[rl]; the auto backend must pick numba there.
    assert numba_available()


def test_fallback_without_numba() -> None:
    """With numba unimportable, auto falls back to numpy and 'numba' says what to install."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import numpy as np\n"
        "from dsec.rl.gae import gae, numba_available\n"
        "from dsec.errors import InvalidArgument\n"
        "assert not numba_available()\n"
        "a = gae(np.ones((3, 2)), np.zeros((3, 2)), np.zeros((3, 2), bool), np.zeros(2), 0.5, 1.0)\n"
        "assert np.allclose(a[0], 1.75), a\n"
        "try:\n"
        "    gae(np.ones((3, 2)), np.zeros((3, 2)), np.zeros((3, 2), bool), np.zeros(2), backend='numba')\n"
        "except InvalidArgument as e:\n"
        "    assert 'dsec[rl]' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         timeout=60, env={**os.environ})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


@pytest.mark.parametrize("wrong", ["values", "dones"])
def test_transposed_input_is_refused_not_misread(wrong: str) -> None:
    """(N, T) values or dones next to (T, N) rewards have the right size, but each env's
    values would be read across another env's time steps: refused by shape (issue 18)."""
    t, n = 6, 4
    args = {"rewards": np.ones((t, n)), "values": np.zeros((t, n)),
            "dones": np.zeros((t, n), bool), "last_value": np.zeros(n)}
    args[wrong] = np.asarray(args[wrong]).T.copy()
    with pytest.raises(InvalidArgument, match=f"{wrong} has shape \\(4, 6\\), rewards \\(6, 4\\)"):
        gae(**args)


def test_one_d_input_takes_a_scalar_last_value() -> None:
    a = gae(np.ones(3), np.zeros(3), np.zeros(3, bool), 0.0, 0.5, 1.0)
    assert a.shape == (3,) and a[0] == pytest.approx(1.75)
    with pytest.raises(InvalidArgument, match="last_value"):
        gae(np.ones(3), np.zeros(3), np.zeros(3, bool), np.zeros(3), 0.5, 1.0)
