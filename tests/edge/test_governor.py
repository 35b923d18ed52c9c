"""Governor: pure layout detection and limit plans for cgroup v1 and v2."""

from __future__ import annotations

import pytest

from dsec.edge.governor import Limits, detect_layout, limit_writes, parse_proc_cgroup
from dsec.errors import BackendError

V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_SELF = "8:pids:/\n6:freezer:/\n4:memory:/api/abc\n2:cpuacct:/\n1:cpu:/\n0::/\n"
V2_MOUNTINFO = "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"


def test_v1_nests_under_the_edges_own_cgroups() -> None:
    layout = detect_layout(V1_MOUNTINFO, V1_SELF, name="n1", v2_controllers=lambda d: {"hugetlb"})
    assert layout.version == 1
    assert layout.bases["memory"] == "/sys/fs/cgroup/memory/api/abc/dsec-n1"
    assert layout.bases["cpu"] == "/sys/fs/cgroup/cpu/dsec-n1"
    assert set(layout.bases) == {"memory", "cpu", "cpuacct", "pids", "freezer"}
    # best-effort cpu cgroups: one idle parent beside the base, at the edge's own level
    assert layout.be_cpu == "/sys/fs/cgroup/cpu/dsec-n1+be"


def test_the_be_cpu_parent_is_found_and_owned_like_the_base() -> None:
    """Cleanup finds the v1 BE cpu parent where it finds the bases (census parents,
    remove_base), a damaged parents record cannot point at anything else, and the orphan
    sweep files it under its edge's name."""
    from dsec.edge.backends.container.census import _owner, parse_parents
    from dsec.edge.governor import all_leaf_dirs

    leaves = all_leaf_dirs(V1_MOUNTINFO, V1_SELF, name="n1")
    assert "/sys/fs/cgroup/cpu/dsec-n1+be" in leaves
    assert [d for d in leaves if d.endswith("+be")] == ["/sys/fs/cgroup/cpu/dsec-n1+be"]
    lines = ("/sys/fs/cgroup/cpu/dsec-n1+be", "/sys/fs/cgroup/cpu/dsec-n1",
             "/sys/fs/cgroup/cpu/dsec-n1+bee", "/sys/fs/cgroup/cpu/dsec-n2+be",
             "/sys/fs/cgroup/cpu/x/../dsec-n1+be")
    assert parse_parents("\n".join(lines), "n1") == ["/sys/fs/cgroup/cpu/dsec-n1+be",
                                        "/sys/fs/cgroup/cpu/dsec-n1"]
    assert _owner("/sys/fs/cgroup/cpu/dsec-n1+be") == _owner("/x/dsec-n1") == "n1"
    # exact (red team 22, B2): a name may end in ".be"; the BE parent's "+" is in no name
    assert _owner("/x/dsec-n1.be") == "n1.be"
    assert _owner("/x/dsec-n1.be+be") == "n1.be"
    assert _owner("/x/dsec+edge") is None and _owner("/x/dsec-a+b") is None


def test_no_dir_dsec_makes_at_the_edges_level_is_two_names_dirs() -> None:
    """Every name valid_cgroup_name accepts owns ``dsec-<name>`` and ``dsec-<name>+be``;
    no two names (nor the v2 edge leaf) share one, whatever the names."""
    from dsec.edge.governor import EDGE_LEAF, cgroup_leaf_names, cgroup_owner, valid_cgroup_name

    names = ["x", "x.be", "x-be", "x_be", "be", "edge", "x.be.be", "dsec-x", "a.b"]
    seen: dict[str, str] = {}
    for n in names:
        assert valid_cgroup_name(n)
        for leaf in cgroup_leaf_names(n):
            assert leaf not in seen, f"{leaf} is both {seen[leaf]!r}'s and {n!r}'s"
            seen[leaf] = n
            assert cgroup_owner(leaf) == n
    assert EDGE_LEAF not in seen and cgroup_owner(EDGE_LEAF) is None
    for bad in ("x+be", "", ".x", "a/b", "x" * 65, "dsec+edge"):
        assert not valid_cgroup_name(bad)


def test_v2_is_preferred_when_it_has_the_controllers() -> None:
    layout = detect_layout(V2_MOUNTINFO, "0::/user/edge\n", name="n1",
                           v2_controllers=lambda d: {"memory", "cpu", "pids", "io"})
    assert layout.version == 2 and layout.v2_own == "/sys/fs/cgroup/user/edge"
    assert layout.bases == {"unified": "/sys/fs/cgroup/user/edge/dsec-n1"}
    assert layout.be_cpu == ""   # v2: BE stays under the base (the node's totals are there)


