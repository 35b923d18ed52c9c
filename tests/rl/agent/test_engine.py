"""The asyncio rollout engine end to end: the real `openai` client against the scripted
endpoint on loopback, real container sandboxes through the SDK (a LocalCluster with the
container backend), real judges."""

from __future__ import annotations

import asyncio

import pytest

from dsec import AsyncClient, LocalCluster
from dsec.rl.agent.policy import OpenAIPolicy, PolicyConfig
from dsec.rl.agent.sandboxes import ClientSandboxes
from dsec.rl.agent.scripted import ScriptedEndpoint, ScriptedTurn
from dsec.rl.engine import EngineConfig, RolloutEngine
from dsec.rl.judges import ExecutableJudge, Verdict
from dsec.rl.tasks import AgentTask, TaskRegistry, TaskSampler
from dsec.wire.spec import SandboxSpec

SPEC = SandboxSpec(backend="container", memory_bytes=128 << 20, pids_max=128)
TEST_SH = b'test "$(cat /workspace/answer)" = 42 || { echo "wrong answer"; exit 1; }\necho ok\n'
JUDGE = ExecutableJudge(hidden_files={"test.sh": TEST_SH}, command=["/bin/sh", "{tests}/test.sh"],
                        carry=["/workspace/answer"])


def task(tid: str = "answer-42", cmds: str = "echo 42 > /workspace/answer\ncat /workspace/answer",
         **kw: object) -> AgentTask:
    return AgentTask(id=tid, prompt=f"Write 42 to /workspace/answer.\n```bash\n{cmds}\n```",
                     judge=JUDGE, spec=SPEC, **kw)  # type: ignore[arg-type]


def _engine(ac: AsyncClient, ep: ScriptedEndpoint, model: str = "honest",
            registry: TaskRegistry | None = None, **cfg: object) -> RolloutEngine:
    pol = OpenAIPolicy(PolicyConfig(base_url=ep.base_url, model=model))
    return RolloutEngine(ClientSandboxes(ac), pol, EngineConfig(**cfg),  # type: ignore[arg-type]
                         registry=registry)


async def _close(eng: RolloutEngine) -> None:
    await eng.close()
    await eng.policy.close()  # type: ignore[attr-defined]


async def _running(ac: AsyncClient) -> list[str]:
    return [s.id for s in await ac.sandboxes.list(state="running")]


async def test_honest_episode_passes_with_full_history(aclient: AsyncClient,
                                                       endpoint: ScriptedEndpoint) -> None:
    eng = _engine(aclient, endpoint)
    traj = await eng.episode(task())
    assert traj.infra_error is None, traj.infra_error
    assert traj.end == "submitted" and traj.reward == 1.0 and traj.verdict is not None
    assert traj.verdict.passed and traj.verdict.judge == "ExecutableJudge"
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant", "tool",
                                               "assistant", "tool"]
    assert [s.action.name for s in traj.steps if s.action] == ["bash", "bash", "submit"]
    assert traj.steps[1].observation == "42\n[exit 0]" and traj.steps[1].exit_code == 0
    assert traj.answer == "42"
    a = traj.messages[1]
    assert a.token_ids and a.logprobs and len(a.token_ids) == len(a.logprobs)
    assert traj.messages[2].tool_call_id == a.tool_calls[0].id
    assert traj.steps[-1].reward == 1.0
    assert traj.timings.setup_s > 0 and traj.timings.judge_s > 0 and traj.timings.total_s > 0
    assert all(s.timings.queue_s >= 0 for s in traj.steps)
    assert await _running(aclient) == []                  # episode and judge sandboxes gone
    await _close(eng)


async def test_cheater_earns_nothing(aclient: AsyncClient, endpoint: ScriptedEndpoint) -> None:
    eng = _engine(aclient, endpoint, model="cheating")
    traj = await eng.episode(task(max_turns=10))
    assert traj.infra_error is None and traj.end == "submitted"
    assert traj.reward == 0.0 and traj.verdict is not None and not traj.verdict.passed
    assert len(traj.steps) == 6 and traj.answer == "PASS"
    assert await _running(aclient) == []
    await _close(eng)


class NotPwned:
    """Judges in place: 1.0 when /workspace/pwned does not exist (nothing ran the prose)."""

    def judge(self, ctx):  # type: ignore[no-untyped-def]
        from dsec.wire.spec import ExecRequest
        (res,) = ctx.access.exec_batch([(ctx.sandbox_id, ExecRequest(
            argv=("test", "!", "-e", "/workspace/pwned")))])
        return Verdict(1.0 if res.exit_code == 0 else 0.0, res.exit_code == 0, "")


