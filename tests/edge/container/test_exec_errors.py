"""A command that cannot start (no such program, user or cwd) in a background exec is
``CannotRun`` (the caller's mistake, 4xx at the API) on both runtimes; in a foreground
exec it is a result with exit code 127/126, as a shell reports it."""

from __future__ import annotations

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.errors import CannotRun
from dsec.wire.spec import ExecRequest

from .conftest import SPEC, new_sid

pytestmark = pytest.mark.root

MISTAKES = [
    (ExecRequest(argv=("/no/such/program",)), 127),
    (ExecRequest(argv=("no-such-program-in-path",)), 127),
    (ExecRequest(argv=("sleep", "1"), user="ghost"), 126),
    (ExecRequest(argv=("sleep", "1"), cwd="/no/such/dir"), 126),
]


async def _check(b: ContainerBackend, foreground_codes: bool) -> None:
    sid = new_sid()
    await b.create(sid, SPEC)
    for req, code in MISTAKES:
        with pytest.raises(CannotRun) as ei:
            await b.exec(sid, ExecRequest(**{**_fields(req), "background": True}))
        assert ei.value.detail["exit_code"] == code, (req, ei.value)
        assert len(ei.value.message) < 500
        if foreground_codes:
            fg = await b.exec(sid, req)
            assert fg.exit_code == code and b"cannot run" in fg.stderr, (req, fg)
    ok = await b.exec(sid, ExecRequest(argv=("sleep", "0"), background=True))
    assert ok.pid is not None and ok.pid > 1


def _fields(req: ExecRequest) -> dict[str, object]:
    return {f: getattr(req, f) for f in req.__struct_fields__}


async def test_native_background_exec_that_cannot_start_is_cannot_run(
        backend: ContainerBackend) -> None:
    await _check(backend, foreground_codes=True)


async def test_runc_background_exec_that_cannot_start_is_cannot_run(
        runc_backend: ContainerBackend) -> None:
    await _check(runc_backend, foreground_codes=False)
