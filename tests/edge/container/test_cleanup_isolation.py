"""One sandbox's cleanup that raises never keeps the others' from going (red team 22,
B3: a RecursionError in one leftover's scratch removal aborted the backend's whole
start-time reconcile, and escaped destroy before its cgroups went)."""

from __future__ import annotations

import os

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.census import Census
from tests.edge.container.conftest import SPEC, backend, images_dir, new_sid  # noqa: F401

pytestmark = pytest.mark.root


async def test_reconcile_goes_on_past_a_leftover_whose_removal_raises(
        backend: ContainerBackend, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    a, b = sorted([new_sid(), new_sid()])
    for sid in (a, b):
        await backend.create(sid, SPEC)
        backend._boxes.pop(sid)          # as after a crash: on the host, not held
    real = backend._remove_leftover

    async def flaky(sid: str, census: Census):  # type: ignore[no-untyped-def]
        if sid == a:
            raise RecursionError("maximum recursion depth exceeded")
        return await real(sid, census)

    monkeypatch.setattr(backend, "_remove_leftover", flaky)
    found = await backend.reconcile(set())
    by_sid = {lo.sandbox_id: lo.what for lo in found}
    assert "RecursionError" in by_sid[a], by_sid
    assert b in by_sid and "could not" not in by_sid[b], by_sid
    assert b not in backend.census().sandboxes()
    monkeypatch.setattr(backend, "_remove_leftover", real)
    await backend.reconcile(set())       # the next pass removes the first one too
    assert a not in backend.census().sandboxes()


async def test_destroy_survives_a_step_that_raises_and_removes_everything(
        backend: ContainerBackend, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from dsec.edge.backends.container import backend as backend_mod

    sid = new_sid()
    await backend.create(sid, SPEC)
    calls = []
    real = backend_mod.remove_scratch_dir

    def once(path: str, s: str) -> str:
        calls.append(s)
        if len(calls) == 1:
            raise RecursionError("maximum recursion depth exceeded")
        return real(path, s)

    monkeypatch.setattr(backend_mod, "remove_scratch_dir", once)
    await backend.destroy(sid)           # retried from the census, not raised
    assert len(calls) >= 2
    assert sid not in backend.census().sandboxes()
    if backend.shared_scratch:
        assert not os.path.lexists(os.path.join(backend.shared_scratch, sid))
