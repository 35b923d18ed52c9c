"""What the host spends on a sandbox beyond what its memory cgroup is charged (issue 22).

A sandbox's memory cgroup is charged for its processes' pages and most kernel memory they
allocate (the init's stack and page tables, the slab of the namespaces the intermediate
creates after joining the cgroup, tmpfs files). Not charged to it: its cgroups' own
structures (allocated by the edge's ``mkdir``), the superblocks of its mounts, and above
all its memcg's **shrinker map** - one slot per memcg-aware shrinker id on the host, in
units of 64 ids that take 1 KiB each (520 bytes in the 1 KiB slab class), allocated for the
highest id in use and never shrunk (docs/container.md, "Density"). Every superblock is a
shrinker, so that term is ~(superblocks on the host)/64 KiB per sandbox: quadratic in the
sandbox count overall.

:func:`uncharged_bytes` estimates that part for ``SandboxStats.memory_host_bytes``. The
shrinker term counts this backend's own superblocks at their peak (the kernel's map never
shrinks) - a lower bound, since the host's and other backends' superblocks count too. The
constants are from ``python -m dsec.bench.kcost`` on the dev VM (n=1,000); the density
bench prints the measured host delta next to this estimate.
"""

from __future__ import annotations

__all__ = ["SUPERBLOCKS_PER_SANDBOX", "uncharged_bytes"]

#: overlay root, the scratch tmpfs (/dev, /dev/shm, /tmp, masks), devpts, sysfs, proc and
#: the mqueue superblock of its ipc namespace (native driver; 9 before issue 22)
SUPERBLOCKS_PER_SANDBOX = 6
#: struct mem_cgroup + per-node info + per-cpu stats, outside the shrinker map (estimate)
_MEMCG_BASE = 16 << 10
#: the cpu, cpuacct, pids and freezer cgroups (kcost: 7.5 + 3.7 + 3.4 + 2.8 KiB)
_OTHER_CGROUPS = 17 << 10
#: a superblock's own structures (kcost: 1-8 KiB of slab each, ~4 on average)
_SUPERBLOCK = 4 << 10


def uncharged_bytes(peak_sandboxes: int) -> int:
    """Kernel memory the host spends on one sandbox outside its memory cgroup, with
    ``peak_sandboxes`` the most sandboxes this backend has held at once. Pure."""
    ids = max(1, peak_sandboxes) * SUPERBLOCKS_PER_SANDBOX
    shrinker_map = -(-ids // 64) * 1024
    return _MEMCG_BASE + _OTHER_CGROUPS + SUPERBLOCKS_PER_SANDBOX * _SUPERBLOCK + shrinker_map
