"""The REST listener's admission and deadlines: uvicorn's httptools protocol, guarded.

uvicorn (0.54) answers 503 under ``limit_concurrency`` only once a request arrives and has
no deadline for a connection that sends nothing, or sends its headers one byte at a time:
an idle or slow-loris connection holds its file descriptor forever, and httptools keeps a
header value that never ends in memory. :class:`GuardedHttpProtocol` adds what the Aether
listeners have (:mod:`dsec.aether.limits`):

- **admission** through the same :class:`~dsec.aether.limits.Admission` bookkeeping and
  the process's shared fd budget: a connection over a cap is answered ``503`` with a JSON
  ``{"code": "overloaded", "message": ...}`` body and ``Retry-After``, then closed;
- **a deadline for the request headers** (``header_timeout_s``): from the connection's
  first byte (a new connection: from its accept) to the end of the headers; a
  connection that sends nothing in time gets ``408``;
- **a cap on header bytes** (``max_header_bytes``): more is ``431``;
- **a body idle timeout** (``body_idle_timeout_s``): a request body that stops arriving
  is cut (the endpoint sees a disconnect);
- between requests, uvicorn's own keep-alive timeout (``timeout_keep_alive``) applies.

"Pending" (the per-peer cap on unauthenticated connections) here means a connection that
has not yet completed its first request's headers; when the listener's pending slots are
full the oldest pending connection is answered 503 and closed to make room.

uvicorn accepts through ``loop.create_server``: on EMFILE uvloop (libuv) accepts with a
descriptor it keeps in reserve and closes at once, without spinning (measured: 0.4 ms of
CPU over 3 s with the fd table full); the shared fd share keeps the process from getting
there in the first place.

Subclassing uvicorn's protocol is the seam uvicorn offers (``Config(http=<class>)``); the
overrides call the parent first and only add bookkeeping around its parser callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dsec.aether.limits import Admission, ProcessBudget, ServerLimits, process_budget
from dsec.aether.transport import peer_key
from dsec.errors import InvalidArgument, Overloaded

__all__ = ["GuardedHttpProtocol", "HttpLimits", "drain_accept_queue", "guarded_protocol",
           "uvicorn_server"]

# Seconds a refused connection may stay open to flush its 503 before it is aborted, and
# how many may linger at once (beyond that a refusal is closed at once).
REFUSAL_LINGER_S = 1.0
MAX_LINGERING = 256


@dataclass(slots=True, frozen=True, kw_only=True)
class HttpLimits:
    """Limits of the REST listener. ``connections`` holds the caps shared with Aether
    listeners (its ``auth_timeout_s`` is unused here: ``header_timeout_s`` applies)."""

    connections: ServerLimits = field(default_factory=ServerLimits)
    header_timeout_s: float = 10.0      # first byte (or accept) -> end of headers
    body_idle_timeout_s: float = 30.0   # a request body silent this long is cut
    max_header_bytes: int = 32 * 1024   # request line + headers

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0 or not self.body_idle_timeout_s > 0:
            raise InvalidArgument(
                f"HttpLimits timeouts must be > 0 seconds (header_timeout_s="
                f"{self.header_timeout_s}, body_idle_timeout_s={self.body_idle_timeout_s})")
        if self.max_header_bytes < 1024:
            raise InvalidArgument(f"HttpLimits.max_header_bytes={self.max_header_bytes} is "
                                  "below 1024; a request line alone may need that")


_json = msgspec.json.Encoder()


def _response(status: int, reason: str, code: str, message: str,
              extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    body = _json.encode({"code": code, "message": message, "request_id": ""})
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close",
            *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with dsec's admission and deadlines (module doc).
    Built per listener by :func:`guarded_protocol`, which sets the class attributes."""

    admission: ClassVar[Admission]
    http_limits: ClassVar[HttpLimits]
    lingering: ClassVar[list[int]]      # one-element counter shared per listener
    # Connections of this listener that have not sent a whole request head yet, oldest
    # first: when the listener's pending slots are full the oldest is dropped for the
    # newcomer (an idle flood cannot lock out clients that send their request at once).
    pending: ClassVar[dict[GuardedHttpProtocol, None]]
    pool: ClassVar[_RestPending]    # the same, as the process budget sees it

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        # an IPv6 peer counts by its /64, as on the Aether listeners
        self._peer = peer_key(str(peer[0])) if isinstance(peer, tuple) and peer else "unix"
        self._established = False
        self._in_headers = True
        self._in_body = False
        self._hdr_bytes = 0
        self._watch_at = float("inf")
        self._watch_handle: asyncio.TimerHandle | None = None
        self._released = False
        self._draining = False          # answered and half-closed: input is dropped
        self._lingers = False
        self._stopping = False          # the server is stopping: answer, then close
        verdict = self.admission.admit(self._peer)
        if verdict is not None and verdict[0] == "pending_full" and self.pending:
            self.pool.evict_oldest_pending()
            verdict = self.admission.admit(self._peer)
        elif (verdict is not None and verdict[0] == "fds"
              and self.admission.budget.make_room()):
            verdict = self.admission.admit(self._peer)
        self._admitted = verdict is None
        if verdict is not None:
            self.transport = transport
            self.admission.stats.refuse(verdict[0])
            self._answer_and_close(_response(503, "Service Unavailable", Overloaded.code,
                                             verdict[1], (("retry-after", "1"),)))
            return
        super().connection_made(transport)
        self.pending[self] = None
        self._hdr_started = self._last_rx = now = self.loop.time()
        self._arm(now + self.http_limits.header_timeout_s)

    # ---------------------------------------------------------------- refusal
    def _answer_and_close(self, response: bytes) -> None:
        """Send ``response`` and close. The connection half-closes and drops what the
        client still sends until it hangs up (at most REFUSAL_LINGER_S): closing with its
        request unread would make the kernel send RST, which can overtake the answer."""
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(response)
        self._draining = True
        if self.lingering[0] >= MAX_LINGERING or not t.can_write_eof():
            t.close()
            return
        self.lingering[0] += 1
        self._lingers = True
        t.write_eof()
        if self._watch_handle is not None:
            self._watch_handle.cancel()
        self._watch_at = float("inf")
        self._watch_handle = self.loop.call_later(REFUSAL_LINGER_S, t.abort)

    # ---------------------------------------------------------------- deadlines
    def _arm(self, at: float) -> None:
        if at < self._watch_at:
            if self._watch_handle is not None:
                self._watch_handle.cancel()
            self._watch_at = at
            self._watch_handle = self.loop.call_at(at, self._watch)

    def _watch(self) -> None:
        self._watch_handle = None
        self._watch_at = float("inf")
        t = self.transport
        if t is None or t.is_closing():
            return
        lim = self.http_limits
        now = self.loop.time()
        if self._in_headers:
            deadline = self._hdr_started + lim.header_timeout_s
            if now >= deadline:
                what = "no request" if not self._established and not self._hdr_bytes else \
                    "request headers not complete"
                self._timeout_out("header_timeout", 408, "Request Timeout", "request_timeout",
                                  f"{what} within {lim.header_timeout_s:g}s; send the whole "
                                  "request line and headers at once")
                return
            self._arm(deadline)
        elif self._in_body:
            deadline = self._last_rx + lim.body_idle_timeout_s
            if now >= deadline:
                self.admission.stats.close("body_timeout")
                t.close()  # the endpoint reading the body sees a disconnect
                return
            self._arm(deadline)

    def _timeout_out(self, kind: str, status: int, reason: str, code: str,
                     message: str) -> None:
        """Answer ``status`` and close: only before a request's headers are complete (no
        response of the app can be under way then). Frees its admission slot at once."""
        self.admission.stats.close(kind)
        self.pending.pop(self, None)
        if not self._released:  # now, not at connection_lost: an eviction reuses the slot
            self._released = True
            self.admission.release(self._peer, established=self._established)
        self._answer_and_close(_response(status, reason, code, message))

    # ---------------------------------------------------------------- parser hooks
    def data_received(self, data: bytes) -> None:
        if self._draining:
            return  # answered: its request is read and dropped until it hangs up
        self._last_rx = self.loop.time()
        if self._in_headers:
            start = self._hdr_bytes
        elif not self._in_body and (self.cycle is None or self.cycle.response_complete):
            start = 0       # between requests, nothing being answered: a head starts here
        else:
            super().data_received(data)
            return
        self._hdr_bytes = start + len(data)
        limit = self.http_limits.max_header_bytes
        # A whole head in one read completes inside the parser, before the check after it
        # could see it (found by the `api` bench's header_limit probe: a 64 KiB head sent
        # at once was served, on a new connection and on a kept-alive one): measure the
        # head up to its end in this read before parsing it.
        end = data.find(b"\r\n\r\n")
        if (start + end + 4 if end >= 0 else self._hdr_bytes) > limit:
            self._too_large(limit)
            return
        super().data_received(data)
        if self._in_headers and self._hdr_bytes > limit and not self.transport.is_closing():
            self._too_large(limit)

    def _too_large(self, limit: int) -> None:
        self._timeout_out("header_too_large", 431, "Request Header Fields Too Large",
                          "payload_too_large", f"request line and headers exceed {limit} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._established:  # a later request on a kept-alive connection
            self._hdr_started = self.loop.time()
            self._arm(self._hdr_started + self.http_limits.header_timeout_s)
        self._in_headers = True

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._hdr_bytes = 0     # bytes counted toward the next request's head from here
        self._in_body = True
        if not self._established:
            self._established = True
            self.pending.pop(self, None)
            self.admission.establish(self._peer)
        super().on_headers_complete()
        if self._stopping and self.cycle is not None:
            self.cycle.keep_alive = False       # answered with Connection: close
        self._arm(self.loop.time() + self.http_limits.body_idle_timeout_s)

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    # ---------------------------------------------------------------- graceful stop
    def shutdown(self) -> None:
        """The server is stopping (SIGTERM: a rolling upgrade, docs/deploy.md). uvicorn
        closes a kept-alive connection between requests at once, but its client may be
        sending the next request on it that instant; for a call that is not idempotent
        (exec) the client cannot tell whether it ran, so it cannot retry. Here a request
        in flight, and the next one on an idle connection, are answered with
        ``Connection: close``; an idle connection that sends nothing more is closed by
        the keep-alive timeout as always (a new one without a request: after the same
        time), and the SDK's pool drops idle connections before that timeout, so it never
        sends on one the server is closing. Measured (tests/control/
        test_rolling_upgrade.py): with the immediate close, ~1 in 100 client calls made
        across a replica's restart failed with "server disconnected"; with this, none."""
        t = self.transport
        if not self._admitted or self._draining or t is None or t.is_closing():
            return
        self._stopping = True
        if self.cycle is not None and not self.cycle.response_complete:
            # Only while its head is still to go: a head already sent without
            # `Connection: close` has told the client it may reuse the connection, so
            # closing after this response could cut the next request the client sends on
            # it; that next one is answered with the close instead (on_headers_complete).
            if not self.cycle.response_started:
                self.cycle.keep_alive = False
        elif self.timeout_keep_alive_task is None:
            # no request yet (its keep-alive timer arms after a response): close it if
            # none comes within the keep-alive time
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._draining:
            return False  # the answered client hung up: close our side too
        super().eof_received()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watch_handle is not None:
            self._watch_handle.cancel()
            self._watch_handle = None
        if self._lingers:
            self._lingers = False
            self.lingering[0] -= 1
        if not self._admitted:
            return
        self.pending.pop(self, None)
        if not self._released:
            self._released = True
            self.admission.release(self._peer, established=self._established)
        super().connection_lost(exc)


class _RestPending:
    """A REST listener's connections without a whole request head yet, as a
    :class:`~dsec.aether.limits.PendingPool` of the process budget."""

    def __init__(self, pending: dict[GuardedHttpProtocol, None]) -> None:
        self.pending = pending

    def pending_count(self) -> int:
        return len(self.pending)

    def evict_oldest_pending(self) -> bool:
        if not self.pending:
            return False
        oldest = next(iter(self.pending))
        oldest._timeout_out("evicted", 503, "Service Unavailable", Overloaded.code,
                            "dropped to make room: the slots for connections that have "
                            "not sent a request yet are full")
        return True


def guarded_protocol(limits: HttpLimits | None = None, *,
                     budget: ProcessBudget | None = None,
                     name: str = "REST listener") -> tuple[type[GuardedHttpProtocol], Admission]:
    """A protocol class for ``uvicorn.Config(http=...)`` admitting through a fresh
    :class:`Admission` (returned too, for its counters) on ``budget`` (default: the
    process's, shared with the Aether listeners)."""
    lim = limits or HttpLimits()
    adm = Admission(lim.connections, budget or process_budget(), name=name)
    pending: dict[GuardedHttpProtocol, None] = {}
    pool = _RestPending(pending)
    adm.budget.pools.add(pool)   # weakly: it lives as long as the protocol class
    attrs: dict[str, Any] = {"admission": adm, "http_limits": lim, "lingering": [0],
                             "pending": pending, "pool": pool}
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), attrs), adm


