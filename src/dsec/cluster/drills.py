"""Fault drills on a multi-host cluster (:mod:`dsec.cluster.hosts`), with counts.

Each drill runs real clients (the SDK, every call with a timeout) against a running
:class:`~dsec.cluster.hosts.HostCluster`, does the damage, and returns what it counted;
the tests assert the counts (lost = 0, duplicates = 0, resurrected = 0, no call past its
timeout) and ``dsec bench cluster`` records them (:mod:`dsec.bench.cluster_hosts`).

- :func:`partition`: one host's link is cut while clients create and exec;
- :func:`replica_kill`: one apiserver replica is killed with -9 during creates that
  carry Idempotency-Keys;
- :func:`edge_kill`: a host's edge process is killed with -9 and comes back.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.cluster.hosts import HostCluster, wait_for
from dsec.errors import DsecError, EdgeUnreachable

__all__ = ["CallLog", "EdgeKillReport", "PartitionReport", "ReplicaKillReport",
           "edge_kill", "partition", "replica_kill"]

# Small sandboxes: the drills are about the cluster, not about capacity.
SMALL: dict[str, Any] = {"cpu": 0.05, "memory": "32MiB"}


@dataclass(slots=True)
class Call:
    what: str          # create / exec / get
    seconds: float
    bound_s: float     # the longest this call may take (its timeouts)
    ok: bool
    detail: str        # sandbox id or the error's class


@dataclass(slots=True)
class CallLog:
    """Every SDK call the clients made, with how long it took and the bound it had."""

    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def timed(self, what: str, bound_s: float, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            out = fn()
        except DsecError as exc:
            self._add(Call(what, time.monotonic() - t0, bound_s, False, type(exc).__name__))
            return None
        self._add(Call(what, time.monotonic() - t0, bound_s, True,
                       str(getattr(out, "id", ""))))
        return out

    def _add(self, c: Call) -> None:
        with self.lock:
            self.calls.append(c)

    @property
    def overdue(self) -> list[Call]:
        """Calls that took longer than their bound: a hang (must be none)."""
        return [c for c in self.calls if c.seconds > c.bound_s]

    def counts(self) -> dict[str, int]:
        return dict(Counter(f"{c.what}:{'ok' if c.ok else c.detail}" for c in self.calls))


@dataclass(slots=True)
class _Clients:
    """``n`` SDK clients creating and exec'ing in a loop until stopped."""

    hc: HostCluster
    n: int
    timeout_s: float
    create_retry_s: float
    log: CallLog = field(default_factory=CallLog)
    # (when asked, when answered, Idempotency-Key, id)
    made: list[tuple[float, float, str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    failed_keys: set[str] = field(default_factory=set)   # creates that raised
    idle: int = 0
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for k in range(self.n):
            t = threading.Thread(target=self._work, name=f"drill-client-{k}", daemon=True)
            self.threads.append(t)
            t.start()

    def _work(self) -> None:
        create_bound = self.create_retry_s + self.timeout_s + 3.0
        exec_bound = 5.0 + self.timeout_s + 3.0
        with self.hc.client(timeout=self.timeout_s, create_retry_s=self.create_retry_s,
                            retries=1) as c:
            while not self.stop.is_set():
                asked = time.monotonic()
                key = f"drill-{uuid.uuid4().hex}"
                sb = self.log.timed("create", create_bound, functools.partial(
                    c.sandboxes.create, backend="simulated", idempotency_key=key,
                    labels={"drill": "clients", "drill-key": key}, **SMALL))
                if sb is None:
                    with self.log.lock:
                        self.failed_keys.add(key)
                    time.sleep(0.05)
                    continue
                with self.log.lock:
                    self.made.append((asked, time.monotonic(), key, sb.id))
                self.log.timed("exec", exec_bound,
                               functools.partial(sb.exec, ["true"], timeout=5))
                # churn: capacity stays free, and what is left live is what nobody has
                self.log.timed("destroy", exec_bound, sb.kill)
            # The client (and its session) stays open until released: a sandbox nobody
            # holds must not be reclaimed merely because its client went away.
            with self.log.lock:
                self.idle += 1
            self.release.wait(120)

    def join(self, timeout: float = 60.0) -> None:
        """Stop the loops; the clients stay open until :meth:`close`."""
        self.stop.set()
        end = time.monotonic() + timeout
        while any(t.is_alive() for t in self.threads) and time.monotonic() < end:
            with self.log.lock:
                if self.idle >= len(self.threads):
                    return
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.release.set()
        for t in self.threads:
            t.join(60)


# ----------------------------------------------------------------------- partition
@dataclass(slots=True)
class PartitionReport:
    victim: str
    written_off: list[str]        # sandboxes on the victim reported lost (node_lost)
    loss_seconds: float           # from the cut until the apiserver reported the node lost
    resurrected: int              # written-off sandboxes alive again after the heal
    duplicate_ids: int            # ids handed out twice
    created_elsewhere_after_loss: int
    created_on_victim_after_loss: int
    # Ghosts: live after the heal though no client was answered with them. A create
    # whose request reached the cut host (or whose reply the cut swallowed) while the
    # client gave up with a timeout is made there all the same; nothing tells the server
    # that the caller gave up, so while the caller's session lives the sandbox lives (to
    # its TTL); closing the session (the client going away) has the sweeper reclaim it.
    ghosts_at_heal: int
    duplicate_keys: int           # ghosts whose key a client got another sandbox for
    unexplained_ghosts: int       # ghosts whose create no client saw fail
    ghosts_open_sessions: int     # ghosts still live while their clients stay open
    ghosts_after_sweep: int       # ... after the clients closed and the sweeper ran
    ghost_story: list[str]        # each ghost at the heal: its events as the apiserver has them
    calls: dict[str, int]
    overdue: list[str]            # calls past their timeout (hangs)


def _spread(hc: HostCluster, c: Any, n: int) -> dict[str, list[str]]:
    by: dict[str, list[str]] = {}
    for _ in range(n):
        sb = c.sandboxes.create(backend="simulated", labels={"drill": "initial"}, **SMALL)
        by.setdefault(hc.host_of(sb.id), []).append(sb.id)
    return by


def partition(hc: HostCluster, *, clients: int = 3, initial: int = 9,
              timeout_s: float = 4.0, create_retry_s: float = 15.0,
              sweep_wait_s: float = 15.0) -> PartitionReport:
    """Cut the busiest host's link while ``clients`` create and exec; wait until its
    sandboxes are reported lost; heal; wait until the edge has destroyed them."""
    ttl = hc.config.node_ttl_s
    with hc.client(timeout=timeout_s, retries=2) as c:
        wait_for(lambda: all(n.healthy for n in c.nodes()), 30, "every host healthy")
        by = _spread(hc, c, initial)
        victim = max(by, key=lambda n: len(by[n]))
        load = _Clients(hc, clients, timeout_s, create_retry_s)
        load.start()
        try:
            return _partition(hc, c, load, victim, by, timeout_s, ttl, sweep_wait_s)
        finally:
            load.close()


def _partition(hc: HostCluster, c: Any, load: _Clients, victim: str,
               by: dict[str, list[str]], timeout_s: float, ttl: float,
               sweep_wait_s: float) -> PartitionReport:
    lost = list(by[victim])
    time.sleep(0.5)
    hc.cut(victim)
    cut_at, cut_wall = time.monotonic(), time.time()

    get_bound = timeout_s + 3.0

    def state_of(s: str) -> tuple[str, str] | None:
        # A sandbox on a silent host may not answer within the request timeout
        # (the apiserver asks its edge): that is an error in time, not a hang.
        sb = load.log.timed("get", get_bound, lambda: c.sandboxes.get(s))
        return None if sb is None else (sb.info.state, sb.info.reason)

    def reported_lost() -> bool:
        return all(state_of(s) == ("destroyed", "node_lost") for s in lost)
    def node_status() -> str:
        nodes = load.log.timed("nodes", get_bound, c.nodes)
        return "" if nodes is None else {n.id: n.status for n in nodes}.get(victim, "")
    try:
        # the node's status (the apiserver's own view, no call to the silent edge)...
        wait_for(lambda: node_status() == "lost", 3 * ttl + 15, f"{victim} lost")
        lost_at = time.monotonic()
        # ... and every one of its sandboxes, each with an event giving the reason
        wait_for(reported_lost, 3 * ttl + 15, f"{victim}'s sandboxes reported lost")
        for s in lost:   # every one of them has an event with the reason
            ev = c.sandboxes.get(s).events()[-1]
            assert ev.reason == "node_lost" and victim in ev.detail, ev
        time.sleep(max(2.0, ttl / 2))   # creates go on while the host is gone
    finally:
        hc.heal(victim)
    healed_at = time.monotonic()
    time.sleep(1.0)
    load.join()
    with load.log.lock:
        made = list(load.made)
    # What the clients made on the victim and could not destroy before the cut is
    # written off too.
    gone = [s for _, _, _, s in made if hc.host_of(s) == victim
            and state_of(s) == ("destroyed", "node_lost")]
    written_off = lost + gone

    def destroyed_on_edge() -> bool:
        st = hc.edge_states(victim, written_off)
        return all(v[0] == "destroyed" for v in st.values())
    try:
        wait_for(destroyed_on_edge, 3 * ttl + 20, f"{victim} to destroy what it lost")
    except TimeoutError:
        pass   # counted below as resurrected
    first = {s for ids in by.values() for s in ids}
    answered = {s for _, _, _, s in made}
    key_of = {k: s for _, _, k, s in made}

    def unknown() -> dict[str, str | None]:
        live = _live(hc)
        return {s: k for s, k in live.items() if s not in first and s not in answered}
    ghosts_at_heal = unknown()
    dup_keys = sum(1 for k in ghosts_at_heal.values() if k in key_of)
    with load.log.lock:
        failed = set(load.failed_keys)
    unexplained = sum(1 for k in ghosts_at_heal.values() if k not in failed)
    # Clients still open: their sessions keep what they own alive (see PartitionReport).
    try:
        wait_for(lambda: not unknown(), 2.0, "ghosts reclaimed", interval=0.5)
    except TimeoutError:
        pass
    ghosts_open = unknown()
    story = []
    for g in ghosts_at_heal:
        sb = load.log.timed("get", get_bound, functools.partial(c.sandboxes.get, g))
        evs = [] if sb is None else sb.events()
        story.append(f"{g}: " + "; ".join(
            f"{e.time - cut_wall:+.1f}s {e.to_state}/{e.reason}" for e in evs)
            + f" (heal at {healed_at - cut_at:+.1f}s)")
    load.close()   # sessions closed: the sweeper reclaims what they owned
    try:
        wait_for(lambda: not unknown(), sweep_wait_s, "the sweeper to reclaim ghosts",
                 interval=0.5)
    except TimeoutError:
        pass
    ghosts_after = unknown()
    live_edge = set(hc.edge_ids(victim))
    listed = {i.id for i in c.sandboxes.list(labels={"drill": "initial"})} | {
        i.id for i in c.sandboxes.list(labels={"drill": "clients"})}
    resurrected = sum(1 for s in written_off if s in live_edge or s in listed)
    ids = [s for _, _, _, s in made] + sorted(first)
    # creates asked after the loss and answered before the heal: placement's choice
    # while the victim was known lost
    during = [s for asked, done, _, s in made if lost_at < asked and done < healed_at]
    return PartitionReport(
        victim=victim, written_off=written_off, loss_seconds=lost_at - cut_at,
        resurrected=resurrected, duplicate_ids=len(ids) - len(set(ids)),
        created_elsewhere_after_loss=sum(1 for s in during if hc.host_of(s) != victim),
        created_on_victim_after_loss=sum(1 for s in during if hc.host_of(s) == victim),
        ghosts_at_heal=len(ghosts_at_heal), duplicate_keys=dup_keys,
        unexplained_ghosts=unexplained, ghosts_open_sessions=len(ghosts_open),
        ghosts_after_sweep=len(ghosts_after), ghost_story=story, calls=load.log.counts(),
        overdue=[f"{x.what} {x.seconds:.1f}s > {x.bound_s:.1f}s ({x.detail})"
                 for x in load.log.overdue])


def _live(hc: HostCluster) -> dict[str, str | None]:
    """Every live sandbox on every host (the edges' word) -> its drill-key label."""
    out: dict[str, str | None] = {}

    async def scan() -> None:
        for node in hc.node_ids:
            async with await hc.edge_client(node) as edge:
                for i in await edge.list():
                    if i.state not in ("destroyed", "failed"):
                        out[str(i.id)] = i.spec.labels.get("drill-key")
    hc.run(scan(), timeout=60)
    return out


# -------------------------------------------------------------------- replica kill
@dataclass(slots=True)
class ReplicaKillReport:
    keys: int                 # creates asked (one Idempotency-Key each)
    answered: int             # keys a client got a sandbox for
    duplicates: int           # sandboxes beyond one per key, on the edges
    orphans: int              # live sandboxes no client was answered with
    killed_pid: int
    answered_before_kill: int # keys answered when the replica was killed
    calls: dict[str, int]
    overdue: list[str]


def _live_by_key(hc: HostCluster) -> tuple[Counter[str], set[str]]:
    """``key -> how many live sandboxes carry it`` and the live ids, from the edges."""
    per: Counter[str] = Counter()
    ids: set[str] = set()

    async def scan() -> None:
        for node in hc.node_ids:
            async with await hc.edge_client(node) as edge:
                for i in await edge.list():
                    if i.state in ("destroyed", "failed"):
                        continue
                    ids.add(str(i.id))
                    key = i.spec.labels.get("drill-key")
                    if key is not None:
                        per[key] += 1
    hc.run(scan(), timeout=60)
    return per, ids


def replica_kill(hc: HostCluster, *, clients: int = 4, per_client: int = 12,
                 kill_after: int = 10, timeout_s: float = 4.0,
                 create_retry_s: float = 20.0, sweep_wait_s: float = 12.0
                 ) -> ReplicaKillReport:
    """``clients`` threads create ``per_client`` sandboxes each, every one under an
    Idempotency-Key of its own (also carried as a label, so the edges can be counted by
    key); after ``kill_after`` answered creates replica 0 is killed with -9. The
    clients' retries reach the other replica through the cluster's one address."""
    if len(hc.replicas) < 2:
        raise ValueError("replica_kill needs a cluster with 2 replicas or more")
    log = CallLog()
    answered: dict[str, str] = {}
    lock = threading.Lock()
    enough = threading.Event()
    bound = create_retry_s + timeout_s + 3.0

    def work(k: int) -> None:
        with hc.client(timeout=timeout_s, create_retry_s=create_retry_s, retries=1) as c:
            for j in range(per_client):
                key = f"drill-{k}-{j}-{uuid.uuid4().hex[:8]}"
                sb = log.timed("create", bound, functools.partial(
                    c.sandboxes.create, backend="simulated", idempotency_key=key,
                    detached=True, labels={"drill-key": key}, **SMALL))
                if sb is not None:
                    with lock:
                        answered[key] = sb.id
                        if len(answered) >= kill_after:
                            enough.set()

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    enough.wait(60)
    pid = hc.kill_replica(0)
    with lock:
        before_kill = len(answered)
    for t in threads:
        t.join(bound * per_client)
    # The sweeper (every replica's) gets a chance to reclaim what the dead one left.
    time.sleep(sweep_wait_s)
    per, live = _live_by_key(hc)
    returned = set(answered.values())
    return ReplicaKillReport(
        keys=clients * per_client, answered=len(answered),
        duplicates=sum(n - 1 for n in per.values() if n > 1),
        orphans=len(live - returned), killed_pid=pid, answered_before_kill=before_kill,
        calls=log.counts(),
        overdue=[f"{x.what} {x.seconds:.1f}s > {x.bound_s:.1f}s ({x.detail})"
                 for x in log.overdue])


# ----------------------------------------------------------------------- edge kill
@dataclass(slots=True)
class EdgeKillReport:
    node: str
    before: list[str]         # the node's sandboxes before the kill
    readopted: int            # of them, alive and answering exec after the restart
    lost: int                 # of them, gone or written off
    old_pid: int
    new_pid: int
    relinks: int              # execs refused with EdgeUnreachable while the link was redialled


def edge_kill(hc: HostCluster, node: str | None = None, *, n: int = 4,
              timeout_s: float = 10.0) -> EdgeKillReport:
    """kill -9 one host's edge; its supervisor restarts it; its sandboxes must be
    re-adopted (alive, and exec works through the apiserver as before)."""
    node = node or hc.node_ids[0]
    with hc.client(timeout=timeout_s, retries=5) as c:
        wait_for(lambda: all(x.healthy for x in c.nodes()), 30, "every host healthy")
        mine: list[Any] = []
        for _ in range(8 * n):
            sb = c.sandboxes.create(labels={"drill": "edge-kill"}, **SMALL)
            if hc.host_of(sb.id) == node:
                mine.append(sb)
            else:
                sb.kill()
            if len(mine) >= n:
                break
        before = [sb.id for sb in mine]
        old = hc.kill_edge(node)
        new = hc.wait_edge(node, old)
        readopted = relinks = 0
        for sb in mine:
            # The apiserver learns that its link died when it next uses it: that exec
            # fails with EdgeUnreachable ("not carried out; retry"), and a client retries.
            end = time.monotonic() + timeout_s
            while True:
                try:
                    r = sb.exec(["sh", "-c", "echo back"], timeout=10)
                    if r.exit_code == 0 and r.stdout == b"back\n" \
                            and sb.refresh().state == "running":
                        readopted += 1
                    break
                except EdgeUnreachable:
                    relinks += 1
                    if time.monotonic() > end:
                        break
                    time.sleep(0.5)
                except DsecError:
                    break
        return EdgeKillReport(node=node, before=before, readopted=readopted,
                              lost=len(before) - readopted, old_pid=old,
                              new_pid=new, relinks=relinks)
