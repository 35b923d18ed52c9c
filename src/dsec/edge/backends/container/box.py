"""What the container backend holds in memory for one live sandbox.

:class:`Box` is shared by the backend and its helpers (the runc driver, snapshots), which
import it from here rather than from the backend module: they sit below the backend, and
the backend imports them (issue 13 broke the ``backend -> runc -> backend`` cycle this
way). The on-disk record that survives an edge restart is :class:`.state.BoxRecord`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dsec.edge.backends.container.images import RootLayers
from dsec.edge.governor import ExecCgroup, SandboxCgroup
from dsec.ids import SandboxId
from dsec.wire.spec import SandboxSpec

__all__ = ["Box"]


@dataclass(slots=True, eq=False)
class Box:
    """One live sandbox of a :class:`~.backend.ContainerBackend` (see its module docstring)."""

    sid: SandboxId
    spec: SandboxSpec
    dir: str
    cg: SandboxCgroup
    layers: RootLayers
    upper: str = ""
    work: str = ""
    pids_max: int | None = None   # the effective task limit (spec.pids_max capped)
    disk_cap: int = 0             # the effective disk cap (spec.disk_bytes or the default)
    disk_q: str = ""              # sysfs dir of its qgroup (usage counters), "" if none
    init_pid: int = 0
    init_start: int = 0           # the init's start time (/proc/<pid>/stat): who init_pid is
    # A pidfd of the init held for the sandbox's life: only for the runc driver and adopted
    # sandboxes (-1 otherwise). A native sandbox holds no descriptor while idle (issue 22:
    # 10,000 sandboxes ran the edge out of them): its init's death is reported by the
    # zygote (the create request's id, ``watch_rid``), and a pidfd is opened per operation
    # and checked against ``init_start`` (Backend._init_fd).
    pidfd: int = -1
    watch_rid: int = 0            # the zygote reports the init's exit under this id (0: not)
    netns_fd: int = -1            # the router slot's netns it joined (the router's fd)
    oom_fd: int | None = None
    oom_seen: int = 0
    #: set when the edge itself kills every process of the sandbox (a memory group's
    #: lowering deadline): the reason its init's death is reported with
    kill_reason: str = ""
    pids_seen: int = 0            # pids.events "max" already reported
    # exec cgroups whose command exited normally but left processes behind (daemons a
    # foreground command started): removed once empty, or with the sandbox
    lingering: list[ExecCgroup] = field(default_factory=list)
    lingering_checked: float = 0.0
    paused: bool = False
    # the exec helper (nsexec.c, do_helper): the id of the request that started it while
    # it runs (0: none), a start in flight, and how often one died or failed to start
    # (at HELPER_MAX_FAILS the per-exec path serves this sandbox for good)
    helper: int = 0
    helper_start: asyncio.Future[int] | None = None
    helper_fails: int = 0
    # its host pid and that pid's start time (a retirement signals only that process),
    # execs it serves now, when it last served one (monotonic), and the request id of a
    # helper being retired for idleness (its exit is then no failure)
    helper_pid: int = 0
    helper_pid_start: int = 0
    helper_busy: int = 0
    helper_used: float = 0.0
    helper_retiring: int = 0
    dying: bool = False
    adopted: bool = False
    exited: asyncio.Event = field(default_factory=asyncio.Event)
