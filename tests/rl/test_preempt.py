"""Preemptible sandbox rollouts: pause/resume mid-episode, and a reconnecting trainer
replaying from a checkpoint gets logged results instead of re-running commands."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from dsec.edge.node import EdgeNode
from dsec.errors import Conflict, NotFound
from dsec.ids import node_of
from dsec.rl.access import EdgeAccess
from dsec.rl.buffer import ReplayBuffer
from dsec.rl.commandlog import (
    CommandInDoubt,
    CommandLog,
    LoggedAccess,
    ReplayDiverged,
    request_digest,
)
from dsec.rl.driver import Driver, LstmState, PolicyOutput, RolloutHandle, resume
from dsec.rl.judges import ExecutableJudge, RegexJudge
from dsec.rl.sandbox import SandboxEnvPool, Task
from dsec.wire.spec import ExecRequest

N = 3
TASKS = [Task(prompt="append numbers to /workspace/log", max_turns=5,
              judge=RegexJudge(r"^3\n", field="last_observation"), name="t0"),
         Task(prompt="same, other task", max_turns=5,
              judge=RegexJudge(r"4", field="last_observation"), name="t1")]


class CounterPolicy:
    """Non-idempotent commands driven by the recurrent state (c counts turns, zeroed on
    done by the driver): ``echo <c> >> log; cat log``."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    def __call__(self, obs: np.ndarray, actor: LstmState | None,
                 critic: LstmState | None) -> PolicyOutput:
        assert actor is not None
        h, c = actor
        nc = c + 1.0
        acts = np.empty(len(obs), dtype=object)
        acts[:] = [f"echo {self.tag}{int(nc[i, 0])} >> /workspace/log; cat /workspace/log"
                   for i in range(len(obs))]
        return PolicyOutput(action=acts, value=nc[:, 0].astype(np.float32),
                            actor_state=(h + 1.0, nc), critic_state=(h + 1.0, nc))


def _buf() -> ReplayBuffer:
    return ReplayBuffer(num_envs=N, capacity=32, obs_dtype=object, action_dtype=object,
                        hidden_size=1)


def _logs(access: Any, pool: SandboxEnvPool) -> list[bytes]:
    return [access.read_file(sid, "/workspace/log") for sid in pool.sandbox_ids()]


def _assert_same(a: ReplayBuffer, b: ReplayBuffer) -> None:
    for name, arr in a.step_major().arrays().items():
        np.testing.assert_array_equal(b.step_major().arrays()[name], arr, err_msg=name)


@pytest.fixture
def pools(sim_access: EdgeAccess) -> Iterator[list[SandboxEnvPool]]:
    made: list[SandboxEnvPool] = []
    try:
        yield made
    finally:
        for p in made:
            p.close()


def test_preempt_mid_episode_then_resume_equals_uninterrupted(
        sim_access: EdgeAccess, sim_nodes: dict[str, EdgeNode],
        pools: list[SandboxEnvPool]) -> None:
    ref_pool = SandboxEnvPool(sim_access, TASKS, N)
    pools.append(ref_pool)
    ref = Driver(ref_pool, CounterPolicy(), _buf())
    ref.start(seed=5)
    ref.rollout(8)          # crosses an episode boundary (max_turns=5)

    pool = SandboxEnvPool(sim_access, TASKS, N)
    pools.append(pool)
    buf = _buf()
    d = Driver(pool, CounterPolicy(), buf)
    d.start(seed=5)
    d.rollout(3)
    handle = RolloutHandle.from_bytes(d.preempt().to_bytes())
    for sid in pool.sandbox_ids():
        assert sid is not None and sim_nodes[node_of(sid)].get(sid).state == "paused"
    d2 = resume(handle, pool=pool, policy=CounterPolicy(), buffer=buf)
    for sid in pool.sandbox_ids():
        assert sim_nodes[node_of(sid)].get(sid).state == "running"  # type: ignore[arg-type]
    d2.rollout(5)
    _assert_same(ref.buffer, buf)
    assert _logs(sim_access, pool) == _logs(sim_access, ref_pool)
    assert _logs(sim_access, pool)[0] == b"1\n2\n3\n"   # second episode, 3 turns in
    assert buf.check() == []


