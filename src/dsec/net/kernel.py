"""Netlink sockets bound to a network namespace, and libnftables for the cold path (shell).

A netlink socket belongs to the netns it was created in for its whole life, so the router
opens its sockets once, inside the router netns, and then uses them from any thread.

Batches are sent and their acks read synchronously: the kernel answers a slot-sized
nf_tables batch in 0.4-0.7 ms and an rtnetlink slot build in ~0.4 ms (E2c, E8), less than
handing the work to a thread and back costs on this machine, so the edge's loop calls
these inline. Every ack is checked; a batch that fails raises :class:`BackendError`
naming the message the kernel refused, and (nf_tables) nothing of the batch was applied.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import threading
from typing import Final, Self

from dsec.errors import BackendError
from dsec.net import netns
from dsec.net.nftwire import NETLINK_NETFILTER, NftBatch, counter_dump_request, parse_counters
from dsec.net.rtwire import parse_acks

__all__ = ["Netlink", "Nft", "NftError"]

NETLINK_ROUTE: Final = 0
SO_SNDBUFFORCE: Final = 32
SO_RCVBUFFORCE: Final = 33
# Big enough for a 64-slot batch and every ack of it (EMSGSIZE at the default buffer with
# 50 slots x 7 messages, E12).
BUFFER_BYTES: Final = 8 << 20
ACK_TIMEOUT_S: Final = 5.0


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` has data within ``timeout_s``. poll(), not select(): a router
    holds an fd per slot, so its sockets' numbers pass select()'s FD_SETSIZE (1024)
    with ~1,000 slots ("filedescriptor out of range in select()", found building the
    1,000-sandbox bench)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(timeout_s * 1000))


FD_SETSIZE: Final = 1024
#: low fd numbers kept free for C libraries that still select() (libnftables)
LOW_FD_RESERVE: Final = 16


def _fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


class _LowFds:
    """Placeholder fds (``/dev/null``) holding low numbers: one is closed right before a
    libnftables context opens its socket, so the socket takes a number below
    FD_SETSIZE, and the reserve is refilled (with the lowest free numbers) after."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.n = n
        self.fds: list[int] = []
        self.refill()

    def release(self, n: int = 3) -> set[int]:
        """Close the ``n`` highest placeholders below FD_SETSIZE (nft_ctx_new holds a file
        of its own open while it opens its socket: one free number is not enough); the
        fds open now, without them."""
        for fd in sorted((fd for fd in self.fds if fd < FD_SETSIZE), reverse=True)[:n]:
            self.fds.remove(fd)
            os.close(fd)
        return _fds()

    def refill(self) -> None:
        while len(self.fds) < self.n:
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            if fd >= FD_SETSIZE:  # nothing low is free: keep no high placeholder
                os.close(fd)
                return
            self.fds.append(fd)


_LOW_FDS = _LowFds(LOW_FD_RESERVE)


