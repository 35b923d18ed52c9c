"""The stream rules of one Aether connection, without I/O (sans-IO).

What a connection may do with stream ids, the authentication gate and GOAWAY, decided on
plain values: no sockets, no event loop, no futures, no clock. The asyncio shell
(:mod:`dsec.aether.connection`) feeds it the frames it decoded and the calls it starts,
and carries out what it answers: futures and handler tasks, write corking, flow control,
timers and listener budgets stay there. h11's ``Connection`` is the model, with one
difference for speed: nothing here allocates per frame on the REQUEST/RESPONSE path (a
verdict is an int, the pending table is one dict the shell's slots live in), because a
no-op call costs ~13 us of CPU in all and an object per frame would add 3-5% of it.

The rules:

- **Stream ids.** The dialing side opens odd ids, the accepting side even ones, each
  strictly increasing (:meth:`ConnectionState.open`). A peer's REQUEST on an id that is
  not new, not increasing or not of its parity is a protocol violation: the byte stream
  can no longer be trusted (:class:`~dsec.errors.RemoteProtocolError`).
- **Pending calls.** Every call this side opened is in ``pending`` until exactly one of:
  its reply (RESPONSE/ERROR/PONG: :meth:`take`), this side giving up (timeout or cancel:
  :meth:`take` too, and then the peer gets a CANCEL), the peer's GOAWAY naming it as
  unprocessed (:meth:`on_goaway`), or the connection closing (:meth:`close`). A reply to
  a call no longer pending is dropped.
- **Authentication.** On an endpoint that requires it, the peer's only allowed request
  is :data:`AUTH_METHOD`; others are refused (the connection stays open for the auth
  call); the credential is checked once (:meth:`accept_auth` / :meth:`refuse_auth`: a
  wrong one is a GOAWAY and the connection closes, so it cannot be guessed on one socket,
  not even by pipelining guesses behind one another).
- **GOAWAY.** Sending one (:meth:`go_away`) records the peer's last stream id this side
  will process; later REQUESTs are dropped unanswered (the peer fails them itself, as
  safe to retry). Receiving one fails this side's calls above its ``last_stream_id`` as
  retryable; either way no new calls are opened.
- **Duplex streams** (:class:`DuplexFlow`, one per stream): raw bytes both ways on one
  stream id, each direction under its own credit (``WINDOW`` frames), half-closed each
  way by a STREAM with ``FIN``. A peer that sends beyond the credit it was granted is a
  protocol violation (the whole connection is cut: its byte stream can no longer be
  trusted to respect any bound), so a receiver never buffers more than the window it
  granted per stream, and one slow reader only ever stops its own stream's sender.
"""

from __future__ import annotations

import enum
import hmac
import struct
from collections.abc import Mapping
from typing import Final, Generic, Literal, TypeVar

import msgspec

from dsec.aether.messages import Goaway
from dsec.errors import InvalidArgument, LocalProtocolError, RemoteProtocolError

__all__ = ["AUTH_METHOD", "DUPLEX_TRANSITIONS", "INITIAL_WINDOW", "MAX_CHUNK", "MAX_WINDOW",
           "ConnectionState", "DuplexFlow", "Side", "Verdict", "decode_window",
           "encode_window"]

#: The method a peer calls first on an endpoint that requires authentication (body: the
#: credential as msgpack bin).
AUTH_METHOD = "aether.auth"
_AUTH_NAME = AUTH_METHOD.encode()

_encoder = msgspec.msgpack.Encoder()
_GOAWAY_DECODER = msgspec.msgpack.Decoder(Goaway)


class Side(enum.Enum):
    """Which end of the connection this is: it fixes the parity of the ids it opens."""

    DIALER = 1      # opens odd stream ids
    ACCEPTOR = 2    # opens even stream ids


