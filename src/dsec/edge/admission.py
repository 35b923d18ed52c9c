"""Admission control: the edge's final say on whether a sandbox fits (``ResourcePool``).

Optimistic: :meth:`ResourcePool.reserve` adds the request to the usage first, then
verifies every limit, and rolls the addition back if one is broken. Placement decisions
made elsewhere are only overlays on a heartbeat snapshot; this is where they meet
reality. Reservations are keyed by sandbox id, so releasing is idempotent and a leak is
visible as a key that outlived its sandbox (:attr:`ResourcePool.held`).

Pure logic: the node calls it with no ``await`` between reserve and verify, so under
any contention exactly ``max_sandboxes`` creations succeed.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from dsec.errors import CapacityExceeded, Conflict, InvalidArgument

__all__ = ["Capacity", "ResourcePool", "Resources"]


class Resources(msgspec.Struct, frozen=True, kw_only=True):
    """An amount of node resources (capacity, usage or free)."""

    cpu_milli: int = 0
    memory_bytes: int = 0
    sandboxes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    """What a node admits. ``cpu_milli`` above the physical cores is CPU overcommit."""

    cpu_milli: int            # millicores admitted in total
    memory_bytes: int         # bytes admitted in total
    max_sandboxes: int        # live sandboxes (any state but destroyed)

    def __post_init__(self) -> None:
        for name in ("cpu_milli", "memory_bytes", "max_sandboxes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise InvalidArgument(f"node capacity {name}={v!r} must be a non-negative integer",
                                      field=name)

    def as_resources(self) -> Resources:
        return Resources(cpu_milli=self.cpu_milli, memory_bytes=self.memory_bytes,
                         sandboxes=self.max_sandboxes)


class ResourcePool:
    """Reserve -> verify -> roll back on cpu, memory and a sandbox count."""

    __slots__ = ("_held", "capacity", "cpu_milli", "memory_bytes")

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.cpu_milli = 0
        self.memory_bytes = 0
        self._held: dict[str, tuple[int, int]] = {}

    @property
    def count(self) -> int:
        return len(self._held)

    @property
    def held(self) -> frozenset[str]:
        """Keys that currently hold a reservation."""
        return frozenset(self._held)

    def usage(self) -> Resources:
        return Resources(cpu_milli=self.cpu_milli, memory_bytes=self.memory_bytes,
                         sandboxes=len(self._held))

    def free(self) -> Resources:
        c = self.capacity
        return Resources(cpu_milli=c.cpu_milli - self.cpu_milli,
                         memory_bytes=c.memory_bytes - self.memory_bytes,
                         sandboxes=c.max_sandboxes - len(self._held))

    def reserve(self, key: str, cpu_milli: int, memory_bytes: int) -> None:
        """Hold ``cpu_milli`` and ``memory_bytes`` for ``key`` or raise CapacityExceeded."""
        held = self._held
        if key in held:
            raise Conflict(f"resources for {key} are already reserved", key=key)
        # Optimistic: take first, then check, then give back if a limit broke.
        held[key] = (cpu_milli, memory_bytes)
        self.cpu_milli += cpu_milli
        self.memory_bytes += memory_bytes
        cap = self.capacity
        if (self.cpu_milli <= cap.cpu_milli and self.memory_bytes <= cap.memory_bytes
                and len(held) <= cap.max_sandboxes):
            return
        short = {}
        if self.cpu_milli > cap.cpu_milli:
            short["cpu_milli"] = self.cpu_milli - cap.cpu_milli
        if self.memory_bytes > cap.memory_bytes:
            short["memory_bytes"] = self.memory_bytes - cap.memory_bytes
        if len(held) > cap.max_sandboxes:
            short["sandboxes"] = len(held) - cap.max_sandboxes
        self._rollback(key)
        free = self.free()
        what = ", ".join(f"{k} short by {v}" for k, v in short.items())
        raise CapacityExceeded(
            f"node cannot admit {key} (cpu_milli={cpu_milli}, memory_bytes={memory_bytes}): "
            f"{what}; free now: cpu_milli={free.cpu_milli}, memory_bytes={free.memory_bytes}, "
            f"sandboxes={free.sandboxes}. Ask for less or place it on another node",
            short=short, requested={"cpu_milli": cpu_milli, "memory_bytes": memory_bytes},
            free={"cpu_milli": free.cpu_milli, "memory_bytes": free.memory_bytes,
                  "sandboxes": free.sandboxes},
        )

    def release(self, key: str) -> bool:
        """Give back what ``key`` holds; False if it held nothing (idempotent)."""
        if key not in self._held:
            return False
        self._rollback(key)
        return True

    def _rollback(self, key: str) -> None:
        cpu, mem = self._held.pop(key)
        self.cpu_milli -= cpu
        self.memory_bytes -= mem
