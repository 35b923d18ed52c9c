"""The rollout worker as a real process next to a real cluster: kill -9 of the trainer and
of the worker mid-rollout loses and duplicates nothing; idle sandboxes pause while the
trainer is away; only the worker's own project may talk to it, on every route."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.cluster.local import LocalCluster
from dsec.errors import PermissionDenied, TransportError, Unauthenticated
from dsec.rl.worker import TrainerClient, WorkerHandle, WorkerTask, start_worker, workers
from tests.syscall_order import assert_durable, record_syscalls

N_TASKS = 48


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1, backend="simulated") as cl:
        yield cl


def _kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _until(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


# The trainer: submits every task (again, after each restart: idempotent), then streams.
# Each trajectory goes into its sink together with the cursor in ONE transaction, then
# is acknowledged. The sink table has no unique key, so a duplicate would be counted.
_TRAINER = r"""
import json, sqlite3, sys, time
from dsec.errors import TransportError
from dsec.rl.worker import TrainerClient, WorkerTask
state_dir, key, sink, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
db = sqlite3.connect(sink, isolation_level=None)
db.execute("PRAGMA synchronous=FULL")
db.execute("CREATE TABLE IF NOT EXISTS got (seq INTEGER, task_id TEXT, attempt INTEGER,"
           " reward REAL)")
db.execute("CREATE TABLE IF NOT EXISTS cursor (after INTEGER)")
if db.execute("SELECT COUNT(*) FROM cursor").fetchone()[0] == 0:
    db.execute("INSERT INTO cursor VALUES (0)")
tasks = [WorkerTask(task_id=f"task-{i}", prompt="p", commands=["echo a", "echo b", "echo 42"],
                    think_s=0.25, expect="42") for i in range(n)]
def client():
    while True:
        try:
            with open(f"{state_dir}/worker.json") as f:
                return TrainerClient(json.load(f)["address"], key, timeout=10)
        except (OSError, ValueError):
            time.sleep(0.05)
c = client()
while True:
    try:
        c.submit(tasks)
        break
    except TransportError:
        time.sleep(0.1); c = client()
print("submitted", flush=True)
while True:
    (after,) = db.execute("SELECT after FROM cursor").fetchone()
    if db.execute("SELECT COUNT(DISTINCT task_id) FROM got").fetchone()[0] >= n:
        break
    try:
        got = c.poll(after, limit=7, wait_s=1.0)
    except TransportError:
        time.sleep(0.1); c = client(); continue
    for seq, t in got:
        db.execute("BEGIN")
        db.execute("INSERT INTO got VALUES (?, ?, ?, ?)",
                   (seq, t.task_id, t.metadata["attempt"], t.reward))
        db.execute("UPDATE cursor SET after = ?", (seq,))
        db.execute("COMMIT")
    try:   # frees what this and any earlier (killed) trainer stored
        c.ack(upto=after if not got else got[-1][0])
    except TransportError:
        pass
print("done", flush=True)
"""


def _trainer(state_dir: str, key: str, sink: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _TRAINER, state_dir, key, sink,
                             str(N_TASKS)], stdout=subprocess.PIPE, text=True)


def _sink(sink: str) -> list[tuple[int, str, int, float]]:
    db = sqlite3.connect(sink)
    try:
        return [tuple(r) for r in db.execute("SELECT seq, task_id, attempt, reward FROM got")]
    except sqlite3.OperationalError:
        return []
    finally:
        db.close()


def _status(h: WorkerHandle, key: str) -> dict[str, Any]:
    with h.trainer(key) as t:
        return t.status()


def _worker_sandboxes(cl: LocalCluster, worker_id: str) -> list[Any]:
    with cl.client() as c:
        return [s for s in c.sandboxes.list(labels={"rl-worker": worker_id})
                if s.info.state not in ("destroyed", "destroying")]


def test_the_workers_config_is_on_disk_before_it_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart after a crash reads config.json (its worker id, its key): it is
    fsynced before its rename, the state directory after it. (The worker itself is not
    started here: the spawn is refused once the config is written.)"""
    def no_spawn(*_: Any, **__: Any) -> Any:
        raise OSError("not started in this test")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    calls = record_syscalls(monkeypatch)
    d = str(tmp_path / "w")
    with pytest.raises(OSError, match="not started"):
        start_worker(d, url="http://127.0.0.1:1", api_key="k", project="p")
    assert_durable(calls, os.path.join(d, "config.json"))
    assert stat.S_IMODE(os.stat(os.path.join(d, "config.json")).st_mode) == 0o600