class Netlink:
    """One netlink socket (route or netfilter) in the netns held by ``netns_fd``."""

    def __init__(self, protocol: int, netns_fd: int | None = None) -> None:
        self.protocol = protocol
        if netns_fd is None:
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                      protocol)
        else:
            with netns.entered(netns_fd):
                self.sock = socket.socket(
                    socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol
                )
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, BUFFER_BYTES)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, BUFFER_BYTES)
            self.sock.bind((0, 0))
        except BaseException:
            self.sock.close()
            raise
        self._seq = 1
        #: held by every use of the socket and by close(): a close never lands while
        #: another thread is inside a request (its fd number could be reused by another
        #: namespace's fd or socket while the request still polls or sends on it)
        self._lock = threading.Lock()
        self._seq_lock = threading.Lock()
        self.closed = False

    @classmethod
    def route(cls, netns_fd: int | None = None) -> Netlink:
        return cls(NETLINK_ROUTE, netns_fd)

    @classmethod
    def netfilter(cls, netns_fd: int | None = None) -> Netlink:
        return cls(NETLINK_NETFILTER, netns_fd)

    def close(self) -> None:
        """Close the socket once no request is using it (waits for one in flight);
        every later request raises BackendError."""
        with self._lock:
            self.closed = True
            self.sock.close()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise BackendError(f"{what}: the netlink socket was closed (its router or "
                               "uplink is shutting down)")

    def next_seq(self, n: int = 1) -> int:
        """Reserve ``n`` sequence numbers; returns the first. Two builders (a background
        refill and an inline build) reserve concurrently: never the same numbers."""
        with self._seq_lock:
            first = self._seq
            self._seq += n
            return first

    def _recv(self) -> bytes:
        if not _readable(self.sock.fileno(), ACK_TIMEOUT_S):
            raise BackendError(f"netlink: no answer from the kernel in {ACK_TIMEOUT_S} s")
        return self.sock.recv(1 << 20)

    def request(self, data: bytes, seqs: list[int], what: str) -> None:
        """Send ``data`` and wait for an ack of every seq in ``seqs``; the first error
        raises (its errno in ``detail``)."""
        with self._lock:
            self._check_open(what)
            try:
                self.sock.send(data)
            except OSError as exc:
                raise BackendError(f"{what}: netlink send failed: {exc}", errno=exc.errno) from exc
            want = set(seqs)
            first_error: tuple[int, int] | None = None
            while want:
                for ack in parse_acks(self._recv()):
                    if ack.seq not in want:
                        continue
                    want.discard(ack.seq)
                    if ack.error and first_error is None:
                        first_error = (ack.seq, ack.error)
                        # nf_tables reports every failing message of an aborted batch and
                        # acks none of the rest: stop waiting once the kernel is silent.
                        want = set() if self.protocol == NETLINK_NETFILTER else want
            if first_error is not None:
                self._drain()
                seq, err = first_error
                raise _error(what, seq, err)

    def _drain(self) -> None:
        while True:
            if not _readable(self.sock.fileno(), 0.01):
                return
            self.sock.recv(1 << 20)

    def commit(self, batch: NftBatch, what: str) -> None:
        """Send an nf_tables batch as one transaction (all of it applies, or none)."""
        if not len(batch):
            return
        batch.seq = self.next_seq(len(batch) + 2)
        data, seqs = batch.encode()
        try:
            self.request(data, seqs, what)
        except BackendError as exc:
            seq = exc.detail.get("seq")
            if isinstance(seq, int):
                exc.message = f"{exc.message} ({batch.describe(seq)})"
                exc.args = (exc.message,)
            raise

    def counters(self, table: str) -> dict[str, tuple[int, int]]:
        """Every named counter of ``table``: ``{name: (packets, bytes)}`` (one dump)."""
        with self._lock:
            self._check_open(f"counters of table {table}")
            seq = self.next_seq()
            self.sock.send(counter_dump_request(seq, table))
            out: dict[str, tuple[int, int]] = {}
            while True:
                data = self._recv()
                acks = [a for a in parse_acks(data) if a.seq == seq and a.error]
                if acks:
                    raise _error(f"counters of table {table}", seq, acks[0].error)
                part, done = parse_counters(data)
                out.update(part)
                if done:
                    return out


def _error(what: str, seq: int, err: int) -> BackendError:
    name = errno.errorcode.get(err, str(err))
    return BackendError(f"{what}: the kernel refused it: {name} ({os.strerror(err)})",
                        errno=err, seq=seq)


# ---------------------------------------------------------------------------------------
# libnftables (ctypes, in-process: no fork) for what is cold: base table, slot objects,
# listings in tests and diagnostics. There is deliberately no "current netns" form: every
# context is bound to an explicit namespace fd.

_NFT_CTX_OUTPUT_JSON: Final = 1 << 4


class NftError(BackendError):
    """libnftables refused a command (its own message attached)."""


