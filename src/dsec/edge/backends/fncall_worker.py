"""A pre-started Python worker for the ``fncall`` backend, and the zygote that forks it.

Started by the edge as ``python -I -c BOOT MODE FD`` (see ``fncall.WorkerPool``), where
BOOT puts the edge's own dsec source root (read from stdin, so no host path is in the
argv a call can read in /proc) on ``sys.path`` and calls :func:`main`. ``MODE`` is
``--zygote`` or ``--worker``; ``FD`` the control socket.

The **zygote** reads one config message (``u32 length + msgpack {"jail": JailConfig |
None}``), builds the jail root and pivots into it when there is a jail (see
``fncall_jail.py``), answers ``Z``, then for every control message carrying a socket
(SCM_RIGHTS) forks a worker on that socket and answers its pid (``u32``). It imports once
and never runs user code, so every worker starts from the same clean, warm state.
Measured on the 2-core dev VM: a fork from the zygote is ready in ~1-2 ms of CPU; a
fresh interpreter start is ~30-40 ms.

A **jailed worker** is two processes: the worker init (PID 1 of a new pid namespace,
root, our code only: it builds the worker's namespaces and mounts and then only reaps)
and the call process (PID 2) that serves one call. The call process sends ``R`` with a
pidfd of the init (SCM_RIGHTS) when warm; the edge kills the whole worker - every
process the call started - by SIGKILL through that pidfd. An **unjailed** worker (the
old behaviour, ``WorkerPool(jail=None)``: no isolation at all) is one process in its own
session that sends ``R`` and is killed by process group.

A call: ``C`` (with SCM_RIGHTS: the work dir's detached mount, the sandbox's
``cgroup.procs`` fds; none when unjailed), then ``u32 length + msgpack request``. The
worker admits itself into the sandbox (``fncall_jail.admit``: after it, no capability
and no host fd is left), runs the code or pickled function, and answers ``u32 length +
msgpack reply``, plain msgpack with no pickles: the code in here is hostile and the edge
must never unpickle its output. The pickled function in a request comes from the edge
(trusted by the worker) and is unpickled only after admission.
"""

from __future__ import annotations

import array
import ast
import gc
import io
import os
import pickle
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

import msgspec

from dsec.edge.backends import fncall_jail
from dsec.edge.backends.fncall_jail import JailConfig
from dsec.edge.fdkeeper import reset_ignored_signals

_LEN = struct.Struct("!I")
_MAX_FDS = 16
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv_fds(sock: socket.socket, tag: bytes) -> list[int]:
    """Receive the one-byte message ``tag`` and the fds that came with it."""
    msg, anc, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(4 * _MAX_FDS))
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
    if msg != tag:
        for f in fds:
            os.close(f)
        raise EOFError(f"expected {tag!r}, got {msg!r}")
    return fds


def _run_code(code: str, glb: dict[str, Any]) -> object:
    tree = ast.parse(code, "<fncall>", "exec")
    last = None
    if tree.body and isinstance(tail := tree.body[-1], ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    exec(compile(tree, "<fncall>", "exec"), glb)  # noqa: S102 - running it is the job
    if last is not None:
        value = eval(compile(last, "<fncall>", "eval"), glb)
        if value is not None:
            print(repr(value))  # like the interactive interpreter
        return value
    return glb.get("result")


def _read_back(fd: int, cap: int) -> tuple[bytes, bool]:
    size = os.lseek(fd, 0, os.SEEK_END)
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, min(size, cap)) if cap else b""
    return data, size > cap


def _close_all_but(keep: set[int]) -> None:
    """Close every fd except 0-2 and ``keep`` (close_range under the hood)."""
    low = 3
    for fd in sorted(keep):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, 1 << 20)


def _devnull_stdio() -> None:
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)


