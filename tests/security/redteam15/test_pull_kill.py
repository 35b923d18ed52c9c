"""Red team, issue 15 stream ia: kill -9 of the process that pulls (the CLI here; the
apiserver and edges run the same dsec.image.pull) while skopeo is fetching from a
registry that stalls a blob (our hostile OCI server on loopback)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec.image.localregistry import Entry, tar_entries
from tests.security.redteam15.hostile_registry import Hostile, _sha

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _skopeo_for(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"skopeo .*{marker}"], check=False, capture_output=True,
                         text=True).stdout.split()
    return [int(p) for p in out]


def test_kill_9_mid_pull_leaves_skopeo_running(tmp_path: Path) -> None:
    """Fault: kill -9 the puller while skopeo copies (a slow or stalled blob). skopeo is
    started with subprocess.run: no PR_SET_PDEATHSIG, no own process group that a
    reaper kills, so it outlives its parent, keeps the registry connection and keeps
    writing into the store's tmp/ (which the next store open reclaims under it) - with
    no timeout of its own against a stalled registry. Every killed apiserver/edge pull
    leaks one. The probe also showed the auth file with the caller's password stays in
    tmp/ until the next store open (reclaimed then: held).

    Safe: the helper dies with its parent (PR_SET_PDEATHSIG=SIGKILL via preexec_fn or a
    prctl wrapper, or a process group killed on the next start), so no skopeo survives
    the puller. Observed: skopeo still runs after its parent was killed."""
    h = Hostile()
    store = tmp_path / "store"
    proc = None
    try:
        raw = tar_entries([Entry("f", data=b"f")])
        gz = gzip.compress(raw, mtime=0)
        cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                          "rootfs": {"type": "layers", "diff_ids": [_sha(raw)]}}).encode()
        h.manifest("t/slow", "1", {
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": h.blob(cfg), "size": len(cfg)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": h.blob(gz), "size": len(gz)}]})
        h.hang.add(_sha(gz))
        proc = subprocess.Popen(
            [sys.executable, "-c", "from dsec.cli.main import main; main()", "image",
             "--root", str(store), "pull", "--insecure", f"{h.host}/t/slow:1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # (img: the pull fetches in-process since F16, no helper: wait for the stalled
        # blob GET, then check the puller has no child a kill -9 could orphan)
        blob = f"/v2/t/slow/blobs/{_sha(gz)}"
        deadline = time.monotonic() + 30
        while (("GET", blob) not in h.log) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ("GET", blob) in h.log, "the blob fetch never started"
        time.sleep(0.5)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], check=False,
                                  capture_output=True, text=True).stdout.split()
        assert children == [], f"the puller runs helpers {children}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(2.0)
        orphans = _skopeo_for(str(store))
        assert orphans == [], f"skopeo {orphans} outlived the puller killed with -9"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _skopeo_for(str(store)):   # ours: their argv names our tmp store
            os.kill(pid, signal.SIGKILL)
        h.close()
