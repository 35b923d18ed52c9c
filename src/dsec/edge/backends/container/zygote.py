"""The helper process that starts sandboxes and every process that runs in one.

Why a helper: the edge is a big asyncio process with threads, sockets and a large heap;
this one is small, single-threaded and does nothing but switch its *pid namespace for
children* and ``posix_spawn`` (vfork semantics: the parent's page tables are never
copied) the static C binary ``dsec-nsexec`` (:mod:`.nsexec`), which does the rest -
cgroup join, namespaces, root, capabilities, no_new_privs, seccomp, execve - in C. It
speaks :mod:`.protocol` over one SOCK_SEQPACKET socket and exits when the edge closes
it; sandboxes it started keep running (their processes re-parent to the sandbox init).

Measured on the 2-core dev VM: the previous design forked this ~20 MB Python process per
create/exec and did the setup with ctypes (fork ~0.4 ms of page-table copy in this
single-threaded loop, then ~1.5 ms of Python in the child); with 64 execs in flight the
fork serialised everything at ~600 execs/s. A spawn here blocks this loop only until the
helper's execve (tens of microseconds); the setup runs in parallel in the helpers.

create: ``unshare(CLONE_NEWPID)`` here, spawn, switch ``pid_ns_for_children`` back: the
helper is PID 1 of a fresh pid namespace, builds the root and execs the init (catatonit
-P). Success is EOF on a close-on-exec status pipe; a failure is its text.

exec: ``setns(init pidfd, CLONE_NEWPID)`` here, spawn, switch back; the helper is in the
sandbox's pid namespace from birth and enters the others with one ``setns(pidfd, ...)``.
Foreground execs are reported Started at once and Exited when reaped; background execs
are reported Started only once their target is running (EOF on the status pipe), so
their pid names the command, not the helper.

The seccomp programs are compiled once (libseccomp, here) into two memfds the helpers
read and load with one prctl. dsec-nsexec makes itself non-dumpable before touching
anything, so sandbox processes cannot open ``/proc/<helper>/{root,fd}`` while it still
holds host state; the window before that prctl is covered by the capability check
(the helper's capabilities are a superset of any sandbox process's).
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import selectors
import signal
import socket
import sys

from dsec.edge.backends.container import linux
from dsec.edge.backends.container.protocol import (
    Create,
    Created,
    Exec,
    Exited,
    Failed,
    Kill,
    Reply,
    Started,
    decode_request,
    encode,
)
from dsec.net.seccomp import compile_profile

INIT_BINARIES = ("/usr/bin/catatonit",)
_PR_SET_DUMPABLE = 4
_MAX_FDS = 8
# dsec-nsexec expects its fds at fixed numbers (see nsexec.c). Every fd this process
# opens or receives is >= _LOW_FDS (the low slots are held), so the dup2 file actions of a
# spawn can never overwrite a source they still need.
_LOW_FDS = 10


def _memfd_with(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


class Zygote:
    def __init__(self, sock: socket.socket, nsexec: str) -> None:
        self.sock = sock
        self.nsexec = nsexec
        self.held = []  # keeps fds 0.._LOW_FDS-1 occupied (see _LOW_FDS)
        while True:
            fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            if fd >= _LOW_FDS:
                os.close(fd)
                break
            self.held.append(fd)
        self.bpf = {nested: _memfd_with("dsec-seccomp", compile_profile(allow_nested=nested))
                    for nested in (False, True)}
        self.init_path = next((p for p in INIT_BINARIES if os.path.exists(p)), "")
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # pid -> exec id for foreground execs (their exit is reported)
        self.execs: dict[int, int] = {}
        # status pipe fd -> (request id, pid, pidfd or -1) for creates and background
        # execs that have not reached their final execve yet
        self.pending: dict[int, tuple[int, int, int]] = {}

    def send(self, msg: Reply, fds: list[int] | None = None) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] \
            if fds else []
        try:
            self.sock.sendmsg([encode(msg)], anc)
        except (BrokenPipeError, ConnectionResetError):
            os._exit(0)

    def run(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(self.sock, selectors.EVENT_READ, "sock")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        while True:
            for key, _ in self.sel.select():
                if key.data == "sock":
                    self.on_request()
                elif key.data == "wake":
                    try:
                        while os.read(self.wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    self.reap()
                else:
                    self.on_status(int(key.fd))

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rid = self.execs.pop(pid, None)
            if rid is not None:
                self.send(Exited(rid, status))

    def on_request(self) -> None:
        # Drain everything queued: one wake-up of the selector per burst, not per request.
        for _ in range(256):
            fds = array.array("i")
            try:
                data, anc, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(_MAX_FDS * 4),
                                                    socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                os._exit(0)  # the edge went away; sandboxes keep running
            for level, kind, blob in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(blob[: len(blob) - len(blob) % 4])
            self.handle(data, list(fds))

    def handle(self, data: bytes, fds: list[int]) -> None:
        try:
            req = decode_request(data)
        except Exception as exc:  # noqa: BLE001
            for fd in fds:
                os.close(fd)
            self.send(Failed(-1, f"undecodable request: {exc}"))
            return
        try:
            if isinstance(req, Create):
                self.create(req)
            elif isinstance(req, Exec):
                self.exec(req, fds)
            elif isinstance(req, Kill):
                self.kill(req)
        except OSError as exc:
            self.send(Failed(req.id, str(exc), exc.errno or 0))
        finally:
            for fd in fds:
                os.close(fd)

    def spawn(self, argv: list[str], dups: list[int], ns_fd: int, ns_type: int) -> int:
        """posix_spawn dsec-nsexec with ``dups[i]`` as its fd ``i``, its pid namespace
        being ``ns_fd`` (setns) or, with ``ns_fd < 0``, a new one (unshare)."""
        actions = [(os.POSIX_SPAWN_DUP2, src, i) for i, src in enumerate(dups)]
        if ns_fd < 0:
            linux.unshare(ns_type)
        else:
            linux.setns(ns_fd, ns_type)
        try:
            return os.posix_spawn(self.nsexec, argv, {}, file_actions=actions)
        finally:
            linux.setns(self.own_pidns, linux.CLONE_NEWPID)

    def create(self, req: Create) -> None:
        if not self.init_path:
            raise OSError(errno.ENOENT, f"no init binary: install catatonit ({INIT_BINARIES})")
        opts = f"lowerdir={':'.join(req.lowerdirs)},upperdir={req.upper},workdir={req.work}"
        argv = [self.nsexec, "create", req.root, opts, req.hostname,
                "1" if req.loopback else "0", str(req.tmp_bytes), self.init_path,
                str(len(req.cgroup_procs)), *req.cgroup_procs]
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = self.spawn(argv, [self.devnull, self.devnull, self.devnull, status_w,
                                    self.bpf[req.nested]], -1, linux.CLONE_NEWPID)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        pidfd = os.pidfd_open(pid)
        os.set_inheritable(pidfd, False)
        self.pending[status_r] = (req.id, pid, pidfd)
        self.sel.register(status_r, selectors.EVENT_READ, "status")

    def on_status(self, fd: int) -> None:
        rid, pid, pidfd = self.pending.pop(fd)
        self.sel.unregister(fd)
        msg = os.read(fd, 4096)
        os.close(fd)
        if pidfd < 0:  # a background exec
            if msg:
                self.send(Failed(rid, msg.decode(errors="replace").strip()))
            else:
                self.send(Started(rid, pid, _ns_pid(pid)))
            return
        if msg:
            os.close(pidfd)
            self.send(Failed(rid, msg.decode(errors="replace")))
            return
        self.send(Created(rid, pid), [pidfd])
        os.close(pidfd)

    def exec(self, req: Exec, fds: list[int]) -> None:
        if len(fds) != 4:
            raise OSError(errno.EINVAL, f"exec needs 4 fds, got {len(fds)}")
        pidfd, stdin, stdout, stderr = fds
        if req.background:  # output of a detached process goes nowhere, it may outlive us
            stdin = stdout = stderr = self.devnull
        argv = [self.nsexec, "exec", req.cwd or "", req.user or "",
                str(len(req.cgroup_procs)), *req.cgroup_procs,
                str(len(req.env)), *req.env, "--", *req.argv]
        if not req.background:
            pid = self.spawn(argv, [stdin, stdout, stderr, pidfd, self.bpf[req.nested],
                                    self.devnull], pidfd, linux.CLONE_NEWPID)
            self.execs[pid] = req.id
            self.send(Started(req.id, pid, pid))
            return
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = self.spawn(argv, [stdin, stdout, stderr, pidfd, self.bpf[req.nested],
                                    status_w], pidfd, linux.CLONE_NEWPID)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        self.pending[status_r] = (req.id, pid, -1)
        self.sel.register(status_r, selectors.EVENT_READ, "status")

    def kill(self, req: Kill) -> None:
        for pid, rid in self.execs.items():
            if rid == req.id:
                for fn in (os.killpg, os.kill):
                    try:
                        fn(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return


def _ns_pid(pid: int) -> int:
    """The pid of host process ``pid`` inside its innermost pid namespace."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return pid


def main() -> None:
    fd, nsexec = int(sys.argv[1]), sys.argv[2]
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    Zygote(sock, nsexec).run()


if __name__ == "__main__":
    main()
