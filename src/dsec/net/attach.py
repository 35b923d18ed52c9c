"""Sandboxes on router slots: what a backend calls at create, update and destroy (shell).

A backend holds one :class:`SandboxNetwork` (or none: every sandbox then gets today's
private loopback-only netns). At create it asks :meth:`attach`: the spec's policy is
compiled to set elements (``compile``, injected: the policy language is the wire's,
this layer only sees addresses and ports), a free slot is taken and loaded in one batch,
and the slot's netns fd goes to the zygote, whose child joins it instead of making one.
A spec that compiles to None (mode ``none``) gets no slot: no veth, no cost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from dsec.errors import Conflict, DsecError
from dsec.net.nftwire import SlotPolicy
from dsec.net.router import Router, Slot
from dsec.wire.spec import SandboxSpec

__all__ = ["PolicyCompiler", "SandboxNetwork"]

log = logging.getLogger(__name__)

#: spec -> the slot's set elements, or None for "no network beyond loopback". Raises
#: InvalidArgument for a policy this node cannot enforce.
PolicyCompiler = Callable[[SandboxSpec], SlotPolicy | None]


@dataclass
class SandboxNetwork:
    router: Router
    compile: PolicyCompiler
    by_sandbox: dict[str, Slot] = field(default_factory=dict)
    policies: dict[str, SlotPolicy] = field(default_factory=dict)

    def resolv_conf(self) -> bytes:
        """/etc/resolv.conf of a sandbox on a slot: the router's resolver (every DNS
        packet is redirected there anyway; this only spares clients a timeout)."""
        return f"nameserver {self.router.pool.resolver}\noptions timeout:2 attempts:2\n".encode()

    def attach(self, sid: str, spec: SandboxSpec) -> Slot | None:
        """Compile, take a slot, load it; None when the spec needs no slot."""
        if sid in self.by_sandbox:
            raise Conflict(f"sandbox {sid} already holds network slot "
                           f"{self.by_sandbox[sid].index}", sandbox_id=sid)
        policy = self.compile(spec)
        if policy is None:
            return None
        slot = self.router.take()
        try:
            self.router.load(slot, policy)
        except BaseException:
            self.router.release(slot)  # nothing ran in it: safe to reuse
            raise
        self.by_sandbox[sid] = slot
        self.policies[sid] = policy
        return slot

    def slot(self, sid: str) -> Slot | None:
        return self.by_sandbox.get(sid)

    def update(self, sid: str, spec: SandboxSpec) -> int | None:
        """Load the spec's policy on the sandbox's slot (one atomic batch; flows the new
        policy forbids are cut). Returns the new generation, the current one when the
        compiled policy did not change (an idempotent retry cuts nothing), or None for
        a sandbox without a slot. A change between "no slot" and "a slot" needs a new
        sandbox: the netns of a running sandbox cannot be swapped."""
        slot = self.by_sandbox.get(sid)
        policy = self.compile(spec)
        if slot is None:
            if policy is None:
                return None
            raise Conflict(
                f"sandbox {sid} was created without a network slot (policy 'none'); a "
                "running sandbox cannot gain one - create a new sandbox with the policy",
                sandbox_id=sid)
        if policy is None:
            policy = SlotPolicy()  # everything closed, the slot kept
        if self.policies.get(sid) == policy:
            return slot.generation
        gen = self.router.load(slot, policy)
        self.policies[sid] = policy
        return gen

    def detach(self, sid: str, *, reusable: bool) -> None:
        """The sandbox is gone: recycle its slot (``reusable``: every process of it is
        known dead) or drop it. Never raises: a failure only costs the slot."""
        slot = self.by_sandbox.pop(sid, None)
        self.policies.pop(sid, None)
        if slot is None:
            return
        try:
            self.router.release(slot, reusable=reusable)
        except DsecError as exc:
            log.warning("net: releasing slot %d of %s failed: %s", slot.index, sid, exc.message)
        except OSError as exc:
            log.warning("net: releasing slot %d of %s failed: %s", slot.index, sid, exc)