class Nft:
    """A libnftables context whose commands run in the netns held by ``netns_fd``."""

    _lib: ctypes.CDLL | None = None

    def __init__(self, netns_fd: int, *, json: bool = False) -> None:
        lib = self._load()
        self._lib_ = lib
        self.netns_fd = netns_fd
        #: held by every command and by close(): nft_ctx_free under a running
        #: nft_run_cmd_from_buffer frees memory the command still uses (heap corruption,
        #: "corrupted double-linked list", found by ``dsec bench net``: Router.close on
        #: the loop while a background refill built slots) and closes the context's
        #: socket, whose number the next open fd takes ("Socket operation on non-socket")
        self._lock = threading.Lock()
        self.ctx: int | None = None
        # The context opens its netlink socket when it is made, in the netns of the
        # calling thread, and keeps it: made outside, every command would act on the
        # host's ruleset. So it is made inside, and commands run inside as well.
        with _LOW_FDS.lock:
            # libnftables waits for the kernel with select() (nftables' mnl.c): a socket
            # numbered past FD_SETSIZE aborts the whole process (glibc's fortified
            # FD_SET), and an edge holding ~1,000 slots, pidfds and pipes has no free
            # number below 1,024. A reserve of low numbers, opened when this module was
            # imported, gives one back for the context's socket (lowest free number).
            before: set[int] = set()
            after: set[int] = set()
            try:
                with netns.entered(netns_fd):  # (which holds an fd of its own meanwhile)
                    before = _LOW_FDS.release()
                    self.ctx = lib.nft_ctx_new(0)
                    after = _fds()
            finally:
                _LOW_FDS.refill()
            if not self.ctx:
                raise BackendError("libnftables: nft_ctx_new failed")
            high = sorted(fd for fd in after - before if fd >= FD_SETSIZE)
            if high:
                lib.nft_ctx_free(self.ctx)
                self.ctx = None
                raise BackendError(
                    f"libnftables: its netlink socket got fd {high[0]}, past FD_SETSIZE "
                    f"({FD_SETSIZE}), where its select() would abort the edge; no low fd "
                    "number was free (close fds, or raise the reserve: kernel.LOW_FD_RESERVE)")
        lib.nft_ctx_buffer_output(self.ctx)
        lib.nft_ctx_buffer_error(self.ctx)
        if json:  # listings come back as libnftables JSON (the host uplink's checks)
            lib.nft_ctx_output_set_flags(self.ctx, _NFT_CTX_OUTPUT_JSON)

    @classmethod
    def _load(cls) -> ctypes.CDLL:
        if cls._lib is None:
            try:
                lib = ctypes.CDLL("libnftables.so.1")
            except OSError as exc:
                raise BackendError(
                    "libnftables.so.1 is missing: install the Debian package 'nftables' "
                    "(make setup does)"
                ) from exc
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_ctx_output_get_flags.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_output_get_flags.restype = ctypes.c_uint
            for fn in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
                getattr(lib, fn).argtypes = [ctypes.c_void_p]
            for fn in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
                getattr(lib, fn).argtypes = [ctypes.c_void_p]
                getattr(lib, fn).restype = ctypes.c_char_p
            cls._lib = lib
        return cls._lib

    def json(self, cmd: str) -> str:
        """``cmd``'s output as libnftables JSON (a listing, for reconcile)."""
        return self(cmd, json=True)

    def __call__(self, cmd: str, *, json: bool = False) -> str:
        lib = self._lib_
        with self._lock:
            if not self.ctx:
                first = cmd.strip().splitlines()[0] if cmd.strip() else ""
                raise BackendError(
                    f"libnftables: the context for netns fd {self.netns_fd} is closed; "
                    f"{first!r} was not run (its router or uplink is shutting down)")
            flags = lib.nft_ctx_output_get_flags(self.ctx)
            if json:
                lib.nft_ctx_output_set_flags(self.ctx, flags | _NFT_CTX_OUTPUT_JSON)
            try:
                with netns.entered(self.netns_fd):
                    rc = lib.nft_run_cmd_from_buffer(self.ctx, cmd.encode())
            finally:
                if json:
                    lib.nft_ctx_output_set_flags(self.ctx, flags)
            out = (lib.nft_ctx_get_output_buffer(self.ctx) or b"").decode()
            err = (lib.nft_ctx_get_error_buffer(self.ctx) or b"").decode()
        if rc != 0:
            first = cmd.strip().splitlines()[0] if cmd.strip() else ""
            raise NftError(f"nft refused the command starting {first!r}: {err.strip()}")
        return out

    def close(self) -> None:
        """Free the context once no command is running in it (waits for one in flight);
        every later command raises BackendError. Idempotent."""
        with self._lock:
            if self.ctx:
                self._lib_.nft_ctx_free(self.ctx)
                self.ctx = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
