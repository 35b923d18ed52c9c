"""F9: one model reply may carry any number of tool calls and the engine runs every one
of them (``RolloutEngine.apply_reply``): ``max_turns``, the budget a task gives the agent,
counts replies, so a reply with 2,000 ``bash`` calls takes 2,000 actions in one "turn"
(and grows the trajectory and the next prompt without bound). A hostile or degenerate
endpoint, or a policy RL pushes there, must not get more actions than the budget says.

The sandbox side is a counting fake at the ToolSandbox boundary (not what is tested)."""

from __future__ import annotations

import asyncio
from typing import Any

from dsec.rl.agent.types import Message, ToolCall, Trajectory
from dsec.rl.engine import EngineConfig, RolloutEngine
from dsec.wire.spec import ExecRequest, ExecResult


class Counting:
    def __init__(self) -> None:
        self.execs = 0

    async def exec(self, sid: str, req: ExecRequest) -> ExecResult:
        self.execs += 1
        return ExecResult(exit_code=0, stdout=b"", stderr=b"")

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)


def test_one_reply_cannot_take_unbounded_actions() -> None:
    sb = Counting()
    engine = RolloutEngine(sb, policy=None, config=EngineConfig())
    calls = tuple(ToolCall(id=f"c{i}", name="bash", arguments='{"command": "true"}')
                  for i in range(2000))
    traj = Trajectory(episode_id="e", task_id="t")

    async def go() -> None:
        try:
            await engine.apply_reply("sb-1", engine.config.tools, traj,
                                     Message(role="assistant", tool_calls=calls))
        finally:
            await engine.close()
    asyncio.run(go())
    assert sb.execs <= 64, (
        f"one assistant reply ran {sb.execs} commands (max_turns counts replies)")
