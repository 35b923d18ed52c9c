"""What lets a background process outlive its edge (issue 22 durability stream): the
process table's entries on disk, and its descriptors in a keeper process.

``process_start`` acknowledges a process that keeps running however long it likes; the
edge that started it may be killed meanwhile. Two things must survive that:

- **the entry** (:class:`DurableProcess`: sandbox, pid, host pid and its start time,
  exec cgroup, argv (its first 4 KiB of JSON, marked when cut), tenant, ring size,
  terminal, stdin open, timeout deadline, the sandbox's OOM count at start), appended
  to ``<state-dir>/processes.jsonl`` by :class:`ProcessJournal` *before* the start is
  answered. A plain ``write`` with no fsync: the page cache survives the edge's kill -9,
  and a host crash ends every process anyway, so an fsync (~ms here) would buy nothing;
- **its descriptors** (the read ends of stdout/stderr, the write end of stdin, or the
  terminal master): a copy of each is handed (SCM_RIGHTS) to the keeper
  (``dsec.edge.fdkeeper``), a small process of its own session that is not the edge.
  While the edge is gone the process's output waits in its pipe (64 KiB on Linux; past
  that its writes block, they do not fail), its stdin stays open.

The restarted edge reads the journal, takes the descriptors back (:meth:`FdStore.take`)
and the process table adopts each process whose host pid still has its recorded start
time (:meth:`dsec.edge.processes.ProcessTable.restore`). What is lost: the ring (the
output the dead edge had read but a client had not), and the exit status of a process
that ends after its edge died is *not* lost when the keeper started the edge's exec
helper (:meth:`FdStore.spawn`, the default with a state dir): the keeper is a child
subreaper, the helper's orphans come to it, and it keeps the status of each process it
holds descriptors for (:meth:`FdStore.status`). Only when that chain is broken (the keeper
was killed, or the process was started under a helper the keeper did not start) is such
an end reported as "exit status lost in the edge restart" (``exit_code`` -1).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import msgspec

from dsec.errors import BackendError, CapacityExceeded, Unavailable
from dsec.wire.process import ProcessInfo

__all__ = ["JOURNAL_CMD_BYTES", "KEEPER_SOCKET", "PROCESS_JOURNAL", "DurableProcess",
           "FdStore", "KeeperUnreachable", "KeptChild", "ProcessJournal", "cut_cmd"]

log = logging.getLogger(__name__)

KEEPER_SOCKET = "fdkeeper.sock"
PROCESS_JOURNAL = "processes.jsonl"
_KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fdkeeper.py")


class DurableProcess(msgspec.Struct, kw_only=True):
    """One running entry of a process table, as the journal keeps it."""

    sid: str
    pid: int                        # in the sandbox
    host_pid: int
    host_start: int                 # /proc/<host_pid>/stat field 22: names it for the boot
    exec_cgroup: str                # its exec cgroup's directory
    info: ProcessInfo               # its ``cmd`` cut to JOURNAL_CMD_BYTES (cut_cmd)
    tenant: str = ""
    ring_cap: int = 1 << 20
    deadline: float | None = None   # wall clock: its timeout kills it then
    pty: tuple[int, int] | None = None
    # the sandbox's OOM kills when it started: an adopted process's SIGKILL with the
    # counter risen since is reported oom_killed, as before the restart (red team 22, B9)
    oom_before: int | None = None

    @property
    def key(self) -> str:
        return f"{self.sid}/{self.host_pid}/{self.host_start}"


class _Put(msgspec.Struct, tag="p", array_like=True):
    proc: DurableProcess


class _End(msgspec.Struct, tag="e", array_like=True):
    sid: str
    pid: int


class _Drop(msgspec.Struct, tag="d", array_like=True):
    sid: str


_Line = _Put | _End | _Drop

#: JSON bytes of a journaled entry's ``cmd`` (red team 22, B4). The argv is the tenant's,
#: up to MAX_ARGV_BYTES (1 MiB; ~6 MB of JSON when it is control bytes, each ``\u00XX``),
#: and the journal only needs it for ``process_list`` after a restart: the entry keeps
#: its head and says it was cut. Every other field is bounded by the wire (cwd 4 KiB,
#: tag 256 B) or is the edge's own: a line is at most ~40 KiB.
JOURNAL_CMD_BYTES = 4096
#: the longest line :meth:`ProcessJournal.load` reads (longer ones are skipped unread):
#: above what a journal of an earlier release (whole argv) could hold, so it still reads
_MAX_LOAD_LINE = 8 << 20
#: compaction runs when the file holds more than 4x its live entries' bytes plus this
#: (or 4x their count plus 1,000 lines): the file stays within ~4x what is live
_COMPACT_SLACK_BYTES = 1 << 20

_json = msgspec.json.Encoder()


def _head(s: str, room: int) -> str:
    """The longest prefix of ``s`` (near enough) whose JSON is at most ``room`` bytes."""
    if room <= 2:
        return ""
    t = s[:room]
    while t:
        n = len(_json.encode(t))
        if n <= room:
            return t
        t = t[:max(0, len(t) * room // n - 1)]
    return t


def cut_cmd(cmd: list[str] | str, limit: int = JOURNAL_CMD_BYTES) -> list[str] | str:
    """``cmd`` as the journal keeps it: itself when its JSON fits in ``limit`` bytes, else
    its head with a mark saying it was cut (an argv gets the mark as a last item). Pure;
    a cut cmd fits, so cutting again leaves it as it is."""
    if len(_json.encode(cmd)) <= limit:
        return cmd
    if isinstance(cmd, str):
        total = len(cmd.encode("utf-8", "surrogatepass"))
    else:
        total = sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in cmd)
    mark = f"...[dsec: cut to fit the edge's process journal; {total} bytes in all]"
    room = limit - len(_json.encode(mark)) - 8
    if isinstance(cmd, str):
        return _head(cmd, room + 2) + mark if room > 0 else mark
    out: list[str] = []
    used = 2
    for a in cmd:
        n = len(_json.encode(a)) + 1
        if used + n <= room:
            out.append(a)
            used += n
            continue
        head = _head(a, room - used - 1)
        if head:
            out.append(head)
        break
    out.append(mark)
    return out


def _bounded(proc: DurableProcess) -> DurableProcess:
    cmd = cut_cmd(proc.info.cmd)
    if cmd is proc.info.cmd:
        return proc
    return msgspec.structs.replace(proc, info=msgspec.structs.replace(proc.info, cmd=cmd))


def _write_all(fd: int, data: bytes) -> int:
    """write(2) all of ``data``; an OSError (``written`` bytes went out before it) if not:
    a short write is the kernel's answer on a disk that fills mid-write (red team 22,
    B5), and a write of nothing would loop forever."""
    view = memoryview(data)
    done = 0
    while done < len(data):
        try:
            n = os.write(fd, view[done:])
        except OSError as exc:
            exc.written = done  # type: ignore[attr-defined]
            raise
        if n <= 0:
            err = OSError(errno.ENOSPC, "write(2) wrote nothing")
            err.written = done  # type: ignore[attr-defined]
            raise err
        done += n
    return done


class ProcessJournal:
    """``<state-dir>/processes.jsonl``: append-only, compacted when it holds more than
    4x the live entries' bytes plus 1 MiB, or 4x their count plus 1,000 lines (module
    docstring for why no fsync).

    Bounded by bytes, not only lines (red team 22, B4): an entry's argv is cut to
    :data:`JOURNAL_CMD_BYTES`, so the file stays within ~4x the live entries (~40 KiB
    each at most, their number bounded by the process table's caps) plus 1 MiB, and
    :meth:`load` streams it line by line. A record is written whole or not at all: a
    short or failed write is cut off again (``ftruncate``; if even that fails, the torn
    tail is cut - or fenced with a newline - before the next append) and the call raises
    BackendError, the entry not taken as journaled (B5). A compaction that cannot write
    (full disk) is logged and skipped: the appended file stays valid (B6)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, PROCESS_JOURNAL)
        self.live: dict[tuple[str, int], DurableProcess] = {}
        self._enc_live: dict[tuple[str, int], bytes] = {}   # each live entry's line
        self._live_bytes = 0
        self._fd = -1
        self._lines = 0
        self._size = 0            # bytes of whole lines in the file
        self._torn = False        # bytes past _size may be half a line: cut them first
        self._stale = False       # the file says more is live than self.live: compact
        self._retry_at = 0        # _lines at which a failed compaction is tried again

    def load(self) -> dict[tuple[str, int], DurableProcess]:
        """Read what a previous edge left (a torn last line is skipped), then compact
        (if it can: on a full disk the old file stays, its torn tail cut)."""
        dec = msgspec.json.Decoder(_Line)
        live: dict[tuple[str, int], DurableProcess] = {}
        good = 0
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            f = None
        except OSError as exc:
            raise BackendError(f"cannot read the process journal {self.path}: {exc}; "
                               "check the edge's state directory") from exc
        if f is not None:
            with f:
                while True:
                    line = f.readline(_MAX_LOAD_LINE + 1)
                    if not line:
                        break
                    if not line.endswith(b"\n"):
                        if len(line) > _MAX_LOAD_LINE:      # skipped unread, to its end
                            while line and not line.endswith(b"\n"):
                                line = f.readline(1 << 20)
                            log.warning("%s: skipped a line over %d bytes", self.path,
                                        _MAX_LOAD_LINE)
                        if not line.endswith(b"\n"):
                            self._torn = True    # the torn tail: cut before the next append
                            break
                        good = f.tell()
                        continue
                    good += len(line)
                    self._lines += 1
                    if not line.strip():
                        continue
                    try:
                        rec = dec.decode(line)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        log.warning("%s: skipped an unreadable line", self.path)
                        continue
                    if isinstance(rec, _Put):
                        live[(rec.proc.sid, rec.proc.pid)] = _bounded(rec.proc)
                    elif isinstance(rec, _End):
                        live.pop((rec.sid, rec.pid), None)
                    else:
                        for k in [k for k in live if k[0] == rec.sid]:
                            del live[k]
        self.live = dict(live)
        self._enc_live = {k: _json.encode(_Put(p)) + b"\n" for k, p in live.items()}
        self._live_bytes = sum(map(len, self._enc_live.values()))
        self._size = good
        if not self._compact() and f is not None:
            self._stale = True     # compaction failed: keep appending to the old file
        return live

    def put(self, proc: DurableProcess) -> None:
        """Journal ``proc`` (its argv cut, :func:`cut_cmd`). BackendError if it could not
        be written whole: the journal then holds what it held before."""
        k = (proc.sid, proc.pid)
        bounded = _bounded(proc)
        line = _json.encode(_Put(bounded)) + b"\n"
        self._append(line)                 # raises: nothing below changes
        self.live[k] = bounded
        self._live_bytes += len(line) - len(self._enc_live.get(k, b""))
        self._enc_live[k] = line
        self._maybe_compact()

    def end(self, sid: str, pid: int) -> None:
        if self.live.pop((sid, pid), None) is not None:
            self._live_bytes -= len(self._enc_live.pop((sid, pid), b""))
            self._append_or_stale(_json.encode(_End(sid, pid)) + b"\n")

    def drop(self, sid: str) -> list[DurableProcess]:
        gone = [k for k in self.live if k[0] == sid]
        if not gone:
            return []
        out = [self.live.pop(k) for k in gone]
        for k in gone:
            self._live_bytes -= len(self._enc_live.pop(k, b""))
        self._append_or_stale(_json.encode(_Drop(sid)) + b"\n")
        return out

    def _append_or_stale(self, line: bytes) -> None:
        """An end or drop: gone from ``live`` either way; if its line cannot be written
        the file says more than is live until the next compaction (tried soon)."""
        try:
            self._append(line)
        except BackendError:
            self._stale = True
            raise
        self._maybe_compact()

    def _append(self, data: bytes) -> None:
        start = self._size
        try:
            if self._fd < 0:
                self._open()
            if self._torn:
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError:
                    start = os.fstat(self._fd).st_size
                    data = b"\n" + data    # fence it off: a blank line reads as nothing
                self._torn = False
            _write_all(self._fd, data)
        except OSError as exc:
            if getattr(exc, "written", 0):
                try:
                    os.ftruncate(self._fd, start)
                except OSError:
                    self._torn = True      # cut (or fenced) before the next append
            # a full disk: the process runs, but would not be found after a restart
            raise BackendError(f"cannot record a process in {self.path}: {exc}; free "
                               "space in the edge's state directory") from exc
        self._size = start + len(data)
        self._lines += 1

    def _maybe_compact(self) -> None:
        if self._lines < self._retry_at:
            return            # the last attempt failed: not one rewrite per append
        if (self._stale or self._size > 4 * self._live_bytes + _COMPACT_SLACK_BYTES
                or self._lines > 4 * len(self.live) + 1000):
            self._compact()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                           0o600)

    def _compact(self) -> bool:
        """Rewrite the file with the live entries; False (logged, no .tmp left, the old
        file still in use) if that fails - a full disk (red team 22, B6)."""
        tmp = self.path + ".tmp"
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
                         | os.O_CLOEXEC, 0o600)
            _write_all(fd, b"".join(self._enc_live.values()))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("%s: compaction failed (%s); appending to the old file", self.path,
                        exc)
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._retry_at = self._lines + 100
            return False
        # the new file's descriptor replaces the old one only once it is in place
        old, self._fd = self._fd, fd
        if old >= 0:
            os.close(old)
        self._lines = len(self.live)
        self._size = self._live_bytes
        self._torn = self._stale = False
        self._retry_at = 0
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class KeeperUnreachable(Unavailable):
    """A keeper's socket is there but no whole answer came (it is slow or stuck, or at
    its descriptor limit, or this edge is at its own): what it holds is unknown - not
    "nothing" (red team 22, B1/B7: a restore must not kill processes on that)."""


