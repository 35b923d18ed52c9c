"""A file written through the files API into a sandbox's ``/tmp`` (or ``/dev/shm``) -
both tmpfs, sized 2x the sandbox's memory - is written by the *edge process*, so its
shmem pages are charged to the edge's memory cgroup, not the sandbox's: the sandbox
reads 2 MiB of memory with 48 MiB of its files in RAM (``memory_tmpfs_bytes`` 0). Per
sandbox a member key parks up to 2 x 2 x ``memory_bytes`` of host RAM outside every
limit and outside placement's accounting (1,000 sandboxes of 64 MiB: 256 GB), with the
streamed upload (``file_write_stream``, no 16 MiB ceiling) or repeated ``write_file``;
when the edge runs in a memory-limited unit, the OOM killer picks the edge. The
sandbox's own writes to /tmp are charged to it (and OOM-kill it) - the host-side path
must be too.

Below: a 64 MiB sandbox; 48 MiB uploaded to /tmp through the SDK; its stats must show
the memory (or the upload must be refused)."""

from __future__ import annotations

import os

from dsec import LocalCluster
from dsec.errors import DsecError


def test_tmpfs_upload_is_charged_to_the_sandbox(tmp_path: object) -> None:
    if os.geteuid() != 0:
        raise AssertionError("needs root (CI runs as root)")
    with LocalCluster(backend="container", state_dir=str(tmp_path)) as cl, \
            cl.client(session_lease_s=None) as c:
        sb = c.sandboxes.create(memory="64MiB")
        try:
            try:
                sb.files.write("/tmp/blob", os.urandom(48 << 20))
            except DsecError:
                return                       # refused: also a fix
            st = sb.stats()
            charged = max(st.memory_bytes, st.memory_tmpfs_bytes or 0)
            assert charged >= 40 << 20, (
                f"48 MiB written to /tmp of a 64 MiB sandbox through the files API; "
                f"the sandbox is charged {charged} bytes (memory_bytes="
                f"{st.memory_bytes}, memory_tmpfs_bytes={st.memory_tmpfs_bytes}): the "
                "edge's memory cgroup holds the tmpfs pages")
        finally:
            sb.kill()
