"""``sandbox.network``: read and change a live sandbox's egress policy.

``sb.network.get()`` answers the policy as its edge enforces it (canonical entries, the
generation, denied counts); ``sb.network.update(allow=[...], deny=[...])`` replaces it
atomically, e.g. between an environment-building phase that may reach a package mirror
and a solving phase that may not (``update(mode="none")``). Entries and modes are the
ones of :class:`~dsec.wire.netpolicy.NetworkPolicy` (docs/networking.md); a policy beyond
the project's network ceiling is refused with ``PermissionDenied`` naming the entry.
The sync :class:`Network` mirrors :class:`AsyncNetwork` keyword for keyword.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from dsec.errors import InvalidArgument
from dsec.wire import ops
from dsec.wire.calls import NetworkUpdate, SandboxRef
from dsec.wire.netpolicy import NetMode, NetworkPolicy
from dsec.wire.ops import Op
from dsec.wire.spec import NetworkView

__all__ = ["AsyncNetwork", "Network", "policy_of"]

T = TypeVar("T")


def policy_of(policy: NetworkPolicy | NetMode | None, *, mode: NetMode | None,
              allow: Sequence[str] | None, deny: Sequence[str] | None,
              max_connections: int | None, rate_mbit: int | None) -> NetworkPolicy:
    """The policy an ``update`` (or a create) asks for: ``policy`` as given, or one built
    from the keywords (entries given without a mode mean mode ``"policy"``)."""
    if isinstance(policy, str):
        if mode is not None and mode != policy:
            raise InvalidArgument(f"network={policy!r} and mode={mode!r} disagree: give one",
                                  field="mode")
        mode, policy = policy, None
    if policy is not None:
        if any(v is not None for v in (mode, allow, deny, max_connections, rate_mbit)):
            raise InvalidArgument("pass either a NetworkPolicy or the mode/allow/deny "
                                  "keywords, not both", field="policy")
        return policy
    if isinstance(allow, str) or isinstance(deny, str):
        raise InvalidArgument("allow and deny are lists of entries (['pypi.org:443']), "
                              "not one string", field="allow" if isinstance(allow, str)
                              else "deny")
    if mode is None:
        mode = "policy" if (allow or deny) else "none"
    return NetworkPolicy(mode=mode, allow=tuple(allow or ()), deny=tuple(deny or ()),
                         max_connections=max_connections, rate_mbit=rate_mbit)


Req = TypeVar("Req")
Rep = TypeVar("Rep")


class _Calls(Protocol):
    """What this module needs of the client (``AsyncClient.call``); a Protocol, so
    ``client.core`` (which builds sandboxes with a ``network``) is not imported back."""

    async def call(self, op: Op[Req, Rep], body: Req) -> Rep: ...


class _Sandbox(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def _c(self) -> _Calls: ...


class AsyncNetwork:
    """``sandbox.network`` of the async SDK."""

    def __init__(self, sb: _Sandbox) -> None:
        self._sb = sb

    async def get(self) -> NetworkView:
        """The egress policy as enforced (canonical entries), its generation, the
        project ceilings' denies added to it and what was denied."""
        return await self._sb._c.call(ops.NETWORK_GET, SandboxRef(id=self._sb.id))

    async def update(self, policy: NetworkPolicy | NetMode | None = None, *,
                     mode: NetMode | None = None, allow: Sequence[str] | None = None,
                     deny: Sequence[str] | None = None, max_connections: int | None = None,
                     rate_mbit: int | None = None,
                     expect_generation: int | None = None) -> NetworkView:
        """Replace the egress policy, atomically (flows it no longer allows are cut).
        ``update(allow=["pypi.org:443"])`` is mode ``"policy"``; ``update(mode="none")``
        closes the network. ``expect_generation``: only if the policy is still at that
        generation (``Conflict`` otherwise). Safe to retry: the same policy twice is one
        change."""
        body = NetworkUpdate(id=self._sb.id, policy=policy_of(
            policy, mode=mode, allow=allow, deny=deny, max_connections=max_connections,
            rate_mbit=rate_mbit), expect_generation=expect_generation)
        return await self._sb._c.call(ops.NETWORK_UPDATE, body)


class _Runs(Protocol):
    def _run(self, coro: Coroutine[Any, Any, T]) -> T: ...


class Network:
    """``sandbox.network`` of the sync SDK (see :class:`AsyncNetwork`)."""

    def __init__(self, client: _Runs, a: AsyncNetwork) -> None:
        self._c = client
        self._a = a

    def get(self) -> NetworkView:
        """The egress policy as enforced (canonical entries), its generation, the
        project ceilings' denies added to it and what was denied."""
        return self._c._run(self._a.get())

    def update(self, policy: NetworkPolicy | NetMode | None = None, *,
               mode: NetMode | None = None, allow: Sequence[str] | None = None,
               deny: Sequence[str] | None = None, max_connections: int | None = None,
               rate_mbit: int | None = None,
               expect_generation: int | None = None) -> NetworkView:
        """Replace the egress policy, atomically (see :meth:`AsyncNetwork.update`)."""
        return self._c._run(self._a.update(
            policy, mode=mode, allow=allow, deny=deny, max_connections=max_connections,
            rate_mbit=rate_mbit, expect_generation=expect_generation))
