"""Which operations the audit log records, and the wrapper that records them (issue 19;
the log itself is :class:`dsec.logs.AuditLog`).

Admin actions change who may do what or what everyone's sandboxes run on: API keys,
quotas (and with them projects), images and layers, join tokens and joined nodes, node
drains and migrations. Each call of such a row - at every door, REST and gateway alike,
since both call :meth:`ApiService.handler` - becomes one line: who (the principal), what
(the row and the objects its request names, from an allowlist of fields: ``creds`` of a
pull or a key's secret never enter it), when, and the outcome (``ok`` or the error code:
a refused attempt is as telling as a success). An intent line is durable before the
action runs (no audit, no action), the outcome line before the answer goes out. Pure table + a wrapper; the I/O is the AuditLog's.
"""

from __future__ import annotations

import errno
import functools
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec

from dsec.errors import DsecError, Unavailable

log_ = logging.getLogger(__name__)

__all__ = ["AUDITED", "TARGET_FIELDS", "audited", "target_of"]

AUDITED: Final = frozenset({
    "create_key", "revoke_key", "quota_set",
    "image_tag", "image_delete", "image_promote", "image_pull", "image_push", "image_pin",
    "image_unpin", "image_prune", "image_build", "image_import",
    "cluster_token_create", "cluster_token_revoke", "cluster_node_revoke",
    "node_drain", "node_undrain", "node_migrate",
})

#: the request fields a line may carry (never credentials)
TARGET_FIELDS: Final = ("path", "project", "name", "role", "id", "ref", "source", "target",
                        "top", "base", "node", "image", "digest", "tag", "kind", "quota",
                        "dry_run", "insecure", "platform", "ttl_s", "uses", "description",
                        "nodes")

#: reply fields that name what an action made (a created key's id, a token's id)
_MADE: Final = {"create_key": "key_id", "cluster_token_create": "id"}


def target_of(body: Any) -> dict[str, Any]:
    """What a request names, from :data:`TARGET_FIELDS` only (defaults included: a
    granted role is said even when it is the default one)."""
    fields = getattr(body, "__struct_fields__", None)
    if fields is None:
        return {}
    out: dict[str, Any] = {}
    for k in TARGET_FIELDS:
        if k in fields and (v := getattr(body, k)) is not None:
            try:
                out[k] = msgspec.to_builtins(v)
            except (TypeError, msgspec.EncodeError):
                out[k] = str(v)
    return out


Policy = Callable[..., Awaitable[Any]]


def audited(name: str, policy: Policy, log: Callable[[], Any]) -> Policy:
    """``policy`` (of row ``name``) that records each call in ``log()`` (an AuditLog, or
    None: not recorded). Audited before acting, durable before acknowledged (red team
    19, B6): an *intent* line (``phase: intent``, the caller, the action, its target) is
    written and fsynced before the policy runs; if it cannot be written the action is
    refused (:class:`Unavailable`, naming the file and the error) and nothing is done.
    The *outcome* line (``ok`` or the error code, same ``op`` id) follows; if that write
    fails (the disk filled in between) it is retried once, then the failure is logged
    and the answer still goes out: the action is done and its intent line names it (an
    intent without an outcome reads "done or failed, unknown")."""

    @functools.wraps(policy)
    async def run(caller: Any, body: Any, *rest: Any) -> Any:
        audit = log()
        if audit is None:
            return await policy(caller, body, *rest)
        target = target_of(body)
        op_id = secrets.token_hex(8)
        who = {"actor": caller.name, "actor_id": caller.id, "action": name}
        try:
            await audit.arecord(**who, target=target, outcome="pending", phase="intent",
                                op=op_id)
        except OSError as exc:
            raise Unavailable(
                f"{name} refused: the audit log {audit.path} cannot be written "
                f"({errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}), and an "
                "admin action is not done unless it is audited; free space on (or fix) the "
                "state dir's filesystem and retry", action=name) from exc

        async def outcome(target: dict[str, Any], result: str, detail: str = "") -> None:
            for attempt in (1, 2):
                try:
                    await audit.arecord(**who, target=target, outcome=result,
                                        phase="outcome", op=op_id, detail=detail)
                    return
                except OSError as exc:
                    if attempt == 2:
                        log_.error("audit log %s: the outcome (%s) of %s op=%s by %s could "
                                   "not be written (%s); its intent line is there",
                                   audit.path, result, name, op_id, caller.name, exc)

        try:
            reply = await policy(caller, body, *rest)
        except DsecError as exc:
            await outcome(target, exc.code, str(exc))
            raise
        made = _MADE.get(name)
        if made is not None and getattr(reply, made, None):
            target = {**target, "made": getattr(reply, made)}
        await outcome(target, "ok")
        return reply
    return run