class Verdict(enum.IntEnum):
    """What the shell does with a peer's REQUEST (:meth:`ConnectionState.on_request`)."""

    DISPATCH = 0            # route it and run its handler
    DROP = 1                # after our GOAWAY: no answer (the peer fails it as retryable)
    BAD_METHOD = 2          # no valid method-name prefix: answer LocalProtocolError
    AUTH = 3                # the authentication call of a peer not yet authenticated
    UNAUTHENTICATED = 4     # any other call before authentication: answer Unauthenticated


_DISPATCH, _DROP, _BAD_METHOD, _AUTH, _UNAUTHENTICATED = (
    Verdict.DISPATCH, Verdict.DROP, Verdict.BAD_METHOD, Verdict.AUTH, Verdict.UNAUTHENTICATED)

S = TypeVar("S")


class ConnectionState(Generic[S]):
    """The rules of one connection (see the module docstring). ``S`` is whatever the shell
    keeps per pending call (a future, a batch or stream slot); this class only files it.

    Read-only for the shell: ``pending`` (sid -> slot, the calls this side waits on),
    ``can_open`` (new calls may start), ``next_sid``, ``last_peer_sid``, ``authed``,
    ``goaway_sent`` (the last peer id we process, once we sent GOAWAY),
    ``goaway_received`` / ``goaway_code`` (what the peer's GOAWAY said), ``closed``.
    """

    __slots__ = ("_first_sid", "_peer_parity", "auth_required", "authed", "can_open", "closed",
                 "goaway_code", "goaway_received", "goaway_sent", "last_peer_sid", "next_sid",
                 "pending", "side", "stale", "stale_per_call")

    def __init__(self, side: Side, *, auth_required: bool = False) -> None:
        self.side = side
        self.next_sid = self._first_sid = 1 if side is Side.DIALER else 2
        self._peer_parity = 0 if side is Side.DIALER else 1
        self.last_peer_sid = 0
        self.pending: dict[int, S] = {}
        self.auth_required = auth_required
        self.authed = not auth_required
        self.goaway_sent: int | None = None
        self.goaway_received: str | None = None
        self.goaway_code = ""
        self.closed = False
        # New calls may be opened: not closed and no GOAWAY either way. A plain attribute
        # kept on each transition (the shell reads it on every call; a property cost more).
        self.can_open = True
        # Frames for streams nothing waits on any more (late replies to calls given up on).
        # ``stale_per_call`` (None: no bound) caps them at that many per call either side
        # opened (plus one call's worth): a peer that keeps sending them is past any
        # lateness and closed (a hostile one would cost us a decode per frame forever).
        self.stale = 0
        self.stale_per_call: int | None = None

    # ------------------------------------------------------------ this side's calls
    @property
    def going_away(self) -> bool:
        """A GOAWAY was sent or received: no new calls may be opened."""
        return self.goaway_sent is not None or self.goaway_received is not None

    def open(self, slot: S) -> int:
        """File a new call under the next stream id of this side and return that id.
        The shell checks :attr:`can_open` first (its error names the connection)."""
        sid = self.next_sid
        self.next_sid = sid + 2
        self.pending[sid] = slot
        return sid

    def open_many(self, slot: S, n: int) -> int:
        """File ``n`` calls sharing one slot (a batch) under consecutive ids of this side;
        returns the first (the others follow, two apart)."""
        first = sid = self.next_sid
        pending = self.pending
        for _ in range(n):
            pending[sid] = slot
            sid += 2
        self.next_sid = sid
        return first

    def take(self, sid: int) -> S | None:
        """The call on ``sid`` ended (its reply came, or this side gave up on it): its
        slot, or None if it was not pending (a late reply to an abandoned call: drop it)."""
        return self.pending.pop(sid, None)

    def on_unsolicited(self, kind: str, sid: int) -> None:
        """A ``kind`` frame (RESPONSE, STREAM, ERROR, PONG, WINDOW) came on ``sid`` with
        nothing waiting for it. A late one for a stream that was opened is dropped (and
        counted against :attr:`stale_per_call`); one for a stream neither side ever opened
        is a protocol violation: RemoteProtocolError."""
        if sid & 1 == self._peer_parity:
            never = sid > self.last_peer_sid
        else:
            never = sid >= self.next_sid
        if never:
            raise RemoteProtocolError(
                f"{kind} frame on stream {sid}, which was never opened (this side opened up "
                f"to {self.next_sid - 2}, the peer up to {self.last_peer_sid})")
        self.stale += 1
        per_call = self.stale_per_call
        if per_call is not None:
            calls = (self.next_sid - self._first_sid) // 2 + self.last_peer_sid // 2 + 1
            if self.stale > per_call * calls:
                raise RemoteProtocolError(
                    f"{self.stale} frames for streams that had ended (the last a {kind} on "
                    f"stream {sid}) over {calls - 1} calls: more than the {per_call} late "
                    "frames per call a peer may send")

    # ------------------------------------------------------------ the peer's calls
    def on_request(self, sid: int, payload: bytes) -> Verdict:
        """The peer sent a REQUEST on ``sid`` (``payload``: u8 method length, the ascii
        method, the body). Raises RemoteProtocolError for an id that breaks the rules."""
        if sid & 1 != self._peer_parity or sid <= self.last_peer_sid:
            raise RemoteProtocolError(
                f"REQUEST on stream {sid} after stream {self.last_peer_sid}: the peer's "
                "stream ids must be new, increasing and of its own parity")
        self.last_peer_sid = sid
        if self.goaway_sent is not None:
            return _DROP
        n = payload[0] if payload else 0
        if not n or len(payload) <= n:
            return _BAD_METHOD
        if not self.authed:
            return _AUTH if payload[1 : 1 + n] == _AUTH_NAME else _UNAUTHENTICATED
        return _DISPATCH

    @staticmethod
    def token_matches(offered: bytes, token: bytes) -> bool:
        """A shared-secret credential check, in constant time."""
        return hmac.compare_digest(offered, token)

    def accept_auth(self) -> None:
        """The peer's credential was good: its calls are served from now on."""
        self.authed = True

    def refuse_auth(self, reason: str) -> bytes | None:
        """The peer's credential was wrong: the connection closes, and nothing it sent after
        the refused call is served (not even a second guess pipelined behind the first:
        one guess per socket). Returns the GOAWAY body to send, as :meth:`go_away`."""
        return self.go_away(reason)

    # --------------------------------------------------------------------- GOAWAY
    def go_away(self, reason: str, code: str = "") -> bytes | None:
        """Stop taking the peer's new calls: the GOAWAY body to send (None if one was
        already sent or the connection is closed). Requests above ``last_peer_sid`` from
        now on are dropped."""
        if self.goaway_sent is not None or self.closed:
            return None
        self.goaway_sent = self.last_peer_sid
        self.can_open = False
        return _encoder.encode(Goaway(reason=reason[:1000], last_stream_id=self.last_peer_sid,
                                      code=code))

    def on_goaway(self, payload: bytes) -> list[tuple[int, S]]:
        """The peer sent GOAWAY: record why, and return (popped) the calls it will not
        process, which are safe to retry. Raises RemoteProtocolError for a bad body."""
        try:
            g = _GOAWAY_DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            raise RemoteProtocolError(f"undecodable GOAWAY body: {exc}") from exc
        self.goaway_received = g.reason or "no reason given"
        self.goaway_code = g.code
        self.can_open = False
        pending = self.pending
        return [(sid, pending.pop(sid)) for sid in [s for s in pending if s > g.last_stream_id]]

    # ---------------------------------------------------------------------- close
    def close(self) -> dict[int, S]:
        """The connection is done: every call still pending (popped), to be failed."""
        self.closed = True
        self.can_open = False
        pending, self.pending = self.pending, {}
        return pending