def uvicorn_server(app: Any, limits: HttpLimits | None = None, *, name: str = "REST listener",
                   access_log: bool = False, log_level: str = "warning",
                   budget: ProcessBudget | None = None) -> tuple[uvicorn.Server, Admission]:
    """The REST listener as it ships: a ``uvicorn.Server`` on the caller's loop
    (``serve(sockets=[...])``) with :class:`GuardedHttpProtocol`, and its
    :class:`Admission`. It installs no signal handlers: the caller owns SIGINT/SIGTERM
    and stops it with ``server.should_exit = True`` (in-flight requests finish; idle
    kept-alive connections are answered once more with ``Connection: close`` or closed by
    the keep-alive timeout: :meth:`GuardedHttpProtocol.shutdown`; before that the caller lets
    it accept what is queued: :func:`drain_accept_queue`). ``dsec up`` and the ``api`` bench build it here,
    so the benchmark measures what ships.

    Why uvicorn and not granian (measured in the ``api`` bench, docs/benchmarks.md):
    granian's Rust accept loop gives Python no hook per connection, so the per-address
    cap on connections without a request (the idle-flood fix of issue 12) cannot be
    held there; uvicorn's protocol class is the seam that holds it."""
    lim = limits or HttpLimits()
    protocol, admission = guarded_protocol(lim, budget=budget, name=name)
    cap = lim.connections.max_connections
    # uvicorn answers 503 once len(connections) >= limit_concurrency, counting the one
    # asking: one more than the admitted maximum lets every admitted connection be served.
    config = uvicorn.Config(app, loop="none", http=protocol, lifespan="off",
                            proxy_headers=False, server_header=False, access_log=access_log,
                            log_level=log_level,
                            limit_concurrency=None if cap is None else cap + 1)
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign, assignment]
    return server, admission


