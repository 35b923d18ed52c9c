"""Errors as data, and batches whose items each succeed or fail on their own.

:class:`ErrorBody` is the payload of an Aether ERROR frame and of a failed batch item:
the :mod:`dsec.errors` code, the message and a JSON-able detail, so the caller re-raises
the same class with the same words (:func:`dsec.errors.error_from_wire`). Batched
replies carry one :class:`Outcome` per item, so one bad item never hides the results of
the others.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dsec.errors import DsecError, error_from_wire
from dsec.wire.spec import ExecResult, SandboxInfo

__all__ = [
    "CreateManyReply",
    "ErrorBody",
    "ExecManyReply",
    "ExecOutcome",
    "InfoOutcome",
    "Outcome",
    "error_body",
    "outcome_error",
    "outcome_value",
]


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


class Outcome(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One item of a batch: ``error`` set, or the value in the typed subclass field."""

    error: ErrorBody | None = None


class InfoOutcome(Outcome, kw_only=True, omit_defaults=True):
    info: SandboxInfo | None = None


class ExecOutcome(Outcome, kw_only=True, omit_defaults=True):
    result: ExecResult | None = None


class CreateManyReply(msgspec.Struct, kw_only=True):
    items: list[InfoOutcome]


class ExecManyReply(msgspec.Struct, kw_only=True):
    items: list[ExecOutcome]


def outcome_error(exc: BaseException) -> ErrorBody:
    return error_body(exc)


def outcome_value(o: Outcome, value: object) -> object:
    """The value of a batch item, or the DsecError it carried."""
    if o.error is not None:
        e: DsecError = error_from_wire(o.error.code, o.error.message, o.error.detail)
        return e
    return value
