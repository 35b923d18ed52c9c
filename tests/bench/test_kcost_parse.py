"""dsec.bench.kcost's pure parts: /proc/slabinfo parsing, per-sandbox growth, and the
superblocks one sandbox holds alone (from two sandboxes' mountinfo)."""

from __future__ import annotations

from dsec.bench.kcost import own_superblocks, slab_growth, slabinfo

SLAB0 = """slabinfo - version: 2.1
# name            <active_objs> <num_objs> <objsize> <objperslab> <pagesperslab> : tunables <limit> <batchcount> <sharedfactor> : slabdata <active_slabs> <num_slabs> <sharedavail>
kmalloc-1k          1000   1024   1024   32    8 : tunables    0    0    0 : slabdata     32     32      0
dentry              5000   5040    192   21    1 : tunables    0    0    0 : slabdata    240    240      0
"""
SLAB1 = SLAB0.replace("kmalloc-1k          1000", "kmalloc-1k          4220").replace(
    "dentry              5000", "dentry              4900") + (
    "mnt_cache            240    240    384   21    2 : tunables 0 0 0 : slabdata 12 12 0\n")


def test_slab_growth_per_sandbox_biggest_first_and_shrinking_caches_left_out() -> None:
    a, b = slabinfo(SLAB0), slabinfo(SLAB1)
    assert a["kmalloc-1k"] == (1000, 1024) and "slabinfo" not in a
    rows = slab_growth(a, b, 10)
    assert rows == [("kmalloc-1k", 322.0, 322.0), ("mnt_cache", 24.0, 9.0)]


def test_own_superblocks_are_what_no_other_sandbox_shares() -> None:
    def line(mid: int, dev: str, point: str, fstype: str) -> str:
        return f"{mid} 1 {dev} / {point} rw - {fstype} x rw"
    shared = [line(1, "0:50", "/sys", "sysfs"), line(2, "0:51", "/tmp", "tmpfs")]
    a = "\n".join([line(3, "0:60", "/", "overlay"), line(4, "0:61", "/proc", "proc"),
                   *shared])
    b = "\n".join([line(3, "0:70", "/", "overlay"), line(4, "0:71", "/proc", "proc"),
                   *shared])
    assert own_superblocks([a, b]) == ["overlay", "proc"]
    assert own_superblocks([a, a]) == []