def zygote(fd: int) -> None:
    ctl = socket.socket(fileno=fd)
    ctl.setblocking(True)
    (n,) = _LEN.unpack(_recv_exact(ctl, 4))
    raw = msgspec.msgpack.decode(_recv_exact(ctl, n))
    jail = msgspec.convert(raw["jail"], JailConfig) if raw.get("jail") is not None else None
    own_pidns = -1
    if jail is not None:
        try:
            own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            fncall_jail.build_root(jail)
            _devnull_stdio()
            os.setpriority(os.PRIO_PROCESS, 0, jail.prestart_nice)  # workers inherit it
            # Host paths that do not exist in the jail (the dsec source, PYTHONPATH-like
            # leftovers) go from sys.path: imports look only where the runtime is.
            sys.path[:] = [p for p in sys.path if p and os.path.isdir(p)]
        except Exception as exc:  # noqa: BLE001 - reported to the edge, then we exit
            ctl.sendall(b"E" + f"{type(exc).__name__}: {exc}".encode()[:4000])
            os._exit(1)
    reset_ignored_signals()   # what started the edge ignored is not the calls' to inherit
    # nor what it blocked: a blocked mask survives fork and execve too (Popen leaves it),
    # and a call with SIGTERM/SIGINT blocked ignores a timeout's polite stop
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the forked workers
    # Everything imported so far goes to the permanent generation: a collection in a
    # worker then never walks (and copy-on-write-faults) the zygote's heap.
    gc.freeze()
    ctl.sendall(b"Z")
    while True:
        msg, anc, _, _ = ctl.recvmsg(1, socket.CMSG_SPACE(4 * 4))
        if not msg:
            os._exit(0)  # the edge went away
        fds: list[int] = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if len(fds) != 1:
            for f in fds:
                os.close(f)
            ctl.sendall(_LEN.pack(0))
            continue
        try:
            if jail is not None:
                fncall_jail.next_child_in_new_pid_namespace(own_pidns)
            pid = os.fork()
        except OSError:
            os.close(fds[0])
            ctl.sendall(_LEN.pack(0))
            continue
        if pid == 0:
            try:
                ctl.close()
                if own_pidns >= 0:
                    os.close(own_pidns)
                if jail is None:
                    os.setsid()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # user code may wait()
                    serve_one(fds[0], None)
                else:
                    worker_init(fds[0], jail)
            finally:
                os._exit(1)
        os.close(fds[0])
        ctl.sendall(_LEN.pack(pid))


def worker_init(sock_fd: int, jail: JailConfig) -> None:
    """PID 1 of a worker's pid namespace: build the namespaces, start the call process,
    then reap until it exits - and exit with it, which kills whatever it left behind."""
    _close_all_but({sock_fd})
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock = socket.socket(fileno=sock_fd)
    try:
        fncall_jail.enter_worker(jail)
        me = os.pidfd_open(os.getpid())  # = 1: ourselves, seen from our own namespace
        child = os.fork()
    except Exception as exc:  # noqa: BLE001 - reported to the edge, then we exit
        sock.sendall(b"E" + f"{type(exc).__name__}: {exc}".encode()[:4000])
        os._exit(1)
    if child == 0:
        call_process(sock, me, jail)
        os._exit(1)
    sock.close()
    os.close(me)
    # Built: back from prestart_nice, so tearing the worker down after its call (the
    # edge waits for that) is not slowed by its low priority.
    os.setpriority(os.PRIO_PROCESS, 0, 0)
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if pid == child:
            os._exit(0)


def call_process(sock: socket.socket, init_pidfd: int, jail: JailConfig) -> None:
    """PID 2: cut the bounding set, hand the edge the init's pidfd, serve one call."""
    try:
        fncall_jail.prestart_call(jail)
    except Exception as exc:  # noqa: BLE001 - reported to the edge, then we exit
        sock.sendall(b"E" + f"{type(exc).__name__}: {exc}".encode()[:4000])
        os._exit(1)
    sock.sendmsg([b"R"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                           array.array("i", [init_pidfd]))])
    os.close(init_pidfd)
    serve_one(sock.detach(), jail)