class KeptChild:
    """A process the keeper started for the edge (the exec helper), as the edge drives
    it: the parts of :class:`subprocess.Popen` it uses. The keeper reaps it; its pidfd
    says when it is gone."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            self._pidfd = -1
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and (self._pidfd < 0 or select.select(
                [self._pidfd], [], [], 0)[0]):
            self._gone()
        return self.returncode

    def _gone(self) -> None:
        self.returncode = -1          # the keeper reaped it; its status is the keeper's
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def kill(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._pidfd >= 0 and not select.select(
                [self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("dsec-nsexec", timeout or 0)
        self._gone()
        assert self.returncode is not None
        return self.returncode


async def _confirmed_already() -> None:
    return None


class FdStore:
    """The edge's side of the keeper (``dsec.edge.fdkeeper``): started on first use, or
    found again on its socket after a restart. Calls are synchronous sends on a local
    socket (~10 us); :meth:`put` waits for the keeper's confirmation (it may refuse: its
    descriptor limit bounds what it holds), :meth:`take` and :meth:`keys` for an answer
    (at restore), each bounded in time.

    ``on_reconnect``: called after the keeper was found gone and a new one started, to
    hand it again everything that must be held (the lost keeper's copies are gone)."""

    def __init__(self, state_dir: str, *, orphan_s: float = 600.0,
                 python: str = sys.executable) -> None:
        self.path = os.path.join(state_dir, KEEPER_SOCKET)
        self.orphan_s = orphan_s
        self.python = python
        self.sock: socket.socket | None = None
        self.keeper: subprocess.Popen[bytes] | None = None
        self.on_reconnect: Callable[[], None] | None = None
        self._watched = -1
        self._seq = 0
        self.ack_timeout_s = 2.0
        self._acks = True          # the keeper answers puts (False: an older keeper)
        self._spawned = False
        # put number -> its future, for puts confirmed on the loop (put_async): the
        # answer comes on the main connection and _lost hands it over
        self._pending: dict[int, asyncio.Future[dict[str, object] | None]] = {}
        self._drops: list[str] = []        # keys to stop holding, sent together (drop)
        self._latest: dict[str, int] = {}  # key -> its latest put_async not yet confirmed
        self._drops_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ connection
    def _connect(self, *, spawn: bool, timeout_s: float = 5.0) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            # bounded: a keeper at its connection bound leaves a connect in its backlog,
            # and a full backlog blocks connect
            s.settimeout(timeout_s)
            s.connect(self.path)
            s.settimeout(None)
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            return self._spawn() if spawn else None
        except OSError as exc:
            s.close()
            raise BackendError(f"cannot reach the descriptor keeper at {self.path}: "
                               f"{exc}") from exc
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            s.close()
            raise BackendError(f"{self.path} is served by uid {uid}, not this edge's: "
                               "refusing to hand it descriptors; remove it")
        return s

    def _spawn(self) -> socket.socket:
        if self.keeper is not None:
            self.keeper.poll()          # reap a keeper that died (kill -9)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._bind_private(lst)
            self.keeper = subprocess.Popen(
                [self.python, "-I", _KEEPER, str(lst.fileno()), self.path, str(self.orphan_s)],
                pass_fds=[lst.fileno()], start_new_session=True, cwd="/",
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            s.connect(self.path)      # queued on the listener until the keeper accepts
            self._spawned = self._acks = True     # ours: this version's keeper
            return s
        except OSError as exc:
            raise BackendError(f"cannot start the descriptor keeper at {self.path}: {exc}") \
                from exc
        finally:
            lst.close()

    def _bind_private(self, lst: socket.socket) -> None:
        """Bind and listen at ``self.path``, which never exists with a mode other than
        0600. Not by narrowing the umask around ``bind``: the umask is the whole
        process's, and other edge threads (the file pool's ``mkdir``) create files
        meanwhile (red team 22, B10). Bound in a fresh 0700 directory next to it (by
        ``/proc/self/fd``: no sun_path limit on the state dir's path), chmod'ed, set
        listening, renamed into place (as ``dsec.aether.transport`` binds the edge's)."""
        tmp = tempfile.mkdtemp(prefix=".fdkeeper-", dir=os.path.dirname(self.path))
        try:
            dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                lst.bind(f"/proc/self/fd/{dfd}/s")
                os.chmod("s", 0o600, dir_fd=dfd)
                lst.listen(16)
                os.rename("s", self.path, src_dir_fd=dfd)
            finally:
                os.close(dfd)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _sock(self) -> socket.socket:
        if self.sock is None:
            self._spawned = False
            self.sock = self._connect(spawn=True)
            assert self.sock is not None
            if not self._spawned:
                self._acks = self._answers_puts()
            self._watch_main()
        assert self.sock is not None
        return self.sock

    def _watch_main(self) -> None:
        """Read the main connection on the running loop: only put answers come back on
        it (to put_async's futures; a late one is skipped), and EOF means the keeper
        died (a new one gets everything at once). Not from a thread or without a loop
        (a tool): then the first put_async on the loop does it (the connection may be
        opened first by a restore's take in a thread)."""
        if self.sock is None or self._watched == self.sock.fileno():
            return
        try:
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._lost)
            self._watched = self.sock.fileno()
        except RuntimeError:
            pass     # no event loop here: the next send notices

    def _answers_puts(self) -> bool:
        """Whether a keeper this edge did not start (a previous edge's, perhaps of an
        older dsec) answers puts: one that pages its keys does. An older one would
        leave every put unconfirmed, so it gets them unconfirmed, as it expects."""
        try:
            reply, _ = self._ask({"op": "keys", "after": "\U0010ffff"}, timeout_s=2.0)
        except KeeperUnreachable as exc:
            log.warning("%s: puts to it go unconfirmed", exc)
            return False
        return reply is not None and "more" in reply

    def _lost(self) -> None:
        """The main connection is readable: a put's answer (to its future, or late: one
        given up on), or EOF (the keeper died)."""
        if self.sock is not None:
            try:
                late = self.sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                late = b""
            if late:
                self._answered(late)
                return
        log.warning("descriptor keeper at %s went away: starting another", self.path)
        self._reset()
        if self.on_reconnect is None:
            return
        try:
            self._sock()
            self.on_reconnect()
        except BackendError as exc:
            log.error("%s; background processes will not survive an edge restart", exc)

    def _send(self, msg: dict[str, object], fds: list[int], *,
              nowait: bool = False) -> socket.socket:
        """Send ``msg`` (with ``fds``) on the main connection, reconnecting (a new
        keeper) once if it is gone. ``nowait``: never block - a keeper that stopped
        reading (SIGSTOP, swapped out) with its queue full refuses the message
        (BackendError) instead of holding the caller's event loop until it reads again
        (red team 23, B1: a blocking send of a put held every request of the edge)."""
        data = json.dumps(msg).encode()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] \
            if fds else []
        for attempt in (0, 1):
            fresh = self.sock is None
            s = self._sock()
            if not self._acks and "ack" in msg:
                del msg["ack"]
                data = json.dumps(msg).encode()
            try:
                s.sendmsg([data], anc, socket.MSG_DONTWAIT if nowait else 0)
                return s
            except BlockingIOError as exc:
                raise BackendError(
                    f"the descriptor keeper at {self.path} is not reading (its queue is "
                    "full: stopped or starved?); nothing was handed to it") from exc
            except OSError as exc:
                self._reset()
                if attempt:
                    raise BackendError(f"the descriptor keeper at {self.path} is gone and "
                                       f"could not be restarted: {exc}") from exc
                log.warning("descriptor keeper at %s gone (%s): starting another", self.path,
                            exc)
                if not fresh and self.on_reconnect is not None:
                    self._sock()
                    self.on_reconnect()
        raise AssertionError("unreachable")

    def _answered(self, data: bytes) -> bool:
        """Hand a put's answer to the future waiting for it; False if none waits."""
        try:
            reply = json.loads(data)
        except ValueError:
            return False
        n = reply.get("n") if isinstance(reply, dict) else None
        fut = self._pending.pop(n, None) if isinstance(n, int) else None
        if fut is None:
            return False
        if not fut.done():
            fut.set_result(reply)
        return True

    def _reset(self) -> None:
        for fut in self._pending.values():    # unanswered: the keeper went (or we reset)
            if not fut.done():
                fut.set_result({"ok": False, "error": "the keeper went away", "gone": True})
        self._pending.clear()
        if self._watched >= 0:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._watched)
            self._watched = -1
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # ------------------------------------------------------------------ operations
    def put(self, key: str, fds: dict[str, int]) -> None:
        """Hold copies of ``fds`` under ``key`` (replacing what it held), confirmed by
        the keeper. Raises (and then nothing is held under ``key``: that process would
        not survive an edge restart) :class:`CapacityExceeded` when the keeper is at
        its descriptor bound, :class:`BackendError` when it refused or did not answer."""
        self._unqueue_drop(key)
        names = list(fds)
        self._seq += 1
        n = self._seq
        msg: dict[str, object] = {"op": "put", "key": key, "names": names, "ack": n}
        s = self._send(msg, [fds[x] for x in names])
        if "ack" not in msg:
            return                    # an older keeper: it never answers a put
        self._check_answer(key, self._await_ack(s, n))

    def put_async(self, key: str, fds: dict[str, int]
                  ) -> Callable[[], Awaitable[None]]:
        """:meth:`put` without holding the event loop for the keeper's answer: the
        descriptors are sent now (in flight in the socket they are the keeper's: an edge
        kill -9 right after does not lose them, it reads its queue before the EOF), and
        the returned call awaits the confirmation, raising as :meth:`put` does.

        Measured (py-spy of a loop of E2B ``commands.run("true")``, issue 20): the
        blocking wait for the answer was a third of the edge's CPU samples in
        ``process_run`` (the keeper, woken on a 2-core host, is scheduled before the
        edge resumes), and a keeper that stops answering held the whole loop for
        ``ack_timeout_s`` per start."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:                   # no loop here (a tool): confirmed now
            self.put(key, fds)
            return _confirmed_already
        self._unqueue_drop(key)
        names = list(fds)
        self._seq += 1
        n = self._seq
        msg: dict[str, object] = {"op": "put", "key": key, "names": names, "ack": n}
        fut: asyncio.Future[dict[str, object] | None] = loop.create_future()
        self._pending[n] = fut
        try:
            self._send(msg, [fds[x] for x in names], nowait=True)
            self._watch_main()
        except BaseException:
            self._pending.pop(n, None)
            raise
        self._latest[key] = n
        if "ack" not in msg:
            self._pending.pop(n, None)
            fut.set_result({"ok": True})       # an older keeper: it never answers a put

        async def confirmed() -> None:
            try:
                async with asyncio.timeout(self.ack_timeout_s):
                    reply = await asyncio.shield(fut)
            except TimeoutError:
                reply = None
                self._pending.pop(n, None)
            if self._latest.get(key, n) != n:
                # a later put of this key (a re-deposit: a new keeper, a pty master, a
                # closed stdin) supersedes this one; its own confirmation decides (red
                # team 23, B2: a keeper replaced mid-confirmation read as "not durable"
                # although the new keeper held it)
                return
            self._latest.pop(key, None)
            self._check_answer(key, reply)
        return confirmed

    def _check_answer(self, key: str, reply: dict[str, object] | None) -> None:
        if reply is None:
            if self._acks:
                self._send_drop_now([key])     # if it ever gets to the put
            raise BackendError(f"the descriptor keeper at {self.path} did not confirm "
                               f"holding the descriptors of {key} within "
                               f"{self.ack_timeout_s:g} s")
        if not reply.get("ok"):
            why = f"the descriptor keeper refused to hold {key}: {reply.get('error')}"
            raise CapacityExceeded(why) if reply.get("full") else BackendError(why)

    def _await_ack(self, s: socket.socket, n: int) -> dict[str, object] | None:
        """The keeper's answer to put ``n`` on the main connection; None if none came
        in time (or the keeper went: the loop's reader on this connection sees that)."""
        deadline = time.monotonic() + self.ack_timeout_s
        poller = select.poll()              # not select: the edge's fds pass FD_SETSIZE
        poller.register(s.fileno(), select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not poller.poll(max(1, int(left * 1000))):
                continue
            try:
                data = s.recv(4096, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            except BlockingIOError:
                continue
            except OSError:
                return None
            if not data:                    # EOF, left in place for _lost
                return {"ok": False, "error": "the keeper went away"}
            s.recv(4096, socket.MSG_DONTWAIT)
            try:
                reply = json.loads(data)
            except ValueError:
                continue
            if isinstance(reply, dict) and reply.get("n") == n:
                return reply
            # else: a put_async's answer (to its future), or a late answer to an earlier
            # put that was given up on
            self._answered(data)

    # how long a drop waits for others to go with it (on the loop); measured with the
    # put above: one message per ended process woke the keeper every time, ~0.1 ms of
    # the edge's time per E2B commands.run on this 2-core host
    DROP_DELAY_S = 0.02

    def drop(self, key: str) -> None:
        """Stop holding ``key`` (no keeper running: nothing is held; none is started).
        On the loop the drop waits ``DROP_DELAY_S`` for others and they go together; a
        put of the same key meanwhile cancels it. Its process ended: the keeper's copies
        of its pipes keep nothing running, so the delay costs only descriptors."""
        self._latest.pop(key, None)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._send_drop_now([key])
            return
        self._drops.append(key)
        if self._drops_timer is None:
            self._drops_timer = loop.call_later(self.DROP_DELAY_S, self.flush_drops)

    def _unqueue_drop(self, key: str) -> None:
        if self._drops and key in self._drops:
            self._drops = [k for k in self._drops if k != key]

    def flush_drops(self) -> None:
        """Send the queued drops now (also before the edge closes)."""
        if self._drops_timer is not None:
            self._drops_timer.cancel()
            self._drops_timer = None
        keys, self._drops = self._drops, []
        if keys:
            self._send_drop_now(keys)

    def _send_drop_now(self, keys: list[str]) -> None:
        try:
            if self.sock is None:
                self.sock = self._connect(spawn=False)
            if self.sock is not None:
                for i, key in enumerate(keys):
                    try:
                        # never blocks the loop: a keeper that stopped reading (SIGSTOP)
                        # with its queue full keeps these until the next edge reconciles
                        self.sock.sendmsg([json.dumps({"op": "drop", "key": key}).encode()],
                                          [], socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        log.warning("descriptor keeper at %s is not reading: %d drop(s) "
                                    "not sent (it holds them until an edge restart)",
                                    self.path, len(keys) - i)
                        return
        except (OSError, BackendError):
            self._reset()

    def _ask(self, msg: dict[str, object], fds: list[int] | None = None, *,
             spawn: bool = False, timeout_s: float = 5.0,
             ) -> tuple[dict[str, object] | None, list[int]]:
        """One question on a connection of its own (answers never mix with the main
        connection's traffic; safe from a thread). None: no keeper runs (so it holds
        nothing). Raises :class:`KeeperUnreachable` when its socket is there but no
        whole answer comes (not "nothing held": red team 22, B1/B7)."""
        op = msg.get("op")
        try:
            ino = os.stat(self.path).st_ino
        except OSError:
            ino = -1
        try:
            s = self._connect(spawn=False, timeout_s=timeout_s)
            if s is None and spawn:
                self._sock()          # starts the keeper (and keeps the main connection)
                s = self._connect(spawn=False, timeout_s=timeout_s)
        except BackendError as exc:
            if spawn:
                raise
            raise KeeperUnreachable(str(exc)) from exc
        if s is None:
            # a dead keeper's socket (it was killed); only that file: this may run in a
            # thread while the loop's thread binds a new keeper's in its place
            with contextlib.suppress(OSError):
                if self.sock is None and os.stat(self.path).st_ino == ino:
                    os.unlink(self.path)
            return None, []
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] \
            if fds else []
        try:
            s.settimeout(timeout_s)
            s.sendmsg([json.dumps(msg).encode()], anc)
            data, ranc, flags, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(8 * 4),
                                             socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:
            raise KeeperUnreachable(f"the descriptor keeper at {self.path} did not answer "
                                    f"{op} within {timeout_s:g} s: {exc}") from exc
        finally:
            s.close()
        got = array.array("i")
        for level, kind, blob in ranc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got.frombytes(blob[: len(blob) - len(blob) % 4])
        why = None
        if flags & socket.MSG_CTRUNC:
            why = ("its descriptors arrived truncated: this edge is at its descriptor "
                   "limit (raise its RLIMIT_NOFILE)")
        elif flags & socket.MSG_TRUNC:
            why = "its answer was longer than 64 KiB"
        elif not data:
            why = "it closed the connection without answering"
        reply = None
        if why is None:
            try:
                reply = json.loads(data)
            except ValueError:
                reply = None
            if not isinstance(reply, dict):
                why = "its answer is not a JSON object"
        if why is not None or not isinstance(reply, dict):
            for fd in got:
                os.close(fd)
            raise KeeperUnreachable(f"the descriptor keeper at {self.path}, asked {op}: "
                                    f"{why}")
        return reply, list(got)

    def take(self, key: str) -> dict[str, int] | None:
        """Copies of what ``key`` holds (the keeper keeps its own), or None: no keeper
        (it was killed, or never started), or it holds nothing under ``key``. Raises
        :class:`KeeperUnreachable` when a keeper is there but does not answer whole."""
        reply, fds = self._ask({"op": "take", "key": key})
        names = reply.get("names") if reply is not None else None
        if names is None:
            for fd in fds:
                os.close(fd)
            return None
        if not isinstance(names, list) or len(names) != len(fds):
            for fd in fds:
                os.close(fd)
            raise KeeperUnreachable(f"the descriptor keeper at {self.path} answered take "
                                    f"{key} with {names!r} for {len(fds)} descriptors")
        return dict(zip((str(n) for n in names), fds, strict=True))

    def keys(self, *, timeout_s: float = 5.0) -> list[str] | None:
        """What the keeper holds (asked page by page: one answer is one message, red
        team 22 B7); None if no keeper runs. Raises :class:`KeeperUnreachable` when one
        is there but does not answer (whole)."""
        out: list[str] = []
        after: str | None = None
        while True:
            reply, _ = self._ask({"op": "keys", "after": after}, timeout_s=timeout_s)
            if reply is None:
                if out:
                    raise KeeperUnreachable(f"the descriptor keeper at {self.path} went "
                                            "away while listing what it holds")
                return None
            page = reply.get("keys")
            if not isinstance(page, list):
                raise KeeperUnreachable(f"the descriptor keeper at {self.path} answered "
                                        f"keys without a list: {reply!r:.200}")
            out += [str(k) for k in page]
            if not reply.get("more") or not page:
                return out
            after = out[-1]

    def spawn(self, argv: list[str], executable: str, fds: list[int]) -> KeptChild:
        """Start ``executable`` as a child of the keeper (``{0}``.. in ``argv``: the
        numbers ``fds`` get there; stdout/stderr: ours). For the edge's exec helper, so
        the processes it starts are the keeper's to reap once it is gone."""
        try:
            reply, _ = self._ask({"op": "spawn", "argv": argv, "exe": executable,
                                  "stderr": True}, [*fds, 2], spawn=True)
        except KeeperUnreachable as exc:
            raise BackendError(f"{exc}; {executable} was not started") from exc
        pid = reply.get("pid") if reply is not None else None
        if not isinstance(pid, int):
            why = reply.get("error", "no answer") if reply is not None else "no keeper"
            raise BackendError(f"the descriptor keeper at {self.path} could not start "
                               f"{executable}: {why}")
        return KeptChild(pid)

    def status(self, key: str, *, timeout_s: float = 5.0) -> int | None:
        """The raw wait status of the process ``key`` names, once the keeper reaped it
        (it waits for that if the process is its child); None if it is not the keeper's
        to know (or no keeper answers). Blocks: call it from a thread."""
        try:
            reply, _ = self._ask({"op": "status", "key": key}, timeout_s=timeout_s)
        except KeeperUnreachable as exc:
            log.warning("%s", exc)
            return None
        st = reply.get("status") if reply is not None else None
        return st if isinstance(st, int) else None

    def close(self) -> None:
        """Disconnect (the keeper keeps what it holds for the next edge)."""
        self.flush_drops()
        self._reset()
        if self.keeper is not None:
            self.keeper.poll()
