"""Tool schemas, tool-call parsing (OpenAI and Hermes) and strict mode."""

from __future__ import annotations

import json

import pytest

from dsec.rl.agent.tools import (
    TOOL_NAMES,
    Bash,
    StrReplace,
    Submit,
    ToolCallError,
    WriteFile,
    decode_action,
    hermes_system_prompt,
    openai_tools,
    parse_hermes,
    parse_reply,
)
from dsec.rl.agent.types import ToolCall


def test_openai_tool_schemas() -> None:
    tools = openai_tools()
    assert [t["function"]["name"] for t in tools] == list(TOOL_NAMES) == [
        "bash", "read_file", "write_file", "str_replace", "submit"]
    for t in tools:
        assert t["type"] == "function"
        params = t["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert set(params["required"]) <= set(params["properties"])
        assert t["function"]["description"]
    bash = tools[0]["function"]["parameters"]
    assert bash["required"] == ["command"]
    tools[0]["function"]["name"] = "mutated"                    # a fresh copy each call
    assert openai_tools()[0]["function"]["name"] == "bash"
    with pytest.raises(ValueError, match="unknown tools"):
        openai_tools(["bash", "rm"])
    assert "<tools>" in hermes_system_prompt() and '"name": "submit"' in hermes_system_prompt()


def test_openai_tool_calls_win_and_decode() -> None:
    calls = (ToolCall(id="a", name="bash", arguments='{"command": "ls -la"}'),
             ToolCall(id="b", name="str_replace",
                      arguments='{"path": "x.py", "old_str": "1", "new_str": "2"}'))
    got = parse_reply("<tool_call>{\"name\": \"submit\"}</tool_call>", calls)
    assert got == list(calls)
    assert decode_action(calls[0]) == Bash(command="ls -la")
    assert decode_action(calls[1]) == StrReplace(path="x.py", old_str="1", new_str="2")


def test_hermes_blocks() -> None:
    text = ('Let me look.\n<tool_call>{"name": "bash", "arguments": {"command": "echo hé"}}'
            '</tool_call>\n<tool_call>\n{"name": "write_file", "arguments": '
            '"{\\"path\\": \\"/a\\", \\"content\\": \\"x\\"}"}\n</tool_call>')
    a, b = parse_hermes(text)
    assert isinstance(a, ToolCall) and isinstance(b, ToolCall)
    assert a.name == "bash" and json.loads(a.arguments) == {"command": "echo hé"}
    assert decode_action(b) == WriteFile(path="/a", content="x")   # double-encoded args
    assert a.id != b.id and a.id.startswith("call_")
    bad = parse_hermes('<tool_call>{"name": "bash", "arguments": {oops}}</tool_call>'
                       '<tool_call>[1]</tool_call><tool_call>{"name": "bash"')
    assert [e.kind for e in bad if isinstance(e, ToolCallError)] == [
        "malformed_json", "malformed_call", "malformed_call"]


def test_strict_mode_never_runs_prose() -> None:
    (err,) = parse_reply("I'll run rm -rf / now", ())
    assert isinstance(err, ToolCallError) and err.kind == "no_tool_call"
    assert "never executed" in str(err)
    (err,) = parse_reply("   ", (), strict=False)
    assert isinstance(err, ToolCallError) and err.kind == "empty_reply"
    (call,) = parse_reply("ls /tmp", (), strict=False)           # scripted policies only
    assert isinstance(call, ToolCall) and decode_action(call) == Bash(command="ls /tmp")


@pytest.mark.parametrize(("name", "args", "kind"), [
    ("rm_rf", "{}", "unknown_tool"),
    ("bash", '{"command": "ls"', "malformed_json"),
    ("bash", "[1, 2]", "malformed_arguments"),
    ("bash", '{"cmd": "ls"}', "bad_arguments"),
    ("bash", '{"command": 5}', "bad_arguments"),
    ("write_file", '{"path": "/a"}', "bad_arguments"),
])
def test_decode_errors_are_observations(name: str, args: str, kind: str) -> None:
    with pytest.raises(ToolCallError) as ei:
        decode_action(ToolCall(id="x", name=name, arguments=args))
    assert ei.value.kind == kind
    assert ei.value.call is not None and ei.value.call.id == "x"


def test_submit_defaults() -> None:
    assert decode_action(ToolCall(id="s", name="submit", arguments="")) == Submit(answer="")
    assert decode_action(ToolCall(id="s", name="submit", arguments='{"answer": "42"}')) == \
        Submit(answer="42")
