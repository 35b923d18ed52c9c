"""Hypothesis strategies for any record of :mod:`dsec.wire`, built from its type hints.

``st.from_type`` fills only a struct's required fields; these fill every field, honour
``msgspec.Meta`` bounds on ``Annotated`` types, keep numbers inside what msgpack and
JSON carry exactly (64-bit ints, finite floats) and substitute the type arguments of
generic structs (``Batch[SandboxInfo]``). A record whose ``__post_init__`` refuses the
drawn values is rejected, not failed: the round trip is about encodings, validation has
its own tests.
"""

from __future__ import annotations

import functools
import operator
import types
import typing
from typing import Any

import msgspec
from hypothesis import strategies as st

from dsec.errors import DsecError
from dsec.wire import spec
from dsec.wire.layers import ImagePinRef, LayerFetch, LayerRef
from dsec.wire.process import ProcessSignal, PtyResize
from dsec.wire.spec import SandboxSpec

_I64 = (-(2**63), 2**63 - 1)


def _bounds(meta: list[msgspec.Meta]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in meta:
        for name in ("ge", "le", "gt", "lt", "min_length", "max_length"):
            v = getattr(m, name, None)
            if v is not None:
                out[name] = v
    return out


def _substitute(tp: Any, env: dict[Any, Any]) -> Any:
    if isinstance(tp, typing.TypeVar):
        return env.get(tp, tp)
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if not args or origin is None:
        return tp
    new = tuple(_substitute(a, env) for a in args)
    if origin is typing.Annotated:
        return typing.Annotated[(new[0], *args[1:])]
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, new)
    if origin is typing.Literal:
        return tp
    return origin[new] if len(new) > 1 else origin[new[0]]


def _struct(cls: type[msgspec.Struct], env: dict[Any, Any]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f: of(_substitute(hints[f], env)) for f in cls.__struct_fields__}

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        kw = {f: draw(s) for f, s in fields.items()}
        try:
            return cls(**kw)
        except (DsecError, ValueError):
            from hypothesis import reject
            reject()

    return build()


