"""A sandbox's process table (issue 19): background processes another client can find,
read, feed and signal.

``process_start`` runs a command the way ``exec`` does, but answers at once with the
process's :class:`~dsec.wire.process.ProcessInfo`; the edge keeps it in the sandbox's
table. Its output goes into a **ring** (the newest ``ring_bytes``; older bytes fall off
the front and are counted in ``output_dropped``), kept after the exit until the entry is
evicted, so ``process_connect`` from any client, at any time, replays the ring and then
follows the live output until the exit, which ends the stream with an
:class:`~dsec.wire.spec.ExecResult`. ``process_input`` writes to its stdin (a pipe kept
open with ``ExecRequest.stdin_open``, or the terminal of a ``pty`` process);
``process_signal`` signals its process group; ``pty_resize`` sets its terminal's size.

What a hostile sandbox or tenant cannot do with it (each bound is a :class:`ProcessLimits`
field, checked before anything is started):

- hold more than ``per_sandbox`` entries per sandbox: a start evicts the oldest *ended*
  entry, and is refused (``RateLimited``) when every entry still runs;
- hold more ring memory than ``ring_budget`` on the node, or more than its **fair share**
  of it while other tenants (top-level projects) need room: each entry reserves its ring's
  full size (``ring_bytes``) *before* anything awaits (concurrent starts cannot all pass
  one check), released on every failure path. A start that does not fit first evicts the
  starting tenant's own ended entries (oldest first); then, while the starting tenant
  stays within its share (the budget divided among the tenants holding rings, itself
  included), it takes room from the tenant furthest over its share: that tenant's ended
  entries first, then its running processes' rings are shrunk (the oldest output falls
  off, counted in ``output_dropped``) down to a quarter of ``ring_bytes``. Otherwise it
  is refused (``CapacityExceeded``). So one tenant may use the whole budget while nobody
  else needs it, but cannot refuse another tenant's start or evict another tenant's ended
  output while that tenant is within its share (red team 19, A4/A5);
- take the node's descriptors: a running process is one of the node's commands, admitted
  and counted by the same caps as ``exec`` (``NodeConfig.max_execs*``: per sandbox, per
  tenant, per node), and released at its exit;
- make the edge buffer without bound: input waits for the pipe to drain past
  ``input_pending`` bytes (the caller's ``process_input`` waits, then fails with
  ``ResourceExhausted`` after ``input_wait_s``); input in flight (a write waiting for
  its pipe, or input a backend without processes collects until stdin closes) is counted
  node-wide against ``input_budget``, a tenant at most half of it (``ResourceExhausted``
  beyond); a ``process_connect`` reader that falls ``follower_backlog`` bytes behind the
  live output is cut off with ``ResourceExhausted`` (it may connect again: the ring holds
  the newest output), and when every reader of the node together holds more than
  ``backlog_budget``, the furthest-behind reader *of the tenant holding the most* is cut.

Processes die with their sandbox (their table goes with it, :meth:`ProcessTable.drop`),
freeze with it (a paused sandbox's processes are frozen in its cgroup; input and signals
wait in the kernel until it resumes).

They outlive their edge (an edge with a state directory, container backend's native
runtime): before ``process_start`` answers, the entry is journaled and copies of its
pipe ends (or terminal master) are handed to a keeper process that is not the edge
(:mod:`dsec.edge.fdstore`), so an edge kill -9 neither kills the process (no SIGPIPE, no
stdin EOF, no SIGHUP) nor loses its output written meanwhile (it waits in the pipe). The
restarted edge takes each one back (:meth:`ProcessTable.restore`): ``process_list``
shows it, ``process_connect`` follows its output from where the dead edge stopped
reading (the ring the dead edge held is lost), input, signals and resize work. Its end
is reported with its exit status: the keeper started the exec helper and is a child
subreaper, so it reaps the helper's orphans and keeps their status (during the downtime
too); when that chain was broken, with ``exit_code`` -1 and "exit status was lost in the
edge restart" on stderr. A process whose descriptors were lost too (the keeper was
killed) is killed at the restart, its end saying why. A keeper that is there but does
not answer (slow, stuck) is not "descriptors lost": its processes are left running,
untracked, and taken back once it answers (red team 22, B1). The keeper bounds what it
holds (its descriptor limit): past that, ``process_start`` is refused
(``CapacityExceeded``), and a process whose descriptors it stops holding (a refused
re-deposit) is told on its stderr that it will not survive an edge restart. Entries that
had ended before the restart are listed ended with their exit status (their output is
gone) until evicted.
Cost: ~60 us per process (start + end) on the dev VM (journal
write ~4 us, the pid's start time ~27 us, two sends to the keeper ~27 us), plus the
keeper's confirmation of the put (a round trip: ~0.25 ms on a busy 2-core box, 2026-12-02).

Backends: the container backend's native runtime spawns the process itself
(``ContainerBackend.spawn_process``: pipes or a pty inside the sandbox, signals to the
process group). Any other backend runs it through its ``exec_stream`` (:class:`StreamedIO`):
no terminal, only SIGKILL-like signals (the exec is cancelled), and stdin, when kept open,
is collected and handed to the command when it is closed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import signal as _signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import msgspec

from dsec.edge.fdstore import DurableProcess, FdStore, KeeperUnreachable, ProcessJournal
from dsec.errors import (
    CapacityExceeded,
    DsecError,
    InvalidArgument,
    InvalidTransition,
    NotFound,
    RateLimited,
    ResourceExhausted,
)
from dsec.ids import SandboxId
from dsec.wire.process import ProcessInfo
from dsec.wire.spec import (
    MAX_STDIN_BYTES,
    ExecChunk,
    ExecRequest,
    ExecResult,
    SandboxSpec,
    project_of,
)

if TYPE_CHECKING:
    from dsec.edge.backend import Backend
    from dsec.edge.clock import Clock

__all__ = [
    "ExitStatus",
    "ProcessHost",
    "ProcessIO",
    "ProcessLimits",
    "ProcessTable",
    "SandboxRecord",
    "StreamedIO",
]

log = logging.getLogger(__name__)

StreamName = Literal["stdout", "stderr"]
OutputSink = Callable[[StreamName, bytes], None]


@dataclass(frozen=True, slots=True)
class ProcessLimits:
    """What one edge's process tables may hold (module docstring)."""

    per_sandbox: int = 32                 # table entries per sandbox, running or ended
    ring_bytes: int = 1 << 20             # output kept per process (both streams)
    ring_budget: int = 256 << 20          # all rings of the node together
    input_pending: int = 1 << 20          # stdin bytes the edge holds for one process
    input_wait_s: float = 30.0            # a write waits this long for the pipe to drain
    follower_backlog: int = 8 << 20       # live output a connect may fall behind by
    followers: int = 16                   # connects following one process at once
    backlog_budget: int = 64 << 20        # all connects of the node, furthest behind cut
    keep_ended_s: float = 3600.0          # an ended entry is kept at most this long
    input_budget: int = 64 << 20          # stdin in flight on the node (a tenant: half)

    def __post_init__(self) -> None:
        for name in ("per_sandbox", "ring_bytes", "ring_budget", "input_pending",
                     "follower_backlog", "followers", "backlog_budget", "input_budget"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"process limit {name} must be >= 1")


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a process ended: ``exit_code`` (128+N for signal N), the signal, timed out."""

    exit_code: int
    signal: int | None = None
    timed_out: bool = False


def exit_status(raw: int) -> ExitStatus:
    """A raw wait status as the table reports it (128+N for signal N)."""
    sig = os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else None
    code = os.waitstatus_to_exitcode(raw)
    return ExitStatus(128 - code if code < 0 else code, signal=sig)


class ProcessIO(Protocol):
    """A running process as its backend drives it."""

    pid: int

    async def write(self, data: bytes) -> None:
        """Queue ``data`` for its stdin/terminal (waits while too much is pending)."""

    def close_stdin(self) -> None: ...

    def signal(self, sig: int) -> None:
        """``sig`` to its process group (no-op once it ended)."""

    def resize(self, cols: int, rows: int) -> None: ...

    async def wait(self) -> ExitStatus:
        """Its end; its output has all been handed to the sink before this returns."""

    def abandon(self) -> None:
        """Its sandbox is gone: drop every descriptor held for it."""


# What the table needs of its node and of a sandbox's record, as Protocols: the node
# (dsec.edge.node) builds the table, so importing it back (even for annotations) would be
# a cycle.
class SandboxRecord(Protocol):
    """A sandbox's live record on the node (``dsec.edge.node._Sandbox``)."""

    @property
    def id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def spec(self) -> SandboxSpec: ...

    last_active_at: float    # the table marks the sandbox active when a process starts/ends


