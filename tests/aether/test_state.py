"""The sans-IO stream rules (dsec.aether.state), in memory, under hypothesis.

Two ConnectionStates, a dialer and an acceptor (which may require authentication), talk
through the real frame codec. A rule-based state machine opens calls on both sides,
delivers frames in each direction in order, answers dispatched requests, abandons calls,
sends GOAWAY and refuses credentials, and checks after every step:

- every call ends exactly once (reply, abandon, the peer's GOAWAY) and, once the wires
  are drained and every dispatched request answered, none is left pending;
- the ids a side opens are increasing and of its parity;
- no request is dispatched after this side's GOAWAY, or before authentication;
- after a refused credential, nothing the peer sends is dispatched.

The example tests below pin the words users see for each broken rule.
"""

from __future__ import annotations

from collections import deque

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from dsec.aether.frame import FrameDecoder, FrameType, encode_parts
from dsec.aether.messages import Goaway, method_prefix
from dsec.aether.state import AUTH_METHOD, ConnectionState, Side, Verdict
from dsec.errors import RemoteProtocolError

_REQ, _RESP, _ERR, _GOAWAY = (int(FrameType.REQUEST), int(FrameType.RESPONSE),
                              int(FrameType.ERROR), int(FrameType.GOAWAY))
_GOOD, _BAD = b"good", b"bad"
_METHOD = method_prefix("m")
_AUTH = method_prefix(AUTH_METHOD)


class _End:
    """One side: its state, the frames coming to it (bytes through a FrameDecoder), the
    peer's requests it dispatched and owes an answer to, and its bookkeeping."""

    def __init__(self, side: Side, *, auth_required: bool) -> None:
        self.state: ConnectionState[str] = ConnectionState(side, auth_required=auth_required)
        self.inbox = FrameDecoder()
        self.queued: deque[int] = deque()      # frames fed but not yet handled (count)
        self.serving: list[int] = []           # dispatched peer requests owed an answer
        self.opened: list[int] = []
        self.ended: dict[int, str] = {}
        self.refused = False                   # it refused the peer's credential


class StreamRules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[Side, _End] = {}

    @rule(auth=st.booleans())
    @precondition(lambda self: not self.ends)
    def start(self, auth: bool) -> None:
        self.ends = {Side.DIALER: _End(Side.DIALER, auth_required=False),
                     Side.ACCEPTOR: _End(Side.ACCEPTOR, auth_required=auth)}

    # ---------------------------------------------------------------- plumbing
    def _peer(self, side: Side) -> _End:
        return self.ends[Side.ACCEPTOR if side is Side.DIALER else Side.DIALER]

    def _send(self, side: Side, ftype: int, sid: int, payload: bytes) -> None:
        peer = self._peer(side)
        peer.inbox.feed(encode_parts(ftype, sid, payload) + payload)

    def _end_call(self, end: _End, sid: int, how: str) -> None:
        assert sid not in end.ended, f"call {sid} ended twice ({end.ended[sid]}, {how})"
        end.ended[sid] = how

    def _handle(self, side: Side) -> bool:
        end = self.ends[side]
        f = end.inbox.next_raw()
        if f is None:
            return False
        ftype, sid, payload, _flags = f
        st_ = end.state
        if ftype == _REQ:
            before_auth = not st_.authed
            verdict = st_.on_request(sid, payload)
            if verdict is Verdict.DISPATCH:
                assert st_.goaway_sent is None, "dispatched after our GOAWAY"
                assert not before_auth, "dispatched before authentication"
                assert not end.refused, "dispatched after a refused credential"
                end.serving.append(sid)
            elif verdict is Verdict.AUTH:
                assert before_auth
                if payload.endswith(msgspec.msgpack.encode(_GOOD)):
                    st_.accept_auth()
                    self._send(side, _RESP, sid, b"\xc0")
                else:
                    body = st_.refuse_auth("authentication failed (unauthenticated)")
                    end.refused = True
                    self._send(side, _ERR, sid, b"\xc0")
                    if body is not None:
                        self._send(side, _GOAWAY, 0, body)
            elif verdict is Verdict.UNAUTHENTICATED:
                assert before_auth
                self._send(side, _ERR, sid, b"\xc0")
            elif verdict is Verdict.BAD_METHOD:
                self._send(side, _ERR, sid, b"\xc0")
            else:
                assert verdict is Verdict.DROP
                assert st_.goaway_sent is not None
        elif ftype in (_RESP, _ERR):
            if st_.take(sid) is not None:
                self._end_call(end, sid, "reply")
        elif ftype == _GOAWAY:
            g = msgspec.msgpack.decode(payload, type=Goaway)
            for failed, _slot in st_.on_goaway(payload):
                assert failed > g.last_stream_id
                self._end_call(end, failed, "goaway")
            assert all(s <= g.last_stream_id for s in st_.pending)
        return True

    # ------------------------------------------------------------------- rules
    @rule(side=st.sampled_from(Side), auth=st.sampled_from([None, _GOOD, _BAD]))
    @precondition(lambda self: bool(self.ends))
    def call(self, side: Side, auth: bytes | None) -> None:
        end = self.ends[side]
        if not end.state.can_open:
            return
        sid = end.state.open("slot")
        assert sid & 1 == (1 if side is Side.DIALER else 0)
        assert not end.opened or sid > end.opened[-1]
        end.opened.append(sid)
        payload = _METHOD + b"\xc0" if auth is None else _AUTH + msgspec.msgpack.encode(auth)
        self._send(side, _REQ, sid, payload)

    @rule(side=st.sampled_from(Side), n=st.integers(1, 5))
    @precondition(lambda self: bool(self.ends))
    def call_batch(self, side: Side, n: int) -> None:
        end = self.ends[side]
        if not end.state.can_open:
            return
        first = end.state.open_many("batch", n)
        for sid in range(first, first + 2 * n, 2):
            assert not end.opened or sid > end.opened[-1]
            end.opened.append(sid)
            self._send(side, _REQ, sid, _METHOD + b"\xc0")

    @rule(side=st.sampled_from(Side), frames=st.integers(1, 4))
    @precondition(lambda self: bool(self.ends))
    def deliver(self, side: Side, frames: int) -> None:
        for _ in range(frames):
            if not self._handle(side):
                break

    @rule(side=st.sampled_from(Side), data=st.data())
    @precondition(lambda self: bool(self.ends))
    def answer(self, side: Side, data: st.DataObject) -> None:
        end = self.ends[side]
        if end.serving:
            sid = end.serving.pop(data.draw(st.integers(0, len(end.serving) - 1)))
            self._send(side, _RESP, sid, b"\xc0")

    @rule(side=st.sampled_from(Side), data=st.data())
    @precondition(lambda self: bool(self.ends))
    def abandon(self, side: Side, data: st.DataObject) -> None:
        end = self.ends[side]
        if end.state.pending:
            sid = data.draw(st.sampled_from(sorted(end.state.pending)))
            assert end.state.take(sid) is not None
            self._end_call(end, sid, "abandon")
            # the peer would get a CANCEL; its reply, if any, arrives late and is dropped

    @rule(side=st.sampled_from(Side))
    @precondition(lambda self: bool(self.ends))
    def go_away(self, side: Side) -> None:
        end = self.ends[side]
        already = end.state.goaway_sent is not None
        body = end.state.go_away("closing")
        assert (body is None) == already
        if body is not None:
            assert end.state.goaway_sent == end.state.last_peer_sid
            self._send(side, _GOAWAY, 0, body)

    # --------------------------------------------------------------- invariants
    @invariant()
    def calls_end_once_and_stay_filed_until_then(self) -> None:
        for end in self.ends.values():
            pending = set(end.state.pending)
            assert pending.isdisjoint(end.ended)
            assert pending | set(end.ended) == set(end.opened)

    def teardown(self) -> None:
        """Drain both wires, answering every dispatched request: nothing is left pending."""
        if not self.ends:
            return
        for _ in range(10_000):
            moved = False
            for side in Side:
                end = self.ends[side]
                while end.serving:
                    self._send(side, _RESP, end.serving.pop(), b"\xc0")
                    moved = True
                moved |= self._handle(side)
            if not moved:
                break
        for side, end in self.ends.items():
            assert not end.state.pending, (side, end.state.pending, end.ended)
            assert end.state.close() == {}


