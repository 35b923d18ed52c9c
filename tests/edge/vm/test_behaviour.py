"""The container suite's behaviour tests, run unchanged on the vm tier (the ``backend``
of this module is a vm backend as a node makes it: tests/edge/vm/behaviour_fixtures.py).

One backend and one warm-pool template serve the whole module, and after every test
``no_leftovers`` asserts the host keeps nothing of the test's sandboxes (no QEMU
process, directory or cgroup). ``make test`` runs the smoke set (two warm-pool
templates booted side by side, then ~1-2 s per create: 50-60 s at load 9-15, most of it the two boots);
``DSEC_VM_FULL=1`` adds the tests that boot VMs cold (snapshot clones and a backend of
their own for test_snapshot.py's image, a 64 MiB guest), the symlink race, pause and
the other-sandbox visibility test (~3-4 min more under load).

Two tests are xfail(strict=True): real gaps of the vm tier, reported:
- test_hostile.test_memory_bomb_is_oom_killed_and_reported: a sandbox of less than ~80
  MiB cannot start (QEMU exits at boot with no message; 64 and 72 MiB fail, 80 boots),
  while qemu.memory_mib's floor is 64 MiB.
- test_hostile.test_fork_bomb_hits_pids_max[plain]: spec.pids_max is not applied in
  the guest.

A few tests run unchanged up to one container-only assertion at their end; the wrapper
here asserts that exactly that assertion is what differs, then checks the vm's own
equivalent:
- test_files.test_file_roundtrip: its last line reads the write from the upper dir on
  the host; the vm's upper dir is inside the guest (on its scratch disk), so the wrapper
  reads it back through the guest instead.
- test_files.test_escapes_resolve_inside_the_root: ``/proc/1/root/...`` is refused with
  ELOOP as on the container tier, as InvalidArgument (the agent's class for ELOOP, a
  4xx) where the container tier says SandboxError.
- test_hostile.test_cannot_see_other_sandboxes: the other sandbox's files and processes
  are invisible, but ``ls /proc`` lists the guest's kernel threads and its agent (the
  guest kernel is the sandbox's own; no pid namespace inside it), so not "<= 4".
- test_lifecycle.test_pause_reclaims_and_resume_thaws (full set): pause stops QEMU
  after saving guest memory to a file, nothing is frozen: the wrapper checks the
  reclaim figures, then resumes and compares the data.

Not run here, and why:
- test_exec.test_create_exec_destroy: asserts the container's init (``/dev/.init``) as
  pid 1 and the upper dir on the host; its exec/hostname/idempotent-destroy checks hold
  and are made by test_background_process_outlives_exec, test_bad_input_leaves_nothing
  and tests/edge/vm/test_backend.py.
- test_hostile.test_privileged_calls_are_denied: by design (docs/vm.md, "Trust") code
  in a vm sandbox is root in its own guest kernel (mount, umount, sysctl, reboot act on
  that guest only); the boundary is the VM, tested in tests/edge/vm/test_hostile_agent.py.
- test_files.test_only_the_sandboxes_own_filesystems_are_reachable: the guest's /proc,
  /sys and /dev are the sandbox's own kernel's, so the file API serves them (the
  container tier refuses them because the edge acts as host root there).
- test_hostile.test_fork_bomb_hits_pids_max[userns]: the vm tier refuses
  user_namespace (InvalidArgument naming the tier).
- test_lifecycle.test_sandboxes_survive_edge_kill_9: a vm's edge-kill path is
  tests/edge/vm/test_backend.py::test_reconcile_after_edge_kill9 (one cold boot in a
  child edge; adoption of a live QEMU is backend.adopt, same code).
- test_lifecycle.test_no_leaks_over_200_cycles: 200 creates at ~1-2 s each is over this
  tier's budget: test_no_leaks_over_cycles below runs 8 of its kinds of cycle (and
  every test here ends with the leak check).
- test_snapshot.test_paused_sandbox_stays_paused_and_strip and
  test_disk_capped_sandbox_snapshots_and_restores: they assert the container's freezer
  state and its disk-pool path of the upper dir; a paused vm's snapshot is in
  tests/edge/vm/test_backend.py::test_lifecycle_files_snapshot_pause_resume.
- test_exec_errors.test_runc_*, test_limits, test_processes, test_ports, test_nofile,
  test_userns, test_runc, test_nsexec, test_disk*, test_overlay_flags, test_qos and the
  other container-mechanism modules: they test the container runtimes' own machinery
  (runc, helper processes, host disk pool, PTYs and port tunnels, which the vm tier
  refuses with InvalidArgument naming the tier).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import pytest

from dsec.errors import BackendError, Conflict, DsecError, InvalidArgument
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container import test_files, test_hostile, test_lifecycle, test_snapshot
from tests.edge.container.conftest import SPEC, images_dir, new_sid  # noqa: F401
from tests.edge.container.test_exec import (
    test_background_process_outlives_exec,
    test_bad_input_leaves_nothing,
    test_env_cwd_user_stdin,
    test_output_cap_truncates_and_yes_does_not_fill_memory,
    test_stream_yields_chunks_then_result,
    test_timeout_kills_process_group,
)
from tests.edge.container.test_exec_errors import _check
from tests.edge.container.test_files import test_write_creates_missing_parents_inside_the_root
from tests.edge.container.test_hostile import (
    test_cannot_reach_host_sockets,
    test_overwriting_bin_sh_stays_in_its_sandbox,
)
from tests.edge.vm.behaviour_fixtures import (  # noqa: F401
    backend,
    env,
    no_leftovers,
    vm_images,
)

pytestmark = [pytest.mark.root, pytest.mark.asyncio(loop_scope="module")]

FULL = os.environ.get("DSEC_VM_FULL") == "1"
full = pytest.mark.skipif(not FULL, reason="by design: vm full behaviour set (cold boots): "
                                           "DSEC_VM_FULL=1")

__all__ = [
    "test_background_process_outlives_exec", "test_bad_input_leaves_nothing",
    "test_cannot_reach_host_sockets", "test_env_cwd_user_stdin",
    "test_output_cap_truncates_and_yes_does_not_fill_memory",
    "test_overwriting_bin_sh_stays_in_its_sandbox", "test_stream_yields_chunks_then_result",
    "test_timeout_kills_process_group", "test_write_creates_missing_parents_inside_the_root",
]


def _only_sandbox(b: Any) -> str:
    (sid,) = b._vms
    return str(sid)


async def test_exec_that_cannot_start_is_cannot_run(backend: Any) -> None:  # noqa: F811
    """Background: CannotRun with 127/126; foreground: that exit code and 'cannot run'."""
    await _check(backend, foreground_codes=True)


async def test_file_roundtrip(backend: Any) -> None:  # noqa: F811
    upper_motd = re.escape(os.path.join("upper", "etc", "motd"))
    with pytest.raises(FileNotFoundError, match=upper_motd):
        await test_files.test_file_roundtrip(backend)
    assert await backend.read_file(_only_sandbox(backend), "/etc/motd") == b"x"


async def test_escapes_resolve_inside_the_root(backend: Any, tmp_path: Any) -> None:  # noqa: F811
    with pytest.raises(InvalidArgument, match="Too many levels of symbolic links"):
        await test_files.test_escapes_resolve_inside_the_root(backend, tmp_path)


@full  # structural on this tier (another kernel), and a `find /` under TCG: ~10 s
async def test_cannot_see_other_sandboxes(backend: Any) -> None:  # noqa: F811
    with pytest.raises(AssertionError, match=r"<= 4"):
        await test_hostile.test_cannot_see_other_sandboxes(backend)
    a, b = sorted(backend._vms)
    for me, other in ((a, b), (b, a)):
        r = await backend.exec(me, ExecRequest(shell="cat /proc/mounts /proc/cmdline; "
                                                     "ls /proc/*/cmdline | wc -l"))
        out = r.stdout.decode()
        assert backend.root_dir not in out and other not in out, out


@full
async def test_symlink_race_stays_inside(backend: Any, tmp_path: Any) -> None:  # noqa: F811
    await test_files.test_symlink_race_stays_inside(backend, tmp_path)


@full
async def test_pause_reclaims_and_resume_restores(backend: Any) -> None:  # noqa: F811
    with pytest.raises(AssertionError, match="is_frozen"):
        await test_lifecycle.test_pause_reclaims_and_resume_thaws(backend)
    sid = _only_sandbox(backend)
    vm = backend._vms[sid]
    assert sid not in backend._qemu_pids() and os.path.getsize(os.path.join(vm.dir, "mem.bin"))
    assert backend.governor.memory_usage(vm.cg) < (8 << 20)
    with pytest.raises(Conflict, match="paused"):   # the node resumes first (auto_resume)
        await backend.exec(sid, ExecRequest(argv=("true",)))
    await backend.resume(sid)
    r = await backend.exec(sid, ExecRequest(shell="wc -c < /tmp/blob; ps -o args | "
                                                  "grep -c '^sleep 1000'"))
    assert r.stdout.split() == [b"41943040", b"1"], r   # the file and the process are back


@full
@pytest.mark.xfail(strict=True, raises=BackendError, reason="a vm sandbox with less than "
                   "~80 MiB cannot start: QEMU exits at boot with no message (measured: 64 and "
                   "72 MiB fail, 80 MiB boots; qemu.memory_mib's floor is 64 MiB)")
async def test_memory_bomb_is_oom_killed_and_reported(backend: Any) -> None:  # noqa: F811
    await test_hostile.test_memory_bomb_is_oom_killed_and_reported(backend)


@full
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the vm tier does not apply spec.pids_max inside "
                   "the guest (setup has no pids limit; the QEMU cgroup's pids cap counts "
                   "QEMU's threads): a fork bomb is bounded by guest memory only")
async def test_fork_bomb_hits_pids_max(backend: Any) -> None:  # noqa: F811
    await test_hostile.test_fork_bomb_hits_pids_max(backend, userns=False)


@full
async def test_snapshot_chain_restores_exact_trees(env: Any) -> None:  # noqa: F811
    await test_snapshot.test_chain_restores_exact_trees(env)


@full
async def test_incremental_snapshot_of_a_clone_and_in_use(env: Any) -> None:  # noqa: F811
    await test_snapshot.test_incremental_snapshot_of_a_clone_and_in_use(env)



def _leak_counts(b: Any) -> tuple[object, ...]:
    """What a vm sandbox can leave on the host, for this backend: QEMU processes,
    sandbox dirs, cgroups, layer mounts, the edge's open descriptors, uid claims."""
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for line in f if line.split()[4].startswith(b.images.cache.root))
    mine = f"{b.key} "
    claims = 0
    for n in os.listdir(b.uid_dir):
        with contextlib.suppress(OSError), open(os.path.join(b.uid_dir, n)) as f:
            claims += f.read(200).startswith(mine)
    return (b._qemu_pids(), sorted(os.listdir(os.path.join(b.root_dir, "sb"))),
            b.governor.list_sandboxes(), mounts, len(os.listdir("/proc/self/fd")), claims)


