from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.edge.lifecycle import IN_FLIGHT, TABLE, allowed_from, event_structs, next_state
from dsec.errors import InvalidTransition

EVENTS = sorted({e for evs in TABLE.values() for e in evs})


def test_happy_path_through_the_table() -> None:
    s = "creating"
    for ev, want in [("created", "running"), ("pause", "pausing"), ("paused", "paused"),
                     ("resume", "resuming"), ("resumed", "running"), ("destroy", "destroying"),
                     ("destroyed", "destroyed")]:
        s = next_state("sb-x", s, ev)  # type: ignore[arg-type]
        assert s == want


def test_failed_only_from_in_flight_states() -> None:
    assert {s for s, evs in TABLE.items() if "fail" in evs} == set(IN_FLIGHT)
    assert TABLE["destroyed"] == {}


def test_illegal_transition_names_sandbox_event_and_state() -> None:
    with pytest.raises(InvalidTransition) as ei:
        next_state("sb-abc", "destroyed", "pause")
    msg = str(ei.value)
    assert "sb-abc" in msg and "pause" in msg and "destroyed" in msg and "running" in msg
    assert ei.value.detail == {"sandbox_id": "sb-abc", "event": "pause", "state": "destroyed"}
    assert allowed_from("pause") == ["running"]


@given(st.lists(st.sampled_from(EVENTS), max_size=40))
def test_any_event_sequence_stays_in_the_table(events: list[str]) -> None:
    state = "creating"
    for ev in events:
        try:
            nxt = next_state("sb-x", state, ev)  # type: ignore[arg-type]
        except InvalidTransition:
            assert ev not in TABLE[state]  # type: ignore[index]
            continue
        assert nxt in TABLE
        assert state != "destroyed"  # nothing leaves destroyed
        state = nxt


def test_event_tuples_become_structs() -> None:
    evs = event_structs("sb-1", [(1.0, None, "creating", "requested", ""),
                                 (2.0, "creating", "running", "requested", "")])
    assert [(e.from_state, e.to_state, e.time) for e in evs] == [
        (None, "creating", 1.0), ("creating", "running", 2.0)]
