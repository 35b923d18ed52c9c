"""Every sandbox overlay says ``redirect_dir=nofollow,metacopy=off`` itself, whatever the
host's overlay module defaults are: an upper dir becomes a lower layer through pack_diff, so a
redirect or metacopy xattr written by the kernel there would be followed later.

overlayfs prints an option in mountinfo only when it differs from the module default, so
the test turns the defaults on for the length of one create and one read of the sandbox
root's options from the host (then restores them): both drivers must print them (``off``
would print ``follow``: the kernel still follows redirects with redirect_dir=off when
redirect_always_follow=Y).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.image.compose import OVERLAY_FLAGS
from tests.edge.container.conftest import SPEC, new_sid

PARAMS = Path("/sys/module/overlay/parameters")


@contextlib.contextmanager
def module_defaults_on() -> Iterator[None]:
    # The parameters are host-wide: a second test session doing the same at once would
    # save our "Y" and restore it after us, so the save/flip/restore is one flock section.
    with open("/run/dsec-test-overlay-params.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = {n: (PARAMS / n).read_text().strip() for n in ("redirect_dir", "metacopy")}
        try:
            for n in saved:
                (PARAMS / n).write_text("Y")
            yield
        finally:
            for n, v in saved.items():
                (PARAMS / n).write_text(v)


def root_overlay_options(pid: int) -> set[str]:
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        if pre.split()[4] == "/" and post.split()[0] == "overlay":
            return set(post.split()[2].split(","))
    raise AssertionError(f"no overlay root in /proc/{pid}/mountinfo")


def test_compose_flags_are_the_safe_ones() -> None:
    assert set(OVERLAY_FLAGS) == {"redirect_dir=nofollow", "metacopy=off"}


async def check_root_flags(b: ContainerBackend) -> None:
    if not PARAMS.is_dir():
        pytest.fail("overlay module parameters missing: is overlayfs loaded?")
    sid = new_sid()
    try:
        with module_defaults_on():  # mountinfo compares with the defaults of the moment
            await b.create(sid, SPEC)
            opts = root_overlay_options(b.init_pid(sid))
        assert set(OVERLAY_FLAGS) <= opts, opts
    finally:
        await b.destroy(sid)


async def test_native_root_turns_redirect_and_metacopy_off(backend: ContainerBackend) -> None:
    await check_root_flags(backend)


async def test_runc_root_turns_redirect_and_metacopy_off(runc_backend: ContainerBackend) -> None:
    await check_root_flags(runc_backend)
