"""Retention: every table of the control plane's state store stays bounded.

Without it the event log grows by two rows per sandbox lifecycle forever (measured:
140,002 rows, 48 MB after 70k lifecycles). A pass (:func:`retain`, run by the control
plane every ``RetentionConfig.interval_s``) trims each growing table by count and by age:

============== ============================================ =============================
table           what grows it                               kept
============== ============================================ =============================
events          two+ rows per sandbox lifecycle              newest ``events_keep`` and
                                                             none older than
                                                             ``events_max_age_s`` (the
                                                             newest row always: it holds
                                                             the global version)
idempotency     one row per create with a key                finished rows for their
                                                             5-minute window (beyond
                                                             ``idempotency_keep`` the
                                                             oldest keep only their
                                                             sandbox id); stale claims
                                                             without a sandbox id; with
                                                             one, once their window passed
                                                             and their holder is gone
lost_sandboxes  one row per sandbox of a lost node           ``lost_max_age_s`` (and
                                                             ``PlaneConfig.lost_tombstones``
                                                             on every write)
process_leases  one row per apiserver process ever started   live leases only
sessions        one row per client session                   the sweeper's rule (closed
                                                             and empty, or lapsed past
                                                             ``session_retention_s``)
============== ============================================ =============================

``sandboxes`` holds live sandboxes only; ``principals``, ``api_keys``,
``role_bindings`` and ``quotas`` change only through admin actions and are not trimmed.
A watcher that asks for events older than what is kept gets
:class:`~dsec.errors.Compacted` and re-lists. SQLite files give freed pages back
(incremental vacuum) so the file shrinks too, not only the row counts.

The decision (what cut-offs apply at ``now``) is :meth:`RetentionConfig.plan`; the pass
carries it out against the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dsec.errors import InvalidArgument

__all__ = ["RetentionConfig", "RetentionPlan", "RetentionReport", "RetentionStore", "retain"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionConfig:
    """How much history the state store keeps (``None``: no bound of that kind)."""

    interval_s: float = 10.0                        # how often a pass runs
    events_keep: int | None = 100_000               # ~35 MB of event rows
    events_max_age_s: float | None = 7 * 86_400.0   # a week of history for watchers
    idempotency_keep: int = 50_000                  # finished keys (each lives 5 min)
    lost_max_age_s: float | None = 7 * 86_400.0     # tombstones of lost nodes' sandboxes
    vacuum_pages: int = 2_000                       # SQLite pages given back per pass

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise InvalidArgument(f"retention interval_s={self.interval_s} must be > 0")
        if self.events_keep is not None and self.events_keep < 1:
            raise InvalidArgument(f"retention events_keep={self.events_keep} must be >= 1 "
                                  "or None")
        for name in ("events_max_age_s", "lost_max_age_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise InvalidArgument(f"retention {name}={v} must be > 0 seconds or None")
        if self.idempotency_keep < 1 or self.vacuum_pages < 0:
            raise InvalidArgument("retention idempotency_keep must be >= 1 and "
                                  "vacuum_pages >= 0")

    def plan(self, now: float) -> RetentionPlan:
        """The cut-offs of a pass at wall time ``now`` (pure)."""
        return RetentionPlan(
            now=now, events_keep=self.events_keep,
            events_older_than=None if self.events_max_age_s is None
            else now - self.events_max_age_s,
            idempotency_keep=self.idempotency_keep,
            lost_older_than=None if self.lost_max_age_s is None
            else now - self.lost_max_age_s,
            vacuum_pages=self.vacuum_pages)


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    now: float
    events_keep: int | None
    events_older_than: float | None
    idempotency_keep: int
    lost_older_than: float | None
    vacuum_pages: int


@dataclass(frozen=True, slots=True)
class RetentionReport:
    """Rows deleted per table by one pass."""

    events: int
    idempotency: int
    lost_sandboxes: int
    process_leases: int

    @property
    def total(self) -> int:
        return self.events + self.idempotency + self.lost_sandboxes + self.process_leases


class RetentionStore(Protocol):
    """The part of :class:`~dsec.control.store.StateStore` a pass uses."""

    def prune_events(self, *, keep_last: int | None, older_than: float | None) -> int: ...
    def idem_purge(self, now: float, keep: int) -> int: ...
    def prune_lost(self, older_than: float) -> int: ...
    def lease_purge(self, now: float) -> int: ...
    def reclaim_space(self, pages: int) -> None: ...


def retain(store: RetentionStore, plan: RetentionPlan) -> RetentionReport:
    """Carry out ``plan`` against ``store`` (synchronous: run it off the event loop)."""
    events = store.prune_events(keep_last=plan.events_keep,
                                older_than=plan.events_older_than)
    idem = store.idem_purge(plan.now, plan.idempotency_keep)
    lost = 0 if plan.lost_older_than is None else store.prune_lost(plan.lost_older_than)
    leases = store.lease_purge(plan.now)
    report = RetentionReport(events, idem, lost, leases)
    if report.total and plan.vacuum_pages:
        store.reclaim_space(plan.vacuum_pages)
    return report
