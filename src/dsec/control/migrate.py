"""Moving the sandboxes off a drained node (``dsec node drain ID --migrate``, issue 16).

Each sandbox on the node is snapshotted there (pack_diff: its upper layer, on the image's
layers), started from that snapshot on another node (placement never picks a drained
node; the create fetches the snapshot's chain through the layer relay, docs/layers.md)
and then ended with reason ``migrated`` and a detail naming the new sandbox, so its
events say where it went. A sandbox gets a new id: ids encode their node.

Durable before acted on: each step's outcome is stored (``migrations``,
:mod:`dsec.control.store.migrations`) before the next, and the create runs under an
Idempotency-Key derived from the old id, so a run cut short (an apiserver killed -9,
an edge that did not answer) is carried on by the next run - on any replica - without a
second snapshot or a second sandbox. A sandbox that cannot move (its project's
snapshot quota is full, no node has room) is left running where it is and reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from dsec.control.records import SandboxRecord
from dsec.control.store.migrations import MigrationRow
from dsec.errors import Conflict, DsecError, PermissionDenied, SandboxNotFound
from dsec.wire.calls import CreateSandbox
from dsec.wire.cluster import Migrated, NodeMigration
from dsec.wire.spec import SandboxInfo

__all__ = ["migrate_node", "migration_key", "remaining_ttl"]

log = logging.getLogger("dsec.control.migrate")


def migration_key(sandbox_id: str) -> str:
    """The Idempotency-Key the new sandbox of ``sandbox_id`` is created under."""
    return f"dsec-migrate-{sandbox_id}"


def remaining_ttl(rec: SandboxRecord, row: MigrationRow,
                  info: SandboxInfo | None = None) -> float | None:
    """The new sandbox's ``ttl_s``: what the original had left when it was snapshotted,
    so a move does not extend a sandbox's life (None: it had no TTL). From the stored
    snapshot time, not the clock, so a run carried on after a crash asks the very same
    create (its Idempotency-Key binds the request); at least 1 s (a sandbox due to
    expire during its move still starts, and expires at once). ``info``: the original
    as its edge answers it (issue 19): its deadline moved by ``set_timeout``, or, paused,
    the time it has left (its clock stopped); without it, the creation time + ttl_s."""
    if info is not None and info.ttl_left_s is not None:
        return max(1.0, round(info.ttl_left_s, 3))
    if info is not None and info.expires_at is not None:
        return max(1.0, round(info.expires_at - row.updated_at, 3))
    assert rec.spec is not None
    if rec.spec.ttl_s is None:
        return None
    return max(1.0, round(rec.created_at + rec.spec.ttl_s - row.updated_at, 3))


async def migrate_node(service: Any, caller: Any, node: str, *,
                       records: Iterable[SandboxRecord], store: Any, drained: bool,
                       clock: Callable[[], float]) -> NodeMigration:
    """Move every sandbox of ``records`` (those the registry places on ``node``) and any
    migration of ``node`` a previous run left unfinished. ``service``: the
    :class:`~dsec.control.api.service.ApiService` whose snapshot, create and routing
    every door uses (its checks and quotas hold here too)."""
    if not caller.superuser:
        raise PermissionDenied(f"cannot migrate the sandboxes of node {node!r}: they are "
                               "every project's, so only a superuser may")
    if not drained:
        raise Conflict(f"node {node!r} is not drained: drain it first (`dsec node drain "
                       f"{node}`), so the sandboxes moved off it are not placed back")
    by_id = {r.id: r for r in records}
    # every migration of the node a run recorded: unfinished ones are carried on, done
    # ones reported again (a repeated run answers the whole move)
    recorded = {m.sandbox_id for m in store.list_migrations(node)}
    items = []
    for sid in sorted(by_id.keys() | recorded):
        try:
            items.append(await _move(service, caller, node, sid, by_id.get(sid), store,
                                     clock))
        except DsecError as exc:
            log.warning("migrating %s off %s: %s", sid, node, exc)
            row = store.get_migration(sid)
            items.append(Migrated(sandbox_id=sid, error=str(exc),
                                  snapshot_id=row.snapshot_id if row else None,
                                  new_id=row.new_id if row else None))
    return NodeMigration(node=node, items=items)


async def _move(service: Any, caller: Any, node: str, sid: str, rec: SandboxRecord | None,
                store: Any, clock: Callable[[], float]) -> Migrated:
    row = store.get_migration(sid) or MigrationRow(sandbox_id=sid, node=node, state="new")
    if row.state == "done":
        return Migrated(sandbox_id=sid, new_id=row.new_id, snapshot_id=row.snapshot_id)
    if row.snapshot_id is None:
        view = await service.snapshot(caller, sid)
        row = msgspec.structs.replace(row, state="snapshotted", snapshot_id=view.id,
                                      updated_at=clock())
        store.put_migration(row)
    if row.new_id is None:
        if rec is None or rec.spec is None:
            raise Conflict(f"sandbox {sid} on {node}: the control plane has no record of "
                           "its spec to start it again from its snapshot")
        try:    # its deadline as its edge keeps it (set_timeout, paused clock)
            now: SandboxInfo | None = await service.get(caller, sid)
        except DsecError:
            now = None
        spec = msgspec.structs.replace(rec.spec, snapshot=row.snapshot_id,
                                       ttl_s=remaining_ttl(rec, row, now))
        info = await service.create(caller, CreateSandbox(
            spec=spec, idempotency_key=migration_key(sid)))
        row = msgspec.structs.replace(row, state="created", new_id=info.id,
                                      updated_at=clock())
        store.put_migration(row)
    try:
        edge, _ = await service._edge_for(caller, sid, "member")
        await edge.destroy(sid, reason="migrated",
                           detail=f"moved to {row.new_id} from snapshot {row.snapshot_id} "
                                  f"(node {node} drained: dsec node drain --migrate)")
    except SandboxNotFound:
        pass        # ended meanwhile (by its owner, or an earlier run's destroy)
    row = msgspec.structs.replace(row, state="done", updated_at=clock())
    store.put_migration(row)
    log.info("sandbox %s moved off %s: now %s", sid, node, row.new_id)
    return Migrated(sandbox_id=sid, new_id=row.new_id, snapshot_id=row.snapshot_id)