def test_kill9_trainer_and_worker_lose_and_duplicate_nothing(
        cluster: LocalCluster, tmp_path: Path) -> None:
    state = str(tmp_path / "worker")
    sink = str(tmp_path / "sink.sqlite")
    key = cluster.api_key
    h = start_worker(state, url=cluster.url, api_key=key, project="default",
                     concurrency=6, away_after_s=0.5)
    listen = "tcp:" + h.address.removeprefix("http://")
    procs: list[subprocess.Popen[str]] = []
    try:
        # 1. the trainer dies twice mid-rollout (episodes running, some delivered)
        for round_ in range(2):
            p = _trainer(state, key, sink)
            procs.append(p)
            have = len(_sink(sink))
            _until(lambda have=have: len(_sink(sink)) >= have + 3, 60, "deliveries")
            assert _status(h, key)["running"] > 0, "the kill must hit mid-rollout"
            _kill9(p.pid)
        # 2. while no trainer runs, the worker keeps rolling out
        done_before = _status(h, key)["done"]
        _until(lambda: _status(h, key)["done"] > done_before + 2, 60, "progress")
        # 3. the worker dies mid-episode; a new process on the same state takes over
        _until(lambda: _status(h, key)["running"] >= 3, 60, "episodes in flight")
        assert _status(h, key)["queued"] > 0, "tasks must be left for the new process"
        in_flight = _status(h, key)["running"]
        _kill9(h.pid)
        h = start_worker(state, url=cluster.url, api_key=key, project="default",
                         concurrency=6, away_after_s=0.5, listen=listen)
        # 4. a trainer that starts mid-way and dies again, then one that finishes
        p = _trainer(state, key, sink)
        procs.append(p)
        _until(lambda: p.poll() is None and len(_sink(sink)) >= N_TASKS - 12, 60, "more")
        _kill9(p.pid)
        p = _trainer(state, key, sink)
        procs.append(p)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and "done" in out
        rows = _sink(sink)
        ids = [r[1] for r in rows]
        lost = {f"task-{i}" for i in range(N_TASKS)} - set(ids)
        dup = len(ids) - len(set(ids))
        assert (len(lost), dup) == (0, 0), (lost, dup)
        assert all(r[3] == 1.0 for r in rows)            # every episode judged, passed
        # the worker kill cost the in-flight episodes one more attempt, no more
        retried = [r for r in rows if r[2] > 1]
        print(f"kill -9: trainer x3, worker x1 ({in_flight} episodes in flight): "
              f"{N_TASKS} tasks, {len(set(ids))} delivered, lost {len(lost)}, "
              f"duplicated {dup}, retried after the worker kill {len(retried)}")
        assert 1 <= len(retried) <= in_flight + 6
        st = _status(h, key)
        assert (st["queued"], st["running"], st["done"], st["unacked"]) == (0, 0, N_TASKS, 0)
        # no sandbox of the killed process's partial episodes is left
        wid = st["worker_id"]
        _until(lambda: not _worker_sandboxes(cluster, wid), 30, "sandboxes gone")
    finally:
        for p in procs:
            if p.poll() is None:
                _kill9(p.pid)
        h.stop()


def test_idle_sandboxes_pause_while_the_trainer_is_away(
        cluster: LocalCluster, tmp_path: Path) -> None:
    key = cluster.api_key
    with cluster.client() as c:        # through the SDK's client: workers(client)
        h = workers(c).create(str(tmp_path / "w"), warm=2, away_after_s=0.5)
        assert workers(c).attach(str(tmp_path / "w")) == h
    try:
        wid = _status(h, key)["worker_id"]

        def states() -> list[str]:
            return sorted(s.info.state for s in _worker_sandboxes(cluster, wid))

        # trainer away: the warm (idle) sandboxes are paused
        _until(lambda: states() == ["paused", "paused"], 30, "paused warm sandboxes")
        # the trainer is back (an open stream counts as present): resumed
        with h.trainer(key) as t:
            assert t.poll(0, wait_s=1.5) == []
            _until(lambda: states() == ["running", "running"], 30, "resumed")
            # an episode takes an idle sandbox, resumed, and runs in it
            t.submit([WorkerTask(task_id="one", commands=["echo 42"], expect="42")])
            [(seq, traj)] = _until(lambda: t.poll(0, wait_s=1.0), 30, "the trajectory")
            assert traj.reward == 1.0 and traj.metadata["attempt"] == 1
            t.ack([seq])
    finally:
        h.stop()
    _until(lambda: not _worker_sandboxes(cluster, wid), 30, "sandboxes gone after stop")


