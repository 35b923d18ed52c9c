"""The RL toolkit over the public SDK (ClientAccess) against a real LocalCluster: the
apiserver, the Aether gateway (or REST) and edges over Unix sockets, as `dsec up` runs them.

Simulated edges for the fast tests; one container cluster (root; CI runs as root) for the
tamper-proof executable judge and preempt/resume on real sandboxes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from dsec import AsyncClient, Client, ExecResult, InvalidArgument, LocalCluster, SandboxNotFound
from dsec.edge.node import EdgeNode
from dsec.ids import node_of
from dsec.rl.access import (
    BatchSandboxAccess,
    ClientAccess,
    DelegatingAccess,
    EdgeAccess,
    LoopThread,
    SandboxAccess,
    create_sandboxes,
    destroy_sandboxes,
    pause_sandboxes,
    resume_sandboxes,
)
from dsec.rl.buffer import ReplayBuffer
from dsec.rl.driver import Driver, LstmState, PolicyOutput, RolloutHandle, resume
from dsec.rl.judges import ExecutableJudge, RegexJudge
from dsec.rl.sandbox import SandboxEnv, SandboxEnvConfig, SandboxEnvPool, Task
from dsec.wire.spec import ExecRequest, NetworkPolicy, SandboxSpec


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # A machine so large that packing does not pull a batch onto the edge that already
    # holds this module's earlier sandboxes: the batches here must spread over both edges.
    with LocalCluster(edges=2, cpu_milli=10**8, memory_bytes=1 << 46) as cl:
        yield cl


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with cluster.client() as c:
        yield c


@pytest.fixture
def access(client: Client) -> ClientAccess:
    return ClientAccess(client)


def _state(client: Client, sid: str | None) -> str:
    assert sid is not None
    try:
        return client.sandboxes.get(sid).state
    except SandboxNotFound:
        return "destroyed"                   # the edge already forgot it


# --------------------------------------------------------------------- SDK exec_many
@pytest.mark.parametrize("transport", ["aether", "http"])
def test_sdk_exec_many_carries_each_calls_request(cluster: LocalCluster, transport: str) -> None:
    with cluster.client(protocol=transport) as c:
        sbs = c.sandboxes.create_many([{"labels": {"i": "0"}}, {"labels": {"i": "1"},
                                                                 "memory": "256MiB"}])
        try:
            assert [s.info.spec.labels["i"] for s in sbs] == ["0", "1"]
            assert sbs[1].info.spec.memory_bytes == 256 << 20
            res = c.sandboxes.exec_many([
                (sbs[0], ExecRequest(argv=("cat",), stdin=b"from stdin")),
                (sbs[0], ExecRequest(shell="echo 123456789", output_cap_bytes=4)),
                (sbs[1], ExecRequest(shell="pwd; env", cwd="/", env={"A": "1"})),
                (sbs[1], "pwd; env", {"cwd": "/workspace", "env": {"B": "2"}}),  # overrides
                (sbs[1], ["pwd"]),                                        # batch defaults
                (sbs[0].id, ExecRequest(shell="pwd"), {"cwd": "/"}),
                ("sb-000000000000-edge-0", "true"),
                (sbs[0], ExecRequest(shell="pwd")),          # batch defaults do not apply
            ], cwd="/tmp", return_exceptions=True)
            out = [r.stdout if isinstance(r, ExecResult) else r for r in res]
            assert out[0] == b"from stdin"
            assert out[1] == b"1234" and res[1].stdout_truncated  # type: ignore[union-attr]
            assert out[2] == b"/\nA=1\n"
            assert out[3] == b"/workspace\nB=2\n"
            assert out[4] == b"/tmp\n"
            assert out[5] == b"/\n"
            assert out[7] == b"/workspace\n"
            assert isinstance(out[6], SandboxNotFound)
            with pytest.raises(SandboxNotFound):
                c.sandboxes.exec_many([(sbs[0], "true"), ("sb-000000000000-edge-1", "true")])
            with pytest.raises(InvalidArgument, match="cwdd"):
                c.sandboxes.exec_many([(sbs[0], "true", {"cwdd": "/"})])
            with pytest.raises(InvalidArgument, match="exactly one of argv"):
                c.sandboxes.exec_many([(sbs[0], ExecRequest())])
            with pytest.raises(InvalidArgument, match="timeout_s"):
                c.sandboxes.exec_many([(sbs[0], ExecRequest(shell="true"), {"timeout": -1})])
            assert c.sandboxes.exec_many([]) == []
        finally:
            for s in sbs:
                s.kill()


# --------------------------------------------------------------------- ClientAccess
def test_overrides_are_spec_fields_or_refused(client: Client) -> None:
    with pytest.raises(InvalidArgument, match=r"\['memory'\] are not fields of SandboxSpec"):
        ClientAccess(client, spec_overrides={"memory": "1GiB"})


def test_create_sends_the_spec_and_access_overrides(client: Client) -> None:
    acc = ClientAccess(client, spec_overrides={"labels": {"run": "7"}, "ttl_s": 600})
    assert isinstance(acc, SandboxAccess)
    sid = acc.create(SandboxSpec(memory_bytes=300 << 20, pids_max=99, labels={"a": "b"},
                                 env={"E": "1"}, network=NetworkPolicy(mode="none")))
    try:
        spec = client.sandboxes.get(sid).info.spec
        assert (spec.memory_bytes, spec.pids_max, spec.env, spec.ttl_s) == (
            300 << 20, 99, {"E": "1"}, 600)
        assert spec.labels["a"] == "b" and spec.labels["run"] == "7"
        assert spec.backend == "simulated" and spec.project == "default"
    finally:
        acc.destroy(sid)
    acc.destroy(sid)                             # idempotent
    assert _state(client, sid) == "destroyed"
    with pytest.raises(InvalidArgument, match="AsyncClient"):
        ClientAccess(client, LoopThread())       # type: ignore[arg-type]


def test_check_env_over_the_api(access: ClientAccess) -> None:
    env = SandboxEnv(access, [Task(prompt="hello", max_turns=3, judge=RegexJudge("x"))],
                     config=SandboxEnvConfig(max_obs_chars=512, max_action_chars=48))
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()


@pytest.mark.serial  # placement spreads by heartbeat-reported load: slow heartbeats put every sandbox on one edge
def test_pool_steps_with_one_exec_many_per_tick_across_edges(
        access: ClientAccess, client: Client) -> None:
    task = Task(prompt="count", max_turns=100, files={"/workspace/seed": b"s\n"})
    pool = SandboxEnvPool(access, [task], 6)
    try:
        pool.reset(seed=3)
        # Episode starts are batched too: one create_many, one mkdir batch, the files.
        assert access.calls == {"create_many": 1, "exec_many": 1, "write_file": 6}
        ids = pool.sandbox_ids()
        assert len(set(ids)) == 6
        assert {client.sandboxes.get(s).info.node for s in ids if s} == {"edge-0", "edge-1"}
        access.calls.clear()
        acts = np.empty(6, dtype=object)
        for t in range(4):
            acts[:] = [f"echo {i}:{t} >> /workspace/seed; cat /workspace/seed"
                       for i in range(6)]
            obs, rew, term, trunc, _ = pool.step(acts)
            assert list(obs) == ["s\n" + "".join(f"{i}:{k}\n" for k in range(t + 1))
                                 + "[exit 0]" for i in range(6)]
            assert not (term.any() or trunc.any() or rew.any())
        assert access.calls == {"exec_many": 4}      # one batched call per tick, nothing else
        assert access.read_file(ids[2], "/workspace/seed") == b"s\n2:0\n2:1\n2:2\n2:3\n"  # type: ignore[arg-type]
    finally:
        pool.close()
    assert [_state(client, sid) for sid in ids] == ["destroyed"] * 6


def test_async_client_on_its_own_loop_thread(cluster: LocalCluster) -> None:
    ac = AsyncClient(cluster.url, cluster.api_key, gateway=cluster.gateway)
    acc = ClientAccess(ac)
    try:
        env = SandboxEnv(acc, [Task(prompt="p", judge=RegexJudge(r"^42$", fullmatch=True))])
        try:
            env.reset(seed=0)
            obs, *_ = env.step('{"tool": "write_file", "path": "/workspace/a", "content": "42"}')
            assert obs == "wrote /workspace/a"
            obs, *_ = env.step('{"tool": "read_file", "path": "/workspace/a"}')
            assert obs == "42"
            _, reward, term, _, info = env.step('{"tool": "submit", "answer": "42"}')
            assert term and reward == 1.0 and info["verdict"].passed
        finally:
            env.close()
    finally:
        acc.run(ac.close())
        acc.close()


class PlainAccess(DelegatingAccess):
    """Only the SandboxAccess protocol (no batched methods): the one-by-one fallback."""

    def __init__(self, inner: EdgeAccess, fail_at: int | None = None) -> None:
        super().__init__(inner)
        self.fail_at = fail_at
        self.created: list[str] = []

    def create(self, spec: SandboxSpec) -> str:
        if len(self.created) == self.fail_at:
            raise InvalidArgument("no more sandboxes for this test")
        self.created.append(self.inner.create(spec))
        return self.created[-1]


def _live(nodes: dict[str, EdgeNode]) -> list[str]:
    return [i.id for n in nodes.values() for i in n.list()
            if i.state not in ("destroyed", "failed")]


def test_batched_creates_are_all_or_nothing(sim_access: EdgeAccess,
                                            sim_nodes: dict[str, EdgeNode],
                                            access: ClientAccess, client: Client) -> None:
    bad = SandboxSpec(memory_bytes=1)                  # refused by validation
    ok = SandboxSpec()
    plain = PlainAccess(sim_access, fail_at=2)
    assert not isinstance(plain, BatchSandboxAccess)
    assert isinstance(sim_access, BatchSandboxAccess) and isinstance(access, BatchSandboxAccess)
    with pytest.raises(InvalidArgument, match="no more"):
        create_sandboxes(plain, [ok, ok, ok])
    assert len(plain.created) == 2 and _live(sim_nodes) == []     # the two were destroyed
    with pytest.raises(InvalidArgument, match="memory_bytes"):
        create_sandboxes(sim_access, [ok, bad, ok])
    assert _live(sim_nodes) == []
    tag = {"labels": {"batch": "all-or-nothing"}}
    with pytest.raises(InvalidArgument, match="memory_bytes"):
        create_sandboxes(ClientAccess(client, spec_overrides=tag), [ok, bad, ok])
    assert [s.state for s in client.sandboxes.list(labels=tag["labels"])
            if s.state != "destroyed"] == []
    ids = create_sandboxes(plain := PlainAccess(sim_access), [ok, ok])
    pause_sandboxes(plain, ids)
    assert {sim_nodes[node_of(s)].get(s).state for s in ids} == {"paused"}
    resume_sandboxes(plain, ids)
    destroy_sandboxes(plain, [*ids, ids[0]])          # already gone is fine
    assert _live(sim_nodes) == []


# ------------------------------------------------------------------ preempt / resume
N = 3
TASKS = [Task(prompt="append numbers to /workspace/log", max_turns=5,
              judge=RegexJudge(r"^3\n", field="last_observation"), name="t0"),
         Task(prompt="same, other task", max_turns=5,
              judge=RegexJudge(r"4", field="last_observation"), name="t1")]


class CounterPolicy:
    """Non-idempotent commands driven by the recurrent state (c counts turns, zeroed on
    done by the driver): ``echo <c> >> log; cat log``."""

    def __call__(self, obs: np.ndarray, actor: LstmState | None,
                 critic: LstmState | None) -> PolicyOutput:
        assert actor is not None
        h, c = actor
        nc = c + 1.0
        acts = np.empty(len(obs), dtype=object)
        acts[:] = [f"echo {int(nc[i, 0])} >> /workspace/log; cat /workspace/log"
                   for i in range(len(obs))]
        return PolicyOutput(action=acts, value=nc[:, 0].astype(np.float32),
                            actor_state=(h + 1.0, nc), critic_state=(h + 1.0, nc))


def _buf(n: int = N) -> ReplayBuffer:
    return ReplayBuffer(num_envs=n, capacity=32, obs_dtype=object, action_dtype=object,
                        hidden_size=1)


def _assert_same(a: ReplayBuffer, b: ReplayBuffer) -> None:
    for name, arr in a.step_major().arrays().items():
        np.testing.assert_array_equal(b.step_major().arrays()[name], arr, err_msg=name)


def _preempt_resume_equals_uninterrupted(
        access: ClientAccess, client: Client, tasks: list[Task], n: int,
        resumed_access: ClientAccess | None = None) -> None:
    """Preempt mid-episode through the API, resume (optionally with another access, as a
    new trainer process would), and compare with an uninterrupted run."""
    pools: list[SandboxEnvPool] = []
    try:
        ref_pool = SandboxEnvPool(access, tasks, n)
        pools.append(ref_pool)
        ref = Driver(ref_pool, CounterPolicy(), _buf(n))
        ref.start(seed=5)
        ref.rollout(8)                   # crosses an episode boundary (max_turns=5)

        pool = SandboxEnvPool(access, tasks, n)
        pools.append(pool)
        buf = _buf(n)
        d = Driver(pool, CounterPolicy(), buf)
        d.start(seed=5)
        d.rollout(3)
        handle = RolloutHandle.from_bytes(d.preempt().to_bytes())
        assert [_state(client, s) for s in pool.sandbox_ids()] == ["paused"] * n
        if resumed_access is not None:
            assert handle.pool_state is not None
            pool = SandboxEnvPool.restore(handle.pool_state, resumed_access, tasks, n)
            pools.append(pool)
        d2 = resume(handle, pool=pool, policy=CounterPolicy(), buffer=buf)
        assert [_state(client, s) for s in pool.sandbox_ids()] == ["running"] * n
        d2.rollout(5)
        _assert_same(ref.buffer, buf)
        logs = [access.read_file(s, "/workspace/log") for s in pool.sandbox_ids() if s]
        assert logs == [access.read_file(s, "/workspace/log")
                        for s in ref_pool.sandbox_ids() if s]
        assert logs[0] == b"1\n2\n3\n"   # second episode, 3 turns in
        assert buf.check() == []
    finally:
        for p in pools:
            p.close()


def test_preempt_and_resume_through_the_api_equals_uninterrupted(
        access: ClientAccess, client: Client) -> None:
    _preempt_resume_equals_uninterrupted(access, client, TASKS, N)


def test_another_trainer_resumes_a_preempted_rollout(cluster: LocalCluster) -> None:
    """Trainer A preempts and goes away; trainer B (a new client, sandbox ids it never
    created) restores the pool from the handle and continues."""
    with cluster.client() as a, cluster.client() as b:
        _preempt_resume_equals_uninterrupted(
            ClientAccess(a, detached=True), a, TASKS, N,
            resumed_access=ClientAccess(b))


@pytest.mark.parametrize("transport", ["aether", "http"])
def test_resume_after_a_stray_exec_woke_a_sandbox(cluster: LocalCluster,
                                                   transport: str) -> None:
    """A preempted rollout whose sandboxes were partly auto-resumed (one stray exec) and
    partly resumed twice resumes cleanly: "already running" is success at every door
    (SDK over the Aether gateway and over REST; the edge door in test_preempt.py)."""
    with cluster.client(protocol=transport) as c:
        acc = ClientAccess(c)
        pool = SandboxEnvPool(acc, TASKS, N)
        try:
            d = Driver(pool, CounterPolicy(), _buf(N))
            d.start(seed=1)
            d.rollout(1)
            handle = d.preempt()
            first, second = pool.sandbox_ids()[:2]
            assert first is not None and second is not None
            r = acc.exec_batch([(first, ExecRequest(shell="true"))])[0]   # auto-resumes
            assert isinstance(r, ExecResult) and _state(c, first) == "running"
            c.sandboxes.get(second).resume()
            c.sandboxes.get(second).resume()                              # twice: fine
            d2 = resume(handle, pool=pool, policy=CounterPolicy(), buffer=_buf(N))
            assert [_state(c, s) for s in pool.sandbox_ids()] == ["running"] * N
            d2.rollout(1)
        finally:
            pool.close()


# ------------------------------------------------------------------ real containers
SPEC = SandboxSpec(backend="container", memory_bytes=256 << 20, pids_max=256)
TEST_SH = b'test "$(cat /workspace/answer)" = 42 || { echo "wrong answer"; exit 1; }\necho ok\n'


@pytest.fixture(scope="module")
def container_cluster() -> Iterator[LocalCluster]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    with LocalCluster(edges=1, backend="container") as cl:
        yield cl


@pytest.fixture(scope="module")
def container_client(container_cluster: LocalCluster) -> Iterator[Client]:
    with container_cluster.client() as c:
        yield c


@pytest.mark.root
@pytest.mark.parametrize("transport", ["aether", "http"])
def test_hide_reaches_the_edge_through_every_door(container_cluster: LocalCluster,
                                                  transport: str) -> None:
    """ExecRequest.hide over the SDK, the Aether gateway and REST (whose body type once
    had no such field and would have dropped it): the command is confined."""
    with container_cluster.client(protocol=transport) as c:
        sb = c.sandboxes.create(spec=SPEC)
        try:
            made = c.sandboxes.exec_many([(sb, ExecRequest(
                shell="mkdir -m700 /.dsec-judge && echo s3cr3t > /.dsec-judge/secret"))])[0]
            assert isinstance(made, ExecResult) and made.exit_code == 0, made
            hidden, plain = c.sandboxes.exec_many([
                (sb, ExecRequest(shell="cat /.dsec-judge/secret", hide=(".dsec-judge",))),
                (sb, ExecRequest(shell="cat /.dsec-judge/secret"))])
            assert isinstance(hidden, ExecResult) and hidden.exit_code != 0, hidden
            assert b"s3cr3t" not in hidden.stdout
            assert isinstance(plain, ExecResult) and plain.stdout == b"s3cr3t\n"
        finally:
            sb.kill()


def _episode(container_client: Client, access: ClientAccess, judge: ExecutableJudge,
             actions: list[str]) -> float:
    task = Task(prompt="Write the answer to /workspace/answer. Tests: /workspace/tests.sh",
                files={"/workspace/tests.sh": TEST_SH}, judge=judge, spec=SPEC, max_turns=20)
    env = SandboxEnv(access, [task])
    try:
        _, info = env.reset(seed=0)
        # A real container: the sandbox's PID 1 is its own init, not the host's.
        assert container_client.sandboxes.get(info["sandbox_id"]).info.spec.backend == \
            "container"
        obs, *_ = env.step("cat /proc/1/comm; ls /bin/busybox")
        assert obs.endswith("/bin/busybox\n[exit 0]") and "systemd" not in obs, obs
        for a in actions:
            obs, _, term, trunc, _ = env.step(a)
            assert not (term or trunc) and obs.endswith("[exit 0]"), obs   # the cheat ran
        _, reward, term, _, info = env.step('{"tool": "submit"}')
        assert term, info
        return float(reward)
    finally:
        env.close()


@pytest.mark.root
def test_isolated_executable_judge_over_the_api_cannot_be_fooled(
        container_client: Client) -> None:
    access = ClientAccess(container_client)
    judge = ExecutableJudge(hidden_files={"test.sh": TEST_SH},
                            command=["/bin/sh", "{tests}/test.sh"], cwd="/workspace",
                            isolate=True, carry=["/workspace/answer"], timeout_s=20.0)
    assert _episode(container_client, access, judge, ["echo 42 > /workspace/answer"]) == 1.0
    cheats = [
        "echo 41 > /workspace/answer",
        "echo 1.0 > /workspace/reward.txt; echo 1.0 > /tmp/reward; echo PASS > /tmp/result",
        "printf 'exit 0\\n' > /workspace/tests.sh",                       # visible tests
        "for i in 0 1 2 3; do mkdir -p /tmp/.judge-$i; printf 'exit 0' > /tmp/.judge-$i/test.sh; done",
        # Replace the shell the verifier would run with one that always passes ...
        "rm /bin/sh && printf '#!/bin/busybox ash\\nexit 0\\n' > /bin/sh && chmod 755 /bin/sh",
        # ... and leave a process behind that rewrites any test that shows up.
        ("/bin/busybox setsid /bin/busybox ash -c 'while :; do for f in /tmp/.judge-*/test.sh;"
         " do [ -f \"$f\" ] && echo \"exit 0\" > \"$f\"; done; done' </dev/null >/dev/null 2>&1 &"),
    ]
    assert _episode(container_client, access, judge, cheats) == 0.0
    assert container_client.sandboxes.list(state="running") == []   # judge sandboxes gone


@pytest.mark.root
def test_preempt_resume_on_containers_equals_uninterrupted(container_client: Client) -> None:
    tasks = [Task(prompt="append numbers", spec=SPEC, max_turns=5,
                  judge=RegexJudge(r"^3\n", field="last_observation"))]
    _preempt_resume_equals_uninterrupted(ClientAccess(container_client), container_client,
                                         tasks, 2)
