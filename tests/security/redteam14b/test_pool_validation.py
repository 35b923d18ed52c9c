"""``--net-pool`` accepts ranges that cannot work or that collide (nd/nb,
net/addressing.py Pool; `dsec up/edge --net-pool`).

Bad input (operator): a pool that is loopback, link-local (the metadata range, and the
uplink's own 169.254.213.0/30 - slot 0's /31 would sit on the uplink link), multicast,
"this network", the whole IPv4 space (then never4 holds everything: nothing reachable),
or a public range (the sandboxes would squat real addresses, and the router's never set
makes those real destinations unreachable for every sandbox).
Expected safe behaviour: refused with a clear error naming the range and what to use
(a private range: 10/8, 172.16/12, 192.168/16, 100.64/10, not overlapping the uplink link).
Observed: all accepted (Pool() computes a capacity and a resolver address for each).
"""

from __future__ import annotations

import pytest

from dsec.errors import InvalidArgument
from dsec.net.addressing import Pool


@pytest.mark.parametrize("cidr", ["0.0.0.0/0", "127.0.0.0/8", "169.254.0.0/16",
                                  "169.254.213.0/24", "224.0.0.0/8", "8.8.8.0/24"])
def test_unusable_pool_is_refused(cidr: str) -> None:
    with pytest.raises(InvalidArgument):
        Pool(cidr)
