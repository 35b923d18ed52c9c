"""``sb.processes`` and ``sb.pty``: background processes and terminals (issue 19).

A process started with :meth:`AsyncProcesses.start` runs in the sandbox's process table on
its edge (``dsec.edge.processes``): its output is kept in a bounded ring, so any client
can :meth:`~AsyncProcesses.connect` to it later by pid and read what it printed, then
follow it live. A :class:`AsyncProcessHandle` waits for it, iterates its output, calls
``on_stdout``/``on_stderr`` as output arrives, writes its stdin, signals it and resizes
its terminal. ``sb.pty.create()`` is a process on a terminal inside the sandbox.

Every call is one operation of the catalogue (``process_*``, ``pty_resize``), so the
gateway and REST serve them alike and check the key's role on the sandbox's project.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal as _signal
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Protocol

import msgspec

from dsec.client.parts import Runs, SandboxPart, closing
from dsec.errors import InvalidArgument, RemoteProtocolError, RequestTimeout
from dsec.wire import ops
from dsec.wire.calls import ExecCall, SandboxRef
from dsec.wire.process import (
    ProcessInfo,
    ProcessInput,
    ProcessRef,
    ProcessRunItem,
    ProcessSignal,
    PtyResize,
    PtySize,
)
from dsec.wire.spec import MAX_PROCESS_INPUT_BYTES, ExecChunk, ExecRequest, ExecResult

__all__ = [
    "AsyncProcessHandle",
    "AsyncProcesses",
    "AsyncPty",
    "OutputCallback",
    "ProcessHandle",
    "Processes",
    "Pty",
]

OutputCallback = Callable[[bytes], object]

#: output a handle keeps for :meth:`AsyncProcessHandle.wait`'s result, per stream
KEEP_OUTPUT_BYTES = 16 << 20


# What this module needs of its sandbox (client.parts, plus ``processes`` for ``pty``):
# client.core builds sandboxes with ``processes``/``pty`` from here, so importing it back
# (even for annotations) would be a cycle.
class _Sandbox(SandboxPart, Protocol):
    """A sandbox of the async SDK (``dsec.client.core.AsyncSandbox``)."""

    @property
    def processes(self) -> AsyncProcesses: ...


def process_request(cmd: str | Sequence[str], *, pty: PtySize | None = None,
                    tag: str | None = None, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None,
                    timeout: float | None = None, stdin: bool = False) -> ExecRequest:
    """The :class:`ExecRequest` of a process start (pure)."""
    if isinstance(cmd, str):
        argv: tuple[str, ...] = ()
        shell: str | None = cmd
    elif isinstance(cmd, Sequence) and cmd and all(isinstance(a, str) for a in cmd):
        argv, shell = tuple(cmd), None
    else:
        raise InvalidArgument("a command is a shell string or a non-empty list of strings, "
                              f"not {type(cmd).__name__}")
    return ExecRequest(argv=argv, shell=shell, env=dict(env or {}), cwd=cwd, user=user,
                       timeout_s=timeout, pty=pty, tag=tag, stdin_open=stdin)


class AsyncProcessHandle:
    """A process of a sandbox's table: ``pid``, its :class:`ProcessInfo` as of the last
    look (``info``), and what to do with it. ``async for chunk in handle`` yields its
    output (what the ring holds, then live) as :class:`ExecChunk`; :meth:`wait` its end."""

    def __init__(self, sb: _Sandbox, info: ProcessInfo, *,
                 on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None,
                 _items: AsyncGenerator[ExecChunk | ExecResult, None] | None = None,
                 ) -> None:
        self._sb = sb
        self.info = info
        self.pid: int = info.pid
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self._result: ExecResult | None = None
        self._follow: asyncio.Task[ExecResult] | None = None
        if _items is not None or on_stdout is not None or on_stderr is not None:
            self._follow = asyncio.ensure_future(self._consume(_items))
            # nobody may ever wait() for it: its error (a closed client) is not a warning
            self._follow.add_done_callback(
                lambda t: None if t.cancelled() else t.exception())

    def __repr__(self) -> str:
        return f"ProcessHandle(pid={self.pid}, sandbox={self._sb.id!r})"

    @property
    def exit_code(self) -> int | None:
        """The exit code once known (after :meth:`wait`, or a finished iteration)."""
        if self._result is not None:
            return self._result.exit_code
        return self.info.exit_code

    @property
    def sandbox_id(self) -> str:
        return self._sb.id

    def _ref(self) -> ProcessRef:
        return ProcessRef(id=self._sb.id, pid=self.pid)

    async def stream(self) -> AsyncGenerator[ExecChunk | ExecResult, None]:
        """Every output chunk, then the :class:`ExecResult` (one ``process_connect``)."""
        t = await self._sb._c._transport()
        stream = t.stream(ops.PROCESS_CONNECT, self._ref(), timeout=None)
        async with closing(stream) as items:
            async for item in items:
                if isinstance(item, ExecResult):
                    self._result = item
                yield item

    async def __aiter__(self) -> AsyncIterator[ExecChunk]:
        async with contextlib.aclosing(self.stream()) as items:
            async for item in items:
                if isinstance(item, ExecChunk):
                    yield item

    async def _consume(self, source: AsyncGenerator[ExecChunk | ExecResult, None] | None = None,
                       ) -> ExecResult:
        """Follow it to its end: ``source`` (the rest of the ``process_run`` stream that
        started it), else a new ``process_connect``."""
        out, err = bytearray(), bytearray()
        t_out = t_err = False
        result: ExecResult | None = None
        async with contextlib.aclosing(self.stream() if source is None else source) as items:
            async for item in items:
                if isinstance(item, ExecResult):
                    result = item
                    break
                cb = self.on_stdout if item.stream == "stdout" else self.on_stderr
                if cb is not None:
                    cb(item.data)
                buf = out if item.stream == "stdout" else err
                room = KEEP_OUTPUT_BYTES - len(buf)
                if len(item.data) > room:
                    if item.stream == "stdout":
                        t_out = True
                    else:
                        t_err = True
                buf += item.data[:max(room, 0)]
        assert result is not None
        self._result = msgspec.structs.replace(
            result, stdout=bytes(out), stderr=bytes(err),
            stdout_truncated=result.stdout_truncated or t_out,
            stderr_truncated=result.stderr_truncated or t_err)
        return self._result

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait for the exit: its :class:`ExecResult`, with the output read meanwhile
        (the ring's and the live output: up to 16 MiB per stream kept). ``timeout``
        (seconds): raise :class:`RequestTimeout` if it has not exited by then (it keeps
        running)."""
        if self._follow is None or (self._follow.done() and self._follow.cancelled()):
            self._follow = asyncio.ensure_future(self._consume())
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self._follow)
        except TimeoutError:
            raise RequestTimeout(f"process {self.pid} in sandbox {self._sb.id} did not exit "
                                 f"within {timeout:g} s; it keeps running",
                                 sandbox_id=self._sb.id, pid=self.pid) from None

    async def kill(self, signal: int = _signal.SIGKILL) -> None:
        """Send ``signal`` (SIGKILL by default) to its process group."""
        await self._sb._c.call(ops.PROCESS_SIGNAL, ProcessSignal(
            id=self._sb.id, pid=self.pid, signal=int(signal)))

    async def send_stdin(self, data: bytes | str) -> None:
        """Write to its stdin (started with ``stdin=True``) or its terminal, in order;
        large data goes in 1 MiB writes."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        for i in range(0, max(len(raw), 1), MAX_PROCESS_INPUT_BYTES):
            await self._sb._c.call(ops.PROCESS_INPUT, ProcessInput(
                id=self._sb.id, pid=self.pid, data=raw[i:i + MAX_PROCESS_INPUT_BYTES]))

    async def close_stdin(self) -> None:
        await self._sb._c.call(ops.PROCESS_CLOSE_STDIN, self._ref())

    async def resize(self, cols: int, rows: int) -> None:
        """Its terminal becomes ``cols`` x ``rows`` (PTY processes)."""
        await self._sb._c.call(ops.PTY_RESIZE, PtyResize(id=self._sb.id, pid=self.pid,
                                                          cols=cols, rows=rows))

    async def refresh(self) -> ProcessInfo:
        for p in await self._sb.processes.list():
            if p.pid == self.pid:
                self.info = p
        return self.info


class AsyncProcesses:
    """``sandbox.processes``: start, list and connect to background processes."""

    def __init__(self, sb: _Sandbox) -> None:
        self._sb = sb

    async def start(self, cmd: str | Sequence[str], *, pty: PtySize | None = None,
                    tag: str | None = None, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None,
                    timeout: float | None = None, stdin: bool = False,
                    on_stdout: OutputCallback | None = None,
                    on_stderr: OutputCallback | None = None) -> AsyncProcessHandle:
        """Start ``cmd`` in the background (a string runs in a shell, a list is an argv).
        ``stdin=True`` keeps its stdin open for :meth:`AsyncProcessHandle.send_stdin`;
        ``pty`` runs it on a terminal of that size; ``timeout`` kills it after that many
        seconds (None: never); ``tag`` labels it in :meth:`list`; ``on_stdout`` /
        ``on_stderr`` are called with each piece of output as it arrives."""
        req = process_request(cmd, pty=pty, tag=tag, env=env, cwd=cwd, user=user,
                              timeout=timeout, stdin=stdin)
        return await start_process(self._sb, req, on_stdout=on_stdout, on_stderr=on_stderr)

    async def list(self) -> list[ProcessInfo]:
        """The sandbox's processes started this way, running and ended (oldest first)."""
        return (await self._sb._c.call(ops.PROCESS_LIST, SandboxRef(id=self._sb.id))).items

    async def connect(self, pid: int, *, on_stdout: OutputCallback | None = None,
                      on_stderr: OutputCallback | None = None) -> AsyncProcessHandle:
        """A handle on process ``pid`` (started by any client): iterate it or wait for
        it to read what it printed and what it prints next."""
        for p in await self.list():
            if p.pid == pid:
                return AsyncProcessHandle(self._sb, p, on_stdout=on_stdout,
                                          on_stderr=on_stderr)
        from dsec.errors import NotFound
        raise NotFound(f"sandbox {self._sb.id} has no process {pid} started with "
                       "processes.start (see processes.list())", sandbox_id=self._sb.id,
                       pid=pid)


