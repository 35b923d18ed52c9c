"""Red team B (issue 19 files x faults): kill -9 of the edge mid-upload leaves the
partial upload in the sandbox, on its disk quota, until another upload happens to go
into the same directory.

A streamed write goes to ``<dir>/.dsec-upload-<hex>`` and is renamed into place at the
end; an edge killed meanwhile leaves that file (here ~80 MiB) behind. The only sweep
is :meth:`SandboxFiles._sweep_stale`, run by the next upload *into that directory*: the
edge's restart (which re-adopts the sandbox from its journal) reconciles nothing, so a
client that retries the upload elsewhere, or never, leaves the bytes counted against the
sandbox's disk cap for its whole life (and a ``files.watch`` never shows them: the
prefix is filtered). Durable-before-acknowledged's other half: what a crash leaves is
found and reconciled at restart.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest

from dsec import LocalCluster
from dsec.control.supervisor import RestartPolicy

sent = [0]      # MiB handed to the upload so far


def _chunks() -> Iterator[bytes]:
    for _ in range(600):
        yield b"x" * (1 << 20)
        sent[0] += 1
        time.sleep(0.005)


def test_b_a_killed_upload_is_reconciled_at_restart() -> None:
    if os.geteuid() != 0:
        pytest.fail("container sandboxes need root (CI runs as root)")
    policy = RestartPolicy(first_delay_s=0.05)
    with LocalCluster(edges=1, edge_processes=True, restart=policy,
                      backend="container") as cl, cl.client(protocol="aether") as c:
        sb = c.sandboxes.create(ttl=600)
        try:
            failed: list[BaseException] = []
            sent[0] = 0

            def upload() -> None:
                try:
                    sb.files.write("/root/big.bin", _chunks())
                except Exception as exc:  # noqa: BLE001 - the edge dies under it
                    failed.append(exc)
            t = threading.Thread(target=upload)
            t.start()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:       # wait until bytes are on its disk
                # (an upload's temporary file may be unnamed (O_TMPFILE): then what the
                # client handed over, far past any in-flight window, says they are)
                r = sb.exec(["sh", "-c", "cat /root/.dsec-upload-* 2>/dev/null | wc -c"])
                if int(r.stdout or 0) > (8 << 20) or sent[0] > 96:
                    break
                time.sleep(0.1)
            cl.kill_edge("edge-0")
            t.join(120)
            assert failed, "the upload should have failed with its edge"
            deadline = time.monotonic() + 90
            while True:                               # the edge back, the sandbox adopted
                with contextlib.suppress(Exception):       # restarting meanwhile
                    if c.sandboxes.get(sb.id).info.state == "running":
                        break
                assert time.monotonic() < deadline, "the edge did not come back"
                time.sleep(0.1)
            time.sleep(1.0)
            left = sb.exec(["sh", "-c", "ls -la /root; du -sk /root"]).stdout.decode()
            assert ".dsec-upload-" not in left, (
                f"after kill -9 mid-upload and the edge's restart, {sb.id}:/root holds the "
                f"partial upload:\n{left}")
        finally:
            sb.kill()
