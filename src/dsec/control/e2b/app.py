"""The E2B-compatible front door (``dsec up --e2b``): E2B's control REST and envd's
Connect-RPC and ``/files`` API, served on their own listener by dsec's own operations.

Every request is authenticated as a dsec API key and carried out by the policy of a row
of the operation catalogue (``ApiService.handler(op)``): the same role checks, project
visibility (another project's sandbox is "not found"), limits and errors as REST and
the Aether gateway. Nothing here touches a sandbox any other way.

Routing (one listener serves both APIs, so ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` are
the same URL):

- ``Host: {port}-{sandboxID}.{domain}`` (``E2B_DOMAIN`` set-ups; ``domain`` configured
  here): envd of that sandbox;
- otherwise the envd paths (``/process.Process/*``, ``/filesystem.Filesystem/*``,
  ``/files``, ``/health``) name the sandbox by the ``E2b-Sandbox-Id`` header the SDK
  sends with ``E2B_SANDBOX_URL``;
- everything else is E2B's control REST (``/sandboxes``, ``/v2/sandboxes``, ...).

Auth: control calls send ``X-API-KEY`` (a dsec key); envd calls send ``X-Access-Token``,
which this layer's create/connect answers set to a token of that sandbox alone
(:mod:`dsec.control.e2b.tokens`: the caller's key sealed under the apiserver's key, opened
only for that sandbox's envd; ``trafficAccessToken`` likewise for its code interpreter),
or a dsec key itself (an envd ``Authorization: Basic <user>:`` header names the user to
run as, never a credential).
"""

from __future__ import annotations

import ast
import base64
import collections
import contextlib
import json
import logging
import re
import secrets
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

import dsec.code as code_kernel
from dsec.control import filedoors
from dsec.control.api.service import ApiService, Caller, api_key_of
from dsec.control.e2b import code as codeapi
from dsec.control.e2b import connect as rpc
from dsec.control.e2b import mapping
from dsec.control.e2b.stream import ConnectStream
from dsec.control.e2b.tokens import SandboxTokens, Scope, is_token
from dsec.control.e2b.watchers import Watchers
from dsec.control.replybudget import consumed, hold_replies, releasing_send
from dsec.errors import (
    DsecError,
    InvalidArgument,
    InvalidTransition,
    NotFound,
    PermissionDenied,
    RemoteProtocolError,
    SandboxNotFound,
    Unauthenticated,
)
from dsec.logs import access, access_enabled
from dsec.wire import ops
from dsec.wire.calls import (
    ExecCall,
    FileRef,
    ListSandboxes,
    Mkdir,
    ReadFile,
    Remove,
    SandboxRef,
    WriteFile,
)
from dsec.wire.files import FileEvent, ReadStream, Rename, Watch, WatchEnd, WriteStream
from dsec.wire.lifetime import SetTimeout
from dsec.wire.process import (
    ProcessInfo,
    ProcessInput,
    ProcessRef,
    ProcessRunItem,
    ProcessSignal,
    PtyResize,
)
from dsec.wire.spec import (
    MAX_TTL_S,
    ExecChunk,
    ExecRequest,
    ExecResult,
    PtySize,
    SandboxInfo,
)

__all__ = ["E2BApp", "E2BConfig"]

log = logging.getLogger("dsec.e2b")

ENVD_PORT = 49983
CODE_PORT = 49999           # e2b-code-interpreter's (JUPYTER_PORT): dsec's run_code kernel
_MAX_MESSAGE = 16 << 20
_ENVD_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
# envd calls that resume a paused dsec sandbox (commands and writes; reads leave it
# paused): refused on a paused sandbox created with auto_resume=False
_ENVD_WRITES = frozenset(
    [f"/process.Process/{m}" for m in ("Start", "SendInput", "SendSignal", "CloseStdin",
                                       "Update")]
    + [f"/filesystem.Filesystem/{m}" for m in ("MakeDir", "Remove", "Move",
                                               "CreateWatcher")])
