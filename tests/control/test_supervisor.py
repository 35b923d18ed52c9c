"""The restart policy of supervised edges, as a pure state machine with an injected clock."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.control.supervisor import (
    TRANSITIONS,
    Exited,
    ExitStatus,
    Ready,
    Report,
    RestartPolicy,
    Signal,
    Spawn,
    Start,
    Stop,
    Supervision,
    Tick,
    WakeAt,
)
from dsec.errors import InvalidArgument, InvalidTransition

KILLED = ExitStatus(signal=signal.SIGKILL)


def _kinds(instructions: list[object]) -> list[str]:
    return [type(i).__name__ for i in instructions]


def _running(policy: RestartPolicy | None = None, at: float = 0.0) -> Supervision:
    s = Supervision("edge e0", policy)
    assert _kinds(s.handle(Start(at))) == ["Spawn", "WakeAt"]
    s.handle(Ready(at + 0.3))
    assert s.state == "running"
    return s


def test_a_crash_restarts_after_the_first_delay_then_backs_off() -> None:
    p = RestartPolicy(first_delay_s=0.1, factor=2.0, max_delay_s=0.5, crash_loop_crashes=10)
    s = _running(p)
    now = 1.0
    delays = []
    for _ in range(5):
        out = s.handle(Exited(now, KILLED))
        assert s.state == "backoff"
        wake = next(i for i in out if isinstance(i, WakeAt))
        delays.append(round(wake.at - now, 3))
        report = next(i for i in out if isinstance(i, Report))
        assert report.level == "warning" and "killed by SIGKILL" in report.message
        assert s.handle(Tick(wake.at - 0.01)) == [WakeAt(wake.at)]   # not yet
        assert _kinds(s.handle(Tick(wake.at))) == ["Spawn", "WakeAt"]
        s.handle(Ready(wake.at + 0.2))
        now = wake.at + 1.0
    assert delays == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert s.restarts == 5


def test_a_stable_run_forgets_the_backoff() -> None:
    p = RestartPolicy(first_delay_s=0.1, stable_after_s=30.0, crash_loop_crashes=10)
    s = _running(p)
    for t in (1.0, 2.0):
        wake = next(i for i in s.handle(Exited(t, KILLED)) if isinstance(i, WakeAt))
        s.handle(Tick(wake.at))
        s.handle(Ready(wake.at))
    out = s.handle(Exited(100.0, KILLED))       # ran ~98 s: stable
    assert next(i for i in out if isinstance(i, WakeAt)).at == pytest.approx(100.1)


def test_a_crash_loop_gives_up_with_a_clear_report() -> None:
    p = RestartPolicy(crash_loop_crashes=3, crash_loop_window_s=60.0, first_delay_s=0.1)
    s = _running(p)
    t = 1.0
    for _ in range(2):
        wake = next(i for i in s.handle(Exited(t, ExitStatus(code=1))) if isinstance(i, WakeAt))
        assert _kinds(s.handle(Tick(wake.at))) == ["Spawn", "WakeAt"]
        t = wake.at + 0.5
    out = s.handle(Exited(t, ExitStatus(code=1)))
    assert s.state == "failed" and _kinds(out) == ["Report"]
    msg = out[0].message  # type: ignore[union-attr]
    assert out[0].level == "error"  # type: ignore[union-attr]
    assert "edge e0 crashed 3 times within 60s (last: exit code 1)" in msg
    assert "not restarting" in msg and "re-adopted" in msg
    assert s.handle(Tick(t + 100)) == []         # stays down
    # Started again by hand: a fresh crash budget.
    assert _kinds(s.handle(Start(t + 200))) == ["Spawn", "WakeAt"]
    s.handle(Ready(t + 200.2))
    assert _kinds(s.handle(Exited(t + 201, KILLED))) == ["Report", "WakeAt"]


def test_crashes_outside_the_window_do_not_count() -> None:
    p = RestartPolicy(crash_loop_crashes=3, crash_loop_window_s=10.0, stable_after_s=1e9)
    s = _running(p)
    for t in (1.0, 20.0, 40.0, 60.0):               # 20 s apart: never 3 within 10 s
        wake = next(i for i in s.handle(Exited(t, KILLED)) if isinstance(i, WakeAt))
        s.handle(Tick(wake.at))
        s.handle(Ready(wake.at))
    assert s.state == "running"


def test_not_ready_in_time_is_killed_and_counted() -> None:
    s = _running(RestartPolicy(start_timeout_s=5.0, crash_loop_crashes=5))
    wake = next(i for i in s.handle(Exited(1.0, KILLED)) if isinstance(i, WakeAt))
    s.handle(Tick(wake.at))                          # restarted, never ready again
    out = s.handle(Tick(wake.at + 5.0))
    assert Signal(signal.SIGKILL) in out
    out = s.handle(Exited(wake.at + 5.1, KILLED))
    assert s.state == "backoff"
    msg = next(i for i in out if isinstance(i, Report)).message
    assert "failed to start (did not become ready within 5s)" in msg


def test_a_first_start_that_fails_is_not_retried() -> None:
    s = Supervision("edge e0")
    s.handle(Start(0.0))
    out = s.handle(Exited(0.8, ExitStatus(code=1)))
    assert s.state == "failed" and _kinds(out) == ["Report"]
    assert out[0].message == ("edge e0 failed to start (exit code 1) and never served; "  # type: ignore[union-attr]
                              "not restarting it: fix the cause and start it again")


def test_stop_terms_then_kills_after_the_grace_and_never_restarts() -> None:
    s = _running(RestartPolicy(stop_grace_s=3.0))
    assert s.handle(Stop(10.0)) == [Signal(signal.SIGTERM), WakeAt(13.0)]
    assert s.state == "stopping"
    assert _kinds(s.handle(Tick(13.0))) == ["Report", "Signal"]
    out = s.handle(Exited(13.1, KILLED))
    assert s.state == "stopped" and "Spawn" not in _kinds(out)
    assert s.handle(Tick(100.0)) == []


def test_stop_with_no_grace_is_a_kill_9() -> None:
    s = _running()
    assert s.handle(Stop(1.0, grace_s=0)) == [Signal(signal.SIGKILL)]
    s.handle(Exited(1.01, KILLED))
    assert s.state == "stopped"


def test_stop_during_backoff_cancels_the_restart() -> None:
    s = _running()
    s.handle(Exited(1.0, KILLED))
    assert s.handle(Stop(1.05)) == []
    assert s.state == "stopped" and s.handle(Tick(5.0)) == []


def test_impossible_events_name_child_event_and_state() -> None:
    s = Supervision("edge e7")
    with pytest.raises(InvalidTransition) as ei:
        s.handle(Exited(0.0, KILLED))
    assert "edge e7 cannot exit while it is idle" in str(ei.value)
    assert ei.value.detail == {"child": "edge e7", "event": "exit", "state": "idle"}


def test_policy_validation() -> None:
    with pytest.raises(InvalidArgument):
        RestartPolicy(first_delay_s=-1)
    with pytest.raises(InvalidArgument):
        RestartPolicy(crash_loop_crashes=0)
    assert str(ExitStatus.from_returncode(-9)) == "killed by SIGKILL"
    assert str(ExitStatus.from_returncode(3)) == "exit code 3"


_events = st.lists(st.tuples(st.sampled_from(["start", "ready", "exit", "stop", "kill", "tick"]),
                             st.floats(0.0, 5.0)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_events)
def test_property_one_process_at_a_time_and_none_after_stop(events: list[tuple[str, float]]
                                                            ) -> None:
    """Whatever happens, the runner is never told to spawn while a process is alive,
    and nothing spawns between a stop and the next start."""
    s = Supervision("edge p", RestartPolicy(crash_loop_crashes=4, crash_loop_window_s=10.0,
                                            start_timeout_s=2.0, stop_grace_s=1.0))
    now, alive, stopped = 0.0, False, False
    for kind, dt in events:
        now += dt
        if kind == "start":
            ev: object = Start(now)
            stopped = False
        elif kind == "ready":
            if not alive:
                continue
            ev = Ready(now)
        elif kind == "exit":
            if not alive:
                continue
            ev = Exited(now, ExitStatus(code=1))
        elif kind in ("stop", "kill"):
            ev = Stop(now, 0.0 if kind == "kill" else None)
            stopped = True
        else:
            ev = Tick(now)
        out = s.handle(ev)  # type: ignore[arg-type]
        if isinstance(ev, Exited):
            alive = False
        for ins in out:
            if isinstance(ins, Spawn):
                assert not alive, "spawned while a process was alive"
                assert not stopped, "spawned after a stop"
                alive = True
        assert s.state in TRANSITIONS
        assert (s.state in ("starting", "running", "stopping")) == alive, (s.state, alive)
