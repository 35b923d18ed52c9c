"""``sb.run_code(...)``: a stateful Python interpreter per sandbox (the protocol of its
kernel and the driver over an injected ``exec``; the SDK's ``sb.run_code`` and the E2B
layer's code interpreter, port 49999, both run it: ``dsec.client.code`` re-exports it).

``sb.run_code("x = 41")`` then ``sb.run_code("x + 1").text == "42"``: the code runs in a
kernel process living inside the sandbox (``dsec/code/kernel.py``, run as
``python3 -c SOURCE`` and started in the background on first use, by whichever client
gets there first), so its variables, imports and open files persist between calls and
between client processes with the same API key, until :func:`restart` or the sandbox
goes. Every call is an ordinary exec of the sandbox (the kernel's ``run`` command, the
code on stdin), so the sandbox's isolation, user, cgroup limits, and every door's auth
and rate limits apply unchanged. The kernel answers only holders of its token (see
:func:`_token`), from a directory only its user made (red team 19, B1/B2; docs/sdk.md).

Needs ``python3`` in the image (the ``base`` image is busybox: no python; see
docs/images.md for a Debian image). The result mirrors e2b-code-interpreter's
``Execution``: output, the value of the last expression (``text/plain`` and, where the
object offers them, rich forms such as ``image/png`` for a matplotlib figure), and an
error with its name, value and traceback.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib.resources
import json
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Literal, Protocol

import msgspec

from dsec.errors import CannotRun, InternalError, InvalidArgument
from dsec.wire.spec import ExecChunk, ExecResult, SandboxInfo


class AsyncSandbox(Protocol):
    """What the kernel needs of a sandbox (``dsec.client.core.AsyncSandbox``): its id,
    its info and exec. A Protocol, so this module does not import the core (which
    imports it)."""

    id: str
    info: SandboxInfo

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                   stdin: bytes | str | None = None, output_cap: int | None = None
                   ) -> ExecResult: ...

__all__ = ["CodeError", "CodeResult", "Execution", "StreamingSandbox", "restart", "run_code",
           "run_code_stream"]

KERNEL_SOURCE = (importlib.resources.files("dsec.code") / "kernel.py").read_text()
_VERSION = hashlib.sha256(KERNEL_SOURCE.encode()).hexdigest()[:12]
# The kernel's source is never a file in the sandbox: every exec runs it as
# ``python3 -c KERNEL_SOURCE ...`` (argv: ~14 KB a call), so there is nothing to plant.
# Each kernel's directory is KERNEL_DIR + "-" + a digest of its token (one directory per
# kernel version and caller context; see _token): made by the kernel's own user with
# mkdir (never -p), mode 0700, and checked (owner, mode, not a symlink, in a sticky
# root-owned /tmp) before every use; it holds only the socket and a lock.
KERNEL_DIR = "/tmp/.dsec-code-" + _VERSION
# Where kernel.py lived before red team 19 (B1): nothing reads or runs it now.
KERNEL_PATH = KERNEL_DIR + "/kernel.py"
EXIT_NO_KERNEL = 91                  # code_kernel.EXIT_NO_KERNEL
EXIT_BAD_DIR = 92                    # code_kernel.EXIT_BAD_DIR: not ours, refused
MAX_CODE_BYTES = 1 << 20
# Each run is one exec: its output cap bounds the result (output + display data).
RESULT_CAP_BYTES = 12 << 20
START_WAIT_S = 15.0                  # code_kernel.START_WAIT_S

# sh: python3 there? then the kernel's command ($1 the source, the rest its arguments).
_KERNEL = 'command -v python3 >/dev/null || exit 127; exec python3 -c "$@"'
# A secret of this process, for clients with no API key (an in-memory transport).
_LOCAL_SECRET = secrets.token_bytes(32)


def _token(sb: AsyncSandbox, key: str | None = None, context: str = "") -> str:
    """The kernel's secret: who holds it reaches the kernel (``run``), nobody else (a
    less-privileged user, an exec confined with ``hide``, any other process of the
    sandbox: the kernel refuses a connection without it, and proves it holds it to the
    client, bound to its pid, before the client sends anything). Derived from the
    client's API key, so every client process with that key shares the sandbox's kernel
    (the CLI sees the SDK's variables) and no one else does; it is sent on each exec's
    stdin and kept only in the kernel's memory, never in the sandbox's files, argv or
    environment. The context (the exec's default user, no ``hide``) is part of the
    message: a kernel per caller context. ``key``: the caller's API key (default: the
    SDK client's, ``sb._c._key``); ``context``: a named interpreter beside the default
    one (E2B's code contexts), its own kernel with its own variables."""
    if key is None:
        key = getattr(getattr(sb, "_c", None), "_key", "") or ""
    secret = key.encode() if key else _LOCAL_SECRET
    ctx = f"|ctx={context}" if context else ""
    msg = f"dsec-run-code|{_VERSION}|{sb.id}|user=|hide={ctx}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _kernel_dir(token: str) -> str:
    return KERNEL_DIR + "-" + hashlib.sha256(token.encode()).hexdigest()[:16]


class CodeResult(msgspec.Struct, kw_only=True):
    """One displayed value: ``data`` maps MIME types to content (``text/plain`` always;
    binary forms such as ``image/png`` base64). ``is_main_result``: the value of the
    code's last expression (others come from ``display(obj)`` or open matplotlib
    figures)."""

    data: dict[str, str] = {}
    is_main_result: bool = False

    @property
    def text(self) -> str | None:
        return self.data.get("text/plain")

    @property
    def png(self) -> bytes | None:
        """The ``image/png`` form, decoded."""
        v = self.data.get("image/png")
        return None if v is None else base64.b64decode(v)

    @property
    def html(self) -> str | None:
        return self.data.get("text/html")


class CodeError(msgspec.Struct, kw_only=True):
    """An exception the code raised: ``name`` (``ZeroDivisionError``), ``value`` (its
    message) and the ``traceback`` of the user's frames."""

    name: str
    value: str
    traceback: str = ""


class Execution(msgspec.Struct, kw_only=True):
    """What one :func:`run_code` did. ``text`` is the last expression's ``text/plain``
    (``None`` when the code ends in a statement or its value is ``None``)."""

    stdout: str = ""
    stderr: str = ""
    results: list[CodeResult] = []
    error: CodeError | None = None
    execution_count: int = 0
    duration_s: float = 0.0
    timed_out: bool = False

    @property
    def text(self) -> str | None:
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


async def run_code(sb: AsyncSandbox, code: str, *, timeout: float | None = 60.0,
                   key: str | None = None, context: str = "") -> Execution:
    """Run ``code`` in the sandbox's kernel (started on first use); see the module.
    ``key``/``context`` pick the kernel (:func:`_token`)."""
    if not isinstance(code, str):
        raise InvalidArgument(f"code must be a str, not {type(code).__name__}", field="code")
    body = json.dumps({"code": code}).encode()
    if len(body) > MAX_CODE_BYTES:
        raise InvalidArgument(f"code of {len(body)} bytes (JSON) is more than "
                              f"{MAX_CODE_BYTES} bytes: write it to a file and run that",
                              field="code", limit=MAX_CODE_BYTES)
    if timeout is not None and not timeout > 0:
        raise InvalidArgument(f"timeout={timeout!r} must be > 0 seconds or None",
                              field="timeout")
    arg = "none" if timeout is None else repr(float(timeout))
    token = _token(sb, key, context)
    d = _kernel_dir(token)
    body = json.dumps({"token": token, "code": code}).encode()
    # the exec's own timeout: the code's, plus the interrupt grace and the kernel's start
    exec_timeout = None if timeout is None else timeout + 10.0
    for attempt in range(3):
        r = await sb.exec(["sh", "-c", _KERNEL, "sh", KERNEL_SOURCE, "run", d, arg],
                          stdin=body, timeout=exec_timeout, output_cap=RESULT_CAP_BYTES)
        if r.exit_code == 0 and not r.timed_out:
            try:
                return msgspec.json.decode(r.stdout, type=Execution)
            except msgspec.DecodeError as exc:
                raise InternalError(f"the code kernel in {sb.id} answered something that is "
                                    f"not a result ({exc}): {r.stdout[:200]!r}") from exc
        if r.exit_code == EXIT_NO_KERNEL and attempt < 2:
            await _start(sb, d, token)
        else:
            break
    _refuse(sb, r.exit_code, r.stderr)
    raise AssertionError("unreachable")


class StreamingSandbox(AsyncSandbox, Protocol):
    """A sandbox whose exec also streams (the ``exec_stream`` row): output chunks as they
    come, then the result."""

    def exec_stream(self, cmd: Sequence[str], *, timeout: float | None, stdin: bytes,
                    output_cap: int) -> AsyncIterator[ExecChunk | ExecResult]: ...


async def run_code_stream(sb: StreamingSandbox, code: str, *,
                          timeout: float | None = 60.0, key: str | None = None,
                          context: str = ""
                          ) -> AsyncGenerator[tuple[str, str] | Execution, None]:
    """:func:`run_code`, with the output as the code writes it: ``("stdout", text)`` /
    ``("stderr", text)`` pieces while it runs (the kernel's stream mode), then the
    :class:`Execution` (which holds all of the output too). The kernel's lines are
    checked: anything but an output piece or the result is an error."""
    if not isinstance(code, str):
        raise InvalidArgument(f"code must be a str, not {type(code).__name__}", field="code")
    if len(json.dumps({"code": code}).encode()) > MAX_CODE_BYTES:
        raise InvalidArgument(f"code of more than {MAX_CODE_BYTES} bytes (JSON): write it to "
                              "a file and run that", field="code", limit=MAX_CODE_BYTES)
    if timeout is not None and not timeout > 0:
        raise InvalidArgument(f"timeout={timeout!r} must be > 0 seconds or None",
                              field="timeout")
    arg = "none" if timeout is None else repr(float(timeout))
    token = _token(sb, key, context)
    d = _kernel_dir(token)
    body = json.dumps({"token": token, "code": code, "stream": True}).encode()
    exec_timeout = None if timeout is None else timeout + 10.0
    for attempt in range(3):
        buf = b""
        answer: bytes | None = None
        final: ExecResult | None = None
        err = b""
        async for item in sb.exec_stream(
                ["sh", "-c", _KERNEL, "sh", KERNEL_SOURCE, "run", d, arg], stdin=body,
                timeout=exec_timeout, output_cap=RESULT_CAP_BYTES):
            if isinstance(item, ExecResult):
                final = item
                continue
            if item.stream == "stderr":
                err = (err + item.data)[-4096:]
                continue
            buf += item.data
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                piece = _piece(line)
                if piece is None:
                    answer = line
                else:
                    yield piece
        if final is None:
            raise InternalError(f"the code kernel's exec in {sb.id} ended without a result")
        if final.exit_code == 0 and not final.timed_out and answer is not None:
            try:
                yield msgspec.json.decode(answer, type=Execution)
            except msgspec.DecodeError as exc:
                raise InternalError(f"the code kernel in {sb.id} answered something that is "
                                    f"not a result ({exc}): {answer[:200]!r}") from exc
            return
        if final.exit_code == EXIT_NO_KERNEL and attempt < 2:
            await _start(sb, d, token)
        else:
            break
    assert final is not None
    _refuse(sb, final.exit_code, err or final.stderr)


class _Piece(msgspec.Struct):
    out: Literal["stdout", "stderr"]
    text: str


def _piece(line: bytes) -> tuple[str, str] | None:
    """An output line of the kernel's stream mode as ``(stream, text)``; None for the
    result line."""
    if not line.startswith(b'{"out"'):
        return None
    try:
        p = msgspec.json.decode(line, type=_Piece)
    except msgspec.DecodeError as exc:
        raise InternalError(f"the code kernel sent a malformed output line ({exc})") from exc
    return p.out, p.text


async def restart(sb: AsyncSandbox, *, key: str | None = None, context: str = "") -> None:
    """Stop the sandbox's kernel: its variables are gone; the next run starts a fresh
    one."""
    r = await sb.exec(["sh", "-c", _KERNEL, "sh", KERNEL_SOURCE, "stop",
                       _kernel_dir(_token(sb, key, context))], timeout=30.0)
    if r.exit_code != 0:
        _refuse(sb, r.exit_code, r.stderr)


async def _start(sb: AsyncSandbox, d: str, token: str) -> None:
    # the token on stdin: it never touches the sandbox's files, argv or environment
    r = await sb.exec(["sh", "-c", _KERNEL, "sh", KERNEL_SOURCE, "start", d],
                      stdin=(token + "\n").encode(), timeout=START_WAIT_S + 10)
    if r.exit_code != 0:
        _refuse(sb, r.exit_code, r.stderr)


def _refuse(sb: AsyncSandbox, code: int, stderr: bytes) -> None:
    if code == 127:
        raise CannotRun(f"run_code needs python3 in the sandbox, and {sb.id}'s image "
                        f"({sb.info.spec.image!r}) has none: use an image with python3 "
                        "(e.g. a Debian one, docs/images.md)", sandbox_id=sb.id)
    if code == EXIT_BAD_DIR:
        raise CannotRun(f"run_code in {sb.id} refused its kernel: "
                        f"{stderr[-500:].decode(errors='replace').strip()}", sandbox_id=sb.id)
    raise InternalError(f"the code kernel in {sb.id} failed (exit {code}): "
                        f"{stderr[-500:].decode(errors='replace')}", sandbox_id=sb.id)
