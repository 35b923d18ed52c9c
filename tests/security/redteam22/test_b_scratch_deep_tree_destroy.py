"""Red team 22 B3: a sandbox's /tmp tree deeper than Python's recursion limit makes the
removal of its shared-scratch directory raise RecursionError.

With the shared scratch (issue 22) a sandbox's /dev, /dev/shm and /tmp are a directory
of the node's one tmpfs, removed at destroy by ``remove_scratch_dir`` ->
``dsec.rmtree.remove_tree``, whose ``_clear`` recurses once per directory level (no
depth bound, no RecursionError handling). Before, the per-sandbox tmpfs was unmounted
(nothing walked). A hostile agent: ``cd /tmp; while :; do mkdir d; cd d; done`` for
~1,000 levels (a few MB of tmpfs). Then:

- ``destroy`` raises RecursionError from ``asyncio.to_thread(remove_scratch_dir, ...)``
  before its cgroups are removed: the sandbox's files stay in the node's scratch tmpfs
  with no byte cap (size=0) - up to its memory limit of host RAM per sandbox, kept after
  the sandbox is gone (charged to a memcg whose sandbox no longer exists);
- the same walk runs in ``_remove_leftover`` (census at edge start), which raises again.

``remove_tree_at`` (the file API's recursive remove) has the same recursion.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.density import remove_scratch_dir
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, backend, images_dir, new_sid  # noqa: F401

DEPTH = 1200


def _deep(top: str, depth: int) -> None:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


def test_remove_scratch_dir_of_a_deep_tree_removes_it(tmp_path: object) -> None:
    scratch = str(tmp_path)
    sid = "sb-deep"
    os.makedirs(os.path.join(scratch, sid, "tmp"))
    _deep(os.path.join(scratch, sid, "tmp"), DEPTH)
    try:
        left = remove_scratch_dir(scratch, sid)      # raises RecursionError today
        assert not os.path.lexists(os.path.join(scratch, sid)), left
    finally:   # (pytest's own tmp cleanup recurses too: rm -rf walks iteratively)
        subprocess.run(["rm", "-rf", os.path.join(scratch, sid)], check=False)


@pytest.mark.root
async def test_destroy_of_a_sandbox_with_a_deep_tmp_tree_frees_its_scratch(
        backend: ContainerBackend) -> None:  # noqa: F811
    assert backend.shared_scratch
    sid = new_sid()
    await backend.create(sid, SPEC)
    r = await backend.exec(sid, ExecRequest(shell=(
        f"cd /tmp && i=0; while [ $i -lt {DEPTH} ]; do mkdir d && cd d || exit 1; "
        "i=$((i+1)); done; echo deep")))
    assert r.exit_code == 0 and b"deep" in r.stdout, r
    where = os.path.join(backend.shared_scratch, sid)
    assert os.path.isdir(where)
    error = None
    try:
        await backend.destroy(sid)
    except BaseException as exc:  # noqa: BLE001 - the finding is what escapes here
        error = exc
    assert error is None, f"destroy raised {type(error).__name__}: {error}"
    assert not os.path.lexists(where), (f"{where} (the sandbox's /tmp, node-wide tmpfs with "
                                        "no size cap) outlived its sandbox")
