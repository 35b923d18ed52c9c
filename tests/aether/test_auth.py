"""Token authentication: an endpoint whose Router has a token serves nothing before it."""

from __future__ import annotations

import os

import pytest

from dsec.aether import Router, connect, serve
from dsec.aether.connection import AUTH_METHOD
from dsec.errors import ConnectionLost, Unauthenticated


@pytest.fixture
def router() -> Router:
    r = Router(token=b"s3cret-token")
    r.add("echo", lambda body: body)
    return r


@pytest.mark.parametrize("kind", ["tcp", "unix"])
async def test_token_required_before_any_method(router: Router, kind: str, tmp_path: object
                                                ) -> None:
    addr = "tcp:127.0.0.1:0" if kind == "tcp" else f"unix:{os.path.join(str(tmp_path), 's')}"
    server = await serve(router, addr)
    try:
        anon = await connect(server.address)
        with pytest.raises(Unauthenticated, match="requires a token"):
            await anon.call("echo", 1)
        # Still open: the one allowed call is the auth call.
        assert await anon.call(AUTH_METHOD, b"s3cret-token") is None
        assert await anon.call("echo", 2) == 2
        await anon.close()

        good = await connect(server.address, token="s3cret-token")
        assert await good.call("echo", 3) == 3
        await good.close()

        with pytest.raises(Unauthenticated, match="wrong Aether token"):
            await connect(server.address, token="guess")
        bad = await connect(server.address)
        with pytest.raises(Unauthenticated):
            await bad.call(AUTH_METHOD, b"guess")
        with pytest.raises(ConnectionLost):
            await bad.call(AUTH_METHOD, b"s3cret-token")  # one guess per connection
    finally:
        await server.close()


async def test_no_token_means_open(tmp_path: object) -> None:
    r = Router()
    r.add("echo", lambda body: body)
    server = await serve(r, "tcp:127.0.0.1:0")
    try:
        c = await connect(server.address)
        assert await c.call("echo", "x") == "x"
        await c.close()
    finally:
        await server.close()