R = TypeVar("R", bound=SandboxRecord)


class ProcessHost(Protocol[R]):
    """The edge node (``dsec.edge.node.EdgeNode``), as the table uses it: find a sandbox's
    record (its own errors: gone, another node's), make it running, and admit and
    release a command under the node's exec caps."""

    @property
    def node_id(self) -> str: ...
    @property
    def clock(self) -> Clock: ...

    def _find(self, sid: str) -> R: ...
    def _check_hide(self, rec: R) -> None: ...
    async def _ready(self, rec: R, op: str) -> None: ...
    def _admit_exec(self, rec: R) -> None: ...
    def _exec_ended(self, rec: R) -> None: ...


_NO_STDIN = "stdin of process {pid} in sandbox {sid} is not open: start it with " \
            "stdin_open=True (or a pty) to write to it"


class StreamedIO:
    """A process on a backend without its own process support, run through
    ``backend.exec_stream``: output streams as it comes; signals cancel the exec (which
    kills its process group); with ``stdin_open`` the input is collected (at most
    ``MAX_STDIN_BYTES``) and the command starts when stdin is closed."""

    def __init__(self, backend: Any, sid: str, req: ExecRequest, pid: int,
                 sink: OutputSink) -> None:
        # The simulated backend emulates a terminal as it emulates everything (output as
        # it comes, the size kept); a real backend without terminals refuses a pty.
        if req.pty is not None and getattr(backend, "name", "") != "simulated":
            raise InvalidArgument(
                f"sandbox {sid}'s backend has no terminals: a pty process needs the "
                "container backend's native runtime", field="pty", sandbox_id=sid)
        self.size = (req.pty.cols, req.pty.rows) if req.pty is not None else None
        self.pid, self._sid, self._backend, self._sink = pid, sid, backend, sink
        self._req = req
        self._input: bytearray | None = bytearray(req.stdin) if req.stdin_open else None
        self._go = asyncio.Event()
        self._killed: int | None = None
        if self._input is None:
            self._go.set()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> ExitStatus:
        await self._go.wait()
        req = self._req
        if self._input is not None:
            req = msgspec.structs.replace(req, stdin=bytes(self._input))
        req = msgspec.structs.replace(req, stdin_open=False, pty=None)
        async for item in self._backend.exec_stream(SandboxId(self._sid), req):
            if isinstance(item, ExecResult):
                return ExitStatus(item.exit_code, timed_out=item.timed_out)
            self._sink(item.stream, item.data)
        return ExitStatus(-1)

    async def write(self, data: bytes) -> None:
        if self._input is None or self._go.is_set():
            raise InvalidTransition(_NO_STDIN.format(pid=self.pid, sid=self._sid),
                                    sandbox_id=self._sid, pid=self.pid)
        if len(self._input) + len(data) > MAX_STDIN_BYTES:
            raise ResourceExhausted(
                f"process {self.pid} in sandbox {self._sid} holds {len(self._input)} bytes "
                f"of input for a backend that delivers stdin when it is closed; at most "
                f"{MAX_STDIN_BYTES} bytes", sandbox_id=self._sid, limit=MAX_STDIN_BYTES)
        self._input += data

    def close_stdin(self) -> None:
        self._go.set()

    def signal(self, sig: int) -> None:
        if not self._task.done():
            self._killed = sig
            self._task.cancel()

    def resize(self, cols: int, rows: int) -> None:
        if self.size is None:
            raise InvalidArgument(f"process {self.pid} in sandbox {self._sid} has no "
                                  "terminal", field="pid", sandbox_id=self._sid)
        self.size = (cols, rows)

    async def wait(self) -> ExitStatus:
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if self._killed is None or not self._task.cancelled():
                raise
            return ExitStatus(128 + self._killed, signal=self._killed)

    def abandon(self) -> None:
        self.signal(_signal.SIGKILL)


