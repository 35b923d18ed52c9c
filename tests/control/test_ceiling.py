"""The cluster-wide "could any node ever hold this?" check (pure)."""

from __future__ import annotations

import pytest

from dsec.control.ceiling import Ceiling, NodeSize
from dsec.edge.admission import Resources
from dsec.errors import InvalidArgument, Unsatisfiable

GiB = 1 << 30


def _size(node: str, cores: int, mem_gib: int, *, oc_cpu: int = 64, oc_mem: int = 4,
          backends: tuple[str, ...] = ("simulated", "container"),
          disk: int | None = None) -> NodeSize:
    phys = Resources(cpu_milli=cores * 1000, memory_bytes=mem_gib * GiB, disk_bytes=disk)
    cap = Resources(cpu_milli=cores * 1000 * oc_cpu, memory_bytes=mem_gib * GiB * oc_mem,
                    sandboxes=1000, disk_bytes=disk)
    return NodeSize(node, frozenset(backends), cap, phys)


def test_nothing_known_refuses_nothing() -> None:
    Ceiling().check(backend="simulated", cpu_milli=10**9, memory_bytes=1 << 50)


def test_refuses_what_the_largest_node_cannot_hold_and_says_so() -> None:
    c = Ceiling()
    c.update(_size("small", 2, 8))
    c.update(_size("big", 2, 24))
    c.check(backend="simulated", cpu_milli=1000, memory_bytes=96 * GiB)   # exactly fits big
    with pytest.raises(Unsatisfiable) as ei:
        c.check(backend="simulated", cpu_milli=1000, memory_bytes=1 << 40)
    assert str(ei.value) == (
        "memory=1 TiB is more than any node of this cluster could ever hold (largest: big "
        "with 24 GiB x overcommit 4 = 96 GiB for all its sandboxes); ask for at most 96 GiB")
    assert isinstance(ei.value, InvalidArgument) and ei.value.http_status == 400
    assert ei.value.detail == {"field": "memory_bytes", "requested": 1 << 40,
                               "most": 96 * GiB, "node": "big"}
    with pytest.raises(Unsatisfiable, match=r"cpu=129 cores .* 2 cores x overcommit 64"):
        c.check(backend="simulated", cpu_milli=129_000, memory_bytes=GiB)


def test_only_nodes_offering_the_backend_count() -> None:
    c = Ceiling()
    c.update(_size("sim", 64, 512, backends=("simulated",)))
    c.update(_size("ct", 2, 8, backends=("container",)))
    c.check(backend="simulated", cpu_milli=1000, memory_bytes=100 * GiB)
    with pytest.raises(Unsatisfiable, match="largest: ct"):
        c.check(backend="container", cpu_milli=1000, memory_bytes=100 * GiB)
    c.check(backend="fncall", cpu_milli=1000, memory_bytes=1 << 50)   # nobody: no verdict


def test_each_resource_fits_somewhere_but_not_together() -> None:
    c = Ceiling()
    c.update(_size("cpu-rich", 64, 1, oc_cpu=1, oc_mem=1))
    c.update(_size("mem-rich", 1, 64, oc_cpu=1, oc_mem=1))
    with pytest.raises(Unsatisfiable, match="no single node .* cpu=32 cores and memory=32 GiB"):
        c.check(backend="simulated", cpu_milli=32_000, memory_bytes=32 * GiB)


def test_disk_is_checked_when_asked_and_known() -> None:
    c = Ceiling()
    c.update(_size("n", 2, 8, disk=100 * GiB))
    c.check(backend="simulated", cpu_milli=1000, memory_bytes=GiB, disk_bytes=None)
    with pytest.raises(Unsatisfiable, match=r"disk=200 GiB .* a 100 GiB filesystem"):
        c.check(backend="simulated", cpu_milli=1000, memory_bytes=GiB, disk_bytes=200 * GiB)


def test_a_node_that_grew_is_seen() -> None:
    c = Ceiling()
    c.update(_size("n", 2, 8))
    with pytest.raises(Unsatisfiable):
        c.check(backend="simulated", cpu_milli=1000, memory_bytes=64 * GiB)
    c.update(_size("n", 2, 32))
    c.check(backend="simulated", cpu_milli=1000, memory_bytes=64 * GiB)
    c.remove("n")
    c.check(backend="simulated", cpu_milli=1000, memory_bytes=1 << 50)