async def start_process(sb: _Sandbox, req: ExecRequest, *,
                        on_stdout: OutputCallback | None = None,
                        on_stderr: OutputCallback | None = None) -> AsyncProcessHandle:
    """Start ``req`` in ``sb``'s process table: ``process_start``, or, followed from the
    start (a callback given), one ``process_run`` (issue 20) instead of
    ``process_start`` then ``process_connect``: its first item is the entry, the rest
    feeds the callbacks (nothing printed in between is read twice or missed)."""
    call = ExecCall(id=sb.id, req=req)
    if on_stdout is None and on_stderr is None:
        return AsyncProcessHandle(sb, await sb._c.call(ops.PROCESS_START, call))
    t = await sb._c._transport()
    run = t.stream(ops.PROCESS_RUN, call, timeout=None)
    try:
        first = await anext(run)
        if not isinstance(first, ProcessRunItem) or first.started is None:
            raise RemoteProtocolError(f"process_run in sandbox {sb.id} did not answer "
                                      "with the process's entry first")
    except BaseException:
        await _aclose(run)
        raise
    return AsyncProcessHandle(sb, first.started, on_stdout=on_stdout, on_stderr=on_stderr,
                              _items=_chunks(run))


async def _aclose(items: object) -> None:
    aclose = getattr(items, "aclose", None)
    if aclose is not None:
        await aclose()


