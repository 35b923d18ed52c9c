"""The trainer's side of a rollout worker: start one, submit tasks, stream trajectories.

Delivery contract (the Kafka consumer-offset pattern): :meth:`TrainerClient.stream`
yields ``(seq, trajectory)`` in sequence order. A trainer that must not see an episode
twice stores the highest ``seq`` it has processed *in the same transaction* as the data
it derived, and after a crash calls ``stream(after=that_seq)``; :meth:`ack` only frees
the worker's storage (unacknowledged trajectories above ``after`` are delivered again).
Submits are idempotent per task id, so a trainer that died before it saw a submit's
answer simply submits the same tasks again.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx
import msgspec

from dsec import statedir
from dsec.errors import DsecError, InvalidArgument, TransportError, error_from_wire
from dsec.rl.agent.types import Trajectory
from dsec.rl.worker.types import WorkerConfig, WorkerTask

__all__ = ["TrainerClient", "WorkerHandle", "Workers", "start_worker", "workers"]

_traj = msgspec.json.Decoder(Trajectory)


@dataclass(slots=True)
class WorkerHandle:
    """A rollout worker process this host started (see :func:`start_worker`)."""

    state_dir: str
    pid: int
    address: str

    def trainer(self, api_key: str, **kw: Any) -> TrainerClient:
        return TrainerClient(self.address, api_key, **kw)

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{self.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM and wait: running episodes go back to the queue for the next start."""
        import signal
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        _wait_gone(self.pid, timeout_s)


def _wait_gone(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.02)
    raise TransportError(f"rollout worker pid {pid} did not stop within {timeout_s:g} s")


def start_worker(state_dir: str, *, url: str, api_key: str, project: str,
                 worker_id: str | None = None, start_timeout_s: float = 30.0,
                 **config: Any) -> WorkerHandle:
    """Start (or restart, on the same ``state_dir``: its queue carries over) a rollout
    worker process on this host, in a session of its own so it outlives the caller.

    Run it on an edge host next to the sandboxes. The project key goes into
    ``state_dir/config.json`` (mode 0600, directory 0700), never onto a command line.
    ``config``: the other :class:`~dsec.rl.worker.types.WorkerConfig` fields.
    """
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    os.chmod(state_dir, 0o700)
    cfg_path = os.path.join(state_dir, "config.json")
    if worker_id is None and os.path.exists(cfg_path):
        with open(cfg_path, "rb") as f:
            worker_id = msgspec.json.decode(f.read(), type=WorkerConfig).worker_id
    try:
        cfg = msgspec.convert({"url": url, "api_key": api_key, "project": project,
                               "worker_id": worker_id or f"w{secrets.token_hex(6)}",
                               **config}, WorkerConfig)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"rollout worker config: {exc}") from exc
    # fsynced, and the directory: the restart after a crash reads it (worker_id, key), and
    # a renamed-but-unsynced one could be empty after a power loss - every later start
    # then failed to decode it, and its queue was not taken over
    statedir.write_private_file(cfg_path, msgspec.json.encode(cfg))
    info = os.path.join(state_dir, "worker.json")
    if os.path.exists(info):
        os.unlink(info)
    log = os.open(os.path.join(state_dir, "worker.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsec.rl.worker", state_dir],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    finally:
        os.close(log)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        try:
            with open(info) as f:
                got = json.load(f)
            if got.get("pid") == proc.pid:
                return WorkerHandle(state_dir, proc.pid, str(got["address"]))
        except (FileNotFoundError, ValueError):
            pass
        if proc.poll() is not None:
            with open(os.path.join(state_dir, "worker.log"), errors="replace") as f:
                tail = f.read()[-2000:]
            raise TransportError(f"rollout worker exited with {proc.returncode}: {tail}")
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise TransportError(f"rollout worker did not come up within {start_timeout_s:g} s")


class Workers:
    """``dsec.rl.worker.workers(client)``: start rollout workers with the client's cluster
    and key. (Not ``client.rl``: the SDK sits a floor below the RL toolkit and imports none
    of it; pyproject.toml's import contracts.)"""

    def __init__(self, url: str, api_key: str, info: Callable[[], Any]) -> None:
        self._url, self._key, self._info = url, api_key, info

    def create(self, state_dir: str, *, project: str | None = None,
               **config: Any) -> WorkerHandle:
        """Start a worker (see :func:`start_worker`) acting with this client's key in
        ``project`` (default: the key's project); on an existing ``state_dir`` it takes
        over that worker's queue (the restart after a crash)."""
        project = project or self._info().project
        if not project:
            raise InvalidArgument("the key has no default project: pass project=...")
        return start_worker(state_dir, url=self._url, api_key=self._key, project=project,
                            **config)

    def attach(self, state_dir: str) -> WorkerHandle:
        """The worker already running on ``state_dir`` (from its ``worker.json``)."""
        try:
            with open(os.path.join(state_dir, "worker.json")) as f:
                got = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"no rollout worker record in {state_dir}: {exc}") from exc
        return WorkerHandle(state_dir, int(got["pid"]), str(got["address"]))