def of(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for values of the type expression ``tp``."""
    return _of(tp, [])


_ENTRIES = ("pypi.org:443/tcp", "*.pythonhosted.org:443", "203.0.113.0/24:8000-8100",
            "[2001:db8::/32]:53/udp", "10.1.2.3", "sandbox:sb-0123456789ab-n1:80")


def valid_policy() -> st.SearchStrategy[spec.NetworkPolicy]:
    """A network policy :meth:`NetworkPolicy.validate` accepts (canonical entries)."""
    entries = st.lists(st.sampled_from(_ENTRIES), max_size=3, unique=True).map(tuple)
    return st.one_of(
        st.just(spec.NetworkPolicy()), st.just(spec.NetworkPolicy(mode="open")),
        st.builds(spec.NetworkPolicy, mode=st.just("policy"), allow=entries, deny=entries,
                  max_connections=st.none() | st.integers(1, spec.MAX_NET_CONNECTIONS),
                  rate_mbit=st.none() | st.integers(1, spec.MAX_NET_RATE_MBIT)))


def valid_spec() -> st.SearchStrategy[SandboxSpec]:
    """A spec :meth:`SandboxSpec.validate` accepts (every field drawn within bounds)."""
    seconds = st.none() | st.floats(min_value=0.001, max_value=spec.MAX_TTL_S)
    env_name = st.text(min_size=1, max_size=8).filter(lambda k: "=" not in k and "\0" not in k)
    no_nul = st.text(max_size=8).filter(lambda v: "\0" not in v)
    project = st.lists(st.from_regex(r"[a-z][a-z0-9-]{0,6}", fullmatch=True), min_size=1,
                       max_size=3).map("/".join)
    return st.builds(
        SandboxSpec,
        image=st.text(min_size=1, max_size=12), workspace=st.none() | st.text(max_size=12),
        toolkits=st.lists(st.text(min_size=1, max_size=8), max_size=2).map(tuple),
        snapshot=st.none() | st.text(max_size=12),
        backend=st.sampled_from(typing.get_args(spec.BackendName)),
        cpu_milli=st.integers(1, spec.MAX_CPU_MILLI),
        memory_bytes=st.integers(1 << 20, spec.MAX_MEMORY_BYTES),
        disk_bytes=st.none() | st.integers(1 << 20, spec.MAX_DISK_BYTES),
        pids_max=st.none() | st.integers(1, 4_194_304), priority=st.integers(-(2**31), 2**31 - 1),
        labels=st.dictionaries(st.from_regex(r"[a-z][a-z0-9._-]{0,7}", fullmatch=True),
                               st.text(max_size=8), max_size=2),
        project=project, ttl_s=seconds, idle_timeout_s=seconds,
        idle_action=st.sampled_from(typing.get_args(spec.IdleAction)),
        env=st.dictionaries(env_name, no_nul, max_size=2),
        network=st.none() | valid_policy(), allow_nested=st.booleans(),
        user_namespace=st.booleans()).flatmap(
        # isolation: unset, or the tier the backend gives (the two must agree)
        lambda sp: st.sampled_from([None, spec.BACKEND_ISOLATION.get(sp.backend)]).map(
            lambda iso: msgspec.structs.replace(sp, isolation=iso)))


def _of(tp: Any, meta: list[msgspec.Meta]) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _of(args[0], meta + [m for m in args[1:] if isinstance(m, msgspec.Meta)])
    b = _bounds(meta)
    if tp is Any:  # a JSON-able detail value
        return st.one_of(st.none(), st.booleans(), st.integers(*_I64), st.text(max_size=8))
    if tp is None or tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        lo = b.get("ge", b["gt"] + 1 if "gt" in b else _I64[0])
        hi = b.get("le", b["lt"] - 1 if "lt" in b else _I64[1])
        return st.integers(max(lo, _I64[0]), min(hi, _I64[1]))
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False, min_value=b.get("ge"),
                         max_value=b.get("le"))
    if tp is str:
        return st.text(min_size=b.get("min_length", 0), max_size=min(b.get("max_length", 20),
                                                                      20))
    if tp is bytes:
        return st.binary(max_size=64)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_of(a, meta) for a in args))
    if origin is list:
        return st.lists(_of(args[0], []), max_size=3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_of(args[0], []), max_size=3).map(tuple)
        return st.tuples(*(_of(a, []) for a in args))
    if origin is dict:
        return st.dictionaries(_of(args[0], []), _of(args[1], []), max_size=3)
    if tp is SandboxSpec:   # half within bounds, so requests that validate it get drawn
        return st.one_of(valid_spec(), _struct(tp, {}))
    if tp in (LayerRef, LayerFetch):   # a full digest (the type refuses anything else)
        digest = st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True)
        node = st.text("abcdefgh0123456789-", min_size=1, max_size=12)
        return (st.builds(LayerRef, digest=digest) if tp is LayerRef else
                st.builds(LayerFetch, node=node, digest=digest, source=st.none() | node))
    if tp is ImagePinRef:              # likewise: a pin names an image by its digest
        return st.builds(ImagePinRef,
                         node=st.text("abcdefgh0123456789-", min_size=1, max_size=12),
                         image=st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True))
    if tp in (ProcessSignal, PtyResize):   # narrow ranges: drawn within them
        sid = st.from_regex(r"sb-[0-9a-f]{12}-n1", fullmatch=True)
        pid = st.integers(1, 4_194_304)
        if tp is ProcessSignal:
            return st.builds(ProcessSignal, id=sid, pid=pid, signal=st.integers(1, 64))
        cells = st.integers(1, spec.MAX_PTY_CELLS)
        return st.builds(PtyResize, id=sid, pid=pid, cols=cells, rows=cells)
    if tp is spec.PtySize:
        return st.builds(spec.PtySize, cols=st.integers(1, spec.MAX_PTY_CELLS),
                         rows=st.integers(1, spec.MAX_PTY_CELLS))
    if tp is spec.NetworkPolicy:   # likewise: NetworkUpdate validates its policy
        return st.one_of(valid_policy(), _struct(tp, {}))
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _struct(tp, {})
    if origin is not None and isinstance(origin, type) and issubclass(origin, msgspec.Struct):
        env = dict(zip(origin.__parameters__, args, strict=True))
        return _struct(origin, env)
    raise TypeError(f"no strategy for {tp!r}: teach tests/wire/strategies.py this type")