# A classic BPF program of one instruction, `ret #0`: drop every packet.
_DROP_ALL = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))
_SO_ATTACH_FILTER = 26


def refuse_new_connections(sock: socket.socket) -> None:
    """Make the listening ``sock`` drop new SYNs, keeping the connections already queued
    for accept. Closing a listener resets what is still in its accept queue: a client
    whose connect completed there has sent its request and sees the connection drop
    with it written (an exec it cannot tell from one that ran). With the filter, a new
    client's SYN goes unanswered, is retransmitted and then refused once the listener
    is closed: a failed connect, which the SDK repeats (nothing was sent)."""
    prog = struct.pack("HL", 1, ctypes.addressof(_DROP_ALL))
    sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, prog)


def accept_queue_length(sock: socket.socket) -> int:
    """Connections waiting in the listening ``sock``'s accept queue (Linux: TCP_INFO's
    ``tcpi_unacked`` on a listener)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return int(struct.unpack_from("I", info, 24)[0])


async def drain_accept_queue(sock: socket.socket, *, poll_s: float = 0.01) -> None:
    """Before a graceful stop closes the listener: refuse new connections
    (:func:`refuse_new_connections`) and wait until the server has accepted every
    queued one (it then answers their requests with ``Connection: close``). The caller
    bounds the wait."""
    refuse_new_connections(sock)
    while accept_queue_length(sock) > 0:
        await asyncio.sleep(poll_s)
