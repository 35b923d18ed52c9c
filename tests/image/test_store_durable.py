"""What the layer store answers "done" to survives a power loss, not only kill -9: every
file it publishes is fsynced before its rename, and the directory after. A power loss
cannot be made in a test; the order of the real syscalls is what is checked (os.fsync
and os.replace wrapped to record what they were given, the I/O itself real)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dsec.image import LayerStore
from tests.conftest import requires_root
from tests.image.test_store import build

pytestmark = requires_root


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str, **kw: object) -> None:
        seen.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    yield seen


def _index(calls: list[tuple[str, str]], kind: str, needle: str, after: int = -1) -> int:
    for i, (k, arg) in enumerate(calls):
        if i > after and k == kind and needle in arg:
            return i
    raise AssertionError(f"no {kind} of {needle!r} after call {after}: {calls}")


def test_a_build_is_durable_before_it_is_answered(store: LayerStore, tmp_path: object,
                                                  calls: list[tuple[str, str]]) -> None:
    m = build(store, str(tmp_path), {"a": "hello"}, kind="base", name="durable", tag="v1")
    hx = m.digest.removeprefix("sha256:")  # type: ignore[attr-defined]
    layers, manifests = os.path.join(store.root, "layers"), os.path.join(store.root, "manifests")
    # the layer: data fsynced, renamed in, layers/ fsynced - before its manifest
    moved = _index(calls, "replace", f"{layers}/{hx}.erofs")
    data = max(i for i, (k, a) in enumerate(calls[:moved]) if k == "fsync")
    assert calls[data][1].endswith(".erofs"), calls[data]
    layers_synced = _index(calls, "fsync", layers, after=moved)
    # the manifest and the name: each staged file fsynced, renamed, its directory fsynced
    manifest = _index(calls, "replace", f"{manifests}/{hx}.json", after=layers_synced)
    assert calls[manifest - 1][0] == "fsync" and ".tmp" in calls[manifest - 1][1]
    _index(calls, "fsync", manifests, after=manifest)
    refs = _index(calls, "replace", f"{store.root}/refs.json", after=manifest)
    assert calls[refs - 1][0] == "fsync" and "refs.json" in calls[refs - 1][1]
    _index(calls, "fsync", store.root, after=refs)
    assert store.get("durable:v1") == m
