"""Reconciling the registry with an edge's heartbeat, as a pure plan (no I/O).

Every poll, the apiserver compares what the edge's heartbeat lists with what its registry
holds for that node (docs/control.md, "Keeping the registry in step with the edges"). The
decision is made here on plain values; the control plane's runner
(``ControlPlane._reconcile``) carries it out: it destroys, records and forgets, and asks
the edge about the sandboxes the heartbeat alone cannot settle (:class:`Probe`), all
those questions at once, then settles each answer with :func:`settle_probe`.

:func:`plan_reconcile` steps, in order:

- :class:`DestroyWrittenOff`: listed sandboxes the control plane wrote off while the node
  was away (their tombstones say so; an apiserver restart made the watcher forget): they
  are destroyed, never resurrected.
- :class:`Probe` ``missing``: in the registry on this node, older than the heartbeat
  (created before it was taken, by the same edge clock) and not listed: gone, with its
  feed event lost - or the edge restarted without it. Younger ones may just be racing
  their create and are left alone.
- :class:`SetPaused`: listed and known, with the other pause state.
- :class:`Probe` ``unknown``: listed but not in the registry: created through another
  replica (or by this one, its record not yet in the store when it restarted). Settled
  from the control plane's own records (:func:`settle_unknown`), never from the edge.

:func:`settle_probe` turns the edge's answer to a ``missing`` probe into :class:`WriteOff`
(the edge has not even a tombstone of it: it restarted without it), :class:`Forget` (it
is gone) or nothing (alive as far as the registry goes, or the edge did not answer: ask
again on the next poll).

An edge is a network peer, not the authority on who owns a sandbox (red team 16, F3/F10):

- what it reports of a sandbox id that does not name it (``sb-<hex>-<node>``) is ignored
  (:func:`split_listing`): another node's sandbox must not be written off, destroyed,
  paused or forgotten on its word;
- a sandbox it lists that the control plane has no record of (no row in the store's
  ``sandboxes`` table, which every create through any replica writes) is *quarantined*
  (:class:`Quarantine`): held aside by the runner, not charged to any project and not
  listed, whatever project the edge claims; it is recorded the moment a record of it
  appears in the store (a replica's batch committed late). It is not destroyed: a
  create acknowledged by a replica that crashed before its batch reached the store
  leaves such a sandbox, and destroying it would lose an answered create.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal

import msgspec

from dsec.control.records import SandboxRecord
from dsec.errors import DsecError, InvalidArgument, SandboxNotFound
from dsec.ids import node_of
from dsec.wire.spec import SandboxInfo

__all__ = [
    "GONE",
    "DestroyWrittenOff",
    "Forget",
    "Probe",
    "ProbeResult",
    "Quarantine",
    "ReconcileStep",
    "Record",
    "RecordBrief",
    "SetPaused",
    "Settled",
    "WriteOff",
    "plan_reconcile",
    "settle_probe",
    "settle_unknown",
    "split_listing",
]

#: Sandbox states that mean "gone" (or going) to the registry.
GONE = frozenset({"destroying", "destroyed", "failed"})


@dataclass(frozen=True, slots=True)
class RecordBrief:
    """What reconciling needs of a registry record."""

    created_at: float
    paused: bool


@dataclass(frozen=True, slots=True)
class DestroyWrittenOff:
    sandbox_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SetPaused:
    sandbox_id: str
    paused: bool


@dataclass(frozen=True, slots=True)
class Probe:
    """Ask the edge about ``sandbox_id`` (``edge.get``): ``missing`` from the heartbeat
    though the registry has it, or ``unknown`` to the registry though listed."""

    sandbox_id: str
    why: Literal["missing", "unknown"]


@dataclass(frozen=True, slots=True)
class WriteOff:
    sandbox_id: str
    detail: str


@dataclass(frozen=True, slots=True)
class Forget:
    sandbox_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Record:
    """Record a sandbox the registry did not hold, as the control plane's own record
    (the store's row) says it is."""

    record: SandboxRecord
    stored_paused: bool = False     # the pause state the stored record says


@dataclass(frozen=True, slots=True)
class Quarantine:
    """A live sandbox the edge lists that the control plane has no record of: hold it
    aside (not charged, not listed) until a record appears."""

    sandbox_id: str


ReconcileStep = DestroyWrittenOff | SetPaused | Probe
Settled = WriteOff | Forget | Record | Quarantine
#: What a probe got back: the edge's view of the sandbox, or the error it answered with.
ProbeResult = SandboxInfo | DsecError


def split_listing(node: str, ids: Iterable[str]) -> tuple[list[str], list[str]]:
    """``ids`` an edge reported, split into (those naming ``node``, the others). The
    others (another node's ids, or no sandbox id at all) are not the edge's to report."""
    own: list[str] = []
    foreign: list[str] = []
    for sid in ids:
        try:
            mine = node_of(sid) == node
        except InvalidArgument:
            mine = False
        (own if mine else foreign).append(sid)
    return own, foreign


def plan_reconcile(
    *,
    hb_time: float,
    listed: Iterable[tuple[str, str]],
    on_node: AbstractSet[str],
    records: Mapping[str, RecordBrief],
    zombies: AbstractSet[str],
    lost: AbstractSet[str],
) -> list[ReconcileStep]:
    """The steps that bring the registry in line with one heartbeat (see the module
    docstring). ``listed``: the heartbeat's (sandbox id, state) pairs; ``on_node``: the
    registry's ids on this node; ``records``: registry records of those and of every
    listed id the registry holds (on any node); ``zombies``: sandboxes the watcher is
    already destroying there; ``lost``: the control plane's written-off sandboxes."""
    alive: dict[str, str] = {}
    written_off: list[str] = []
    for sid, state in listed:
        if state in GONE or sid in zombies:
            continue
        if sid in lost:
            written_off.append(sid)
            continue
        alive[sid] = state
    steps: list[ReconcileStep] = []
    if written_off:
        steps.append(DestroyWrittenOff(tuple(written_off)))
    for sid in sorted(on_node - alive.keys()):
        rec = records.get(sid)
        if rec is not None and rec.created_at < hb_time:
            steps.append(Probe(sid, "missing"))
    for sid, state in alive.items():
        rec = records.get(sid)
        if rec is None:
            steps.append(Probe(sid, "unknown"))
        elif state in ("running", "paused") and rec.paused != (state == "paused"):
            steps.append(SetPaused(sid, state == "paused"))
    return steps


def settle_probe(probe: Probe, result: ProbeResult, *, node: str,
                 lost: AbstractSet[str]) -> Settled | None:
    """What the edge's answer to a ``missing`` probe means for the registry (None:
    nothing now). ``unknown`` probes are not the edge's to settle: see
    :func:`settle_unknown`."""
    sid = probe.sandbox_id
    if probe.why != "missing":
        return None
    if isinstance(result, SandboxNotFound):
        # Not even a tombstone on the edge: it restarted without this one.
        return WriteOff(sid, f"node {node} no longer has it: the node restarted "
                             "without it (it was not in the node's journal)")
    if isinstance(result, DsecError):
        return None     # ask again on the next poll
    if result.state in GONE:
        return Forget(sid, result.reason or "gone")
    return None         # alive after all (the heartbeat raced it)


def settle_unknown(sandbox_id: str, stored_record: SandboxRecord | None, *, node: str,
                   paused: bool, lost: AbstractSet[str]) -> Settled | None:
    """A live sandbox ``node`` lists that the registry does not hold: recorded as the
    control plane's own record (``stored_record``, the store's row) says, with the pause
    state the heartbeat gives; quarantined without such a record (or with one that puts
    it on another node); nothing if it was written off (the plan destroys those)."""
    if sandbox_id in lost:
        return None
    if stored_record is None or stored_record.id != sandbox_id or stored_record.node != node:
        return Quarantine(sandbox_id)
    return Record(msgspec.structs.replace(stored_record, paused=paused),
                  stored_paused=stored_record.paused)
