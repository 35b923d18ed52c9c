"""A pre-started Python worker for the ``fncall`` backend; run as a script, not imported.

Started as ``python -I fncall_worker.py FD``: it imports what a call needs, writes one
byte ``R`` on the control socket FD (= warm), then serves exactly one request and exits.
The edge kills its process group right after, so nothing a call leaves behind (threads,
children, globals, monkeypatches) reaches the next call.

Started as ``python -I fncall_worker.py --zygote FD`` it is a fork server: it imports
once, then for every control message carrying a socket (SCM_RIGHTS) forks a child that
becomes a new session leader and serves one request on that socket, as above. It never
runs user code itself, so every child starts from the same clean, already-imported
state. Measured on the 2-core dev VM: a fork from the zygote is ready in ~1-2 ms of
CPU; a fresh interpreter start is ~30-40 ms, which bounded the pool's refill rate.

Wire: requests (edge -> worker) are ``u32 length + msgpack``, and may carry a pickled
function (the edge is trusted by the worker). Replies (worker -> edge) are plain msgpack
with no pickles: the code in here is hostile and the edge must never unpickle its output.
"""

from __future__ import annotations

import array
import ast
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

_LEN = struct.Struct("!I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


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


def zygote(fd: int) -> None:
    ctl = socket.socket(fileno=fd)
    ctl.setblocking(True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the forked workers
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
        pid = os.fork()
        if pid == 0:
            try:
                ctl.close()
                os.setsid()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # user code may wait() on kids
                serve_one(fds[0])
            finally:
                os._exit(1)
        os.close(fds[0])
        ctl.sendall(_LEN.pack(pid))


def main() -> None:
    if sys.argv[1] == "--zygote":
        zygote(int(sys.argv[2]))
    else:
        serve_one(int(sys.argv[1]))


def serve_one(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.sendall(b"R")
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    req = msgspec.msgpack.decode(_recv_exact(sock, n))
    t0 = time.perf_counter()
    out_fd = os.memfd_create("stdout")
    err_fd = os.memfd_create("stderr")
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    # The process exits right after the call; these wrappers live until then.
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), write_through=True)  # noqa: SIM115
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), write_through=True)  # noqa: SIM115
    sys.stdin = io.TextIOWrapper(io.BytesIO(req.get("stdin") or b""))
    reply: dict[str, Any] = {"exit_code": 0}
    try:
        if req.get("cwd"):
            os.chdir(req["cwd"])
        os.environ.update(req.get("env") or {})
        if req.get("fn") is not None:
            fn, args, kwargs = pickle.loads(req["fn"])
            value = fn(*args, **kwargs)
        else:
            value = _run_code(req["code"], {"__name__": "__main__"})
        try:
            reply["value"] = msgspec.msgpack.encode(value)
        except (TypeError, ValueError, OverflowError):
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


if __name__ == "__main__":
    main()
