"""Network namespace setup done from inside a fresh sandbox netns.

A new network namespace holds only ``lo``, and it is down. ``loopback`` mode brings it up
(so servers inside the sandbox can talk to themselves on 127.0.0.1); ``none`` leaves it
down. Nothing else exists, so nothing outside is reachable - including the edge's own
abstract UNIX sockets, which live per network namespace. One ioctl instead of spawning
``ip`` (an ``ip`` process costs ~2 ms; see MACHINE-NOTES.md).
"""

from __future__ import annotations

import fcntl
import socket
import struct

__all__ = ["bring_loopback_up", "loopback_is_up"]

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
