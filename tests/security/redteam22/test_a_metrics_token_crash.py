"""A4: a kill -9 while the metrics token file is being made leaves the edge unable to
start, for good.

``read_token(create=True)`` (``dsec edge --metrics-token-file``: the systemd unit and the
DaemonSet name ``/var/lib/dsec/edge/metrics.token``) and ``metrics_token_file`` (``dsec
up``) make the file with ``O_CREAT|O_EXCL`` and *then* write the token. A crash (kill -9,
OOM kill, node power loss before the data reached disk) between the two leaves an empty
or short file; every later start finds it, does not make it again, and refuses it ("the
token must be 16 or more printable characters"): the edge crash-loops (systemd
Restart=, Kubernetes CrashLoopBackOff) until someone deletes the file by hand. The port
key next to it is written whole to a temporary file and linked into place for exactly
this reason (cluster/runtime.py ``_port_token_key``).

Each test makes the state the crash leaves (the write cannot be interrupted reliably
from a test: it is one small write right after the open) - an empty 0600 file - and
asserts the next start recovers.
"""

from __future__ import annotations

import os

from dsec.cluster.runtime import metrics_token_file
from dsec.edge.metrics import read_token


def _crashed_file(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # ... then kill -9
    os.close(fd)


def test_an_edge_starts_after_a_crash_while_making_its_token_file(tmp_path: object
                                                                   ) -> None:
    path = os.path.join(str(tmp_path), "edge", "metrics.token")
    os.makedirs(os.path.dirname(path), mode=0o700)
    _crashed_file(path)
    token = read_token(path, create=True)      # the restarted edge
    assert len(token) >= 16


def test_dsec_up_starts_after_a_crash_while_making_the_token_file(tmp_path: object
                                                                   ) -> None:
    state = str(tmp_path)
    _crashed_file(os.path.join(state, "metrics.token"))
    path = metrics_token_file(state)           # dsec up, again
    assert len(read_token(path)) >= 16         # what each edge it starts then reads
