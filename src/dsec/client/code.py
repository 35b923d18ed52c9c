"""``sb.run_code(...)``: a stateful Python interpreter per sandbox.

``sb.run_code("x = 41")`` then ``sb.run_code("x + 1").text == "42"``: the code runs in a
kernel process living inside the sandbox (:mod:`dsec.client.code_kernel`, copied in and
started in the background on first use, by whichever client gets there first), so its
variables, imports and open files persist between calls and between client processes,
until :func:`restart` or the sandbox goes. Every call is an ordinary exec of the sandbox
(the kernel's ``run`` command, the code on its stdin), so the sandbox's isolation, user,
cgroup limits, and every door's auth and rate limits apply unchanged: the kernel is
just a process of the sandbox, with no door of its own.

Needs ``python3`` in the image (the ``base`` image is busybox: no python; see
docs/images.md for a Debian image). The result mirrors e2b-code-interpreter's
``Execution``: output, the value of the last expression (``text/plain`` and, where the
object offers them, rich forms such as ``image/png`` for a matplotlib figure), and an
error with its name, value and traceback.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import json
from collections.abc import Sequence
from typing import Protocol

import msgspec

from dsec.errors import CannotRun, InternalError, InvalidArgument
from dsec.wire.spec import ExecResult, SandboxInfo


class AsyncSandbox(Protocol):
    """What the kernel needs of a sandbox (``dsec.client.core.AsyncSandbox``): its id,
    its info and exec. A Protocol, so this module does not import the core (which
    imports it)."""

    id: str
    info: SandboxInfo

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                   stdin: bytes | str | None = None, output_cap: int | None = None
                   ) -> ExecResult: ...

__all__ = ["CodeError", "CodeResult", "Execution", "restart", "run_code"]

KERNEL_SOURCE = (importlib.resources.files("dsec.client") / "code_kernel.py").read_text()
# One directory per kernel version: an upgraded SDK never talks to an older kernel.
KERNEL_DIR = "/tmp/.dsec-code/" + hashlib.sha256(KERNEL_SOURCE.encode()).hexdigest()[:12]
KERNEL_PATH = KERNEL_DIR + "/kernel.py"
EXIT_NOT_INSTALLED = 90
EXIT_NO_KERNEL = 91                  # code_kernel.EXIT_NO_KERNEL
MAX_CODE_BYTES = 1 << 20
# Each run is one exec: its output cap bounds the result (output + display data).
RESULT_CAP_BYTES = 12 << 20
START_WAIT_S = 15.0                  # a kernel's start (python3's import time, loaded box)

# sh: is this kernel version installed? then its run command, the code on stdin.
_RUN = (f'test -f {KERNEL_PATH} || exit {EXIT_NOT_INSTALLED}; '
        f'exec python3 {KERNEL_PATH} run {KERNEL_DIR} "$1"')
# sh: start the kernel (the exec is a background one: it returns at once) and wait until
# its socket is there, so the next run finds it.
_START = (f'python3 {KERNEL_PATH} serve {KERNEL_DIR} </dev/null >/dev/null 2>&1 & '
          f'i=0; while [ ! -S {KERNEL_DIR}/sock ] && [ $i -lt {int(START_WAIT_S * 20)} ]; '
          'do sleep 0.05; i=$((i+1)); done; test -S ' + KERNEL_DIR + '/sock')


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


async def run_code(sb: AsyncSandbox, code: str, *, timeout: float | None = 60.0
                   ) -> Execution:
    """Run ``code`` in the sandbox's kernel (started on first use); see the module."""
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
    # the exec's own timeout: the code's, plus the interrupt grace and the kernel's start
    exec_timeout = None if timeout is None else timeout + 10.0
    for attempt in range(3):
        r = await sb.exec(["sh", "-c", _RUN, "sh", arg], stdin=body, timeout=exec_timeout,
                          output_cap=RESULT_CAP_BYTES)
        if r.exit_code == 0 and not r.timed_out:
            try:
                return msgspec.json.decode(r.stdout, type=Execution)
            except msgspec.DecodeError as exc:
                raise InternalError(f"the code kernel in {sb.id} answered something that is "
                                    f"not a result ({exc}): {r.stdout[:200]!r}") from exc
        if r.exit_code == EXIT_NOT_INSTALLED and attempt < 2:
            await _install(sb)
            await _start(sb)
        elif r.exit_code == EXIT_NO_KERNEL and attempt < 2:
            await _start(sb)
        else:
            break
    _refuse(sb, r.exit_code, r.stderr)
    raise AssertionError("unreachable")


async def restart(sb: AsyncSandbox) -> None:
    """Stop the sandbox's kernel: its variables are gone; the next run starts a fresh
    one."""
    r = await sb.exec(["sh", "-c", (f"test -f {KERNEL_PATH} || exit 0; "
                                    f"exec python3 {KERNEL_PATH} stop {KERNEL_DIR}")],
                      timeout=30.0)
    if r.exit_code != 0:
        _refuse(sb, r.exit_code, r.stderr)


async def _install(sb: AsyncSandbox) -> None:
    # written by exec (stdin) rather than files.write: one call, and the same user and
    # mode rules as the kernel's own execs
    r = await sb.exec(["sh", "-c", (f"umask 077; mkdir -p {KERNEL_DIR} && cat > "
                                    f"{KERNEL_PATH}.$$ && mv {KERNEL_PATH}.$$ {KERNEL_PATH}")],
                      stdin=KERNEL_SOURCE.encode(), timeout=30.0)
    if r.exit_code != 0:
        _refuse(sb, r.exit_code, r.stderr)


async def _start(sb: AsyncSandbox) -> None:
    r = await sb.exec(["sh", "-c", "command -v python3 >/dev/null || exit 127; " + _START],
                      timeout=START_WAIT_S + 10)
    if r.exit_code != 0:
        _refuse(sb, r.exit_code, r.stderr)


def _refuse(sb: AsyncSandbox, code: int, stderr: bytes) -> None:
    if code == 127:
        raise CannotRun(f"run_code needs python3 in the sandbox, and {sb.id}'s image "
                        f"({sb.info.spec.image!r}) has none: use an image with python3 "
                        "(e.g. a Debian one, docs/images.md)", sandbox_id=sb.id)
    raise InternalError(f"the code kernel in {sb.id} failed (exit {code}): "
                        f"{stderr[-500:].decode(errors='replace')}", sandbox_id=sb.id)