def test_reconnecting_trainer_replays_from_log_without_rerunning(
        sim_access: EdgeAccess, tmp_path: Any, pools: list[SandboxEnvPool]) -> None:
    ref_pool = SandboxEnvPool(sim_access, TASKS, N)
    pools.append(ref_pool)
    ref = Driver(ref_pool, CounterPolicy(), _buf())
    ref.start(seed=9)
    ref.rollout(4)

    path = str(tmp_path / "commands.log")
    acc_a = LoggedAccess(sim_access, CommandLog(path))
    pool_a = SandboxEnvPool(acc_a, TASKS, N)
    pools.append(pool_a)
    da = Driver(pool_a, CounterPolicy(), _buf())
    da.start(seed=9)
    da.rollout(1)
    saved = da.checkpoint().to_bytes()       # trainer A checkpoints ...
    da.rollout(2)                            # ... runs on, then dies without a word
    acc_a.log.close()
    assert _logs(sim_access, pool_a)[0] == b"1\n2\n3\n"

    # Trainer B: new process state, same command log file, same sandboxes.
    handle = RolloutHandle.from_bytes(saved)
    assert handle.pool_state is not None
    acc_b = LoggedAccess(sim_access, CommandLog(path))
    pool_b = SandboxEnvPool.restore(handle.pool_state, acc_b, TASKS, N)
    buf_b = _buf()
    db = resume(handle, pool=pool_b, policy=CounterPolicy(), buffer=buf_b)
    db.rollout(2)                            # the two ticks A already ran: from the log
    assert acc_b.replayed == 2 * N
    assert _logs(sim_access, pool_b)[0] == b"1\n2\n3\n"     # not run twice
    db.rollout(1)                            # past the log: live again
    assert acc_b.replayed == 2 * N
    assert _logs(sim_access, pool_b) == _logs(sim_access, ref_pool)
    # What B recorded after the checkpoint equals the uninterrupted run's steps 1..3.
    ref_sm, b_sm = ref.buffer.step_major(), buf_b.step_major()
    for name in ("obs", "action", "reward", "done"):
        np.testing.assert_array_equal(getattr(b_sm, name), getattr(ref_sm, name)[1:4])
    acc_b.log.close()


def test_log_refuses_divergence_and_commands_in_doubt(sim_access: EdgeAccess,
                                                      tmp_path: Any) -> None:
    path = str(tmp_path / "c.log")
    sid = sim_access.create(TASKS[0].spec)
    try:
        acc = LoggedAccess(sim_access, CommandLog(path))
        req = ExecRequest(shell="echo a >> /tmp/x")
        acc.exec_batch([(sid, req), (sid, req)])
        acc.log.record_intents([(sid, 2, request_digest(req))])   # sent, result never recorded
        acc.log.close()
        # A torn tail (crash mid-append) is ignored on load.
        with open(path, "ab") as f:
            f.write(b"\x40\x00\x00\x00garbage")
        acc2 = LoggedAccess(sim_access, CommandLog(path))
        assert acc2.log.length(sid) == 3
        with pytest.raises(ReplayDiverged, match="#0"):
            acc2.exec_batch([(sid, ExecRequest(shell="echo b >> /tmp/x"))])
        acc2.seek({sid: 0})
        assert acc2.exec_batch([(sid, req), (sid, req)])[1].exit_code == 0
        assert sim_access.read_file(sid, "/tmp/x") == b"a\na\n"
        with pytest.raises(CommandInDoubt, match="may have run"):
            acc2.exec_batch([(sid, req)])
        assert os.path.getsize(path) > 0
        acc2.log.close()
    finally:
        sim_access.destroy(sid)


def test_resume_is_idempotent_at_the_edge(sim_access: EdgeAccess,
                                          sim_nodes: dict[str, EdgeNode],
                                          pools: list[SandboxEnvPool]) -> None:
    """One stray exec auto-resumed a paused sandbox: resuming the preempted rollout must
    not raise InvalidTransition for it (nor for one resumed twice)."""
    pool = SandboxEnvPool(sim_access, TASKS, N)
    pools.append(pool)
    d = Driver(pool, CounterPolicy(), _buf())
    d.start(seed=3)
    d.rollout(2)
    handle = d.preempt()
    sids = [s for s in pool.sandbox_ids() if s is not None]
    sim_access.exec_batch([(sids[0], ExecRequest(shell="true"))])      # auto-resume
    sim_access.resume(sids[1])
    sim_access.resume(sids[1])
    d2 = resume(handle, pool=pool, policy=CounterPolicy(), buffer=_buf())
    assert [sim_nodes[node_of(s)].get(s).state for s in sids] == ["running"] * N
    d2.rollout(1)


class _PreemptAt(CounterPolicy):
    """CounterPolicy that, in the middle of tick ``at``, runs ``notice`` (what a
    preemption notice does: another thread, or a real signal)."""

    def __init__(self, at: int, notice: Any) -> None:
        super().__init__()
        self.at, self.notice, self.calls = at, notice, 0

    def __call__(self, obs: np.ndarray, actor: LstmState | None,
                 critic: LstmState | None) -> PolicyOutput:
        if self.calls == self.at:
            self.notice()
        self.calls += 1
        return super().__call__(obs, actor, critic)


