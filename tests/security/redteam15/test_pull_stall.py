"""Red team, issue 15 stream ia: a stalled registry against the apiserver's image routes
(the real ImageAdmin over a real layer store, real skopeo, a real registry for the
victim and a loopback listener that accepts and never answers for the attacker)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from dsec.control.api.images import ImageAdmin
from dsec.control.api.service import Caller
from dsec.image.localregistry import Entry, LocalRegistry, push, tar_entries, write_image
from dsec.wire.api import ImagePullRequest
from tests.security.redteam15.test_pull_names import _Charges

pytestmark = [pytest.mark.root, pytest.mark.slow]

MALLORY = Caller(id="k-m", name="mallory", roles={"teama": "member"}, default_project="teama")
BOB = Caller(id="k-b", name="bob", roles={"teamb": "member"}, default_project="teamb")


class Stall:
    """Accepts TCP connections on loopback and never says a word."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                c, _ = self.sock.accept()
                self.conns.append(c)

    def close(self) -> None:
        # shutdown wakes the accept() blocked in _run; a bare close() did not (the blocked
        # call keeps the socket listening), so a hog that connected after it was never
        # cut and the test waited out its 60 s stall timeout
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.t.join(5.0)
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


def test_six_pulls_from_a_silent_registry_stall_every_tenants_image_routes(
        tmp_path: Path) -> None:
    """Attack: a member starts a handful of pulls (images.pull or just creates naming
    ``127.0.0.1:<port>/x:N``) from a registry that accepts connections and never answers.
    Each pull runs skopeo in ``asyncio.to_thread`` with a 1800 s timeout, i.e. in the
    event loop's *default* executor, which has min(32, cpus + 4) = 6 threads on this
    2-core machine. Six silent pulls hold all of them for 30 minutes: every other
    tenant's pull, image build and the retention job (plane.py) queue behind them.

    Safe: registry I/O has its own bounded pool / per-project concurrency limit and a
    short stall timeout (no bytes for N s -> Timeout); another project's pull from a
    healthy registry is not delayed. Observed: Bob's 1-layer pull from a healthy local
    registry does not finish within 30 s (it needs ~1 s alone)."""
    work = tempfile.mkdtemp(prefix="rt15-reg-")
    stall = Stall()
    admin = ImageAdmin(_Charges(), layer_dir=str(tmp_path / "layers"))
    admin.registries = ("127.0.0.1",)   # (fix15a) loopback is opened by the operator (F6)
    try:
        with LocalRegistry(os.path.join(work, "open")) as reg:
            lay = os.path.join(work, "layout")
            write_image(lay, "ok", [tar_entries([Entry("ok", data=b"ok")])])
            push(lay, "ok", f"{reg.host}/teamb/ok:1")

            async def scenario() -> float | None:
                hogs = [asyncio.create_task(admin.pull_image(MALLORY, ImagePullRequest(
                    ref=f"127.0.0.1:{stall.port}/x:{i}", project="teama", insecure=True)))
                    for i in range(min(32, (os.cpu_count() or 1) + 4))]
                await asyncio.sleep(1.0)
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(admin.pull_image(BOB, ImagePullRequest(
                        ref=f"{reg.host}/teamb/ok:1", project="teamb", insecure=True)), 30)
                    took: float | None = time.monotonic() - t0
                except TimeoutError:
                    took = None
                stall.close()                      # let the hogs' skopeo fail now
                for h in hogs:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(h, 60)
                return took
            took = asyncio.run(scenario())
            assert took is not None, ("another project's pull from a healthy registry waited "
                                      "> 30 s behind pulls stalled on a silent registry")
    finally:
        stall.close()
        shutil.rmtree(work, ignore_errors=True)
