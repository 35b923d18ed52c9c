"""ReplayBuffer: ring order, episode starts, zeroed LSTM state, views vs copies, checker."""

from __future__ import annotations

import numpy as np
import pytest

from dsec.errors import InvalidArgument
from dsec.rl.buffer import ReplayBuffer


def _fill(buf: ReplayBuffer, steps: int, done_every: int = 3) -> None:
    n = buf.num_envs
    for t in range(buf.steps_added, buf.steps_added + steps):
        done = np.array([(t + i) % done_every == done_every - 1 for i in range(n)])
        h = np.full((n, buf.hidden_size or 1), t + 1.0, np.float32)
        buf.add(obs=np.full((n, 2), t, np.float32), action=np.arange(n) + t,
                reward=np.full(n, t, np.float32), done=done, logprob=-float(t), value=t * 0.5,
                actor_h=h, actor_c=h * 2, critic_h=h * 3, critic_c=h * 4)


def _buf(capacity: int = 8, n: int = 3) -> ReplayBuffer:
    return ReplayBuffer(num_envs=n, capacity=capacity, obs_shape=(2,), hidden_size=4)


def test_step_major_layout_and_starts() -> None:
    buf = _buf()
    _fill(buf, 5)
    sm = buf.step_major()
    assert not sm.copied and sm.obs.shape == (5, 3, 2)
    assert np.shares_memory(sm.obs, buf.obs)
    assert sm.reward[:, 0].tolist() == [0, 1, 2, 3, 4]
    # Row t of all envs is contiguous in memory (step-major).
    assert buf.reward[1].flags.c_contiguous and buf.reward.strides[0] == 3 * 4
    # start[t] == done[t-1]; first row starts everywhere.
    assert sm.start[0].all()
    np.testing.assert_array_equal(sm.start[1:], sm.done[:-1])
    # LSTM state is zero exactly at starts, as given elsewhere.
    for a in (sm.actor_h, sm.actor_c, sm.critic_h, sm.critic_c):
        assert a is not None
        assert (a[sm.start] == 0).all()
        assert (a[~sm.start] != 0).all()
    assert buf.check() == []


def test_episode_major_is_a_view_until_it_must_copy() -> None:
    buf = _buf(capacity=6)
    _fill(buf, 6)
    em = buf.episode_major()
    assert em.obs.shape == (3, 6, 2) and not em.copied
    assert np.shares_memory(em.reward, buf.reward)
    assert em.reward[1].tolist() == [0, 1, 2, 3, 4, 5]
    seg = buf.segments(3)
    assert seg.reward.shape == (3, 2, 3) and np.shares_memory(seg.reward, buf.reward)
    assert seg.reward[2, 1].tolist() == [3, 4, 5]
    c = buf.episode_major(contiguous=True)
    assert c.copied and c.obs.flags.c_contiguous and not np.shares_memory(c.obs, buf.obs)
    np.testing.assert_array_equal(c.obs, em.obs)
    # Wrap the ring: now the chronological window is two pieces, so it must copy.
    _fill(buf, 2)
    assert buf.wrapped
    em2 = buf.episode_major()
    assert em2.copied and em2.reward[0].tolist() == [2, 3, 4, 5, 6, 7]
    assert buf.check() == []
    buf.clear()
    assert buf.size == 0 and buf.step_major().obs.shape == (0, 3, 2)
    with pytest.raises(InvalidArgument, match="horizon"):
        _fill(buf, 4)
        buf.segments(3)


def test_continuous_cutting_across_clear() -> None:
    """An episode running across a clear() does not restart at the new rollout."""
    buf = ReplayBuffer(num_envs=1, capacity=4, hidden_size=2)
    h = np.ones((1, 2), np.float32)
    buf.add(0.0, 0, 0.0, False, actor_h=h, actor_c=h)
    buf.clear()
    buf.add(1.0, 0, 0.0, True, actor_h=h, actor_c=h)
    buf.add(2.0, 0, 0.0, False, actor_h=h, actor_c=h)
    sm = buf.step_major()
    assert sm.start[:, 0].tolist() == [False, True]
    assert sm.actor_h is not None and sm.actor_h[0, 0].tolist() == [1, 1]
    assert sm.actor_h[1, 0].tolist() == [0, 0]


