"""The agent's tools: schemas in OpenAI ``tools=`` format, parsing of what a model sends,
and decoding into typed actions.

Five tools: ``bash`` (a shell command in the sandbox), ``read_file``, ``write_file``,
``str_replace`` (replace one unique occurrence in a file) and ``submit`` (end the episode
with an answer). A model calls them either the OpenAI way (``tool_calls`` on the
assistant message) or Hermes-style, as text::

    <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>

**Strict mode** (the default for LLM policies): text that is not a tool call is never run.
A reply without a tool call, malformed JSON, an unknown tool or a missing argument each
become a :class:`ToolCallError` whose message is fed back to the model as the observation
(the step records ``error``), so the model can correct itself and nothing it wrote as prose
reaches a shell. ``strict=False`` keeps the old text-action convention of
:mod:`dsec.rl.sandbox` for scripted policies: a reply with no tool call is a bash command.

Everything here is pure (no I/O): :mod:`dsec.rl.agent.executor` runs the actions.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from dsec.errors import InvalidArgument
from dsec.rl.agent.types import ToolCall

__all__ = [
    "TOOL_NAMES", "Action", "Bash", "ReadFile", "StrReplace", "Submit", "ToolCallError",
    "WriteFile", "decode_action", "hermes_system_prompt", "openai_tools",
    "parse_hermes", "parse_reply",
]


class Bash(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    command: str
    timeout_s: float | None = None


class ReadFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str


class WriteFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    content: str


class StrReplace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    old_str: str
    new_str: str = ""


class Submit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    answer: str = ""


Action = Bash | ReadFile | WriteFile | StrReplace | Submit
ToolName = Literal["bash", "read_file", "write_file", "str_replace", "submit"]

_TYPES: dict[str, type[Action]] = {
    "bash": Bash, "read_file": ReadFile, "write_file": WriteFile, "str_replace": StrReplace,
    "submit": Submit,
}
TOOL_NAMES: tuple[str, ...] = tuple(_TYPES)

_DESCRIPTIONS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "bash": ("Run a shell command in the sandbox; returns stdout, stderr and the exit code.",
             {"command": {"type": "string", "description": "the command line (sh -c)"},
              "timeout_s": {"type": "number",
                            "description": "seconds before the command is killed"}},
             ["command"]),
    "read_file": ("Read a text file from the sandbox.",
                  {"path": {"type": "string",
                            "description": "absolute, or relative to the work dir"}},
                  ["path"]),
    "write_file": ("Create or overwrite a file (parent directories are created).",
                   {"path": {"type": "string"}, "content": {"type": "string"}},
                   ["path", "content"]),
    "str_replace": (("Replace the one occurrence of old_str in a file with new_str (fails "
                    "when old_str occurs zero or several times)."),
                    {"path": {"type": "string"}, "old_str": {"type": "string"},
                     "new_str": {"type": "string"}},
                    ["path", "old_str", "new_str"]),
    "submit": ("Finish the task; the result is then checked. Call it once, last.",
               {"answer": {"type": "string", "description": "the final answer, if any"}},
               []),
}


def openai_tools(names: Sequence[str] = TOOL_NAMES) -> list[dict[str, Any]]:
    """The tool schemas for ``chat.completions.create(tools=...)`` (a fresh list: the
    caller may change it)."""
    unknown = [n for n in names if n not in _DESCRIPTIONS]
    if unknown:
        raise InvalidArgument(f"unknown tools {unknown}; dsec's tools are {list(TOOL_NAMES)}")
    out = []
    for n in names:
        desc, props, required = _DESCRIPTIONS[n]
        out.append({"type": "function", "function": {
            "name": n, "description": desc,
            "parameters": {"type": "object", "properties": json.loads(json.dumps(props)),
                           "required": list(required), "additionalProperties": False}}})
    return out


def hermes_system_prompt(names: Sequence[str] = TOOL_NAMES) -> str:
    """A system prompt that offers the tools Hermes-style (for endpoints without native
    tool calling): the schemas inside ``<tools>`` and the ``<tool_call>`` reply format."""
    sigs = "\n".join(json.dumps(t["function"]) for t in openai_tools(names))
    return ("You may call tools. Their signatures:\n<tools>\n" + sigs + "\n</tools>\n"
            "To call one, reply with <tool_call>{\"name\": <tool>, \"arguments\": "
            "{...}}</tool_call> (one block per call). Text outside the blocks is not run.")


class ToolCallError(InvalidArgument):
    """What the model sent is not a valid tool call. Its message is the observation the
    model gets back; ``kind`` is the step's ``error`` label."""

    def __init__(self, message: str, *, kind: str, call: ToolCall | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.call = call


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_OPEN = re.compile(r"<tool_call>")


def _call_id() -> str:
    return "call_" + secrets.token_hex(8)


def parse_hermes(text: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text``, in order: a
    :class:`ToolCall`, or a :class:`ToolCallError` for a block that is not
    ``{"name": str, "arguments": object}`` (an unclosed block is one too)."""
    out: list[ToolCall | ToolCallError] = []
    for m in _HERMES.finditer(text):
        body = m.group(1)
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            out.append(ToolCallError(
                f"<tool_call> block is not valid JSON ({exc.msg} at char {exc.pos}): "
                f"{body[:200]!r}", kind="malformed_json"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append(ToolCallError(
                "a <tool_call> block must be {\"name\": <tool>, \"arguments\": {...}}, got "
                f"{body[:200]!r}", kind="malformed_call"))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):          # some models double-encode the arguments
            arg_text = args
        elif isinstance(args, dict):
            arg_text = json.dumps(args, ensure_ascii=False)
        else:
            out.append(ToolCallError(f"the arguments of tool {obj['name']!r} must be a JSON "
                                     f"object, got {type(args).__name__}",
                                     kind="malformed_arguments"))
            continue
        out.append(ToolCall(id=_call_id(), name=obj["name"], arguments=arg_text))
    closed = len(_HERMES.findall(text))
    if len(_HERMES_OPEN.findall(text)) > closed:
        out.append(ToolCallError("a <tool_call> block is not closed with </tool_call>",
                                 kind="malformed_call"))
    return out


def parse_reply(content: str | None, tool_calls: Sequence[ToolCall], *,
                strict: bool = True) -> list[ToolCall | ToolCallError]:
    """The calls an assistant reply makes: its OpenAI ``tool_calls`` when it has any, else
    its Hermes ``<tool_call>`` blocks. With none: in strict mode one
    :class:`ToolCallError` (``no_tool_call``: the text is not run); otherwise the text is
    a bash command (the old convention), and an empty reply is an error either way."""
    if tool_calls:
        return list(tool_calls)
    text = content or ""
    found = parse_hermes(text)
    if found:
        return found
    if not text.strip():
        return [ToolCallError("empty reply: call one of the tools "
                              f"({', '.join(TOOL_NAMES)})", kind="empty_reply")]
    if strict:
        return [ToolCallError(
            "your reply contained no tool call, so nothing was run. Call one of the tools "
            f"({', '.join(TOOL_NAMES)}); text outside a tool call is never executed.",
            kind="no_tool_call")]
    return [ToolCall(id=_call_id(), name="bash",
                     arguments=json.dumps({"command": text}, ensure_ascii=False))]


def decode_action(call: ToolCall) -> Action:
    """The typed action of ``call``; raises :class:`ToolCallError` (unknown tool, arguments
    that are not a JSON object of the tool's fields)."""
    typ = _TYPES.get(call.name)
    if typ is None:
        raise ToolCallError(f"unknown tool {call.name[:80]!r}; the tools are "
                            f"{', '.join(TOOL_NAMES)}", kind="unknown_tool", call=call)
    try:
        raw = json.loads(call.arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the arguments of {call.name} are not valid JSON ({exc.msg} at "
                            f"char {exc.pos}): {call.arguments[:200]!r}",
                            kind="malformed_json", call=call) from None
    if not isinstance(raw, Mapping):
        raise ToolCallError(f"the arguments of {call.name} must be a JSON object, got "
                            f"{type(raw).__name__}", kind="malformed_arguments",
                            call=call)
    try:
        action: Action = msgspec.convert(raw, typ)
    except msgspec.ValidationError as exc:
        _, props, required = _DESCRIPTIONS[call.name]
        raise ToolCallError(f"bad arguments for {call.name}: {exc}; it takes "
                            f"{', '.join(props)} (required: {', '.join(required) or 'none'})",
                            kind="bad_arguments", call=call) from None
    return action
