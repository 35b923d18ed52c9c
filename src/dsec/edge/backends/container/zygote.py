"""The helper process that starts sandboxes and forks every process that runs in one.

Why a helper: forking the edge (a big asyncio process with threads, sockets and a large
heap) per exec would copy its page tables and inherit its state; this process is small,
single-threaded and has everything it needs imported before it forks, so its children do
no imports after they entered a sandbox (a hostile sandbox could plant modules on the
path otherwise). It speaks :mod:`.protocol` over one SOCK_SEQPACKET socket and exits when
the edge closes it; sandboxes it started keep running (their inits are re-parented).

create: ``unshare(CLONE_NEWPID)`` here, fork, and switch this process's
``pid_ns_for_children`` back, so the child is PID 1 of a fresh pid namespace after one
fork (fork+unshare+fork measured 5.4-6.8 ms, this path ~2-3 ms). The child joins its
cgroup itself (in parallel with the next request), unshares the other namespaces, builds
the root and execs the init (catatonit -P) - success is seen as EOF on a close-on-exec
status pipe.

exec: ``setns(init pidfd, CLONE_NEWPID)`` here, fork, switch back; the child joins the
cgroup, enters mount/net/uts/ipc/cgroup namespaces with one ``setns(pidfd, ...)`` (the
mount namespace's root is the sandbox root: no chroot needed), drops to the container
capability set, sets no_new_privs, loads the seccomp program and execs.

This process is non-dumpable (inherited by its children until execve) so a sandbox
process cannot open ``/proc/<child>/fd/*`` during the short window between a child
entering the sandbox and exec'ing.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import selectors
import signal
import socket
import stat
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
from dsec.edge.backends.container.rootfs import (
    DEVICES,
    MASKED_DIRS,
    MASKED_FILES,
    READONLY_PATHS,
    SHM_BYTES,
)
from dsec.net.netns import bring_loopback_up
from dsec.net.seccomp import compile_profile

INIT_BINARIES = ("/usr/bin/catatonit",)
_NS_CREATE = (linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWUTS
              | linux.CLONE_NEWIPC | linux.CLONE_NEWCGROUP)
_NS_ENTER = _NS_CREATE
_PR_SET_DUMPABLE = 4
_MAX_FDS = 8


def _write_file(path: str, data: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def _mkdirs(path: str) -> None:
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _build_root(req: Create, init_path: str) -> None:
    """Runs in the create child, inside its fresh mount namespace."""
    M = linux
    root = req.root
    M.mount(None, "/", None, M.MS_REC | M.MS_PRIVATE)
    opts = f"lowerdir={':'.join(req.lowerdirs)},upperdir={req.upper},workdir={req.work}"
    M.mount("overlay", root, "overlay", M.MS_NODEV, opts)
    for d in ("proc", "dev", "sys", "tmp"):
        _mkdirs(f"{root}/{d}")
    M.mount("proc", f"{root}/proc", "proc", M.MS_NOSUID | M.MS_NODEV | M.MS_NOEXEC)
    dev = f"{root}/dev"
    M.mount("tmpfs", dev, "tmpfs", M.MS_NOSUID, "mode=755,size=64k,nr_inodes=64")
    for name, major, minor, mode in DEVICES:
        os.mknod(f"{dev}/{name}", stat.S_IFCHR | mode, os.makedev(major, minor))
        os.chmod(f"{dev}/{name}", mode)
    os.mkdir(f"{dev}/pts")
    M.mount("devpts", f"{dev}/pts", "devpts", M.MS_NOSUID | M.MS_NOEXEC,
            "newinstance,ptmxmode=0666,mode=0620")
    os.symlink("pts/ptmx", f"{dev}/ptmx")
    os.mkdir(f"{dev}/shm", 0o1777)
    M.mount("tmpfs", f"{dev}/shm", "tmpfs", M.MS_NOSUID | M.MS_NODEV | M.MS_NOEXEC,
            f"mode=1777,size={SHM_BYTES}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    _touch(f"{dev}/.init")
    M.mount(init_path, f"{dev}/.init", None, M.MS_BIND)
    M.mount(None, f"{dev}/.init", None,
            M.MS_BIND | M.MS_REMOUNT | M.MS_RDONLY | M.MS_NOSUID | M.MS_NODEV)
    M.mount("tmpfs", f"{root}/tmp", "tmpfs", M.MS_NOSUID | M.MS_NODEV,
            f"mode=1777,size={req.tmp_bytes}")
    M.mount("sysfs", f"{root}/sys", "sysfs",
            M.MS_RDONLY | M.MS_NOSUID | M.MS_NODEV | M.MS_NOEXEC)
    for p in MASKED_FILES:
        if os.path.exists(root + p):
            M.mount(f"{dev}/null", root + p, None, M.MS_BIND)
    for p in MASKED_DIRS:
        if os.path.isdir(root + p):
            M.mount("tmpfs", root + p, "tmpfs", M.MS_RDONLY | M.MS_NOSUID | M.MS_NODEV
                    | M.MS_NOEXEC, "size=0,nr_inodes=1")
    for p in READONLY_PATHS:
        if os.path.exists(root + p):
            M.mount(root + p, root + p, None, M.MS_BIND | M.MS_REC)
            M.mount(None, root + p, None, M.MS_BIND | M.MS_REMOUNT | M.MS_RDONLY
                    | M.MS_NOSUID | M.MS_NODEV | M.MS_NOEXEC)
    # pivot_root(".", "."): the old root ends up stacked under the new one; detach it.
    os.chdir(root)
    M.pivot_root(".", ".")
    M.umount2(".", M.MNT_DETACH)
    os.chdir("/")


def _harden(bpf: bytes) -> None:
    linux.drop_capabilities()
    linux.set_no_new_privs()
    linux.load_seccomp(bpf)


def _child_create(req: Create, status_w: int, init_path: str, bpf: bytes) -> None:
    """PID 1 of the new pid namespace; never returns."""
    try:
        for f in req.cgroup_procs:
            _write_file(f, "0")
        linux.unshare(_NS_CREATE)
        os.umask(0)
        _build_root(req, init_path)
        os.umask(0o022)
        linux.sethostname(req.hostname)
        if req.loopback:
            bring_loopback_up()
        null = os.open("/dev/null", os.O_RDWR)
        for i in range(3):
            os.dup2(null, i)
        _harden(bpf)
        os.execve("/dev/.init", ["/dev/.init", "-P"], {"PATH": "/bin"})
    except BaseException as exc:  # noqa: BLE001 - report anything, then die
        try:
            os.write(status_w, f"{type(exc).__name__}: {exc}".encode()[:4000])
        finally:
            os._exit(1)


def _lookup_user(user: str) -> tuple[int, int, str]:
    """``user`` (name, uid or uid:gid) -> (uid, gid, home), read from the sandbox's own
    /etc/passwd (we are already inside its mount namespace)."""
    name, _, group = user.partition(":")
    if name.isdigit():
        uid, gid, home = int(name), int(name), "/"
        try:
            with open("/etc/passwd", "rb") as f:
                for line in f.read(1 << 20).decode(errors="replace").splitlines():
                    parts = line.split(":")
                    if len(parts) >= 6 and parts[2] == name:
                        gid, home = int(parts[3]), parts[5]
                        break
        except OSError:
            pass
    else:
        with open("/etc/passwd", "rb") as f:
            for line in f.read(1 << 20).decode(errors="replace").splitlines():
                parts = line.split(":")
                if len(parts) >= 6 and parts[0] == name:
                    uid, gid, home = int(parts[2]), int(parts[3]), parts[5]
                    break
            else:
                raise OSError(errno.ENOENT, f"unknown user {name!r} in /etc/passwd")
    if group.isdigit():
        gid = int(group)
    return uid, gid, home


def _child_exec(req: Exec, fds: list[int], bpf: bytes) -> None:
    """Runs in the exec child (already in the sandbox's pid namespace); never returns."""
    try:
        pidfd, stdin, stdout, stderr = fds
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.setsid()
        for f in req.cgroup_procs:
            _write_file(f, "0")
        linux.setns(pidfd, _NS_ENTER)
        env = list(req.env)
        home = None
        if req.user is not None:
            uid, gid, home = _lookup_user(req.user)
        os.chdir(req.cwd or "/")
        linux.drop_capabilities()
        if req.user is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            env = [e for e in env if not e.startswith("HOME=")] + [f"HOME={home}"]
        linux.set_no_new_privs()
        linux.load_seccomp(bpf)
        envd = dict(e.split("=", 1) for e in env)
        os.execvpe(req.argv[0], req.argv, envd)
    except BaseException as exc:  # noqa: BLE001
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        try:
            os.write(2, f"dsec: cannot run {req.argv[0]!r}: {exc}\n".encode())
        finally:
            os._exit(code)


class Zygote:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.bpf = {False: compile_profile(allow_nested=False),
                    True: compile_profile(allow_nested=True)}
        self.init_path = next((p for p in INIT_BINARIES if os.path.exists(p)), "")
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # pid -> exec id for foreground execs (their exit is reported)
        self.execs: dict[int, int] = {}
        # status pipe fd -> (request id, pid, pidfd) for creates in progress
        self.creating: dict[int, tuple[int, int, int]] = {}

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
                    self.on_create_status(int(key.fd))

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
        fds = array.array("i")
        try:
            data, anc, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(_MAX_FDS * 4),
                                                socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            os._exit(0)  # the edge went away; sandboxes keep running
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(blob[: len(blob) - len(blob) % 4])
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
                self.exec(req, list(fds))
            elif isinstance(req, Kill):
                self.kill(req)
        except OSError as exc:
            self.send(Failed(req.id, str(exc), exc.errno or 0))
        finally:
            for fd in fds:
                os.close(fd)

    def create(self, req: Create) -> None:
        if not self.init_path:
            raise OSError(errno.ENOENT, f"no init binary: install catatonit ({INIT_BINARIES})")
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            linux.unshare(linux.CLONE_NEWPID)
            pid = self.fork_restoring_pidns()
            if pid == 0:
                try:
                    os.close(status_r)
                    _child_create(req, status_w, self.init_path, self.bpf[req.nested])
                finally:
                    os._exit(1)
            os.close(status_w)
        except BaseException:
            os.close(status_r)
            os.close(status_w)
            raise
        pidfd = os.pidfd_open(pid)
        os.set_inheritable(pidfd, False)
        self.creating[status_r] = (req.id, pid, pidfd)
        self.sel.register(status_r, selectors.EVENT_READ, "create")

    def on_create_status(self, fd: int) -> None:
        rid, pid, pidfd = self.creating.pop(fd)
        self.sel.unregister(fd)
        msg = os.read(fd, 4096)
        os.close(fd)
        if msg:
            os.close(pidfd)
            self.send(Failed(rid, msg.decode(errors="replace")))
            return
        self.send(Created(rid, pid), [pidfd])
        os.close(pidfd)

    def exec(self, req: Exec, fds: list[int]) -> None:
        if len(fds) != 4:
            raise OSError(errno.EINVAL, f"exec needs 4 fds, got {len(fds)}")
        if req.background:  # output of a detached process goes nowhere, it may outlive us
            fds = [fds[0], self.devnull, self.devnull, self.devnull]
        linux.setns(fds[0], linux.CLONE_NEWPID)
        pid = self.fork_restoring_pidns()
        if pid == 0:
            try:
                _child_exec(req, fds, self.bpf[req.nested])
            finally:
                os._exit(126)
        ns_pid = pid
        if req.background:
            ns_pid = _ns_pid(pid)
        else:
            self.execs[pid] = req.id
        self.send(Started(req.id, pid, ns_pid))

    def fork_restoring_pidns(self) -> int:
        """fork, then (in this process only) point ``pid_ns_for_children`` back at our
        own pid namespace. The child must not try: that ns is its ancestor (EINVAL)."""
        try:
            pid = os.fork()
        except BaseException:
            linux.setns(self.own_pidns, linux.CLONE_NEWPID)
            raise
        if pid != 0:
            linux.setns(self.own_pidns, linux.CLONE_NEWPID)
        return pid

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
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    Zygote(sock).run()


if __name__ == "__main__":
    main()