async def _chunks(run: AsyncIterator[ProcessRunItem | ExecResult],
                  ) -> AsyncGenerator[ExecChunk | ExecResult, None]:
    """The rest of a ``process_run`` stream as ``process_connect`` yields it."""
    try:
        async for item in run:
            yield (ExecChunk(stream=item.stream, data=item.data)
                   if isinstance(item, ProcessRunItem) else item)
    finally:
        await _aclose(run)


class AsyncPty:
    """``sandbox.pty``: interactive terminals inside the sandbox."""

    def __init__(self, sb: _Sandbox) -> None:
        self._sb = sb

    async def create(self, cols: int = 80, rows: int = 24, cmd: str | Sequence[str] = "/bin/sh",
                     *, env: Mapping[str, str] | None = None, cwd: str | None = None,
                     user: str | None = None, timeout: float | None = None,
                     tag: str | None = None,
                     on_data: OutputCallback | None = None) -> AsyncProcessHandle:
        """``cmd`` on a new ``cols`` x ``rows`` terminal (a pty inside the sandbox: its
        controlling terminal, Ctrl-C (``send_stdin(b"\\x03")``) reaching its foreground
        process group). Output arrives on stdout; ``on_data`` is called with each
        piece. A string ``cmd`` is the program (``"/bin/sh"``), not a shell line."""
        argv = [cmd] if isinstance(cmd, str) else list(cmd)
        term = {"TERM": "xterm-256color", **(env or {})}
        return await self._sb.processes.start(argv, pty=PtySize(cols=cols, rows=rows),
                                              env=term, cwd=cwd, user=user,
                                              timeout=timeout, tag=tag, on_stdout=on_data)


