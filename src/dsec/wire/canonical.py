"""The canonical form of a request: what it *means*, as bytes, for fingerprints that must
not depend on how the request was spelled or which release spelled it.

Two requests that mean the same must give the same bytes, and a request type gaining a
defaulted field must not change the bytes of any request that leaves it at its default
(logs and keys written by the previous release stay valid). msgspec's own encoding gives
neither: ``omit_defaults`` tells a default by identity (a spelled-out ``60.0``, a decoded
``"base"`` or ``1 << 20`` is written while the default object itself is not), and dicts
keep their insertion order. So :func:`meaning` leaves out every field equal to its
default *by value*, writes a whole number in a float field as a float, and
:func:`canonical_bytes` encodes it with every map's keys sorted. Used by the RL command
log's command digests (:mod:`dsec.rl.commandlog`) and the apiserver's idempotency
fingerprints (:mod:`dsec.control.idempotency`).
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

__all__ = ["canonical_bytes", "meaning"]

_REQUIRED: Any = object()
_SORTED = msgspec.msgpack.Encoder(order="sorted")


def canonical_bytes(value: object) -> bytes:
    """``meaning(value)`` as msgpack with sorted keys."""
    return _SORTED.encode(meaning(value))


def meaning(value: object) -> Any:
    """``value`` as plain data: a struct as a map of its fields that differ from their
    defaults (by value) under their wire names, recursively; sequences as lists."""
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {}
        for name, wire, default, is_float in _fields(type(value)):
            v = getattr(value, name)
            if isinstance(v, list) and isinstance(default, tuple):
                v = tuple(v)
            if v is default or (default is not _REQUIRED and v == default):
                continue
            if is_float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            out[wire] = meaning(v)
        return out
    if isinstance(value, (list, tuple)):
        return [meaning(v) for v in value]
    if isinstance(value, dict):
        return {k: meaning(v) for k, v in value.items()}
    return value


@functools.cache
def _fields(cls: type[msgspec.Struct]) -> tuple[tuple[str, str, Any, bool], ...]:
    """Per field of ``cls``: name, wire name, default (``_REQUIRED`` if none), whether it
    holds a float (so an int there is the same number)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    out = []
    for f in info.fields:
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = _REQUIRED
        types = f.type.types if isinstance(f.type, msgspec.inspect.UnionType) else (f.type,)
        is_float = (any(isinstance(t, msgspec.inspect.FloatType) for t in types)
                    and not any(isinstance(t, msgspec.inspect.IntType) for t in types))
        out.append((f.name, f.encode_name, default, is_float))
    return tuple(out)