async def test_malformed_calls_are_observation_errors_never_commands(
        aclient: AsyncClient, endpoint: ScriptedEndpoint) -> None:
    eng = _engine(aclient, endpoint, model="malformed")
    t = AgentTask(id="malformed", prompt="do it", judge=NotPwned(), spec=SPEC)  # type: ignore[arg-type]
    traj = await eng.episode(t)
    assert traj.infra_error is None and traj.end == "submitted"
    # the unclosed Hermes block is prose to a native-tool-calling policy (red17 N4): it is
    # not parsed at all, so "no tool call" rather than "malformed call"
    assert [s.error for s in traj.steps] == ["no_tool_call", "malformed_json", "unknown_tool",
                                             "no_tool_call", "bad_arguments", None]
    assert traj.reward == 1.0                              # /workspace/pwned never appeared
    # prose and Hermes errors come back as user messages, bad native calls as tool messages
    roles = [m.role for m in traj.messages]
    assert roles[:11] == ["user", "assistant", "user", "assistant", "tool", "assistant",
                          "tool", "assistant", "user", "assistant", "tool"]
    assert "never executed" in (traj.messages[2].content or "")
    await _close(eng)


async def test_episodes_progress_independently(aclient: AsyncClient,
                                               endpoint: ScriptedEndpoint) -> None:
    """One episode blocked in a command does not hold up the others: they all finish while
    it waits (a lockstep loop would wait for it on every tick, and never finish here)."""
    eng = _engine(aclient, endpoint, max_concurrent_episodes=8)
    blocked = task("blocked", "while [ ! -e /workspace/go ]; do sleep 0.05; done\n"
                              "echo 42 > /workspace/answer")
    slow = asyncio.ensure_future(eng.episode(blocked))
    fast = await asyncio.wait_for(asyncio.gather(*(eng.episode(task(f"fast-{i}"))
                                                   for i in range(4))), 120)
    assert [t.reward for t in fast] == [1.0] * 4
    assert not slow.done()
    (sid,) = await _running(aclient)                      # only the blocked episode's
    await (await aclient.sandboxes.get(sid)).files.write("/workspace/go", b"")
    traj = await asyncio.wait_for(slow, 60)
    assert traj.reward == 1.0 and traj.sandbox_id == sid
    await _close(eng)


async def test_concurrency_bound_and_registry(aclient: AsyncClient,
                                              endpoint: ScriptedEndpoint) -> None:
    reg = TaskRegistry([task("a"), task("b", "echo 41 > /workspace/answer")])
    eng = _engine(aclient, endpoint, registry=reg, max_concurrent_episodes=2)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, eng.live_episodes)
            await asyncio.sleep(0.005)
    w = asyncio.ensure_future(watch())
    trajs = await eng.run(reg.tasks(), epochs=2, group_size=2)
    w.cancel()
    assert peak == 2
    assert len(trajs) == 8
    assert {t.epoch for t in trajs} == {0, 1}
    groups: dict[str, list[str]] = {}
    for t in trajs:
        assert t.group_id is not None
        groups.setdefault(t.group_id, []).append(t.task_id)
    assert sorted(sorted(v) for v in groups.values()) == [["a", "a"]] * 2 + [["b", "b"]] * 2
    assert reg.stats("a").attempts == 4 and reg.stats("a").pass_rate == 1.0
    assert reg.stats("b").attempts == 4 and reg.stats("b").pass_rate == 0.0
    assert [t.id for t in reg.select(min_pass_rate=0.5)] == ["a"]
    assert await _running(aclient) == []
    await _close(eng)


async def test_group_from_one_snapshot(aclient: AsyncClient, endpoint: ScriptedEndpoint) -> None:
    """GRPO: n rollouts each from the same pack_diff snapshot holding the task's files."""
    t = task("from-snap", "cat /workspace/input > /workspace/answer",
             files={"/workspace/input": b"42\n"})
    eng = _engine(aclient, endpoint)
    trajs = await eng.group(t, 3, snapshot_files=True)
    assert [tr.reward for tr in trajs] == [1.0, 1.0, 1.0], [tr.infra_error for tr in trajs]
    assert len({tr.group_id for tr in trajs}) == 1
    snaps = await aclient.snapshots.list()
    assert snaps                                         # made once, for the group
    assert await _running(aclient) == []
    await _close(eng)