def main(argv: list[str]) -> None:
    if argv[0] == "--zygote":
        zygote(int(argv[1]))
    else:
        serve_one(int(argv[1]), None)


def serve_one(fd: int, jail: JailConfig | None) -> None:
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    # Everything that does not depend on the call is done before we report warm: it is
    # off the handout path (each step here touches copy-on-write pages of the zygote's
    # heap, ~0.5 ms together on the dev VM when done at call time).
    out_fd = os.memfd_create("stdout")
    err_fd = os.memfd_create("stderr")
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    # The process exits right after the call; these wrappers live until then.
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), write_through=True)  # noqa: SIM115
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), write_through=True)  # noqa: SIM115
    if jail is not None:  # a clean environment: nothing of the edge's leaks in
        os.environ.clear()
        os.environ.update({"PATH": DEFAULT_PATH, "HOME": jail.workdir, "LANG": "C.UTF-8",
                           "TERM": "xterm"})
    if jail is None:
        sock.sendall(b"R")
    try:
        grant = _recv_fds(sock, b"C")
        (n,) = _LEN.unpack(_recv_exact(sock, 4))
        req = msgspec.msgpack.decode(_recv_exact(sock, n))
    except (EOFError, OSError):
        os._exit(0)  # the edge went away (or discarded this worker)
    reply: dict[str, Any] = {"exit_code": 0}
    try:
        if jail is not None:
            host = str(req.get("hostname") or jail.hostname)
            uid = req.get("uid")
            fncall_jail.admit(jail, grant, hostname=host,
                              uid=None if uid is None else int(uid))
            os.environ["HOSTNAME"] = host
        else:
            for f in grant:
                os.close(f)
    except Exception as exc:  # noqa: BLE001 - the edge reports it as a backend failure
        data = msgspec.msgpack.encode({"jail_error": f"{type(exc).__name__}: {exc}"})
        sock.sendall(_LEN.pack(len(data)) + data)
        os._exit(1)
    sys.stdin = io.TextIOWrapper(io.BytesIO(req.get("stdin") or b""))
    env = req.get("env") or {}
    t0 = time.perf_counter()
    reply["t_start"] = t0
    try:
        if req.get("cwd"):
            os.chdir(req["cwd"])
        os.environ.update(env)
        if req.get("fn") is not None:
            fn, args, kwargs = pickle.loads(req["fn"])
            value = fn(*args, **kwargs)
        else:
            value = _run_code(req["code"], {"__name__": "__main__"})
        # At most value_cap bytes of msgpack (0: the caller wants no value, e.g. an
        # exec, which prints it): the edge refuses more, as its decoded form can be ~64x
        # larger. A bigger or non-msgpack value comes back as its repr.
        value_cap = int(req.get("value_cap", 0))
        if value_cap > 0:
            try:
                packed: bytes | None = msgspec.msgpack.encode(value)
            except (TypeError, ValueError, OverflowError):
                packed = None
            if packed is not None and len(packed) <= value_cap:
                reply["value"] = packed
            else:
                if packed is not None:
                    print(f"fncall: the return value is {len(packed)} bytes of msgpack, "
                          f"over the {value_cap}-byte limit; value_repr holds its repr - "
                          "write large results to a file", file=sys.stderr)
                reply["value_repr"] = repr(value)[:65536]
    except SystemExit as e:
        code = e.code
        reply["exit_code"] = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # show the caller's frames, not this worker's
        traceback.print_exception(type(e), e, tb)
        reply["exit_code"] = 1
        reply["error"] = f"{type(e).__name__}: {e}"[:65536]
    sys.stdout.flush()
    sys.stderr.flush()
    cap = int(req.get("cap", 1 << 20))
    reply["stdout"], reply["stdout_truncated"] = _read_back(out_fd, cap)
    reply["stderr"], reply["stderr_truncated"] = _read_back(err_fd, cap)
    reply["duration_s"] = time.perf_counter() - t0
    data = msgspec.msgpack.encode(reply)
    sock.sendall(_LEN.pack(len(data)) + data)
    os._exit(0)
