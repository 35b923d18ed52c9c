"""The container suite's behaviour tests, run unchanged on the gvisor tier (the
``backend`` fixture of this directory is a runsc ContainerBackend).

Not run here, and why:
- test_exec.test_bad_input_leaves_nothing: it asserts ``governor.list_sandboxes()`` is
  empty after a refused create, which holds, but then creates with SPEC only - covered by
  test_create_exec_destroy; kept to the native suite to save time.
- test_files.test_escapes_resolve_inside_the_root: the same escapes, except that
  ``/proc/1/root/...`` is refused by path (InvalidArgument) before any resolution, not by
  the magic-link rule: test_gvisor.py::test_file_escapes_stay_inside.
- test_hostile.test_privileged_calls_are_denied: every attempt fails on gVisor too (the
  native seccomp profile applies to execs there, see runsc.py), but it reads
  ``NoNewPrivs`` from /proc/self/status, a line gVisor's procfs does not have:
  test_gvisor.py::test_privileged_calls_fail_or_stay_in_the_sentry runs the same attempts.
- test_lifecycle.test_pause_reclaims_and_resume_thaws: it fills /tmp as memory and
  expects it not on the disk; on gVisor /tmp is the disk (see runsc.py):
  test_gvisor.py::test_pause_freezes_and_resume_thaws.
- test_files.test_only_the_sandboxes_own_filesystems_are_reachable: on gVisor /proc,
  /sys and /dev are the Sentry's, not host mounts: the file API refuses them by path
  (test_gvisor.py::test_sentry_mounts_are_refused_by_the_file_api).
- test_hostile.test_memory_bomb_is_oom_killed_and_reported: on gVisor a memory limit hit
  OOM-kills the Sentry, so the whole sandbox stops (test_gvisor.py covers that event).
- test_hostile.test_fork_bomb_hits_pids_max (native, userns variants): user namespaces
  are the native driver's; the pids limit is covered by test_gvisor.py.
- test_hostile.test_cannot_reach_host_sockets: binds a host unix socket into the image
  dir; gVisor refuses host sockets by design (--host-uds=none), checked in
  tests/security/test_gvisor_surface.py.
- test_lifecycle.test_sandboxes_survive_edge_kill_9 / test_no_leaks_over_200_cycles:
  the edge-restart adoption is shared code (test_gvisor.py adopts once); 200 cycles at
  ~0.3 s each is over this tier's test budget.
"""

from __future__ import annotations

import pytest

from tests.edge.container.test_exec import (
    test_background_process_outlives_exec,
    test_create_exec_destroy,
    test_env_cwd_user_stdin,
    test_output_cap_truncates_and_yes_does_not_fill_memory,
    test_stream_yields_chunks_then_result,
    test_timeout_kills_process_group,
)
from tests.edge.container.test_exec_errors import _check
from tests.edge.container.test_files import (
    test_file_roundtrip,
    test_symlink_race_stays_inside,
    test_write_creates_missing_parents_inside_the_root,
)
from tests.edge.container.test_hostile import (
    test_cannot_see_other_sandboxes,
    test_overwriting_bin_sh_stays_in_its_sandbox,
)

pytestmark = pytest.mark.root

__all__ = [
    "test_background_process_outlives_exec", "test_cannot_see_other_sandboxes",
    "test_create_exec_destroy", "test_env_cwd_user_stdin",
    "test_file_roundtrip", "test_output_cap_truncates_and_yes_does_not_fill_memory",
    "test_overwriting_bin_sh_stays_in_its_sandbox", "test_stream_yields_chunks_then_result",
    "test_symlink_race_stays_inside", "test_timeout_kills_process_group",
    "test_write_creates_missing_parents_inside_the_root",
]


async def test_exec_that_cannot_start_is_cannot_run(backend: object) -> None:
    """Background: CannotRun with 127/126; foreground: that exit code and 'cannot run'."""
    await _check(backend, foreground_codes=True)  # type: ignore[arg-type]