async def test_infra_errors_are_flagged_not_scored(aclient: AsyncClient) -> None:
    # the endpoint goes away: every request fails after the retries -> infra_error
    with ScriptedEndpoint(fail_first=1000) as ep:
        eng = RolloutEngine(ClientSandboxes(aclient), OpenAIPolicy(PolicyConfig(
            base_url=ep.base_url, model="honest", max_retries=0)))
        traj = await eng.episode(task())
        assert traj.end == "infra_error" and traj.reward == 0.0 and traj.verdict is None
        assert traj.infra_error is not None and "503" in traj.infra_error
        await _close(eng)
    # the sandbox dies under the agent -> infra_error naming the tool
    with ScriptedEndpoint(think_s=0.3) as ep:
        eng = RolloutEngine(ClientSandboxes(aclient), OpenAIPolicy(PolicyConfig(
            base_url=ep.base_url, model="slow")))
        ep_task = asyncio.ensure_future(eng.episode(task()))
        # the first model request comes after the sandbox is made and set up: killing it
        # then (while the slow policy thinks) fails the next tool, not the set-up
        while ep.stats.requests < 1 or not await _running(aclient):
            await asyncio.sleep(0.02)
        for sid in await _running(aclient):
            await (await aclient.sandboxes.get(sid)).kill()
        traj = await ep_task
        assert traj.end == "infra_error" and traj.infra_error is not None
        assert "tool bash failed" in traj.infra_error and traj.steps[-1].infra_error
        await _close(eng)
    assert await _running(aclient) == []


async def test_step_and_episode_deadlines(aclient: AsyncClient) -> None:
    with ScriptedEndpoint(think_s=0.5) as ep:
        eng = RolloutEngine(ClientSandboxes(aclient), OpenAIPolicy(PolicyConfig(
            base_url=ep.base_url, model="slow")), EngineConfig(step_timeout_s=0.2))
        traj = await eng.episode(task())
        assert traj.end == "step_timeout" and traj.infra_error is not None
        await _close(eng)
        eng = RolloutEngine(ClientSandboxes(aclient), OpenAIPolicy(PolicyConfig(
            base_url=ep.base_url, model="slow")), EngineConfig(episode_timeout_s=1.2))
        traj = await eng.episode(task())
        assert traj.end == "episode_timeout" and traj.infra_error is None
        assert traj.reward == 0.0 and len(traj.steps) < 3        # cut off mid-episode
        await _close(eng)
    assert await _running(aclient) == []


def test_sampler_epochs_without_replacement() -> None:
    tasks = [AgentTask(id=f"t{i}", prompt="p") for i in range(5)]
    s = TaskSampler(tasks, seed=7)
    got = s.take(15)
    for e in range(3):
        ids = [t.id for t, ep in got[5 * e: 5 * e + 5]]
        assert sorted(ids) == [f"t{i}" for i in range(5)]
        assert {ep for _, ep in got[5 * e: 5 * e + 5]} == {e}
    assert [t.id for t, _ in TaskSampler(tasks, seed=7).take(15)] == [t.id for t, _ in got]
    assert [t.id for t, _ in got[:5]] != [t.id for t, _ in got[5:10]] or \
        [t.id for t, _ in got[5:10]] != [t.id for t, _ in got[10:]]


def test_sync_client_drives_the_engine(cluster: LocalCluster, endpoint: ScriptedEndpoint) -> None:
    """A sync Client's loop thread runs the sandbox calls; the engine runs on another loop."""
    with cluster.client() as client:
        async def go() -> list[float]:
            pol = OpenAIPolicy(PolicyConfig(base_url=endpoint.base_url, model="honest"))
            eng = RolloutEngine(ClientSandboxes(client), pol)
            try:
                return [t.reward for t in await eng.group(task(), 2)]
            finally:
                await _close(eng)
        assert asyncio.run(go()) == [1.0, 1.0]
        assert client.sandboxes.list(state="running") == []


async def test_judge_that_cannot_judge_is_an_infra_error(aclient: AsyncClient,
                                                         endpoint: ScriptedEndpoint) -> None:
    judge = ExecutableJudge(hidden_files={"test.sh": TEST_SH}, carry=["/workspace/answer"],
                            command=["/bin/sh", "{tests}/test.sh"],
                            judge_spec=SandboxSpec(backend="container", image="no-such-image"))
    eng = _engine(aclient, endpoint)
    traj = await eng.episode(AgentTask(id="bad-judge", prompt=task().prompt, judge=judge,
                                       spec=SPEC))
    assert traj.end == "infra_error" and traj.verdict is None and traj.reward == 0.0
    assert traj.infra_error is not None and "judge ExecutableJudge" in traj.infra_error
    assert await _running(aclient) == []
    await _close(eng)


