"""File calls with ``user=`` on the gvisor tier: the same kernel-checked identity on the
bundle's root (tests/edge/container/test_files_as_user.py)."""

from __future__ import annotations

import pytest

from dsec.edge.backends.container import ContainerBackend
from tests.edge.container.conftest import SPEC, new_sid
from tests.edge.container.test_files_as_user import (
    SETUP,
    _as_user_calls,
    _threads_are_root_again,
    sh,
)

pytestmark = pytest.mark.root


async def test_file_calls_as_a_user_are_checked_by_the_kernel(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    await sh(backend, sid, SETUP)
    await _as_user_calls(backend, sid)
    await _threads_are_root_again(backend)
