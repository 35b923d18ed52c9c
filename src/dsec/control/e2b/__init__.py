"""dsec's E2B-compatible API (issue 20): E2B's control REST and envd protocol, served on
a listener of its own by the apiserver (``dsec up --e2b``, ``dsec apiserver --e2b``),
carried out by dsec's own operations. docs/e2b.md says how to point the stock SDK at it
(``E2B_API_URL`` and ``E2B_SANDBOX_URL``), the mapping and the gaps."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from dsec.control.e2b.app import E2BApp, E2BConfig
from dsec.control.e2b.coalesce import coalescing_protocol
from dsec.errors import InvalidArgument, TransportError

__all__ = ["E2BApp", "E2BConfig", "E2BServer", "start_e2b"]


class E2BServer:
    """A running E2B listener: ``url`` (what ``E2B_API_URL``/``E2B_SANDBOX_URL`` name)."""

    def __init__(self, server: Any, task: asyncio.Task[Any], url: str, app: E2BApp) -> None:
        self.server, self.task, self.url, self.app = server, task, url, app

    async def stop(self) -> None:
        await self.app.watchers.close()
        self.server.should_exit = True
        # in-flight requests finish (10 s at most); asyncio.wait neither cancels the
        # server's task at its timeout nor swallows a cancel of this stop()
        done, _ = await asyncio.wait({self.task}, timeout=10.0)
        if not done:
            self.task.cancel()
        elif not self.task.cancelled():
            self.task.result()          # a server that failed says so, as before


async def start_e2b(service: Any, listen: str, *, config: E2BConfig | None = None,
                    tls_cert: str | None = None, tls_key: str | None = None,
                    limits: Any = None) -> E2BServer:
    """Serve the E2B layer of ``service`` on ``listen`` (``HOST:PORT``; port 0 picks
    one), with TLS when ``tls_cert``/``tls_key`` are given (``E2B_DOMAIN`` set-ups: the
    SDK speaks https to ``{port}-{id}.{domain}``). The same guarded uvicorn listener as
    dsec's REST (connection caps, header deadlines)."""
    from dsec.control.api.http_limits import uvicorn_server
    host, _, port_s = listen.rpartition(":")
    if not host or not port_s.isdigit():
        raise InvalidArgument(f"--e2b {listen!r} must be HOST:PORT, e.g. 127.0.0.1:3000 "
                              "(port 0 picks a free port)")
    sock = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), int(port_s)))
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot listen on {listen} for the E2B API: "
                             f"{exc.strerror or exc}; pick another --e2b address") from exc
    sock.listen(1024)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    app = E2BApp(service, config)
    server, _ = uvicorn_server(app, limits, name=f"E2B listener {listen}")
    # the small writes of one loop step leave as one (headers with the first body, the
    # end of a stream with its terminator): dsec.control.e2b.coalesce
    protocol = server.config.http
    if isinstance(protocol, type):          # uvicorn_server's guarded protocol class
        server.config.http = coalescing_protocol(protocol)
    scheme = "http"
    if tls_cert:
        # uvicorn builds its SSL context in Config.load() (run by serve()) from these;
        # it offers no ALPN, so the SDK's client speaks HTTP/1.1 (uvicorn has no h2)
        server.config.ssl_certfile, server.config.ssl_keyfile = tls_cert, tls_key
        scheme = "https"
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise TransportError(f"the E2B listener on {listen} stopped at start-up")
        await asyncio.sleep(0.005)
    return E2BServer(server, task, f"{scheme}://{host}:{port}", app)