# ------------------------------------------------------------------ duplex streams
#: Credit each side starts with on a new duplex stream, per direction (bytes the sender may
#: put on the wire before the first WINDOW). 256 KiB: a tunnel over the loopback link moves
#: ~1 GB/s with it (the plan's E7 relay), and it is what a receiver may be made to hold per
#: stream before its reader takes anything.
INITIAL_WINDOW: Final = 256 * 1024
#: The largest credit a stream may be granted in all (HTTP/2's bound): more is a protocol
#: violation, never an overflow.
MAX_WINDOW: Final = 2**31 - 1
#: The largest STREAM payload a duplex sender makes: a big write is cut in pieces so one
#: stream's write does not sit in front of another stream's frames for long.
MAX_CHUNK: Final = 64 * 1024

_U32 = struct.Struct("!I")

DuplexState = Literal["open", "local_closed", "remote_closed", "closed"]
DuplexEvent = Literal["send_fin", "recv_fin", "end"]

#: Half-close as a table: ``send_fin`` (this side sent FIN: it writes no more),
#: ``recv_fin`` (the peer's FIN came: nothing more will be read), ``end`` (the call is over
#: either way: RESPONSE, ERROR, CANCEL or the connection). A missing entry is an illegal
#: event; :meth:`DuplexFlow._step` says which side broke the rule.
DUPLEX_TRANSITIONS: Final[Mapping[DuplexState, Mapping[DuplexEvent, DuplexState]]] = {
    "open": {"send_fin": "local_closed", "recv_fin": "remote_closed", "end": "closed"},
    "local_closed": {"recv_fin": "closed", "end": "closed"},
    "remote_closed": {"send_fin": "closed", "end": "closed"},
    "closed": {"end": "closed"},
}


