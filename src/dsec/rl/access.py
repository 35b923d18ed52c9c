"""What the RL toolkit needs from sandboxes, and the adapter onto the edge.

:class:`SandboxAccess` is the boundary: create/destroy, a *batched* exec, file
read/write, pause/resume. Everything in :mod:`dsec.rl.sandbox` and
:mod:`dsec.rl.judges` talks to sandboxes only through it, so tests and users can plug in
anything that implements it.

The interface is synchronous on purpose: Gymnasium environments and the rollout loop
are synchronous. :class:`EdgeAccess` implements it over :class:`~dsec.edge.node.EdgeNode`
objects (in-process) or :class:`~dsec.edge.service.EdgeClient` connections (Aether),
running their coroutines on one event loop in a background thread. Its
:meth:`EdgeAccess.exec_batch` groups the calls by the node that owns each sandbox (the
id says which) and sends one ``exec_many`` per node, all nodes concurrently: one round
trip per tick per node, whatever the number of environments.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from dsec.edge.spec import ExecRequest, ExecResult, SandboxSpec
from dsec.errors import DsecError, InternalError, InvalidArgument, WrongNode
from dsec.ids import node_of

__all__ = ["EdgeAccess", "ExecOutcome", "LoopThread", "SandboxAccess"]

T = TypeVar("T")
# A batch item either ran (ExecResult, whatever its exit code) or failed as an operation
# (sandbox gone, node refused): one dead sandbox must not fail the other envs' step.
ExecOutcome = ExecResult | DsecError


@runtime_checkable
class SandboxAccess(Protocol):
    def create(self, spec: SandboxSpec) -> str:
        """Create a running sandbox; returns its id."""

    def destroy(self, sandbox_id: str) -> None:
        """Destroy it and everything in it; idempotent."""

    def exec_batch(self, calls: Sequence[tuple[str, ExecRequest]]) -> list[ExecOutcome]:
        """Run each ``(sandbox_id, request)``; outcomes in the same order."""

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Create or replace ``path`` (parents must exist)."""

    def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    def pause(self, sandbox_id: str) -> None: ...

    def resume(self, sandbox_id: str) -> None: ...


class LoopThread:
    """An asyncio event loop running in a daemon thread, for sync callers of async code."""

    def __init__(self, *, name: str = "dsec-rl-loop") -> None:
        try:
            import uvloop
            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a core dependency
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (raises what it raises)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise InternalError("LoopThread.run called from its own loop thread (deadlock)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class EdgeAccess:
    """:class:`SandboxAccess` over edge nodes or edge clients, keyed by node id.

    ``targets`` maps node id -> an object with the edge's async API (``EdgeNode`` or
    ``EdgeClient``); they must live on ``loop``. New sandboxes go to the nodes in turn
    (placement is the apiserver's job; this adapter is for direct edge access).
    """

    def __init__(self, targets: Mapping[str, Any], loop: LoopThread, *,
                 timeout_s: float | None = 120.0) -> None:
        if not targets:
            raise InvalidArgument("EdgeAccess needs at least one edge node or client")
        self.targets = dict(targets)
        self.loop = loop
        self.timeout_s = timeout_s
        self._turn = itertools.cycle(list(self.targets))

    def _target(self, sandbox_id: str) -> Any:
        node = node_of(sandbox_id)
        t = self.targets.get(node)
        if t is None:
            raise WrongNode(f"sandbox {sandbox_id} lives on node {node!r}, which this "
                            f"EdgeAccess does not reach (it knows {sorted(self.targets)})",
                            sandbox_id=sandbox_id, node=node)
        return t

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(coro, self.timeout_s)

    def create(self, spec: SandboxSpec) -> str:
        info = self._run(self.targets[next(self._turn)].create(spec))
        return str(info.id)

    def destroy(self, sandbox_id: str) -> None:
        self._run(self._target(sandbox_id).destroy(sandbox_id))

    def exec_batch(self, calls: Sequence[tuple[str, ExecRequest]]) -> list[ExecOutcome]:
        if not calls:
            return []
        groups: dict[str, list[int]] = {}
        out: list[ExecOutcome | None] = [None] * len(calls)
        for i, (sid, _) in enumerate(calls):
            try:
                node = node_of(sid)
            except DsecError as exc:
                out[i] = exc
                continue
            if node not in self.targets:
                out[i] = WrongNode(f"sandbox {sid} lives on node {node!r}, which this "
                                   "EdgeAccess does not reach", sandbox_id=sid, node=node)
                continue
            groups.setdefault(node, []).append(i)

        async def one_node(node: str, idx: list[int]) -> None:
            res = await self.targets[node].exec_many([calls[i] for i in idx])
            for i, r in zip(idx, res):
                out[i] = r

        async def all_nodes() -> None:
            await asyncio.gather(*(one_node(n, idx) for n, idx in groups.items()))

        if groups:
            self._run(all_nodes())
        return out  # type: ignore[return-value]

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._run(self._target(sandbox_id).write_file(sandbox_id, path, data, mode=mode))

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return bytes(self._run(self._target(sandbox_id).read_file(sandbox_id, path)))

    def pause(self, sandbox_id: str) -> None:
        self._run(self._target(sandbox_id).pause(sandbox_id))

    def resume(self, sandbox_id: str) -> None:
        self._run(self._target(sandbox_id).resume(sandbox_id))