# ------------------------------------------------------------------------- sync shells
class ProcessHandle:
    """See :class:`AsyncProcessHandle` (sync; ``for chunk in handle`` iterates output).
    Callbacks run on the client's loop thread, as the output arrives."""

    def __init__(self, client: Runs, a: AsyncProcessHandle) -> None:
        self._c = client
        self._a = a
        self.pid: int = a.pid

    def __repr__(self) -> str:
        return repr(self._a)

    @property
    def info(self) -> ProcessInfo:
        return self._a.info

    @property
    def exit_code(self) -> int | None:
        return self._a.exit_code

    @property
    def sandbox_id(self) -> str:
        return self._a.sandbox_id

    def stream(self) -> Iterator[ExecChunk | ExecResult]:
        agen = self._a.stream()
        try:
            while True:
                try:
                    yield self._c._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._c._run(agen.aclose())

    def __iter__(self) -> Iterator[ExecChunk]:
        for item in self.stream():
            if isinstance(item, ExecChunk):
                yield item

    def wait(self, timeout: float | None = None) -> ExecResult:
        return self._c._run(self._a.wait(timeout))

    def kill(self, signal: int = _signal.SIGKILL) -> None:
        self._c._run(self._a.kill(signal))

    def send_stdin(self, data: bytes | str) -> None:
        self._c._run(self._a.send_stdin(data))

    def close_stdin(self) -> None:
        self._c._run(self._a.close_stdin())

    def resize(self, cols: int, rows: int) -> None:
        self._c._run(self._a.resize(cols, rows))

    def refresh(self) -> ProcessInfo:
        return self._c._run(self._a.refresh())


class Processes:
    """See :class:`AsyncProcesses`."""

    def __init__(self, client: Runs, a: AsyncProcesses) -> None:
        self._c = client
        self._a = a

    def start(self, cmd: str | Sequence[str], *, pty: PtySize | None = None,
              tag: str | None = None, env: Mapping[str, str] | None = None,
              cwd: str | None = None, user: str | None = None,
              timeout: float | None = None, stdin: bool = False,
              on_stdout: OutputCallback | None = None,
              on_stderr: OutputCallback | None = None) -> ProcessHandle:
        return ProcessHandle(self._c, self._c._run(self._a.start(
            cmd, pty=pty, tag=tag, env=env, cwd=cwd, user=user, timeout=timeout,
            stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr)))

    def list(self) -> list[ProcessInfo]:
        return self._c._run(self._a.list())

    def connect(self, pid: int, *, on_stdout: OutputCallback | None = None,
                on_stderr: OutputCallback | None = None) -> ProcessHandle:
        return ProcessHandle(self._c, self._c._run(self._a.connect(
            pid, on_stdout=on_stdout, on_stderr=on_stderr)))


class Pty:
    """See :class:`AsyncPty`."""

    def __init__(self, client: Runs, a: AsyncPty) -> None:
        self._c = client
        self._a = a

    def create(self, cols: int = 80, rows: int = 24, cmd: str | Sequence[str] = "/bin/sh",
               *, env: Mapping[str, str] | None = None, cwd: str | None = None,
               user: str | None = None, timeout: float | None = None,
               tag: str | None = None,
               on_data: OutputCallback | None = None) -> ProcessHandle:
        return ProcessHandle(self._c, self._c._run(self._a.create(
            cols, rows, cmd, env=env, cwd=cwd, user=user, timeout=timeout, tag=tag,
            on_data=on_data)))
