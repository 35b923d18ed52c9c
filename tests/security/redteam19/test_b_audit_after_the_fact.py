"""Red team B (issue 19): an admin action whose audit line cannot be written is done
anyway, unaudited, and answered as a failure.

``dsec.control.audit.audited`` runs the action first and writes the line after it; its
docstring says "a failure to record fails the call (an admin action is not done unless
it is audited)", but by then the action is done: with the state dir's disk full, a
``create_key`` answers an error while the key it made exists and works, and no line
names it (the same for ``revoke_key``, ``quota_set``, image deletes, join tokens, node
drains: every AUDITED row). An attacker (or just a full disk) gets admin actions with no
trace. Fault: the audit log on a small tmpfs this test mounts and fills.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

import httpx

from dsec.cluster.local import LocalCluster
from dsec.logs import AuditLog


def test_b_an_unaudited_admin_action_is_not_done(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mnt = str(tmp_path / "full")
    os.mkdir(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mnt], check=True)
    try:
        with LocalCluster(edges=1) as cl:
            svc = cl.runtime.service
            path = os.path.join(mnt, "audit.log")
            svc.audit = AuditLog(path)
            fd = os.open(os.path.join(mnt, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
            try:                                        # the disk is now full
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * 4096)
            finally:
                os.close(fd)
            admin = {"authorization": f"Bearer {cl.api_key}"}
            r = httpx.post(f"{cl.url}/v1/keys", json={"name": "ghost", "project": "default",
                                                      "role": "admin"},
                           headers=admin, timeout=30)
            recs = AuditLog.read(path)
            assert not any(x["action"] == "create_key" for x in recs)   # nothing recorded
            assert r.status_code >= 400, r.text   # ... and answered as a failure
            # then the key must not exist: nothing names it in the audit log
            keys = httpx.get(f"{cl.url}/v1/keys", params={"principal": "ghost"},
                             headers=admin, timeout=30)
            listed = keys.json().get("items", []) if keys.status_code == 200 else []
            assert listed == [], (
                f"create_key answered {r.status_code} ({r.json().get('message')!r}) and "
                f"left no audit line, but the key exists: {listed}")
            svc.audit.close()
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
