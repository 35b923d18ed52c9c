"""Processes and terminals (issue 19): the wire types of the ``process_*`` rows.

A sandbox's *process table* lives on its edge (``dsec.edge.processes``): a command started
with ``process_start`` runs in the background, its output kept in a bounded ring (the
newest bytes; what fell off the front is counted in ``output_dropped``) for as long as the
table keeps the entry, after its exit too, so another client can ``process_connect`` later
and read it (the ring replayed, then live output until the exit). ``process_input`` writes
to its stdin (kept a pipe with ``ExecRequest.stdin_open``, or the terminal of a PTY
process, ``ExecRequest.pty``), ``process_signal`` signals its process group, ``pty_resize``
sets its terminal's size (TIOCSWINSZ; the foreground group gets SIGWINCH).

``process_run`` (issue 20) is ``process_start`` and ``process_connect`` in one call: one
stream whose first item carries the :class:`ProcessInfo` (its pid: other clients connect,
type and signal by it), then the output, then the exit. Its reader going away ends only
the reader, never the process.

``pid`` is the process's pid inside the sandbox (what ``ps`` there shows).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from dsec.errors import InvalidArgument
from dsec.wire.api import ExecStreamLine
from dsec.wire.calls import _Call
from dsec.wire.spec import (
    MAX_PROCESS_INPUT_BYTES,
    MAX_PROCESS_TAG_BYTES,
    MAX_PTY_CELLS,
    PtySize,
    check_id,
    check_pty_size,
)

__all__ = [
    "MAX_PROCESS_INPUT_BYTES",
    "MAX_PROCESS_TAG_BYTES",
    "MAX_PTY_CELLS",
    "ProcessInfo",
    "ProcessInput",
    "ProcessList",
    "ProcessRef",
    "ProcessRunItem",
    "ProcessRunLine",
    "ProcessSignal",
    "PtyResize",
    "PtySize",
]

#: the largest pid a sandbox's pid namespace can hand out (PID_MAX_LIMIT)
_MAX_PID = 4_194_304


def _check_pid(pid: int) -> None:
    if not 1 <= pid <= _MAX_PID:
        raise InvalidArgument(f"pid={pid!r} is not a process id (1..{_MAX_PID})", field="pid")


class ProcessInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of a sandbox's process table."""

    pid: int
    #: the argv list, or the shell string
    cmd: list[str] | str
    cwd: str | None = None
    tag: str | None = None
    pty: bool = False
    started_at: float = 0.0
    running: bool = True
    #: the exit code once it ended (128+N when a signal N killed it)
    exit_code: int | None = None
    #: the signal that killed it, if one did
    signal: int | None = None
    #: stdin is a pipe (or the terminal) that ``process_input`` writes to
    stdin_open: bool = False
    ended_at: float | None = None
    #: output bytes that fell off the front of the ring (a connect no longer sees them)
    output_dropped: int = 0


class ProcessRunItem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One item of ``process_run``'s stream: the first has ``started`` (the process's
    entry, as ``process_start`` answers it), every later one is a piece of output
    (``stream`` + ``data``, as an :class:`~dsec.wire.spec.ExecChunk`).

    One struct rather than ``ProcessInfo | ExecChunk``: msgpack and JSON decoders need
    one type per item (two untagged structs cannot be told apart), and tagging
    ``ExecChunk`` would change every other stream's wire form."""

    started: ProcessInfo | None = None
    stream: Literal["stdout", "stderr"] = "stdout"
    data: bytes = b""


class ProcessRunLine(ExecStreamLine, kw_only=True, omit_defaults=True):
    """One NDJSON line of ``POST /v1/sandboxes/{id}/processes/run``: the first has
    ``started`` (the process's entry), then output lines and the end line, as
    ``exec/stream`` writes them."""

    started: ProcessInfo | None = None


class ProcessList(msgspec.Struct, kw_only=True):
    """``process_list``: the sandbox's process table, oldest first."""

    items: list[ProcessInfo] = []


class ProcessRef(_Call, kw_only=True):
    """One process of sandbox ``id`` (``process_connect``, ``process_close_stdin``)."""

    id: str
    pid: int

    def __post_init__(self) -> None:
        check_id(self.id)
        _check_pid(self.pid)


class ProcessInput(_Call, kw_only=True):
    """``process_input``: ``data`` written to the process's stdin (or its terminal: a
    Ctrl-C is ``b"\\x03"``), in order with earlier writes."""

    id: str
    pid: int
    data: bytes

    def __post_init__(self) -> None:
        check_id(self.id)
        _check_pid(self.pid)
        if len(self.data) > MAX_PROCESS_INPUT_BYTES:
            raise InvalidArgument(
                f"process input is {len(self.data)} bytes, over the "
                f"{MAX_PROCESS_INPUT_BYTES}-byte limit for one write; send it in pieces",
                field="data", size=len(self.data), limit=MAX_PROCESS_INPUT_BYTES)


class ProcessSignal(_Call, kw_only=True):
    """``process_signal``: ``signal`` (1..64) to the process's process group."""

    id: str
    pid: int
    signal: int = 9

    def __post_init__(self) -> None:
        check_id(self.id)
        _check_pid(self.pid)
        if not 1 <= self.signal <= 64:
            raise InvalidArgument(f"signal={self.signal!r} is not a signal number (1..64)",
                                  field="signal")


class PtyResize(_Call, kw_only=True):
    """``pty_resize``: the terminal of PTY process ``pid`` becomes ``cols`` x ``rows``."""

    id: str
    pid: int
    cols: int
    rows: int

    def __post_init__(self) -> None:
        check_id(self.id)
        _check_pid(self.pid)
        check_pty_size(self.cols, self.rows)
