"""Red team B (issue 19, CLI): a tenant's label writes into an admin's terminal.

Label keys and values are any characters (only their length is checked), and ``dsec
sandbox ls`` (cli19: "never truncates") prints them raw. A member of a subproject sets
a label value holding a newline and a forged row, or terminal escapes (clear the line,
move the cursor, set the window title, OSC 8 links); the admin of the parent project
listing sandboxes sees rows that do not exist and loses the ones that do. The same
text reaches ``dsec sandbox logs`` (event details) and any other plain-text table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from dsec.cluster.local import LocalCluster

DSEC = [sys.executable, "-c", "from dsec.cli.main import main; main()"]


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


def test_b_labels_cannot_forge_rows_or_send_escapes(cluster: LocalCluster) -> None:
    cl = cluster
    key = cl.create_key("labeller", "default/sub", "member")
    forged = "x\nsb-000000000000-fake  running  simulated  base  default  1  512Mi  1s  ok"
    for value in (forged, "\x1b[2K\x1b[1A\x1b]0;pwned\x07"):
        r = httpx.post(f"{cl.url}/v1/sandboxes", headers={"authorization": f"Bearer {key}"},
                       json={"project": "default/sub", "image": "base",
                             "labels": {"note": value}}, timeout=30)
        if r.status_code == 400:        # refused at the door: fixed that way
            continue
        assert r.status_code == 201, r.text
    out = subprocess.run([*DSEC, "sandbox", "ls"], capture_output=True, timeout=120, check=False,
                         env={**os.environ, "DSEC_URL": cl.url, "DSEC_API_KEY": cl.api_key})
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout.decode("utf-8", "replace")
    rows = text.splitlines()[1:]
    assert not any(r.startswith("sb-000000000000-fake") for r in rows), text
    assert not any(ch in text for ch in ("\x1b", "\x07", "\r")), repr(text)
