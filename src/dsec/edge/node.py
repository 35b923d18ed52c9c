"""``EdgeNode``: one machine's sandboxes: lifecycle, admission, events, reaping, records.

The node is the data plane's source of truth (DESIGN.md). It owns every state change
(through the table in :mod:`dsec.edge.lifecycle`), every reservation (through
:class:`~dsec.edge.admission.ResourcePool`) and every event; backends only do the work
and are always awaited. It is backend-agnostic: it takes any mapping of
:class:`~dsec.edge.backend.Backend` by name and picks one per ``spec.backend``.

Hot-path choices (measured by the ``edge`` bench suite):
- A create is: validate, reserve, one dict insert, two transitions (tuple events), one
  awaited backend call and two journal commits: the intent is *written* before the
  backend acts (the page cache survives kill -9; after a host crash reconcile finds
  what is left), the running record is written *and fsynced* before the answer. Commits
  are group commits: concurrent creates share one write and one fsync
  (:mod:`dsec.edge.journal`), so a batch of 1,000 costs ~2 writes and 1 fsync.
- Batch calls (``create_many``, ``exec_many``, ``destroy_many``) step each coroutine
  eagerly (:mod:`dsec.edge.eager`) so an operation that never waits costs no task.
- Events are tuples in a bounded per-sandbox list plus a bounded node-wide feed; they
  become structs only when read.
- Durable before acknowledged: create, destroy, pause and resume answer only once the
  journal holds the new state (``NodeConfig.journal_sync``; ``"tick"`` is the old
  write-once-per-tick mode for scale tests). At start the node adopts what the journal
  holds and then has every backend reconcile the host against it: whatever is left on
  the host that the journal does not know is destroyed, with a tombstone saying so.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import hashlib
import heapq
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self, TypeVar

import msgspec

from dsec.aether.connection import DuplexStream
from dsec.aether.limits import soft_nofile
from dsec.edge.admission import Capacity, ResourcePool
from dsec.edge.backend import (
    Backend,
    Leftover,
    PortBackend,
    ReconcilingBackend,
    SnapshotBackend,
)
from dsec.edge.clock import Clock, SystemClock
from dsec.edge.eager import gather_eager
from dsec.edge.filestream import FileStreamBackend, watch_budget
from dsec.edge.journal import (
    JOURNAL_SYNC_MODES,
    JournalEnd,
    JournalRecord,
    JournalSync,
    SandboxJournal,
)
from dsec.edge.layers import EdgeLayers, find_store, held_layers
from dsec.edge.lifecycle import (
    FINAL_REASONS,
    NOTICE_REASONS,
    TABLE,
    EventTuple,
    LifecycleEvent,
    adopted_lifetime,
    event_structs,
    moved_lifetime,
    next_state,
    start_clock,
    stop_clock,
)
from dsec.edge.qos import (
    PressureDriver,
    PressurePolicy,
    QosView,
    Relief,
    node_qos,
    qos_policy_text,
    read_psi,
)
from dsec.edge.usage import CpuUsage, OpTimings
from dsec.errors import (
    BackendError,
    CapacityExceeded,
    Conflict,
    DsecError,
    ImageNotFound,
    InUse,
    InvalidArgument,
    InvalidTransition,
    NotFound,
    PermissionDenied,
    RateLimited,
    ResourceExhausted,
    SandboxNotFound,
    StreamReset,
    WrongNode,
)
from dsec.ids import NodeId, SandboxId, node_of, parse_node_id, parse_sandbox_id
from dsec.image.store import LayerStore
from dsec.net.compile import ipv6_inert_note
from dsec.net.tunnel import connect_in_netns, relay
from dsec.wire.calls import ResumeReason
from dsec.wire.files import (
    MAX_WATCHES_PER_SANDBOX,
    FileEvent,
    ReadStream,
    Rename,
    Watch,
    WriteStream,
)
from dsec.wire.netpolicy import NetworkPolicy, within
from dsec.wire.node import (
    MAX_FEED_EVENTS,
    MAX_LIST_PAGE,
    EventFeed,
    Heartbeat,
    PoolStats,
    SandboxBrief,
    labels_match,
)
from dsec.wire.ports import (
    MAX_EXPOSED_PORTS,
    MAX_TUNNELS_PER_SANDBOX,
    TUNNEL_IDLE_S,
    TUNNEL_OPEN_IDLE_S,
    PortRecord,
)
from dsec.wire.spec import (
    LEGACY_PROJECT,
    MAX_TTL_S,
    PAUSED_RETENTION_S,
    BackendName,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileInfo,
    NetworkView,
    PauseStats,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SandboxStats,
    SnapshotInfo,
    backend_of,
    check_file_user,
    check_mode,
    check_path,
    check_read_range,
    check_snapshot_ref,
    check_strip,
    isolation_of,
    not_offered,
    project_of,
    qos_of,
    resolve,
    stored,
)

__all__ = ["EdgeNode", "NodeConfig", "ReapAction"]

log = logging.getLogger("dsec.edge")
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """How one edge node behaves. Units are in the names; ``None`` means none."""

    node_id: str
    capacity: Capacity
    labels: Mapping[str, str] = field(default_factory=dict)
    state_dir: str | None = None          # where sandbox records persist; None = memory only
    # When an answered change is on disk (dsec.edge.journal): "fsync" (default) before the
    # answer, surviving kill -9 and power loss; "write" before the answer, surviving kill
    # -9 only; "tick" up to flush_interval_s later (a crash loses that tick).
    journal_sync: JournalSync = "fsync"
    flush_interval_s: float = 0.05        # journal tick: writes what nobody waits for
    reap_interval_s: float = 0.5          # TTL / idle check tick
    # How long a sandbox may stay paused, measured from its pause (``dsec edge
    # --paused-retention-s``): then it is destroyed with reason "paused_retention". The
    # TTL clock stops while paused, so without this a paused sandbox (an idle pause by
    # the edge itself, a client that paused and exited) lived forever, holding its
    # project's sandbox count and memory quota, its upper layer and its kernel objects
    # (red team 19, B4). E2B keeps a paused sandbox a bounded time too. None: forever.
    paused_retention_s: float | None = PAUSED_RETENTION_S
    events_per_sandbox: int = 64          # bounded per-sandbox event log (first event kept)
    feed_size: int = 65_536               # bounded node-wide event feed
    tombstones: int = 10_000              # destroyed sandboxes still answerable by id
    # Commands running at once. Each holds file descriptors of this process (output
    # pipes, stdin, a pidfd): a member key running 600 `sleep`s in its own sandbox took
    # every fd of a dsec up process (RLIMIT_NOFILE 1024), and other tenants' execs and
    # creates failed with EMFILE. Beyond a cap an exec is refused with a clear error.
    # "auto": an eighth of the soft RLIMIT_NOFILE (read at each exec: backends raise
    # it), i.e. at most half the fds the listeners leave to the node's own work.
    max_execs: int | None | Literal["auto"] = "auto"
    # ... and per sandbox, at most this and a quarter of max_execs; a top-level project
    # (a tenant, with all its sub-projects) holds at most half of max_execs: one tenant
    # cannot take the whole share, the others always find room.
    max_execs_per_sandbox: int | None = 256
    # Output a command's reply carries, per stream (stdout, stderr): a non-streaming
    # exec collects at most this much in the edge's memory whatever output_cap_bytes
    # asks (up to 1 GiB is valid, for exec_stream). One `head -c 600M /dev/zero` with a
    # 1 GiB cap grew dsec up by 1 GB, only to fail: no reply is over 16 MiB (max_frame).
    max_reply_output_bytes: int = 4 << 20
    # Exposed ports (dsec.wire.ports): TCP connections into one sandbox at once through
    # port_connect (each holds a socket of this process), and how long one may idle.
    max_tunnels_per_sandbox: int = MAX_TUNNELS_PER_SANDBOX
    tunnel_idle_s: float = TUNNEL_IDLE_S
    tunnel_open_idle_s: float = TUNNEL_OPEN_IDLE_S     # before the first byte
    # The backend of a create whose spec leaves it unset (a caller reaching the edge
    # directly; the apiserver resolves specs before they get here).
    default_backend: BackendName = "simulated"
    # The most open egress policy this node serves (``dsec edge --net-max``): a create
    # or network_update beyond it is refused, whoever asks. None: no node ceiling (the
    # control plane's project ceilings still bind what comes through the apiserver).
    net_max: NetworkPolicy | None = None
    # The egress policy of a create whose spec names none (``dsec edge --net-default``):
    # what an edge reached directly gives; the apiserver resolves its own before.
    net_default: NetworkPolicy = field(default_factory=NetworkPolicy)
    # The layer store layers move in and out of (issue 16, dsec.edge.layers) when no
    # backend mounts from one (a simulated node beside the cluster's store); None: the
    # container backend's store, if any.
    layer_store: str | None = None
    # Projects (with their subprojects) whose sandboxes this node runs best-effort only
    # (``dsec edge --qos-be-only PROJECT``, issue 22): a create naming no QoS class gets
    # "be", one asking "ls" is refused, whoever asks (the control plane's project quota
    # ``qos_ls`` binds what comes through the apiserver).
    qos_be_only: tuple[str, ...] = ()
    # Relieve node memory pressure (PSI) by pausing idle best-effort sandboxes
    # (dsec.edge.qos.plan_relief), checked every pressure_interval_s; None: off
    # (``dsec edge --memory-pressure``: the default PressurePolicy).
    memory_pressure: PressurePolicy | None = None
    pressure_interval_s: float = 5.0

    def __post_init__(self) -> None:
        parse_node_id(self.node_id)
        self.net_default.validate("net_default")
        if self.net_max is not None:
            self.net_max.validate("net_max")
        if self.journal_sync not in JOURNAL_SYNC_MODES:
            raise InvalidArgument(f"node config journal_sync={self.journal_sync!r} must be "
                                  f"one of {', '.join(JOURNAL_SYNC_MODES)}")
        if self.paused_retention_s is not None and not self.paused_retention_s > 0:
            raise InvalidArgument(f"node config paused_retention_s="
                                  f"{self.paused_retention_s!r} must be positive seconds "
                                  "or None (paused sandboxes are kept forever)")
        for name in ("flush_interval_s", "reap_interval_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"node config {name} must be positive seconds")
        for name in ("max_execs", "max_execs_per_sandbox"):
            v = getattr(self, name)
            if v is not None and v != "auto" and (not isinstance(v, int) or v < 1):
                raise InvalidArgument(f"node config {name}={v!r} must be >= 1, None"
                                      + (" or 'auto'" if name == "max_execs" else ""))


@dataclass(frozen=True, slots=True)
class ReapAction:
    """What the reaper decided for one sandbox."""

    sandbox_id: str
    action: str        # "destroy" | "pause"
    reason: str        # "ttl" | "idle_timeout" | "paused_retention" (destroy) | "idle" |
    #                    "ttl" (pause: ttl_action="pause")


class _Sandbox:
    """The node's live record of one sandbox (mutable, never leaves the node)."""

    __slots__ = (
        "active",
        "backend",
        "busy",
        "ceiling_deny",
        "created_at",
        "cut",
        "deadline",
        "doomed",
        "ending",
        "events",
        "execs",
        "expires_at",
        "id",
        "last_active_at",
        "net_generation",
        "net_lock",
        "paused_at",
        "paused_reason",
        "paused_until",
        "ports",
        "reason",
        "snap_lock",
        "spec",
        "state",
        "ttl_left",
        "tunnels",
    )

    def __init__(self, sid: str, spec: SandboxSpec, backend: Backend, now: float) -> None:
        self.id = sid
        self.spec = spec
        self.backend = backend
        self.state: SandboxState = "creating"
        self.created_at = now
        self.last_active_at = now
        self.reason = "requested"
        self.events: builtins.list[EventTuple] = [(now, None, "creating", "requested", "")]
        self.busy: asyncio.Future[None] | None = None  # set while pausing/resuming
        self.active = 0          # operations in flight (exec, files) - never idle-reaped
        self.execs = 0           # of which commands (see NodeConfig.max_execs_per_sandbox)
        self.deadline: float | None = None  # earliest TTL/idle deadline queued
        self.doomed: tuple[str, str] | None = None  # died (reason, detail) while creating
        # the roll-back of a failed create, while it runs: it owns the record (a destroy
        # waits for it instead of tearing down the same sandbox beside it)
        self.ending: asyncio.Task[None] | None = None
        # The lifetime (issue 19): a running clock (expires_at, unix seconds) or, while
        # paused, a stopped one (ttl_left seconds); both None: no TTL. set_timeout moves it.
        self.expires_at: float | None = None if spec.ttl_s is None else now + spec.ttl_s
        self.ttl_left: float | None = None
        self.paused_reason = ""                  # "requested" | "idle" | "ttl" while paused
        self.paused_at: float | None = None      # when it was paused (retention clock)
        self.paused_until: float | None = None   # ... and when that retention ends
        # Held while a snapshot writes the sandbox's state: snapshots run one at a time and
        # a destroy waits for the one in flight (its final write renames files inside the
        # sandbox's directory, which the destroy removes).
        self.snap_lock: asyncio.Lock | None = None
        # The network policy's generation (1 at create; network_update bumps it when the
        # policy changes), the project ceilings' denies, and the lock that serialises
        # updates of one sandbox's policy.
        self.net_generation = 1
        self.ceiling_deny: tuple[str, ...] = ()
        self.net_lock: asyncio.Lock | None = None
        self.ports: dict[int, PortRecord] = {}     # exposed ports (journaled)
        self.tunnels: dict[asyncio.Task[Any], int] = {}   # open port_connect -> port
        self.cut: dict[asyncio.Task[Any], str] = {}       # ... cancelled by us: why

    @property
    def port_records(self) -> tuple[PortRecord, ...]:
        return tuple(self.ports.values())

    def cut_tunnels(self, why: str, port: int | None = None) -> int:
        """End the open tunnels (of ``port``, or all): each caller gets StreamReset(why)."""
        n = 0
        for task, p in list(self.tunnels.items()):
            if port is None or p == port:
                self.cut[task] = why
                task.cancel()
                n += 1
        return n

    def ended(self) -> JournalEnd:
        """The journal's tombstone of this (ended) sandbox, from its final event."""
        t, _, to, reason, detail = self.events[-1]
        return JournalEnd(id=self.id, state=to, spec=self.spec, created_at=self.created_at,
                          ended_at=t, reason=reason, detail=detail)