def encode_window(increment: int) -> bytes:
    """The payload of a WINDOW frame: u32 credit increment, 1..MAX_WINDOW."""
    if not 0 < increment <= MAX_WINDOW:
        raise LocalProtocolError(f"WINDOW increment {increment} is outside 1..{MAX_WINDOW}")
    return _U32.pack(increment)


def decode_window(payload: bytes, sid: int) -> int:
    """A WINDOW frame's increment; RemoteProtocolError for a malformed or zero one."""
    if len(payload) != 4:
        raise RemoteProtocolError(
            f"WINDOW frame on stream {sid} has a {len(payload)}-byte payload, expected 4 "
            "(u32 credit increment)")
    n: int = _U32.unpack(payload)[0]
    if not 0 < n <= MAX_WINDOW:
        raise RemoteProtocolError(
            f"WINDOW frame on stream {sid} grants {n} bytes, outside 1..{MAX_WINDOW}")
    return n


class DuplexFlow:
    """Credit and half-close bookkeeping of one duplex stream, both directions, no I/O.

    Sending: :meth:`sendable` says how many of ``n`` bytes may go now (0: wait for a
    WINDOW), :meth:`sent` charges them, :meth:`on_window` adds the peer's grant.
    Receiving: :meth:`on_data` checks the peer stayed within the credit it was given
    (raising RemoteProtocolError when it did not: the shell cuts the connection), and
    :meth:`consumed` (the reader took bytes) answers the WINDOW increment to send, if any.
    Grants are batched: credit goes back once a quarter of the window has been read, so a
    reader taking 1 byte at a time does not cost a frame per byte.

    Invariants (``tests/aether/test_duplex.py`` checks them under hypothesis):
    ``0 <= send_credit``, ``0 <= recv_credit``, ``unread + recv_credit + to_grant ==
    window`` while the peer may still send: what the peer can make us hold is bounded by
    the window, however it interleaves frames.
    """

    __slots__ = ("recv_credit", "send_credit", "sid", "state", "threshold", "to_grant",
                 "unread", "window")

    def __init__(self, sid: int, *, window: int = INITIAL_WINDOW,
                 peer_window: int = INITIAL_WINDOW) -> None:
        if not 0 < window <= MAX_WINDOW or not 0 < peer_window <= MAX_WINDOW:
            raise InvalidArgument(
                f"duplex windows must be 1..{MAX_WINDOW} bytes, got {window}/{peer_window}")
        self.sid = sid
        self.window = window
        self.threshold = max(1, window // 4)
        self.send_credit = peer_window   # bytes we may still send before a WINDOW
        self.recv_credit = window        # bytes the peer may still send us
        self.unread = 0                  # received, not yet taken by our reader
        self.to_grant = 0                # taken by our reader, not yet granted back
        self.state: DuplexState = "open"

    # ------------------------------------------------------------------ state
    def _step(self, event: DuplexEvent) -> None:
        nxt = DUPLEX_TRANSITIONS[self.state].get(event)
        if nxt is None:
            if event == "recv_fin":
                raise RemoteProtocolError(
                    f"second FIN on duplex stream {self.sid} (state {self.state})")
            raise LocalProtocolError(
                f"duplex stream {self.sid}: event {event!r} in state {self.state!r}")
        self.state = nxt

    @property
    def can_send(self) -> bool:
        return self.state in ("open", "remote_closed")

    @property
    def can_receive(self) -> bool:
        """The peer may still send bytes (no FIN from it, call not over)."""
        return self.state in ("open", "local_closed")

    def end(self) -> None:
        """The call is over (reply, error, cancel, connection gone): nothing more moves."""
        self._step("end")

    # ------------------------------------------------------------------ sending
    def sendable(self, n: int) -> int:
        """How many of the next ``n`` bytes may be sent now (at most MAX_CHUNK; 0 means
        wait for the peer's WINDOW). Raises LocalProtocolError after this side's FIN."""
        if not self.can_send:
            raise LocalProtocolError(
                f"duplex stream {self.sid} is closed for writing (state {self.state})")
        return min(n, self.send_credit, MAX_CHUNK)

    def sent(self, n: int) -> None:
        if n > self.send_credit:
            raise LocalProtocolError(
                f"duplex stream {self.sid}: {n} bytes sent with {self.send_credit} of credit")
        self.send_credit -= n

    def send_fin(self) -> None:
        self._step("send_fin")

    def on_window(self, increment: int) -> None:
        """The peer granted ``increment`` more bytes (already range-checked)."""
        if self.send_credit + increment > MAX_WINDOW:
            raise RemoteProtocolError(
                f"WINDOW on duplex stream {self.sid} raises its credit to "
                f"{self.send_credit + increment}, over {MAX_WINDOW}")
        self.send_credit += increment

    # ---------------------------------------------------------------- receiving
    def on_data(self, n: int, fin: bool) -> None:
        """The peer sent ``n`` bytes (and FIN when ``fin``). Raises RemoteProtocolError
        for bytes beyond the credit we granted or after its FIN."""
        if not self.can_receive:
            raise RemoteProtocolError(
                f"{n} bytes on duplex stream {self.sid} after the peer's FIN")
        if n > self.recv_credit:
            raise RemoteProtocolError(
                f"the peer sent {n} bytes on duplex stream {self.sid} with only "
                f"{self.recv_credit} bytes of credit left (window {self.window}): it "
                "ignores WINDOW flow control")
        self.recv_credit -= n
        self.unread += n
        if fin:
            self._step("recv_fin")

    def consumed(self, n: int) -> int:
        """Our reader took ``n`` bytes: the WINDOW increment to send now (0: none yet)."""
        if n > self.unread:
            raise LocalProtocolError(
                f"duplex stream {self.sid}: reader took {n} bytes of {self.unread} unread")
        self.unread -= n
        if not self.can_receive:
            return 0   # the peer sends no more: granting would be noise
        self.to_grant += n
        if self.to_grant < self.threshold:
            return 0
        grant, self.to_grant = self.to_grant, 0
        self.recv_credit += grant
        return grant
