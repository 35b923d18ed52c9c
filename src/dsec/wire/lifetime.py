"""Lifetimes (issue 19): the ``set_timeout`` request.

A sandbox's lifetime is a deadline its edge keeps (``SandboxInfo.expires_at``, unix
seconds); while the sandbox is paused the clock stops (``SandboxInfo.ttl_left_s`` says
what is left, ``expires_at`` is None) and runs again from its resume. ``set_timeout``
moves the deadline: ``timeout_s`` seconds from now (E2B's ``set_timeout``, Modal's
``timeout``), or, with ``extend``, ``timeout_s`` more than what is left.
"""

from __future__ import annotations

import math

from dsec.errors import InvalidArgument
from dsec.wire.calls import _Call
from dsec.wire.spec import MAX_TTL_S, check_id

__all__ = ["SetTimeout"]


class SetTimeout(_Call, kw_only=True):
    """``set_timeout``: sandbox ``id`` ends ``timeout_s`` seconds from now (``extend``:
    ``timeout_s`` seconds after its current deadline, or from now when it has none). A
    paused sandbox's clock is stopped: the time set is what it will have left when it
    resumes. The resulting lifetime is capped at :data:`MAX_TTL_S` from now."""

    id: str
    timeout_s: float
    extend: bool = False

    def __post_init__(self) -> None:
        check_id(self.id)
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) \
                or not 0 < t <= MAX_TTL_S:
            raise InvalidArgument(
                f"timeout_s={t!r} must be within (0, {MAX_TTL_S:g}] seconds (30 days); "
                "to end a sandbox now, destroy it", field="timeout_s", limit=MAX_TTL_S)