class _Follower:
    """One ``process_connect`` reading live output: a queue bounded by bytes."""

    __slots__ = ("backlog", "cut", "queue", "tenant", "wake")

    def __init__(self, tenant: str = "") -> None:
        self.queue: collections.deque[ExecChunk] = collections.deque()
        self.backlog = 0
        self.cut = False
        self.tenant = tenant
        self.wake = asyncio.Event()


class _Backlog:
    """What every follower of the node holds, together: over the budget, the one
    furthest behind *of the tenant holding the most* is cut (as Aether cuts the stream
    furthest behind): one tenant's many slow readers cannot get another tenant's reader
    cut."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.total = 0
        self.followers: set[_Follower] = set()

    def add(self, f: _Follower, n: int) -> None:
        self.total += n
        while self.total > self.budget:
            held: dict[str, int] = {}
            for x in self.followers:
                if not x.cut:
                    held[x.tenant] = held.get(x.tenant, 0) + x.backlog
            if not held:
                return
            top = max(held, key=held.__getitem__)
            worst = max((x for x in self.followers if not x.cut and x.tenant == top),
                        key=lambda x: x.backlog)
            self.cut(worst)

    def cut(self, f: _Follower) -> None:
        f.cut = True
        f.queue.clear()        # its memory goes now; the reader hears at once
        f.wake.set()
        if f in self.followers:
            self.total -= f.backlog

    def taken(self, f: _Follower, n: int) -> None:
        if not f.cut and f in self.followers:
            self.total -= n

    def leave(self, f: _Follower) -> None:
        if f in self.followers:
            if not f.cut:
                self.total -= f.backlog
            self.followers.discard(f)


def _oom_kills(rec: Any) -> int | None:
    """The OOM kills in ``rec``'s sandbox so far, or None where its backend cannot say."""
    count = getattr(rec.backend, "oom_kills_of", None)
    if count is None:
        return None
    try:
        got = count(SandboxId(rec.id))
    except (DsecError, OSError):
        return None
    return got if isinstance(got, int) else None


class _Process:
    """One entry of a sandbox's table."""

    def __init__(self, info: ProcessInfo, ring_cap: int, tenant: str = "") -> None:
        self.info = info
        self.tenant = tenant
        self.ring: collections.deque[ExecChunk] = collections.deque()
        self.ring_size = 0
        self.ring_cap = ring_cap
        self.input_held = 0      # input_budget bytes charged until the process ends
        self.followers: set[_Follower] = set()
        self.io: ProcessIO | None = None
        self.result: ExecResult | None = None
        self.done = asyncio.Event()
        self.t0 = time.monotonic()
        self.ended_mono: float | None = None
        self.durable: DurableProcess | None = None   # journaled (running or ended)
        self.kept = False                            # its descriptors are with the keeper
        self.oom_before: int | None = None           # the sandbox's OOM kills at its start
        self.killed_by_caller = False                # process_signal sent it SIGKILL

    def take(self, stream: StreamName, data: bytes, backlog_cap: int,
             backlog: _Backlog | None = None) -> None:
        if not data:
            return
        chunk = ExecChunk(stream=stream, data=data)
        for f in self.followers:
            if f.cut:
                continue
            f.queue.append(chunk)
            f.backlog += len(data)
            if backlog is not None:
                backlog.add(f, len(data))
            if not f.cut and f.backlog > backlog_cap:
                if backlog is not None:
                    backlog.cut(f)
                else:
                    f.cut = True
                    f.queue.clear()    # its memory goes now; the reader hears at once
            f.wake.set()
        if len(data) >= self.ring_cap:  # one read larger than the ring: keep its tail
            dropped = self.ring_size + len(data) - self.ring_cap
            self.ring.clear()
            chunk = ExecChunk(stream=stream, data=data[-self.ring_cap:])
            self.ring.append(chunk)
            self.ring_size = self.ring_cap
            self.info.output_dropped += dropped
            return
        self.ring.append(chunk)
        self.ring_size += len(data)
        self._trim()

    def shrink(self, cap: int) -> None:
        """Keep only the newest ``cap`` bytes from now on (another tenant needs room)."""
        self.ring_cap = cap
        self._trim()

    def _trim(self) -> None:
        while self.ring_size > self.ring_cap:
            head = self.ring[0]
            over = self.ring_size - self.ring_cap
            if len(head.data) <= over:
                self.ring.popleft()
                self.ring_size -= len(head.data)
                self.info.output_dropped += len(head.data)
            else:
                self.ring[0] = ExecChunk(stream=head.stream, data=head.data[over:])
                self.ring_size -= over
                self.info.output_dropped += over

    def end(self, result: ExecResult, status: ExitStatus, now: float) -> None:
        info = self.info
        info.running = False
        info.stdin_open = False
        info.exit_code = status.exit_code
        info.signal = status.signal
        info.ended_at = now
        self.result = result
        self.ended_mono = time.monotonic()
        self.done.set()
        for f in self.followers:
            f.wake.set()


