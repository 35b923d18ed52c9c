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
"""

from __future__ import annotations

import enum
import hmac
from typing import Generic, TypeVar

import msgspec

from dsec.aether.messages import Goaway
from dsec.errors import RemoteProtocolError

__all__ = ["AUTH_METHOD", "ConnectionState", "Side", "Verdict"]

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

    __slots__ = ("_peer_parity", "auth_required", "authed", "can_open", "closed", "goaway_code",
                 "goaway_received", "goaway_sent", "last_peer_sid", "next_sid", "pending",
                 "side")

    def __init__(self, side: Side, *, auth_required: bool = False) -> None:
        self.side = side
        self.next_sid = 1 if side is Side.DIALER else 2
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
