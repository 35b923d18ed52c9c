"""The descriptor keeper: a small process that is not the edge and holds, for the edge,
the pipe ends and terminal masters of its background processes (the systemd fd-store
pattern), so an edge killed with -9 does not take them along: a process whose output
pipe's last reader is gone dies of SIGPIPE at its next write, one whose stdin writer is
gone reads EOF, one whose terminal master is gone gets SIGHUP. The restarted edge takes
them back (``dsec.edge.fdstore``).

Run by path with the standard library only (``python -I fdkeeper.py LISTEN_FD PATH
ORPHAN_S``): it imports nothing of dsec, so it costs a bare interpreter (~10 MB) and its
code cannot drift with the edge's imports. The edge binds and listens on the socket
itself and hands the listening descriptor over, so it can connect before this process
has even started. Only peers of its own uid are served (SO_PEERCRED), the socket file is
0600 in the edge's state directory.

It is also the parent of the edge's exec helper (the nsexec zygote, ``spawn``) and a
child subreaper: the zygote is the parent of every command it starts, and when it exits
with its edge those commands are re-parented here, not to the host's init. So it reaps
them and keeps the exit status of each process it holds descriptors for, and a
restarted edge learns how a background process ended, during the downtime or later
(``status``).

Protocol (SOCK_SEQPACKET, one JSON object per message, descriptors as SCM_RIGHTS):
``put`` key+names (+fds, replacing what the key held; the key is ``sid/host_pid/start``;
with ``ack``: answer ``{"n": ack, "ok": bool, "error": why}`` - a refused put holds
nothing under the key, so the edge knows that process is not durable), ``drop`` key,
``take`` key (answer: its names + copies of its fds; it keeps holding them until
dropped), ``keys`` after (answer: a page of the keys it holds, sorted, past ``after``,
and ``more``), ``spawn`` argv+exe (+fds, named ``{0}``.. in argv; answer: the pid),
``status`` key (answer: the raw wait status, once the process is reaped if it is our
child; null if it is not ours to know).

Its descriptor limit (RLIMIT_NOFILE, raised to the hard limit) bounds what it holds
(red team 22, B1): it keeps a reserve for its connections, a ``spawn`` and its own files,
and refuses (answers) a put past the rest rather than having the kernel truncate the
SCM_RIGHTS; a put whose descriptors arrived truncated anyway (MSG_CTRUNC) is refused the
same way. It serves at most a bounded number of connections (the listener is not polled
while at that bound: later ones wait in its backlog), and an ``accept`` that fails for
want of a descriptor sheds that connection with a spare descriptor kept for the purpose
and pauses the listener - never a busy loop on a listener that stays readable.

It exits when it holds nothing and no edge is connected; when it holds descriptors and no
edge has been connected for ``ORPHAN_S`` seconds it closes them (their processes then see
their pipes close) and exits, so a node whose edge never comes back does not keep them
forever.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import time

MAX_FDS = 8
MAX_MSG = 1 << 16
MAX_KEY = 512          # bytes: a key is ~45 (so a keys page always fits one message)
PAGE_BYTES = 32768     # a keys answer's keys, at most (the edge reads 64 KiB)
# descriptors kept free besides those of connections: a spawn's (MAX_FDS received, the
# Popen error pipe), a /proc read, the spare, slack
RESERVE = MAX_FDS + 8


_SYS_RT_SIGACTION = {"x86_64": 13, "aarch64": 134}
_SIG_IGN = 1


class _KernelSigaction(ctypes.Structure):
    _fields_ = [("handler", ctypes.c_void_p), ("flags", ctypes.c_ulong),
                ("restorer", ctypes.c_void_p), ("mask", ctypes.c_ulong)]


def reset_ignored_signals(keep: tuple[int, ...] = (signal.SIGPIPE, signal.SIGXFSZ),
                          first: int = 1) -> list[int]:
    """Put every signal this process ignores (but ``keep``) back to its default, and
    return which: an ignored signal survives fork and execve, so whatever started the
    edge (nohup: SIGHUP; a script's ``&``: SIGINT, SIGQUIT; glibc's posix_spawn: its own
    32 and 33) would reach each process we start. Raw ``rt_sigaction``: glibc's
    ``sigaction()``, hence Python's ``signal``, refuses 32 and 33. Python ignores SIGPIPE
    and SIGXFSZ on purpose (``keep``); :class:`subprocess.Popen` restores them in a
    child. Stdlib only: the keeper runs isolated (``python -I``). ``first``: leave the
    signals below it alone (the edge passes 32: see ``ContainerBackend``)."""
    nr = _SYS_RT_SIGACTION.get(os.uname().machine)
    if nr is None:                 # not a machine we know the number on: what Python can
        done: list[int] = []
        for sig in signal.valid_signals():
            if sig >= first and sig not in keep and signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
                done.append(int(sig))
        return done
    libc = ctypes.CDLL(None, use_errno=True)
    done = []
    for s in range(max(1, first), 65):
        if s in (signal.SIGKILL, signal.SIGSTOP) or s in keep:
            continue
        old = _KernelSigaction()
        if libc.syscall(nr, s, None, ctypes.byref(old), 8) != 0 or old.handler != _SIG_IGN:
            continue
        dfl = _KernelSigaction()
        if libc.syscall(nr, s, ctypes.byref(dfl), None, 8) == 0:
            done.append(s)
    return done


def _recv(conn: socket.socket) -> tuple[dict[str, object] | None, list[int], bool]:
    """(message or None at EOF or {} if unreadable, descriptors, truncated): truncated
    when the message or its descriptors did not arrive whole (MSG_TRUNC/MSG_CTRUNC: at
    our descriptor limit the kernel drops what does not fit)."""
    data, anc, flags, _ = conn.recvmsg(MAX_MSG, socket.CMSG_SPACE(MAX_FDS * 4),
                                       socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, blob in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(blob[: len(blob) - len(blob) % 4])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, [], False
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        try:
            msg = json.loads(data)
        except ValueError:
            msg = None
        return (msg if isinstance(msg, dict) else {}), [], True
    try:
        msg = json.loads(data)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        for fd in fds:
            os.close(fd)
        return {}, [], False
    return msg, list(fds), False


def _send(conn: socket.socket, msg: dict[str, object], fds: list[int] | None = None) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] \
        if fds else []
    try:
        conn.sendmsg([json.dumps(msg).encode()], anc)
    except OSError:
        pass   # the edge went away mid-answer: it asks again when it comes back


_PR_SET_CHILD_SUBREAPER = 36
MAX_EXITS = 4096
GONE_S = 60.0     # no edge, every held process ended: exit after this long


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rfind(b")") + 2:].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rfind(b")") + 2:].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1     # less listdir's own
    except OSError:
        return 16


def _pid_key(key: str) -> str:
    """``sid/host_pid/start`` -> ``host_pid/start``."""
    return key.split("/", 1)[-1]


def _spawn(msg: dict[str, object], fds: list[int]) -> subprocess.Popen[bytes]:
    raw = msg.get("argv")
    argv = [str(a) for a in raw] if isinstance(raw, list) else []
    for i, fd in enumerate(fds):
        argv = [a.replace(f"{{{i}}}", str(fd)) for a in argv]
    err = fds[-1] if msg.get("stderr") and fds else None
    try:
        # Popen, not posix_spawn: glibc's posix_spawn leaves its internal signals (32,
        # 33) ignored in the child, and that would reach every sandbox command; Popen
        # resets SIGPIPE/SIGXFSZ (Python ignores them) and we ignore nothing else
        return subprocess.Popen(argv, executable=str(msg.get("exe")), pass_fds=fds,
                                close_fds=True, stdin=subprocess.DEVNULL, stdout=err,
                                stderr=err)
    finally:
        for fd in fds:
            os.close(fd)


def serve(listener: socket.socket, path: str, orphan_s: float) -> None:
    try:
        ino = os.stat(path).st_ino
    except OSError:
        ino = -1
    held: dict[str, tuple[list[str], list[int]]] = {}
    conns: list[socket.socket] = []
    alone_since = time.monotonic()
    uid = os.getuid()
    exits: dict[str, int] = {}                 # host_pid/start -> raw wait status
    spawned: dict[int, subprocess.Popen[bytes]] = {}
    waiting: dict[str, list[socket.socket]] = {}
    wake_r, wake_w = socket.socketpair()       # SIGCHLD wakes select
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    spare: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = 1 << 20 if limit == resource.RLIM_INFINITY else limit
    base = _open_fds()
    max_conns = max(2, min(64, limit // 16))
    hold_cap = max(0, limit - base - max_conns - RESERVE)
    nheld = 0                                  # descriptors held, all keys
    listen_paused_until = 0.0

    def close_key(key: str) -> None:
        nonlocal nheld
        old = held.pop(key, None)
        if old is not None:
            for fd in old[1]:
                os.close(fd)
            nheld -= len(old[1])
        exits.pop(_pid_key(key), None)

    def put(key: str, names: list[str], fds: list[int],
            truncated: bool) -> tuple[str | None, bool]:
        """Hold ``fds`` under ``key``; or why not, and whether for want of descriptors
        (then nothing is held under it)."""
        nonlocal nheld
        before = len(held[key][1]) if key in held else 0
        why = None
        full = truncated or nheld - before + len(fds) > hold_cap
        if truncated:
            why = ("its descriptors arrived truncated (the keeper is at its descriptor "
                   f"limit, {limit}): raise the edge's hard RLIMIT_NOFILE or end "
                   "background processes")
        elif len(key.encode()) > MAX_KEY or not key:
            why = f"a key must be 1-{MAX_KEY} bytes"
        elif len(names) != len(fds):
            why = f"{len(names)} names for {len(fds)} descriptors"
        elif nheld - before + len(fds) > hold_cap:
            why = (f"the keeper holds {nheld} descriptors and may hold {hold_cap} (its "
                   f"RLIMIT_NOFILE {limit}, less a reserve): raise the edge's hard "
                   "RLIMIT_NOFILE or end background processes")
        close_key(key)
        if why is not None:
            for fd in fds:
                os.close(fd)
            return why, full
        held[key] = (names, fds)
        nheld += len(fds)
        return None, False

    def keys_page(after: object) -> dict[str, object]:
        page: list[str] = []
        size = 0
        for k in sorted(held):
            if isinstance(after, str) and k <= after:
                continue
            n = len(json.dumps(k)) + 2
            if size + n > PAGE_BYTES:
                return {"keys": page, "more": True}
            page.append(k)
            size += n
        return {"keys": page, "more": False}

    def accept() -> None:
        nonlocal spare, listen_paused_until
        try:
            c, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            # out of descriptors (or another failure): the connection stays queued and
            # the listener readable; shed it with the spare descriptor, and do not poll
            # the listener for a moment (no busy loop)
            listen_paused_until = time.monotonic() + 0.2
            if exc.errno in (errno.EMFILE, errno.ENFILE) and spare is not None:
                os.close(spare)
                spare = None
                with contextlib.suppress(OSError):
                    listener.accept()[0].close()
                with contextlib.suppress(OSError):
                    spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            return
        creds = c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                             struct.calcsize("3i"))
        _, peer_uid, _ = struct.unpack("3i", creds)
        if peer_uid != uid:
            c.close()     # another user: nothing here is theirs
            return
        conns.append(c)

    def reap() -> None:
        watched: set[str] | None = None     # built once a child did end (O(held))
        while True:
            try:
                si = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if si is None or not si.si_pid:
                return
            start = _start_time(si.si_pid)     # a zombie still has its stat
            try:
                _, status = os.waitpid(si.si_pid, 0)
            except ChildProcessError:
                continue
            child = spawned.pop(si.si_pid, None)
            if child is not None:
                child.returncode = status     # so Popen never waits for a reused pid
            pk = f"{si.si_pid}/{start}"
            if watched is None:
                watched = {_pid_key(k) for k in held} | set(waiting)
            if pk in watched and len(exits) < MAX_EXITS:
                exits[pk] = status
            for c in waiting.pop(pk, []):
                _send(c, {"status": status})

    def all_gone() -> bool:
        for key in held:
            pid, _, start = _pid_key(key).partition("/")
            if not pid.isdigit() or str(_start_time(int(pid))) == start:
                return False
        return True

    first = True      # the edge that started us connects first (queued on the listener)
    gone_since: float | None = None
    while True:
        reap()
        now = time.monotonic()
        if conns:
            alone_since = now
            first = False
            gone_since = None
        elif first:
            if now - alone_since > 10.0:
                break
        elif not held or now - alone_since > orphan_s:
            break
        elif all_gone():
            # every process held for has ended (their statuses are kept for the next
            # edge) and no edge came back: do not wait the whole orphan time for it
            gone_since = gone_since if gone_since is not None else now
            if now - gone_since > min(orphan_s, GONE_S):
                break
        else:
            gone_since = None
        # poll, not select: held descriptors push a late connection past FD_SETSIZE
        poller = select.poll()
        polled = [wake_r, *conns]
        paused = now < listen_paused_until
        if len(conns) < max_conns and not paused:
            polled.append(listener)      # else later connections wait in its backlog
        if spare is None:
            with contextlib.suppress(OSError):
                spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        by_fd = {x.fileno(): x for x in polled}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        wait_s = None if conns else max(0.1, min(orphan_s / 10, 1.0))
        if paused:
            wait_s = min(wait_s or 1.0, max(0.01, listen_paused_until - now))
        ready = [by_fd[fd] for fd, _ in
                 poller.poll(None if wait_s is None else int(wait_s * 1000))]
        for s in ready:
            if s is wake_r:
                with contextlib.suppress(OSError):
                    wake_r.recv(4096)
                continue
            if s is listener:
                accept()
                continue
            try:
                msg, fds, truncated = _recv(s)
            except OSError:
                msg, fds, truncated = None, [], False
            if msg is None:
                conns.remove(s)
                s.close()
                continue
            op, key = msg.get("op"), str(msg.get("key", ""))
            if op == "put":
                raw = msg.get("names")
                names = [str(n) for n in raw] if isinstance(raw, list) else []
                why, full = put(key, names, fds, truncated)
                if "ack" in msg:
                    _send(s, {"n": msg["ack"], "ok": why is None, "error": why,
                              "full": full})
            elif op == "drop":
                for fd in fds:
                    os.close(fd)
                close_key(key)
            elif op == "take":
                for fd in fds:
                    os.close(fd)
                got = held.get(key)
                _send(s, {"names": got[0] if got else None}, got[1] if got else [])
            elif op == "keys":
                for fd in fds:
                    os.close(fd)
                _send(s, keys_page(msg.get("after")))
            elif op == "spawn":
                if truncated:
                    _send(s, {"error": "its descriptors arrived truncated (the keeper is "
                                       f"at its descriptor limit, {limit})"})
                    continue
                try:
                    child = _spawn(msg, fds)
                except OSError as exc:
                    _send(s, {"error": str(exc)})
                else:
                    spawned[child.pid] = child    # reaped by reap(), not by Popen
                    _send(s, {"pid": child.pid})
            elif op == "status":
                for fd in fds:
                    os.close(fd)
                pk = _pid_key(key)
                if pk in exits:
                    _send(s, {"status": exits[pk]})
                    continue
                pid, _, start = pk.partition("/")
                if (pid.isdigit() and _parent(int(pid)) == os.getpid()
                        and str(_start_time(int(pid))) == start):
                    waiting.setdefault(pk, []).append(s)   # answered once reaped
                else:
                    _send(s, {"status": None})      # not ours: nobody here reaps it
            else:
                for fd in fds:
                    os.close(fd)
    for key in list(held):
        close_key(key)
    try:
        if os.stat(path).st_ino == ino:
            os.unlink(path)        # still ours (a later edge may have bound a new one)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    listen_fd, path, orphan_s = int(argv[1]), argv[2], float(argv[3])
    # orphans of the exec helper we start come to us, not to the host's init
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("fdkeeper: PR_SET_CHILD_SUBREAPER:", os.strerror(ctypes.get_errno()),
              file=sys.stderr)
    os.set_inheritable(listen_fd, False)
    reset_ignored_signals()       # what it spawns (the exec helper) inherits them
    signal.pthread_sigmask(signal.SIG_SETMASK, ())   # ... and a blocked mask too
    # it may hold three descriptors per background process of the node
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    listener = socket.socket(fileno=listen_fd)
    serve(listener, path, orphan_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