#: What a route answers with: a Starlette response or a ConnectStream (an ASGI app each).
_Answer = Callable[[Any, Any, Any], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class E2BConfig:
    """The E2B layer's settings. ``domain``: route ``{port}-{id}.{domain}`` host names
    to envd (``E2B_DOMAIN`` set-ups); ``max_upload``: bytes of one ``/files`` upload."""

    domain: str | None = None
    max_upload: int = 256 << 20
    keepalive_s: float = 50.0
    # one code-interpreter run's bound (seconds): the SDK's own ``timeout`` is a client
    # read deadline it never sends, and a run its client gave up on still holds the
    # kernel (one run at a time): past this the code is interrupted (KeyboardInterrupt)
    code_timeout_s: float = 3600.0


class _E2BError(Exception):
    """An answer in E2B's control error shape: ``{"code": <status>, "message"}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _control_error(exc: BaseException) -> Response:
    if isinstance(exc, _E2BError):
        status, msg = exc.status, exc.message
    elif isinstance(exc, DsecError):
        status, msg = exc.http_status, f"{exc.code}: {exc.message}"
    else:
        status, msg = 500, f"internal error ({type(exc).__name__})"
    return Response(json.dumps({"code": status, "message": msg}), status_code=status,
                    media_type="application/json")


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj), status_code=status, media_type="application/json",
                    headers=headers)


async def _body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    n = 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise _E2BError(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _user_of(request: Request) -> str | None:
    """The user an envd call runs as: ``Authorization: Basic base64(user:)``."""
    auth = request.headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        user = base64.b64decode(value.strip()).decode().partition(":")[0]
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("the Authorization: Basic header is not base64 of "
                              "'user:'") from None
    return user or None


_SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}


def _process_info(p: ProcessInfo) -> dict[str, Any]:
    """envd's ``ProcessInfo`` for an entry of dsec's process table."""
    argv = p.cmd if isinstance(p.cmd, list) else ["/bin/sh", "-c", p.cmd]
    out: dict[str, Any] = {"pid": p.pid, "config": {"cmd": argv[0], "args": argv[1:],
                                                    "envs": {}}}
    if p.cwd:
        out["config"]["cwd"] = p.cwd
    if p.tag:
        out["tag"] = p.tag
    return out


def _end_event(r: ExecResult) -> dict[str, Any]:
    """envd's ``EndEvent``: a process a signal killed (dsec: exit code 128+N) reads as
    envd reports it, ``exitCode -1``, ``status "signal: killed"``."""
    if r.exit_code > 128 and r.exit_code - 128 in (9, 15):
        name = "killed" if r.exit_code == 137 else "terminated"
        return {"exitCode": -1, "exited": False, "status": f"signal: {name}",
                "error": f"signal: {name}"}
    end: dict[str, Any] = {"exitCode": r.exit_code, "exited": True,
                           "status": f"exit status {r.exit_code}"}
    if r.exit_code != 0:
        end["error"] = f"exit status {r.exit_code}"
    return end


class E2BApp:
    """The ASGI app of the E2B layer over ``service`` (an :class:`ApiService`)."""

    def __init__(self, service: ApiService, config: E2BConfig | None = None) -> None:
        self.service = service
        self.config = config or E2BConfig()
        h = service.handler
        self._get = h(ops.GET)
        self._list = h(ops.LIST)
        self._destroy = h(ops.DESTROY)
        self._pause = h(ops.PAUSE)
        self._resume = h(ops.RESUME)
        self._set_timeout = h(ops.SET_TIMEOUT)
        self._stats = h(ops.STATS)
        self._rename = h(ops.FILE_RENAME)
        self._watch_policy: Callable[[Caller, Watch], Awaitable[AsyncIterator[
            FileEvent | WatchEnd]]] = service.stream_handler(ops.FILE_WATCH)  # type: ignore[arg-type]
        self.watchers = Watchers()
        # per-sandbox access tokens, keyed from the port-URL key every replica shares
        # (a service without one: a key of this process)
        port_key = getattr(getattr(service, "port_tokens", None), "key", None)
        self.tokens = SandboxTokens(port_key if isinstance(port_key, bytes)
                                    else secrets.token_bytes(32))
        self._bash: dict[str, None] = {}     # sandboxes seen with /bin/bash (insertion order)
        # sandbox -> created with auto_resume=False (bounded; learnt once per sandbox)
        self._resume_off: dict[str, bool] = {}
        self._put = h(ops.WRITE_FILE)
        self._read = h(ops.READ_FILE)
        self._exec = h(ops.EXEC)
        self._exec_stream: Callable[[Caller, ExecCall], Awaitable[AsyncIterator[
            ExecChunk | ExecResult]]] = service.stream_handler(ops.EXEC_STREAM)  # type: ignore[arg-type]
        self._list_dir = h(ops.LIST_DIR)
        self._stat = h(ops.STAT)
        self._mkdir = h(ops.MKDIR)
        self._remove = h(ops.REMOVE)
        self._plist = h(ops.PROCESS_LIST)
        self._psignal = h(ops.PROCESS_SIGNAL)
        self._pinput = h(ops.PROCESS_INPUT)
        self._pclose = h(ops.PROCESS_CLOSE_STDIN)
        self._presize = h(ops.PTY_RESIZE)
        self._pconnect: Callable[[Caller, ProcessRef], Awaitable[AsyncIterator[
            ExecChunk | ExecResult]]] = service.stream_handler(ops.PROCESS_CONNECT)  # type: ignore[arg-type]
        self._prun: Callable[[Caller, ExecCall], Awaitable[AsyncIterator[
            ProcessRunItem | ExecResult]]] = service.stream_handler(ops.PROCESS_RUN)  # type: ignore[arg-type]
        dom = self.config.domain
        self._host = (re.compile(r"^(\d+)-([^.]+)\." + re.escape(dom) + r"(?::\d+)?$")
                      if dom else None)

    # ----------------------------------------------------------------- routing
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._serve(scope, receive, send)
            return
        # a door of the per-tenant reply budget (red team 21, B2): the leases of the
        # replies this request's response is made of stay charged until it is written
        # out (dsec.control.replybudget), as at the REST door and the gateway
        with hold_replies() as leases:
            released = releasing_send(send, leases)

            async def door_send(message: Any) -> None:
                # while the request holds no lease (a process stream, most envd calls)
                # there is nothing to release: the plain send, without the wrapper's
                # extra empty final message; from the first lease on, the wrapper
                if leases:
                    await released(message)
                else:
                    await send(message)
            try:
                await self._logged(scope, receive, door_send)
            finally:
                for lease in leases:
                    lease.release()

    async def _logged(self, scope: Any, receive: Any, send: Any) -> None:
        if not access_enabled():
            await self._serve(scope, receive, send)
            return
        # --access-log (issue 19; red team 19 B9: every door): one line per request, as
        # the REST door writes them, refused ones included
        t0 = time.perf_counter()
        status = 0

        async def sent(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self._serve(scope, receive, sent)
        finally:
            caller: Caller | None = scope.get("dsec.caller")
            client = scope.get("client")
            path = scope.get("path", "")
            access(f"{scope['method']} {path} {status}", door="e2b", method=scope["method"],
                   path=path, status=status,
                   duration_ms=round((time.perf_counter() - t0) * 1000, 3),
                   client=client[0] if client else "-",
                   principal=caller.name if caller is not None else "-")

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return
        if scope["type"] != "http":
            await Response(status_code=404)(scope, receive, send)
            return
        request = Request(scope, receive)
        path: str = scope["path"]
        sandbox: str | None = None
        if self._host is not None:
            m = self._host.match(request.headers.get("host", ""))
            if m is not None:
                if int(m.group(1)) == CODE_PORT:
                    await (await self._code(request, m.group(2)))(scope, receive, send)
                    return
                if int(m.group(1)) != ENVD_PORT:
                    resp = _json({"code": 502, "message": f"port {m.group(1)} is not "
                                  f"open: dsec's E2B layer serves envd's port {ENVD_PORT} "
                                  f"and the code interpreter's {CODE_PORT} only "
                                  "(docs/e2b.md)"}, 502)
                    await resp(scope, receive, send)
                    return
                sandbox = m.group(2)
        if sandbox is None:
            port = request.headers.get("e2b-sandbox-port")
            if port == str(CODE_PORT):
                sid = request.headers.get("e2b-sandbox-id") or ""
                await (await self._code(request, sid))(scope, receive, send)
                return
            if port is not None and port != str(ENVD_PORT):
                # E2B_SANDBOX_URL set-ups reach any sandbox port through these headers
                resp = _json({"code": 502, "message": f"port {port[:8]} is not open: "
                              f"dsec's E2B layer serves envd's port {ENVD_PORT} and the "
                              f"code interpreter's {CODE_PORT} only (docs/e2b.md, "
                              "'Gaps')"}, 502)
                await resp(scope, receive, send)
                return
            if path.startswith(_ENVD_PREFIXES) or path in ("/files", "/health"):
                sandbox = request.headers.get("e2b-sandbox-id") or ""
        answer: _Answer
        if sandbox is not None:
            answer = await self._envd(request, sandbox)
        else:
            answer = await self._control(request)
        await answer(scope, receive, send)

    def _caller(self, request: Request, *names: str, sandbox: str | None = None,
                scopes: tuple[Scope, ...] = ()) -> Caller:
        return self._authenticate(request, names, sandbox=sandbox, scopes=scopes)[0]

    def _authenticate(self, request: Request, names: Sequence[str], *,
                      sandbox: str | None = None, scopes: tuple[Scope, ...] = (),
                      ) -> tuple[Caller, str]:
        """The caller and the API key it authenticated with, from the first of the
        headers ``names`` present (else ``Authorization: Bearer``). A per-sandbox token
        (:mod:`dsec.control.e2b.tokens`) is accepted only with ``scopes`` and only for
        ``sandbox``: opened, it is the key it was minted for; anywhere else (the control
        REST, another sandbox, another scope) it is refused, never taken as a key."""
        key = None
        for name in names:
            key = request.headers.get(name)
            if key:
                break
        if not key:
            auth = request.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                key = auth
        if not key:
            raise Unauthenticated(f"no API key: send a dsec API key as {names[0]} "
                                  "(E2B_API_KEY)")
        client = request.client.host if request.client else None
        with contextlib.suppress(Unauthenticated):    # else authenticate says why
            key = api_key_of(key)
        if is_token(key):
            try:
                if sandbox is None or not scopes:
                    raise Unauthenticated(
                        "an E2B access token (envdAccessToken, trafficAccessToken) opens "
                        "one sandbox's envd or code interpreter; it is not an API key: "
                        "send a dsec API key (E2B_API_KEY) here")
                key = self.tokens.open(key, sandbox, scopes)
            except Unauthenticated:
                if client is not None:     # as a bad key: guessing costs the guesser
                    self.service.check_anonymous(client, charge=True)
                raise
        caller = self.service.authenticate(key, client)
        request.scope["dsec.caller"] = caller       # for the access-log line
        return caller, key

    def _tokens_for(self, key: str, sandbox: str) -> tuple[str, str]:
        """The envd and traffic tokens of ``sandbox`` for the caller holding ``key``."""
        return (self.tokens.mint(key, sandbox, "envd"),
                self.tokens.mint(key, sandbox, "traffic"))

    # ------------------------------------------------------------ control REST
    async def _control(self, request: Request) -> Response:
        try:
            caller, key = self._authenticate(request, ("x-api-key",))
            return await self._control_route(request, caller, key)
        except (DsecError, _E2BError) as exc:
            if isinstance(exc, DsecError):
                exc = self.service.redact(exc)
            return _control_error(exc)
        except Exception as exc:
            log.exception("E2B control %s %s failed", request.method, request.url.path)
            return _control_error(exc)

    async def _control_route(self, request: Request, caller: Caller,
                             token: str) -> Response:
        method, parts = request.method, request.url.path.strip("/").split("/")
        if parts and parts[0] == "v2":
            parts = parts[1:]
        if not parts or parts[0] != "sandboxes":
            raise _E2BError(501, f"{method} {request.url.path[:120]} is not served by "
                                 "dsec's E2B layer (docs/e2b.md, 'Gaps')")
        if len(parts) == 1:
            if method == "POST":
                return await self._create(request, caller, token)
            if method == "GET":
                return await self._list_sandboxes(request, caller,
                                                  paged=request.url.path.startswith("/v2"))
        elif len(parts) == 3 and parts[2] == "metrics" and method == "GET":
            info = await self._live(caller, parts[1])
            stats = await self._stats(caller, SandboxRef(id=parts[1]))
            return _json([mapping.metrics(info, stats, time.time())])
        elif len(parts) == 2 and parts[1] != "metrics":
            sid = parts[1]
            if method == "GET":
                info = await self._live(caller, sid)
                return _json(mapping.sandbox_detail(info, self._tokens_for(token, sid)[0]))
            if method == "DELETE":
                await self._live(caller, sid)
                await self._destroy(caller, SandboxRef(id=sid))
                return Response(status_code=204)
        elif len(parts) == 3 and method == "POST":
            sid, verb = parts[1], parts[2]
            if verb == "connect":
                return await self._connect(request, caller, sid, token)
            if verb == "timeout":
                body = await self._json_body(request)
                t = body.get("timeout")
                if not isinstance(t, int) or isinstance(t, bool) or t <= 0:
                    raise _E2BError(400, f"timeout={t!r} must be a positive whole number "
                                         "of seconds")
                await self._live(caller, sid)
                await self._set_timeout(caller, SetTimeout(id=sid, timeout_s=float(
                    min(t, MAX_TTL_S))))
                return Response(status_code=204)
            if verb == "pause":
                info = await self._live(caller, sid)
                if mapping.state_of(info) == "paused":
                    raise _E2BError(409, f"sandbox {sid} is already paused")
                try:
                    await self._pause(caller, SandboxRef(id=sid))
                except InvalidTransition as exc:
                    raise _E2BError(409, f"sandbox {sid} cannot be paused now: "
                                         f"{exc.message}") from None
                return Response(status_code=204)
            if verb == "resume":
                return await self._connect(request, caller, sid, token)
        # 501, never 404: the SDK reads a 404 on a sandbox's route as "sandbox not
        # found" (a snapshot of a live sandbox said SandboxNotFoundException)
        raise _E2BError(501, f"{method} {request.url.path[:120]} is not served by dsec's "
                             "E2B layer (docs/e2b.md, 'Gaps')")

    async def _json_body(self, request: Request) -> dict[str, Any]:
        raw = await _body(request, 4 << 20)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            raise _E2BError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise _E2BError(400, "the body must be a JSON object")
        return body

    async def _live(self, caller: Caller, sid: str) -> SandboxInfo:
        """The sandbox ``sid`` as its edge reports it; a destroyed one is E2B's 404."""
        try:
            info = await self._get(caller, SandboxRef(id=sid))
        except (SandboxNotFound, InvalidArgument):
            raise _E2BError(404, f"sandbox {sid[:80]} not found") from None
        except InvalidTransition:   # lost with its node
            raise _E2BError(404, f"sandbox {sid[:80]} not found (lost with its node)"
                            ) from None
        if mapping.state_of(info) is None:
            raise _E2BError(404, f"sandbox {sid[:80]} not found ({info.state})")
        return info

    async def _create(self, request: Request, caller: Caller, token: str) -> Response:
        body = await self._json_body(request)
        try:
            req = mapping.create_request(body, max_ttl_s=MAX_TTL_S)
        except InvalidArgument as exc:
            raise _E2BError(400, exc.message) from None
        key = request.headers.get("idempotency-key")
        info = await self.service.create(caller, req, idempotency_key=key)
        self._note_resume(info)
        return _json(mapping.sandbox_created(info, *self._tokens_for(token, info.id)), 201)

    async def _connect(self, request: Request, caller: Caller, sid: str,
                       token: str) -> Response:
        body = await self._json_body(request)
        info = await self._live(caller, sid)
        self._note_resume(info)
        status = 200
        if mapping.state_of(info) == "paused" or info.state == "pausing":
            info = await self._resume(caller, SandboxRef(id=sid))
            status = 201
        t = body.get("timeout")
        if isinstance(t, int) and not isinstance(t, bool) and t > 0:
            # E2B: a running sandbox's timeout only ever grows on connect
            left = info.ttl_left_s if info.ttl_left_s is not None else (
                None if info.expires_at is None else info.expires_at - time.time())
            if left is None or left < t:
                info = await self._set_timeout(caller, SetTimeout(
                    id=sid, timeout_s=float(min(t, MAX_TTL_S))))
        return _json(mapping.sandbox_created(info, *self._tokens_for(token, info.id)), status)

    async def _list_sandboxes(self, request: Request, caller: Caller, *,
                              paged: bool) -> Response:
        q = request.query_params
        for name in q:
            if name not in _LIST_PARAMS:
                raise _E2BError(400, f"query parameter {name[:40]!r} is not supported by "
                                     "dsec's E2B layer (it takes "
                                     f"{', '.join(sorted(_LIST_PARAMS))})")
        labels = mapping.metadata_filter(q.get("metadata") or q.get("query"))
        states = {s for s in (q.get("state") or "").split(",") if s}
        if states - {"running", "paused"}:
            raise _E2BError(400, f"state must be running and/or paused, not {q['state']!r}")
        state: Any = states.pop() if len(states) == 1 else None
        limit = 100
        if "limit" in q:
            try:
                limit = int(q["limit"])
            except ValueError:
                raise _E2BError(400, f"limit={q['limit'][:20]!r} is not a number") from None
            if not 1 <= limit <= 1000:
                raise _E2BError(400, f"limit={limit} must be within 1..1000")
        try:
            view = mapping.ListView.of(order=q.get("order"),
                                       started_after=q.get("startedAfter"),
                                       template=q.get("template"))
        except InvalidArgument as exc:
            raise _E2BError(400, exc.message) from None
        cursor = q.get("nextToken") or None
        bounded = paged or "limit" in q
        if view is not None:
            return await self._list_view(caller, view, labels, state, limit, cursor,
                                         bounded=bounded, paged=paged)
        # v2 (paged): one page of at most ``limit`` rows and its token; v1 (unpaged, as
        # E2B's): every sandbox, or the first ``limit`` when the caller names one. Each
        # list call asks for what is still missing (never 0 rows: red team 19, A8).
        items: list[dict[str, Any]] = []
        while True:
            want = limit - len(items) if bounded else 1000
            page = await self._list(caller, ListSandboxes(labels=labels, state=state,
                                                          limit=want, cursor=cursor))
            items += [mapping.listed(i) for i in page.items if mapping.state_of(i)]
            cursor = page.next_cursor
            if cursor is None or (bounded and len(items) >= limit):
                break
        headers = {"x-next-token": cursor} if paged and cursor else None
        return _json(items, 200, headers)

    async def _list_view(self, caller: Caller, view: mapping.ListView,
                         labels: dict[str, str], state: Any, limit: int,
                         token: str | None, *, bounded: bool, paged: bool) -> Response:
        """``order``/``startedAfter``/``template``: E2B orders by start time across the
        whole result, before paging, so every match is read (dsec lists by id), at most
        ``mapping.MAX_VIEW`` of them, then sorted, and paged by a key token (the last
        row's start time and id: a sandbox created or gone meanwhile moves no other)."""
        after = mapping.ListView.token_key(token) if token else None
        if token and after is None:
            raise _E2BError(400, "nextToken is not one this listing gave")
        rows: list[SandboxInfo] = []
        cursor: str | None = None
        while True:
            page = await self._list(caller, ListSandboxes(labels=labels, state=state,
                                                          limit=1000, cursor=cursor))
            rows += [i for i in page.items if mapping.state_of(i) and view.keeps(i)]
            if len(rows) > mapping.MAX_VIEW:
                raise _E2BError(400, f"more than {mapping.MAX_VIEW} sandboxes match: "
                                     "narrow the list with metadata or state to order it")
            cursor = page.next_cursor
            if cursor is None:
                break
        rows = view.sorted(rows, after)
        more = bounded and len(rows) > limit
        rows = rows[:limit] if bounded else rows
        headers = ({"x-next-token": view.token(rows[-1])} if paged and more and rows
                   else None)
        return _json([mapping.listed(i) for i in rows], 200, headers)

    # --------------------------------------------------------------------- envd
    async def _envd(self, request: Request, sandbox: str) -> _Answer:
        path: str = request.scope["path"]     # (request.url parses a whole URL)
        streaming = request.headers.get("content-type", "").startswith(
            "application/connect+")
        try:
            if not sandbox:
                raise _E2BError(400, "no sandbox named: send E2b-Sandbox-Id (with "
                                     "E2B_SANDBOX_URL) or use a {port}-{id}.{domain} host")
            if path == "/health":
                return await self._health(request, sandbox)
            caller = self._caller(request, "x-access-token", "x-api-key", sandbox=sandbox,
                                  scopes=("envd",))
            if path in _ENVD_WRITES or (path == "/files" and request.method == "POST"):
                await self._no_silent_resume(caller, sandbox)
            if path == "/files":
                return await self._files(request, caller, sandbox)
            if not path.startswith(_ENVD_PREFIXES):
                raise _E2BError(404, f"no envd route {path[:80]}")
            raw = await _body(request, _MAX_MESSAGE + 5)
            msg = (rpc.decode_envelope(raw, limit=_MAX_MESSAGE) if streaming
                   else rpc.parse_message(raw))
            method = path.rpartition("/")[2]
            if path.startswith("/process.Process/"):
                return await self._process(request, caller, sandbox, method, msg,
                                           streaming)
            return await self._filesystem(request, caller, sandbox, method, msg,
                                          streaming, user=_user_of(request))
        except (DsecError, _E2BError) as exc:
            return self._rpc_error(exc, streaming, request)
        except Exception as exc:  # a bug: logged, answered as internal, never a trace
            log.exception("E2B envd %s failed", path)
            return self._rpc_error(exc, streaming, request)

    def _note_resume(self, info: SandboxInfo) -> bool:
        off = not mapping.auto_resume(info)
        if len(self._resume_off) >= 4096 and info.id not in self._resume_off:
            self._resume_off.pop(next(iter(self._resume_off)))
        self._resume_off[info.id] = off
        return off

    async def _no_silent_resume(self, caller: Caller, sandbox: str) -> None:
        """E2B's ``auto_resume=False``: a command or a write on the paused sandbox fails
        as on E2B (its envd is not running: the SDK's ``SandboxNotRunningException``)
        instead of dsec resuming it. Whether a sandbox has it off is learnt once (a
        ``get``; a create or connect here notes it); only those are asked their state
        per call."""
        off = self._resume_off.get(sandbox)
        info: SandboxInfo | None = None
        if off is None:
            info = await self._get(caller, SandboxRef(id=sandbox))
            off = self._note_resume(info)
        if not off:
            return
        if info is None:
            info = await self._get(caller, SandboxRef(id=sandbox))
        if mapping.state_of(info) == "paused" or info.state == "pausing":
            raise _E2BError(502, f"The sandbox {sandbox[:80]} is paused and was created "
                                 "with auto_resume=False, so it was not found running: "
                                 "Sandbox.connect() resumes it")

    def _rpc_error(self, exc: BaseException, streaming: bool, request: Request) -> Response:
        code, message = self._rpc_code(exc, request)
        if request.scope["path"] in ("/files", "/health"):
            # plain HTTP routes: an error of this layer keeps its own status (413 for an
            # upload past max_upload, 405 for a wrong method), not the Connect code's
            status = exc.status if isinstance(exc, _E2BError) else \
                rpc.HTTP_STATUS.get(code, 500)
            return _json({"code": status, "message": message}, status)
        if streaming:
            return Response(rpc.end_stream((code, message)),
                            media_type="application/connect+json")
        return _json(rpc.error_body(code, message), rpc.HTTP_STATUS.get(code, 500))

    def _rpc_code(self, exc: BaseException, request: Request) -> tuple[str, str]:
        if isinstance(exc, _E2BError):
            code = {400: "invalid_argument", 401: "unauthenticated", 404: "not_found",
                    409: "already_exists", 413: "resource_exhausted",
                    501: "unimplemented", 502: "unavailable"}.get(exc.status, "internal")
            return code, exc.message
        if isinstance(exc, DsecError):
            exc = self.service.redact(exc)
            return rpc.code_of(exc), exc.message
        return "internal", f"internal error ({type(exc).__name__})"

    async def _health(self, request: Request, sandbox: str) -> Response:
        """204 while the sandbox runs; 502 "... was not found" once it is gone (the
        message the SDK reads as "not running"). Unauthenticated, as envd's is: it says
        no more than whether that id is live for the key sent, if any."""
        try:
            caller = self._caller(request, "x-access-token", "x-api-key", sandbox=sandbox,
                                  scopes=("envd",))
            await self._live(caller, sandbox)
        except (_E2BError, DsecError):
            return _json({"code": 502, "message": f"The sandbox {sandbox[:80]} was not "
                          "found"}, 502)
        return Response(status_code=204)

    # ---------------------------------------------------------------- processes
    async def _process(self, request: Request, caller: Caller, sandbox: str, method: str,
                       msg: dict[str, Any], streaming: bool) -> _Answer:
        """envd's ``process.Process`` on dsec's process table (the ``process_*`` rows:
        the sandbox's edge keeps each process, its output ring and its stdin, so any
        apiserver replica, and any client, reaches it)."""
        if method == "Start" and streaming:
            return await self._start(request, caller, sandbox, msg)
        if method == "Connect" and streaming:
            pid = await self._pid(caller, sandbox, msg)
            return self._follow(request, caller, sandbox, pid, pty=await self._is_pty(
                caller, sandbox, pid), timeout_s=None)
        if method == "List":
            table = await self._plist(caller, SandboxRef(id=sandbox))
            return _json({"processes": [_process_info(p) for p in table.items
                                        if p.running]})
        if method == "SendSignal":
            pid = await self._pid(caller, sandbox, msg, running=True)
            sig = _SIGNALS.get(msg.get("signal", "SIGNAL_SIGKILL"))
            if sig is None:
                raise InvalidArgument(f"signal {str(msg.get('signal'))[:40]!r} is not "
                                      "SIGNAL_SIGKILL or SIGNAL_SIGTERM", field="signal")
            await self._psignal(caller, ProcessSignal(id=sandbox, pid=pid, signal=sig))
            return _json({})
        if method == "SendInput":
            pid = await self._pid(caller, sandbox, msg)
            inp = _obj(msg, "input")
            data = mapping.unb64(inp.get("stdin", inp.get("pty", "")), "input")
            await self._pinput(caller, ProcessInput(id=sandbox, pid=pid, data=data))
            return _json({})
        if method == "CloseStdin":
            pid = await self._pid(caller, sandbox, msg)
            await self._pclose(caller, ProcessRef(id=sandbox, pid=pid))
            return _json({})
        if method == "Update":
            pid = await self._pid(caller, sandbox, msg)
            size = _obj(_obj(msg, "pty"), "size", "pty.size")
            await self._presize(caller, PtyResize(
                id=sandbox, pid=pid, cols=_int(size, "cols", 0, "pty.size.cols"),
                rows=_int(size, "rows", 0, "pty.size.rows")))
            return _json({})
        raise _E2BError(501, f"process.Process/{method[:40]} is not supported by dsec's E2B "
                             "layer (docs/e2b.md, 'Gaps')")

    async def _pid(self, caller: Caller, sandbox: str, msg: dict[str, Any], *,
                   running: bool = False) -> int:
        """The pid a ``ProcessSelector`` names (by pid or by tag). ``running``: an
        ended process is "not found", as envd answers (the SDK's kill returns False)."""
        sel = _obj(msg, "process")
        pid, tag = sel.get("pid"), sel.get("tag")
        if not isinstance(pid, int) and not isinstance(tag, str):
            raise InvalidArgument("process (a selector: pid or tag) is required",
                                  field="process")
        if isinstance(pid, int) and not running:
            return pid
        with consumed():        # looked up here, not written out
            table = await self._plist(caller, SandboxRef(id=sandbox))
        for p in table.items:
            if (p.pid == pid if isinstance(pid, int) else p.tag == tag) and (
                    p.running or not running):
                return p.pid
        raise NotFound(f"process {pid if isinstance(pid, int) else tag!r} is not running "
                       f"in sandbox {sandbox[:80]}")

    async def _is_pty(self, caller: Caller, sandbox: str, pid: int) -> bool:
        with consumed():
            table = await self._plist(caller, SandboxRef(id=sandbox))
        return any(p.pid == pid and p.pty for p in table.items)

    async def _start(self, request: Request, caller: Caller, sandbox: str,
                     msg: dict[str, Any]) -> _Answer:
        cfg = _obj(msg, "process")
        cmd = cfg.get("cmd")
        args = cfg.get("args") or []
        if not isinstance(cmd, str) or not cmd:
            raise InvalidArgument("process.cmd (a program) is required", field="cmd")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise InvalidArgument("process.args must be a list of strings",
                                  field="process.args")
        envs = _obj(cfg, "envs", "process.envs")
        if not all(isinstance(v, str) for v in envs.values()):
            raise InvalidArgument("process.envs must map names to string values",
                                  field="process.envs")
        cwd = cfg.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise InvalidArgument("process.cwd must be a string", field="process.cwd")
        # The SDK's command timeout bounds the stream (Connect-Timeout-Ms); dsec makes it
        # the command's timeout too, so a command never outlives its caller's wait.
        timeout_ms = request.headers.get("connect-timeout-ms")
        timeout_s = None
        if timeout_ms and timeout_ms.isdigit() and int(timeout_ms) > 0:
            timeout_s = int(timeout_ms) / 1000.0
        pty = None
        if msg.get("pty"):
            size = _obj(_obj(msg, "pty"), "size", "pty.size")
            pty = PtySize(cols=_int(size, "cols", 80, "pty.size.cols"),
                          rows=_int(size, "rows", 24, "pty.size.rows"))
        tag = msg.get("tag")
        if tag is not None and not isinstance(tag, str):
            raise InvalidArgument("tag must be a string", field="tag")
        if cmd == "/bin/bash" and not await self._has_bash(caller, sandbox):
            # the SDK runs every command as /bin/bash -l -c CMD (a pty as /bin/bash -i
            # -l): an image without bash (busybox, alpine, distroless-ish) gets the same
            # flags on /bin/sh, which POSIX shells and busybox ash all take
            cmd = "/bin/sh"
        req = ExecRequest(argv=(cmd, *args), env=dict(envs),
                          cwd=cwd or None, user=_user_of(request),
                          timeout_s=timeout_s, pty=pty, tag=tag if tag else None,
                          stdin_open=bool(msg.get("stdin")))
        # One edge call (issue 20): process_run starts it as process_start would and
        # streams its entry, then its output. The entry is read before the answer
        # starts, so a refused start is still an HTTP error, as with process_start.
        it = aiter(await self._prun(caller, ExecCall(id=sandbox, req=req)))
        try:
            first = await anext(it)
        except BaseException:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            raise
        if not isinstance(first, ProcessRunItem) or first.started is None:
            raise RemoteProtocolError(f"process_run in sandbox {sandbox[:80]} did not "
                                      "answer with the process's entry first")

        async def rest() -> AsyncIterator[ProcessRunItem | ExecResult]:
            return it
        return self._follow(request, caller, sandbox, first.started.pid, pty=pty is not None,
                            timeout_s=timeout_s, open_=rest)

    async def _has_bash(self, caller: Caller, sandbox: str) -> bool:
        """Whether ``/bin/bash`` exists in the sandbox. A yes is remembered (bounded, per
        sandbox: images do not lose bash in practice, and a removed one fails the
        command as it would on E2B); a no is asked again each time, so a bash
        installed later is used."""
        if sandbox in self._bash:
            return True
        try:
            await self._stat(caller, FileRef(id=sandbox, path="/bin/bash"))
        except NotFound as exc:
            if isinstance(exc, SandboxNotFound):
                raise
            return False
        if len(self._bash) >= 4096:
            self._bash.pop(next(iter(self._bash)))
        self._bash[sandbox] = None
        return True

    def _follow(self, request: Request, caller: Caller, sandbox: str, pid: int, *,
                pty: bool, timeout_s: float | None,
                open_: Callable[[], Awaitable[AsyncIterator[Any]]] | None = None,
                ) -> ConnectStream[Any]:
        """The Connect stream of process ``pid``: its start event, its output (what its
        ring holds, then live), its end; a keep-alive event on a quiet stream
        (:class:`ConnectStream`: written straight to ``send``, the end event and the
        end-of-stream envelope in one final write)."""
        def frame(item: ExecChunk | ProcessRunItem | ExecResult) -> tuple[bytes, bool]:
            if isinstance(item, (ExecChunk, ProcessRunItem)):
                return rpc.data_event("pty" if pty else item.stream,
                                      base64.b64encode(item.data)), False
            if item.timed_out:
                why = f"the command ran past its timeout of {timeout_s}s and was killed"
                return rpc.end_stream(("deadline_exceeded", why)), True
            return rpc.envelope({"event": {"end": _end_event(item)}}) + rpc.END_OK, True

        def on_error(exc: BaseException) -> bytes:
            if not isinstance(exc, DsecError):  # a bug: logged, ends the stream as internal
                log.error("E2B envd stream of process %s in %s failed", pid, sandbox,
                          exc_info=exc)
            return rpc.end_stream(self._rpc_code(exc, request))

        if open_ is None:
            def open_() -> Awaitable[AsyncIterator[Any]]:
                return self._pconnect(caller, ProcessRef(id=sandbox, pid=pid))
        return ConnectStream(
            rpc.envelope({"event": {"start": {"pid": pid}}}), open_, frame,
            on_error, keepalive_s=self.config.keepalive_s)

    # --------------------------------------------------------------- filesystem
    async def _filesystem(self, request: Request, caller: Caller, sandbox: str,
                          method: str, msg: dict[str, Any], streaming: bool, *,
                          user: str | None = None) -> _Answer:
        raw_path = msg.get("path")
        if method in ("Stat", "ListDir", "MakeDir", "Remove", "WatchDir",
                      "CreateWatcher") and (
                not isinstance(raw_path, str) or not raw_path):
            raise InvalidArgument("path is required")
        path = str(raw_path)
        # ``user`` (the SDK's user=): every call below runs AS that user on the edge (its
        # fsuid/fsgid/groups on the file thread: the kernel checks each step, atomically);
        # never a check as the user followed by root's act (red team 21, B1 B4 B10 B11)
        as_ = _file_user(user)
        if method == "Stat":
            fi = await self._stat(caller, FileRef(id=sandbox, path=path, user=as_))
            return _json({"entry": mapping.entry_info(fi)})
        if method == "ListDir":
            depth = _int(msg, "depth", 1, "depth") or 1
            entries = await self._walk(caller, sandbox, path, depth, as_)
            return _json({"entries": entries})
        if method == "MakeDir":
            try:
                await self._stat(caller, FileRef(id=sandbox, path=path, user=as_))
            except (NotFound, SandboxNotFound) as exc:
                if isinstance(exc, SandboxNotFound):
                    raise
            else:
                return _json(rpc.error_body("already_exists", f"{path} already exists"),
                             409)
            await self._mkdir(caller, Mkdir(id=sandbox, path=path, parents=True, user=as_))
            fi = await self._stat(caller, FileRef(id=sandbox, path=path, user=as_))
            return _json({"entry": mapping.entry_info(fi)})
        if method == "Remove":
            await self._remove(caller, Remove(id=sandbox, path=path, recursive=True,
                                              user=as_))
            return _json({})
        if method == "Move":
            src, dst = msg.get("source"), msg.get("destination")
            if not isinstance(src, str) or not isinstance(dst, str) or not src or not dst:
                raise InvalidArgument("source and destination are required")
            # envd's Move is a rename(2): it replaces an existing destination
            fi = await self._rename(caller, Rename(id=sandbox, src=src, dst=dst,
                                                   overwrite=True, user=as_))
            return _json({"entry": mapping.entry_info(fi)})
        if method == "WatchDir" and streaming:
            return self._watch_stream(request, caller, sandbox, path or "/",
                                      bool(msg.get("recursive")), user=as_)
        if method == "CreateWatcher":
            fi = await self._stat(caller, FileRef(id=sandbox, path=path, user=as_))
            if fi.type != "dir":
                raise InvalidArgument(f"{path} is not a directory", field="path")
            await self._may_watch(caller, sandbox, path, as_)

            async def probe(p: str) -> None:
                await self._put(caller, WriteFile(id=sandbox, path=p, data=b""))
                await self._remove(caller, Remove(id=sandbox, path=p))
            recorded = getattr(self.service.directory, "recorded_project", None)
            project = recorded(sandbox) if recorded is not None else None
            wid = await self.watchers.create(caller, Watch(
                id=sandbox, path=path, recursive=bool(msg.get("recursive"))),
                self._watch_policy, probe,
                tenant=project.partition("/")[0] if project else None)
            return _json({"watcherId": wid})
        if method == "GetWatcherEvents":
            events = self.watchers.take(caller, str(msg.get("watcherId") or ""))
            return _json({"events": events})
        if method == "RemoveWatcher":
            self.watchers.remove(caller, str(msg.get("watcherId") or ""))
            return _json({})
        raise _E2BError(501, f"filesystem.Filesystem/{method} is not supported by dsec's "
                             "E2B layer yet (docs/e2b.md, 'Gaps')")

    async def _walk(self, caller: Caller, sandbox: str, path: str, depth: int,
                    user: str | None = None) -> list[dict[str, Any]]:
        """ListDir at ``depth``: each level listed by the edge (as ``user`` when set: a
        directory below that the user may not list is left out, as envd's walk skips
        it), at most MAX_WALK_ENTRIES entries in all (one JSON reply), else an error
        saying so."""
        out: list[dict[str, Any]] = []
        todo = [(path, 1)]
        while todo:
            d, level = todo.pop(0)
            try:
                listing = await self._list_dir(caller, FileRef(id=sandbox, path=d,
                                                                user=user))
            except PermissionDenied:
                if level == 1:
                    raise
                continue        # the user may not list it: not descended into
            for fi in listing.items:
                if len(out) >= MAX_WALK_ENTRIES:
                    raise InvalidArgument(
                        f"listing {path[:200]!r} at depth {depth} passes "
                        f"{MAX_WALK_ENTRIES} entries; list with a smaller depth or a "
                        "deeper path", field="depth", limit=MAX_WALK_ENTRIES)
                out.append(mapping.entry_info(fi))
                if fi.type == "dir" and level < depth:
                    todo.append((fi.path, level + 1))
        return out

    # --------------------------------------------------------- code interpreter
    async def _code(self, request: Request, sandbox: str) -> Response:
        """e2b-code-interpreter's port 49999 (:mod:`dsec.control.e2b.code`): ``/execute``
        and ``/contexts`` on dsec's run_code kernel, run by the sandbox's ``exec`` as the
        caller. The SDK authenticates these with the create answer's tokens: the
        ``X-Access-Token`` (run) or ``E2B-Traffic-Access-Token`` (contexts), both
        tokens of this sandbox sealing the caller's key (or a dsec key itself)."""
        path = request.url.path.rstrip("/")
        try:
            if not sandbox:
                raise _E2BError(400, "no sandbox named: send E2b-Sandbox-Id (with "
                                     "E2B_SANDBOX_URL) or use a 49999-{id}.{domain} host")
            # the key picks the kernel (dsec.code._token): the one authenticated
            # (a token's sealed key: the kernel dsec's SDK reaches with that key)
            caller, key = self._authenticate(
                request, ("x-access-token", "e2b-traffic-access-token", "x-api-key"),
                sandbox=sandbox, scopes=("envd", "traffic"))
            info = await self._live(caller, sandbox)
            kernel = _KernelSandbox(self, caller, info)
            method = request.method
            if path == "/execute" and method == "POST":
                return await self._execute(request, kernel, key)
            if path == "/contexts" and method == "POST":
                body = await self._json_body(request)
                return _json(await self._new_context(kernel, key, body))
            if path == "/contexts" and method == "GET":
                return _json(await self._contexts(kernel))
            parts = path.strip("/").split("/")
            if len(parts) in (2, 3) and parts[0] == "contexts":
                cid = codeapi.check_context_id(parts[1])
                rec = await self._context(kernel, cid)
                if len(parts) == 3 and parts[2] == "restart" and method == "POST":
                    await code_kernel.restart(kernel, key=key, context=cid)
                    await self._init_context(kernel, key, cid, rec["cwd"])
                    return _json({})
                if len(parts) == 2 and method == "DELETE":
                    await code_kernel.restart(kernel, key=key, context=cid)
                    await self._remove(caller, Remove(
                        id=sandbox, path=f"{codeapi.CONTEXT_DIR}/{cid}.json"))
                    return Response(status_code=204)
            raise _E2BError(404, f"no code interpreter route {method} {path[:80]}")
        except (DsecError, _E2BError) as exc:
            if isinstance(exc, DsecError):
                exc = self.service.redact(exc)
            return _control_error(exc)
        except Exception as exc:  # a bug: logged, answered as internal, never a trace
            log.exception("E2B code interpreter %s failed", path)
            return _control_error(exc)

    async def _execute(self, request: Request, kernel: _KernelSandbox,
                       key: str) -> Response:
        body = await self._json_body(request)
        code = body.get("code")
        if not isinstance(code, str):
            raise InvalidArgument("code (a string) is required", field="code")
        cid = body.get("context_id")
        if cid is not None and body.get("language") is not None:
            raise InvalidArgument("give context_id or language, not both",
                                  field="language")
        context = ""
        if cid is not None:
            context = codeapi.check_context_id(cid)
            await self._context(kernel, context)
        else:
            codeapi.check_language(body.get("language"))
        env = _obj(body, "env_vars")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise InvalidArgument("env_vars must map names to string values",
                                  field="env_vars")
        timeout = self.config.code_timeout_s
        if env:
            # E2B: the variables hold for this run only. Set before, restored after
            # (two small runs of the same kernel), so the code itself runs unchanged
            # (its last expression is still its result, its line numbers its own).
            await self._run_quiet(kernel, key, context, _ENV_SET.format(env=repr(env)))
        # the output streams as the code writes it (the kernel's stream mode): the first
        # item is awaited here, so a run that cannot start is an HTTP error, as E2B's
        run = code_kernel.run_code_stream(kernel, code, timeout=timeout, key=key,
                                          context=context)
        try:
            first = await anext(run)
        except BaseException:
            if env:
                await self._run_quiet(kernel, key, context, _ENV_RESTORE)
            raise

        async def stream() -> AsyncIterator[bytes]:
            item: tuple[str, str] | code_kernel.Execution | None = first
            try:
                while item is not None:
                    if isinstance(item, code_kernel.Execution):
                        for line in codeapi.execute_lines(item, time.time_ns(),
                                                          output=False):
                            yield line
                        break
                    yield codeapi.output_line(*item, now_ns=time.time_ns())
                    item = await anext(run, None)
            except DsecError as exc:
                exc = self.service.redact(exc)
                yield codeapi.failure_line(exc.code, exc.message)
            finally:
                # best effort: a client gone mid-run (the SDK's timeout) leaves the code
                # running; the restore then waits for the kernel, and may fail
                with contextlib.suppress(Exception):
                    await run.aclose()          # the exec stream, if still open
                if env:
                    with contextlib.suppress(Exception):
                        await self._run_quiet(kernel, key, context, _ENV_RESTORE)
        return StreamingResponse(stream(), media_type="application/x-ndjson")

    async def _run_quiet(self, kernel: _KernelSandbox, key: str, context: str,
                         code: str) -> code_kernel.Execution:
        ex = await code_kernel.run_code(kernel, code, timeout=30.0, key=key,
                                        context=context)
        if ex.error is not None:
            raise InvalidArgument(f"the code interpreter could not prepare the run: "
                                  f"{ex.error.name}: {ex.error.value}"[:500])
        return ex

    async def _init_context(self, kernel: _KernelSandbox, key: str, cid: str,
                            cwd: str | None) -> str:
        """Start context ``cid``'s kernel in ``cwd`` (None: the exec's default); its
        working directory."""
        ex = await self._run_quiet(kernel, key, cid, "import os as _dsec_os\n" + (
            f"_dsec_os.chdir({cwd!r})\n" if cwd else "") + "_dsec_os.getcwd()")
        text = ex.text or "''"
        try:
            out = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out = None
        return out if isinstance(out, str) else (cwd or "/")

    async def _new_context(self, kernel: _KernelSandbox, key: str,
                           body: dict[str, Any]) -> dict[str, str]:
        language = codeapi.check_language(body.get("language"))
        cwd = body.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise InvalidArgument("cwd must be an absolute path", field="cwd")
        if len(await self._contexts(kernel)) >= codeapi.MAX_CONTEXTS:
            raise _E2BError(429, f"sandbox {kernel.id} has {codeapi.MAX_CONTEXTS} code "
                                 "contexts: remove one first")
        cid = "ctx-" + secrets.token_hex(8)
        real = await self._init_context(kernel, key, cid, cwd)
        rec = codeapi.context_record(cid, language, real)
        await self._mkdir(kernel.caller, Mkdir(id=kernel.id, path=codeapi.CONTEXT_DIR,
                                               parents=True))
        await self._put(kernel.caller, WriteFile(
            id=kernel.id, path=f"{codeapi.CONTEXT_DIR}/{cid}.json",
            data=json.dumps(rec).encode()))
        return rec

    async def _context(self, kernel: _KernelSandbox, cid: str) -> dict[str, str]:
        try:
            with consumed():
                raw = await self._read(kernel.caller, ReadFile(
                    id=kernel.id, path=f"{codeapi.CONTEXT_DIR}/{cid}.json",
                    length=codeapi.MAX_CONTEXT_RECORD + 1))
        except NotFound:
            raw = b""
        rec = codeapi.parse_context(raw, cid) if raw else None
        if rec is None:
            raise _E2BError(404, f"context {cid} not found in sandbox {kernel.id}")
        return rec

    async def _contexts(self, kernel: _KernelSandbox) -> list[dict[str, str]]:
        try:
            with consumed():
                listing = await self._list_dir(kernel.caller, FileRef(
                    id=kernel.id, path=codeapi.CONTEXT_DIR))
        except NotFound:
            return []
        out = []
        for fi in listing.items[:codeapi.MAX_CONTEXTS * 2]:
            cid = fi.name.removesuffix(".json")
            if fi.type != "file" or not cid.startswith("ctx-"):
                continue
            try:
                out.append(await self._context(kernel, codeapi.check_context_id(cid)))
            except (_E2BError, InvalidArgument):
                continue
        return out

    # -------------------------------------------------------------------- files
    async def _files(self, request: Request, caller: Caller, sandbox: str) -> Response:
        path = request.query_params.get("path")
        request.scope["dsec.e2b.user"] = (request.query_params.get("username")
                                          or _user_of(request))
        if request.method == "GET":
            if not path:
                raise _E2BError(400, "query parameter path is required")
            # read AS the user (their rights, checked by the kernel as the edge opens
            # it): never a check as them followed by root's read (red team 21, B4)
            return await self._download(caller, sandbox, path,
                                        _file_user(request.scope["dsec.e2b.user"]))
        if request.method == "POST":
            return await self._upload(request, caller, sandbox, path)
        raise _E2BError(405, f"{request.method} /files: use GET or POST")

    async def _download(self, caller: Caller, sandbox: str, path: str,
                        user: str | None = None) -> Response:
        """The file streamed from the sandbox (``file_read_stream``: bounded memory on
        every hop, whatever the size), its length (that of the file as opened) said up
        front."""
        req, info = await filedoors.sized_read(self.service, caller,
                                               ReadStream(id=sandbox, path=path, user=user))
        if info.type == "dir":
            raise _E2BError(400, f"{path} is a directory")
        first, more = await filedoors.read_chunks(self.service, caller, req)

        async def body() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for chunk in more:
                yield chunk
        assert req.length is not None
        return StreamingResponse(body(), media_type="application/octet-stream",
                                 headers={"content-length": str(req.length)})

    async def _upload(self, request: Request, caller: Caller, sandbox: str,
                      path: str | None) -> Response:
        ctype = request.headers.get("content-type", "")
        results: list[dict[str, Any]] = []
        limit = self.config.max_upload
        clen = request.headers.get("content-length")
        if ctype.startswith("multipart/form-data"):
            # Bounded before a byte is read: the body may carry max_upload bytes of files
            # plus MULTIPART_FRAMING bytes of boundaries and part headers. Parts are then
            # streamed one by one straight into file_write_stream (nothing is spooled on
            # the apiserver), counting file bytes as they pass (a chunked body has no
            # length to check up front: past max_upload the part being written is
            # abandoned - its temporary file removed - and the answer is 413).
            if clen and clen.isdigit() and \
                    int(clen) > limit + MULTIPART_FRAMING:
                raise _E2BError(413, f"upload of {clen} bytes exceeds max_upload={limit} "
                                     "bytes of files (plus multipart framing)")
            results = await self._upload_multipart(request, caller, sandbox, path, ctype,
                                                   limit)
        else:
            if not path:
                raise _E2BError(400, "query parameter path is required for an "
                                     "octet-stream upload")
            encoding = request.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("identity", "gzip"):
                raise _E2BError(400, f"Content-Encoding {encoding[:40]!r} is not accepted: "
                                     "upload gzip (gzip=True) or uncompressed")
            size = int(clen) if clen and clen.isdigit() else None
            if size is not None and size > limit:
                raise _E2BError(413, f"upload of {size} bytes exceeds max_upload={limit}")
            counted = _Counted(request.stream(), limit)
            chunks = counted.chunks()
            if encoding == "gzip":
                # gzip=True: inflated as it streams, max_upload bounding the inflated
                # bytes too (a small bomb is refused, 413, once past it; nothing kept)
                counted = _Counted(_gunzip(chunks), limit)
                chunks, size = counted.chunks(), None
            try:
                results.append(await self._write(caller, sandbox, path, chunks, size,
                                                 user=request.scope["dsec.e2b.user"]))
            except Exception:
                if counted.over:
                    raise _E2BError(413, f"upload exceeds max_upload={limit} bytes; "
                                         "nothing was changed") from None
                raise
        return _json(results)

    async def _upload_multipart(self, request: Request, caller: Caller, sandbox: str,
                                path: str | None, ctype: str,
                                limit: int) -> list[dict[str, Any]]:
        """Parse the multipart body as it arrives (python-multipart's streaming parser)
        and write each file part through ``file_write_stream`` while it is read: memory
        per request is one body chunk, and at most MULTIPART_MAX_PARTS parts and
        max_upload bytes of files are taken."""
        _, params = parse_options_header(ctype)
        boundary = params.get(b"boundary")
        if not boundary:
            raise _E2BError(400, "multipart/form-data without a boundary")
        parts = _Parts(request.stream(), boundary, limit)
        results: list[dict[str, Any]] = []
        while True:
            headers = await parts.next_part()
            if headers is None:
                return results
            _, disp = parse_options_header(headers.get(b"content-disposition", b""))
            fname = disp.get(b"filename")
            if fname is None:          # a plain field: read (bounded) and ignored
                async for _ in parts.data(field=True):
                    pass
                continue
            target = fname.decode("utf-8", "surrogateescape")
            if not target.startswith("/") and path:
                target = path
            if not target:
                raise _E2BError(400, "a multipart file part needs a filename (the path) "
                                     "or ?path=")
            try:
                results.append(await self._write(caller, sandbox, target, parts.data(),
                                                 None, user=request.scope["dsec.e2b.user"]))
            except Exception:
                if parts.over:
                    raise _E2BError(413, parts.over) from None
                raise

    async def _write(self, caller: Caller, sandbox: str, path: str,
                     chunks: AsyncIterator[bytes], size: int | None, *,
                     user: str | None = None) -> dict[str, Any]:
        """Stream ``chunks`` into ``path`` (``file_write_stream``: the edge writes a
        temporary file and renames it into place, so a cut upload leaves the old file);
        missing parents are made first, as envd does. ``user`` (the SDK's ``user=``):
        the parents and the file are made AS that user on the edge (their fsuid, fsgid
        and groups: the kernel checks every step and they own what is made), in one
        call - no check-then-root-write-then-chown (red team 21, B1 B11)."""
        parent = path.rpartition("/")[0]
        as_ = _file_user(user)
        if parent:
            await self._mkdir(caller, Mkdir(id=sandbox, path=parent, parents=True, user=as_))
        info = await filedoors.write_chunks(
            self.service, caller, WriteStream(id=sandbox, path=path, size=size, user=as_),
            chunks)
        return mapping.write_info(info)

    async def _shell(self, caller: Caller, sandbox: str, script: str, args: list[str],
                     user: str) -> None:
        """``script`` (sh, ``$1``...: ``args``) as ``user`` through the ``exec`` row; a
        failure is the user's to see (their rights: permission_denied)."""
        with consumed():        # a check: its output is not written out
            r: ExecResult = await self._exec(caller, ExecCall(id=sandbox, req=ExecRequest(
                argv=("/bin/sh", "-c", script, "sh", *args), user=user, timeout_s=30.0,
                output_cap_bytes=4096)))
        if r.exit_code != 0:
            why = r.stderr.decode(errors="replace").strip()[-300:] or \
                f"exit {r.exit_code}"
            raise PermissionDenied(f"as user {user!r} in sandbox {sandbox}: {why}")

    # ------------------------------------------------------------------ watches
    async def _may_watch(self, caller: Caller, sandbox: str, path: str,
                         user: str | None) -> None:
        """``watch_dir(user=u)``: ``u`` must be able to list the directory (inotify wants
        read permission on it, and envd watches as the user): the edge lists it as
        ``u`` (the kernel's refusal is the error). The watch itself is dsec's
        ``file_watch``, with root's rights below it (docs/e2b.md, 'Gaps')."""
        if user is None:
            return
        with consumed():        # a check: its reply is not written out
            await self._list_dir(caller, FileRef(id=sandbox, path=path, user=user))

    def _watch_stream(self, request: Request, caller: Caller, sandbox: str, path: str,
                      recursive: bool, *, user: str | None = None,
                      ) -> ConnectStream[FileEvent | WatchEnd]:
        """envd's streaming WatchDir on ``file_watch``: a start event, then one
        ``filesystem`` event per change (a keep-alive on a quiet stream: the stream
        stays open however long it is quiet). ``user``: checked as for CreateWatcher
        (:meth:`_may_watch`); refused, the stream ends with the error."""
        def frame(item: FileEvent | WatchEnd) -> tuple[bytes, bool]:
            if isinstance(item, FileEvent):
                lost = mapping.watch_incomplete(item, path)
                if lost is not None:
                    return rpc.end_stream(self._rpc_code(lost, request)), True
                ev = mapping.fs_event(item, path)
                return (b"" if ev is None else
                        rpc.envelope({"event": {"filesystem": ev}})), False
            return rpc.END_OK, True

        def on_error(exc: BaseException) -> bytes:
            if not isinstance(exc, DsecError):
                log.error("E2B envd watch of %s in %s failed", path[:200], sandbox,
                          exc_info=exc)
            return rpc.end_stream(self._rpc_code(exc, request))

        async def open_() -> AsyncIterator[FileEvent | WatchEnd]:
            await self._may_watch(caller, sandbox, path, user)
            return await self._watch_policy(caller, Watch(id=sandbox, path=path,
                                                          recursive=recursive))

        return ConnectStream(rpc.envelope({"event": {"start": {}}}), open_, frame,
                             on_error, keepalive_s=self.config.keepalive_s)


# ListDir's whole answer (every level of a depth walk) is one JSON reply: bounded.
MAX_WALK_ENTRIES = 65536
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$")


def _file_user(user: str | None) -> str | None:
    """The ``user`` of the file calls made for ``user``: None for root (the edge's own
    identity), else the name (checked)."""
    return user if _other_user(user) else None


def _other_user(user: str | None) -> bool:
    """Whether file calls must act as ``user`` (a name other than root's)."""
    if user is None or user in ("root", "0"):
        return False
    if not _USER.match(user):
        raise InvalidArgument(f"user {user[:40]!r} is not a user name", field="user")
    return True


_LIST_PARAMS = frozenset({"metadata", "state", "limit", "nextToken", "query", "order",
                          "startedAfter", "template"})

_ENV_SET = ("import os as _dsec_os\n_dsec_env = {env}\n"
            "_dsec_env_saved = {{k: _dsec_os.environ.get(k) for k in _dsec_env}}\n"
            "_dsec_os.environ.update(_dsec_env)\ndel _dsec_env\n")
_ENV_RESTORE = ("for _k, _v in _dsec_env_saved.items():\n"
                "    if _v is None: _dsec_os.environ.pop(_k, None)\n"
                "    else: _dsec_os.environ[_k] = _v\n"
                "del _dsec_env_saved, _k, _v\n")


class _KernelSandbox:
    """What :mod:`dsec.code`'s driver needs of a sandbox (id, info, exec), carried
    out as ``caller`` through the ``exec`` row of the catalogue: the kernel runs with
    the sandbox's isolation, user and limits, and every rule an exec has."""

    def __init__(self, app: E2BApp, caller: Caller, info: SandboxInfo) -> None:
        self.app, self.caller, self.info, self.id = app, caller, info, info.id

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = 60.0,
                   stdin: bytes | str | None = None, output_cap: int | None = None
                   ) -> ExecResult:
        argv = (cmd,) if isinstance(cmd, str) else tuple(cmd)
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        req = ExecRequest(argv=argv, stdin=data, timeout_s=timeout)
        if output_cap:
            req = msgspec.structs.replace(req, output_cap_bytes=output_cap)
        with consumed():    # the kernel driver's: parsed, not written out as it is
            result: ExecResult = await self.app._exec(self.caller,
                                                      ExecCall(id=self.id, req=req))
        return result

    async def exec_stream(self, cmd: Sequence[str], *, timeout: float | None,
                          stdin: bytes, output_cap: int
                          ) -> AsyncIterator[ExecChunk | ExecResult]:
        req = ExecRequest(argv=tuple(cmd), stdin=stdin, timeout_s=timeout,
                          output_cap_bytes=output_cap)
        stream = await self.app._exec_stream(self.caller, ExecCall(id=self.id, req=req))
        async for item in stream:
            yield item


