"""The slot pool's state machine (pure: events in, instructions out).

A slot is a network namespace + veth pair + /31 addresses + route + its nft objects,
built ahead of time and handed to a sandbox at create (``setns`` of the slot's fd: 54 us
vs 368 us for a fresh ``unshare(CLONE_NEWNET)``, E6). When the sandbox goes, its slot is
drained (sets flushed, generation moved on: 0.43-0.74 ms) and goes back to the pool, which
also spares the kernel's serialized netns teardown (1,000 netns: 1.03 s of cleanup_net, E4).

The router shell (net/router.py) executes the instructions and reports what happened as
events. An event the table does not allow in the slot's state is a bug in the shell and
raises :class:`InternalError` naming slot, event and state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from dsec.errors import InternalError

__all__ = [
    "SLOT_TRANSITIONS",
    "BuildSlots",
    "Drain",
    "DropSlot",
    "Instruction",
    "SlotEvent",
    "SlotEventKind",
    "SlotState",
    "SlotTable",
]

SlotState = Literal["building", "free", "assigned", "draining", "gone"]
SlotEventKind = Literal[
    "built", "build_failed", "take", "policy_loaded", "released", "drained", "drain_failed",
    "lost", "shrink", "adopted",
]

SLOT_TRANSITIONS: Final[Mapping[SlotState, Mapping[SlotEventKind, SlotState]]] = {
    "building": {"built": "free", "build_failed": "gone"},
    "free": {"take": "assigned", "shrink": "gone", "lost": "gone"},
    "assigned": {"policy_loaded": "assigned", "released": "draining", "lost": "gone"},
    "draining": {"drained": "free", "drain_failed": "gone", "lost": "gone"},
    # "adopted": a live sandbox's slot found at edge start (net/reconcile.py)
    "gone": {"adopted": "assigned"},
}
# "lost": the netns vanished (its veth left the router's link list), e.g. an assigned
# slot whose sandbox died while the edge was down.


@dataclass(frozen=True, slots=True)
class SlotEvent:
    kind: SlotEventKind
    slot: int


@dataclass(frozen=True, slots=True)
class BuildSlots:
    """Build these slots (netns + veth + addresses + route); ``objects``: those of them
    whose nft objects do not exist yet (objects outlive a slot's netns and are reused)."""

    slots: tuple[int, ...]
    objects: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Drain:
    """Flush the slot's sets (one batch) and check its netns still looks as built."""

    slot: int


@dataclass(frozen=True, slots=True)
class DropSlot:
    """Forget the slot's netns (close the fd; the kernel removes the veth with it) and
    flush its sets; its nft objects stay for the next slot with this index."""

    slot: int


Instruction = BuildSlots | Drain | DropSlot


class SlotTable:
    """Which slot is in which state; what to build, drain or drop next.

    ``pool_min`` free (or building) slots are kept ahead of demand, built ``build_batch``
    at a time; indices are reused lowest first, so a node's slots stay dense.
    """

    def __init__(self, *, capacity: int, pool_min: int = 32, build_batch: int = 64) -> None:
        if capacity <= 0:
            raise ValueError(f"slot capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.pool_min = min(pool_min, capacity)
        self.build_batch = max(1, build_batch)
        self.state: dict[int, SlotState] = {}
        self.has_objects: set[int] = set()
        self._free: deque[int] = deque()

    # -- queries

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.state.values() if s == state)

    def in_state(self, state: SlotState) -> list[int]:
        return sorted(i for i, s in self.state.items() if s == state)

    # -- transitions

    def _move(self, slot: int, kind: SlotEventKind) -> SlotState:
        cur: SlotState = self.state.get(slot, "gone")
        nxt = SLOT_TRANSITIONS[cur].get(kind)
        if nxt is None:
            allowed = ", ".join(sorted(SLOT_TRANSITIONS[cur])) or "nothing"
            raise InternalError(
                f"slot {slot} (dsv{slot}): event {kind!r} in state {cur!r} (allowed: {allowed})",
                slot=slot, event=kind, state=cur,
            )
        if nxt == "gone":
            self.state.pop(slot, None)
        else:
            self.state[slot] = nxt
        if cur == "free":
            self._free.remove(slot)
        if nxt == "free":
            self._free.append(slot)
        return nxt

    def handle(self, *events: SlotEvent) -> list[Instruction]:
        """Apply events in order; return what the shell must do next for them (refilling
        the pool is asked separately, :meth:`refill`, so a create or destroy never builds
        slots inline unless it must)."""
        out: list[Instruction] = []
        for ev in events:
            cur = self.state.get(ev.slot, "gone")
            nxt = self._move(ev.slot, ev.kind)
            if ev.kind in ("built", "adopted"):
                self.has_objects.add(ev.slot)
            elif ev.kind == "released":
                out.append(Drain(ev.slot))
            elif nxt == "gone" and cur != "building":
                out.append(DropSlot(ev.slot))
        return out

    def take(self) -> int | None:
        """A free slot for a sandbox (oldest freed first), or None when the pool is empty:
        the shell then builds one inline with :meth:`reserve` (a create never fails for an
        empty pool while capacity lasts)."""
        if not self._free:
            return None
        slot = self._free[0]
        self._move(slot, "take")
        return slot

    def reserve(self, n: int) -> BuildSlots | None:
        """Mark up to ``n`` unused indices ``building`` (lowest first)."""
        picked: list[int] = []
        i = 0
        while len(picked) < n and i < self.capacity:
            if i not in self.state:
                picked.append(i)
            i += 1
        if not picked:
            return None
        for s in picked:
            self.state[s] = "building"
        return BuildSlots(
            slots=tuple(picked), objects=tuple(s for s in picked if s not in self.has_objects)
        )

    def refill(self) -> list[Instruction]:
        """Build more slots when free + building fell below ``pool_min``."""
        ahead = len(self._free) + self.count("building")
        if ahead >= self.pool_min:
            return []
        want = max(self.pool_min - ahead, min(self.build_batch, self.pool_min))
        want = min(want, self.build_batch)
        b = self.reserve(want)
        return [b] if b is not None else []
