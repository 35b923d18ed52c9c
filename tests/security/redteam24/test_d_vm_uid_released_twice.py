"""Red team 24 D1: a VM's uid claim is released by backend key alone, so a second
teardown of a VM (``_teardown`` says "idempotent") frees the claim of whichever VM got
that uid in between - and the next VM runs as the same uid: two tenants' QEMUs under one
host uid (red team 23b B1's outcome, by another path the new ``_uid_lock`` does not
cover).

``_release_uid(uid)`` discards ``uid`` from ``_uids`` and unlinks ``<uid_dir>/<uid>``
when its first word is this backend's key - not when it names the sandbox being torn
down. ``_teardown`` releases ``vm.rec.uid`` every time it runs. It runs twice for one VM
when two destroys of it overlap (the node's create roll-back and a client's destroy
race: red team 24 A1 - both reach ``backend.destroy``; each sees the VM still in
``_vms`` until its own end), with the event loop free to run a create in between
(``_teardown`` awaits the process exit and a threaded ``remove_tree``).

Fix: release only a claim that names the sandbox (``owner == f"{key} {sid}"``, under
``_uid_lock``), and let ``_teardown`` release once (clear ``vm.rec.uid``/mark it
released); serialise destroys of one VM.
"""

from __future__ import annotations

import os

from dsec.edge.backends.vm import VmBackend
from tests.edge.vm.test_durability import _vm, bare  # noqa: F401  (fixture)


async def test_a_second_teardown_does_not_free_another_vms_uid(
        bare: VmBackend) -> None:  # noqa: F811
    b = bare
    a = _vm(b, "sb-a", uid=b._alloc_uid("sb-a"))
    b._vms["sb-a"] = a
    await b._teardown(a)                  # the first destroy's teardown
    uid_b = b._alloc_uid("sb-b")          # a create meanwhile: gets the freed uid
    assert uid_b == a.rec.uid
    await b._teardown(a)                  # the overlapping destroy's teardown ends
    with open(os.path.join(b.uid_dir, str(uid_b))) as f:  # noqa: ASYNC230
        assert f.read() == f"{b.key} sb-b\n", "sb-b's claim was freed by sb-a's teardown"
    assert b._alloc_uid("sb-c") != uid_b, "two VMs hold one uid"
