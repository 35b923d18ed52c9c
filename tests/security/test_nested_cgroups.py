"""``allow_nested`` sandboxes cannot reach their own cgroups.

``allow_nested`` lets the namespace and mount calls through seccomp so that a sandbox can
build user namespaces of its own (bwrap, rootless tools). Without a user namespace of the
sandbox (``user_namespace=False``) its root is host uid 0, and a user namespace it makes
may map host uid 0 to its root. A cgroup namespace made together with it is owned by that
user namespace, so cgroupfs mounts there - rooted at the sandbox's own cgroup - and the
cgroup files are owned by host uid 0: before the fix an agent raised its own ``pids.max``,
``memory.limit_in_bytes`` and CFS quota (both drivers), escaping every limit of its spec.
Found by the rt-kernel review; new cgroup namespaces are refused now (seccomp, any way
they are asked for), while the rest of ``allow_nested`` keeps working.
"""

from __future__ import annotations

import os

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import SandboxSpec
from tests.security.conftest import new_sid, probe

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

NESTED = SandboxSpec(backend="container", toolkits=("probe",), memory_bytes=256 << 20,
                     pids_max=64, cpu_milli=500, allow_nested=True)

# (controller, file, value): each would lift a limit of the sandbox (the file is the
# sandbox's own: the root of the nested cgroup namespace's view)
WRITES = [("pids", "pids.max", "max"),
          ("cpu", "cpu.cfs_quota_us", "-1"),
          ("memory", "memory.memsw.limit_in_bytes", str(64 << 30)),
          ("memory", "memory.limit_in_bytes", str(64 << 30))]


def _limits(b: ContainerBackend, sid: str) -> dict[str, str]:
    cg = b.governor.paths(sid)
    out = {}
    for ctrl, fname, _ in WRITES:
        path = os.path.join(cg.dirs[ctrl], fname)
        if os.path.exists(path):
            with open(path) as f:
                out[fname] = f.read().strip()
    return out


async def _cannot_lift_limits(b: ContainerBackend, spec: SandboxSpec) -> None:
    sid = new_sid()
    await b.create(sid, spec)
    before = _limits(b, sid)
    assert before["pids.max"] == "64", before
    # the nesting the flag is for still works
    assert (await probe(b, sid, "nested_userns_tmpfs"))[1] == "ok"
    let_through = []
    for how in ("unshare", "clone", "clone3"):
        for ctrl, fname, value in WRITES:
            _, word = await probe(b, sid, "nested_cgroupfs", ctrl, fname, value, how)
            if word == "ok":
                let_through.append((how, fname))
    assert not let_through, f"the sandbox wrote its own cgroup limits: {let_through}"
    assert _limits(b, sid) == before


async def test_native_nested_sandbox_cannot_lift_its_cgroup_limits(
        backend: ContainerBackend) -> None:
    await _cannot_lift_limits(backend, NESTED)


async def test_native_nested_userns_sandbox_cannot_lift_its_cgroup_limits(
        backend: ContainerBackend) -> None:
    """With a user namespace of its own the sandbox's root is an unprivileged host uid:
    its cgroup files were never writable, and the cgroup namespace is refused too."""
    await _cannot_lift_limits(backend, SandboxSpec(
        backend="container", toolkits=("probe",), memory_bytes=256 << 20, pids_max=64,
        cpu_milli=500, allow_nested=True, user_namespace=True))


async def test_runc_nested_sandbox_cannot_lift_its_cgroup_limits(
        runc_backend: ContainerBackend) -> None:
    await _cannot_lift_limits(runc_backend, NESTED)


async def test_nested_sandbox_cannot_mount_the_hosts_unified_hierarchy(
        backend: ContainerBackend) -> None:
    """On a hybrid host the sandbox sits in the edge's v2 cgroup (here the root): a view of
    it would let the sandbox make host cgroups and freeze or kill other v2 cgroups."""
    sid = new_sid()
    await backend.create(sid, NESTED)
    code, word = await probe(backend, sid, "nested_cgroupfs", "unified", "cgroup.procs",
                             "0", "unshare")
    assert word != "ok" and word.startswith("E"), (code, word)
