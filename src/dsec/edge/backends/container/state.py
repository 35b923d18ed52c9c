"""The on-disk record of one container sandbox, for re-adoption after an edge restart.

Written atomically (tmp + rename) into ``<root_dir>/sb/<sid>/state.json`` once the
sandbox is exec-ready. The init's pid plus its start time (``/proc/<pid>/stat`` field 22)
identify the process across restarts without being fooled by pid reuse; cgroup membership
is checked as a second witness.
"""

from __future__ import annotations

import os

import msgspec

from dsec.wire.spec import SandboxSpec

__all__ = ["BoxRecord", "load_record", "save_record"]


class BoxRecord(msgspec.Struct, kw_only=True):
    sid: str
    runtime: str
    spec: SandboxSpec
    init_pid: int
    init_start: int
    cgroup_version: int
    cgroup_dirs: dict[str, str]
    lowerdirs: list[str]
    created_at: float


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(BoxRecord)


def save_record(path: str, rec: BoxRecord) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(_enc.encode(rec))
    os.replace(tmp, path)


def load_record(path: str) -> BoxRecord | None:
    """The record at ``path``, or None if it is missing or unreadable (half-written)."""
    try:
        with open(path, "rb") as f:
            return _dec.decode(f.read())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


