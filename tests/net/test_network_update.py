"""``EdgeNode.network_update``: durable before acknowledged, atomic, idempotent.

A real node (journal on disk) over the container backend on router slots; the journal
file is read the way a restarted edge would read it.
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator

import msgspec
import pytest

from dsec.edge.admission import Capacity
from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.journal import JOURNAL
from dsec.edge.node import EdgeNode, NodeConfig
from dsec.errors import BackendError
from dsec.net.attach import SandboxNetwork
from dsec.net.router import Router
from dsec.net.testinternet import ALLOWED, CIDR_IN, SIBLING, Internet
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import ExecRequest, SandboxSpec

from ..edge.container.conftest import _cleanup
from .test_egress_hostile import images_dir, policy

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

__all__ = ["images_dir"]  # the session fixture, shared


def journal_network(state_dir: str, sid: str) -> tuple[str, ...] | None:
    """The allow list of ``sid``'s last journal record (as a restart would read it)."""
    allow: tuple[str, ...] | None = None
    with open(os.path.join(state_dir, JOURNAL), "rb") as f:
        for line in f.read().splitlines():
            if not line.strip():
                continue
            rec = msgspec.json.decode(line)
            if rec[0] == "put" and rec[1] == sid:
                allow = tuple(rec[3].get("network", {}).get("allow", ()))
    return allow


class Recording(SandboxNetwork):
    """Notes what the journal file said when each kernel update began."""

    state_dir: str = ""
    seen: list[tuple[str, ...] | None]

    def update(self, sid: str, spec: SandboxSpec,
               ceiling_deny: tuple[str, ...] = ()) -> int | None:
        self.seen.append(journal_network(self.state_dir, sid))
        return super().update(sid, spec, ceiling_deny)


@pytest.fixture
async def node(tmp_path: object, images_dir: str, router: Router,
               internet: Internet) -> AsyncIterator[tuple[EdgeNode, Recording, str]]:
    state = os.path.join(str(tmp_path), "state")
    net = Recording(router)
    net.state_dir, net.seen = state, []
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), network=net)
    n = EdgeNode(NodeConfig(node_id="t1", capacity=Capacity(
        cpu_milli=64_000, memory_bytes=64 << 30, max_sandboxes=64), state_dir=state),
        b, rng=random.Random(3))
    await n.start()
    try:
        yield n, net, state
    finally:
        try:
            for info in n.list():
                await n.destroy(info.id)
        finally:
            await _cleanup(b)
            await n.close()


async def test_update_is_journaled_before_the_kernel_and_retry_is_a_noop(
        node: tuple[EdgeNode, Recording, str]) -> None:
    n, net, state = node
    info = await n.create(policy(f"{ALLOWED}:80/tcp"))
    slot = net.slot(info.id)
    assert slot is not None
    new = NetworkPolicy(mode="policy", allow=(f"{CIDR_IN}:80/tcp",))
    view = await n.network_update(info.id, new)
    assert view.generation == 2
    assert net.seen == [(f"{CIDR_IN}:80/tcp",)]  # on disk before the batch ran
    assert journal_network(state, info.id) == (f"{CIDR_IN}:80/tcp",)
    assert n.get(info.id).spec.network == new
    kernel_gen = slot.generation
    assert f"{CIDR_IN} . tcp . 80" in net.router.nft(f"list set inet dsec s{slot.index}a4")
    # a retry (the client lost the answer) changes nothing and cuts nothing
    assert (await n.network_update(info.id, new)).generation == 2
    assert slot.generation == kernel_gen and len(net.seen) == 1