def test_checker_finds_and_repairs() -> None:
    buf = _buf()
    _fill(buf, 6)
    # Corrupt as a buggy writer would: state leaks into a start row, a start flag is lost,
    # a NaN reward.
    starts = np.argwhere(buf.start[: buf.size])
    t0, n0 = starts[-1]
    buf.actor_h[t0, n0] = 7.0  # type: ignore[index]
    t1, n1 = 4, 0
    buf.start[t1, n1] = not buf.done[t1 - 1, n1]
    buf.reward[2, 2] = np.nan
    found = buf.check()
    kinds = sorted((v.kind, v.step, v.env) for v in found)
    assert ("hidden_at_start", int(t0), int(n0)) in kinds
    assert ("start_mismatch", t1, n1) in kinds
    assert ("nonfinite", 2, 2) in kinds
    assert all(not v.repaired for v in found)
    repaired = buf.check(repair=True)
    assert {v.kind for v in repaired if v.repaired} >= {"hidden_at_start", "start_mismatch"}
    left = buf.check()
    assert [v.kind for v in left] == ["nonfinite"]
    sm = buf.step_major()
    np.testing.assert_array_equal(sm.start[1:], sm.done[:-1])
    assert sm.actor_h is not None and (sm.actor_h[sm.start] == 0).all()


def test_checker_uses_chronological_steps_when_wrapped() -> None:
    buf = _buf(capacity=4)
    _fill(buf, 6)
    assert buf.wrapped and buf.check() == []
    phys = (buf.oldest + 2) % buf.capacity
    buf.start[phys, 1] = not buf.start[phys, 1]
    [v] = buf.check(repair=True)
    assert (v.kind, v.step, v.env) == ("start_mismatch", 2, 1)
    assert buf.check() == []


def test_bad_input() -> None:
    with pytest.raises(InvalidArgument):
        ReplayBuffer(num_envs=0, capacity=4)
    buf = _buf()
    with pytest.raises(InvalidArgument, match="num_envs=3"):
        buf.add(np.zeros((5, 2)), 0, 0.0, False)
    assert buf.size == 0


def test_no_hidden_state() -> None:
    buf = ReplayBuffer(num_envs=2, capacity=3, hidden_size=None)
    buf.add([0.0, 1.0], [1, 0], [1.0, 0.0], [True, False])
    em = buf.episode_major()
    assert em.actor_h is None and em.critic_h is None
    assert set(em.arrays()) == {"obs", "action", "reward", "done", "start", "logprob", "value"}


# -- LSTM state at sequence starts only (R2D2) -------------------------------------------

