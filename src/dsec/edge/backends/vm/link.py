"""The host's end of the guest agent's channel (virtio-serial, via QEMU's chardev socket).

The guest is hostile: everything it sends is bounded and validated here before the
backend uses it. Frames are capped at the agent protocol's ``DEFAULT_MAX_FRAME``; bodies
decode into :mod:`.agentproto`'s structs (msgspec rejects anything else); an ERROR from
the agent becomes one of the few error classes the agent may use (``ERROR_CODES``), its
message cut and labelled as the guest's, never a class of the guest's choosing (a guest
answering ``sandbox_not_found`` or ``overloaded`` must not steer the node); sizes, counts
and output lengths are checked against what was asked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from dsec.aether.connection import Connection
from dsec.aether.transport import connect
from dsec.edge.backends.vm import agentproto as ap
from dsec.edge.backends.vm.qemu import unix_path
from dsec.errors import (
    BackendError,
    CannotRun,
    Conflict,
    ConnectFailed,
    DsecError,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    RemoteProtocolError,
    ResourceExhausted,
    Timeout,
)
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult, FileInfo

__all__ = ["AgentLink", "GuestError"]

_T = TypeVar("_T")

_BY_CODE: dict[str, type[DsecError]] = {
    "invalid_argument": InvalidArgument, "not_found": NotFound, "conflict": Conflict,
    "permission_denied": PermissionDenied, "payload_too_large": PayloadTooLarge,
    "resource_exhausted": ResourceExhausted,
}
MAX_GUEST_MESSAGE = 512
#: slack over an exec's own timeout before the host gives up on the agent's answer
EXEC_SLACK_S = 10.0
#: how long a call that is not an exec may take (a stuck guest is a dead one)
CALL_TIMEOUT_S = 30.0
#: replies shorter than asked, not at EOF, one read may get before it fails. The agent
#: fills each reply (it loops on pread) unless the file changes under it; a guest that
#: answers a byte at a time would turn one read_file into a call per byte.
MAX_SHORT_READS = 8
#: frames for ended streams the guest may send per call of ours before the link is cut
#: (late chunks of a cancelled exec_stream or diff); any for a stream never opened cut it
#: at once (Connection.limit_late_frames). The link re-dials on the next call.
LATE_FRAMES_PER_CALL = 1024


class GuestError(BackendError):
    """The guest agent failed in a way that is not the caller's mistake."""


def _guest_error(exc: DsecError, what: str) -> DsecError:
    """``exc`` as decoded from the agent's ERROR, re-made as a class the agent may use."""
    msg = str(exc.message if hasattr(exc, "message") else exc)[:MAX_GUEST_MESSAGE]
    if exc.code == "cannot_run":    # the program, user or cwd is missing: the caller's
        code = getattr(exc, "detail", {}).get("exit_code")   # 127 or 126, nothing else
        return CannotRun(f"{what}: {msg}", exit_code=code if code in (126, 127) else 126)
    cls = _BY_CODE.get(exc.code, GuestError)
    return cls(f"{what}: {msg}")