async def test_a_refused_batch_puts_the_journal_back(
        node: tuple[EdgeNode, Recording, str], monkeypatch: pytest.MonkeyPatch) -> None:
    n, net, state = node
    info = await n.create(policy(f"{ALLOWED}:80/tcp"))
    slot = net.slot(info.id)
    assert slot is not None
    gen = slot.generation
    plan = net.policies[info.id]

    def refused(*_a: object, **_k: object) -> int:  # the kernel refuses the batch
        raise BackendError(f"policy of slot {slot.index}: the kernel refused it: ENOMEM")
    monkeypatch.setattr(net.router, "load", refused)
    new = NetworkPolicy(mode="policy", allow=(f"{SIBLING}:80/tcp",))
    with pytest.raises(BackendError, match="kernel refused"):
        await n.network_update(info.id, new)
    assert net.seen[-1] == (f"{SIBLING}:80/tcp",)  # it was journaled first...
    assert journal_network(state, info.id) == (f"{ALLOWED}:80/tcp",)  # ...and put back
    assert n.get(info.id).spec.net.allow == (f"{ALLOWED}:80/tcp",)
    assert slot.generation == gen and net.policies[info.id] == plan
    monkeypatch.undo()
    text = net.router.nft(f"list set inet dsec s{slot.index}a4")
    assert f"{ALLOWED} . tcp . 80" in text and SIBLING not in text


async def test_ceiling_denies_are_in_the_kernel_from_create_on(
        node: tuple[EdgeNode, Recording, str]) -> None:
    n, net, _state = node
    info = await n.create(policy("203.0.113.0/24:80/tcp"), ceiling_deny=(f"{ALLOWED}:80/tcp",))
    slot = net.slot(info.id)
    assert slot is not None
    assert f"{ALLOWED} . tcp . 80" in net.router.nft(f"list set inet dsec s{slot.index}d4")
    # the control plane sends the ceilings' denies with every update: they stay
    await n.network_update(info.id, NetworkPolicy(mode="policy", allow=("203.0.113.0/24:80/tcp",
                                                                       f"{CIDR_IN}:80/tcp")),
                           ceiling_deny=(f"{ALLOWED}:80/tcp",))
    assert f"{ALLOWED} . tcp . 80" in net.router.nft(f"list set inet dsec s{slot.index}d4")


async def test_network_get_shows_what_the_node_enforces(
        node: tuple[EdgeNode, Recording, str]) -> None:
    """network_get says "as enforced": the sandbox's address on its slot, the packets its
    slot dropped (as of the last counter poll), its live pins; none of them for a
    sandbox without a slot (REDTEAM-14 "noticed": they were never filled)."""
    n, net, _state = node
    info = await n.create(policy(f"{ALLOWED}:80/tcp"))
    slot = net.slot(info.id)
    assert slot is not None
    view = n.network_get(info.id)
    assert view.address == str(slot.addr.sandbox_ip) and view.denied_packets == 0
    r = await n.exec(info.id, ExecRequest(shell=f"nettool tcp {SIBLING} 80 x", timeout_s=20))
    assert b"ERR" in r.stdout + r.stderr
    net.poll_denied()
    assert n.network_get(info.id).denied_packets >= 1
    closed = await n.create(policy(mode="none"))
    assert n.network_get(closed.id).address is None


async def test_v6_entries_on_a_node_without_ipv6_are_said_inert(
        node: tuple[EdgeNode, Recording, str]) -> None:
    """A policy naming IPv6 entries on a node whose sandboxes have no IPv6: accepted,
    ``network_get`` says ``ipv6: false``, and the create and the update each leave a
    ``network_ipv6_inert`` notice naming the entries (never a silent no-op)."""
    n, _net, _state = node
    info = await n.create(policy(f"{ALLOWED}:80/tcp", "[2001:db8::/32]:443/tcp"))
    assert n.network_get(info.id).ipv6 is False
    notes = [e for e in n.events(info.id) if e.reason == "network_ipv6_inert"]
    assert len(notes) == 1 and "[2001:db8::/32]:443/tcp" in notes[0].detail, notes
    assert "accepted but inert" in notes[0].detail
    await n.network_update(info.id, NetworkPolicy(
        mode="policy", allow=(f"{ALLOWED}:80/tcp",), deny=("[2001:db8::1]",)))
    notes = [e for e in n.events(info.id) if e.reason == "network_ipv6_inert"]
    assert len(notes) == 2 and "[2001:db8::1]" in notes[1].detail, notes
    # v4 only: nothing to say
    plain = await n.create(policy(f"{ALLOWED}:80/tcp"))
    assert [e for e in n.events(plain.id) if e.reason == "network_ipv6_inert"] == []