async def test_no_leaks_over_cycles(backend: Any) -> None:  # noqa: F811
    """test_lifecycle.test_no_leaks_over_200_cycles at this tier's scale: creates that
    work (an exec, a timed-out exec, a background process) and creates that fail early
    (no such image, a bad spec) or half-way (a guest too small to boot: QEMU started,
    cgroup, disk and uid made), then destroy: the host is back where it was."""
    warm = new_sid()
    await backend.create(warm, SPEC)
    await backend.destroy(warm)
    before = _leak_counts(backend)
    failures = 0
    for i in range(8):
        sid = new_sid()
        kind = i % 4
        try:
            if kind == 1:
                await backend.create(sid, SandboxSpec(backend="container", image="missing"))
            elif kind == 2:
                await backend.create(sid, SandboxSpec(backend="container", cpu_milli=0))
            elif kind == 3 and i == 3:    # boots cold: once
                await backend.create(sid, SandboxSpec(backend="container",
                                                      memory_bytes=64 << 20))
            else:
                await backend.create(sid, SPEC)
                r = await backend.exec(sid, ExecRequest(shell="sleep 5", timeout_s=0.05)
                                       if i % 2 else ExecRequest(shell="sleep 100",
                                                                 background=True))
                assert r.timed_out or r.pid
        except DsecError:
            failures += 1
        finally:
            await backend.destroy(sid)
    assert failures >= 4          # the missing images and bad specs (+ the small guest)
    assert _leak_counts(backend) == before