class AgentLink:
    """One Aether connection to the agent of sandbox ``sid``."""

    def __init__(self, conn: Connection, sid: str) -> None:
        self.conn = conn
        self.sid = sid

    @classmethod
    async def open(cls, path: str, sid: str, *, timeout: float) -> AgentLink:
        """Dial the chardev socket at ``path`` and wait for ``hello`` (the guest may still
        be booting: virtio-serial holds the bytes until the agent opens its port, and a
        hello is retried in case the first was read before the agent was listening)."""
        deadline = time.monotonic() + timeout
        try:
            with unix_path(path) as short:
                conn = await connect("unix:" + short, timeout=timeout,
                                     max_frame=ap.DEFAULT_MAX_FRAME)
        except ConnectFailed as exc:
            raise BackendError(f"sandbox {sid}: cannot reach the guest agent's channel "
                               f"{path}: {exc}") from exc
        conn.limit_late_frames(LATE_FRAMES_PER_CALL)
        link = cls(conn, sid)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"sandbox {sid}: the guest agent did not answer hello "
                                  f"within {timeout:.0f}s (guest kernel or agent failed to "
                                  "start; see the console log)")
                try:
                    link.hello_reply = await link.call("hello", None, ap.Hello,
                                                       timeout=min(left, 3.0))
                    break
                except Timeout:
                    continue
        except BaseException:
            await conn.close("hello failed")
            raise
        if link.hello_reply.version != ap.PROTOCOL_VERSION:
            await conn.close("protocol version")
            raise GuestError(f"sandbox {sid}: the guest agent speaks protocol "
                             f"{link.hello_reply.version}, this host "
                             f"{ap.PROTOCOL_VERSION}; rebuild the guest initramfs")
        return link

    hello_reply: ap.Hello

    async def close(self) -> None:
        await self.conn.close("host closes")

    @property
    def closed(self) -> bool:
        return self.conn.closed

    async def call(self, method: str, body: Any, rtype: type[_T], *,
                   timeout: float = CALL_TIMEOUT_S) -> _T:
        # The deadline is ours (asyncio.timeout), not the connection's: then every
        # DsecError out of conn.call on an open connection came from an ERROR frame the
        # guest wrote - which may claim any code, "request_timeout" and "overloaded" too.
        try:
            async with asyncio.timeout(timeout):
                out = await self.conn.call(method, body, response_type=rtype)
        except TimeoutError:
            raise Timeout(f"sandbox {self.sid}: the guest agent did not answer {method} "
                          f"within {timeout:g}s") from None
        except DsecError as exc:
            raise self._mapped(exc, method) from None
        if not isinstance(out, rtype):  # pragma: no cover - msgspec guarantees it
            raise GuestError(f"sandbox {self.sid}: {method} reply of the wrong type")
        return out

    def _mapped(self, exc: DsecError, method: str) -> DsecError:
        if self.conn.closed:
            return GuestError(f"sandbox {self.sid}: lost the guest agent during {method} "
                              f"(the guest died or broke the channel): "
                              f"{str(exc)[:MAX_GUEST_MESSAGE]}")
        if isinstance(exc, RemoteProtocolError):
            return GuestError(f"sandbox {self.sid}: the guest agent broke the protocol in "
                              f"{method}: {str(exc)[:MAX_GUEST_MESSAGE]}")
        return _guest_error(exc, f"sandbox {self.sid}: {method} in the guest")

    # -- exec -------------------------------------------------------------------------
    async def exec(self, req: ExecRequest) -> ExecResult:
        timeout = 24 * 3600.0 if req.timeout_s is None else req.timeout_s + EXEC_SLACK_S
        res = await self.call("exec", req, ExecResult, timeout=timeout)
        return checked_result(res, req)

    async def exec_stream(self, req: ExecRequest) -> AsyncIterator[ExecChunk | ExecResult]:
        timeout = (req.timeout_s + EXEC_SLACK_S) if req.timeout_s is not None else None
        cap = req.output_cap_bytes
        seen = {"stdout": 0, "stderr": 0}
        over = {"stdout": False, "stderr": False}
        try:
            async with asyncio.timeout(timeout), self.conn.stream(
                    "exec_stream", req, item_type=ExecChunk, response_type=ExecResult) as st:
                async for chunk in st:
                    n = seen[chunk.stream]
                    if n >= cap:
                        over[chunk.stream] = True
                        continue
                    data = chunk.data[:cap - n]
                    if len(data) < len(chunk.data):
                        over[chunk.stream] = True
                    seen[chunk.stream] = n + len(data)
                    yield ExecChunk(stream=chunk.stream, data=data)
                res = st.result
        except TimeoutError:
            raise Timeout(f"sandbox {self.sid}: the guest agent did not end exec_stream "
                          f"within {timeout:g}s") from None
        except DsecError as exc:
            raise self._mapped(exc, "exec_stream") from None
        res = checked_result(res, req)
        res.stdout = res.stderr = b""
        res.stdout_truncated = res.stdout_truncated or over["stdout"]
        res.stderr_truncated = res.stderr_truncated or over["stderr"]
        yield res

    # -- files ------------------------------------------------------------------------
    async def read(self, path: str, offset: int, length: int | None, *,
                   max_bytes: int) -> bytes:
        """The bytes of ``path`` from ``offset`` (all of it, or ``length``), at most
        ``max_bytes`` (PayloadTooLarge beyond: never buffered whole)."""
        want = max_bytes + 1 if length is None else min(length, max_bytes + 1)
        out = bytearray()
        short = 0
        while len(out) < want:
            n = min(ap.MAX_READ, want - len(out))
            r = await self.call("read", ap.ReadRequest(path=path, offset=offset + len(out),
                                                       length=n), ap.ReadResult)
            if len(r.data) > n:
                raise GuestError(f"sandbox {self.sid}: the guest agent returned "
                                 f"{len(r.data)} bytes for a read of {n}")
            out += r.data
            if r.eof or not r.data:
                break
            if len(r.data) < n:
                # Each call must make progress: at most MAX_SHORT_READS short replies,
                # then ceil(want / MAX_READ) full ones bound the calls of one read.
                short += 1
                if short > MAX_SHORT_READS:
                    raise GuestError(
                        f"sandbox {self.sid}: the guest agent answered {short} reads of "
                        f"{path} short of what was asked without reaching its end (a "
                        "broken or hostile agent); the read was given up")
        if len(out) > max_bytes:
            raise PayloadTooLarge(f"file {path} in sandbox {self.sid} is larger than "
                                  f"{max_bytes} bytes; read it in ranges (offset/length)",
                                  limit=max_bytes)
        return bytes(out)

    async def write(self, path: str, data: bytes, *, mode: int, append: bool) -> None:
        step = ap.MAX_READ
        first = True
        for i in range(0, max(len(data), 1), step):
            await self.call("write", ap.WriteRequest(
                path=path, data=data[i:i + step], mode=mode, append=append or not first),
                ap.WriteResult)
            first = False

    async def list(self, path: str, *, limit: int = 10000) -> list[FileInfo]:
        r = await self.call("list", ap.ListRequest(path=path, limit=limit), ap.ListResult)
        if len(r.entries) > limit:
            raise GuestError(f"sandbox {self.sid}: the guest agent listed "
                             f"{len(r.entries)} entries, over the {limit} asked")
        return r.entries


def checked_result(res: ExecResult, req: ExecRequest) -> ExecResult:
    """An agent's ExecResult held to what was asked (pure): output within the cap
    (cut and marked truncated beyond), a sane exit code, no pid for a foreground exec."""
    cap = req.output_cap_bytes
    if len(res.stdout) > cap:
        res.stdout, res.stdout_truncated = res.stdout[:cap], True
    if len(res.stderr) > cap:
        res.stderr, res.stderr_truncated = res.stderr[:cap], True
    if not -(1 << 31) <= res.exit_code < (1 << 31):
        res.exit_code = -1
    if not req.background:
        res.pid = None
    if not (0 <= res.duration_s < 1e7):
        res.duration_s = 0.0
    return res
