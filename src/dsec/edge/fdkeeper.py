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

Protocol (SOCK_SEQPACKET, one JSON object per message, descriptors as SCM_RIGHTS):
``put`` key+names (+fds, replacing what the key held), ``drop`` key, ``take`` key (answer:
its names + copies of its fds; it keeps holding them until dropped), ``keys`` (answer: the
keys it holds).

It exits when it holds nothing and no edge is connected; when it holds descriptors and no
edge has been connected for ``ORPHAN_S`` seconds it closes them (their processes then see
their pipes close) and exits, so a node whose edge never comes back does not keep them
forever.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import sys
import time

MAX_FDS = 8
MAX_MSG = 1 << 16


def _recv(conn: socket.socket) -> tuple[dict[str, object] | None, list[int]]:
    data, anc, _, _ = conn.recvmsg(MAX_MSG, socket.CMSG_SPACE(MAX_FDS * 4),
                                   socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, blob in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(blob[: len(blob) - len(blob) % 4])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        msg = json.loads(data)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        for fd in fds:
            os.close(fd)
        return {}, []
    return msg, list(fds)


def _send(conn: socket.socket, msg: dict[str, object], fds: list[int] | None = None) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] \
        if fds else []
    try:
        conn.sendmsg([json.dumps(msg).encode()], anc)
    except OSError:
        pass   # the edge went away mid-answer: it asks again when it comes back


def serve(listener: socket.socket, path: str, orphan_s: float) -> None:
    try:
        ino = os.stat(path).st_ino
    except OSError:
        ino = -1
    held: dict[str, tuple[list[str], list[int]]] = {}
    conns: list[socket.socket] = []
    alone_since = time.monotonic()
    uid = os.getuid()

    def close_key(key: str) -> None:
        old = held.pop(key, None)
        if old is not None:
            for fd in old[1]:
                os.close(fd)

    first = True      # the edge that started us connects first (queued on the listener)
    while True:
        if conns:
            alone_since = time.monotonic()
            first = False
        elif first:
            if time.monotonic() - alone_since > 10.0:
                break
        elif not held or time.monotonic() - alone_since > orphan_s:
            break
        ready, _, _ = select.select([listener, *conns], [], [],
                                    None if conns else max(0.1, min(orphan_s / 10, 1.0)))
        for s in ready:
            if s is listener:
                try:
                    c, _ = listener.accept()
                except OSError:
                    continue
                creds = c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                     struct.calcsize("3i"))
                _, peer_uid, _ = struct.unpack("3i", creds)
                if peer_uid != uid:
                    c.close()     # another user: nothing here is theirs
                    continue
                conns.append(c)
                continue
            try:
                msg, fds = _recv(s)
            except OSError:
                msg, fds = None, []
            if msg is None:
                conns.remove(s)
                s.close()
                continue
            op, key = msg.get("op"), str(msg.get("key", ""))
            if op == "put":
                raw = msg.get("names")
                names = [str(n) for n in raw] if isinstance(raw, list) else []
                close_key(key)
                if len(names) == len(fds):
                    held[key] = (names, fds)
                else:
                    for fd in fds:
                        os.close(fd)
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
                _send(s, {"keys": sorted(held)})
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a terminal's ^C is the edge's, not ours
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    listener = socket.socket(fileno=listen_fd)
    serve(listener, path, orphan_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