def test_no_usable_hierarchy_is_a_clear_error() -> None:
    with pytest.raises(BackendError, match="no usable cgroup hierarchy"):
        detect_layout(V2_MOUNTINFO, "0::/\n", name="n", v2_controllers=lambda d: set())


def test_limit_plans() -> None:
    lim = Limits(cpu_milli=1500, memory_bytes=1 << 30, pids_max=None)
    v1 = {(c, f): v for c, f, v in limit_writes(1, lim, memsw=True)}
    assert v1[("memory", "memory.memsw.limit_in_bytes")] == str(1 << 30)
    assert v1[("cpu", "cpu.cfs_quota_us")] == "150000" and v1[("cpu", "cpu.shares")] == "1536"
    assert v1[("pids", "pids.max")] == "max"
    v2 = {f: v for _, f, v in limit_writes(2, lim)}
    assert v2["memory.swap.max"] == "0" and v2["cpu.max"] == "150000 100000"
    assert 1 <= int(v2["cpu.weight"]) <= 10000
    assert parse_proc_cgroup("3:cpu,cpuacct:/x\n")["cpuacct"] == "/x"


# ------------------------------------------------------------------ pid budgets
def test_pids_budget_keeps_the_headroom_and_caps_one_sandbox() -> None:
    from dsec.edge.governor import pids_budget

    assert pids_budget(32768, headroom=4096, max_sandbox=8192) == (28672, 8192)
    # a per-sandbox cap above what all sandboxes together may have is lowered to it
    assert pids_budget(10_000, headroom=4096, max_sandbox=8192) == (5904, 5904)
    with pytest.raises(ValueError, match="pids_headroom=32768 must be >= 0 and below "
                                         "kernel.pid_max=32768"):
        pids_budget(32768, headroom=32768, max_sandbox=1)
    with pytest.raises(ValueError, match="max_sandbox_pids=0 must be >= 1"):
        pids_budget(32768, headroom=0, max_sandbox=0)


def test_the_pid_budget_is_split_between_the_tiers_of_a_host() -> None:
    """Red team 21, A5: each backend took the whole budget, so two tiers on one host could
    together hold twice the host's pids."""
    from dsec.edge.governor import TIER_PIDS_WEIGHTS, pids_budget, pids_share, pids_split

    # backends made alone assume every tier may run beside them: all together fit
    assert sum(pids_share(t) for t in TIER_PIDS_WEIGHTS) == pytest.approx(1.0)
    totals = [pids_budget(32768, headroom=4096, max_sandbox=8192, share=pids_share(t))[0]
              for t in TIER_PIDS_WEIGHTS]
    assert sum(totals) <= 28672 and min(totals) >= 1024
    # an edge splits the budget between the tiers it runs; one tier gets all of it
    assert pids_split(("container",)) == {"container": 1.0}
    split = pids_split(("container", "gvisor", "simulated", "gvisor"))
    assert set(split) == {"container", "gvisor"} and sum(split.values()) == pytest.approx(1)
    assert split["container"] > split["gvisor"]
    # ... within its own share of the host when several edges share it (dsec up)
    assert sum(pids_split(("container", "vm", "fncall"), 0.25).values()) == pytest.approx(0.25)
    assert pids_budget(32768, headroom=4096, max_sandbox=8192, share=0.25) == (7168, 7168)
    for bad in (0, -0.5, 1.5, 1e-9):
        with pytest.raises(ValueError, match="pids_share"):
            pids_budget(32768, headroom=4096, max_sandbox=8192, share=bad)


def test_sandbox_pids_is_the_spec_or_the_node_maximum() -> None:
    from dsec.edge.governor import sandbox_pids
    from dsec.errors import InvalidArgument

    assert sandbox_pids(None, 8192) == 8192          # "no cap" gets the node's maximum
    assert sandbox_pids(100, 8192) == 100
    assert sandbox_pids(8192, 8192) == 8192
    with pytest.raises(InvalidArgument, match="pids_max=8193 is above this node's "
                                               "per-sandbox maximum of 8192 tasks") as e:
        sandbox_pids(8193, 8192)
    assert e.value.detail["field"] == "pids_max"


def test_mountinfo_mountpoints_are_unescaped_fully() -> None:
    """mountinfo escapes space, tab, newline and backslash (octal): a cgroup hierarchy
    mounted at such a path is found at its real path, not at the escaped text."""
    from dsec.edge.governor import parse_mountinfo
    line = ("35 24 0:30 / /sys/fs/cgroup/we\\011ird\\134dir\\040x rw,nosuid - cgroup "
            "cgroup rw,memory\n")
    (m,) = parse_mountinfo(line)
    assert m.mountpoint == "/sys/fs/cgroup/we\tird\\dir x"
    assert "memory" in m.super_options