async def test_episode_starts_are_coalesced_into_one_create(aclient: AsyncClient,
                                                            endpoint: ScriptedEndpoint) -> None:
    sbx = ClientSandboxes(aclient)
    eng = RolloutEngine(sbx, OpenAIPolicy(PolicyConfig(base_url=endpoint.base_url,
                                                       model="honest")))
    unjudged = [AgentTask(id=f"u{i}", prompt=task().prompt, spec=SPEC) for i in range(5)]
    trajs = await asyncio.gather(*(eng.episode(t) for t in unjudged))
    assert [t.end for t in trajs] == ["submitted"] * 5
    assert len({t.sandbox_id for t in trajs}) == 5
    assert sbx.create_calls == 1                          # five sandboxes, one create_many
    await _close(eng)


def test_registry_records_persist_and_filter() -> None:
    from dsec.errors import Conflict, NotFound
    from dsec.rl.agent.types import Trajectory, VerdictRecord

    reg = TaskRegistry([AgentTask(id=t, prompt="p") for t in ("easy", "hard", "new")])
    for tid, passed in [("easy", True), ("easy", True), ("hard", False), ("hard", True),
                        ("hard", False), ("hard", False)]:
        reg.record(Trajectory(episode_id="e", task_id=tid, reward=float(passed),
                              verdict=VerdictRecord(reward=float(passed), passed=passed)))
    reg.record(Trajectory(episode_id="e", task_id="hard", infra_error="node lost"))
    assert (reg.stats("hard").attempts, reg.stats("hard").passes,
            reg.stats("hard").infra_errors) == (4, 1, 1)
    assert reg.stats("new").pass_rate is None
    assert [t.id for t in reg.select(max_pass_rate=0.5)] == ["hard", "new"]
    assert [t.id for t in reg.select(max_pass_rate=0.5, keep_unattempted=False)] == ["hard"]
    again = TaskRegistry(reg.tasks())
    again.load_stats(reg.to_json())
    assert again.stats("easy").pass_rate == 1.0 and again.stats("hard").mean_reward == 0.25
    with pytest.raises(Conflict):
        reg.add(AgentTask(id="easy", prompt="other"))
    with pytest.raises(NotFound):
        reg.record(Trajectory(episode_id="e", task_id="unknown"))


def _flood(messages: object) -> ScriptedTurn:
    """40 calls in the first reply, a submit in the next."""
    if sum(1 for m in messages if m.get("role") == "assistant"):  # type: ignore[attr-defined]
        return ScriptedTurn(calls=(("submit", {"answer": "done"}),))
    return ScriptedTurn(calls=tuple(("bash", {"command": f"echo {i} >> /workspace/log"})
                                    for i in range(40)))


async def test_one_reply_runs_at_most_max_calls_per_turn(aclient: AsyncClient) -> None:
    """red17 F9: a reply with 40 tool calls runs 5 (max_calls_per_turn=5); the other 35
    are answered "not run" (every call id gets its tool message), in one step."""
    with ScriptedEndpoint(policies={"flood": _flood}) as ep:
        eng = _engine(aclient, ep, model="flood", max_calls_per_turn=5, keep_sandboxes=True)
        try:
            traj = await eng.episode(task(max_turns=3))
            assert traj.infra_error is None and traj.end == "submitted", traj.infra_error
            assert traj.sandbox_id is not None
            log = await eng.sandboxes.read_file(traj.sandbox_id, "/workspace/log")
            assert log == b"0\n1\n2\n3\n4\n"
            assert [s.error for s in traj.steps] == [None] * 5 + ["too_many_calls", None]
            assert "only the first 5 ran" in traj.steps[5].observation
            reply = traj.messages[1]
            answered = [m.tool_call_id for m in traj.messages[2:42]]
            assert answered == [c.id for c in reply.tool_calls]
            assert all("not run" in (m.content or "") for m in traj.messages[7:42])
        finally:
            if traj.sandbox_id is not None:
                await eng.destroy_sandbox(traj.sandbox_id)
            await _close(eng)
