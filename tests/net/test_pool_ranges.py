"""--net-pool ranges (REDTEAM-14b #9): only private ranges, apart from the uplink link,
refused with a clear error through every door (Pool, the router, `dsec edge/up`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dsec.errors import InvalidArgument
from dsec.net.addressing import Pool
from dsec.net.router import Router, RouterConfig
from dsec.net.uplink import NetnsUplink


@pytest.mark.parametrize("cidr", ["10.213.0.0/16", "172.16.0.0/24", "192.168.8.0/22",
                                  "100.64.0.0/16", "198.18.0.0/16"])
def test_private_pools_accepted(cidr: str) -> None:
    assert Pool(cidr).capacity > 0


@pytest.mark.parametrize("cidr", ["0.0.0.0/8", "192.0.2.0/24", "240.0.0.0/8",
                                  "10.0.0.0/7", "255.255.255.252/30"])
def test_other_pools_refused_naming_the_range(cidr: str) -> None:
    with pytest.raises(InvalidArgument, match="private range"):
        Pool(cidr)


def test_pool_overlapping_the_uplink_link_refused_before_anything_is_made() -> None:
    up = NetnsUplink(peer_netns_fd=-1, peer_ifname="x", link="10.213.0.0/30")
    with pytest.raises(InvalidArgument, match="overlaps the uplink link"):
        Router.create(RouterConfig(pool="10.213.0.0/16"), up)


@pytest.mark.parametrize("cmd", ["edge", "up"])
def test_cli_refuses_a_public_pool(cmd: str, tmp_path: object) -> None:
    # a state dir of the test's own: were the flag not refused, `dsec up` would start a
    # cluster in ~/.dsec (on the old code it did, until the timeout)
    state = os.path.join(str(tmp_path), "state")
    r = subprocess.run([sys.executable, "-c", "from dsec.cli.main import main; main()",
                        cmd, "--state-dir", state, "--net-pool", "8.8.8.0/24"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "DSEC_STATE_DIR": state}, check=False)
    assert r.returncode == 2 and "8.8.8.0/24" in r.stderr and "private range" in r.stderr, r.stderr
