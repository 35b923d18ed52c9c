"""Network namespace setup done from inside a fresh sandbox netns.

A new network namespace holds only ``lo``, and it is down. ``loopback`` mode brings it up
(so servers inside the sandbox can talk to themselves on 127.0.0.1); ``none`` leaves it
down. Nothing else exists, so nothing outside is reachable - including the edge's own
abstract UNIX sockets, which live per network namespace. One ioctl instead of spawning
``ip`` (an ``ip`` process costs ~2 ms; see MACHINE-NOTES.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
from collections.abc import Iterator

__all__ = [
    "bring_loopback_up",
    "current_netns",
    "entered",
    "loopback_is_up",
    "netns_inode",
    "new_netns",
    "open_pinned",
    "pin",
    "setns_net",
    "unpin",
    "write_sysctl",
]

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14x"


def _flags(s: socket.socket) -> int:
    raw = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
    return int(struct.unpack(_IFREQ, raw)[1])


def bring_loopback_up() -> None:
    """``ip link set lo up`` in the calling thread's network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", _flags(s) | _IFF_UP))


def loopback_is_up() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return bool(_flags(s) & _IFF_UP)


# ---------------------------------------------------------------------------------------
# Network namespaces held by file descriptors (the router and the slots of net/router.py).
#
# setns(2) and unshare(2) act on the *calling thread* only, so every helper here switches
# the calling thread and switches it back before returning: a socket keeps the netns it was
# created in for its whole life, whatever thread later uses it. Python 3.11 has no
# os.setns/os.unshare; libc through ctypes (as edge/backends/container/linux.py does; the
# net floor may not import the edge's).


CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns_net(fd: int) -> None:
    """Move the calling thread into the network namespace held by ``fd``."""
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(CLONE_NEWNET)), f"setns({fd}, NEWNET)")


def current_netns() -> int:
    """An fd holding the calling thread's network namespace (the caller closes it)."""
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def new_netns() -> int:
    """Create a network namespace and return an fd holding it; the calling thread stays
    where it was. The namespace lives while any fd or process holds it."""
    back = current_netns()
    try:
        _check(_libc.unshare(ctypes.c_int(CLONE_NEWNET)), "unshare(NEWNET)")
        try:
            return current_netns()
        finally:
            setns_net(back)
    finally:
        os.close(back)


@contextlib.contextmanager
def entered(fd: int) -> Iterator[None]:
    """Run the block with the calling thread in netns ``fd`` (no await inside: the thread
    is the loop's when called from it)."""
    back = current_netns()
    try:
        setns_net(fd)
        try:
            yield
        finally:
            setns_net(back)
    finally:
        os.close(back)


def netns_inode(fd: int) -> int:
    """The namespace's identity (st_ino of its nsfs file): equal inodes, same netns."""
    return os.fstat(fd).st_ino


def write_sysctl(fd: int, path: str, value: str) -> None:
    """Write ``/proc/sys/<path>`` of netns ``fd``: /proc/sys/net resolves to the netns of
    the thread that opens it, so the open happens inside."""
    with entered(fd), open(f"/proc/sys/{path}", "w") as f:
        f.write(value)


# ---------------------------------------------------------------------------------------
# Pinning: a netns bind-mounted on a file outlives every fd and process (``ip netns add``
# does the same under /run/netns). The router's is pinned so live sandboxes keep their
# network while the edge restarts (plan-14 §9).

_MS_BIND = 4096
_MNT_DETACH = 2
_NSFS_MAGIC = 0x6E736673


def pin(fd: int, path: str) -> None:
    """Bind-mount the netns held by ``fd`` on ``path`` (an empty file is made)."""
    with open(path, "a"):
        pass
    os.chmod(path, 0o600)
    src = f"/proc/self/fd/{fd}".encode()
    _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                            ctypes.c_ulong, ctypes.c_void_p]
    _check(_libc.mount(src, path.encode(), None, _MS_BIND, None), f"bind-mount netns on {path}")


def unpin(path: str) -> bool:
    """Undo :func:`pin` (every mount stacked on ``path``) and remove the file; False when
    nothing was pinned there."""
    found = False
    for _ in range(16):  # stacked pins (bounded: never spin on a mount that stays)
        if open_pinned(path, check_only=True) is None:
            break
        found = True
        _check(_libc.umount2(path.encode(), ctypes.c_int(_MNT_DETACH)), f"umount {path}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return found


def open_pinned(path: str, *, check_only: bool = False) -> int | None:
    """An fd on the netns pinned at ``path`` (the caller closes it), or None when no
    netns is mounted there (a plain file left by a crash between create and mount, or
    nothing). ``check_only``: return -1 instead of an fd."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if _fs_magic(fd) != _NSFS_MAGIC:
            os.close(fd)
            return None
    except OSError:
        os.close(fd)
        raise
    if check_only:
        os.close(fd)
        return -1
    return fd


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 112)]


def _fs_magic(fd: int) -> int:
    buf = _Statfs()
    _check(_libc.fstatfs(ctypes.c_int(fd), ctypes.byref(buf)), "fstatfs")
    return int(buf.f_type) & 0xFFFFFFFF