# Multipart /files bounds (A7): parts in one request (E2B's SDK sends one per file of a
# write_files call) and bytes of boundaries + part headers (~150 per part) allowed on top
# of max_upload when the request's length is checked up front. A field (non-file part)
# may hold FIELD_MAX bytes.
MULTIPART_MAX_PARTS = 64
MULTIPART_FRAMING = 64 << 10
FIELD_MAX = 64 << 10


_INFLATE_PIECE = 1 << 20


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A gzip body inflated as it arrives, at most ``_INFLATE_PIECE`` bytes of output at a
    time (memory stays bounded whatever the ratio); malformed or cut input is a 400."""
    d = zlib.decompressobj(wbits=31)
    try:
        async for chunk in chunks:
            data = chunk
            while data:
                out = d.decompress(data, _INFLATE_PIECE)
                data = d.unconsumed_tail
                if out:
                    yield out
                if d.eof:
                    if data or d.unused_data:
                        raise _E2BError(400, "bytes after the end of the gzip stream "
                                             "(one member only)")
                    break
        if not d.eof:
            raise _E2BError(400, "the gzip upload ended before its end (cut or not gzip)")
    except zlib.error as exc:
        raise _E2BError(400, f"the upload is not valid gzip ({exc})") from None


class _Counted:
    """A request body passed on while counting it; past ``limit`` it stops (``over``)."""

    def __init__(self, stream: AsyncIterator[bytes], limit: int) -> None:
        self.stream, self.limit, self.seen, self.over = stream, limit, 0, False

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self.stream:
            self.seen += len(chunk)
            if self.seen > self.limit:
                self.over = True
                raise _E2BError(413, f"upload exceeds max_upload={self.limit} bytes")
            yield chunk


class _Parts:
    """A multipart body parsed as it streams in (pull-driven: a chunk of the request is
    read only when the consumer of the current part wants more), so a file part goes to
    the sandbox while it arrives. ``over`` says why a bound was hit (then 413)."""

    def __init__(self, stream: AsyncIterator[bytes], boundary: bytes, limit: int) -> None:
        self.stream = aiter(stream)
        self.limit = limit
        self.file_bytes = 0
        self.count = 0
        self.over = ""
        self.events: collections.deque[tuple[str, bytes]] = collections.deque()
        self._field = b""
        self._value = b""

        def on_data(kind: str) -> Callable[[bytes, int, int], None]:
            def cb(data: bytes, start: int, end: int) -> None:
                self.events.append((kind, bytes(data[start:end])))
            return cb

        def on(kind: str) -> Callable[[], None]:
            def cb() -> None:
                self.events.append((kind, b""))
            return cb

        self.parser = MultipartParser(boundary, {
            "on_part_begin": on("begin"), "on_part_data": on_data("data"),
            "on_part_end": on("end"), "on_header_field": on_data("hfield"),
            "on_header_value": on_data("hvalue"), "on_header_end": on("hend"),
            "on_end": on("eof")})
        self.done = False

    async def _event(self) -> tuple[str, bytes]:
        while not self.events:
            if self.done:
                return ("eof", b"")
            chunk = await anext(self.stream, None)
            if chunk is None:
                self.done = True
                self.parser.finalize()
                continue
            try:
                self.parser.write(chunk)
            except Exception as exc:     # python-multipart's MultipartParseError & co
                raise _E2BError(400, f"malformed multipart body: {exc}") from exc
        return self.events.popleft()

    async def next_part(self) -> dict[bytes, bytes] | None:
        """The headers of the next part (lower-cased names), None at the end."""
        while True:
            kind, _ = await self._event()
            if kind == "eof":
                return None
            if kind == "begin":
                break
        self.count += 1
        if self.count > MULTIPART_MAX_PARTS:
            self.over = f"more than {MULTIPART_MAX_PARTS} parts in one upload"
            raise _E2BError(413, self.over)
        headers: dict[bytes, bytes] = {}
        field, value = b"", b""
        while True:
            kind, data = await self._event()
            if kind == "hfield":
                field += data
            elif kind == "hvalue":
                value += data
            elif kind == "hend":
                headers[field.lower()] = value
                field, value = b"", b""
            elif kind == "eof":
                raise _E2BError(400, "multipart body ends inside a part's headers")
            else:                       # the first data (or the end) of the part
                self.events.appendleft((kind, data))
                return headers

    async def data(self, *, field: bool = False) -> AsyncIterator[bytes]:
        """The current part's bytes, counted against the bounds."""
        seen = 0
        while True:
            kind, data = await self._event()
            if kind == "end":
                return
            if kind == "eof":
                raise _E2BError(400, "multipart body ends inside a part")
            if kind != "data":
                continue
            seen += len(data)
            if field:
                if seen > FIELD_MAX:
                    self.over = f"a multipart field exceeds {FIELD_MAX} bytes"
                    raise _E2BError(413, self.over)
                continue
            self.file_bytes += len(data)
            if self.file_bytes > self.limit:
                self.over = (f"upload exceeds max_upload={self.limit} bytes of files; the "
                             "part being written was not kept")
                raise _E2BError(413, self.over)
            yield data


def _obj(msg: dict[str, Any], key: str, field: str | None = None) -> dict[str, Any]:
    """``msg[key]`` as an object ({} when absent/null), or invalid_argument: caller data
    never reaches ``dict()``/``.get`` unchecked (red team 19, A8)."""
    v = msg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise InvalidArgument(f"{field or key} must be an object, not "
                              f"{type(v).__name__}", field=field or key)
    return v


def _int(msg: dict[str, Any], key: str, default: int, field: str) -> int:
    """``msg[key]`` as an integer (``default`` when absent), or invalid_argument.
    Connect's JSON mapping may send 64-bit integers as decimal strings."""
    v = msg.get(key)
    if v is None:
        return default
    if isinstance(v, str) and v.lstrip("-").isdigit() and len(v) <= 20:
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise InvalidArgument(f"{field} must be an integer, not {str(v)[:40]!r}",
                              field=field)
    return v