class EdgeNode:
    """See the module docstring. Use as ``async with EdgeNode(cfg, backends) as node``."""

    def __init__(
        self,
        config: NodeConfig,
        backends: Mapping[str, Backend] | Backend,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        journal: SandboxJournal | None = None,
    ) -> None:
        self.config = config
        self.node_id = NodeId(config.node_id)
        if isinstance(backends, Mapping):
            self.backends: dict[str, Backend] = dict(backends)
        else:
            self.backends = {backends.name: backends}
        if not self.backends:
            raise InvalidArgument("an edge node needs at least one backend")
        self.clock: Clock = clock or SystemClock()
        # Sandbox ids only need to be unique, not secret (they are not credentials);
        # a seeded Random is ~10x cheaper than secrets.token_hex per id.
        self._rng = rng or random.Random()
        self.pool = ResourcePool(config.capacity, node=f"node {config.node_id}")
        self._live: dict[str, _Sandbox] = {}
        self._dead: collections.OrderedDict[str, _Sandbox] = collections.OrderedDict()
        self._feed: collections.deque[tuple[int, str, EventTuple]] = collections.deque(
            maxlen=config.feed_size)
        self._seq = 0
        # Notices a backend reports while it adopts a sandbox (before the node lists it
        # live again: network_lost, layer_unavailable), handed out once it is.
        self._adopt_notices: dict[str, list[tuple[str, str]]] = {}
        self._deadlines: builtins.list[tuple[float, str]] = []
        self._cpu = CpuUsage()          # each sandbox's previous CPU reading (stats)
        self.timings = OpTimings()      # operation durations and notices (/metrics)
        if journal is None and config.state_dir is not None:
            journal = SandboxJournal(config.state_dir, sync=config.journal_sync,
                                     keep_ended=config.tombstones)
        self.journal = journal
        self._durable: SandboxJournal | None = None  # the journal, unless in tick mode
        self._tasks: builtins.list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[Any]] = set()
        self._execs = 0          # commands running on this node (NodeConfig.max_execs)
        self._execs_by_tenant: dict[str, int] = {}   # ... by top-level project
        self._watches_by_tenant: dict[str, int] = {}  # file watches open, by tenant
        self._watches_by_sandbox: dict[str, int] = {}
        self._started = False
        self._closed = False
        self._suffix = f"-{self.node_id}"
        for b in self.backends.values():
            b.watch(self._on_death)
        # Issue 19: background processes with output rings, stdin, ptys (edge/processes.py)
        from dsec.edge.processes import ProcessTable
        self.processes = ProcessTable(self, state_dir=config.state_dir)
        spawner = self.processes.helper_spawner
        if spawner is not None:
            # the container helper is the keeper's child: its orphans (the table's
            # processes, once helper and edge are gone) are the keeper's to reap, so
            # their exit status survives an edge restart (dsec.edge.fdstore)
            for b in self.backends.values():
                zygote = getattr(b, "_zygote", None)
                if zygote is not None and hasattr(zygote, "spawner"):
                    zygote.spawner = spawner
        # Layer transfer (issue 16): this node's store, through its container backend
        self._own_store: LayerStore | None = None
        self._images_cache: tuple[tuple[object, ...], builtins.list[str], int] | None = None
        self.layers = EdgeLayers(self._layer_store)
        self._pins_gen = 0                   # the PinSet last applied whole (heartbeat)
        self._pins_lock = asyncio.Lock()
        # memory-pressure relief (issue 22); ``pressure.read`` is the PSI source
        self.pressure = PressureDriver(
            read=read_psi, views=self._qos_views, pause=self._pause_for_pressure,
            notify=self._pressure_notice, clock=self.clock.time,
            policy=config.memory_pressure or PressurePolicy())

    def _layer_store(self) -> LayerStore | None:
        store = find_store(self.backends)
        if store is None and self.config.layer_store is not None:
            if self._own_store is None:
                self._own_store = LayerStore(self.config.layer_store)
            store = self._own_store
        return store

    # =============================================================== start / close
    async def start(self) -> Self:
        """Load persisted records, adopt their sandboxes, reconcile the host against
        them, start the reaper and the journal tick."""
        if self._started:
            return self
        self._started = True
        journal = self.journal
        if journal is not None:
            self._durable = journal if journal.sync != "tick" else None
            contents = journal.open(keep=self._journal_keep)
            self._load_ended(contents.ended)
            await self._adopt_all(contents.records)
        await self._reconcile()
        await self.processes.restore()   # background processes the last edge left running
        if journal is not None:
            journal.write_soon()
            await journal.commit()  # what start decided is on disk before anyone is served
            self._tasks.append(asyncio.create_task(self._flush_loop(), name="edge-journal"))
        self._tasks.append(asyncio.create_task(self._reap_loop(), name="edge-reaper"))
        if self.config.memory_pressure is not None:
            self._tasks.append(asyncio.create_task(self._pressure_loop(), name="edge-pressure"))
        return self

    # ================================================================ qos (issue 22)
    def qos_policy(self) -> dict[str, str]:
        """The QoS policies this node applies, for node info (dsec.edge.qos.qos_policy_text):
        each backend's CPU pinning and I/O limits (a backend with a ``qos_policy()``),
        the memory-pressure relief and the best-effort-only projects."""
        out: dict[str, str] = {}
        for b in self.backends.values():
            fn = getattr(b, "qos_policy", None)
            if callable(fn):
                out.update(fn())
        out.update(qos_policy_text(None, {}, pressure=self.config.memory_pressure,
                                   be_only=self.config.qos_be_only))
        return out

    def _qos_views(self) -> builtins.list[QosView]:
        """What the pressure policy weighs: a sandbox with an operation in flight counts
        as active now; resident memory is estimated by its memory_bytes reservation."""
        now = self.clock.time()

        def group(r: _Sandbox) -> str:
            fn = getattr(r.backend, "memory_group_of", None)
            return str(fn(r.id)) if callable(fn) else ""
        return [QosView(r.id, qos_of(r.spec), r.state,
                        now if r.active else r.last_active_at, r.spec.memory_bytes,
                        group(r))
                for r in self._live.values()]

    def _pressure_notice(self, sid: str, detail: str) -> None:
        rec = self._live.get(sid)
        if rec is not None:
            self._event(rec, rec.state, rec.state, "memory_pressure", detail)

    async def _pause_for_pressure(self, sid: str) -> None:
        await self.pause(sid, reason="memory_pressure")   # info.paused_reason says so

    async def relieve_pressure(self) -> Relief:
        """One round of the memory-pressure policy: read PSI, pause idle best-effort
        sandboxes (idle longest first), then a ``memory_pressure`` notice on each."""
        return await self.pressure.tick()

    async def _pressure_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.pressure_interval_s)
            try:
                await self.relieve_pressure()
            except Exception:
                log.exception("memory pressure round failed")

    async def close(self) -> None:
        """Stop background work and flush records. Sandboxes stay (a restart adopts them)."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._bg, return_exceptions=True)
        await self.processes.close()
        if self.journal is not None:
            await self.journal.drain()
            try:
                self.journal.flush()
            except OSError:
                log.exception("final journal flush failed")
            self.journal.close()
        for b in self.backends.values():
            try:
                await b.close()
            except Exception:
                log.exception("backend %s failed to close", b.name)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _adopt_all(self, records: dict[str, JournalRecord]) -> None:
        now = self.clock.time()
        over = False
        for r in records.values():
            if r.id.endswith(self._suffix) is False:
                log.warning("journal holds %s, which is not this node's; dropped", r.id)
                continue
            spec = stored(r.spec)
            rec = _Sandbox(r.id, spec, self.backends.get(backend_of(spec)), now)  # type: ignore[arg-type]
            # The idle clock restarts with the edge: exec activity is never journaled, so
            # the line's last_active_at may be far older than the last use (a sandbox in
            # use a moment before a crash was idle-reaped by the first pass after it).
            rec.created_at, rec.last_active_at = r.created_at, max(now, r.last_active_at)
            rec.expires_at, rec.ttl_left = adopted_lifetime(
                r.expires_at, r.ttl_left_s, created_at=r.created_at, ttl_s=spec.ttl_s)
            rec.paused_reason = r.paused_reason
            rec.paused_at = r.paused_at
            rec.ports = {p.port: p for p in r.ports}
            rec.net_generation, rec.ceiling_deny = r.net_generation, r.ceiling_deny
            rec.events = [(now, None, "creating", "adopted", f"journal state {r.state}")]
            backend = rec.backend
            if backend is None:
                self._bury(rec, "node_lost", f"backend {spec.backend!r} is not on this node")
                continue
            adopting = getattr(backend, "adopting", None)
            if adopting is not None and r.ceiling_deny:
                adopting(r.id, r.ceiling_deny)  # the policy's deny entries, for its slot
            self._adopt_notices[r.id] = []
            try:
                alive = await backend.adopt(SandboxId(r.id), r.spec)
            except Exception as exc:  # noqa: BLE001 - a broken one must not stop the others
                alive, why = False, f"adopt failed: {exc!r}"
            else:
                why = "the backend no longer has it after an edge restart"
            notices = self._adopt_notices.pop(r.id, [])
            if not alive or r.state in ("creating", "destroying", "failed"):
                if alive:
                    why = f"was {r.state} when the edge stopped"
                    with contextlib.suppress(Exception):
                        await backend.destroy(SandboxId(r.id))
                if r.state == "creating":
                    # Its intent was recorded but its answer never went out: the create
                    # is rolled back (what the backend had made is removed above or by
                    # the reconciliation below).
                    self._bury(rec, "create_failed", "the edge stopped while creating it; "
                               "rolled back at restart")
                else:
                    self._bury(rec, "node_lost", why)
                continue
            if r.state == "running":
                # Answered running (or a pause/snapshot was cut short): a freeze the
                # crash left must not stop it for good while it is reported running.
                # Every backend's resume is a no-op on a running sandbox.
                try:
                    await backend.resume(SandboxId(r.id))
                except Exception as exc:  # noqa: BLE001
                    with contextlib.suppress(Exception):
                        await backend.destroy(SandboxId(r.id))
                    self._bury(rec, "node_lost", f"could not thaw it after a restart: {exc!r}")
                    continue
            # Held past the capacity if it shrank since the last start: a running
            # sandbox is never destroyed for an accounting limit (new creates wait).
            if not self.pool.adopt(r.id, r.spec.cpu_milli, r.spec.memory_bytes) and \
                    not over:
                over = True
                log.warning("node %s re-adopted more than its capacity now admits (%s); "
                            "no new sandbox is admitted until enough of them are gone",
                            self.node_id, self.pool.capacity)
            self._live[r.id] = rec
            state: SandboxState = "paused" if r.state in ("paused", "pausing") else "running"
            if r.state == "resuming":
                state = "paused"  # a paused backend accepts resume; the next exec resumes it
            self._move(rec, "created", "adopted", f"journal state {r.state}")
            for reason, detail in notices:
                self._event(rec, rec.state, rec.state, reason, detail)
            if state == "paused":
                rec.state = "paused"
                stop_clock(rec, now)
                rec.paused_reason = rec.paused_reason or "requested"
                # a line written before paused_at was journaled: retention from now
                self._hold_paused(rec, now if rec.paused_at is None else rec.paused_at)
            else:
                start_clock(rec, now)
                rec.paused_reason = ""
                rec.paused_at = rec.paused_until = None
            self._arm(rec)
            self.journal.put(rec)  # type: ignore[union-attr]

    def _bury(self, rec: _Sandbox, reason: str, detail: str) -> None:
        """Record the final event of a sandbox that never became live again."""
        self._event(rec, rec.state, "destroyed", reason, detail)
        rec.state = "destroyed"
        rec.reason = reason
        self._tomb(rec)
        if self.journal is not None:
            self.journal.end(rec)

    def _load_ended(self, ended: builtins.list[JournalEnd]) -> None:
        """Tombstones from the journal: ended sandboxes stay answerable across restarts."""
        any_backend = next(iter(self.backends.values()))
        for e in ended:
            if not e.id.endswith(self._suffix):
                continue
            spec = stored(e.spec)
            rec = _Sandbox(e.id, spec, self.backends.get(backend_of(spec), any_backend),
                           e.created_at)
            rec.state = e.state
            rec.reason = e.reason
            rec.last_active_at = e.ended_at
            rec.events = [(e.ended_at, None, e.state, e.reason, e.detail)]
            self._tomb(rec)

    def _journal_keep(self) -> tuple[builtins.list[_Sandbox], builtins.list[JournalEnd]]:
        """What a compaction of the journal keeps: live records and the tombstones."""
        return list(self._live.values()), [r.ended() for r in self._dead.values()]

    def _reconcilers(self) -> builtins.list[ReconcilingBackend]:
        seen: set[int] = set()
        out: builtins.list[ReconcilingBackend] = []
        for b in self.backends.values():
            if isinstance(b, ReconcilingBackend) and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
        return out

    async def _reconcile(self) -> None:
        """Have each backend remove whatever the host holds for sandboxes this node does
        not own (a crash before the journal knew them, a journal that was lost); each
        becomes a tombstone with reason ``node_lost`` saying what was found."""
        keep = frozenset(self._live)
        for b in self._reconcilers():
            try:
                found = await b.reconcile(keep)
            except Exception:
                log.exception("backend %s could not reconcile the host at start",
                              getattr(b, "name", b))
                continue
            for left in found:
                self._record_leftover(left, "node_lost", "found on the host at edge start "
                                      f"with no journal record ({left.what}); destroyed")

    def _record_leftover(self, left: Leftover, reason: str, detail: str) -> _Sandbox | None:
        """A tombstone for sandbox traces a backend removed (None if the id is not one
        this node could have made, or already has a tombstone)."""
        sid = left.sandbox_id
        known = self._dead.get(sid)
        if known is not None:
            log.info("removed leftovers of ended sandbox %s: %s", sid, left.what)
            return known
        try:
            if node_of(parse_sandbox_id(sid)) != self.node_id:
                raise InvalidArgument("another node's id")
        except DsecError:
            log.warning("removed host leftovers named %r (not a sandbox id of node %s): %s",
                        sid, self.node_id, left.what)
            return None
        spec = stored(left.spec or SandboxSpec(backend=left.backend))
        rec = _Sandbox(sid, spec, self.backends.get(backend_of(spec))
                       or next(iter(self.backends.values())), self.clock.time())
        rec.events[0] = (rec.created_at, None, "creating", "reconciled", left.what)
        self._seq += 1
        self._feed.append((self._seq, sid, rec.events[0]))
        self._bury(rec, reason, detail)
        log.warning("sandbox %s: %s", sid, rec.events[-1][4])
        return rec

    # ================================================================ background
    async def _flush_loop(self) -> None:
        """Write what nobody waits for (tick mode; retries after a failed write)."""
        journal = self.journal
        assert journal is not None
        while True:
            await asyncio.sleep(self.config.flush_interval_s)
            if journal.dirty:
                journal.write_soon()

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            try:
                await self.reap()
            except Exception:
                log.exception("reaper pass failed")

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _to_the_end(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` to its end even if the caller is cancelled (a client that hung
        up, a request's deadline): a state change the backend has begun - destroy,
        pause, resume, a create's roll-back - reaches its final state and record. A
        cancel cut the old code anywhere in the backend's step and left the sandbox in
        ``destroying``/``pausing``/``resuming`` for good, every later call refused by the
        state table (red team 23b B3: a fncall destroy cancelled during its threaded
        teardown). The caller still sees its cancel; the work goes on as a task."""
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        t.add_done_callback(_consume_result)
        return await asyncio.shield(t)

    # ================================================================ internals
    def _event(self, rec: _Sandbox, frm: SandboxState | None, to: SandboxState, reason: str,
               detail: str) -> None:
        ev = (self.clock.time(), frm, to, reason, detail)
        if frm == to and reason in NOTICE_REASONS:
            self.timings.notice(reason)
        events = rec.events
        events.append(ev)
        if len(events) > self.config.events_per_sandbox:
            del events[1]  # keep the birth event, drop the oldest after it
        self._seq += 1
        self._feed.append((self._seq, rec.id, ev))

    def _move(self, rec: _Sandbox, event: LifecycleEvent, reason: str, detail: str = "") -> None:
        """Compare-and-set: check the table and switch state with no await in between."""
        frm = rec.state
        nxt = TABLE[frm].get(event)
        if nxt is None:
            next_state(rec.id, frm, event)  # raises InvalidTransition with a full message
        rec.state = nxt  # type: ignore[assignment]
        rec.reason = reason
        self._event(rec, frm, nxt, reason, detail)  # type: ignore[arg-type]

    def _new_id(self) -> str:
        bits = self._rng.getrandbits
        sid = f"sb-{bits(48):012x}{self._suffix}"
        while sid in self._live or sid in self._dead:
            sid = f"sb-{bits(48):012x}{self._suffix}"
        return sid

    def _claim_id(self, sandbox_id: str) -> str:
        sid = parse_sandbox_id(sandbox_id)
        if node_of(sid) != self.node_id:
            raise WrongNode(f"sandbox id {sid} names node {node_of(sid)}, but this is node "
                            f"{self.node_id}; send it to its own node", sandbox_id=sid)
        if sid in self._live or sid in self._dead:
            raise InvalidArgument(f"sandbox id {sid} is already in use on node {self.node_id}",
                                  sandbox_id=sid)
        return sid

    def _find(self, sid: str) -> _Sandbox:
        """The live record of ``sid`` or the right typed error for why there is none."""
        rec = self._live.get(sid)
        if rec is not None:
            return rec
        dead = self._dead.get(sid)
        if dead is not None:
            _, _, to, reason, detail = dead.events[-1]
            raise InvalidTransition(
                f"sandbox {sid} is {to} (reason: {reason}{': ' + detail if detail else ''}); "
                "create a new one", sandbox_id=sid, state=to, reason=reason)
        owner = node_of(sid)  # InvalidArgument for a malformed id
        if owner != self.node_id:
            raise WrongNode(f"sandbox {sid} belongs to node {owner}, not to {self.node_id}; "
                            "route the call by the node in the id", sandbox_id=sid, node=owner)
        raise SandboxNotFound(f"no sandbox {sid} on node {self.node_id} (never existed here, "
                              "or destroyed long ago)", sandbox_id=sid)

    def _info(self, rec: _Sandbox) -> SandboxInfo:
        return SandboxInfo(id=rec.id, node=self.node_id, state=rec.state, spec=rec.spec,
                           created_at=rec.created_at, last_active_at=rec.last_active_at,
                           reason=rec.reason, expires_at=rec.expires_at,
                           ttl_left_s=rec.ttl_left, paused_reason=rec.paused_reason,
                           paused_until=rec.paused_until)

    def _tomb(self, rec: _Sandbox) -> None:
        # an ended sandbox's URLs and tunnels end with it, and its process table
        rec.cut_tunnels(f"sandbox {rec.id} ended ({rec.state})")
        self.processes.drop(rec.id, f"{rec.state}: {rec.reason}")
        rec.ports = {}
        dead = self._dead
        dead[rec.id] = rec
        self._cpu.forget(rec.id)          # its previous CPU reading (stats)
        if len(dead) > self.config.tombstones:
            dead.popitem(last=False)

    def _hold_paused(self, rec: _Sandbox, paused_at: float) -> None:
        """Start ``rec``'s paused retention (:attr:`NodeConfig.paused_retention_s`),
        measured from ``paused_at``; journaled with the record, so it survives a
        restart (the deadline is re-derived from the node's setting at adoption)."""
        keep = self.config.paused_retention_s
        rec.paused_at = paused_at
        rec.paused_until = None if keep is None else paused_at + keep

    def _arm(self, rec: _Sandbox) -> None:
        """Queue the sandbox's next TTL/idle deadline (lazy heap: checked when popped)."""
        d = self._deadline_of(rec)
        if d is not None and (rec.deadline is None or d < rec.deadline):
            rec.deadline = d
            heapq.heappush(self._deadlines, (d, rec.id))

    @staticmethod
    def _deadline_of(rec: _Sandbox) -> float | None:
        spec = rec.spec
        d = rec.expires_at
        if spec.idle_timeout_s is not None and rec.state == "running":
            i = rec.last_active_at + spec.idle_timeout_s
            d = i if d is None or i < d else d
        if rec.paused_until is not None:
            d = rec.paused_until if d is None or rec.paused_until < d else d
        return d

    def _backend_error(self, rec: _Sandbox, op: str, exc: BaseException) -> DsecError:
        if isinstance(exc, DsecError):
            return exc
        return BackendError(f"backend {rec.backend.name} failed to {op} sandbox {rec.id}: "
                            f"{type(exc).__name__}: {exc}", sandbox_id=rec.id, op=op)

    def _interrupted(self, rec: _Sandbox, op: str, exc: BaseException) -> DsecError:
        """The error for an exec/file call that failed; names a destroy that raced it."""
        if rec.state in ("destroying", "destroyed", "failed"):
            return InvalidTransition(
                f"sandbox {rec.id} was {rec.state} (reason: {rec.reason}) while {op} ran",
                sandbox_id=rec.id, event=op, state=rec.state, reason=rec.reason)
        return self._backend_error(rec, op + " in", exc)

    # ================================================================ create
    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None,
                     ceiling_deny: tuple[str, ...] = ()) -> SandboxInfo:
        """Admit, create and return a running sandbox; on any failure nothing remains.
        ``ceiling_deny``: the project's network ceilings' deny entries (the control
        plane's), enforced with the sandbox's own.

        Durable before acknowledged: the intent (``creating``) is in the journal before
        the backend starts, the ``running`` record before the answer."""
        t0, ok = time.monotonic(), False
        try:
            rec = self._admit(spec, sandbox_id, ceiling_deny)
            await self._commit_or_abort(rec, sync=False)   # the intent: written, not fsynced
            await self._build(rec)
            await self._commit_or_abort(rec)
            info = self._created(rec)
            ok = True
            return info
        finally:
            self.timings.observe("create", time.monotonic() - t0, ok=ok)

    async def create_many(self, specs: Sequence[SandboxSpec]) -> builtins.list[SandboxInfo | DsecError]:
        """Create each spec; one result per spec in order, failures as error objects.

        The same steps as :meth:`create`, phase by phase over the whole batch, so the
        batch shares two journal commits instead of waiting on them item by item
        (measured, 1,000 per batch: per-item waits cost a task and three wake-ups per
        lifecycle, ~4x the journal-off time; phased, the durable burst stays within
        ~1.5x of it)."""
        out: builtins.list[SandboxInfo | DsecError | None] = [None] * len(specs)
        recs: builtins.list[tuple[int, _Sandbox]] = []
        for i, spec in enumerate(specs):
            try:
                recs.append((i, self._admit(spec, None)))
            except DsecError as exc:
                out[i] = exc
        try:
            recs = await self._commit_batch(recs, out, sync=False)
            res = await gather_eager([self._build(r) for _, r in recs])
            built: builtins.list[tuple[int, _Sandbox]] = []
            for (i, r), x in zip(recs, res, strict=True):
                if isinstance(x, BaseException):
                    out[i] = _as_error(x)
                else:
                    built.append((i, r))
            for i, r in await self._commit_batch(built, out):
                out[i] = self._created(r)
        except BaseException as exc:  # cancelled: nothing half-made stays
            for _, r in recs:
                if r.id in self._live and r.state == "creating":
                    await self._abort_create(r, exc)
            raise
        return out  # type: ignore[return-value]

    def _admit(self, spec: SandboxSpec, sandbox_id: str | None,
               ceiling_deny: tuple[str, ...] = ()) -> _Sandbox:
        """Validate, reserve, record (no await): the sandbox exists as ``creating`` and
        its intent is noted in the journal."""
        spec = resolve(spec.validate(), backend=self.config.default_backend,
                       project=LEGACY_PROJECT, network=self.config.net_default)
        assert spec.network is not None  # stored resolved: a later default moves nothing
        self._check_node_ceiling(spec.network, "network")
        spec = node_qos(spec, self.config.qos_be_only, self.node_id)
        backend = self.backends.get(backend_of(spec))
        if backend is None:
            raise not_offered(spec, self.backends, f"node {self.node_id}")
        sid = self._new_id() if sandbox_id is None else self._claim_id(sandbox_id)
        self.pool.reserve(sid, spec.cpu_milli, spec.memory_bytes, disk_bytes=spec.disk_bytes)
        rec = _Sandbox(sid, spec, backend, self.clock.time())
        rec.ceiling_deny = ceiling_deny
        self._live[sid] = rec
        self._seq += 1
        self._feed.append((self._seq, sid, rec.events[0]))
        if self.journal is not None:
            # Intent first: a crash from here on finds the record at restart and rolls
            # the create back (with whatever the backend had made).
            self.journal.put(rec)
        return rec

    async def _commit_or_abort(self, rec: _Sandbox, *, sync: bool = True) -> None:
        """Wait for the journal to hold what was noted (fsynced unless ``sync=False``:
        see :meth:`SandboxJournal.commit`); on failure roll ``rec`` back."""
        if self._durable is None:
            return
        try:
            await self._durable.commit(sync=sync)
        except BaseException as exc:
            await self._abort_create(rec, exc)
            raise

    async def _commit_batch(self, recs: builtins.list[tuple[int, _Sandbox]],
                            out: builtins.list[Any], *,
                            sync: bool = True) -> builtins.list[tuple[int, _Sandbox]]:
        if self._durable is None or not recs:
            return recs
        try:
            await self._durable.commit(sync=sync)
        except DsecError as exc:
            for i, r in recs:
                await self._abort_create(r, exc)
                out[i] = exc
            return []
        return recs

    async def _build(self, rec: _Sandbox) -> None:
        """The backend's part of a create, then the running record noted; on failure
        everything is rolled back and the error raised."""
        try:
            await rec.backend.create(SandboxId(rec.id), rec.spec)
            setter = getattr(rec.backend, "set_network", None)
            if rec.ceiling_deny and setter is not None:
                # the project ceilings' denies, enforced before the create is answered
                # (nothing but the sandbox's init runs yet)
                await setter(SandboxId(rec.id), rec.spec, rec.ceiling_deny, rec.net_generation)
        except BaseException as exc:
            await self._abort_create(rec, exc)
            if isinstance(exc, Exception):
                raise self._backend_error(rec, "create", exc) from exc
            raise
        if self.journal is not None:
            # Durable before acknowledged: the record says running before the answer
            # (and before the state switches, so a failed write rolls back cleanly).
            self.journal.put(rec, "running")

    def _created(self, rec: _Sandbox) -> SandboxInfo:
        self._move(rec, "created", "requested")
        note = self._ipv6_note(rec)
        if note:
            self._event(rec, rec.state, rec.state, "network_ipv6_inert", note[:500])
        if rec.doomed is not None:  # the backend reported its death while we created it
            self._spawn(self._die(rec, *rec.doomed))
        elif rec.expires_at is not None or rec.spec.idle_timeout_s is not None:
            self._arm(rec)
        return self._info(rec)

    async def _abort_create(self, rec: _Sandbox, exc: BaseException) -> None:
        """Roll back a failed create: backend cleanup, reservation, record; final event.
        Runs to its end if the caller is cancelled again meanwhile; one roll-back per
        record (a second call waits for the first)."""
        if rec.ending is None:
            rec.ending = asyncio.ensure_future(self._to_the_end(self._abort_create_now(rec, exc)))
        await asyncio.shield(rec.ending)

    async def _abort_create_now(self, rec: _Sandbox, exc: BaseException) -> None:
        detail = f"{type(exc).__name__}: {exc}"
        if rec.state == "creating":
            self._move(rec, "fail", "create_failed", detail)
        try:
            await rec.backend.destroy(SandboxId(rec.id))
        except BaseException as cleanup:  # noqa: BLE001
            # The backend could not clean up: keep the reservation so the leak is visible
            # as a failed sandbox that a later destroy (or the reaper) can retry.
            log.error("cleanup of failed create %s also failed: %r", rec.id, cleanup)
            if self.journal is not None:
                self.journal.put(rec)
            return
        self.pool.release(rec.id)
        self._live.pop(rec.id, None)
        self._tomb(rec)
        if self.journal is not None:
            self.journal.end(rec)  # the tick writes it; nobody waits

    # ================================================================ destroy
    async def destroy(self, sandbox_id: str, *, reason: str = "requested",
                      detail: str = "") -> SandboxInfo:
        """Destroy and return the final info (state destroyed, with ``reason``); answered
        once the tombstone is in the journal, so it never comes back after a crash.

        An id this node has no record of, but whose traces a backend still finds on the
        host, is cleaned up too (and answered with a tombstone) instead of
        ``SandboxNotFound``."""
        t0, ok = time.monotonic(), False
        try:
            info = await self._destroy(sandbox_id, reason, detail)
            if self._durable is not None:
                await self._durable.commit()
            ok = True
            return info
        finally:
            self.timings.observe("destroy", time.monotonic() - t0, ok=ok)

    async def _destroy(self, sandbox_id: str, reason: str, detail: str) -> SandboxInfo:
        """:meth:`destroy` up to noting the tombstone (the caller commits)."""
        if reason not in FINAL_REASONS:
            raise InvalidArgument(f"destroy reason {reason!r} is not one of "
                                  f"{', '.join(sorted(FINAL_REASONS))}", field="reason")
        rec = self._live.get(sandbox_id)
        if rec is not None and rec.ending is not None:
            # its create is being rolled back: that roll-back ends it (a second teardown
            # beside it raced it to the record - red team 24 A1); then answered as any
            # destroy of an ended sandbox is
            with contextlib.suppress(Exception):
                await asyncio.shield(rec.ending)
            rec = self._live.get(sandbox_id)
        if rec is None:
            if sandbox_id not in self._dead:
                left = await self._discard(sandbox_id, reason, detail)
                if left is not None:
                    return self._info(left)
            rec = self._find(sandbox_id)
        self._move(rec, "destroy", reason, detail)
        return await self._to_the_end(self._destroy_rest(rec, reason, detail))

    async def _destroy_rest(self, rec: _Sandbox, reason: str, detail: str) -> SandboxInfo:
        """:meth:`_destroy` once the sandbox is ``destroying`` (never cut by a cancel)."""
        lock = rec.snap_lock
        if lock is not None and lock.locked():
            async with lock:
                pass  # let the snapshot in flight finish its final write first
        try:
            await rec.backend.destroy(SandboxId(rec.id))
        except Exception as exc:
            self._move(rec, "fail", "failed", f"destroy failed: {type(exc).__name__}: {exc}")
            if self.journal is not None:
                self.journal.put(rec)
            raise self._backend_error(rec, "destroy", exc) from exc
        self._move(rec, "destroyed", reason, detail)
        self.pool.release(rec.id)
        self._live.pop(rec.id, None)
        self._tomb(rec)
        if self.journal is not None:
            self.journal.end(rec)
        return self._info(rec)

    async def _discard(self, sandbox_id: str, reason: str, detail: str) -> _Sandbox | None:
        """Remove host traces of an id of this node that it has no record of."""
        try:
            sid = parse_sandbox_id(sandbox_id)
        except DsecError:
            return None
        if node_of(sid) != self.node_id:
            return None
        for b in self._reconcilers():
            try:
                left = await b.discard(SandboxId(sid))
            except Exception as exc:
                raise BackendError(f"backend {getattr(b, 'name', b)} could not remove what "
                                   f"the host holds for {sid}: {type(exc).__name__}: {exc}",
                                   sandbox_id=sid) from exc
            if left is not None:
                rec = self._record_leftover(
                    left, reason, "the node had no record of it; removed what the host "
                    f"still held ({left.what})" + (f"; {detail}" if detail else ""))
                if rec is not None and self._durable is not None:
                    await self._durable.commit()
                return rec
        return None

    async def destroy_many(self, ids: Sequence[str], *,
                           reason: str = "requested") -> builtins.list[SandboxInfo | DsecError]:
        """Destroy each; the batch shares one journal commit before the answer."""
        res = await gather_eager([self._destroy(i, reason, "") for i in ids])
        out = [r if not isinstance(r, BaseException) else _as_error(r) for r in res]
        if self._durable is not None and any(isinstance(r, SandboxInfo) for r in out):
            try:
                await self._durable.commit()
            except DsecError as exc:  # destroyed, but not recorded: say so for each
                out = [exc if isinstance(r, SandboxInfo) else r for r in out]
        return out

    def _on_death(self, sid: SandboxId, reason: str, detail: str) -> None:
        """Backend sink: a sandbox died on its own (OOM, exited, crash), or a notice."""
        rec = self._live.get(sid)
        if rec is None and reason in NOTICE_REASONS and sid in self._adopt_notices:
            self._adopt_notices[sid].append((reason, detail))   # being adopted right now
            return
        if rec is None or rec.state in ("destroying", "destroyed"):
            return
        if reason in NOTICE_REASONS:
            # Something happened inside a sandbox that lives on (e.g. one process was
            # OOM-killed): an event without a state change, so clients can see why.
            self._event(rec, rec.state, rec.state, reason, detail)
            return
        why = reason if reason in FINAL_REASONS else "backend_crash"
        if rec.state == "creating":
            rec.doomed = (why, detail or reason)  # create() cleans up when it returns
            return
        self._spawn(self._die(rec, why, detail or reason))

    async def _die(self, rec: _Sandbox, reason: str, detail: str) -> None:
        while rec.state in ("pausing", "resuming") and rec.busy is not None:
            # Let the in-flight operation finish (it will likely fail), then clean up.
            await asyncio.shield(rec.busy)
        if rec.id not in self._live or rec.state in ("destroying", "destroyed"):
            return
        try:
            await self.destroy(rec.id, reason=reason, detail=detail)
        except DsecError as exc:
            log.warning("cleanup after %s of %s failed: %s", reason, rec.id, exc)

    # ================================================================ network
    def _check_node_ceiling(self, policy: NetworkPolicy, where: str) -> None:
        """This node's ceiling (``dsec edge --net-max``): an edge reached directly is
        never asked for more than its operator allows."""
        v = within(policy, self.config.net_max)
        if v is not None:
            fld = v.field.replace("network", where, 1)
            raise PermissionDenied(
                f"{fld} {v.entry!r} is outside the network ceiling of node {self.node_id} "
                f"({self.config.net_max}): that ceiling {v.why}", field=fld, entry=v.entry,
                node=self.node_id)

    @staticmethod
    def _net_ipv6(rec: _Sandbox) -> bool:
        """Whether the sandbox's backend enforces IPv6 entries (its slots have IPv6)."""
        return rec.spec.net.net_mode != "none" and bool(
            getattr(rec.backend, "network_ipv6", False))

    def _ipv6_note(self, rec: _Sandbox) -> str:
        """What the caller is told when the policy's v6 entries are inert here."""
        if self._net_ipv6(rec):
            return ""
        return ipv6_inert_note(rec.spec.net, self.node_id)

    def _net_view(self, rec: _Sandbox) -> NetworkView:
        address, denied, pins = None, 0, 0
        status = getattr(rec.backend, "network_status", None)
        if status is not None and rec.state not in ("destroyed", "failed"):
            address, denied, pins = status(SandboxId(rec.id))
        return NetworkView(policy=rec.spec.net, generation=rec.net_generation,
                           ceiling_deny=rec.ceiling_deny, address=address,
                           ipv6=self._net_ipv6(rec), denied_packets=denied, pins=pins)

    def network_get(self, sandbox_id: str) -> NetworkView:
        """The sandbox's egress policy as this node holds it, and its generation."""
        return self._net_view(self._find(sandbox_id))

    async def network_update(self, sandbox_id: str, policy: NetworkPolicy, *,
                             expect_generation: int | None = None,
                             ceiling_deny: tuple[str, ...] = ()) -> NetworkView:
        """Replace the sandbox's egress policy. A policy equal to the live one (and the
        same ceiling denies) changes nothing: no new generation, so a retry after a lost
        answer is a no-op. Otherwise durable before acknowledged: the journal holds the
        new policy before the backend applies it (a crash between the two is reconciled
        from the journal at restart), and a refusal by the backend puts the old one back
        in the journal before the error is answered.

        The backend applies it through its ``set_network(id, spec, ceiling_deny,
        generation)``; a backend without one enforces no policy but ``none``, and is
        asked for nothing else."""
        rec = self._find(sandbox_id)
        policy = policy.validate("policy")
        self._check_node_ceiling(policy, "policy")
        if rec.net_lock is None:
            rec.net_lock = asyncio.Lock()
        async with rec.net_lock:
            if rec.state not in ("running", "paused"):
                raise InvalidTransition(
                    f"sandbox {rec.id} is {rec.state}: its network policy changes only "
                    "while it is running or paused", sandbox_id=rec.id, state=rec.state)
            if expect_generation is not None and expect_generation != rec.net_generation:
                raise Conflict(
                    f"sandbox {rec.id}'s network policy is at generation "
                    f"{rec.net_generation}, not {expect_generation}: it changed since you "
                    "read it; read it again (network_get) and retry",
                    field="expect_generation", sandbox_id=rec.id,
                    generation=rec.net_generation)
            if policy == rec.spec.net and ceiling_deny == rec.ceiling_deny:
                return self._net_view(rec)
            setter = getattr(rec.backend, "set_network", None)
            if setter is None and policy.net_mode != "none":
                raise InvalidArgument(
                    f"the {rec.spec.backend} backend on node {self.node_id} enforces no "
                    f"network policy but 'none'; {policy.net_mode!r} is refused",
                    field="policy.mode")
            checker = getattr(rec.backend, "check_network", None)
            if checker is not None:
                # a policy the backend will refuse is refused before it is journaled
                try:
                    await checker(SandboxId(rec.id),
                                  msgspec.structs.replace(rec.spec, network=policy),
                                  ceiling_deny)
                except Exception as exc:
                    raise self._backend_error(rec, "network_update", exc) from exc
            old = (rec.spec, rec.ceiling_deny, rec.net_generation)
            rec.spec = msgspec.structs.replace(rec.spec, network=policy)
            rec.ceiling_deny = ceiling_deny
            rec.net_generation += 1
            await self._journal_now(rec)
            try:
                if setter is not None:
                    await setter(SandboxId(rec.id), rec.spec, ceiling_deny, rec.net_generation)
            except BaseException as exc:
                rec.spec, rec.ceiling_deny, rec.net_generation = old
                await self._journal_now(rec)
                if isinstance(exc, Exception):
                    raise self._backend_error(rec, "network_update", exc) from exc
                raise
            self._event(rec, rec.state, rec.state, "network_updated",
                        f"generation {rec.net_generation}: {policy}"[:500])
            note = self._ipv6_note(rec)
            if note:
                self._event(rec, rec.state, rec.state, "network_ipv6_inert", note[:500])
            return self._net_view(rec)

    async def _journal_now(self, rec: _Sandbox) -> None:
        """Put ``rec`` in the journal and wait until it is durable."""
        if self.journal is not None:
            self.journal.put(rec)
            if self._durable is not None:
                await self._durable.commit()

    # ================================================================ lifetimes
    async def set_timeout(self, sandbox_id: str, timeout_s: float, *,
                          extend: bool = False) -> SandboxInfo:
        """End the sandbox ``timeout_s`` seconds from now (``extend``: after its current
        deadline). Paused, its clock is stopped: this sets the time it will have left
        when it resumes. Durable before acknowledged (journaled and fsynced)."""
        rec = self._find(sandbox_id)
        if rec.state in ("destroying", "destroyed", "failed"):
            raise InvalidTransition(
                f"sandbox {rec.id} is {rec.state} (reason: {rec.reason}): its lifetime can "
                "no longer change", sandbox_id=rec.id, event="set_timeout", state=rec.state)
        now = self.clock.time()
        old = (rec.expires_at, rec.ttl_left)
        rec.expires_at, rec.ttl_left = moved_lifetime(
            rec.expires_at, rec.ttl_left, stopped=rec.state in ("paused", "resuming"),
            now=now, timeout_s=timeout_s, extend=extend, cap_s=MAX_TTL_S)
        try:
            await self._journal_now(rec)
        except BaseException:
            rec.expires_at, rec.ttl_left = old
            raise
        self._arm(rec)
        self._event(rec, rec.state, rec.state, "timeout_set",
                    f"expires_at={rec.expires_at}" if rec.expires_at is not None
                    else f"ttl_left_s={rec.ttl_left} (paused: the clock runs from resume)")
        return self._info(rec)

    # ================================================================ pause / resume
    async def pause(self, sandbox_id: str, *, reason: str = "requested") -> PauseStats:
        """Freeze the sandbox and give back its memory (backend-dependent). Idempotent
        like :meth:`resume`: a sandbox already paused (an idle pause, another caller's)
        is success with nothing more given back; one in flight is waited for first.
        ``reason``: "requested", or "idle" for the reaper's idle pause. Its TTL clock
        stops once it is paused and runs again from its resume."""
        rec = self._find(sandbox_id)
        while rec.state in ("pausing", "resuming") and rec.busy is not None:
            await asyncio.shield(rec.busy)
        if rec.state == "paused":
            return PauseStats()
        t0, ok = time.monotonic(), False
        try:
            stats = await self._pause(rec, reason)
            ok = True
            return stats
        finally:
            self.timings.observe("pause", time.monotonic() - t0, ok=ok)

    async def _pause(self, rec: _Sandbox, reason: str) -> PauseStats:
        self._move(rec, "pause", reason)
        rec.busy = asyncio.get_running_loop().create_future()   # with the move: no gap
        return await self._to_the_end(self._pause_rest(rec, reason))

    async def _pause_rest(self, rec: _Sandbox, reason: str) -> PauseStats:
        try:
            stats = await rec.backend.pause(SandboxId(rec.id))
        except Exception as exc:
            await self._fail_op(rec, "pause", exc)
            raise self._backend_error(rec, "pause", exc) from exc
        finally:
            self._release_busy(rec)
        if rec.state != "pausing":  # destroyed while pausing
            raise InvalidTransition(f"sandbox {rec.id} was {rec.state} while it paused",
                                    sandbox_id=rec.id, state=rec.state)
        self._move(rec, "paused", reason)
        now = self.clock.time()
        stop_clock(rec, now)
        if reason == "ttl" and rec.spec.ttl_s is not None:
            # paused by its TTL (ttl_action="pause", E2B's autoPause): resumed, it runs
            # a whole ttl_s again (else it would pause again at once: nothing was left)
            rec.ttl_left = rec.spec.ttl_s
        rec.paused_reason = reason
        self._hold_paused(rec, now)
        self._arm(rec)
        if self.journal is not None:  # acknowledged paused = adopted paused after a crash
            self.journal.put(rec)
            if self._durable is not None:
                await self._durable.commit()
        return stats

    async def resume(self, sandbox_id: str, *,
                     reason: ResumeReason = "requested") -> SandboxInfo:
        """Make the sandbox running. Idempotent: a sandbox that is already running (an
        exec resumed it transparently, another caller resumed it first) is success, so
        a trainer resuming every sandbox of a preempted rollout never fails on the few a
        stray exec woke (issue 18). A pause or resume in flight is waited for first.
        ``reason`` goes on the events: ``auto_resume`` when the control plane resumes
        it ahead of a write or exec (within the quota), as ``_ready`` would here."""
        rec = self._find(sandbox_id)
        while rec.state in ("pausing", "resuming") and rec.busy is not None:
            await asyncio.shield(rec.busy)
        if rec.state != "running":
            await self._resume(rec, reason)
        return self._info(rec)

    async def _resume(self, rec: _Sandbox, reason: str) -> None:
        t0, ok = time.monotonic(), False
        try:
            await self._resume_now(rec, reason)
            ok = True
        finally:
            self.timings.observe("resume", time.monotonic() - t0, ok=ok)

    async def _resume_now(self, rec: _Sandbox, reason: str) -> None:
        self._move(rec, "resume", reason)
        rec.busy = asyncio.get_running_loop().create_future()   # with the move: no gap
        await self._to_the_end(self._resume_rest(rec, reason))

    async def _resume_rest(self, rec: _Sandbox, reason: str) -> None:
        try:
            await rec.backend.resume(SandboxId(rec.id))
        except Exception as exc:
            await self._fail_op(rec, "resume", exc)
            raise self._backend_error(rec, "resume", exc) from exc
        finally:
            self._release_busy(rec)
        if rec.state != "resuming":
            raise InvalidTransition(f"sandbox {rec.id} was {rec.state} while it resumed",
                                    sandbox_id=rec.id, state=rec.state)
        rec.last_active_at = self.clock.time()
        self._move(rec, "resumed", reason)
        start_clock(rec, rec.last_active_at)
        rec.paused_reason = ""
        rec.paused_at = rec.paused_until = None
        self._arm(rec)
        if self.journal is not None:
            self.journal.put(rec)
            if self._durable is not None:
                await self._durable.commit()

    @staticmethod
    def _release_busy(rec: _Sandbox) -> None:
        busy, rec.busy = rec.busy, None
        if busy is not None and not busy.done():
            busy.set_result(None)

    async def _fail_op(self, rec: _Sandbox, op: str, exc: BaseException) -> None:
        """A pause/resume failed: mark failed, then destroy so nothing stays held."""
        if rec.state not in ("pausing", "resuming"):
            return
        self._move(rec, "fail", "failed", f"{op} failed: {type(exc).__name__}: {exc}")
        with contextlib.suppress(DsecError):
            await self.destroy(rec.id, reason="failed", detail=f"cleanup after failed {op}")

    async def _ready(self, rec: _Sandbox, op: str) -> None:
        """Make ``rec`` running for an exec/file call, resuming transparently if paused."""
        while True:
            state = rec.state
            if state == "running":
                return
            if state == "paused":
                try:
                    await self._resume(rec, "auto_resume")
                except InvalidTransition:
                    continue  # another caller started the resume first: wait for it
                return
            if state in ("pausing", "resuming") and rec.busy is not None:
                await asyncio.shield(rec.busy)
                continue
            raise InvalidTransition(
                f"sandbox {rec.id} cannot {op} while it is {state}; it must be running "
                "or paused", sandbox_id=rec.id, event=op, state=state)

    # ================================================================ ports
    def _port_backend(self, rec: _Sandbox) -> PortBackend:
        backend = rec.backend
        if not isinstance(backend, PortBackend):
            raise InvalidArgument(
                f"sandbox {rec.id} runs on the {rec.spec.backend!r} backend, which has no "
                "network namespace of its own: its exposed ports cannot be connected to "
                "(use a container sandbox)", field="port", backend=rec.spec.backend)
        return backend

    async def _journal_ports(self, rec: _Sandbox) -> None:
        if self.journal is not None:   # acknowledged = still exposed after a restart
            self.journal.put(rec)
            if self._durable is not None:
                await self._durable.commit()

    async def port_expose(self, sandbox_id: str, port: int) -> PortRecord:
        """Expose ``port`` (idempotent: an exposed port answers its current record).
        Bookkeeping on every backend; connecting needs one with a network namespace."""
        rec = self._find(sandbox_id)
        if rec.state not in ("running", "paused", "pausing", "resuming"):
            raise InvalidTransition(
                f"sandbox {rec.id} is {rec.state}: ports can be exposed once it runs",
                sandbox_id=rec.id, state=rec.state)
        have = rec.ports.get(port)
        if have is not None:
            return have
        if len(rec.ports) >= MAX_EXPOSED_PORTS:
            raise InvalidArgument(
                f"sandbox {rec.id} already has {len(rec.ports)} exposed ports (the limit is "
                f"{MAX_EXPOSED_PORTS}); close one first", field="port", sandbox_id=rec.id,
                limit=MAX_EXPOSED_PORTS)
        # A new generation at each opening: URLs and tunnels of an earlier one never work
        # again. Random (not a counter) so it needs no state of its own across restarts.
        pr = PortRecord(port=port, generation=self._rng.getrandbits(62) | 1,
                        exposed_at=self.clock.time())
        rec.ports[port] = pr
        try:
            await self._journal_ports(rec)
        except BaseException:
            rec.ports.pop(port, None)      # not durable: not exposed
            raise
        return pr

    def port_list(self, sandbox_id: str) -> builtins.list[PortRecord]:
        rec = self._find(sandbox_id)
        return sorted(rec.ports.values(), key=lambda p: p.port)

    async def port_close(self, sandbox_id: str, port: int) -> None:
        """Close ``port``: its record goes and every tunnel to it is cut (idempotent)."""
        rec = self._find(sandbox_id)
        if rec.ports.pop(port, None) is None:
            return
        # Cut first: a URL stops working the moment it is closed, whatever the journal
        # does (its generation is gone from memory; a failed write leaves the port
        # exposed after a restart, which the error tells the caller).
        rec.cut_tunnels(f"port {port} of sandbox {rec.id} was closed", port)
        await self._journal_ports(rec)

    async def port_connect(self, sandbox_id: str, port: int, generation: int,
                           stream: DuplexStream) -> None:
        """Relay ``stream`` to ``127.0.0.1:port`` inside the sandbox until either side ends,
        the port closes, the sandbox ends, or the tunnel idles out."""
        rec = self._find(sandbox_id)
        pr = rec.ports.get(port)
        if pr is None or pr.generation != generation:
            raise NotFound(
                f"port {port} of sandbox {rec.id} is not exposed"
                + ("" if pr is None else " under this URL (closed and exposed again since)")
                + "; expose it and use the new URL", sandbox_id=rec.id, port=port)
        cap = self.config.max_tunnels_per_sandbox
        n_tunnels = sum(1 for p in rec.tunnels.values() if p > 0)  # not file streams
        if n_tunnels >= cap:
            raise RateLimited(
                f"sandbox {rec.id} has {n_tunnels} open connections to its exposed "
                f"ports (the limit is {cap}); close some or retry later",
                sandbox_id=rec.id, limit=cap, retry_after=1.0)
        backend = self._port_backend(rec)
        task = asyncio.current_task()
        assert task is not None
        rec.tunnels[task] = port
        try:
            await self._ready(rec, "connect")
            sock = await connect_in_netns(backend.netns_fd(SandboxId(rec.id)), port,
                                          what=f"sandbox {rec.id}")
            try:
                rec.last_active_at = self.clock.time()
                await relay(stream, sock, idle_s=self.config.tunnel_idle_s,
                            open_idle_s=self.config.tunnel_open_idle_s)
                rec.last_active_at = self.clock.time()
            finally:
                sock.close()
        except asyncio.CancelledError:
            why = rec.cut.pop(task, None)
            if why is None:
                raise            # the caller's CANCEL, or the connection going away
            raise StreamReset(why, sandbox_id=rec.id, port=port) from None
        finally:
            rec.tunnels.pop(task, None)
            rec.cut.pop(task, None)

    # ================================================================ exec
    @staticmethod
    def _check_hide(rec: _Sandbox) -> None:
        """``ExecRequest.hide`` is a security promise: refuse it where no Landlock layer
        keeps it, rather than run the command unconfined."""
        if not getattr(rec.backend, "supports_hide", False):
            raise InvalidArgument(
                f"sandbox {rec.id} runs on the {rec.spec.backend!r} backend, which cannot "
                "hide paths from a command (exec hide needs the container backend's native "
                "runtime and a kernel with Landlock)", field="hide", sandbox_id=rec.id)

    @staticmethod
    def _plain_exec(req: ExecRequest) -> None:
        """A terminal or an open stdin needs a process of the table (process_start):
        nothing could write to it during a plain exec."""
        if req.pty is not None or req.stdin_open:
            raise InvalidArgument("pty and stdin_open are for process_start (a process "
                                  "that input can be sent to); a plain exec takes its "
                                  "whole stdin up front", field="pty" if req.pty else
                                  "stdin_open")

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        """Run one command (resuming a paused sandbox first)."""
        rec = self._live.get(sandbox_id) or self._find(sandbox_id)
        if req.pty is not None or req.stdin_open:
            self._plain_exec(req)
        if req.hide:
            self._check_hide(rec)
        room = self.config.max_reply_output_bytes
        if req.output_cap_bytes > room:
            # more would be collected only to fail as too large for one reply: keep what
            # fits and flag the rest truncated, like any capped output
            req = msgspec.structs.replace(req, output_cap_bytes=room)
        if rec.state != "running":
            await self._ready(rec, "exec")
        self._admit_exec(rec)
        rec.active += 1
        rec.last_active_at = self.clock.time()
        t0, ok = time.monotonic(), False
        try:
            result = await rec.backend.exec(SandboxId(rec.id), req)
            ok = True
            return result
        except Exception as exc:
            raise self._interrupted(rec, "exec", exc) from exc
        finally:
            self.timings.observe("exec", time.monotonic() - t0, ok=ok)
            rec.active -= 1
            self._exec_ended(rec)
            rec.last_active_at = self.clock.time()
            if rec.spec.idle_timeout_s is not None:
                self._arm(rec)

    def _admit_exec(self, rec: _Sandbox) -> None:
        """Count one more command on ``rec`` and the node, or refuse it with the cap it
        would pass (the caller retries later) - never an EMFILE from deep inside."""
        cfg = self.config
        cap = cfg.max_execs
        if cap == "auto":
            cap = max(1, soft_nofile() // 8)
        per = cfg.max_execs_per_sandbox
        if cap is not None:
            per = max(1, cap // 4) if per is None else max(1, min(per, cap // 4))
        if per is not None and rec.execs >= per:
            raise RateLimited(
                f"sandbox {rec.id} already runs {rec.execs} commands, the per-sandbox "
                f"limit; wait for some to finish (or run them as one script)",
                sandbox_id=rec.id, limit=per, retry_after=1.0)
        tenant = project_of(rec.spec).partition("/")[0]
        mine = self._execs_by_tenant.get(tenant, 0)
        if cap is not None and mine >= max(1, cap // 2):
            raise RateLimited(
                f"project {tenant} already runs {mine} commands on node {self.node_id}, "
                f"half of the node's limit of {cap}; wait for some to finish",
                sandbox_id=rec.id, limit=max(1, cap // 2), retry_after=1.0)
        if cap is not None and self._execs >= cap:
            raise CapacityExceeded(
                f"node {self.node_id} already runs {self._execs} commands, its limit "
                f"({cap}: each holds file descriptors of the node); retry later",
                sandbox_id=rec.id, limit=cap, retry_after=1.0)
        rec.execs += 1
        self._execs += 1
        self._execs_by_tenant[tenant] = mine + 1

    def _exec_ended(self, rec: _Sandbox) -> None:
        rec.execs -= 1
        self._execs -= 1
        tenant = project_of(rec.spec).partition("/")[0]
        n = self._execs_by_tenant.get(tenant, 0) - 1
        if n > 0:
            self._execs_by_tenant[tenant] = n
        else:
            self._execs_by_tenant.pop(tenant, None)

    async def exec_many(self, calls: Sequence[tuple[str, ExecRequest]]
                        ) -> builtins.list[ExecResult | DsecError]:
        """Run many commands (on one or many sandboxes) concurrently; results in order."""
        res = await gather_eager([self.exec(sid, req) for sid, req in calls])
        return [r if not isinstance(r, BaseException) else _as_error(r) for r in res]

    async def exec_stream(self, sandbox_id: str,
                          req: ExecRequest) -> AsyncIterator[ExecChunk | ExecResult]:
        """Yield output chunks as they come, then one final ExecResult."""
        rec = self._find(sandbox_id)
        self._plain_exec(req)
        if req.hide:
            self._check_hide(rec)
        if rec.state != "running":
            await self._ready(rec, "exec")
        self._admit_exec(rec)
        rec.active += 1
        rec.last_active_at = self.clock.time()
        t0, ok = time.monotonic(), False
        try:
            async for item in rec.backend.exec_stream(SandboxId(rec.id), req):
                yield item
            ok = True
        except Exception as exc:
            raise self._interrupted(rec, "exec", exc) from exc
        finally:
            self.timings.observe("exec_stream", time.monotonic() - t0, ok=ok)
            rec.active -= 1
            self._exec_ended(rec)
            rec.last_active_at = self.clock.time()
            if rec.spec.idle_timeout_s is not None:
                self._arm(rec)

    # ================================================================ files
    async def _file_op(self, sandbox_id: str, op: str,
                       call: Callable[[Backend, SandboxId], Awaitable[_T]], path: str,
                       *, read: bool = False) -> _T:
        rec = self._find(sandbox_id)
        check_path(path)  # the same limits whatever door the request came through
        if rec.state != "running":
            if read:
                await self._readable(rec, op)
            else:
                await self._ready(rec, op)
        rec.active += 1
        rec.last_active_at = self.clock.time()
        try:
            return await call(rec.backend, SandboxId(rec.id))
        except Exception as exc:
            raise self._interrupted(rec, op, exc) from exc
        finally:
            rec.active -= 1
            rec.last_active_at = self.clock.time()
            if rec.spec.idle_timeout_s is not None:
                self._arm(rec)

    def _as_user(self, sandbox_id: str, user: str | None) -> dict[str, Any]:
        """The ``user=`` keyword of a backend file call: {} for root (None); refused on a
        backend that cannot act on files as a sandbox user (only one whose file
        operations run with that user's identity, checked by the kernel - the container
        tiers - says FILES_AS_USER: a check followed by root's act would be a race)."""
        if user is None:
            return {}
        check_file_user(user)
        rec = self._find(sandbox_id)
        if not getattr(rec.backend, "FILES_AS_USER", False):
            raise InvalidArgument(
                f"file calls with user={user[:40]!r} are not supported by sandbox "
                f"{sandbox_id}'s backend ({rec.spec.backend or 'default'}): only the "
                "container tiers (native, runc, gvisor) run them as the user; leave user "
                "unset (root), or run a command as the user with exec", field="user")
        return {"user": user}

    async def read_file(self, sandbox_id: str, path: str, *, offset: int = 0,
                        length: int | None = None, user: str | None = None) -> bytes:
        check_read_range(offset, length)
        kw = self._as_user(sandbox_id, user)
        return await self._file_op(
            sandbox_id, "read_file",
            lambda b, s: b.read_file(s, path, offset=offset, length=length, **kw), path,
            read=True)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644,
                         append: bool = False, user: str | None = None) -> None:
        check_mode(mode)
        kw = self._as_user(sandbox_id, user)
        await self._file_op(sandbox_id, "write_file",
                            lambda b, s: b.write_file(s, path, data, mode=mode, append=append,
                                                      **kw),
                            path)

    async def list_dir(self, sandbox_id: str, path: str, *,
                       user: str | None = None) -> builtins.list[FileInfo]:
        kw = self._as_user(sandbox_id, user)
        return await self._file_op(
            sandbox_id, "list_dir", lambda b, s: b.list_dir(s, path, **kw), path, read=True)

    async def stat(self, sandbox_id: str, path: str, *, user: str | None = None) -> FileInfo:
        kw = self._as_user(sandbox_id, user)
        return await self._file_op(
            sandbox_id, "stat", lambda b, s: b.stat(s, path, **kw), path, read=True)

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True,
                    user: str | None = None) -> None:
        kw = self._as_user(sandbox_id, user)
        await self._file_op(sandbox_id, "mkdir",
                            lambda b, s: b.mkdir(s, path, parents=parents, **kw), path)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False,
                     user: str | None = None) -> None:
        kw = self._as_user(sandbox_id, user)
        await self._file_op(sandbox_id, "remove",
                            lambda b, s: b.remove(s, path, recursive=recursive, **kw), path)

    # ---------------------------------------------- streams, rename, watch (issue 19)
    async def _readable(self, rec: _Sandbox, op: str) -> None:
        """The paused-sandbox rule for reads (docs/sdk.md "Paused sandboxes"): a read
        (read, list, stat, streamed read, watch) works on a running or a paused sandbox
        without resuming it, from the host side (its files stay where they are while it
        is frozen); a pause or resume in flight is waited for first."""
        while True:
            state = rec.state
            if state in ("running", "paused"):
                return
            if state in ("pausing", "resuming") and rec.busy is not None:
                await asyncio.shield(rec.busy)
                continue
            raise InvalidTransition(
                f"sandbox {rec.id} cannot {op} while it is {state}; it must be running "
                "or paused", sandbox_id=rec.id, event=op, state=state)

    def _streams(self, rec: _Sandbox) -> FileStreamBackend:
        backend = rec.backend
        if not isinstance(backend, FileStreamBackend):
            raise InvalidArgument(f"sandbox {rec.id} runs on the {rec.spec.backend!r} "
                                  "backend, which streams no files", backend=rec.spec.backend)
        return backend

    @contextlib.asynccontextmanager
    async def _file_stream(self, sandbox_id: str, op: str, *, read: bool,
                           kind: int = 0) -> AsyncIterator[tuple[_Sandbox, FileStreamBackend]]:
        """A long file call (a transfer, a watch): ready (reads: readable) first, counted
        as activity, and ended with StreamReset when the sandbox ends (its task sits
        with the sandbox's tunnels under ``kind``: 0 transfers, -1 watches)."""
        rec = self._find(sandbox_id)
        backend = self._streams(rec)
        tenant = ""
        if kind == -1:      # reserved here, before any await (no check-then-await race)
            tenant = self._admit_watch(rec)
        try:
            async with self._file_stream_open(rec, op, read=read, kind=kind):
                yield rec, backend
        finally:
            if kind == -1:
                self._release_watch(rec.id, tenant)

    def _admit_watch(self, rec: _Sandbox) -> str:
        """Reserve one file watch of ``rec`` under the node's budgets (A6): at most
        MAX_WATCHES_PER_SANDBOX per sandbox, ``watch_budget()`` on the node and half of
        that per top-level project. Watches share one inotify instance per edge (see
        dsec.edge.filestream), but each holds kernel watches, a task and a queue, and a
        tenant must not take them all. Answers the tenant to release with."""
        open_ = self._watches_by_sandbox.get(rec.id, 0)
        if open_ >= MAX_WATCHES_PER_SANDBOX:
            raise ResourceExhausted(
                f"sandbox {rec.id} has {open_} file watches open, the limit; close one "
                "(leave its iterator) first", sandbox_id=rec.id,
                limit=MAX_WATCHES_PER_SANDBOX)
        budget = watch_budget()
        tenant = project_of(rec.spec).partition("/")[0]
        mine = self._watches_by_tenant.get(tenant, 0)
        share = max(1, budget // 2)
        if mine >= share:
            raise ResourceExhausted(
                f"project {tenant} has {mine} file watches open on node {self.node_id}, "
                f"half of the node's budget of {budget}; close some first",
                sandbox_id=rec.id, limit=share)
        total = sum(self._watches_by_tenant.values())
        if total >= budget:
            raise ResourceExhausted(
                f"node {self.node_id} has {total} file watches open, its budget "
                f"({budget}); retry later", sandbox_id=rec.id, limit=budget)
        self._watches_by_sandbox[rec.id] = open_ + 1
        self._watches_by_tenant[tenant] = mine + 1
        return tenant

    def _release_watch(self, sid: str, tenant: str) -> None:
        for table, key in ((self._watches_by_sandbox, sid), (self._watches_by_tenant, tenant)):
            n = table.get(key, 0) - 1
            if n > 0:
                table[key] = n
            else:
                table.pop(key, None)

    @contextlib.asynccontextmanager
    async def _file_stream_open(self, rec: _Sandbox, op: str, *, read: bool,
                                kind: int) -> AsyncIterator[None]:
        if read:
            await self._readable(rec, op)
        else:
            await self._ready(rec, op)
        task = asyncio.current_task()
        assert task is not None
        rec.tunnels[task] = kind
        rec.active += 1
        rec.last_active_at = self.clock.time()
        try:
            yield
        except asyncio.CancelledError:
            why = rec.cut.pop(task, None)
            if why is None:
                raise            # the caller's CANCEL, or the connection going away
            raise StreamReset(why, sandbox_id=rec.id) from None
        except DsecError:
            raise
        except Exception as exc:
            raise self._interrupted(rec, op, exc) from exc
        finally:
            rec.tunnels.pop(task, None)
            rec.cut.pop(task, None)
            rec.active -= 1
            rec.last_active_at = self.clock.time()
            if rec.spec.idle_timeout_s is not None:
                self._arm(rec)

    async def file_read_stream(self, b: ReadStream, stream: DuplexStream) -> FileInfo:
        """Send the file's bytes on ``stream`` (under the caller's credit), half-close,
        answer the file as it was opened."""
        kw = self._as_user(b.id, b.user)
        async with self._file_stream(b.id, "read", read=True) as (rec, backend):
            info = await backend.read_stream(SandboxId(rec.id), b.path, b.offset, b.length,
                                             stream.send, **kw)
            stream.close_write()
            return info

    async def file_write_stream(self, b: WriteStream, stream: DuplexStream) -> FileInfo:
        """Replace the file with the bytes the caller sends until its FIN (atomically)."""
        kw = self._as_user(b.id, b.user)
        async with self._file_stream(b.id, "write", read=False) as (rec, backend):
            return await backend.write_stream(SandboxId(rec.id), b.path, b.mode, b.size,
                                              aiter(stream), **kw)

    async def file_rename(self, b: Rename) -> FileInfo:
        check_path(b.dst, field="dst")
        kw = self._as_user(b.id, b.user)
        return await self._file_op(
            b.id, "rename",
            lambda be, s: self._streams(self._find(b.id)).rename_file(
                s, b.src, b.dst, b.overwrite, **kw), b.src)

    async def file_watch(self, b: Watch, send: Callable[[FileEvent], Awaitable[None]]
                         ) -> str:
        """Send changes below ``b.path`` until it goes away (``removed``), ``b.timeout_s``
        passes (``timeout``) or the caller ends the call; answers why it ended."""
        async with self._file_stream(b.id, "watch", read=True, kind=-1) as (rec, backend):
            try:
                async with asyncio.timeout(b.timeout_s):
                    tenant = project_of(rec.spec).partition("/")[0]
                    async for ev in backend.watch_files(SandboxId(rec.id), b.path,
                                                        b.recursive, tenant):
                        await send(ev)
            except TimeoutError:
                return "timeout"
            return "removed"

    async def stats(self, sandbox_id: str) -> SandboxStats:
        """The backend's reading, with the CPU usage over the interval since this
        sandbox's previous stats call (or over a short sample: dsec.edge.usage)."""
        rec = self._find(sandbox_id)
        try:
            st = await rec.backend.stats(SandboxId(rec.id))
            pct, dt = self._cpu.update(rec.id, time.monotonic(), st.cpu_seconds)
            if pct is None:
                await asyncio.sleep(self._cpu.sample_s)
                st = await rec.backend.stats(SandboxId(rec.id))
                pct, dt = self._cpu.update(rec.id, time.monotonic(), st.cpu_seconds)
        except Exception as exc:
            raise self._backend_error(rec, "read stats of", exc) from exc
        # the class, whichever backend answered (issue 22)
        return msgspec.structs.replace(st, cpu_percent=pct, cpu_interval_s=dt,
                                       qos=st.qos or qos_of(rec.spec),
                                       isolation=isolation_of(rec.spec) or "")

    # ================================================================ snapshots
    def _snapshotters(self) -> builtins.list[SnapshotBackend]:
        """Backends with the snapshot capability, each once (two backends may share one
        layer store, e.g. container and runc, and then report the same snapshots)."""
        seen: set[int] = set()
        out: builtins.list[SnapshotBackend] = []
        for b in self.backends.values():
            if isinstance(b, SnapshotBackend) and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
        return out

    async def snapshot(self, sandbox_id: str, *, strip: Sequence[str] = (),
                       max_bytes: int | None = None) -> SnapshotInfo:
        """pack_diff the sandbox's changes since its previous snapshot into a new one.

        Allowed while running or paused (a paused sandbox stays paused; a running one is
        frozen by the backend for a consistent cut). Records a lifecycle-neutral event
        (reason ``snapshot``, state unchanged). Unchanged since the previous snapshot:
        returns that one with ``unchanged=True``. ``max_bytes`` bounds the new layer
        (``QuotaExceeded`` over it, nothing stored)."""
        rec = self._find(sandbox_id)
        strip = _check_strip(strip)
        if max_bytes is not None and max_bytes < 0:
            raise InvalidArgument(f"snapshot max_bytes={max_bytes} must be >= 0",
                                  field="max_bytes")
        backend = rec.backend
        if not isinstance(backend, SnapshotBackend):
            raise Conflict(f"sandbox {rec.id} runs on the {backend.name} backend, which "
                           "cannot take snapshots; use the container or simulated backend",
                           sandbox_id=rec.id, backend=backend.name)
        if rec.snap_lock is None:
            rec.snap_lock = asyncio.Lock()
        async with rec.snap_lock:  # one snapshot at a time; a destroy waits for it
            while rec.state in ("pausing", "resuming") and rec.busy is not None:
                await asyncio.shield(rec.busy)
            if rec.state not in ("running", "paused"):
                raise InvalidTransition(
                    f"sandbox {rec.id} cannot snapshot while it is {rec.state}; it must be "
                    "running or paused", sandbox_id=rec.id, event="snapshot",
                    state=rec.state)
            rec.active += 1  # never idle-reaped mid-snapshot
            try:
                info = await backend.snapshot(SandboxId(rec.id), strip=strip,
                                              max_bytes=max_bytes)
            except Exception as exc:
                raise self._interrupted(rec, "snapshot", exc) from exc
            finally:
                rec.active -= 1
        info = msgspec.structs.replace(info, node=self.node_id)
        if rec.id in self._live:
            self._event(rec, rec.state, rec.state, "snapshot",
                        info.id + (" (unchanged)" if info.unchanged else ""))
        return info

    async def snapshots(self, *, project: str | None = None,
                        sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """Snapshots this node can start sandboxes from, oldest first, filtered."""
        out: dict[str, SnapshotInfo] = {}
        for b in self._snapshotters():
            try:
                infos = await b.snapshots()
            except DsecError:
                raise
            except Exception as exc:
                raise BackendError(f"backend {getattr(b, 'name', b)} failed to list "
                                   f"snapshots: {type(exc).__name__}: {exc}") from exc
            for i in infos:
                if project is not None and i.project != project:
                    continue
                if sandbox_id is not None and i.sandbox_id != sandbox_id:
                    continue
                out.setdefault(i.id, msgspec.structs.replace(i, node=self.node_id))
        # Stable on ties (a fake clock): backends list in creation order.
        return sorted(out.values(), key=lambda i: i.created)

    async def get_snapshot(self, ref: str) -> SnapshotInfo:
        """One snapshot by ref (``sha256:<hex>`` or a unique prefix); ImageNotFound."""
        return (await self._holder(ref))[1]

    async def _holder(self, ref: str) -> tuple[SnapshotBackend, SnapshotInfo]:
        check_snapshot_ref(ref)
        for b in self._snapshotters():
            try:
                info = await b.snapshot_info(ref)
            except ImageNotFound:
                continue
            return b, msgspec.structs.replace(info, node=self.node_id)
        raise ImageNotFound(f"no snapshot {ref[:80]!r} on node {self.node_id}; snapshots "
                            "live on the node that took them (see the snapshot list)",
                            ref=ref[:80])

    async def delete_snapshot(self, ref: str) -> SnapshotInfo:
        """Remove a snapshot. ``InUse`` while a live sandbox was started from it or
        another snapshot builds on it."""
        b, info = await self._holder(ref)
        users = [r.id for r in self._live.values()
                 if r.spec.snapshot is not None and _same_ref(r.spec.snapshot, info.id)]
        if users:
            raise InUse(f"snapshot {info.id} is in use by sandbox(es) {', '.join(users[:5])}"
                        f"{' ...' if len(users) > 5 else ''}; destroy them first",
                        ref=info.id, sandboxes=len(users))
        return msgspec.structs.replace(await b.delete_snapshot(info.id), node=self.node_id)

    # ================================================================ queries
    def get(self, sandbox_id: str) -> SandboxInfo:
        """Info of a live sandbox, or of a destroyed one still in the tombstone list."""
        rec = self._live.get(sandbox_id) or self._dead.get(sandbox_id)
        if rec is None:
            self._find(sandbox_id)  # raises the right error
            raise AssertionError("unreachable")
        return self._info(rec)

    def list(self, *, state: SandboxState | None = None, project: str | None = None,
             labels: Mapping[str, str] | None = None) -> builtins.list[SandboxInfo]:
        """Live sandboxes, filtered."""
        out = []
        for rec in self._live.values():
            if state is not None and rec.state != state:
                continue
            if project is not None and rec.spec.project != project:
                continue
            if labels and not labels_match(rec.spec.labels, labels):
                continue
            out.append(self._info(rec))
        return out

    def events(self, sandbox_id: str) -> builtins.list[SandboxEvent]:
        """Every recorded transition of one sandbox (bounded; the birth event is kept)."""
        rec = self._live.get(sandbox_id) or self._dead.get(sandbox_id)
        if rec is None:
            self._find(sandbox_id)
            raise AssertionError("unreachable")
        return event_structs(rec.id, rec.events)

    def feed(self, after: int = 0, limit: int = 1000) -> EventFeed:
        """Node-wide events with sequence number > ``after`` (for watchers)."""
        if limit <= 0:
            raise InvalidArgument(f"feed limit={limit} must be positive")
        limit = min(limit, MAX_FEED_EVENTS)     # what a reader's EventFeed type accepts
        feed = self._feed
        first = feed[0][0] if feed else self._seq + 1
        lost = max(0, first - after - 1) if after < first - 1 else 0
        start = max(0, after + 1 - first)
        out: builtins.list[SandboxEvent] = []
        nxt = after
        for i in range(start, min(len(feed), start + limit)):
            seq, sid, (t, f, to, r, d) = feed[i]
            out.append(SandboxEvent(time=t, sandbox_id=sid, from_state=f, to_state=to,
                                    reason=r, detail=d))
            nxt = seq
        if not out and after < first - 1:
            nxt = first - 1
        return EventFeed(events=out, next=max(nxt, after), lost=lost)

    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(rec.state for rec in self._live.values()))

    @property
    def live_count(self) -> int:
        return len(self._live)

    def images(self) -> builtins.list[str]:
        """Image refs present: from live specs plus what a backend reports (optional
        ``images_present()`` capability, e.g. a layer store)."""
        seen: set[str] = set()
        for b in self.backends.values():
            fn = getattr(b, "images_present", None)
            if callable(fn):
                seen.update(fn())
        if self.config.layer_store is not None and find_store(self.backends) is None:
            store = self._layer_store()
            if store is not None:
                seen.update(held_layers(store))
        for rec in self._live.values():
            seen.add(rec.spec.image)
        return sorted(seen)

    def _images_now(self) -> tuple[builtins.list[str], int]:
        """The images this node reports and their fingerprint, recomputed only when the
        layer store's manifests or names or the live sandboxes' images changed (a
        listdir of 10,000 manifests per heartbeat otherwise)."""
        store = self._layer_store()
        key: tuple[object, ...] = (frozenset(rec.spec.image for rec in self._live.values()),)
        racy = False
        if store is not None:
            stamps = tuple(_stamp(os.path.join(store.root, p))
                           for p in ("manifests", "layers", "refs.json"))
            key += stamps
            # A stamp is the state of a directory or file as of its last change; a
            # second change within one tick of the kernel's coarse clock leaves it
            # as it was (same mtime; a directory's size need not move either), so a
            # list taken between the two would be kept for good (red team 23b B2). As
            # git does with its index ("racily clean"): a stamp younger than a second
            # is not trusted - the list is recomputed until its inputs are older.
            now = time.time_ns()
            # (a stamp from the future - a clock stepped back - is not "young": it would
            # disable the cache until the clock caught up; red team 24 C1)
            racy = any(0 <= now - st[1] < 1_000_000_000 for st in stamps if st[0])
        cached = self._images_cache
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        images = self.images()
        gen = int.from_bytes(hashlib.blake2b("\n".join(images).encode(),
                                             digest_size=8).digest()) >> 1
        self._images_cache = None if racy else (key, images, gen)
        return images, gen

    def heartbeat(self, *, include_sandboxes: bool = True,
                  images_gen: int | None = None, list_after: str = "",
                  list_limit: int = MAX_LIST_PAGE) -> Heartbeat:
        """What the watcher/placement needs to (re)build their view of this node. The
        sandbox list is a page: ids after ``list_after`` in id order, at most
        ``list_limit`` (``list_more`` says more follow)."""
        briefs = None
        more = False
        if include_sandboxes:
            limit = max(1, min(list_limit, MAX_LIST_PAGE))
            live = self._live
            ids = heapq.nsmallest(limit + 1, (i for i in live if i > list_after))
            more = len(ids) > limit
            briefs = []
            for sid in ids[:limit]:
                r = live[sid]
                briefs.append(SandboxBrief(r.id, r.state, project_of(r.spec),
                                           r.spec.priority, r.spec.cpu_milli,
                                           r.spec.memory_bytes))
        # Warm-pool stats from backends that have a pool (optional ``pool_stats()``
        # capability, e.g. fncall); the control plane turns them into a hit-rate gauge.
        pools: dict[str, PoolStats] = {}
        for name, b in self.backends.items():
            fn = getattr(b, "pool_stats", None)
            if callable(fn):
                pools[name] = fn()
        images, gen = self._images_now()
        same = images_gen is not None and images_gen == gen
        return Heartbeat(
            node=self.node_id, time=self.clock.time(),
            capacity=self.pool.capacity.as_resources(), physical=self.pool.capacity.physical,
            usage=self.pool.usage(),
            counts=self.counts(), labels=dict(self.config.labels),
            images=[] if same else images, images_gen=gen, images_same=same,
            backends=sorted(self.backends), feed_seq=self._seq, sandboxes=briefs,
            list_more=more, pools=pools, pins_gen=self._pins_gen, lazy=self._lazy_images())

    def _lazy_images(self) -> bool:
        """[lazy3] Whether a backend's image resolver reads layers from a blob store."""
        return any(getattr(getattr(b, "images", None), "lazy", None) is not None
                   for b in self.backends.values())

    async def grant_layers(self, manifests: builtins.list[bytes]) -> builtins.list[str]:
        """``layer_grant`` (issue 17, red team 17 F1): record the layers the control plane
        says this node may read lazily, by the control plane's manifests (lowest first),
        in the backend whose image resolver reads a blob store, off the loop (each chunk
        table is fetched and checked against the manifest's record)."""
        from dsec.image.transfer import decode_manifest

        decoded = [decode_manifest(raw) for raw in manifests]
        for b in self.backends.values():
            images: Any = getattr(b, "images", None)
            if getattr(images, "lazy", None) is not None:
                got: builtins.list[str] = await asyncio.to_thread(images.grant, decoded)
                return got
        # no blob store here: only layers it holds whole are readable (nothing recorded)
        store = self._layer_store()
        held = [m.digest for m in decoded if store is not None and store.has(m.digest)
                and os.path.exists(store.layer_path(m.digest))]
        if len(held) != len(decoded):
            raise InvalidArgument(
                f"node {self.node_id} reads no layers from a blob store (start its edge "
                "with --blob-store URL); the control plane relays layers to it whole",
                field="manifests")
        return held

    async def apply_pins(self, images: builtins.list[str], gen: int) -> None:
        """``node_pins``: make the images pinned on this node exactly ``images`` (issue
        17) in every backend whose image resolver keeps pins (``apply_pins``), in a
        worker thread (resolving an image may read the blob store). ``gen`` is reported
        in the heartbeat only once every image resolved, so an unresolved one is sent
        again with the next heartbeat; sets are applied one at a time, last one wins."""
        async with self._pins_lock:
            whole = True
            for b in self.backends.values():
                fn = getattr(getattr(b, "images", None), "apply_pins", None)
                if not callable(fn):
                    continue
                change = await asyncio.to_thread(fn, list(images))
                if change.unresolved:
                    whole = False
                    log.warning("node %s: pinned images %s not resolved from the blob "
                                "store yet; the control plane sends them again",
                                self.node_id, ", ".join(change.unresolved)[:400])
            self._pins_gen = gen if whole else 0

    # ================================================================ metrics (issue 19)
    def state_counts(self) -> dict[str, int]:
        """Live sandboxes by lifecycle state (the edge's /metrics)."""
        out: dict[str, int] = {}
        for rec in self._live.values():
            out[rec.state] = out.get(rec.state, 0) + 1
        return out

    def layer_counts(self) -> tuple[int, int, int, int] | None:
        """``(layers stored, their bytes, layer puts hit, missed)`` or None without a
        layer store (the edge's /metrics; one listdir and a manifest read per layer)."""
        store = self._layer_store()
        if store is None:
            return None
        digests = store.stored_digests()
        size = 0
        for d in digests:
            with contextlib.suppress(OSError):     # pruned since the listdir
                size += os.stat(store.layer_path(d)).st_size
        return len(digests), size, self.layers.hits, self.layers.misses

    # ================================================================ reaping
    def due(self, now: float | None = None) -> builtins.list[ReapAction]:
        """Sandboxes whose TTL or idle timeout has passed at ``now`` (pure decision)."""
        now = self.clock.time() if now is None else now
        heap = self._deadlines
        out: builtins.list[ReapAction] = []
        acted: set[str] = set()
        while heap and heap[0][0] <= now:
            _, sid = heapq.heappop(heap)
            if out and out[-1].sandbox_id not in acted:
                acted.add(out[-1].sandbox_id)
            rec = self._live.get(sid)
            if rec is None or sid in acted:
                # a stale entry of the lazy heap (a pause, resume and pause again leave
                # two paused-retention deadlines): one action per sandbox per pass
                continue
            rec.deadline = None
            spec = rec.spec
            if rec.paused_until is not None and now >= rec.paused_until:
                if rec.state == "paused":
                    out.append(ReapAction(sid, "destroy", "paused_retention"))
                else:
                    self._retry_later(rec, now)
                continue
            if rec.expires_at is not None and now >= rec.expires_at:
                if rec.state == "running" and spec.ttl_action == "pause":
                    out.append(ReapAction(sid, "pause", "ttl"))
                elif rec.state in ("running", "failed"):
                    out.append(ReapAction(sid, "destroy", "ttl"))
                else:
                    self._retry_later(rec, now)
                continue
            if (spec.idle_timeout_s is not None and rec.state == "running"
                    and now >= rec.last_active_at + spec.idle_timeout_s):
                if rec.active:  # a command is still running: not idle, look again later
                    self._retry_later(rec, now)
                else:
                    out.append(ReapAction(sid, spec.idle_action,
                                          "idle" if spec.idle_action == "pause"
                                          else "idle_timeout"))
                continue
            if rec.state in ("creating", "pausing", "resuming", "destroying"):
                self._retry_later(rec, now)
            else:
                self._arm(rec)  # activity moved the deadline: queue the new one
        return out

    def _retry_later(self, rec: _Sandbox, now: float) -> None:
        rec.deadline = now + self.config.reap_interval_s
        heapq.heappush(self._deadlines, (rec.deadline, rec.id))

    async def reap(self, now: float | None = None) -> builtins.list[ReapAction]:
        """Carry out :meth:`due`; returns what was done."""
        actions = self.due(now)
        coros: builtins.list[Coroutine[Any, Any, object]] = []
        for a in actions:
            if a.action == "pause":
                coros.append(self.pause(a.sandbox_id, reason=a.reason))
            else:
                coros.append(self.destroy(a.sandbox_id, reason=a.reason))
        for a, r in zip(actions, await gather_eager(coros)):
            if isinstance(r, BaseException):
                log.warning("reaper could not %s %s (%s): %s", a.action, a.sandbox_id,
                            a.reason, r)
        return actions


def _check_strip(strip: Sequence[str]) -> tuple[str, ...]:
    """Snapshot strip patterns: a few short, printable glob patterns (the wire's rule,
    :func:`dsec.wire.spec.check_strip`, for in-process callers too)."""
    if isinstance(strip, str):
        raise InvalidArgument("snapshot strip must be a list of patterns, not one string",
                              field="strip")
    out = tuple(strip)
    check_strip(out)
    return out


def _same_ref(ref: str, full_id: str) -> bool:
    return ref == full_id or (ref.startswith("sha256:") and len(ref) >= 19
                              and full_id.startswith(ref))


def _as_error(exc: BaseException) -> DsecError:
    if isinstance(exc, DsecError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    return DsecError(f"{type(exc).__name__}: {exc}")


def _consume_result(t: asyncio.Task[Any]) -> None:
    """A task run to its end for a caller that was cancelled: its failure was the
    caller's to see; logged instead of "exception was never retrieved"."""
    if not t.cancelled() and (exc := t.exception()) is not None:
        log.debug("operation finished after its caller left: %r", exc)


def _stamp(path: str) -> tuple[int, int, int]:
    """What changes when a file is replaced or a directory's entries change: inode,
    mtime in ns, size ((0, 0, 0): absent). Not the mtime alone: timestamps are taken
    from the kernel's coarse clock (one tick, 4 ms here), and a name moved within the
    tick of the previous write left refs.json's mtime as it was - the heartbeat then
    said "images unchanged" (the suite caught it after the store's write path changed).
    ``refs.json`` is replaced by rename on every write: a new inode."""
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_mtime_ns, st.st_size)