def _preempted_mid_tick_equals_uninterrupted(
        sim_access: EdgeAccess, sim_nodes: dict[str, EdgeNode],
        pools: list[SandboxEnvPool], make_notice: Any) -> list[BaseException]:
    ref_pool = SandboxEnvPool(sim_access, TASKS, N)
    pools.append(ref_pool)
    ref = Driver(ref_pool, CounterPolicy(), _buf())
    ref.start(seed=4)
    ref.rollout(7)

    pool = SandboxEnvPool(sim_access, TASKS, N)
    pools.append(pool)
    buf = _buf()
    refused: list[BaseException] = []
    holder: dict[str, Driver] = {}
    d = holder["d"] = Driver(pool, _PreemptAt(2, make_notice(holder, refused)), buf)
    d.start(seed=4)
    stats = d.rollout(100)
    # the tick in flight finished; the rollout stopped at the next boundary, paused
    assert stats.preempted and stats.handle is not None and stats.handle.paused
    assert d.ticks == 3 and stats.steps == 3 * N
    for sid in pool.sandbox_ids():
        assert sid is not None and sim_nodes[node_of(sid)].get(sid).state == "paused"
    with pytest.raises(Conflict, match="preempted"):
        d.rollout(1)
    d2 = resume(RolloutHandle.from_bytes(stats.handle.to_bytes()), pool=pool,
                policy=CounterPolicy(), buffer=buf)
    d2.rollout(4)
    _assert_same(ref.buffer, buf)
    assert _logs(sim_access, pool) == _logs(sim_access, ref_pool)
    return refused


def test_preempt_notice_from_a_thread_mid_tick(sim_access: EdgeAccess,
                                               sim_nodes: dict[str, EdgeNode],
                                               pools: list[SandboxEnvPool]) -> None:
    import threading

    def make_notice(holder: dict[str, Driver], refused: list[BaseException]) -> Any:
        def notice() -> None:
            def other_thread() -> None:
                try:
                    holder["d"].preempt()          # mid-tick: refused at once, no hang
                except Conflict as exc:
                    refused.append(exc)
                holder["d"].request_preempt()
            t = threading.Thread(target=other_thread)
            t.start()
            t.join(10)
            assert not t.is_alive()
        return notice

    refused = _preempted_mid_tick_equals_uninterrupted(sim_access, sim_nodes, pools,
                                                       make_notice)
    assert len(refused) == 1 and "request_preempt" in str(refused[0])


def test_preempt_notice_from_a_real_signal_mid_tick(sim_access: EdgeAccess,
                                                    sim_nodes: dict[str, EdgeNode],
                                                    pools: list[SandboxEnvPool]) -> None:
    import signal

    def make_notice(holder: dict[str, Driver], refused: list[BaseException]) -> Any:
        def on_signal(signum: int, frame: Any) -> None:
            try:
                holder["d"].preempt()
            except Conflict as exc:
                refused.append(exc)
            holder["d"].request_preempt()
        signal.signal(signal.SIGUSR1, on_signal)
        return lambda: os.kill(os.getpid(), signal.SIGUSR1)   # delivered mid-tick

    old = signal.getsignal(signal.SIGUSR1)
    try:
        refused = _preempted_mid_tick_equals_uninterrupted(sim_access, sim_nodes, pools,
                                                           make_notice)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert len(refused) == 1 and "mid-tick" in str(refused[0])


# -- issue 18: a replay that crosses episode ends ----------------------------------------

def _score(res: Any) -> float:
    lines = res.stdout.decode().splitlines()
    return 1.0 if len(lines) == 2 and lines[0] == f"expect {lines[1]}" else 0.0


STAGGER_TASKS = [Task(prompt="answer, then submit", max_turns=20, judge=ExecutableJudge(
    hidden_files={"expected": b"expect 42\n"},
    command=["cat", "{tests}/expected", "/workspace/answer"], score=_score,
    cwd="/workspace", isolate=True, carry=["/workspace/answer"]))]


