"""Red team 24 C1: a layer-store stamp in the future turns the images cache off until
the wall clock catches up - every heartbeat lists (and, through ``held_layers``, reads)
every manifest again, for hours or days.

``EdgeNode._images_now`` treats a stamp as "racy" when ``now - mtime < 1 s``; a mtime
ahead of ``now`` gives a negative difference, so it is racy for as long as it stays
ahead. A store written while the clock ran ahead (a VM that booted with a bad RTC and
was stepped back by NTP, a store restored or copied with its times) has such stamps;
no tenant needs to do anything. The 1 s rule only has to distrust stamps taken within
the last tick: a stamp from the future cannot hide a later change (that change stamps
an earlier, different mtime).

Fix: ``racy = any(0 <= now - st[1] < 1_000_000_000 ...)`` (or compare with ``abs`` and
log a warning once for a stamp ahead of the clock).
"""

from __future__ import annotations

import os
import time

from dsec.image import LayerStore
from tests.edge.conftest import make_node
from tests.edge.test_layer_receive import built


def test_a_stamp_from_the_future_still_lets_the_list_be_cached(tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "store")
    store = LayerStore(root)
    built(store, str(tmp_path), {"f": "x"}, kind="toolkit", name="t")
    ahead = time.time_ns() + 3600 * 10**9          # an hour ahead (a clock stepped back)
    for p in ("manifests", "layers", "refs.json"):
        path = os.path.join(root, p)
        if os.path.exists(path):
            os.utime(path, ns=(ahead, ahead))
    node = make_node(layer_store=root)
    first = node.heartbeat(images_gen=None)
    assert node._images_cache is not None, "the list is recomputed at every heartbeat"
    again = node.heartbeat(images_gen=first.images_gen)
    assert again.images_same
