"""The warm pool's pure parts: which guest block devices a VM has, and when a guest's own
report (agent ``hello``/``quiesce``) says it is not ready to be saved or used as a clone."""

from __future__ import annotations

import pytest

from dsec.edge.backends.vm.pool import device_gaps, guest_block_devices


def test_guest_block_devices_follow_the_launch_order() -> None:
    assert guest_block_devices(2, pmem=True) == ["pmem0", "pmem1", "vda"]
    assert guest_block_devices(2, pmem=False) == ["vda", "vdb", "vdc"]
    assert guest_block_devices(0, pmem=True) == ["vda"]
    with pytest.raises(ValueError, match="vdz"):
        guest_block_devices(26, pmem=False)


def test_device_gaps_names_what_is_missing() -> None:
    want = ["pmem0", "vda"]
    assert device_gaps(want, ["vda", "pmem0", "zram0"], [], False) is None
    why = device_gaps(want, ["vda"], ["virtio1:27"], True)
    assert why is not None
    assert "pmem0" in why and "virtio1:27" in why and "module loader" in why
    # a clone that reports nothing at all (an agent without the fields) is not ready
    assert device_gaps(want, [], [], False) is not None


def test_device_gaps_quotes_a_hostile_report_briefly() -> None:
    """The lists come from the guest: only a few items, each cut short, are quoted."""
    why = device_gaps(["vda"], [], ["x" * 10_000] * 1000, False)
    assert why is not None and len(why) < 600 and "+992 more" in why
