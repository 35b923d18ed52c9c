"""``pinned_budget`` promises that what a member can pin with no OOM kill freeing it
(tmpfs pages and inodes, SysV shm, message queues, semaphores) is "together at most
15/16 of its own memory_bytes, so no member can wedge its group-mates". The caps that
enforce it (``new_namespace_ipc_caps``, now written by nsexec's PID 1) floor at one
of each: ``msgmni = max(1, msg_bytes // (64 x msgmnb))`` with msgmnb left at the new
namespace's 16,384 - one queue of 0-byte messages is 1 MiB of kernel memory (red team
27 K), whatever msg_bytes is - and the tmpfs at ``max(1 MiB, memory_bytes // 4)``
(pages, plus as many again in inodes at one per KiB). Below 8 MiB the sum exceeds
15/16 of memory_bytes; a 1 MiB member (the smallest spec allowed) can pin ~3.3 MiB
of its group's limit, 2.3 MiB of it taken from its group-mates' shares.

Repro (pure): the worst case the caps allow for members of 1..64 MiB.

Severity: low (small members only; MiBs, but it is the invariant the groups rest on).

Fix: lower ``msgmnb`` with the caps (it bounds a queue's message count too: msgmni=1
with msgmnb=msg_bytes/64), or msgmni=0 when a queue cannot fit; scale the tmpfs
floor with memory_bytes, or make small sandboxes ungroupable (groupable()).
"""

from __future__ import annotations

import os

import pytest

from dsec.edge.backends.container.density import new_namespace_ipc_caps
from dsec.edge.memgroups import MIN_MEMBER_BYTES, groupable, pinned_budget

MIB = 1 << 20
_MSG_HEADER, _NEW_NS_MSGMNB = 64, 16384        # density.py's, kernel defaults
_SEM, _SEM_ARRAY = 64, 256


@pytest.mark.parametrize("mib", [1, 2, 4, 8, 16, 64])
def test_a_members_worst_case_pins_stay_within_15_16_of_its_memory(mib: int) -> None:
    mem = mib * MIB
    if mem < MIN_MEMBER_BYTES:     # the fix: too small to join a group at all
        assert not groupable(False, False, mem)
        return
    page = os.sysconf("SC_PAGE_SIZE")
    caps = dict(new_namespace_ipc_caps(mem))
    _semmsl, semmns, _semopm, semmni = map(int, caps["sem"].split())
    shm = int(caps["shmall"]) * page
    msg = int(caps["msgmni"]) * _MSG_HEADER * int(caps["msgmnb"])   # msgmnb capped too
    sem = semmns * _SEM + semmni * _SEM_ARRAY
    tmpfs = 2 * pinned_budget(mem).tmpfs_bytes        # pages + inodes (1 per KiB)
    worst = shm + msg + sem + tmpfs
    assert worst <= mem * 15 // 16, (
        f"a {mib} MiB member can pin {worst / MIB:.2f} MiB (tmpfs {tmpfs / MIB:.2f}, shm "
        f"{shm / MIB:.2f}, msg {msg / MIB:.2f} = {caps['msgmni']} queue(s) x msgmnb "
        f"0-byte messages, sem {sem / MIB:.2f}) - over 15/16 of its {mib} MiB")
