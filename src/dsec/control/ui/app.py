"""The dashboard's routes (``/ui``), served by the apiserver beside the REST API.

Each page calls the same operation policies the REST routes and the Aether gateway call
(``ApiService.handler(row)`` of :mod:`dsec.wire.ops`) with the caller its session key
authenticates to, so what a key sees and may do here is exactly what it sees and may do
through REST: another project's sandbox is the same 404, a reader's pause the same 403.
The session and CSRF rules are in :mod:`dsec.control.ui.session`, the HTML in
:mod:`dsec.control.ui.views` and its templates; this module is the I/O between them.

Costs: the sandboxes page is one ``list`` call (the registry's sorted id index, O(page)
however many sandboxes exist; figure ``ui_sandboxes_page_load_ms``, suite ``features``)
plus rendering the page's rows. The node filter is ``list``'s own ``node`` filter (the
registry's per-node index), so a node-filtered page is one ``list`` call and O(page) too.
It used to scan list pages of the display limit and keep that node's rows: with
``limit=1`` one page view made up to 2,000 ``list`` calls (red team 19, A9).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qsl, quote

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from dsec.control.api.service import ApiService, Caller
from dsec.control.replybudget import SentThenReleased, hold_replies
from dsec.control.ui import session as sess
from dsec.control.ui.rate import CreationSeries
from dsec.control.ui.views import Filters, SandboxesPage, chart, render, sandboxes_links
from dsec.errors import (
    Compacted,
    DsecError,
    InternalError,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from dsec.wire import ops
from dsec.wire.calls import Empty, ExecCall, ListSandboxes, SandboxRef
from dsec.wire.process import ProcessSignal
from dsec.wire.spec import ExecRequest, PtySize

__all__ = ["CSP", "Dashboard"]

log = logging.getLogger("dsec.ui")

# No inline script or style, nothing from another origin, no framing, forms and fetches
# to this origin only.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
# The terminal page only: xterm.js's DOM renderer writes its cell metrics and colours
# into <style> elements it creates (xterm 6 has no nonce option), which 'self' refuses.
# Scripts stay 'self' only; styles cannot run code.
CSP_TERMINAL = CSP.replace("style-src 'self'", "style-src 'self' 'unsafe-inline'")
# Referrer-Policy same-origin, not no-referrer: under no-referrer Chromium sends
# "Origin: null" with the dashboard's own form POSTs, which the origin check refuses.
_HEADERS = {"x-content-type-options": "nosniff", "referrer-policy": "same-origin",
            "x-frame-options": "DENY", "cache-control": "no-store",
            "cross-origin-opener-policy": "same-origin"}
FOLLOW_MAX_BEHIND = 20_000
# What the terminal runs: a login-less shell (every image has /bin/sh).
TERMINAL_ARGV = ("/bin/sh",)
# A dashboard shell ends (SIGKILL to its process group) once nobody has had its terminal
# open for TERMINAL_IDLE_S (counted by the apiserver that started it, from the moment it
# starts or its last viewer's socket closes), and in any case after TERMINAL_TIMEOUT_S
# (the process's own timeout, enforced by its edge: it holds after an apiserver restart,
# and the session that opened it cannot outlive it either). Each click on "Terminal"
# reuses the caller's running dashboard shell in that sandbox (tag
# "dashboard:<principal>") instead of starting another: a page left open, closed or
# reloaded no longer leaves a /bin/sh (a ring and one of the sandbox's process slots)
# behind for good (red team 19, noted).
TERMINAL_IDLE_S = 600.0
TERMINAL_TIMEOUT_S = float(sess.SESSION_MAX_AGE_S)
MAX_FORM_BYTES = 4096
_STATIC = Path(__file__).with_name("static")


class _Login(Exception):
    """No usable session: send the browser to the login form."""


class Dashboard:
    """The ``/ui`` pages over one :class:`ApiService`. ``root`` (set by the apiserver
    once its whole app exists) is where the terminal's WebSocket is handed on, to the
    REST process WebSocket route, with the session's key as its ``Authorization``."""

    def __init__(self, service: ApiService, *, clock: Callable[[], float] = time.time
                 ) -> None:
        self.service = service
        self.clock = clock
        self.root: Callable[[Any, Any, Any], Awaitable[None]] | None = None
        h = service.handler
        self._list, self._get, self._events = h(ops.LIST), h(ops.GET), h(ops.EVENTS)
        self._stats, self._nodes = h(ops.STATS), h(ops.NODES)
        self._process_start, self._processes = h(ops.PROCESS_START), h(ops.PROCESS_LIST)
        self._psignal = h(ops.PROCESS_SIGNAL)
        self.terminal_idle_s = TERMINAL_IDLE_S
        # dashboard shells this apiserver started or reused: who started them (the key
        # their end is sent with), open terminal sockets, the pending idle end
        self._shells: dict[tuple[str, int], Caller] = {}
        self._viewers: dict[tuple[str, int], int] = {}
        self._idle: dict[tuple[str, int], asyncio.TimerHandle] = {}
        self._actions: dict[str, Callable[[Caller, Any], Awaitable[Any]]] = {
            "pause": h(ops.PAUSE), "resume": h(ops.RESUME), "destroy": h(ops.DESTROY)}
        self.series = CreationSeries()

    # ------------------------------------------------------------------ routing
    def routes(self) -> list[BaseRoute]:
        return [Mount("/ui", routes=[
            Route("/", self._index),
            Route("/login", self._login_form, methods=["GET"]),
            Route("/login", self._login, methods=["POST"]),
            Route("/logout", self._logout, methods=["POST"]),
            Route("/nodes", self._page(self._nodes_page)),
            Route("/sandboxes", self._page(self._sandboxes_page)),
            Route("/sandboxes/{id}", self._page(self._sandbox_page)),
            Route("/sandboxes/{id}/{action}", self._page(self._action), methods=["POST"]),
            Route("/sandboxes/{id}/terminal/{pid:int}", self._page(self._terminal_page)),
            WebSocketRoute("/sandboxes/{id}/processes/{pid:int}/ws", _Asgi(self._terminal_ws)),
            Route("/rate", self._page(self._rate_page)),
            Mount("/static", app=_Headers(StaticFiles(directory=str(_STATIC))),
                  name="static"),
        ])]

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _html(body: str, status: int = 200, *, csp: str = CSP,
              headers: Mapping[str, str] | None = None) -> HTMLResponse:
        resp = HTMLResponse(body, status_code=status)
        resp.headers.update(_HEADERS)
        resp.headers["content-security-policy"] = csp
        if headers:
            resp.headers.update(headers)
        return resp

    @staticmethod
    def _secure(request: Request) -> bool:
        return request.url.scheme == "https"

    def _redirect(self, url: str, *, cookie: str | None = None) -> Response:
        resp = RedirectResponse(url, status_code=303)
        resp.headers.update(_HEADERS)
        if cookie is not None:
            resp.headers["set-cookie"] = cookie
        return resp

    def _caller(self, request: Request) -> tuple[Caller, str]:
        key = request.cookies.get(sess.COOKIE, "")
        if not sess.plausible_key(key):
            raise _Login
        try:
            return self.service.authenticate(key, _client(request.scope)), key
        except Unauthenticated:
            raise _Login from None

    def _page(self, view: Callable[[Request, Caller, str], Awaitable[Response]]
              ) -> Callable[[Request], Awaitable[Response]]:
        """A page or action behind the session: no session -> the login form; a
        ``DsecError`` -> an error page with its status and (redacted) message."""
        async def endpoint(request: Request) -> Response:
            try:
                caller, key = self._caller(request)
            except _Login:
                return self._redirect("/ui/login",
                                      cookie=sess.clear_cookie(secure=self._secure(request)))
            except DsecError as exc:     # rate limited
                return self._error(exc, None, "")
            try:
                # a door of the per-tenant reply budget (red team 21, B2): a page made of
                # a sandbox's events keeps them charged until it is written out
                with hold_replies() as leases:
                    resp = await view(request, caller, key)
                if leases:
                    return cast(Response, SentThenReleased(resp, leases))
                return resp
            except DsecError as exc:
                return self._error(exc, caller, key)
            except Exception as exc:
                log.exception("dashboard %s %s failed", request.method, request.url.path)
                return self._error(InternalError(f"internal error ({type(exc).__name__})"),
                                   caller, key)
        return endpoint

    def _error(self, exc: DsecError, caller: Caller | None, key: str) -> Response:
        exc = self.service.redact(exc)
        return self._html(render("error.html", status=exc.http_status, code=exc.code,
                                 message=exc.message, **self._chrome(caller, key)),
                          exc.http_status)

    @staticmethod
    def _chrome(caller: Caller | None, key: str, page: str = "") -> dict[str, Any]:
        if caller is None:
            return {"who": None, "csrf": "", "page": page}
        return {"who": caller.name, "csrf": sess.csrf_token(key), "page": page}

    async def _form(self, request: Request) -> dict[str, str]:
        """A small urlencoded form body (first value of each name)."""
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                raise InvalidArgument(f"form body over {MAX_FORM_BYTES} bytes")
        out: dict[str, str] = {}
        for k, v in parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True):
            out.setdefault(k, v)
        return out

    @staticmethod
    def _check_post(request: Request, form: Mapping[str, str] | None, key: str | None) -> None:
        if not sess.same_origin(request.headers, require_origin=True):
            raise PermissionDenied("cross-origin request refused: dashboard actions are "
                                   "accepted from the dashboard's own pages only")
        if key is not None and (form is None or not sess.csrf_ok(key, form.get("csrf"))):
            raise PermissionDenied("missing or wrong CSRF token: reload the page and try "
                                   "again")

    # ------------------------------------------------------------------ login
    async def _index(self, request: Request) -> Response:
        return self._redirect("/ui/sandboxes")

    async def _login_form(self, request: Request) -> Response:
        return self._html(render("login.html", error=None))

    async def _login(self, request: Request) -> Response:
        try:
            self._check_post(request, None, None)
            form = await self._form(request)
        except DsecError as exc:
            return self._html(render("login.html", error=exc.message), exc.http_status)
        key = form.get("key", "").strip()
        if not sess.plausible_key(key):
            return self._html(render("login.html", error="That is not an API key (they look "
                                     "like dsk_<16 hex>_<secret>)."), 400)
        try:
            self.service.authenticate(key, _client(request.scope))
        except DsecError as exc:   # unknown/revoked (charged to the address), rate limited
            return self._html(render("login.html", error=exc.message), exc.http_status)
        return self._redirect("/ui/sandboxes",
                              cookie=sess.session_cookie(key, secure=self._secure(request)))

    async def _logout(self, request: Request) -> Response:
        key = request.cookies.get(sess.COOKIE, "")
        try:
            form = await self._form(request)
            self._check_post(request, form, key)
        except DsecError as exc:
            return self._html(render("error.html", status=exc.http_status, code=exc.code,
                                     message=exc.message), exc.http_status)
        return self._redirect("/ui/login", cookie=sess.clear_cookie(secure=self._secure(request)))

    # ------------------------------------------------------------------ pages
    async def _nodes_page(self, request: Request, caller: Caller, key: str) -> Response:
        nodes = (await self._nodes(caller, Empty())).items
        return self._html(render("nodes.html", nodes=nodes, now=self.clock(),
                                 **self._chrome(caller, key, "nodes")))

    def _filters(self, request: Request) -> Filters:
        q = request.query_params
        unknown = set(q) - {"state", "project", "label", "node", "limit", "cursor"}
        if unknown:
            raise InvalidArgument(f"unknown query parameter {min(unknown)[:60]!r} (the "
                                  "page takes state, project, label, node, limit, cursor)")
        try:
            limit = int(q.get("limit") or 50)
        except ValueError:
            raise InvalidArgument("limit must be a number") from None
        if not 1 <= limit <= 200:
            raise InvalidArgument(f"limit={limit} must be within 1..200")
        state = q.get("state", "")
        if state not in ("", "running", "paused"):
            raise InvalidArgument(f"state must be running or paused, not {state[:40]!r}")
        return Filters(state=state, project=q.get("project", "").strip(),
                       labels=tuple(v.strip() for v in q.getlist("label") if v.strip()),
                       node=q.get("node", "").strip(), limit=limit,
                       cursor=q.get("cursor", ""))

    async def list_page(self, caller: Caller, f: Filters) -> SandboxesPage:
        """One page of the sandboxes list for ``f``, through the list operation's policy."""
        labels: dict[str, str] = {}
        for item in f.labels:
            k, eq, v = item.partition("=")
            if not eq or not k:
                raise InvalidArgument(f"label filter {item[:80]!r} must be key=value")
            labels[k] = v
        try:
            req = msgspec.convert({"project": f.project or None, "labels": labels,
                                   "state": f.state or None, "cursor": f.cursor or None,
                                   "limit": f.limit, "node": f.node or None},
                                  ListSandboxes)
        except msgspec.ValidationError as exc:
            if isinstance(exc.__cause__, DsecError):
                raise exc.__cause__ from None
            raise InvalidArgument(f"bad filter: {exc}") from None
        rep = await self._list(caller, req)
        return SandboxesPage(rep.items, rep.next_cursor)

    async def _sandboxes_page(self, request: Request, caller: Caller, key: str) -> Response:
        f = self._filters(request)
        page = await self.list_page(caller, f)
        return self._html(render("sandboxes.html", f=f, items=page.items,
                                 **sandboxes_links(f, page),
                                 **self._chrome(caller, key, "sandboxes")))

    async def _sandbox_page(self, request: Request, caller: Caller, key: str) -> Response:
        ref = _ref(request)
        info = await self._get(caller, ref)       # 404 for another project's, as REST
        events = (await self._events(caller, ref)).items
        stats: list[tuple[str, Any]] | None = None
        stats_error = ""
        procs: list[Any] = []
        if info.state in ("running", "paused"):
            try:
                # every field, zeros included (the wire form omits defaults)
                raw = msgspec.structs.asdict(await self._stats(caller, ref))
                stats = [(k, msgspec.to_builtins(v)) for k, v in raw.items()]
                procs = (await self._processes(caller, ref)).items
            except DsecError as exc:
                stats_error = self.service.redact(exc).message
        return self._html(render("sandbox.html", info=info, events=events, stats=stats,
                                 stats_error=stats_error, procs=procs,
                                 **self._chrome(caller, key, "sandboxes")))

    async def _action(self, request: Request, caller: Caller, key: str) -> Response:
        form = await self._form(request)
        self._check_post(request, form, key)
        ref = _ref(request)
        action = request.path_params["action"]
        if action == "terminal":
            pid = await self._start_terminal(caller, ref)
            return self._redirect(f"/ui/sandboxes/{quote(ref.id, safe='')}/terminal/{pid}")
        do = self._actions.get(action)
        if do is None:
            raise InvalidArgument(f"no dashboard action {action[:40]!r} (pause, resume, "
                                  "destroy, terminal)")
        await do(caller, ref)
        return self._redirect(f"/ui/sandboxes/{quote(ref.id, safe='')}")

    async def _start_terminal(self, caller: Caller, ref: SandboxRef) -> int:
        """A shell on a terminal in the sandbox (``process_start`` with a pty: member, as
        through REST), or the caller's dashboard shell already running there; the page
        then attaches to it by pid. See ``TERMINAL_IDLE_S`` for its end."""
        tag = _terminal_tag(caller)
        for p in (await self._processes(caller, ref)).items:
            if p.running and p.pty and p.tag == tag:
                pid = int(p.pid)
                break
        else:
            info = await self._process_start(caller, ExecCall(id=ref.id, req=ExecRequest(
                argv=TERMINAL_ARGV, pty=PtySize(cols=100, rows=30),
                timeout_s=TERMINAL_TIMEOUT_S, env={"TERM": "xterm-256color"}, tag=tag)))
            pid = int(info.pid)
        key = (ref.id, pid)
        self._shells[key] = caller
        if not self._viewers.get(key):
            self._arm_idle(key)           # ends unless a terminal connects in time
        return pid

    def _arm_idle(self, key: tuple[str, int]) -> None:
        old = self._idle.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._idle[key] = loop.call_later(
            self.terminal_idle_s, lambda: loop.create_task(self._end_idle(key)))

    async def _end_idle(self, key: tuple[str, int]) -> None:
        """The idle timer fired: end the shell if nobody has opened its terminal since."""
        self._idle.pop(key, None)
        if self._viewers.get(key):
            return
        caller = self._shells.pop(key, None)
        if caller is None:
            return
        sid, pid = key
        try:
            for p in (await self._processes(caller, SandboxRef(id=sid))).items:
                if p.pid == pid and p.running and p.tag == _terminal_tag(caller):
                    await self._psignal(caller, ProcessSignal(id=sid, pid=pid,
                                                              signal=signal.SIGKILL))
                    log.info("dashboard shell %d in %s ended: no terminal open for %g s",
                             pid, sid, self.terminal_idle_s)
        except DsecError as exc:          # gone with its sandbox, key revoked: nothing left
            log.info("dashboard shell %d in %s not ended: %s", pid, sid, exc.message)

    async def _terminal_page(self, request: Request, caller: Caller, key: str) -> Response:
        ref = _ref(request)
        await self._get(caller, ref)               # the same 404 as every other page
        return self._html(render("terminal.html", sid=ref.id, pid=request.path_params["pid"],
                                 **self._chrome(caller, key, "sandboxes")), csp=CSP_TERMINAL)

    async def _rate_page(self, request: Request, caller: Caller, key: str) -> Response:
        now = self.clock()
        self.follow(now)
        pts = self.series.series(lambda p: caller.role_on(p) is not None, now)
        c = chart(pts)
        return self._html(render("rate.html", bucket_label="minute", window_label="hour",
                                 **c, **self._chrome(caller, key, "rate")))

    def follow(self, now: float, *, rounds: int = 10) -> None:
        """Read the registry's event log from where the series left off and count its
        ``sandbox_added`` events: at most ``rounds`` x 1,000 events per page view (from
        the registry's in-memory ring when recent, else one indexed store read per
        1,000), and never more than ``FOLLOW_MAX_BEHIND`` back: a dashboard nobody
        looked at while the cluster made more events than that counts from there."""
        reg = getattr(self.service.directory, "registry", None)
        if reg is None:
            return
        s = self.series
        s.position = max(s.position, reg.committed_version - FOLLOW_MAX_BEHIND, 0)
        for _ in range(rounds):
            try:
                batch = reg.read(s.position, 1000)
            except Compacted as exc:
                s.position = int(exc.detail.get("oldest", reg.committed_version)) - 1
                continue
            if not batch:
                return
            for e in batch:
                if e.kind == "sandbox_added":
                    rec = e.payload.get("record") or {}
                    project = rec.get("project") if isinstance(rec, dict) else None
                    if isinstance(project, str):
                        s.add(e.time, project, now)
            s.position = batch[-1].version

    # ------------------------------------------------------------------ terminal
    async def _terminal_ws(self, scope: Any, receive: Any, send: Any) -> None:
        """The terminal's WebSocket: the session cookie and this origin checked, then
        handed to the REST process WebSocket with the key as ``Authorization`` (the
        browser never holds the key; the REST route checks the role as for any client)."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        cookies = _cookies(headers.get("cookie", ""))
        key = cookies.get(sess.COOKIE, "")
        ok = sess.plausible_key(key) and sess.same_origin(headers, require_origin=True)
        if ok:
            try:
                self.service.authenticate(key, _client(scope))
            except DsecError:
                ok = False
        if not ok or self.root is None:
            await receive()                       # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        sid, pid = scope["path_params"]["id"], scope["path_params"]["pid"]
        shell = (sid, int(pid))
        path = f"/v1/sandboxes/{quote(sid, safe='')}/processes/{pid}/ws"
        inner = dict(scope)
        inner["path"] = path
        inner["raw_path"] = path.encode()
        inner["root_path"] = ""
        inner["query_string"] = b""
        inner["headers"] = [(k, v) for k, v in scope["headers"]
                            if k not in (b"cookie", b"authorization")]
        inner["headers"].append((b"authorization", f"Bearer {key}".encode()))
        self._viewers[shell] = self._viewers.get(shell, 0) + 1
        idle = self._idle.pop(shell, None)
        if idle is not None:
            idle.cancel()
        try:
            await self.root(inner, receive, send)
        finally:
            left = self._viewers.get(shell, 0) - 1
            if left > 0:
                self._viewers[shell] = left
            else:
                self._viewers.pop(shell, None)
                if shell in self._shells:     # only the shells the dashboard started
                    self._arm_idle(shell)


def _terminal_tag(caller: Caller) -> str:
    """The tag of ``caller``'s dashboard shells (reused per principal and sandbox)."""
    return f"dashboard:{caller.name[:200]}"


class _Asgi:
    """Wraps a coroutine as an ASGI app (Starlette routes a non-function endpoint as
    one: the terminal WebSocket is handed on whole, not accepted here)."""

    def __init__(self, fn: Callable[[Any, Any, Any], Awaitable[None]]) -> None:
        self.fn = fn

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.fn(scope, receive, send)


class _Headers:
    """Adds ``nosniff`` (and no framing) to the static files' responses."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_with(msg: Any) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []),
                                          (b"x-content-type-options", b"nosniff"),
                                          (b"x-frame-options", b"DENY")]}
            await send(msg)
        await self.app(scope, receive, send_with)


def _ref(request: Request) -> SandboxRef:
    try:
        return SandboxRef(id=str(request.path_params["id"]))
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(str(exc)) from None


def _cookies(header: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in header.split(";"):
        k, eq, v = part.strip().partition("=")
        if eq:
            out.setdefault(k, v)
    return out


def _client(scope: Any) -> str | None:
    client = scope.get("client")
    if client and isinstance(client[0], str) and client[0]:
        return client[0]
    return None
