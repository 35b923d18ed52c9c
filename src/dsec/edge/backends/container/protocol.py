"""Messages between the container backend and its helper process (the zygote).

One SOCK_SEQPACKET socketpair, one msgpack message per packet; file descriptors travel
alongside as SCM_RIGHTS (pipes for stdio, pidfds). Every request carries an ``id`` that
its replies repeat, so many creates and execs are in flight at once.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "Create",
    "Created",
    "Exec",
    "Exited",
    "Failed",
    "Kill",
    "Reply",
    "Request",
    "Started",
    "decode_reply",
    "decode_request",
    "encode",
]


class Create(msgspec.Struct, tag="create", frozen=True):
    """Start a sandbox: new namespaces, overlay root, init as PID 1. No fds."""

    id: int
    lowerdirs: list[str]
    upper: str
    work: str
    root: str
    hostname: str
    cgroup_procs: list[str]
    loopback: bool
    nested: bool
    tmp_bytes: int


class Exec(msgspec.Struct, tag="exec", frozen=True):
    """Run a process inside a sandbox. fds: [init pidfd, stdin, stdout, stderr]."""

    id: int
    argv: list[str]
    env: list[str]
    cwd: str | None
    user: str | None
    cgroup_procs: list[str]
    nested: bool
    background: bool


class Kill(msgspec.Struct, tag="kill", frozen=True):
    """SIGKILL the process group of a running exec."""

    id: int


Request = Create | Exec | Kill


class Created(msgspec.Struct, tag="created", frozen=True):
    """The sandbox's init runs; its pidfd rides along (fds: [pidfd])."""

    id: int
    pid: int


class Started(msgspec.Struct, tag="started", frozen=True):
    id: int
    pid: int
    ns_pid: int


class Exited(msgspec.Struct, tag="exited", frozen=True):
    id: int
    status: int         # raw wait status


class Failed(msgspec.Struct, tag="failed", frozen=True):
    id: int
    message: str
    errno: int = 0


Reply = Created | Started | Exited | Failed

_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_rep_dec = msgspec.msgpack.Decoder(Reply)


def encode(msg: Request | Reply) -> bytes:
    return _enc.encode(msg)


def decode_request(data: bytes) -> Request:
    return _req_dec.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _rep_dec.decode(data)
