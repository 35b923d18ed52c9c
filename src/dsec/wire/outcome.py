"""Errors as data, and batches whose items each succeed or fail on their own.

:class:`ErrorBody` is the payload of an Aether ERROR frame and of a failed batch item:
the :mod:`dsec.errors` code, the message and a JSON-able detail, so the caller re-raises
the same class with the same words (:func:`dsec.errors.error_from_wire`). Batched
replies carry one :class:`Outcome` per item, so one bad item never hides the results of
the others.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Generic, TypeVar, cast

import msgspec

from dsec.errors import DsecError, InvalidArgument, error_from_wire

__all__ = [
    "Batch",
    "ErrorBody",
    "Outcome",
    "error_body",
    "undecodable",
]


_AT = " - at `$"
_FIELD = re.compile(r"[.`]([A-Za-z_][A-Za-z0-9_]*)(?:\[\d+\])*`$")


def undecodable(name: str, exc: msgspec.DecodeError, *, at: str = "") -> InvalidArgument:
    """The one refusal of a request body that does not decode (msgspec's own check: a
    wrong JSON/msgpack type, a bound written on the type, an unknown field), worded
    alike at every door: ``the create request does not decode: Expected `int`, got
    `str` - at `$.spec.cpu_milli```. ``name`` is the operation (no door prefix, no type
    name: the doors decode different types of one request); ``at`` the request field a
    door's body stands for (REST's body of ``create`` is the ``spec``), so the path
    reads the same as where the whole request is one body (Aether). A value a type's
    own ``__post_init__`` refused is not this: the doors answer that error unchanged."""
    said = str(exc)
    if at:
        said = (said.replace(_AT, f"{_AT}.{at}", 1) if _AT in said
                else f"{said}{_AT}.{at}`")
    m = _FIELD.search(said)
    return InvalidArgument(f"the {name} request does not decode: {said}",
                           **({"field": m.group(1)} if m else {}))


class ErrorBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Payload of an ERROR frame.

    ``code`` names the :class:`DsecError` subclass the *caller* raises (see
    :func:`dsec.errors.error_from_wire`); unknown codes become plain ``DsecError``.
    """

    code: str
    message: str
    detail: dict[str, Any] = {}


def error_body(exc: BaseException) -> ErrorBody:
    """The ERROR payload for ``exc``: dsec errors keep their code, message and JSON-able
    detail; anything else is a handler bug and becomes ``internal_error``."""
    if isinstance(exc, DsecError):
        detail = {k: v for k, v in exc.detail.items() if _wire_safe(v)}
        return ErrorBody(code=exc.code, message=exc.message, detail=detail)
    # Not one of ours: a bug in a handler. Say what, not where (no stack trace on the wire).
    return ErrorBody(code="internal_error", message=f"{type(exc).__name__}: {exc}")


def _wire_safe(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None), list, dict, tuple))


T = TypeVar("T")


class Outcome(msgspec.Struct, Generic[T], kw_only=True, omit_defaults=True):
    """One item of a batch: ``error`` set, or ``value``."""

    error: ErrorBody | None = None
    value: T | None = None

    @classmethod
    def of(cls, x: T | BaseException) -> Outcome[T]:
        """The outcome of one item: an exception becomes its :class:`ErrorBody`."""
        if isinstance(x, BaseException):
            return Outcome(error=error_body(x))
        return Outcome(value=x)

    def result(self) -> T | DsecError:
        """The value, or the :class:`DsecError` the item failed with (same class and
        detail as if the call had been made alone)."""
        if self.error is not None:
            return error_from_wire(self.error.code, self.error.message, self.error.detail)
        # an item without error carries its value (no operation's reply type is None)
        return cast(T, self.value)


class Batch(msgspec.Struct, Generic[T], kw_only=True):
    """The reply of a batched operation: one :class:`Outcome` per item, in order."""

    items: list[Outcome[T]]

    @classmethod
    def of(cls, results: Iterable[T | BaseException]) -> Batch[T]:
        return Batch(items=[Outcome.of(x) for x in results])

    def results(self) -> list[T | DsecError]:
        return [o.result() for o in self.items]
