"""Red team 22 B7: the keeper's ``keys`` answer is one SOCK_SEQPACKET message, read by
``FdStore._ask`` into a 64 KiB buffer (and sent by the keeper in one ``sendmsg``, whose
size is bounded by the socket's send buffer, ~208 KiB): with more keys than fit
(~1,500 background processes at ~45 bytes a key) the reply is truncated, fails to parse,
and ``keys()`` returns None - "no keeper". ``ProcessTable.restore`` then takes every
entry's descriptors as lost and kills every background process of the node at each
restart. The default limits allow ~1,024 running processes (ring_budget / ring floor);
a node configured with smaller rings (ring_bytes=256 KiB: ~4,096) is past the cliff.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dsec.edge.fdstore import FdStore

N = 2000


@pytest.fixture
def store(tmp_path: object) -> Iterator[FdStore]:
    s = FdStore(str(tmp_path), orphan_s=30.0)
    try:
        yield s
    finally:
        s.close()
        if s.keeper is not None:
            if s.keeper.poll() is None:
                s.keeper.kill()
            s.keeper.wait()


def test_keys_of_many_held_processes_come_back_whole(store: FdStore) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        keys = [f"sb-{i:012x}-node1/{4_000_000 + i}/{123_456_789 + i}" for i in range(N)]
        for k in keys:
            store.put(k, {"out": null})
        again = FdStore(os.path.dirname(store.path))
        held = again.keys()
        got = again.take(keys[-1])
        again.close()
    finally:
        os.close(null)
    assert held is not None, (f"keys() of a keeper holding {N} processes returned None (its "
                              "one-message reply does not fit 64 KiB): restore would kill "
                              "every background process")
    assert len(held) == N
    assert got is not None
    for fd in got.values():
        os.close(fd)
