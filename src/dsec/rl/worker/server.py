"""The rollout worker process: runs episodes next to their sandboxes, outliving trainers.

A worker owns its sandboxes (labelled ``rl-worker=<id>``) and a durable queue
(:mod:`.queue`); the trainer talks to it over a small authenticated HTTP API:

``POST /v1/tasks``            submit tasks (idempotent per task id)
``GET  /v1/trajectories``     finished trajectories after a sequence number (long poll)
``POST /v1/ack``              the trainer holds these durably: forget them
``GET  /v1/status``           queue counts, sandboxes, whether the trainer counts as away

Every request carries a project API key (``Authorization: Bearer``). The worker asks the
apiserver who the key is (``info``) and admits it only for its own project (or an
ancestor of it): ``reader`` may read status and trajectories, ``member``/``admin`` may also
submit and acknowledge. Another project's key, a revoked key or none at all gets 401/403
on every route, the same check on each (one function, :meth:`Worker._authorize`).

Crash behaviour (tested with kill -9, tests/rl/worker):

- the *trainer* dies: nothing is lost on the worker. Episodes keep running, finished
  trajectories wait (durably) until a trainer reads and acknowledges them; after
  ``away_after_s`` without a trainer, idle (warm) sandboxes are paused, and resumed when
  one is back.
- the *worker* dies: every episode in flight is lost mid-way (its sandbox holds a partial
  state no one can vouch for). At the next start, :meth:`RolloutQueue.recover` requeues
  those tasks and the worker destroys every sandbox labelled with its id (a create that
  was in flight has its Idempotency-Key, so it cannot leak a second sandbox); the episode
  runs again from scratch as the next attempt. A trajectory is committed with its task's
  ``done`` in one transaction, so no task ever yields two trajectories.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from dsec.errors import (
    DsecError,
    InvalidArgument,
    PermissionDenied,
    RateLimited,
    TransportError,
    Unauthenticated,
    Unavailable,
)
from dsec.rl.agent.types import (
    Message,
    Step,
    StepTimings,
    ToolCall,
    Trajectory,
    TrajectoryTimings,
    VerdictRecord,
    trajectory_to_json,
)
from dsec.rl.worker.auth import KeyVerdict, KeyVerdicts, looks_like_api_key
from dsec.rl.worker.queue import RolloutQueue, TaskRow
from dsec.rl.worker.types import WorkerConfig, WorkerTask
from dsec.wire.api import ApiError

__all__ = ["Worker", "main"]

log = logging.getLogger(__name__)

WORKER_LABEL = "rl-worker"
TASK_LABEL = "rl-task"
_MAX_BODY = 16 << 20
_RETRYABLE = (TransportError, Unavailable)


class Worker:
    """One worker process's state. ``run()`` serves until SIGTERM/SIGINT."""

    def __init__(self, config: WorkerConfig, state_dir: str) -> None:
        from dsec.client.core import AsyncClient

        self.cfg = config
        self.state_dir = state_dir
        self.queue = RolloutQueue(os.path.join(state_dir, "queue.sqlite"))
        # session=True: a dead worker's sandboxes are swept after its lease (issue 19
        # made sandboxes outlive their client by default)
        self.client = AsyncClient(config.url, config.api_key, protocol="http", session=True)
        self._verdicts = KeyVerdicts()
        self._asking: dict[str, asyncio.Future[KeyVerdict]] = {}
        #: lookups in flight at once (each is a client and a request to the apiserver)
        self._lookups = asyncio.Semaphore(4)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._warm: list[Any] = []          # AsyncSandbox, fresh, unused
        self._paused: set[str] = set()
        self._finished = asyncio.Event()
        self._streams = 0
        self._last_seen = time.monotonic()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._seq = 0
        self._engine_obj: Any = None
        self._policy: Any = None

    # -- trainer presence --------------------------------------------------------------
    def trainer_away(self) -> bool:
        return self._streams == 0 and (
            time.monotonic() - self._last_seen > self.cfg.away_after_s)

    # -- auth --------------------------------------------------------------------------
    async def _authorize(self, header: str | None, need: str, peer: str = "") -> None:
        """Raise Unauthenticated/PermissionDenied unless the bearer key belongs to this
        worker's project (or an ancestor) with role ``need`` or more. ``peer``: the
        caller's address, for the per-peer lookup budget (:mod:`.auth`)."""
        if not header or not header.lower().startswith("bearer "):
            raise Unauthenticated("this rollout worker needs a project API key: send "
                                  "`Authorization: Bearer <key>`")
        key = header[7:].strip()
        if not looks_like_api_key(key):
            raise Unauthenticated("malformed API key: expected 'dsk_<16 hex>_<43 chars>', "
                                  "a key of this worker's project")
        got = await self._verdict(hashlib.sha256(key.encode()).hexdigest(), key, peer)
        if got.unknown:
            raise Unauthenticated("the apiserver does not know this API key (wrong or "
                                  "revoked); use a key of this worker's project")
        if not got.ok:
            raise PermissionDenied(
                f"this rollout worker serves project {self.cfg.project!r}; the key belongs "
                "to none of it or its ancestors")
        order = {"reader": 0, "member": 1, "admin": 2}
        if order.get(got.role or "", -1) < order[need]:
            raise PermissionDenied(f"role {got.role!r} on project {self.cfg.project!r} "
                                   f"cannot do this; it needs {need!r} or more")

    async def _verdict(self, h: str, key: str, peer: str) -> KeyVerdict:
        """The cached verdict on a key, else the apiserver's: one lookup per key at a
        time (concurrent requests with it wait for that one), within the budget."""
        now = time.monotonic()
        got = self._verdicts.get(h, now)
        if got is not None:
            return got
        pending = self._asking.get(h)
        if pending is not None:
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                if pending.cancelled():     # the lookup's own request went away
                    raise Unavailable("the check of this API key was abandoned; "
                                      "retry the request") from None
                raise
        if not self._verdicts.may_ask(h, peer, now):
            raise RateLimited("too many unknown API keys presented to this rollout worker "
                              "right now; retry in a few seconds with a valid key")
        fut: asyncio.Future[KeyVerdict] = asyncio.get_running_loop().create_future()
        self._asking[h] = fut
        try:
            async with self._lookups:
                try:
                    got = await self._ask_apiserver(key, time.monotonic())
                except Unauthenticated:
                    got = KeyVerdict(ok=False, role=None, unknown=True,
                                     until=time.monotonic() + self._verdicts.limits.unknown_s)
            self._verdicts.put(h, got)
            fut.set_result(got)
            return got
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()     # retrieved: nobody else may be waiting
            raise
        finally:
            del self._asking[h]

    async def _ask_apiserver(self, key: str, now: float) -> KeyVerdict:
        from dsec.client.core import AsyncClient

        c = AsyncClient(self.cfg.url, key, protocol="http", session_lease_s=None, retries=1)
        try:
            info = await c.info()   # Unauthenticated (401) for a wrong or revoked key
        finally:
            await c.close()
        p, mine = info.project or "", self.cfg.project
        ok = info.principal is not None and (p == mine or mine.startswith(p.rstrip("/") + "/"))
        return KeyVerdict(ok=ok, role=info.role, until=now + self.cfg.auth_cache_s)

    # -- episodes ----------------------------------------------------------------------
    async def _sandbox(self, row: TaskRow, task: WorkerTask) -> Any:
        if task.image == "base" and self._warm:
            sb = self._warm.pop()
            if sb.id in self._paused:
                await sb.resume()
                self._paused.discard(sb.id)
            return sb
        return await self.client.sandboxes.create(
            image=task.image, backend=self.cfg.backend,  # type: ignore[arg-type]
            isolation=self.cfg.isolation, memory=self.cfg.memory_bytes,
            project=self.cfg.project, pids_max=256,
            labels={WORKER_LABEL: self.cfg.worker_id, TASK_LABEL: row.task_id},
            idempotency_key=f"rlw-{self.cfg.worker_id}-{row.task_id}-{row.attempt}"[:255])

    async def _engine(self) -> Any:
        """The ``agent`` stream's rollout engine over this worker's client and policy
        (made on first use, inside the loop: the policy's HTTP pool is bound to it)."""
        if self._engine_obj is None:
            from dsec.rl.agent.policy import OpenAIPolicy, PolicyConfig
            from dsec.rl.agent.sandboxes import ClientSandboxes
            from dsec.rl.engine import EngineConfig, RolloutEngine

            p = self.cfg.policy
            if p is None:
                raise InvalidArgument("this worker has no model endpoint (policy) for tasks "
                                      "without scripted commands")
            policy = OpenAIPolicy(PolicyConfig(
                base_url=p.base_url, model=p.model, api_key=p.api_key, timeout_s=p.timeout_s,
                max_concurrency=p.max_concurrency,
                tool_format=p.tool_format))  # type: ignore[arg-type]
            over: dict[str, Any] = {"project": self.cfg.project,
                                    "memory_bytes": self.cfg.memory_bytes,
                                    "labels": {WORKER_LABEL: self.cfg.worker_id}}
            if self.cfg.backend is not None:
                over["backend"] = self.cfg.backend
            if self.cfg.isolation is not None:
                over["isolation"] = self.cfg.isolation
            self._engine_obj = RolloutEngine(
                ClientSandboxes(self.client, spec_overrides=over), policy,
                EngineConfig(max_concurrent_episodes=self.cfg.concurrency,
                             tool_format=policy.tool_format))
            self._policy = policy
        return self._engine_obj

    async def _engine_episode(self, row: TaskRow, task: WorkerTask) -> Trajectory:
        from dsec.rl.judges import ExecutableJudge, RegexJudge
        from dsec.rl.tasks import AgentTask
        from dsec.rl.worker.types import RegexJudgeSpec
        from dsec.wire.spec import SandboxSpec

        judge: Any = None
        j = task.judge
        if isinstance(j, RegexJudgeSpec):
            judge = RegexJudge(j.pattern, field=j.field, fullmatch=j.fullmatch)  # type: ignore[arg-type]
        elif j is not None:
            judge = ExecutableJudge(
                hidden_files={k: v.encode() for k, v in j.hidden_files.items()},
                command=tuple(j.command), isolate=j.isolate, timeout_s=j.timeout_s)
        engine = await self._engine()
        traj: Trajectory = await engine.episode(AgentTask(
            id=row.task_id, prompt=task.prompt, judge=judge, max_turns=task.max_turns,
            spec=SandboxSpec(image=task.image, labels={TASK_LABEL: row.task_id}),
            files={k: v.encode() for k, v in task.files.items()},
            metadata=dict(task.metadata)), group_id=task.group_id, epoch=task.epoch)
        traj.episode_id = f"{self.cfg.worker_id}/{row.task_id}"
        traj.metadata = {**traj.metadata, **task.metadata, "attempt": row.attempt,
                         "worker": self.cfg.worker_id, "policy": "engine"}
        return traj

    async def _episode(self, row: TaskRow) -> None:
        try:
            await self._episode_once(row)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not strand the task in "running"
            log.exception("episode of task %s attempt %d crashed", row.task_id, row.attempt)
            if row.attempt < self.cfg.max_attempts:
                self.queue.requeue(row.task_id)
            else:
                traj = Trajectory(episode_id=f"{self.cfg.worker_id}/{row.task_id}",
                                  task_id=row.task_id, end="infra_error",
                                  infra_error=f"the worker failed: {exc!r}",
                                  metadata={"attempt": row.attempt,
                                            "worker": self.cfg.worker_id})
                self.queue.finish(row.task_id, row.attempt, trajectory_to_json(traj))
                self._finished.set()

    async def _episode_once(self, row: TaskRow) -> None:
        task = msgspec.json.decode(row.body, type=WorkerTask)
        if not task.commands:
            try:
                traj = await self._engine_episode(row, task)
            except DsecError as exc:
                traj = Trajectory(episode_id=f"{self.cfg.worker_id}/{row.task_id}",
                                  task_id=row.task_id, infra_error=str(exc),
                                  end="infra_error",
                                  metadata={"attempt": row.attempt,
                                            "worker": self.cfg.worker_id})
            self.queue.finish(row.task_id, row.attempt, trajectory_to_json(traj))
            self._finished.set()
            return
        t0 = time.time()
        traj = Trajectory(episode_id=f"{self.cfg.worker_id}/{row.task_id}",
                          task_id=row.task_id, group_id=task.group_id, epoch=task.epoch,
                          metadata={**task.metadata, "attempt": row.attempt,
                                    "worker": self.cfg.worker_id})
        traj.timings = TrajectoryTimings(started_at=t0)
        sb = None
        try:
            sb = await self._sandbox(row, task)
            traj.timings.setup_s = time.time() - t0
            traj.metadata["sandbox"] = sb.id
            traj.messages.append(Message(role="user", content=task.prompt))
            last = ""
            for i, cmd in enumerate(task.commands):
                tm = time.time()
                if task.think_s:
                    await asyncio.sleep(task.think_s)   # the scripted policy "thinks"
                call = ToolCall(id=f"call_{i}", name="bash",
                                arguments=json.dumps({"command": cmd}))
                traj.messages.append(Message(role="assistant", tool_calls=(call,)))
                ts = time.time()
                res = await sb.exec(cmd, timeout=task.command_timeout_s)
                te = time.time()
                last = res.stdout.decode(errors="replace")
                obs = last + res.stderr.decode(errors="replace")
                traj.messages.append(Message(role="tool", content=obs,
                                             tool_call_id=call.id, name="bash"))
                traj.steps.append(Step(index=i, action=call, observation=obs,
                                       exit_code=res.exit_code,
                                       timings=StepTimings(model_s=ts - tm, tool_s=te - ts,
                                                           started_at=ts)))
                traj.timings.model_s += ts - tm
                traj.timings.tool_s += te - ts
            traj.end = "submitted" if task.commands else "max_turns"
            if task.expect is not None:
                passed = task.expect in last
                traj.reward = 1.0 if passed else 0.0
                traj.verdict = VerdictRecord(reward=traj.reward, passed=passed,
                                             judge="ScriptedContains")
        except asyncio.CancelledError:
            raise
        except _RETRYABLE as exc:
            if row.attempt < self.cfg.max_attempts:
                log.warning("task %s attempt %d: %s; running it again", row.task_id,
                            row.attempt, exc)
                await self._drop(sb)
                self.queue.requeue(row.task_id)
                self._wake.set()
                return
            traj.infra_error, traj.end = str(exc), "infra_error"
        except DsecError as exc:
            traj.infra_error, traj.end = f"{type(exc).__name__}: {exc}", "infra_error"
        traj.timings.finished_at = time.time()
        # durable before anything else: the trajectory and the task's "done" together
        self.queue.finish(row.task_id, row.attempt, trajectory_to_json(traj))
        self._finished.set()
        await self._drop(sb)

    async def _drop(self, sb: Any) -> None:
        if sb is None:
            return
        with contextlib.suppress(DsecError):
            await sb.kill()

    async def _schedule(self) -> None:
        while not self._stop.is_set():
            room = self.cfg.concurrency - len(self._running)
            if room > 0:
                for row in self.queue.claim(room):
                    t = asyncio.create_task(self._episode(row))
                    self._running[row.task_id] = t
                    t.add_done_callback(functools.partial(self._done, row.task_id))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await self._wake.wait()

    def _done(self, task_id: str, t: asyncio.Task[None]) -> None:
        self._running.pop(task_id, None)
        if not t.cancelled() and t.exception() is not None:
            log.error("episode of task %s crashed: %r", task_id, t.exception())
        self._wake.set()

    async def _tend(self) -> None:
        """Keep the warm pool full; pause it while the trainer is away, resume it when
        the trainer is back."""
        while not self._stop.is_set():
            try:
                away = self.trainer_away()
                while len(self._warm) < self.cfg.warm and not away:
                    self._warm.append(await self.client.sandboxes.create(
                        image="base", backend=self.cfg.backend,  # type: ignore[arg-type]
                        isolation=self.cfg.isolation,
                        memory=self.cfg.memory_bytes, project=self.cfg.project,
                        pids_max=256,
                        labels={WORKER_LABEL: self.cfg.worker_id, TASK_LABEL: "warm"}))
                for sb in list(self._warm):
                    if away and sb.id not in self._paused:
                        await sb.pause()
                        self._paused.add(sb.id)
                    elif not away and sb.id in self._paused:
                        await sb.resume()
                        self._paused.discard(sb.id)
                pause_s = 0.1
            except DsecError as exc:
                log.warning("warm pool: %s", exc)
                pause_s = 2.0       # quota, no capacity, apiserver away: no busy loop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause_s):
                    await self._stop.wait()

    async def recover(self) -> int:
        """Requeue what a killed predecessor had in flight and destroy every sandbox
        labelled with this worker's id (partial episodes, warm ones). Returns how many
        sandboxes went."""
        back = self.queue.recover()
        if back:
            log.warning("requeued %d episodes a previous worker process had in flight",
                        len(back))
        gone = 0
        while True:
            try:
                for sb in await self.client.sandboxes.list(
                        project=self.cfg.project, labels={WORKER_LABEL: self.cfg.worker_id}):
                    if sb.state not in ("destroying", "destroyed", "failed"):
                        await sb.kill()
                        gone += 1
                return gone
            except _RETRYABLE as exc:
                log.warning("recover: apiserver unreachable (%s); retrying", exc)
                await asyncio.sleep(1.0)

    # -- HTTP --------------------------------------------------------------------------
    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        enc = msgspec.json.Encoder()

        def answer(obj: Any, status: int = 200) -> Response:
            return Response(enc.encode(obj), status_code=status,
                            media_type="application/json")

        def route(need: str, fn: Callable[[Request], Awaitable[Any]]) -> Any:
            async def handler(request: Request) -> Response:
                self._seq += 1
                rid = f"rlw-{self._seq:x}"
                try:
                    peer = request.client.host if request.client is not None else ""
                    await self._authorize(request.headers.get("authorization"), need,
                                          peer)
                    self._last_seen = time.monotonic()
                    return answer(await fn(request))
                except DsecError as exc:
                    return answer(ApiError(code=exc.code, message=exc.message,
                                           request_id=rid), exc.http_status)
            return handler

        async def body(request: Request) -> Any:
            data = await request.body()
            if len(data) > _MAX_BODY:
                raise InvalidArgument(f"request body of {len(data)} bytes is over the "
                                      f"{_MAX_BODY} byte limit; submit in smaller batches")
            try:
                return msgspec.json.decode(data)
            except msgspec.DecodeError as exc:
                raise InvalidArgument(f"request body is not JSON: {exc}") from exc

        async def submit(request: Request) -> Any:
            raw = await body(request)
            if not isinstance(raw, dict) or not isinstance(raw.get("tasks"), list):
                raise InvalidArgument('submit takes {"tasks": [task, ...]}')
            rows: list[tuple[str, bytes]] = []
            for t in raw["tasks"]:
                try:
                    task = msgspec.convert(t, WorkerTask)
                except msgspec.ValidationError as exc:
                    raise InvalidArgument(f"task is invalid: {exc}") from exc
                rows.append((task.task_id, enc.encode(task)))
            new, known = await asyncio.to_thread(self.queue.submit, rows)
            self._wake.set()
            return {"accepted": new, "already_known": known}

        async def trajectories(request: Request) -> Any:
            q = request.query_params
            try:
                after = int(q.get("after", "0"))
                limit = min(max(int(q.get("limit", "100")), 1), 1000)
                wait_s = min(max(float(q.get("wait_s", "0")), 0.0), 60.0)
            except ValueError as exc:
                raise InvalidArgument(f"bad query parameter: {exc}") from exc
            self._streams += 1
            try:
                deadline = time.monotonic() + wait_s
                while True:
                    self._finished.clear()
                    got = await asyncio.to_thread(self.queue.read, after, limit)
                    left = deadline - time.monotonic()
                    if got or left <= 0:
                        break
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(left, 1.0)):
                            await self._finished.wait()
            finally:
                self._streams -= 1
                self._last_seen = time.monotonic()
            return {"items": [{"seq": d.seq, "task_id": d.task_id, "attempt": d.attempt,
                               "trajectory": msgspec.Raw(d.body)} for d in got]}

        async def ack(request: Request) -> Any:
            raw = await body(request)
            raw = raw if isinstance(raw, dict) else {}
            seqs, upto = raw.get("seqs", []), raw.get("upto")
            if (not isinstance(seqs, list) or not all(type(s) is int for s in seqs)
                    or not (upto is None or type(upto) is int)):
                raise InvalidArgument('ack takes {"seqs": [int, ...], "upto": int}')
            return {"released": await asyncio.to_thread(self.queue.ack, seqs, upto=upto)}

        async def status(request: Request) -> Any:
            c = self.queue.counts()
            return {"worker_id": self.cfg.worker_id, "project": self.cfg.project,
                    "queued": c.queued, "running": c.running, "done": c.done,
                    "unacked": c.unacked, "warm": len(self._warm),
                    "paused": sorted(self._paused), "trainer_away": self.trainer_away(),
                    "pid": os.getpid()}

        return Starlette(routes=[
            Route("/v1/tasks", route("member", submit), methods=["POST"]),
            Route("/v1/trajectories", route("reader", trajectories), methods=["GET"]),
            Route("/v1/ack", route("member", ack), methods=["POST"]),
            Route("/v1/status", route("reader", status), methods=["GET"]),
        ])

    def _bind(self) -> tuple[socket.socket, str]:
        kind, _, where = self.cfg.listen.partition(":")
        if kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(where)
            os.chmod(where, 0o600)
            return s, f"unix:{where}"
        if kind != "tcp":
            raise InvalidArgument(f"listen={self.cfg.listen!r}: use tcp:HOST:PORT or "
                                  "unix:PATH")
        host, _, port = where.rpartition(":")
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        h, p = s.getsockname()[:2]
        return s, f"http://{h}:{p}"

    async def run(self) -> None:
        import uvicorn

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self.recover()
        sock, address = self._bind()
        sock.listen(256)
        server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning",
                                               lifespan="off", access_log=False))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.01)
        _write_json(os.path.join(self.state_dir, "worker.json"),
                    {"pid": os.getpid(), "address": address})
        tasks = [asyncio.create_task(self._schedule()), asyncio.create_task(self._tend())]
        await self._stop.wait()
        server.should_exit = True
        for t in [*tasks, *self._running.values()]:
            t.cancel()
        await asyncio.gather(*tasks, *self._running.values(), serving,
                             return_exceptions=True)
        # A clean stop: running episodes go back to the queue for the next start.
        self.queue.recover()
        if self._engine_obj is not None:
            await self._engine_obj.close()
            await self._policy.close()
        for sb in self._warm:
            await self._drop(sb)
        await self.client.close()
        self.queue.close()


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def main(state_dir: str) -> None:
    import uvloop

    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s rl-worker %(levelname)s %(message)s")
    with open(os.path.join(state_dir, "config.json"), "rb") as f:
        cfg = msgspec.json.decode(f.read(), type=WorkerConfig)
    uvloop.run(Worker(cfg, state_dir).run())

