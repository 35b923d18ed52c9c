"""OpenAIPolicy through the real `openai` client against the scripted endpoint (HTTP on
loopback): tool calls both ways, token ids and logprobs, retries, concurrency, errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from dsec.errors import InvalidArgument, Unavailable
from dsec.rl.agent.policy import OpenAIPolicy, PolicyConfig, SamplingParams
from dsec.rl.agent.scripted import ScriptedEndpoint
from dsec.rl.agent.tools import decode_action, parse_reply
from dsec.rl.agent.types import Message

PROMPT = "Write 42 to /workspace/out.\n```bash\necho 42 > /workspace/out\ncat /workspace/out\n```"


def _cfg(ep: ScriptedEndpoint, model: str = "honest", **kw: object) -> PolicyConfig:
    return PolicyConfig(base_url=ep.base_url, model=model, **kw)  # type: ignore[arg-type]


async def test_native_tool_calls_with_token_ids_and_logprobs(endpoint: ScriptedEndpoint) -> None:
    pol = OpenAIPolicy(_cfg(endpoint, sampling=SamplingParams(temperature=0.5, max_tokens=64,
                                                              seed=3)))
    try:
        msgs = [Message(role="user", content=PROMPT)]
        reply = await pol.act(msgs)
        assert reply.role == "assistant" and reply.finish_reason == "tool_calls"
        (call,) = reply.tool_calls
        assert call.name == "bash" and json.loads(call.arguments) == {
            "command": "echo 42 > /workspace/out"}
        assert reply.token_ids and reply.logprobs and len(reply.token_ids) == len(reply.logprobs)
        assert reply.prompt_token_ids
        assert all(lp < 0 for lp in reply.logprobs)
        # the whole history goes back, in OpenAI shape, with the tool schemas
        msgs += [reply, Message(role="tool", content="[exit 0]", tool_call_id=call.id,
                                name="bash")]
        second = await pol.act(msgs)
        body = endpoint.requests[-1]
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
        assert body["messages"][1]["tool_calls"][0]["id"] == call.id
        assert body["messages"][2]["tool_call_id"] == call.id
        assert next(t["function"]["name"] for t in body["tools"]) == "bash"
        assert body["temperature"] == 0.5 and body["max_tokens"] == 64 and body["seed"] == 3
        assert body["logprobs"] is True and body["return_token_ids"] is True
        assert json.loads(second.tool_calls[0].arguments)["command"] == "cat /workspace/out"
        assert pol.info().model == "honest"
    finally:
        await pol.close()


async def test_hermes_format_without_tools_field(endpoint: ScriptedEndpoint) -> None:
    pol = OpenAIPolicy(_cfg(endpoint, tool_format="hermes", logprobs=False,
                            return_token_ids=False))
    try:
        assert pol.system_prompt is not None and "<tool_call>" in pol.system_prompt
        reply = await pol.act([Message(role="system", content=pol.system_prompt),
                               Message(role="user", content=PROMPT)])
        assert "tools" not in endpoint.requests[-1]
        assert reply.tool_calls == () and reply.token_ids is None and reply.logprobs is None
        (call,) = parse_reply(reply.content, reply.tool_calls)
        assert not isinstance(call, Exception)
        assert decode_action(call).command == "echo 42 > /workspace/out"  # type: ignore[union-attr]
    finally:
        await pol.close()


async def test_retries_then_unavailable() -> None:
    with ScriptedEndpoint(fail_first=2) as ep:
        pol = OpenAIPolicy(_cfg(ep, max_retries=2))
        try:
            reply = await pol.act([Message(role="user", content=PROMPT)])   # 2 x 503, then ok
            assert reply.tool_calls and ep.stats.requests == 3
        finally:
            await pol.close()
    with ScriptedEndpoint(fail_first=10) as ep:
        pol = OpenAIPolicy(_cfg(ep, max_retries=1))
        try:
            with pytest.raises(Unavailable, match="503 after 1 retries"):
                await pol.act([Message(role="user", content=PROMPT)])
            assert ep.stats.requests == 2
        finally:
            await pol.close()


async def test_unknown_model_is_invalid_argument(endpoint: ScriptedEndpoint) -> None:
    pol = OpenAIPolicy(_cfg(endpoint, model="nope"))
    try:
        with pytest.raises(InvalidArgument, match="404"):
            await pol.act([Message(role="user", content="hi")])
    finally:
        await pol.close()


@pytest.mark.parametrize("per_pool", [64, 1])
async def test_concurrency_limit_holds(endpoint: ScriptedEndpoint, per_pool: int) -> None:
    # one pool, or three pools of one connection each (requests spread over them)
    pol = OpenAIPolicy(_cfg(endpoint, model="slow", max_concurrency=3,
                            connections_per_client=per_pool))
    try:
        endpoint.stats.max_in_flight = 0
        replies = await asyncio.gather(*(pol.act([Message(role="user", content=PROMPT)])
                                         for _ in range(12)))
        assert endpoint.stats.max_in_flight == 3
        assert all(r.tool_calls[0].name == "bash" for r in replies)
    finally:
        await pol.close()


def test_config_is_checked() -> None:
    with pytest.raises(InvalidArgument, match="base_url"):
        PolicyConfig(base_url="127.0.0.1:8000", model="m")
    with pytest.raises(InvalidArgument, match="max_concurrency"):
        PolicyConfig(base_url="http://x/v1", model="m", max_concurrency=0)


async def test_endpoint_in_a_child_process() -> None:
    from dsec.rl.agent.scripted import EndpointProcess
    with EndpointProcess(think_s=0.0, policies={"h2": "dsec.rl.agent.scripted:honest"}) as ep:
        pol = OpenAIPolicy(PolicyConfig(base_url=ep.base_url, model="h2"))
        try:
            reply = await pol.act([Message(role="user", content=PROMPT)])
            assert reply.tool_calls[0].name == "bash"
        finally:
            await pol.close()
        proc = ep._proc
    assert proc.returncode is not None                    # stopped with the block