def _lstm_step(w: np.ndarray, x: np.ndarray, h: np.ndarray,
               c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A real LSTM cell in float32 (gates i, f, g, o from [x, h] @ w)."""
    z = np.concatenate([x, h], axis=1) @ w
    hs = h.shape[1]
    i, f, g, o = (z[:, j * hs:(j + 1) * hs] for j in range(4))
    sig = lambda v: (1.0 / (1.0 + np.exp(-v))).astype(np.float32)
    c2 = (sig(f) * c + sig(i) * np.tanh(g)).astype(np.float32)
    return (sig(o) * np.tanh(c2)).astype(np.float32), c2


def _roll(bufs: list[ReplayBuffer], steps: int, seed: int = 0) -> None:
    """The driver's loop: state in, step, reset on done; the same data into every buffer."""
    rng = np.random.default_rng(seed)
    n, hs, od = bufs[0].num_envs, bufs[0].hidden_size or 1, 2
    w = rng.normal(scale=0.5, size=(od + hs, 4 * hs)).astype(np.float32)
    h = np.zeros((n, hs), np.float32)
    c = np.zeros((n, hs), np.float32)
    for _ in range(steps):
        obs = rng.normal(size=(n, od)).astype(np.float32)
        done = rng.random(n) < 0.15
        for b in bufs:
            b.add(obs, 0, 1.0, done, actor_h=h, actor_c=c)
        h, c = _lstm_step(w, obs, h, c)
        h[done] = 0.0
        c[done] = 0.0
    for b in bufs:
        b.w = w  # type: ignore[attr-defined]


def _unroll(buf: ReplayBuffer) -> tuple[np.ndarray, np.ndarray]:
    """Every step's state recomputed from the stored sequence-start states, resetting
    at start rows (what a trainer does for BPTT)."""
    sm = buf.step_major()
    assert sm.state_steps is not None and sm.actor_h is not None and sm.actor_c is not None
    t_len, n = sm.reward.shape
    out_h = np.full((t_len, n, buf.hidden_size or 1), np.nan, np.float32)
    out_c = out_h.copy()
    h = c = None
    stored = dict(zip(sm.state_steps.tolist(), range(len(sm.state_steps))))
    for t in range(t_len):
        if t in stored:
            h, c = sm.actor_h[stored[t]].copy(), sm.actor_c[stored[t]].copy()
        elif h is not None:
            assert c is not None
            h, c = _lstm_step(buf.w, sm.obs[t - 1], h, c)  # type: ignore[attr-defined]
        if h is None or c is None:
            continue  # before the first stored state of a window that starts mid-sequence
        h[sm.start[t]] = 0.0
        c[sm.start[t]] = 0.0
        out_h[t], out_c[t] = h, c
    return out_h, out_c


@pytest.mark.parametrize("steps", [16, 37, 64])  # fills, wraps mid-sequence, wraps twice
def test_sequence_start_states_recompute_every_step_exactly(steps: int) -> None:
    full = ReplayBuffer(num_envs=5, capacity=24, obs_shape=(2,), hidden_size=6,
                        critic_hidden_size=None)
    sparse = ReplayBuffer(num_envs=5, capacity=24, obs_shape=(2,), hidden_size=6,
                          critic_hidden_size=None, state_interval=4)
    assert sparse.actor_h is not None and sparse.actor_h.shape == (6, 5, 6)
    _roll([full, sparse], steps)
    fm, sm = full.step_major(), sparse.step_major()
    assert sm.state_steps is not None and fm.state_steps is None
    phys = (sparse.oldest + sm.state_steps) % sparse.capacity
    assert (phys % 4 == 0).all() and len(sm.state_steps) == len(set(phys.tolist()))
    np.testing.assert_array_equal(fm.start, sm.start)
    # the stored rows are the full buffer's rows, zero at episode starts
    assert fm.actor_h is not None and sm.actor_h is not None
    np.testing.assert_array_equal(sm.actor_h, fm.actor_h[sm.state_steps])
    assert (sm.actor_h[sm.start[sm.state_steps]] == 0).all()
    # and every other step's state is recomputed bit for bit (LSTM resets included)
    uh, uc = _unroll(sparse)
    first = int(sm.state_steps[0])
    assert fm.actor_c is not None
    np.testing.assert_array_equal(uh[first:], fm.actor_h[first:])
    np.testing.assert_array_equal(uc[first:], fm.actor_c[first:])
    assert np.isnan(uh[:first]).all()
    assert sparse.check() == [] and full.check() == []
    # the episode-major view carries the same rows, env-major
    em = sparse.episode_major()
    assert em.actor_h is not None and em.state_steps is not None
    np.testing.assert_array_equal(em.actor_h, np.swapaxes(sm.actor_h, 0, 1))


def test_sequence_start_segments_and_checker() -> None:
    buf = ReplayBuffer(num_envs=3, capacity=8, obs_shape=(2,), hidden_size=4, state_interval=2)
    _fill(buf, 8)
    seg = buf.segments(4)
    assert seg.actor_h is not None and seg.actor_h.shape == (3, 2, 4)
    sm = buf.step_major()
    assert sm.actor_h is not None
    np.testing.assert_array_equal(seg.actor_h[:, 1], sm.actor_h[2])  # step 4 = slot 2
    assert np.shares_memory(seg.actor_h, buf.actor_h)
    with pytest.raises(InvalidArgument, match="multiple"):
        buf.segments(1)
    # a leaked state at a stored start row is found at its chronological step, repaired
    assert sm.state_steps is not None
    starts = np.argwhere(sm.start[sm.state_steps])
    i, n = starts[-1]
    buf.critic_c[i, n] = 3.0  # type: ignore[index]
    [v] = buf.check(repair=True)
    assert (v.kind, v.step, v.env, v.repaired) == ("hidden_at_start", int(sm.state_steps[i]),
                                                   int(n), True)
    assert buf.check() == []
    _fill(buf, 3)  # window now starts mid-sequence
    with pytest.raises(InvalidArgument, match="sequence start"):
        buf.segments(4)
    with pytest.raises(InvalidArgument, match="divide"):
        ReplayBuffer(num_envs=1, capacity=10, hidden_size=2, state_interval=4)