def workers(client: Any) -> Workers:
    """Rollout workers acting with ``client``'s cluster and key (a sync
    :class:`dsec.client.sync.Client`): ``workers(client).create(state_dir, ...)``."""
    return Workers(client.url, client._a._key, client.info)


class TrainerClient:
    """Talks to one rollout worker with a project key (sync, httpx)."""

    def __init__(self, address: str, api_key: str, *, timeout: float = 30.0) -> None:
        if address.startswith("unix:"):
            transport = httpx.HTTPTransport(uds=address[5:], retries=3)
            base = "http://rl-worker"
        else:
            transport = httpx.HTTPTransport(retries=3)
            base = address
        self._http = httpx.Client(base_url=base, transport=transport, timeout=timeout,
                                  headers={"authorization": f"Bearer {api_key}"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise TransportError(f"rollout worker unreachable: {exc}") from exc
        if r.status_code >= 400:
            try:
                e = r.json()
                raise error_from_wire(str(e["code"]), str(e["message"]), e.get("detail"))
            except (ValueError, KeyError, TypeError):
                raise DsecError(f"rollout worker answered {r.status_code}: "
                                f"{r.text[:500]}") from None
        return r.json()

    def submit(self, tasks: Sequence[WorkerTask]) -> tuple[int, int]:
        """(accepted, already known). Durable when this returns."""
        got = self._call("POST", "/v1/tasks", content=msgspec.json.encode(
            {"tasks": list(tasks)}))
        return int(got["accepted"]), int(got["already_known"])

    def poll(self, after: int = 0, *, limit: int = 100,
             wait_s: float = 0.0) -> list[tuple[int, Trajectory]]:
        got = self._call("GET", "/v1/trajectories",
                         params={"after": after, "limit": limit, "wait_s": wait_s},
                         timeout=wait_s + 30.0)
        return [(int(i["seq"]), _traj.decode(json.dumps(i["trajectory"])))
                for i in got["items"]]

    def stream(self, after: int = 0, *, wait_s: float = 5.0,
               limit: int = 100) -> Iterator[tuple[int, Trajectory]]:
        """Every finished trajectory above ``after``, as they finish (never ends)."""
        while True:
            for seq, t in self.poll(after, limit=limit, wait_s=wait_s):
                after = max(after, seq)
                yield seq, t

    def ack(self, seqs: Sequence[int] = (), *, upto: int | None = None) -> int:
        """Free the worker's copies of ``seqs`` and of every trajectory up to ``upto``
        (call ``ack(upto=cursor)`` after a restart); returns how many were held."""
        body: dict[str, Any] = {"seqs": list(seqs)}
        if upto is not None:
            body["upto"] = upto
        return int(self._call("POST", "/v1/ack", json=body)["released"])

    def status(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/status"))
