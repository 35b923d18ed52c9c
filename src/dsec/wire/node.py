"""What an edge node says about itself: its identity, capacity, heartbeats and event feed.

The control plane builds its whole view of a node from these (placement, the watcher,
reconcile). Heartbeats use ``array_like`` briefs because a node with 100k sandboxes
sends 100k of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final

import msgspec

from dsec.wire.spec import SandboxEvent, SandboxState

#: The version of the edge's Aether methods and bodies (:mod:`dsec.wire.ops` rows with
#: the edge door). Raise it with any change an edge of the previous release would
#: misread. 1: before issue 13 (``edge.info``, per-type batch items); 2: the catalogue
#: (``edge.node_info``, ``Batch[T]``, request bodies refuse unknown fields); 3: issue 14
#: (Aether duplex streams and their ``WINDOW`` frame, which an edge of release 2 would
#: take for corruption; the network policy and port rows); 4: issue 19 (the process rows
#: and the file rows: file_read_stream, file_write_stream, file_rename, file_watch).
EDGE_PROTOCOL: Final = 4

#: The most sandboxes one heartbeat lists (a page: ``HeartbeatRequest.list_after`` /
#: ``list_limit`` ask for the next) and the most events one feed read carries. In the
#: types, so a reply that says more is refused at its array header, before any of it is
#: decoded: an edge is a network peer (a hostile one listing 3 million sandboxes cost
#: the control plane 0.5 s of decoding per poll; refused at the header, 0.1 ms).
MAX_LIST_PAGE: Final = 10_000
MAX_FEED_EVENTS: Final = 10_000

__all__ = [
    "EDGE_PROTOCOL",
    "MAX_FEED_EVENTS",
    "MAX_LIST_PAGE",
    "EventFeed",
    "Heartbeat",
    "NodeInfo",
    "PoolStats",
    "Resources",
    "SandboxBrief",
    "describe_request",
    "format_amount",
    "format_bytes",
    "format_cpu",
    "labels_match",
    "too_big",
]


class Resources(msgspec.Struct, frozen=True, kw_only=True):
    """An amount of node resources (capacity, usage or free). ``disk_bytes`` is only
    meaningful in a capacity: the most disk one sandbox may be given (the size of the
    node's state filesystem); None = not known, not checked."""

    cpu_milli: int = 0
    memory_bytes: int = 0
    sandboxes: int = 0
    disk_bytes: int | None = None


# ------------------------------------------------------------------ "never fits"
# Resources in people's words, and what of a request no node could ever hold: the edge's
# admission and the apiserver's ceiling answer a too-big create in the same words.
def format_bytes(n: int) -> str:
    """1073741824 -> '1 GiB'; 1610612736 -> '1.5 GiB'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} bytes"


def format_cpu(milli: int) -> str:
    """2000 -> '2 cores'; 500 -> '0.5 cores'."""
    return f"{milli / 1000:g} cores"


def _factor(total: int, physical: int | None) -> str:
    if not physical or physical == total:
        return ""
    return f" x overcommit {total / physical:g}"


def too_big(capacity: Resources, physical: Resources | None, *, cpu_milli: int,
            memory_bytes: int, disk_bytes: int | None) -> list[tuple[str, str, int, int]]:
    """What of a request is more than a node with ``capacity`` could ever hold:
    ``(field, "what it has", requested, most)`` per resource; empty if it fits."""
    out = []
    if cpu_milli > capacity.cpu_milli:
        pc = physical.cpu_milli if physical else None
        has = (f"{format_cpu(pc)}{_factor(capacity.cpu_milli, pc)} = "
               if pc and pc != capacity.cpu_milli else "")
        out.append(("cpu_milli", f"{has}{format_cpu(capacity.cpu_milli)}", cpu_milli,
                    capacity.cpu_milli))
    if memory_bytes > capacity.memory_bytes:
        pm = physical.memory_bytes if physical else None
        has = (f"{format_bytes(pm)}{_factor(capacity.memory_bytes, pm)} = "
               if pm and pm != capacity.memory_bytes else "")
        out.append(("memory_bytes", f"{has}{format_bytes(capacity.memory_bytes)}",
                    memory_bytes, capacity.memory_bytes))
    if (disk_bytes is not None and capacity.disk_bytes is not None
            and disk_bytes > capacity.disk_bytes):
        out.append(("disk_bytes", f"a {format_bytes(capacity.disk_bytes)} filesystem",
                    disk_bytes, capacity.disk_bytes))
    return out


def format_amount(field: str, amount: int) -> str:
    """An amount of ``cpu_milli`` or a ``*_bytes`` field, for people."""
    return format_cpu(amount) if field == "cpu_milli" else format_bytes(amount)


def describe_request(field: str, amount: int) -> str:
    """``memory_bytes``, 2**40 -> 'memory=1 TiB' (the SDK's spelling of the field)."""
    name = "cpu" if field == "cpu_milli" else field.removesuffix("_bytes")
    return f"{name}={format_amount(field, amount)}"


class EventFeed(msgspec.Struct, kw_only=True):
    """Node-wide events after ``FeedRequest.after``. ``next`` is the cursor for the next
    read; ``lost`` counts events that fell out of the bounded feed before being read."""

    events: Annotated[list[SandboxEvent], msgspec.Meta(max_length=MAX_FEED_EVENTS)]
    next: int
    lost: int = 0


class SandboxBrief(msgspec.Struct, array_like=True, frozen=True):
    """What the control plane needs per sandbox to rebuild its view from heartbeats."""

    id: str
    state: SandboxState
    project: str
    priority: int
    cpu_milli: int
    memory_bytes: int


class PoolStats(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A backend's warm pool (fncall): handouts served warm (``hits``) or cold
    (``misses``) since the edge started, the pool's target ``size`` and how many workers
    are warm now (``ready``)."""

    hits: int = 0
    misses: int = 0
    size: int = 0
    ready: int = 0


class Heartbeat(msgspec.Struct, kw_only=True, omit_defaults=True):
    node: str
    time: float
    capacity: Resources
    usage: Resources
    counts: dict[str, int]          # live sandboxes by state
    labels: dict[str, str] = {}
    images: list[str] = []          # image refs present on the node
    # A fingerprint of ``images`` (issue 16): the control plane asks with the one it
    # holds, and an edge whose set is unchanged answers ``images_same`` and no list.
    # Measured: 10,000 layer digests are 730 KB of msgpack per heartbeat (386 KB
    # zlib'd), every second per edge; unchanged, 20 bytes.
    images_gen: int = 0
    images_same: bool = False
    backends: list[str] = []
    feed_seq: int = 0               # last event sequence number (see EventFeed)
    # A page of the node's live sandboxes in id order (HeartbeatRequest.list_after,
    # list_limit); ``list_more``: sandboxes with larger ids follow.
    sandboxes: Annotated[list[SandboxBrief], msgspec.Meta(max_length=MAX_LIST_PAGE)] | None = None
    list_more: bool = False
    pools: dict[str, PoolStats] = {}    # backend name -> warm-pool stats (optional capability)
    physical: Resources | None = None   # the machine before overcommit (capacity / physical)
    # The image pins this node applied (issue 17): dsec.wire.layers.pins_fingerprint of
    # the last PinSet it carried out whole, 0 after a start; the control plane sends the
    # set again (node_pins) when this is not the fingerprint of the stored pins.
    pins_gen: int = 0
    # [lazy3] The node reads layers lazily from the cluster's blob store (dsec edge
    # --blob-store): the control plane grants it pushed layers (layer_grant) instead of
    # relaying them whole.
    lazy: bool = False


class NodeInfo(msgspec.Struct, kw_only=True):
    """``edge.node_info``: who the node is, what it runs and which edge protocol it
    speaks (:data:`EDGE_PROTOCOL`; an edge of another release is refused on connect)."""

    node: str
    backends: list[str]
    capacity: Resources
    labels: dict[str, str]
    methods: list[str]
    physical: Resources | None = None
    protocol: int = 0               # 0: an edge from before the field existed
    # What the node's kernel offers QoS classes (issue 22, dsec.edge.qos.qos_features):
    # core_sched (CONFIG_SCHED_CORE), cpu_idle (cgroup cpu.idle), psi (memory pressure),
    # io_weight (a disk whose scheduler honours weights)
    qos: dict[str, bool] = {}
    # The QoS policies the node applies (dsec.edge.qos.qos_policy_text): cpus.ls/cpus.be
    # (pinning), io.ls/io.be + io.device (block I/O limits), pressure, be_only; {}: none
    qos_policy: dict[str, str] = {}


def labels_match(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())
