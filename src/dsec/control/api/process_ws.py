"""``GET /v1/sandboxes/{id}/processes/{pid}/ws``: a process (a terminal) over one WebSocket.

What a browser terminal (the dashboard's) or ``websocat`` needs, built from the process
rows' own policies, so the WebSocket enforces exactly what REST and the gateway do:
reading output is ``process_connect`` (reader on the sandbox's project), typing is
``process_input`` (member), resizing ``pty_resize``, signals ``process_signal``.

Framing (docs/api.md, "Processes"):

- client -> server, **binary**: bytes for the process's stdin / terminal (at most
  ``MAX_PROCESS_INPUT_BYTES`` per frame); **text**: one JSON control object:
  ``{"resize": [cols, rows]}``, ``{"signal": N}``, ``{"close_stdin": true}``;
- server -> client, **binary**: output (the ring first, then live; stdout and stderr
  alike, as a terminal shows them); **text**: ``{"exit_code": N, "timed_out": bool}``
  as the last frame, then a normal close (1000), or ``{"error": {"code", "message"}}``
  for a refused control or input (the socket stays open), or before a close with code
  4400 + the HTTP status (4401 unauthenticated, 4403, 4404...) when the socket cannot
  serve at all.

The API key comes in the ``Authorization: Bearer`` header, or as ``?token=KEY`` for
browsers (which cannot set headers on a WebSocket); like any query string it may end up
in access logs, so a dashboard should prefer short-lived keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from dsec.errors import DsecError, InvalidArgument
from dsec.wire import ops
from dsec.wire.process import ProcessInput, ProcessRef, ProcessSignal, PtyResize
from dsec.wire.spec import ExecChunk, ExecResult

if TYPE_CHECKING:
    from dsec.control.api.service import ApiService

__all__ = ["PATH", "attach_route"]

PATH = "/v1/sandboxes/{id}/processes/{pid}/ws"


def _status(exc: DsecError) -> int:
    return int(exc.http_status)


def _error(exc: DsecError) -> str:
    return json.dumps({"error": {"code": exc.code, "message": exc.message}})


def attach_route(service: ApiService) -> WebSocketRoute:
    """The WebSocket route of ``service`` (module docstring)."""
    connect = service.stream_handler(ops.PROCESS_CONNECT)
    send_input = service.handler(ops.PROCESS_INPUT)
    resize = service.handler(ops.PTY_RESIZE)
    signal = service.handler(ops.PROCESS_SIGNAL)
    close_stdin = service.handler(ops.PROCESS_CLOSE_STDIN)

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        client = ws.client.host if ws.client else None
        try:
            auth = ws.headers.get("authorization") or ws.query_params.get("token")
            caller = service.authenticate(auth, client)
            try:
                pid = int(ws.path_params["pid"])
            except ValueError:
                raise InvalidArgument(f"pid {ws.path_params['pid'][:20]!r} is not a number",
                                      field="pid") from None
            ref = ProcessRef(id=ws.path_params["id"], pid=pid)
            stream = await connect(caller, ref)
        except DsecError as exc:
            exc = service.redact(exc)
            with contextlib.suppress(Exception):
                await ws.send_text(_error(exc))
                await ws.close(code=4000 + _status(exc))
            return

        async def pump_out() -> None:
            try:
                async for item in stream:
                    if isinstance(item, ExecChunk):
                        await ws.send_bytes(item.data)
                    elif isinstance(item, ExecResult):
                        await ws.send_text(json.dumps({"exit_code": item.exit_code,
                                                       "timed_out": item.timed_out}))
                await ws.close(code=1000)
            except DsecError as exc:
                exc = service.redact(exc)
                with contextlib.suppress(Exception):
                    await ws.send_text(_error(exc))
                    await ws.close(code=4000 + _status(exc))

        async def control(msg: dict[str, Any]) -> None:
            if not isinstance(msg, dict) or len(msg) != 1:
                raise InvalidArgument('a control frame is one JSON object: {"resize": '
                                      '[cols, rows]}, {"signal": N} or {"close_stdin": true}')
            if "resize" in msg:
                size = msg["resize"]
                if not (isinstance(size, list) and len(size) == 2
                        and all(type(v) is int for v in size)):
                    raise InvalidArgument('"resize" takes [cols, rows], two integers',
                                          field="resize")
                await resize(caller, PtyResize(id=ref.id, pid=ref.pid, cols=size[0],
                                               rows=size[1]))
            elif "signal" in msg:
                sig = msg["signal"]
                if type(sig) is not int:
                    raise InvalidArgument('"signal" takes a signal number', field="signal")
                await signal(caller, ProcessSignal(id=ref.id, pid=ref.pid, signal=sig))
            elif "close_stdin" in msg:
                await close_stdin(caller, ref)
            else:
                raise InvalidArgument(f"unknown control {next(iter(msg))[:40]!r}: use "
                                      "resize, signal or close_stdin")

        async def pump_in() -> None:
            while True:
                m = await ws.receive()
                if m["type"] == "websocket.disconnect":
                    return
                try:
                    if m.get("bytes") is not None:
                        await send_input(caller, ProcessInput(id=ref.id, pid=ref.pid,
                                                              data=m["bytes"]))
                    elif m.get("text") is not None:
                        try:
                            msg = json.loads(m["text"])
                        except ValueError:
                            raise InvalidArgument("a text frame must be a JSON control "
                                                  "object") from None
                        await control(msg)
                except DsecError as exc:
                    await ws.send_text(_error(service.redact(exc)))

        out = asyncio.ensure_future(pump_out())
        inp = asyncio.ensure_future(pump_in())
        try:
            await asyncio.wait({out, inp}, return_when=asyncio.FIRST_COMPLETED)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            for t in (out, inp):
                t.cancel()
            await asyncio.gather(out, inp, return_exceptions=True)
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    return WebSocketRoute(PATH, endpoint)