def test_only_the_workers_project_gets_in_on_every_route(
        cluster: LocalCluster, tmp_path: Path) -> None:
    key = cluster.api_key
    state = tmp_path / "w"
    h = start_worker(str(state), url=cluster.url, api_key=key, project="default")
    try:
        # the state dir holds the project key: nobody else on the host may read it
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
        for f in ("config.json", "queue.sqlite", "worker.json", "worker.log"):
            assert stat.S_IMODE(os.stat(state / f).st_mode) == 0o600, f
        with open(f"/proc/{h.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        with h.trainer(key) as t:
            t.submit([WorkerTask(task_id="mine", commands=["echo 42"], expect="42")])
            _until(lambda: t.poll(0, wait_s=1.0), 30, "the trajectory")
        other = cluster.create_key("mallory-w", "elsewhere", "admin")
        reader = cluster.create_key("rita-w", "default", "reader")
        routes: list[tuple[str, str, Any]] = [
            ("POST", "/v1/tasks", {"tasks": [{"task_id": "evil", "commands": ["id"]}]}),
            ("GET", "/v1/trajectories", None),
            ("POST", "/v1/ack", {"seqs": [1]}),
            ("GET", "/v1/status", None)]
        headers: dict[str, dict[str, str]] = {
            "none": {}, "garbage": {"authorization": "Bearer dsec_nope"},
            "basic": {"authorization": "Basic " + key},
            "other project": {"authorization": f"Bearer {other}"},
            "reader": {"authorization": f"Bearer {reader}"}}
        want = {"none": 401, "garbage": 401, "basic": 401, "other project": 403}
        with httpx.Client(base_url=h.address) as http:
            for who, hd in headers.items():
                for method, path, body in routes:
                    r = http.request(method, path, headers=hd, json=body)
                    code = want.get(who) or (403 if method == "POST" else 200)
                    assert r.status_code == code, (who, method, path, r.text)
                    if code >= 400:
                        assert r.json()["code"] in ("unauthenticated", "permission_denied")
                        assert "mine" not in r.text and "42" not in r.text
        # nothing another key sent got in; the trajectory is still there for its owner
        with h.trainer(key) as t:
            st = t.status()
            assert (st["done"], st["queued"], st["unacked"]) == (1, 0, 1)
        with h.trainer(other) as t, pytest.raises(PermissionDenied):
            t.poll(0)
        with h.trainer("dsec_bogus") as t, pytest.raises(Unauthenticated):
            t.status()
    finally:
        h.stop()
    with pytest.raises(TransportError), TrainerClient(h.address, key, timeout=2) as t:
        t.status()
    assert json.loads((state / "worker.json").read_text())["pid"] == h.pid
    # the other door: a Unix socket (mode 0600) with the same checks
    sock = tmp_path / "w2.sock"
    h2 = start_worker(str(tmp_path / "w2"), url=cluster.url, api_key=key, project="default",
                      listen=f"unix:{sock}")
    try:
        assert h2.address == f"unix:{sock}"
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        with h2.trainer(other) as t, pytest.raises(PermissionDenied):
            t.submit([WorkerTask(task_id="evil", commands=["id"])])
        with h2.trainer("dsec_bogus") as t, pytest.raises(Unauthenticated):
            t.poll(0)
        with h2.trainer(key) as t:
            assert t.status()["queued"] == 0 and t.submit(
                [WorkerTask(task_id="ok", commands=["true"])]) == (1, 0)
    finally:
        h2.stop()


def test_llm_policy_episodes_run_through_the_agent_engine(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """Tasks without scripted commands are played by the worker's model endpoint (a real
    OpenAI-compatible server on loopback, the real openai client) through the ``agent``
    rollout engine, judged, and delivered like any other."""
    from dsec.rl.agent.scripted import ScriptedEndpoint
    from dsec.rl.worker.types import RegexJudgeSpec

    key = cluster.api_key
    with ScriptedEndpoint(think_s=0.01) as ep:
        h = start_worker(str(tmp_path / "w"), url=cluster.url, api_key=key,
                         project="default",
                         policy={"base_url": ep.base_url, "model": "honest"})
        try:
            with h.trainer(key) as t:
                t.submit([WorkerTask(task_id=f"llm-{i}", max_turns=4,
                                     prompt=f"Print {i}:\n```bash\necho {i}\n```",
                                     judge=RegexJudgeSpec(pattern=f"^{i}$"))
                          for i in (41, 42)])
                got = _until(lambda: len(t.poll(0, wait_s=1.0)) == 2 and t.poll(0), 60,
                             "two trajectories")
                for _, traj in got:
                    assert traj.infra_error is None and traj.reward == 1.0, traj
                    assert traj.model is not None and traj.model.model == "honest"
                    calls = [c for m in traj.messages for c in m.tool_calls]
                    assert [c.name for c in calls] == ["bash", "submit"]
                    assert traj.metadata["attempt"] == 1
                    assert traj.episode_id.endswith("/" + traj.task_id)
        finally:
            h.stop()