TestStreamRules = StreamRules.TestCase
TestStreamRules.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -------------------------------------------------------------- single rules


@given(st.lists(st.integers(0, 40), max_size=30))
def test_request_ids_must_be_new_increasing_and_of_the_peers_parity(sids: list[int]) -> None:
    state: ConnectionState[str] = ConnectionState(Side.ACCEPTOR)
    last = 0
    for sid in sids:
        ok = sid % 2 == 1 and sid > last
        if ok:
            assert state.on_request(sid, _METHOD + b"\xc0") is Verdict.DISPATCH
            last = sid
        else:
            with pytest.raises(RemoteProtocolError, match="must be new, increasing"):
                state.on_request(sid, _METHOD + b"\xc0")
        assert state.last_peer_sid == last


def test_messages_for_broken_rules() -> None:
    acc: ConnectionState[str] = ConnectionState(Side.ACCEPTOR, auth_required=True)
    with pytest.raises(RemoteProtocolError) as ei:
        acc.on_request(2, _METHOD)          # the dialer's ids are odd
    assert str(ei.value) == ("REQUEST on stream 2 after stream 0: the peer's stream ids "
                             "must be new, increasing and of its own parity")
    assert acc.on_request(1, b"") is Verdict.BAD_METHOD
    assert acc.on_request(3, b"\x05ab") is Verdict.BAD_METHOD     # prefix longer than it
    assert acc.on_request(5, _METHOD + b"\xc0") is Verdict.UNAUTHENTICATED
    assert acc.on_request(7, _AUTH + b"\xc4\x00") is Verdict.AUTH
    assert acc.token_matches(b"s3cret", b"s3cret") and not acc.token_matches(b"s", b"s3cret")
    body = acc.refuse_auth("authentication failed (unauthenticated)")
    assert body is not None
    assert msgspec.msgpack.decode(body, type=Goaway) == Goaway(
        reason="authentication failed (unauthenticated)", last_stream_id=7)
    # a second guess right behind the first is not even looked at
    assert acc.on_request(9, _AUTH + b"\xc4\x00") is Verdict.DROP
    assert not acc.authed and acc.going_away and not acc.can_open


def test_goaway_fails_only_the_calls_it_did_not_process() -> None:
    dial: ConnectionState[str] = ConnectionState(Side.DIALER)
    sids = [dial.open(f"c{i}") for i in range(4)]
    assert sids == [1, 3, 5, 7]
    failed = dial.on_goaway(msgspec.msgpack.encode(Goaway(reason="draining",
                                                          last_stream_id=3)))
    assert failed == [(5, "c2"), (7, "c3")]
    assert sorted(dial.pending) == [1, 3]
    assert dial.goaway_received == "draining" and not dial.can_open
    with pytest.raises(RemoteProtocolError, match="undecodable GOAWAY body"):
        dial.on_goaway(b"\xff")
    assert dial.close() == {1: "c0", 3: "c1"} and dial.pending == {} and dial.closed
