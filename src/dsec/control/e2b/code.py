"""e2b-code-interpreter's API (the sandbox's port 49999) on dsec's run_code kernel (pure:
no I/O).

The stock ``e2b_code_interpreter`` SDK speaks plain HTTP/JSON to port 49999 of a sandbox
(through the same ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers, or a
``49999-{id}.{domain}`` host):

- ``POST /execute`` ``{"code", "context_id", "language", "env_vars"}``: ``200`` and a
  stream of NDJSON events, one per line: ``{"type": "stdout"|"stderr", "text",
  "timestamp"}`` (Unix ns), ``{"type": "result", "text", "html", "png", ...,
  "is_main_result"}``, ``{"type": "error", "name", "value", "traceback"}``, ``{"type":
  "number_of_executions", "execution_count"}``, then ``{"type": "end_of_execution"}``;
- ``POST /contexts`` ``{"language", "cwd"}`` -> ``{"id", "language", "cwd"}``;
  ``GET /contexts`` (a list of those); ``POST /contexts/{id}/restart``;
  ``DELETE /contexts/{id}``.

dsec runs the code in :mod:`dsec.code`'s kernel: the default context is the kernel
``sb.run_code`` of dsec's SDK reaches with the same API key (same variables), a created
context is a kernel of its own (``context=`` its id). Only Python: that is the kernel.
Output streams as the code writes it (the kernel's stream mode: ``stdout``/``stderr``
events while it runs), then the results, the error and the count when it is done.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dsec.code import CodeResult, Execution
from dsec.errors import InvalidArgument

__all__ = ["CONTEXT_DIR", "MAX_CONTEXT_RECORD", "check_context_id", "check_language",
           "context_record", "execute_lines", "failure_line", "output_line", "parse_context"]

#: Where created contexts are recorded, in the sandbox itself (one small JSON file each):
#: every apiserver replica and a restarted one list the same contexts, and they go with
#: the sandbox. What a process of the sandbox writes there only names a kernel of its own
#: sandbox (a kernel answers holders of the caller's key-derived token, never a name).
CONTEXT_DIR = "/tmp/.dsec-e2b-contexts"
MAX_CONTEXT_RECORD = 8 << 10
MAX_CONTEXTS = 64
_ID = re.compile(r"^ctx-[0-9a-f]{16}$")

# dsec's display data (MIME type -> content) -> e2b-code-interpreter's Result fields
_FORMATS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown",
            "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
            "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
            "application/javascript": "javascript"}


def check_language(language: Any) -> str:
    """``python`` (also when none is named), or invalid_argument: dsec's kernel runs
    Python only."""
    if language is None or language == "python":
        return "python"
    raise InvalidArgument(f"language {str(language)[:40]!r} is not supported by dsec's E2B "
                          "layer: its code interpreter is dsec's Python kernel (run other "
                          "languages with commands.run)", field="language")


def check_context_id(cid: Any) -> str:
    if not isinstance(cid, str) or not _ID.match(cid):
        raise InvalidArgument(f"context id {str(cid)[:40]!r} is not one this layer made "
                              "(ctx-<16 hex>)", field="context_id")
    return cid


def context_record(cid: str, language: str, cwd: str) -> dict[str, str]:
    return {"id": cid, "language": language, "cwd": cwd}


def parse_context(raw: bytes, cid: str) -> dict[str, str] | None:
    """A context's record read back from the sandbox (hostile bytes: bounded, checked);
    None when it is not a record of ``cid``."""
    if len(raw) > MAX_CONTEXT_RECORD:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("id") != cid:
        return None
    lang, cwd = rec.get("language"), rec.get("cwd")
    if not isinstance(lang, str) or not isinstance(cwd, str):
        return None
    return context_record(cid, lang, cwd)


def _result(r: CodeResult) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": r.is_main_result}
    extra: dict[str, str] = {}
    for mime, value in r.data.items():
        name = _FORMATS.get(mime)
        if name is None:
            extra[mime] = value
        elif name == "json":
            try:
                out["json"] = json.loads(value)
            except ValueError:
                out["json"] = value
        else:
            out[name] = value
    if extra:
        out["extra"] = extra
    return out


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def output_line(stream: str, text: str, *, now_ns: int) -> bytes:
    """One ``stdout``/``stderr`` event, sent while the code runs."""
    return _line({"type": stream, "text": text, "timestamp": now_ns})


def failure_line(name: str, message: str) -> bytes:
    """An ``error`` event for a run that failed once its answer had begun (the status
    was sent): the kernel's exec broke, the sandbox went away."""
    return _line({"type": "error", "name": name, "value": message, "traceback": ""})


def execute_lines(ex: Execution, now_ns: int, *, output: bool = True) -> list[bytes]:
    """The NDJSON lines of one run, in the order e2b-code-interpreter's server sends
    them: output (unless it was streamed already: ``output=False``), results, the
    error, the execution count, the end."""
    events: list[dict[str, Any]] = []
    if ex.stdout and output:
        events.append({"type": "stdout", "text": ex.stdout, "timestamp": now_ns})
    if ex.stderr and output:
        events.append({"type": "stderr", "text": ex.stderr, "timestamp": now_ns})
    events += [_result(r) for r in ex.results]
    if ex.error is not None:
        events.append({"type": "error", "name": ex.error.name, "value": ex.error.value,
                       "traceback": ex.error.traceback})
    events.append({"type": "number_of_executions", "execution_count": ex.execution_count})
    events.append({"type": "end_of_execution"})
    return [_line(e) for e in events]
