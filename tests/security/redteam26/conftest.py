"""Red team 26 (memory groups, VM resume re-creating cgroups, reconcile re-claim):
shared fixtures and helpers."""

from __future__ import annotations

import os

from dsec.wire.spec import SandboxSpec
from tests.security.conftest import images_dir, probe_binary  # noqa: F401  (pytest fixtures)

MIB = 1 << 20


def spec(project: str, mib: int = 64, qos: str | None = None) -> SandboxSpec:
    return SandboxSpec(backend="container", memory_bytes=mib * MIB, pids_max=64,
                       project=project, qos=qos)  # type: ignore[arg-type]


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def group_file(gdir: str, name: str) -> int:
    return int(read(os.path.join(gdir, name)).split()[0])


def oom_kills(gdir: str) -> int:
    for line in read(os.path.join(gdir, "memory.oom_control")).splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return 0