class ProcessTable(Generic[R]):
    """Every sandbox's process table on one edge node (module docstring)."""

    def __init__(self, node: ProcessHost[R], limits: ProcessLimits | None = None, *,
                 state_dir: str | None = None, keeper_orphan_s: float = 600.0) -> None:
        """``state_dir``: where entries are journaled and the descriptor keeper's socket
        lives, so processes outlive the edge (module docstring); None: memory only."""
        self.node = node
        self.limits = limits or ProcessLimits()
        self._tables: dict[str, collections.OrderedDict[int, _Process]] = {}
        self._reserved = 0          # ring bytes reserved by every entry on the node
        self._by_tenant: dict[str, int] = {}   # ... by top-level project
        self._starting: dict[str, int] = {}    # starts past their check, by sandbox
        self._input = 0                        # input_budget bytes in flight
        self._input_by_tenant: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._fake_pids = itertools.count(1000)
        self._backlog = _Backlog(self.limits.backlog_budget)
        self._closing = False
        self._journal: ProcessJournal | None = None
        self._store: FdStore | None = None
        if state_dir is not None:
            self._journal = ProcessJournal(state_dir)
            self._store = FdStore(state_dir, orphan_s=keeper_orphan_s)
            self._store.on_reconnect = self._redeposit_all

    # ------------------------------------------------------------------ bookkeeping
    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def count(self, sid: str | None = None) -> int:
        if sid is not None:
            return len(self._tables.get(sid, ()))
        return sum(len(t) for t in self._tables.values())

    @staticmethod
    def _tenant(rec: SandboxRecord) -> str:
        """The top-level project: the unit of every share (as ``_admit_exec`` counts)."""
        return project_of(rec.spec).partition("/")[0]

    def _reserve(self, tenant: str, n: int) -> None:
        self._reserved += n
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + n

    def _release(self, tenant: str, n: int) -> None:
        self._reserved -= n
        left = self._by_tenant.get(tenant, 0) - n
        if left > 0:
            self._by_tenant[tenant] = left
        else:
            self._by_tenant.pop(tenant, None)

    def _evict(self, sid: str, pid: int) -> None:
        table = self._tables.get(sid)
        if table is None:
            return
        p = table.pop(pid, None)
        if p is not None:
            self._release(p.tenant, p.ring_cap)
            if p.durable is not None and self._journal is not None:
                with contextlib.suppress(DsecError):
                    self._journal.end(sid, pid)
            if p.kept and self._store is not None:
                self._store.drop(p.durable.key if p.durable else "")
                p.kept = False
        if not table:
            self._tables.pop(sid, None)

    def _oldest_ended(self, tenant: str) -> tuple[str, int] | None:
        oldest: tuple[float, str, int] | None = None
        for s, t in self._tables.items():
            for pid, p in t.items():
                if (p.tenant == tenant and p.ended_mono is not None
                        and (oldest is None or p.ended_mono < oldest[0])):
                    oldest = (p.ended_mono, s, pid)
        return None if oldest is None else (oldest[1], oldest[2])

    def _expire(self) -> None:
        keep = self.limits.keep_ended_s
        now = time.monotonic()
        for sid, table in list(self._tables.items()):
            for pid, p in list(table.items()):
                if p.ended_mono is not None and now - p.ended_mono > keep:
                    self._evict(sid, pid)

    def _make_room(self, sid: str, tenant: str) -> None:
        """Evict/shrink until one more entry fits, or refuse with the bound (module
        docstring). Synchronous: the caller reserves before its first await."""
        lim = self.limits
        self._expire()
        table = self._tables.get(sid)
        held = (len(table) if table is not None else 0) + self._starting.get(sid, 0)
        if held >= lim.per_sandbox:
            ended = [pid for pid, p in (table or {}).items() if p.ended_mono is not None]
            if not ended:
                raise RateLimited(
                    f"sandbox {sid} already runs {held} processes started with "
                    f"process_start, the per-sandbox limit; kill some or wait for them "
                    "to exit", sandbox_id=sid, limit=lim.per_sandbox, retry_after=1.0)
            self._evict(sid, ended[0])
        need = lim.ring_bytes
        floor = max(1, lim.ring_bytes // 4)
        while self._reserved + need > lim.ring_budget:
            mine = self._oldest_ended(tenant)
            if mine is not None:
                self._evict(*mine)
                continue
            tenants = set(self._by_tenant) | {tenant}
            share = lim.ring_budget // len(tenants)
            have = self._by_tenant.get(tenant, 0)
            over = {t: n - share for t, n in self._by_tenant.items()
                    if t != tenant and n > share}
            if have + need <= share and over and self._reclaim(
                    max(over, key=over.__getitem__), over,
                    self._reserved + need - lim.ring_budget, floor):
                continue
            raise CapacityExceeded(
                f"node {self.node_id} keeps output rings of {self._reserved} bytes, its "
                f"budget of {lim.ring_budget} ({lim.ring_bytes} per process); project "
                f"{tenant} holds {have} of them (its share while {len(tenants)} projects "
                f"hold rings: {share}); retry when some of its processes have ended",
                sandbox_id=sid, limit=lim.ring_budget, retry_after=1.0)

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def _reclaim(self, victim: str, over: dict[str, int], want: int, floor: int) -> bool:
        """Take up to ``want`` ring bytes (at most its excess) from tenant ``victim``:
        its oldest ended entry, else its largest running ring shrunk toward ``floor``."""
        ended = self._oldest_ended(victim)
        if ended is not None:
            self._evict(*ended)
            return True
        biggest: _Process | None = None
        for t in self._tables.values():
            for p in t.values():
                if p.tenant == victim and p.ring_cap > floor and (
                        biggest is None or p.ring_cap > biggest.ring_cap):
                    biggest = p
        if biggest is None:
            return False
        cut = min(biggest.ring_cap - floor, want, over[victim])
        biggest.shrink(biggest.ring_cap - cut)
        self._release(victim, cut)
        return True

    def _get(self, sid: str, pid: int) -> _Process:
        self.node._find(sid)  # the sandbox's own error first (gone, another node's)
        table = self._tables.get(sid)
        p = table.get(pid) if table is not None else None
        if p is None:
            raise NotFound(f"sandbox {sid} has no process {pid} started with process_start "
                           "(ended ones are kept until evicted; see process_list)",
                           sandbox_id=sid, pid=pid)
        return p

    # ------------------------------------------------------------------ operations
    async def start(self, sid: str, req: ExecRequest, *,
                    confirm: bool = True) -> ProcessInfo:
        """``confirm``: wait for the keeper to confirm it holds the process's descriptors
        before answering (a refusal kills the process and raises). :meth:`run` does not:
        they are sent before its answer (in flight they are the keeper's already) and a
        refusal arriving later is said in the process's output, as a keeper lost later
        is (:meth:`_not_durable`)."""
        node = self.node
        rec = node._find(sid)
        if req.hide:
            node._check_hide(rec)
        if req.background:
            raise InvalidArgument("process_start runs every process in the background; "
                                  "leave background unset", field="background")
        if rec.state != "running":
            await node._ready(rec, "process_start")
        tenant = self._tenant(rec)
        # Check and reserve with no await between (red team 19, A5): the ring bytes and
        # the table slot are held from here, released on every failure path below.
        self._make_room(sid, tenant)
        node._admit_exec(rec)
        admitted = True
        lim = self.limits
        info = ProcessInfo(pid=0, cmd=list(req.argv) if req.argv else (req.shell or ""),
                           cwd=req.cwd, tag=req.tag, pty=req.pty is not None,
                           started_at=node.clock.time(), running=True,
                           stdin_open=req.stdin_open or req.pty is not None)
        proc = _Process(info, lim.ring_bytes, tenant)
        self._reserve(tenant, proc.ring_cap)
        self._starting[sid] = self._starting.get(sid, 0) + 1

        backlog = self._backlog

        def sink(stream: StreamName, data: bytes) -> None:
            proc.take(stream, data, lim.follower_backlog, backlog)

        proc.oom_before = _oom_kills(rec)
        try:
            io = await self._spawn(rec, req, sink)
        except BaseException:
            node._exec_ended(rec)
            self._release(tenant, proc.ring_cap)
            raise
        finally:
            left = self._starting.get(sid, 0) - 1
            if left > 0:
                self._starting[sid] = left
            else:
                self._starting.pop(sid, None)
        proc.io = io
        info.pid = io.pid
        try:
            gone = node._find(sid) is not rec
        except DsecError:
            gone = True
        if gone:
            # the sandbox ended during the spawn: drop() ran without this entry, which
            # would otherwise hold its ring (and the process) forever
            with contextlib.suppress(Exception):
                io.abandon()
            node._exec_ended(rec)
            self._release(tenant, proc.ring_cap)
            node._find(sid)   # the sandbox's own error (ended, with its reason)
            raise InvalidTransition(f"sandbox {sid} ended while process_start ran",
                                    sandbox_id=sid)
        table = self._tables.setdefault(sid, collections.OrderedDict())
        old = table.pop(io.pid, None)   # a reused pid: the ended entry goes
        if old is not None:
            self._release(old.tenant, old.ring_cap)
        table[io.pid] = proc
        rec.last_active_at = node.clock.time()
        task = asyncio.ensure_future(self._watch(rec, proc, io, admitted))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        confirmed = None
        try:
            confirmed = self._persist(sid, proc, io, req)    # durable before acknowledged
            if confirmed is not None and confirm:
                await confirmed()
        except BaseException:
            # not durable: it would die with this edge unseen; end it now, say why. A
            # cancel while awaiting the keeper (the client gave up) ends it too: never
            # answered, it is nobody's, and its confirmation would go unchecked (red
            # team 23, B3)
            with contextlib.suppress(Exception):
                proc.killed_by_caller = True
                io.signal(_signal.SIGKILL)
            raise
        if confirmed is not None and not confirm:
            self._confirm_in_background(proc, confirmed)
        return msgspec.structs.replace(info)

    async def _confirm_later(self, proc: _Process,
                             confirmed: Callable[[], Awaitable[None]]) -> None:
        try:
            await confirmed()
        except DsecError as exc:
            self._not_durable(proc, exc)

    # ------------------------------------------------------------------ durability
    @property
    def helper_spawner(self) -> Callable[[list[str], str, list[int]], Any] | None:
        """What starts a backend's exec helper as the keeper's child (None: no state
        dir, processes are not durable)."""
        return self._store.spawn if self._store is not None else None

    def _persist(self, sid: str, proc: _Process, io: ProcessIO, req: ExecRequest
                 ) -> Callable[[], Awaitable[None]] | None:
        """Journal the entry and send its descriptors to the keeper (dsec.edge.fdstore);
        returns what awaits the keeper's confirmation (None: nothing to confirm). A
        backend without its own processes (StreamedIO) is not durable."""
        journal, store = self._journal, self._store
        held = getattr(io, "held_fds", None)
        if journal is None or store is None or held is None:
            return None
        host_pid, host_start, ec_dir = io.identity()  # type: ignore[attr-defined]
        info = proc.info
        dp = DurableProcess(
            sid=sid, pid=io.pid, host_pid=host_pid, host_start=host_start,
            exec_cgroup=ec_dir, info=info, tenant=proc.tenant, ring_cap=proc.ring_cap,
            deadline=None if req.timeout_s is None else info.started_at + req.timeout_s,
            pty=(req.pty.cols, req.pty.rows) if req.pty is not None else None,
            oom_before=proc.oom_before)
        journal.put(dp)
        proc.durable = dp
        confirmed = store.put_async(dp.key, held())
        proc.kept = True
        io.fds_changed = lambda: self._redeposit(proc)  # type: ignore[attr-defined]
        return confirmed

    def _redeposit(self, proc: _Process) -> None:
        """Its descriptors changed (terminal master arrived, stdin closed): the keeper's
        copies follow (a copy of a closed stdin would keep the process from EOF)."""
        dp, io = proc.durable, proc.io
        if dp is None or io is None or proc.result is not None or self._store is None:
            return
        try:
            if self._journal is not None:
                self._journal.put(dp)   # stdin_open may have changed
            confirmed = self._store.put_async(dp.key, io.held_fds())  # type: ignore[attr-defined]
            proc.kept = True
        except DsecError as exc:
            self._not_durable(proc, exc)
            return
        self._confirm_in_background(proc, confirmed)

    def _confirm_in_background(self, proc: _Process,
                               confirmed: Callable[[], Awaitable[None]]) -> None:
        """Await the keeper's confirmation off the caller's path (never by blocking
        the loop: a stopped keeper would hold every request of the edge)."""
        task = asyncio.ensure_future(self._confirm_later(proc, confirmed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _not_durable(self, proc: _Process, exc: DsecError) -> None:
        """The keeper does not hold its descriptors (any more): it runs on, but an edge
        restart would kill it - say so, where its client reads (red team 22, B1)."""
        dp = proc.durable
        if dp is None or not proc.kept:
            return
        proc.kept = False
        log.warning("process %d in sandbox %s is no longer durable: %s", dp.pid, dp.sid,
                    exc)
        proc.take("stderr", f"dsec: process {dp.pid} will not survive an edge restart: "
                  f"{exc}\n".encode(), self.limits.follower_backlog)

    def _redeposit_all(self) -> None:
        """A new keeper (the last one died while this edge lived): hand it everything,
        one put at a time, each confirmed before the next (a burst of thousands would
        fill the keeper's queue, and its answers ours, while this loop could not read
        them: red team 23, B1)."""
        procs = [p for table in self._tables.values() for p in table.values()
                 if p.durable is not None and p.result is None and p.io is not None]
        if not procs:
            return
        task = asyncio.ensure_future(self._redeposit_each(procs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _redeposit_each(self, procs: list[_Process]) -> None:
        for p in procs:
            if p.result is not None or p.io is None or p.durable is None \
                    or self._store is None:
                continue                 # it ended meanwhile
            p.kept = True                # a failure below is said in its output
            try:
                confirmed = self._store.put_async(
                    p.durable.key, p.io.held_fds())  # type: ignore[attr-defined]
                await confirmed()
            except DsecError as exc:
                self._not_durable(p, exc)

    def _forget(self, proc: _Process) -> None:
        """It ended with this edge watching: its end is journaled (a restart lists it
        ended, with its exit status, until it is evicted); its descriptors go."""
        if self._closing:
            return        # the edge stops, the process does not: the next edge takes it
        dp = proc.durable
        if dp is None:
            return
        if self._journal is not None:
            with contextlib.suppress(DsecError):
                self._journal.put(dp)       # info now says how it ended
        if proc.kept and self._store is not None:
            self._store.drop(dp.key)
        proc.kept = False

    async def restore(self) -> None:
        """At edge start: take back the processes a previous edge of this state dir left
        running (module docstring); drop what belongs to sandboxes no longer live."""
        journal, store = self._journal, self._store
        if journal is None or store is None:
            return
        try:
            entries = journal.load()
        except DsecError as exc:
            # an unreadable journal must not keep the edge from starting (red team 22,
            # B6): its processes run on unlisted, as without a state dir
            log.error("process journal not read, no background process taken back: %s", exc)
            entries = {}
        held: set[str] | None = set()
        if entries or os.path.exists(store.path):
            held = await self._held_keys(store, (5.0,))
        later: list[DurableProcess] = []
        for (sid, _pid), dp in entries.items():
            rec = self._live(sid)
            if rec is None:
                with contextlib.suppress(DsecError):   # a full disk: compaction drops it
                    journal.end(dp.sid, dp.pid)
                store.drop(dp.key)
                continue
            if not dp.info.running:
                self._restore_ended(rec, dp)     # its key, if held, is dropped below
                continue
            if held is None or not await self._take_back(rec, dp, held):
                held = None
                later.append(dp)
        if held is not None:
            for key in held:
                store.drop(key)
        if later:
            log.error("the descriptor keeper at %s does not answer: %d background "
                      "processes are left running, untracked, until it does (asked again "
                      "in the background; not killed: what it holds is unknown)",
                      store.path, len(later))
            task = asyncio.ensure_future(self._restore_later(later))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _live(self, sid: str) -> R | None:
        try:
            rec = self.node._find(sid)
        except DsecError:
            return None
        return rec if rec.state in ("running", "paused") else None

    @staticmethod
    async def _held_keys(store: FdStore, waits: tuple[float, ...]) -> set[str] | None:
        """The keys the keeper holds (empty: no keeper runs); None: one is there but did
        not answer within any of ``waits`` (seconds) - not "nothing held"."""
        for wait_s in waits:
            try:
                return set(await asyncio.to_thread(store.keys, timeout_s=wait_s) or ())
            except KeeperUnreachable as exc:
                log.warning("%s", exc)
        return None

    async def _take_back(self, rec: R, dp: DurableProcess, held: set[str]) -> bool:
        """Adopt one running entry with its descriptors (killed if the keeper holds none);
        False if the keeper did not answer (left alone: not known lost)."""
        journal, store = self._journal, self._store
        assert journal is not None and store is not None
        try:
            fds = (await asyncio.to_thread(store.take, dp.key)) if dp.key in held else None
        except KeeperUnreachable as exc:
            log.warning("%s", exc)
            return False
        held.discard(dp.key)
        try:
            await self._adopt(rec, dp, fds)
        except Exception:
            log.exception("process %d of sandbox %s could not be taken back", dp.pid,
                          dp.sid)
            with contextlib.suppress(DsecError):    # a full disk: compaction drops it
                journal.end(dp.sid, dp.pid)
            store.drop(dp.key)
        return True

    async def _restore_later(self, waiting: list[DurableProcess]) -> None:
        """Entries left alone at restore (the keeper did not answer): ask it again, with
        a growing pause, and take each back once it answers - unless it went meanwhile
        (its sandbox ended, or its pid was reused by a newer entry)."""
        store, journal = self._store, self._journal
        assert store is not None and journal is not None
        pause = 2.0
        while waiting:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 60.0)
            held = await self._held_keys(store, (5.0,))
            if held is None:
                continue
            left: list[DurableProcess] = []
            for dp in waiting:
                rec = self._live(dp.sid)
                if (rec is None or journal.live.get((dp.sid, dp.pid)) is not dp
                        or dp.pid in self._tables.get(dp.sid, {})):
                    continue
                if not await self._take_back(rec, dp, held):
                    left.append(dp)
            waiting = left
        log.info("the descriptor keeper at %s answered: background processes taken back",
                 store.path)

    def _insert(self, sid: str, dp: DurableProcess) -> _Process:
        """A journaled entry back in its sandbox's table (its ring reserved)."""
        proc = _Process(dp.info, dp.ring_cap, dp.tenant)
        proc.durable = dp
        proc.oom_before = dp.oom_before    # _watch's oom_killed (red team 22, B9)
        proc.t0 = time.monotonic() - max(0.0, self.node.clock.time() - dp.info.started_at)
        self._reserve(dp.tenant, proc.ring_cap)
        table = self._tables.setdefault(sid, collections.OrderedDict())
        old = table.pop(dp.pid, None)
        if old is not None:
            self._release(old.tenant, old.ring_cap)
        table[dp.pid] = proc
        return proc

    def _restore_ended(self, rec: R, dp: DurableProcess) -> None:
        """An entry that had ended before the restart: listed with its exit status until
        evicted (``keep_ended_s`` counts from its end); its output is gone."""
        now = self.node.clock.time()
        info = dp.info
        ended_at = info.ended_at if info.ended_at is not None else now
        proc = self._insert(rec.id, dp)
        proc.take("stderr", f"dsec: the output of process {dp.pid} was lost in an edge "
                  "restart\n".encode(), self.limits.follower_backlog)
        code = info.exit_code if info.exit_code is not None else -1
        proc.end(ExecResult(exit_code=code, duration_s=max(0.0, ended_at - info.started_at),
                            pid=dp.pid), ExitStatus(code, signal=info.signal), ended_at)
        proc.ended_mono = time.monotonic() - max(0.0, now - ended_at)

    async def _adopt(self, rec: R, dp: DurableProcess, fds: dict[str, int] | None) -> None:
        node, lim = self.node, self.limits
        proc = self._insert(rec.id, dp)
        if proc.oom_before is None:
            # journaled by an edge before red team 22 (B9): counted from now, an OOM kill
            # during the downtime is missed, the later ones are not
            proc.oom_before = _oom_kills(rec)
        backlog = self._backlog

        def sink(stream: StreamName, data: bytes) -> None:
            proc.take(stream, data, lim.follower_backlog, backlog)

        io: ProcessIO | None = None
        why = "its exit status was lost in the edge restart (it ended while no edge ran)"
        if fds is None:
            why = ("its output pipes were lost in the edge restart (the descriptor keeper "
                   "is gone too); it was killed")
            kill = getattr(rec.backend, "kill_process", None)
            if kill is not None:
                with contextlib.suppress(DsecError, OSError):
                    await kill(SandboxId(rec.id), dp.exec_cgroup)
        else:
            adopt = getattr(rec.backend, "adopt_process", None)
            if adopt is None:
                for fd in fds.values():
                    os.close(fd)
            else:
                left = None if dp.deadline is None else dp.deadline - node.clock.time()
                store = self._store
                assert store is not None
                io = await adopt(SandboxId(rec.id), pid=dp.pid, host_pid=dp.host_pid,
                                 host_start=dp.host_start, exec_cgroup=dp.exec_cgroup,
                                 fds=fds, sink=sink, pty=dp.pty, deadline_in_s=left,
                                 input_pending=lim.input_pending,
                                 input_wait_s=lim.input_wait_s,
                                 lost_status=lambda: store.status(dp.key))
        if io is None:
            raw = None
            if fds is not None and self._store is not None:
                # it ended while no edge ran: the keeper reaped it (if it was its)
                raw = await asyncio.to_thread(self._store.status, dp.key, timeout_s=1.0)
            if raw is None:
                proc.take("stderr", f"dsec: process {dp.pid}: {why}\n".encode(),
                          lim.follower_backlog)
                status = ExitStatus(-1)
            else:
                status = exit_status(raw)
            proc.end(ExecResult(exit_code=status.exit_code,
                                duration_s=time.monotonic() - proc.t0, pid=dp.pid),
                     status, node.clock.time())
            proc.kept = fds is not None
            self._forget(proc)
            return
        proc.io = io
        proc.kept = True
        io.fds_changed = lambda: self._redeposit(proc)  # type: ignore[attr-defined]
        try:
            node._admit_exec(rec)
            admitted = True
        except DsecError:
            admitted = False     # held past the caps (as a sandbox past the capacity)
        task = asyncio.ensure_future(self._watch(rec, proc, io, admitted))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _spawn(self, rec: R, req: ExecRequest, sink: OutputSink) -> ProcessIO:
        backend = rec.backend
        spawn = getattr(backend, "spawn_process", None)
        if spawn is not None and getattr(backend, "supports_processes", False):
            io: ProcessIO = await spawn(SandboxId(rec.id), req, sink,
                                        input_pending=self.limits.input_pending,
                                        input_wait_s=self.limits.input_wait_s)
            return io
        return StreamedIO(backend, rec.id, req, next(self._fake_pids), sink)

    async def _watch(self, rec: R, proc: _Process, io: ProcessIO,
                     admitted: bool) -> None:
        status: ExitStatus
        try:
            status = await io.wait()
        except asyncio.CancelledError:
            status = ExitStatus(128 + _signal.SIGKILL, signal=_signal.SIGKILL)
        except Exception as exc:  # noqa: BLE001 - the backend's failure ends the process
            log.warning("process %d in sandbox %s ended with an error: %r", io.pid, rec.id,
                        exc)
            msg = f"dsec: process failed: {type(exc).__name__}: {exc}\n".encode()
            proc.take("stderr", msg, self.limits.follower_backlog)
            status = ExitStatus(-1) if not isinstance(exc, DsecError) else ExitStatus(126)
        finally:
            if admitted:
                self.node._exec_ended(rec)
        result = ExecResult(exit_code=status.exit_code, timed_out=status.timed_out,
                            duration_s=time.monotonic() - proc.t0, pid=io.pid)
        killed = status.signal == _signal.SIGKILL or status.exit_code == 128 + _signal.SIGKILL
        if killed and not status.timed_out and not proc.killed_by_caller \
                and proc.oom_before is not None:
            # As exec: the sandbox's OOM counter is bumped at the kill, before the exit is
            # seen. A long-lived process outlives other processes' OOM kills, so only an
            # end by SIGKILL (or a shell's 137: its last command's) with the counter risen
            # while it ran, and not a kill of ours (process_signal, its timeout), counts as
            # its own. A SIGKILL from another process of the sandbox during someone else's
            # OOM kill would be misread: there is no per-process OOM record in a memcg.
            after = _oom_kills(rec)
            result.oom_killed = after is not None and after > proc.oom_before
        proc.end(result, status, self.node.clock.time())
        self._forget(proc)
        self._uncharge_input(proc)
        rec.last_active_at = self.node.clock.time()

    def list(self, sid: str) -> list[ProcessInfo]:
        self.node._find(sid)
        table = self._tables.get(sid)
        return [msgspec.structs.replace(p.info) for p in (table or {}).values()]

    async def run(self, sid: str, req: ExecRequest,
                  ) -> AsyncGenerator[ProcessInfo | ExecChunk | ExecResult, None]:
        """``process_run`` (issue 20): :meth:`start` (the same admission, ring, journal and
        keeper), its :class:`ProcessInfo`, then what :meth:`connect` yields. The entry is
        taken right after the start, with no await between, so an eviction of an ended
        entry (a quick command, a concurrent start) cannot lose its output or its end;
        output written while the pid travels waits in the ring. Closing this stream ends
        the reader only: the process runs on, in the table, for any client."""
        info = await self.start(sid, req, confirm=False)
        p = self._tables[sid][info.pid]
        yield info
        async for item in self._follow(sid, info.pid, p):
            yield item

    async def connect(self, sid: str, pid: int) -> AsyncIterator[ExecChunk | ExecResult]:
        """The ring, then live output, then the result (as :meth:`exec_stream` yields)."""
        async for item in self._follow(sid, pid, self._get(sid, pid)):
            yield item

    async def _follow(self, sid: str, pid: int,
                      p: _Process) -> AsyncIterator[ExecChunk | ExecResult]:
        replay = list(p.ring)
        if p.result is not None:
            for c in replay:
                yield c
            yield p.result
            return
        if len(p.followers) >= self.limits.followers:
            raise RateLimited(f"process {pid} in sandbox {sid} already has "
                              f"{len(p.followers)} readers following it, the limit; close "
                              "one", sandbox_id=sid, limit=self.limits.followers,
                              retry_after=1.0)
        f = _Follower(p.tenant)
        p.followers.add(f)   # no await since the ring was copied: nothing is missed
        self._backlog.followers.add(f)
        try:
            for c in replay:
                yield c
            while True:
                while f.queue and not f.cut:
                    c = f.queue.popleft()
                    f.backlog -= len(c.data)
                    self._backlog.taken(f, len(c.data))
                    yield c
                if f.cut:
                    raise ResourceExhausted(
                        f"this reader of process {pid} in sandbox {sid} fell "
                        f"{f.backlog} bytes behind its output (at most "
                        f"{self.limits.follower_backlog} each, {self.limits.backlog_budget} "
                        "for every reader of the node) and was cut off; connect again "
                        "(the ring holds the newest output)",
                        sandbox_id=sid, limit=self.limits.follower_backlog)
                if p.result is not None:
                    yield p.result
                    return
                f.wake.clear()
                await f.wake.wait()
        finally:
            p.followers.discard(f)
            self._backlog.leave(f)
            f.queue.clear()

    async def input(self, sid: str, pid: int, data: bytes) -> None:
        p = self._get(sid, pid)
        if p.io is None or not p.info.stdin_open:
            raise InvalidTransition(_NO_STDIN.format(pid=pid, sid=sid), sandbox_id=sid,
                                    pid=pid)
        if p.result is not None:
            raise InvalidTransition(f"process {pid} in sandbox {sid} has exited "
                                    f"(exit code {p.info.exit_code})", sandbox_id=sid,
                                    pid=pid)
        n = len(data)
        self._charge_input(sid, p.tenant, n)
        # a backend without processes keeps what it collected until stdin closes: the
        # charge stays with the process until it ends
        keep = isinstance(p.io, StreamedIO)
        try:
            await p.io.write(data)
        except BaseException:
            self._uncharge(p.tenant, n)
            raise
        if keep and p.result is None:
            p.input_held += n
        else:
            self._uncharge(p.tenant, n)

    def _charge_input(self, sid: str, tenant: str, n: int) -> None:
        """Count ``n`` bytes of stdin in flight, or refuse past the node's
        ``input_budget`` (a tenant: half of it)."""
        lim = self.limits
        mine = self._input_by_tenant.get(tenant, 0)
        half = max(1, lim.input_budget // 2)
        if mine + n > half or self._input + n > lim.input_budget:
            raise ResourceExhausted(
                f"node {self.node_id} holds {self._input} bytes of process input in flight "
                f"(project {tenant}: {mine}); the budget is {lim.input_budget} ({half} per "
                f"project): wait for the processes to read their input, then write "
                f"{n} bytes again", sandbox_id=sid, limit=lim.input_budget)
        self._input += n
        self._input_by_tenant[tenant] = mine + n

    def _uncharge(self, tenant: str, n: int) -> None:
        self._input -= n
        left = self._input_by_tenant.get(tenant, 0) - n
        if left > 0:
            self._input_by_tenant[tenant] = left
        else:
            self._input_by_tenant.pop(tenant, None)

    def _uncharge_input(self, p: _Process) -> None:
        if p.input_held:
            self._uncharge(p.tenant, p.input_held)
            p.input_held = 0

    def close_stdin(self, sid: str, pid: int) -> None:
        p = self._get(sid, pid)
        if p.io is not None and p.result is None:
            p.io.close_stdin()
        p.info.stdin_open = False

    def signal(self, sid: str, pid: int, sig: int) -> None:
        p = self._get(sid, pid)
        if p.io is not None and p.result is None:
            if sig == _signal.SIGKILL:
                p.killed_by_caller = True     # its SIGKILL end is not the OOM killer's
            p.io.signal(sig)

    def resize(self, sid: str, pid: int, cols: int, rows: int) -> None:
        p = self._get(sid, pid)
        if not p.info.pty:
            raise InvalidArgument(f"process {pid} in sandbox {sid} has no terminal (start "
                                  "it with pty=...)", field="pid", sandbox_id=sid)
        if p.io is not None and p.result is None:
            p.io.resize(cols, rows)

    # ------------------------------------------------------------------ lifecycle
    def drop(self, sid: str, why: str) -> None:
        """Sandbox ``sid`` ended: its processes are gone; readers get the end now."""
        table = self._tables.pop(sid, None)
        if self._journal is not None:
            with contextlib.suppress(DsecError):
                self._journal.drop(sid)
        if not table:
            return
        now = self.node.clock.time()
        for p in table.values():
            if p.kept and p.durable is not None and self._store is not None:
                self._store.drop(p.durable.key)
                p.kept = False
            p.durable = None
            self._release(p.tenant, p.ring_cap)
            self._uncharge_input(p)
            if p.io is not None:
                with contextlib.suppress(Exception):
                    p.io.abandon()
            if p.result is None:
                status = ExitStatus(128 + _signal.SIGKILL, signal=_signal.SIGKILL)
                p.take("stderr", f"dsec: the sandbox ended ({why})\n".encode(),
                       self.limits.follower_backlog)
                p.end(ExecResult(exit_code=status.exit_code,
                                 duration_s=time.monotonic() - p.t0, pid=p.info.pid),
                      status, now)

    async def close(self) -> None:
        """The edge stops: durable processes keep running for the next edge to take back
        (their descriptors here are closed; the keeper holds copies); others end."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for table in self._tables.values():
            for p in table.values():
                if p.durable is not None and p.io is not None:
                    with contextlib.suppress(Exception):
                        p.io.abandon()
        if self._journal is not None:
            self._journal.close()
        if self._store is not None:
            self._store.close()
