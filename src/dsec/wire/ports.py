"""Exposed ports: the requests and records of ``port_expose``, ``port_list``,
``port_close`` and the edge's duplex ``port_connect`` (docs/networking.md, "Ports").

A port is exposed per (sandbox, port): the edge keeps a :class:`PortRecord` (journaled
with the sandbox, so it survives an edge restart) whose ``generation`` is new each time
the port is opened; the apiserver mints URLs and tokens bound to that generation, so
closing the port (or destroying the sandbox) kills every URL and tunnel made for it,
and a token of an earlier opening never works again. Pure types, no I/O; limits are
``MAX_*`` constants here and every refusal names the field and the limit.
"""

from __future__ import annotations

from typing import Final

import msgspec

from dsec.errors import InvalidArgument
from dsec.wire.calls import _Call
from dsec.wire.spec import check_id

__all__ = [
    "MAX_EXPOSED_PORTS",
    "MAX_TOKEN_TTL_S",
    "MAX_TUNNELS_PER_SANDBOX",
    "TUNNEL_IDLE_S",
    "TUNNEL_OPEN_IDLE_S",
    "ExposedPort",
    "ExposedPortList",
    "PortConnect",
    "PortExpose",
    "PortExposeBody",
    "PortRecord",
    "PortRecordList",
    "PortRef",
]

#: Ports one sandbox may have exposed at once.
MAX_EXPOSED_PORTS: Final = 16
#: Tunnels (TCP connections through the edge) open to one sandbox at once, all its
#: ports together: a client holding connections cannot take the edge's fds.
MAX_TUNNELS_PER_SANDBOX: Final = 256
#: A tunnel with no byte either way for this long is closed.
TUNNEL_IDLE_S: Final = 300.0
#: ... and one that has moved no byte at all yet, this long: a client that opens
#: connections and sends nothing holds a place of the sandbox's 256 for 30 s, not 300.
TUNNEL_OPEN_IDLE_S: Final = 30.0
#: The longest a URL token may live (the port's own lifetime bounds it too).
MAX_TOKEN_TTL_S: Final = 30 * 86400.0


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise InvalidArgument(f"port={port} must be within 1..65535", field="port",
                              limit=65535)


class PortRef(_Call, kw_only=True):
    """``port_close``: one exposed port of sandbox ``id``."""

    id: str
    port: int

    def __post_init__(self) -> None:
        check_id(self.id)
        _check_port(self.port)


class PortExpose(PortRef, kw_only=True):
    """``port_expose``: reach ``port`` inside sandbox ``id`` through the apiserver.
    ``token_ttl_s``: the URL token's lifetime (None: until the port closes, at most
    :data:`MAX_TOKEN_TTL_S`)."""

    token_ttl_s: float | None = None

    def __post_init__(self) -> None:
        check_id(self.id)
        _check_port(self.port)
        ttl = self.token_ttl_s
        if ttl is not None and not 0 < ttl <= MAX_TOKEN_TTL_S:
            raise InvalidArgument(
                f"token_ttl_s={ttl!r} must be within (0, {MAX_TOKEN_TTL_S:g}] seconds",
                field="token_ttl_s", limit=MAX_TOKEN_TTL_S)


class PortExposeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The JSON body of ``POST /v1/sandboxes/{id}/ports`` (the id is in the path); the
    route builds a :class:`PortExpose` from it, whose check words the refusals."""

    port: int
    token_ttl_s: float | None = None


class PortConnect(PortRef, kw_only=True):
    """``port_connect`` (edge only, a duplex stream): a TCP connection to ``port`` inside
    the sandbox, opened only while the port is exposed with ``generation``."""

    generation: int


class PortRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the edge keeps (and journals) for one exposed port."""

    port: int
    generation: int            # new at each opening; tokens and tunnels are bound to it
    exposed_at: float


class PortRecordList(msgspec.Struct, frozen=True, kw_only=True):
    items: list[PortRecord]


class ExposedPort(msgspec.Struct, frozen=True, kw_only=True):
    """What the API answers: where to reach the port, and the URL token."""

    port: int
    url: str                   # {api}/v1/proxy/{id}/{port}/ (with ?dsec_token= when token)
    token: str | None          # the URL token (a credential: members only)
    expires_at: float | None


class ExposedPortList(msgspec.Struct, frozen=True, kw_only=True):
    items: list[ExposedPort]
