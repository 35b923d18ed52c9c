"""E2B layer: inputs a caller controls end as internal errors or refuse every caller.

1. ``GET /sandboxes`` (E2B's v1 list, unpaged) with more sandboxes than ``limit``
   (default 100): the loop goes on past the limit (``continue`` when not paged) and asks
   the list for ``limit - len(items)`` = 0 rows, which it refuses: **400 "limit=0 must
   be within 1..1000"** for any project with more than 100 sandboxes (or with
   ``?limit=10`` and 11). The v1 list must answer (at most ``limit`` rows, or all).
2. ``process.Process/Start`` with ``envs`` not an object, or a pty ``size`` with a
   non-number: ``dict(...)`` / ``int(...)`` raise TypeError/ValueError, logged with a
   traceback as a bug and answered ``internal`` - any key floods the apiserver's error
   log, and the caller gets no clear message. They must be ``invalid_argument``."""

from __future__ import annotations

import json
import struct

import httpx

from dsec import LocalCluster


def _env(m: object) -> bytes:
    d = json.dumps(m).encode()
    return struct.pack(">BI", 0, len(d)) + d


def test_v1_list_with_more_sandboxes_than_its_limit(e2b_sim: LocalCluster) -> None:
    cl = e2b_sim
    with cl.client(session_lease_s=None) as c:
        sbs = c.sandboxes.create_many(12)
        try:
            r = httpx.get(f"{cl.runtime.e2b_url}/sandboxes", params={"limit": 10},
                          headers={"X-API-KEY": cl.api_key}, timeout=60)
            assert r.status_code == 200, (
                f"E2B v1 GET /sandboxes?limit=10 over 12 sandboxes: HTTP {r.status_code} "
                f"{r.text[:200]}")
        finally:
            for sb in sbs:
                sb.kill()


def test_malformed_start_fields_are_invalid_argument(e2b_sim: LocalCluster) -> None:
    cl = e2b_sim
    with cl.client(session_lease_s=None) as c:
        sb = c.sandboxes.create()
        try:
            for msg in ({"process": {"cmd": "echo", "envs": [1, 2]}},
                        {"process": {"cmd": "echo"}, "pty": {"size": {"cols": "x"}}}):
                r = httpx.post(f"{cl.runtime.e2b_url}/process.Process/Start",
                               content=_env(msg), timeout=30,
                               headers={"E2b-Sandbox-Id": sb.id,
                                        "X-Access-Token": cl.api_key,
                                        "content-type": "application/connect+json"})
                body = r.content[5:].decode(errors="replace")
                assert '"invalid_argument"' in body, (
                    f"Start {msg} answered {body[:200]} (a caller's bad field is a bug "
                    "with a traceback in the apiserver's log)")
        finally:
            sb.kill()
