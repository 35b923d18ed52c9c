"""The real order of fsync and rename syscalls, for durability tests: what the next start
(or a client) trusts under a name must be on disk before the rename gives it that name,
and the rename itself durable (its directory fsynced) after it. A write then rename
alone survives kill -9 (the page cache) but not a power loss, where the renamed file can
come back empty. The syscalls run for real; they are only recorded."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pytest

Call = tuple[str, ...]


def record_syscalls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """From now on, every ``os.fsync`` (as ``("fsync", path)``) and every ``os.rename``
    / ``os.replace`` / ``os.link`` (as ``("rename", src, dst)``), in order, real paths."""
    calls: list[Call] = []
    real_fsync, real_rename, real_replace, real_link = os.fsync, os.rename, os.replace, os.link

    def fsync(fd: Any) -> None:
        n = fd if isinstance(fd, int) else fd.fileno()
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{n}")))
        real_fsync(fd)

    def moved(real: Any) -> Any:
        def call(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
            calls.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
            real(src, dst, *args, **kw)
        return call

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", moved(real_rename))
    monkeypatch.setattr(os, "replace", moved(real_replace))
    monkeypatch.setattr(os, "link", moved(real_link))
    return calls


def assert_durable(calls: list[Call], final: str, *, inside: Iterable[str] = ()) -> None:
    """``final`` was made by a rename whose source (and, for a directory, each of
    ``inside``: names in it) was fsynced before it, and ``final``'s directory after it."""
    final = os.path.realpath(final)
    at = next((i for i, c in enumerate(calls) if c[0] == "rename" and c[2] == final), None)
    assert at is not None, f"no rename to {final}: {calls}"
    src = calls[at][1]
    synced = {c[1] for c in calls[:at] if c[0] == "fsync"}
    need = {src, *(os.path.join(src, n) for n in inside)}
    assert need <= synced, f"not fsynced before the rename to {final}: {need - synced}; {calls}"
    assert ("fsync", os.path.dirname(final)) in calls[at + 1:], \
        f"{os.path.dirname(final)} not fsynced after the rename: {calls}"
