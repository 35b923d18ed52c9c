"""A real ``dsec edge --backend container`` process to kill -9, for fault tests and the
``faults`` bench: start it on a state dir, talk to it, kill it, start it again, and read
what the host holds for it (:mod:`dsec.edge.backends.container.census`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from dsec.cluster import DSEC_ARGV
from dsec.edge.backends.container.census import Census, cgroup_name_of, take_census
from dsec.edge.service import EdgeClient
from dsec.errors import DsecError

__all__ = ["EdgeProcess"]



class EdgeProcess:
    """``dsec edge`` serving a container backend rooted at ``<work>/root`` with its
    journal in ``<work>/state``, on ``unix:<work>/edge.sock``."""

    def __init__(self, work: str, images_dir: str, *, node_id: str = "dur",
                 max_sandboxes: int = 1000, extra: tuple[str, ...] = ()) -> None:
        self.work = os.path.abspath(work)
        self.sock = os.path.join(self.work, "edge.sock")
        self.state = os.path.join(self.work, "state")
        self.root = os.path.join(self.work, "root")
        self.images_dir = images_dir
        self.node_id = node_id
        self.max_sandboxes = max_sandboxes
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = os.path.join(self.work, "edge.log")
        os.makedirs(self.work, exist_ok=True)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def argv(self) -> list[str]:
        return [*DSEC_ARGV, "edge", "--listen", f"unix:{self.sock}", "--state-dir", self.state,
                "--node-id", self.node_id, "--backend", "container",
                "--backend-opt", f"container.images_dir={self.images_dir}",
                "--backend-opt", f"container.root_dir={self.root}",
                "--max-sandboxes", str(self.max_sandboxes), "--cpu-milli", "1000000",
                "--memory-bytes", str(1 << 40), "--log-level", "warning",
                *self.extra]

    async def start(self, timeout_s: float = 120.0) -> None:
        """Start the edge and return once it answers on its socket (after adoption and
        reconciliation, which run before it listens)."""
        self.proc = self._spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = Path(self.log).read_bytes()[-2000:].decode(errors="replace")
                raise RuntimeError(f"dsec edge exited with {self.proc.returncode}: {tail}")
            try:
                c = await EdgeClient.connect(f"unix:{self.sock}", timeout=10)
            except (DsecError, OSError):
                await asyncio.sleep(0.05)
                continue
            try:
                await c.info()
                return
            except DsecError:
                await asyncio.sleep(0.05)
            finally:
                await c.close()
        self.kill9()
        raise RuntimeError(f"dsec edge did not answer within {timeout_s} s")

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as log:
            return subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=log)

    async def client(self, timeout_s: float = 60.0) -> EdgeClient:
        return await EdgeClient.connect(f"unix:{self.sock}", timeout=timeout_s)

    def kill9(self) -> None:
        """SIGKILL the edge process (its sandboxes stay) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait (a clean stop: sandboxes stay for the next start)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill9()
                raise
        return self.proc.returncode

    def census(self) -> Census:
        """What the host holds for this edge's container backend right now."""
        return take_census(self.root, cgroup_name_of(self.root))

    async def wipe(self) -> None:
        """Destroy every sandbox the edge knows and stop it (cleanup after a test)."""
        with contextlib.suppress(Exception):
            if self.proc is None or self.proc.poll() is not None:
                await self.start()
            async with await self.client() as c:
                ids = [i.id for i in await c.list()]
                for k in range(0, len(ids), 100):
                    await c.destroy_many(ids[k:k + 100])
        with contextlib.suppress(Exception):
            self.stop()
        self.kill9()
