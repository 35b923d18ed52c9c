"""The SDK, sync: :class:`Client` and :class:`Sandbox`, thin shells over the async core.

Each :class:`Client` owns one private event-loop thread and runs the async core's
coroutines on it, so there is exactly one implementation of every behaviour (retries,
idempotency keys, sessions, error mapping) and the sync API mirrors the async one
method for method. The loop thread also renews the client's session lease in the
background.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal, Self, TypeVar, overload

from dsec.client.code import Execution
from dsec.client.core import (
    AsyncClient,
    AsyncPorts,
    AsyncSandbox,
    AsyncSandboxes,
    AsyncSnapshots,
    Snapshot,
    WireProtocol,
)
from dsec.client.files import Files
from dsec.client.images import AsyncImages, LayerKind
from dsec.client.network import Network
from dsec.client.processes import (
    AsyncProcessHandle,
    OutputCallback,
    Processes,
    ProcessHandle,
    Pty,
)
from dsec.client.transport import Transport
from dsec.errors import DsecError
from dsec.wire.api import (
    ImagePinView,
    ImagePromoteRequest,
    ImagePruned,
    ImagePushed,
    ImageView,
    Info,
    NodeView,
)
from dsec.wire.cluster import JoinedNode, JoinTokenView, NodeMigration
from dsec.wire.layers import LayerFetched
from dsec.wire.netpolicy import NetMode
from dsec.wire.ops import USE_CLIENT_DEFAULT, Deadline, Op, UploadOp
from dsec.wire.ports import ExposedPort
from dsec.wire.spec import (
    BackendName,
    ExecChunk,
    ExecRequest,
    ExecResult,
    IdleAction,
    Isolation,
    NetworkPolicy,
    PauseStats,
    QosClass,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SandboxStats,
)

__all__ = ["Client", "ExecCall", "Files", "Images", "Sandbox", "Sandboxes", "Snapshots"]

T = TypeVar("T")
Req = TypeVar("Req")
Rep = TypeVar("Rep")

# One exec_many item: (sandbox, command) or (sandbox, command, {keyword: override}).
ExecCall = (tuple["Sandbox | str", "str | Sequence[str] | ExecRequest"]
            | tuple["Sandbox | str", "str | Sequence[str] | ExecRequest", Mapping[str, Any]])


class _Loop:
    """A daemon thread running an event loop (uvloop when available)."""

    def __init__(self) -> None:
        try:
            import uvloop
            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dsec-client",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a sync dsec Client was called from its own loop thread")
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result()

    def stop(self) -> None:
        """Stop the loop as ``asyncio.run`` ends one: the tasks still pending (a process
        handle's follower, the close of a stream a generator left) cancelled and
        awaited, every async generator finalized, then the loop stopped and closed.
        Before, the loop was closed with them pending: "Task was destroyed but it is
        pending!" on stderr at exit (seen in CI from `dsec sandbox attach`)."""
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(drain_tasks(), self.loop).result(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


async def drain_tasks() -> None:
    """On a loop about to be stopped from another thread: cancel and await every other
    task, finalize the async generators (and await the closes that starts). What
    ``asyncio.run`` does before closing its loop; every loop-in-a-thread of dsec (this
    client's, the RL access thread, LocalCluster, the hosts relay) calls it."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
    tasks = [t for t in asyncio.all_tasks() if t is not me]   # what the finalizers began
    await asyncio.gather(*tasks, return_exceptions=True)


class Client:
    """``client = Client()`` (or ``Client(url=..., api_key=...)``); see
    :class:`~dsec.client.core.AsyncClient` for every option."""

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, timeout: float | None = 30.0,
        protocol: WireProtocol = "auto", transport: Transport | None = None,
        gateway: str | None = None, retries: int = 3,
        session_lease_s: float | None = 60.0, create_retry_s: float | None = 120.0,
        session: bool = False, _http_transport: Any = None,
    ) -> None:
        self._loop = _Loop()
        try:
            self._a = AsyncClient(url, api_key, timeout=timeout, protocol=protocol,
                                  transport=transport,
                                  gateway=gateway, retries=retries,
                                  session_lease_s=session_lease_s,
                                  create_retry_s=create_retry_s, session=session,
                                  _http_transport=_http_transport)
        except BaseException:
            self._loop.stop()
            raise
        self.url = self._a.url
        self.sandboxes = Sandboxes(self, self._a.sandboxes)
        self.snapshots = Snapshots(self, self._a.snapshots)
        self.images = Images(self, self._a.images)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def call(self, op: Op[Req, Rep], body: Req, *, idempotent: bool | None = None,
             timeout: Deadline = USE_CLIENT_DEFAULT) -> Rep:
        """See :meth:`~dsec.client.core.AsyncClient.call`: one operation of the
        catalogue with its request object, typed by the row."""
        return self._run(self._a.call(op, body, idempotent=idempotent, timeout=timeout))

    def upload(self, op: UploadOp[Req, Rep], body: Req, chunks: Iterator[bytes]) -> Rep:
        """See :meth:`~dsec.client.core.AsyncClient.upload`: an upload row, its body the
        byte pieces ``chunks`` gives (read in a worker thread, off the client's loop)."""
        async def pieces() -> AsyncIterator[bytes]:
            it = iter(chunks)
            while (piece := await asyncio.to_thread(next, it, None)) is not None:
                yield piece
        return self._run(self._a.upload(op, body, pieces()))

    def info(self) -> Info:
        return self._run(self._a.info())

    def fetch_layer(self, node_id: str, digest: str, *,
                    source: str | None = None) -> LayerFetched:
        """See :meth:`AsyncClient.fetch_layer`."""
        return self._run(self._a.fetch_layer(node_id, digest, source=source))

    def nodes(self) -> list[NodeView]:
        return self._run(self._a.nodes())

    def create_join_token(self, *, ttl_s: float = 86400.0, uses: int = 1,
                          description: str = "") -> JoinTokenView:
        """See :meth:`AsyncClient.create_join_token`."""
        return self._run(self._a.create_join_token(ttl_s=ttl_s, uses=uses,
                                                   description=description))

    def join_tokens(self) -> list[JoinTokenView]:
        return self._run(self._a.join_tokens())

    def revoke_join_token(self, token_id: str, *, nodes: bool = False) -> None:
        """See :meth:`AsyncClient.revoke_join_token`."""
        self._run(self._a.revoke_join_token(token_id, nodes=nodes))

    def joined_nodes(self) -> list[JoinedNode]:
        return self._run(self._a.joined_nodes())

    def revoke_joined_node(self, node_id: str) -> None:
        """See :meth:`AsyncClient.revoke_joined_node`."""
        self._run(self._a.revoke_joined_node(node_id))

    def drain_node(self, node_id: str) -> NodeView:
        """See :meth:`AsyncClient.drain_node`."""
        return self._run(self._a.drain_node(node_id))

    def migrate_node(self, node_id: str) -> NodeMigration:
        """See :meth:`AsyncClient.migrate_node`."""
        return self._run(self._a.migrate_node(node_id))

    def undrain_node(self, node_id: str) -> NodeView:
        """See :meth:`AsyncClient.undrain_node`."""
        return self._run(self._a.undrain_node(node_id))

    @property
    def transport_name(self) -> str | None:
        return self._a.transport_name

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        try:
            self._run(self._a.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandboxes:
    def __init__(self, client: Client, a: AsyncSandboxes) -> None:
        self._c = client
        self._a = a

    def create(
        self, *, spec: SandboxSpec | None = None, image: str = "base",
        workspace: str | None = None,
        toolkits: Sequence[str] = (), snapshot: Snapshot | str | None = None,
        backend: BackendName | None = None, cpu: float = 1, memory: int | str = "512MiB",
        disk: int | str | None = None, pids_max: int | None = 1024, priority: int = 0,
        labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
        project: str | None = None, ttl: float | None = None,
        idle_timeout: float | None = None, idle_action: IdleAction = "destroy",
        ttl_action: IdleAction = "destroy",
        network: NetworkPolicy | NetMode | None = None, allow_nested: bool = False,
        user_namespace: bool = False, detached: bool = False,
        idempotency_key: str | None = None, cwd: str | None = None, user: str | None = None,
        build_step: str | None = None, session: bool | None = None,
        qos: QosClass | None = None, cpu_quota: float | None = None,
        isolation: Isolation | None = None,
    ) -> Sandbox:
        """See :meth:`~dsec.client.core.AsyncSandboxes.create`."""
        return Sandbox(self._c, self._c._run(self._a.create(
            spec=spec, image=image, workspace=workspace, toolkits=toolkits, snapshot=snapshot,
            backend=backend, cpu=cpu, memory=memory, disk=disk, pids_max=pids_max,
            priority=priority, labels=labels, env=env, project=project, ttl=ttl,
            idle_timeout=idle_timeout, idle_action=idle_action, ttl_action=ttl_action,
            network=network,
            allow_nested=allow_nested, user_namespace=user_namespace, detached=detached,
            idempotency_key=idempotency_key, cwd=cwd, user=user, build_step=build_step,
            session=session, qos=qos, cpu_quota=cpu_quota, isolation=isolation)))

    def create_many(
        self, n: int | Sequence[Mapping[str, Any] | SandboxSpec], *, image: str = "base",
        workspace: str | None = None, toolkits: Sequence[str] = (),
        snapshot: Snapshot | str | None = None, backend: BackendName | None = None, cpu: float = 1,
        memory: int | str = "512MiB", disk: int | str | None = None,
        pids_max: int | None = 1024, priority: int = 0,
        labels: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
        project: str | None = None, ttl: float | None = None,
        idle_timeout: float | None = None, idle_action: IdleAction = "destroy",
        ttl_action: IdleAction = "destroy",
        network: NetworkPolicy | NetMode | None = None, allow_nested: bool = False,
        user_namespace: bool = False, detached: bool = False,
        cwd: str | None = None, user: str | None = None, session: bool | None = None,
        qos: QosClass | None = None, cpu_quota: float | None = None,
        isolation: Isolation | None = None,
    ) -> list[Sandbox]:
        """See :meth:`~dsec.client.core.AsyncSandboxes.create_many`."""
        return [Sandbox(self._c, s) for s in self._c._run(self._a.create_many(
            n, image=image, workspace=workspace, toolkits=toolkits, snapshot=snapshot,
            backend=backend, cpu=cpu, memory=memory, disk=disk, pids_max=pids_max,
            priority=priority, labels=labels, env=env, project=project, ttl=ttl,
            idle_timeout=idle_timeout, idle_action=idle_action, ttl_action=ttl_action,
            network=network,
            allow_nested=allow_nested, user_namespace=user_namespace, detached=detached,
            cwd=cwd, user=user, session=session, qos=qos, cpu_quota=cpu_quota,
            isolation=isolation))]

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._c, self._c._run(self._a.get(sandbox_id)))

    def list(self, *, project: str | None = None, labels: Mapping[str, str] | None = None,
             state: SandboxState | None = None, limit: int | None = None,
             node: str | None = None,
             isolation: Isolation | None = None) -> list[Sandbox]:
        """Every matching sandbox (pages through the server's cursor); ``node``: only
        those on that node; ``isolation``: only those of that tier."""
        return [Sandbox(self._c, s) for s in self._c._run(self._a.list(
            project=project, labels=labels, state=state, limit=limit, node=node,
            isolation=isolation))]

    def exec_many(
        self, calls: Sequence[ExecCall], *, timeout: float | None = 60.0,
        env: Mapping[str, str] | None = None, cwd: str | None = None,
        stdin: bytes | str | None = None, user: str | None = None,
        output_cap: int | None = None, return_exceptions: bool = False,
    ) -> builtins.list[ExecResult | DsecError]:
        """See :meth:`~dsec.client.core.AsyncSandboxes.exec_many`: ``(sandbox, command)``
        or ``(sandbox, command, overrides)``, command a string, argv or ``ExecRequest``."""
        items: list[Any] = [
            (c[0]._a, *c[1:]) if isinstance(c, tuple) and c and isinstance(c[0], Sandbox) else c
            for c in calls]
        return self._c._run(self._a.exec_many(
            items, timeout=timeout, env=env, cwd=cwd, stdin=stdin, user=user,
            output_cap=output_cap, return_exceptions=return_exceptions))


class Snapshots:
    """``client.snapshots``: list, get, delete."""

    def __init__(self, client: Client, a: AsyncSnapshots) -> None:
        self._c = client
        self._a = a

    def list(self, *, project: str | None = None,
             sandbox_id: str | None = None) -> builtins.list[Snapshot]:
        return self._c._run(self._a.list(project=project, sandbox_id=sandbox_id))

    def get(self, snapshot: Snapshot | str) -> Snapshot:
        return self._c._run(self._a.get(snapshot))

    def delete(self, snapshot: Snapshot | str) -> None:
        self._c._run(self._a.delete(snapshot))


class Images:
    """``client.images``: list, get, build (directory or tar), import_oci, pull, tag,
    delete."""

    def __init__(self, client: Client, a: AsyncImages) -> None:
        self._c = client
        self._a = a

    def list(self) -> builtins.list[ImageView]:
        return self._c._run(self._a.list())

    def get(self, ref: str) -> ImageView:
        return self._c._run(self._a.get(ref))

    def tag(self, source: str, target: str) -> ImageView:
        return self._c._run(self._a.tag(source, target))

    def promote(self, req: ImagePromoteRequest) -> ImageView:
        return self._c._run(self._a.promote(req))

    def delete(self, ref: str | ImageView) -> None:
        self._c._run(self._a.delete(ref))

    def pin(self, ref: str | ImageView, *, node: str) -> ImagePinView:
        """See :meth:`~dsec.client.images.AsyncImages.pin`."""
        return self._c._run(self._a.pin(ref, node=node))

    def unpin(self, image: str, *, node: str) -> None:
        """See :meth:`~dsec.client.images.AsyncImages.unpin`."""
        self._c._run(self._a.unpin(image, node=node))

    def pins(self, node: str) -> builtins.list[ImagePinView]:
        """See :meth:`~dsec.client.images.AsyncImages.pins`."""
        return self._c._run(self._a.pins(node))

    def push(self, ref: str | ImageView, *, verify: bool = False) -> ImagePushed:
        """See :meth:`~dsec.client.images.AsyncImages.push`."""
        return self._c._run(self._a.push(ref, verify=verify))

    def prune(self, *, dry_run: bool = False) -> ImagePruned:
        """See :meth:`~dsec.client.images.AsyncImages.prune`."""
        return self._c._run(self._a.prune(dry_run=dry_run))

    def build(self, source: str | os.PathLike[str], *, name: str,
              kind: LayerKind = "base", tag: str = "latest") -> ImageView:
        """See :meth:`~dsec.client.images.AsyncImages.build`."""
        return self._c._run(self._a.build(source, name=name, kind=kind, tag=tag))

    def import_oci(self, source: str | os.PathLike[str], *, name: str,
                   tag: str = "latest") -> ImageView:
        return self._c._run(self._a.import_oci(source, name=name, tag=tag))

    def pull(self, ref: str, *, name: str | None = None, project: str | None = None,
             platform: str | None = None, insecure: bool = False,
             creds: str | None = None) -> ImageView:
        """See :meth:`~dsec.client.images.AsyncImages.pull`."""
        return self._c._run(self._a.pull(ref, name=name, project=project, platform=platform,
                                         insecure=insecure, creds=creds))


class Ports:
    """See :class:`~dsec.client.core.AsyncPorts`."""

    def __init__(self, client: Client, a: AsyncPorts) -> None:
        self._c = client
        self._a = a

    def expose(self, port: int, *, token_ttl_s: float | None = None) -> str:
        return self._c._run(self._a.expose(port, token_ttl_s=token_ttl_s))

    def expose_info(self, port: int, *, token_ttl_s: float | None = None) -> ExposedPort:
        return self._c._run(self._a.expose_info(port, token_ttl_s=token_ttl_s))

    def list(self) -> list[ExposedPort]:
        return self._c._run(self._a.list())

    def close(self, port: int) -> None:
        self._c._run(self._a.close(port))


class Sandbox:
    """One sandbox; ``with`` kills it on exit."""

    def __init__(self, client: Client, a: AsyncSandbox) -> None:
        self._c = client
        self._a = a
        self.id = a.id
        self.files = Files(client, a.files)
        self.ports = Ports(client, a.ports)
        self.network = Network(client, a.network)
        self.processes = Processes(client, a.processes)
        self.pty = Pty(client, a.pty)

    def __repr__(self) -> str:
        return repr(self._a)

    @property
    def info(self) -> SandboxInfo:
        return self._a.info

    @property
    def state(self) -> str:
        return self._a.state

    @property
    def isolation(self) -> Isolation | None:
        """See :attr:`~dsec.client.core.AsyncSandbox.isolation`."""
        return self._a.isolation

    def refresh(self) -> SandboxInfo:
        return self._c._run(self._a.refresh())

    @overload
    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | str | None = None, user: str | None = None,
             background: Literal[False] = False, output_cap: int | None = None,
             on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult: ...

    @overload
    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | str | None = None, user: str | None = None,
             background: Literal[True], output_cap: int | None = None,
             on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ProcessHandle: ...

    @overload
    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | str | None = None, user: str | None = None,
             background: bool = False, output_cap: int | None = None,
             on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult | ProcessHandle: ...

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | str | None = None, user: str | None = None,
             background: bool = False, output_cap: int | None = None,
             on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None) -> ExecResult | ProcessHandle:
        """See :meth:`~dsec.client.core.AsyncSandbox.exec` (callbacks run on the
        client's loop thread)."""
        r: ExecResult | AsyncProcessHandle = self._c._run(self._a.exec(cmd, timeout=timeout, env=env, cwd=cwd,
                                      stdin=stdin, user=user, background=background,
                                      output_cap=output_cap, on_stdout=on_stdout,
                                      on_stderr=on_stderr))
        if isinstance(r, AsyncProcessHandle):
            return ProcessHandle(self._c, r)
        return r

    def exec_stream(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                    env: Mapping[str, str] | None = None, cwd: str | None = None,
                    stdin: bytes | str | None = None
                    ) -> Iterator[ExecChunk | ExecResult]:
        agen = self._a.exec_stream(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin)
        try:
            while True:
                try:
                    yield self._c._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._c._run(agen.aclose())

    def pause(self) -> PauseStats:
        return self._c._run(self._a.pause())

    def resume(self) -> None:
        self._c._run(self._a.resume())

    def snapshot(self, *, strip: Sequence[str] = ()) -> Snapshot:
        return self._c._run(self._a.snapshot(strip=strip))

    def events(self) -> list[SandboxEvent]:
        return self._c._run(self._a.events())

    def stats(self) -> SandboxStats:
        return self._c._run(self._a.stats())

    def set_timeout(self, seconds: float) -> SandboxInfo:
        return self._c._run(self._a.set_timeout(seconds))

    def extend(self, seconds: float) -> SandboxInfo:
        return self._c._run(self._a.extend(seconds))

    def run_code(self, code: str, *, timeout: float | None = 60.0) -> Execution:
        """See :meth:`~dsec.client.core.AsyncSandbox.run_code`."""
        return self._c._run(self._a.run_code(code, timeout=timeout))

    def restart_code(self) -> None:
        """See :meth:`~dsec.client.core.AsyncSandbox.restart_code`."""
        self._c._run(self._a.restart_code())

    def kill(self) -> None:
        self._c._run(self._a.kill())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


