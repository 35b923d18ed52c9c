"""A memory-group member with allow_nested (a spec field the tenant sets) may unshare a
user namespace and with it a new ipc namespace or mount namespace. A new ipc namespace
has the kernel's defaults again - shmmax 16 EiB, shmall unlimited - not the caps the
edge wrote into the member's own (red team 26 H's fix, density.cap_sysv_ipc), and a
new mount namespace may mount a tmpfs of any size. A segment left in place (or a file
in that tmpfs) lives as long as a tiny process stays in the namespace, which the OOM
killer picks last: it is charged to the group, and the member pins more than its own
memory_bytes - up to the group's limit - wedging its group-mates exactly as H did.

Repro: two members of 64 MiB (group 128 MiB), a with allow_nested: `hog nsshm 124`
(unshare user+ipc, one 124 MiB segment, a sleeping holder) or `hog nstmp 124` (unshare
user+mnt, a tmpfs with a 124 MiB file, a sleeping holder), then 8 MiB in its own /tmp
(well inside its own tmpfs cap); b runs `true` three times.

Fix: a sandbox with allow_nested (or anything that can make namespaces) is never put in
a memory group (a memcg of its own: its limit is the bound).
"""

from __future__ import annotations

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import new_sid

from .conftest import mate_answers, spec

pytestmark = [pytest.mark.root]


@pytest.mark.parametrize("how", ["nsshm", "nstmp"])
async def test_nested_member_cannot_pin_past_its_share(grouped: ContainerBackend,
                                                       how: str) -> None:
    b = grouped
    a, mate = new_sid(), new_sid()
    await b.create(a, spec("p", 64, allow_nested=True))
    await b.create(mate, spec("p", 64))
    gdir = b.memory_group_of(a)
    if gdir is None or gdir != b.memory_group_of(mate):
        return   # fixed by keeping a nesting sandbox out of groups: its memcg bounds it
    w = await b.exec(a, ExecRequest(shell=f"hog {how} 124; head -c 8m /dev/zero > /tmp/x", timeout_s=60))
    held = b.governor.memory_shmem(b.box(a).cg)
    results, kills = await mate_answers(b, mate, gdir)
    assert held <= 64 << 20 and results == [(0, False)] * 3 and kills == 0, (
        f"member {a} (memory_bytes 64 MiB, allow_nested) holds {held >> 20} MiB of shmem "
        f"in the group via a namespace of its own ({w.stdout.decode().strip()!r}); its "
        f"group-mate's `true` x3: {results}, {kills} OOM kills in the group")