class StaggeredPolicy:
    """Env i's episodes last 3 + i % 4 turns (ends staggered over ticks); it appends to a
    log every turn (not idempotent), writes its answer (42, or 41 for i % 3 == 0: some
    episodes fail) and submits on its last turn. The turn count is the LSTM c state."""

    def __call__(self, obs: np.ndarray, actor: LstmState | None,
                 critic: LstmState | None) -> PolicyOutput:
        assert actor is not None
        h, c = actor
        nc = c + 1.0
        acts = np.empty(len(obs), dtype=object)
        for i in range(len(obs)):
            turn = int(nc[i, 0])
            if turn >= 3 + i % 4:
                acts[i] = '{"tool": "submit"}'
            else:
                ans = 41 if i % 3 == 0 else 42
                acts[i] = f"echo {ans} > /workspace/answer; echo {turn} >> /workspace/log"
        return PolicyOutput(action=acts, value=nc[:, 0].astype(np.float32),
                            actor_state=(h, nc), critic_state=(h, nc))


def _log_or_none(access: Any, sid: str | None) -> bytes | None:
    try:
        return access.read_file(sid, "/workspace/log")
    except NotFound:
        return None                               # an episode that just started


def _live(nodes: dict[str, EdgeNode]) -> list[str]:
    return [i.id for n in nodes.values() for i in n.list()
            if i.state not in ("destroyed", "failed")]


def test_replay_across_episode_ends_pays_the_same_rewards_and_leaks_nothing(
        sim_access: EdgeAccess, sim_nodes: dict[str, EdgeNode], tmp_path: Any) -> None:
    """8 envs, staggered episode ends, checkpoint at tick 5, 4 more ticks, crash (the
    trainer vanishes: no close, no pause), restore + resume, roll to tick 12: the same
    rewards as an uncrashed run, no command run twice, no sandbox left running."""
    n = 8

    def buf() -> ReplayBuffer:
        return ReplayBuffer(num_envs=n, capacity=16, obs_dtype=object, action_dtype=object,
                            hidden_size=1)

    ref_pool = SandboxEnvPool(sim_access, STAGGER_TASKS, n)
    ref = Driver(ref_pool, StaggeredPolicy(), buf())
    ref.start(seed=11)
    ref.rollout(12)
    ref_rewards = ref.buffer.step_major().reward.copy()
    assert (ref_rewards[5:9] == 1.0).sum() >= 4        # passes inside the crash window
    ref_logs = [_log_or_none(sim_access, s) for s in ref_pool.sandbox_ids()]
    ref_pool.close()
    assert _live(sim_nodes) == []

    path = str(tmp_path / "commands.log")
    acc_a = LoggedAccess(sim_access, CommandLog(path))
    pool_a = SandboxEnvPool(acc_a, STAGGER_TASKS, n)
    da = Driver(pool_a, StaggeredPolicy(), buf())
    da.start(seed=11)
    da.rollout(5)
    saved = da.checkpoint().to_bytes()
    da.rollout(4)                                       # tick 9 ... then the crash
    acc_a.log.close()

    handle = RolloutHandle.from_bytes(saved)
    assert handle.pool_state is not None
    acc_b = LoggedAccess(sim_access, CommandLog(path))
    pool_b = SandboxEnvPool.restore(handle.pool_state, acc_b, STAGGER_TASKS, n)
    buf_b = buf()
    db = resume(handle, pool=pool_b, policy=StaggeredPolicy(), buffer=buf_b)
    db.rollout(7)                                       # ticks 6..12
    np.testing.assert_array_equal(buf_b.step_major().reward, ref_rewards[5:12])
    np.testing.assert_array_equal(buf_b.step_major().done, ref.buffer.step_major().done[5:12])
    assert [_log_or_none(sim_access, s) for s in pool_b.sandbox_ids()] == ref_logs
    assert set(_live(sim_nodes)) == {s for s in pool_b.sandbox_ids() if s is not None}
    pool_b.close()
    acc_b.log.close()
    assert _live(sim_nodes) == []


def test_preempt_with_a_sandbox_already_paused(sim_access: EdgeAccess,
                                               sim_nodes: dict[str, EdgeNode],
                                               pools: list[SandboxEnvPool]) -> None:
    """Pause is idempotent like resume: a sandbox paused already (an idle pause, another
    caller's) does not fail the preemption of the whole rollout."""
    pool = SandboxEnvPool(sim_access, TASKS, N)
    pools.append(pool)
    d = Driver(pool, CounterPolicy(), _buf())
    d.start(seed=2)
    d.rollout(1)
    first = pool.sandbox_ids()[0]
    assert first is not None
    sim_access.pause(first)
    sim_access.pause(first)
    handle = d.preempt()
    assert [sim_nodes[node_of(s)].get(s).state for s in pool.sandbox_ids()  # type: ignore[arg-type]
            ] == ["paused"] * N
    resume(handle, pool=pool, policy=CounterPolicy(), buffer=_buf()).rollout(1)
