"""What the RL toolkit needs from sandboxes, and the adapter onto the edge.

:class:`SandboxAccess` is the boundary: create/destroy, a *batched* exec, file
read/write, pause/resume. Everything in :mod:`dsec.rl.sandbox` and
:mod:`dsec.rl.judges` talks to sandboxes only through it, so tests and users can plug in
anything that implements it.

The interface is synchronous on purpose: Gymnasium environments and the rollout loop
are synchronous. :class:`ClientAccess` implements it over the public SDK (a
:class:`~dsec.client.sync.Client` or :class:`~dsec.client.core.AsyncClient`), so a trainer
talks to ``dsec up`` or a remote cluster through the apiserver like any user; its
``exec_batch`` is one ``exec_many`` per tick, which the apiserver splits into one batched
edge call per node. :class:`EdgeAccess` implements it over :class:`~dsec.edge.node.EdgeNode`
objects (in-process) or :class:`~dsec.edge.service.EdgeClient` connections (Aether),
running their coroutines on one event loop in a background thread. Its
:meth:`EdgeAccess.exec_batch` groups the calls by the node that owns each sandbox (the
id says which) and sends one ``exec_many`` per node, all nodes concurrently: one round
trip per tick per node, whatever the number of environments.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import msgspec

from dsec.client.sync import drain_tasks
from dsec.errors import (
    DsecError,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SandboxNotFound,
    WrongNode,
)
from dsec.ids import node_of
from dsec.wire.spec import ExecRequest, ExecResult, SandboxSpec

if TYPE_CHECKING:
    from dsec.client.core import AsyncClient, AsyncSandbox
    from dsec.client.sync import Client

__all__ = ["BatchSandboxAccess", "ClientAccess", "DelegatingAccess", "EdgeAccess",
           "ExecOutcome", "LoopThread", "SandboxAccess", "create_sandboxes",
           "destroy_sandboxes", "is_infra_error", "pause_sandboxes", "resume_sandboxes"]

T = TypeVar("T")
# A batch item either ran (ExecResult, whatever its exit code) or failed as an operation
# (sandbox gone, node refused): one dead sandbox must not fail the other envs' step.
ExecOutcome = ExecResult | DsecError


def is_infra_error(exc: DsecError) -> bool:
    """True when ``exc`` is the platform's failure, not the agent's doing: the sandbox
    was lost or is in no state to run, the node or link failed, a deadline passed, the
    cluster is out of capacity. False for what the agent caused (a program or path that
    does not exist, a request it made invalid, a permission it lacks)."""
    return not isinstance(exc, InvalidArgument | PermissionDenied) and (
        isinstance(exc, SandboxNotFound) or not isinstance(exc, NotFound))


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


class DelegatingAccess:
    """A :class:`SandboxAccess` that passes every call to ``inner``: subclass it and
    override what you change (a command log, a test's spy or fault injector). Written
    out rather than ``__getattr__``, so mypy sees each method and the protocol holds."""

    def __init__(self, inner: SandboxAccess) -> None:
        self.inner = inner

    def create(self, spec: SandboxSpec) -> str:
        return self.inner.create(spec)

    def destroy(self, sandbox_id: str) -> None:
        self.inner.destroy(sandbox_id)

    def exec_batch(self, calls: Sequence[tuple[str, ExecRequest]]) -> list[ExecOutcome]:
        return self.inner.exec_batch(calls)

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self.inner.write_file(sandbox_id, path, data, mode=mode)

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return self.inner.read_file(sandbox_id, path)

    def pause(self, sandbox_id: str) -> None:
        self.inner.pause(sandbox_id)

    def resume(self, sandbox_id: str) -> None:
        self.inner.resume(sandbox_id)


@runtime_checkable
class BatchSandboxAccess(SandboxAccess, Protocol):
    """A :class:`SandboxAccess` that also creates, destroys, pauses and resumes many
    sandboxes at once (concurrently, or in one batched call). Optional: the module-level
    functions below fall back to one call per sandbox for a plain ``SandboxAccess``."""

    def create_many(self, specs: Sequence[SandboxSpec]) -> list[str]:
        """All or nothing: on any failure the ones created are destroyed and it raises."""

    def destroy_many(self, sandbox_ids: Sequence[str]) -> None:
        """Best effort, like ``destroy`` of each (already gone is fine)."""

    def pause_many(self, sandbox_ids: Sequence[str]) -> None: ...

    def resume_many(self, sandbox_ids: Sequence[str]) -> None: ...


def create_sandboxes(access: SandboxAccess, specs: Sequence[SandboxSpec]) -> list[str]:
    """Create one sandbox per spec, batched when ``access`` can; all or nothing."""
    if not specs:
        return []
    if isinstance(access, BatchSandboxAccess):
        return access.create_many(specs)
    made: list[str] = []
    try:
        for spec in specs:
            made.append(access.create(spec))
    except BaseException:
        destroy_sandboxes(access, made)
        raise
    return made


def destroy_sandboxes(access: SandboxAccess, sandbox_ids: Sequence[str]) -> None:
    """Destroy them, batched when ``access`` can; errors (already gone) are ignored."""
    if not sandbox_ids:
        return
    if isinstance(access, BatchSandboxAccess):
        try:
            access.destroy_many(sandbox_ids)
        except DsecError:
            pass
        return
    for sid in sandbox_ids:
        try:
            access.destroy(sid)
        except DsecError:
            pass  # already gone (evicted, node lost): nothing left to release


def pause_sandboxes(access: SandboxAccess, sandbox_ids: Sequence[str]) -> None:
    """Pause them, concurrently when ``access`` can (a preemption pauses every sandbox of
    a rollout: 64 container pauses one by one took 0.8 s through the API)."""
    if isinstance(access, BatchSandboxAccess):
        if sandbox_ids:
            access.pause_many(sandbox_ids)
        return
    for sid in sandbox_ids:
        access.pause(sid)


def resume_sandboxes(access: SandboxAccess, sandbox_ids: Sequence[str]) -> None:
    if isinstance(access, BatchSandboxAccess):
        if sandbox_ids:
            access.resume_many(sandbox_ids)
        return
    for sid in sandbox_ids:
        access.resume(sid)


async def _gather_all(coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run them concurrently; raise the first error only after every one finished (so no
    operation is left running behind the caller's back)."""
    res = await asyncio.gather(*coros, return_exceptions=True)
    for r in res:
        if isinstance(r, BaseException):
            raise r
    return res


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
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(drain_tasks(), self.loop).result(5)
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

    def create_many(self, specs: Sequence[SandboxSpec]) -> list[str]:
        targets = [self.targets[next(self._turn)] for _ in specs]

        async def go() -> list[str]:
            res = await asyncio.gather(*(t.create(s) for t, s in zip(targets, specs)),
                                       return_exceptions=True)
            made = [str(r.id) for r in res if not isinstance(r, BaseException)]
            failed = [r for r in res if isinstance(r, BaseException)]
            if failed:
                await asyncio.gather(*(self._target(sid).destroy(sid) for sid in made),
                                     return_exceptions=True)
                raise failed[0]
            return made
        return self._run(go())

    def destroy_many(self, sandbox_ids: Sequence[str]) -> None:
        self._run(_gather_all([self._target(s).destroy(s) for s in sandbox_ids]))

    def pause_many(self, sandbox_ids: Sequence[str]) -> None:
        self._run(_gather_all([self._target(s).pause(s) for s in sandbox_ids]))

    def resume_many(self, sandbox_ids: Sequence[str]) -> None:
        self._run(_gather_all([self._target(s).resume(s) for s in sandbox_ids]))

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._run(self._target(sandbox_id).write_file(sandbox_id, path, data, mode=mode))

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return bytes(self._run(self._target(sandbox_id).read_file(sandbox_id, path)))

    def pause(self, sandbox_id: str) -> None:
        self._run(self._target(sandbox_id).pause(sandbox_id))

    def resume(self, sandbox_id: str) -> None:
        self._run(self._target(sandbox_id).resume(sandbox_id))


class ClientAccess:
    """:class:`SandboxAccess` over the public SDK: ``dsec up``, a remote cluster, anything
    a :class:`~dsec.client.sync.Client` reaches.

    - ``client``: a sync ``Client`` (its own loop thread runs our calls) or an
      ``AsyncClient`` together with the :class:`LoopThread` it is used on (``loop=None``
      starts one, owned and closed by :meth:`close`; the client must then not be used on
      another loop).
    - every spec goes to the SDK whole (``sandboxes.create(spec=...)``): no field is
      rebuilt by hand, so none can be dropped (a hand-kept field list once dropped
      ``user_namespace``); ``backend``, ``project`` and ``ttl_s`` left None are the
      cluster's (``dsec up --backend``, the key's project, the server's TTL).
    - ``spec_overrides``: spec fields laid over every spec (``msgspec.structs.replace``),
      e.g. ``{"backend": "container", "ttl_s": 3600, "labels": {"run": "7"}}``; labels
      are merged. A name that is not a field of :class:`SandboxSpec` is refused here.
    - ``detached=True`` when a preempted rollout is to be resumed by another trainer
      process: otherwise the sandboxes are bound to this client's session lease and
      swept after the client closes or dies, whatever the client's own ``session``
      default (sandboxes outlive a plain client since issue 19; a trainer that crashes
      must not leave its pool running until the TTL). A client made with
      ``session_lease_s=None`` has no lease to bind to: its sandboxes live to their TTL.

    ``exec_batch`` is one ``client.sandboxes.exec_many`` per call (per tick of a
    :class:`~dsec.rl.sandbox.SandboxEnvPool`); the apiserver sends one batched call to each
    edge. ``calls`` counts the SDK operations issued, by name, for tests and benchmarks.
    """

    def __init__(self, client: Client | AsyncClient, loop: LoopThread | None = None, *,
                 spec_overrides: Mapping[str, Any] | None = None,
                 detached: bool = False) -> None:
        from dsec.client.core import AsyncClient
        from dsec.client.sync import Client

        self._own_loop: LoopThread | None = None
        self._runner: Callable[[Coroutine[Any, Any, Any]], Any]
        if isinstance(client, Client):
            if loop is not None:
                raise InvalidArgument("ClientAccess(Client(...)) runs on the client's own loop "
                                      "thread; pass loop= only with an AsyncClient")
            self.client: AsyncClient = client._a
            self._runner = client._run
        elif isinstance(client, AsyncClient):
            self.client = client
            if loop is None:
                loop = self._own_loop = LoopThread(name="dsec-rl-client")
            self._runner = loop.run
        else:
            raise InvalidArgument(f"ClientAccess needs a dsec Client or AsyncClient, not "
                                  f"{type(client).__name__}")
        self.spec_overrides = dict(spec_overrides or {})
        unknown = sorted(set(self.spec_overrides) - set(SandboxSpec.__struct_fields__))
        if unknown:
            raise InvalidArgument(f"spec_overrides {unknown} are not fields of SandboxSpec "
                                  f"({', '.join(SandboxSpec.__struct_fields__)})",
                                  field="spec_overrides")
        self.detached = detached
        self.calls: Counter[str] = Counter()
        # Sandbox handles by id; ids this access did not create (a pool restored in a new
        # trainer process) are looked up once with `get`.
        self._handles: dict[str, AsyncSandbox] = {}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the client on the loop it lives on and wait for it (e.g.
        ``access.run(async_client.close())`` before :meth:`close`)."""
        result: T = self._runner(coro)
        return result

    _run = run

    async def _sandbox(self, sandbox_id: str) -> AsyncSandbox:
        sb = self._handles.get(sandbox_id)
        if sb is None:
            self.calls["get"] += 1
            sb = self._handles[sandbox_id] = await self.client.sandboxes.get(sandbox_id)
        return sb

    def _spec(self, spec: SandboxSpec) -> SandboxSpec:
        """``spec`` with :attr:`spec_overrides` laid over it (labels merged)."""
        over = self.spec_overrides
        if not over:
            return spec
        if "labels" in over:
            over = {**over, "labels": {**spec.labels, **over["labels"]}}
        return msgspec.structs.replace(spec, **over)

    def _session(self) -> bool:
        """Bind creates to the client's session lease unless detached (or no lease)."""
        return not self.detached and self.client.session_lease_s is not None

    def create(self, spec: SandboxSpec) -> str:
        self.calls["create"] += 1
        sb = self._run(self.client.sandboxes.create(spec=self._spec(spec),
                                                    session=self._session()))
        self._handles[sb.id] = sb
        return sb.id

    def destroy(self, sandbox_id: str) -> None:
        async def go() -> None:
            try:
                sb = await self._sandbox(sandbox_id)
            except NotFound:
                return
            self.calls["destroy"] += 1
            await sb.kill()
        try:
            self._run(go())
        finally:
            self._handles.pop(sandbox_id, None)

    def exec_batch(self, calls: Sequence[tuple[str, ExecRequest]]) -> list[ExecOutcome]:
        if not calls:
            return []
        self.calls["exec_many"] += 1
        return self._run(self.client.sandboxes.exec_many(list(calls), return_exceptions=True))

    def create_many(self, specs: Sequence[SandboxSpec]) -> list[str]:
        """One batched SDK ``create_many`` (per-item keywords); all or nothing."""
        if not specs:
            return []
        items = [self._spec(spec) for spec in specs]
        self.calls["create_many"] += 1
        made = self._run(self.client.sandboxes.create_many(items, session=self._session()))
        self._handles.update((sb.id, sb) for sb in made)
        return [sb.id for sb in made]

    def destroy_many(self, sandbox_ids: Sequence[str]) -> None:
        async def one(sid: str) -> None:
            try:
                sb = await self._sandbox(sid)
            except NotFound:
                return
            self.calls["destroy"] += 1
            await sb.kill()
        try:
            self._run(_gather_all([one(s) for s in sandbox_ids]))
        finally:
            for sid in sandbox_ids:
                self._handles.pop(sid, None)

    def pause_many(self, sandbox_ids: Sequence[str]) -> None:
        async def one(sid: str) -> None:
            sb = await self._sandbox(sid)
            self.calls["pause"] += 1
            await sb.pause()
        self._run(_gather_all([one(s) for s in sandbox_ids]))

    def resume_many(self, sandbox_ids: Sequence[str]) -> None:
        async def one(sid: str) -> None:
            sb = await self._sandbox(sid)
            self.calls["resume"] += 1
            await sb.resume()
        self._run(_gather_all([one(s) for s in sandbox_ids]))

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        async def go() -> None:
            sb = await self._sandbox(sandbox_id)
            self.calls["write_file"] += 1
            await sb.files.write(path, data, mode=mode)
        self._run(go())

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        async def go() -> bytes:
            sb = await self._sandbox(sandbox_id)
            self.calls["read_file"] += 1
            return await sb.files.read(path)
        return self._run(go())

    def pause(self, sandbox_id: str) -> None:
        async def go() -> None:
            sb = await self._sandbox(sandbox_id)
            self.calls["pause"] += 1
            await sb.pause()
        self._run(go())

    def resume(self, sandbox_id: str) -> None:
        async def go() -> None:
            sb = await self._sandbox(sandbox_id)
            self.calls["resume"] += 1
            await sb.resume()
        self._run(go())

    def close(self) -> None:
        """Stop the loop thread this access started, if any. The client stays the
        caller's: close an ``AsyncClient`` first with ``access.run(client.close())``."""
        if self._own_loop is not None:
            self._own_loop.close()
            self._own_loop = None
