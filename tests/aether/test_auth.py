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


# ------------------------------------------------- the connection's context (issue 13, C1)
class _Session:
    def __init__(self, key: str, peer: str) -> None:
        self.key, self.peer = key, peer


async def test_authenticator_context_reaches_handlers_added_with_context() -> None:
    """The credential is checked once per connection; what the authenticator returns is
    handed to every ``with_context`` handler (sync, async, streaming) of that connection,
    and only of that one."""
    from dsec.aether import StreamSender

    seen: list[str] = []

    def admit(credential: bytes, peer: str) -> _Session:
        key = credential.decode()
        if not key.startswith("key-"):
            raise Unauthenticated(f"unknown key {key!r}")
        seen.append(key)
        return _Session(key, peer)

    r = Router(authenticate=admit, credential="API key")
    r.add("whoami", lambda ctx, body: [ctx.key, body], with_context=True)

    async def whoami_async(ctx: _Session, body: int) -> list[object]:
        return [ctx.key, body]

    async def whoami_stream(ctx: _Session, body: int, out: StreamSender) -> str:
        for i in range(body):
            await out.send(f"{ctx.key}:{i}")
        return ctx.key

    r.add("whoami_async", whoami_async, with_context=True)
    r.add("whoami_stream", whoami_stream, with_context=True, streaming=True)
    r.add("plain", lambda body: body)           # no context: the body alone, as before
    server = await serve(r, "tcp:127.0.0.1:0")
    try:
        a = await connect(server.address, token="key-a")
        b = await connect(server.address, token="key-b")
        assert await a.call("whoami", 1) == ["key-a", 1]
        assert await b.call("whoami", 2) == ["key-b", 2]
        assert await a.call("whoami_async", 3) == ["key-a", 3]
        assert await b.call("whoami_async", 4) == ["key-b", 4]
        s = b.stream("whoami_stream", 2)
        assert [x async for x in s] == ["key-b:0", "key-b:1"]
        assert s.result == "key-b"
        assert await a.call("plain", 5) == 5
        assert seen == ["key-a", "key-b"]       # once per connection, not per call
        assert a.auth_context is None           # the dialing side holds no server context
        with pytest.raises(Unauthenticated, match="unknown key 'nope'"):
            await connect(server.address, token="nope")
        await a.close()
        await b.close()
    finally:
        await server.close()


async def test_post_init_refusal_is_the_error_itself() -> None:
    """A body whose type refuses it in ``__post_init__`` answers with that DsecError (class,
    message and detail), not a generic "does not decode" InvalidArgument: the same words
    every door gives."""
    import msgspec

    from dsec.errors import InvalidArgument, PayloadTooLarge

    class Bounded(msgspec.Struct, frozen=True):
        argv: list[str]

        def __post_init__(self) -> None:
            if len(self.argv) > 3:
                raise PayloadTooLarge(f"argv has {len(self.argv)} items; at most 3 are allowed",
                                      field="argv", size=len(self.argv), limit=3)

    r = Router()
    r.add("run", lambda body: len(body.argv), request_type=Bounded)
    server = await serve(r, "tcp:127.0.0.1:0")
    try:
        c = await connect(server.address)
        assert await c.call("run", {"argv": ["a"]}) == 1
        with pytest.raises(PayloadTooLarge) as ei:
            await c.call("run", {"argv": ["a", "b", "c", "d"]})
        assert str(ei.value) == "argv has 4 items; at most 3 are allowed"
        assert ei.value.detail == {"field": "argv", "size": 4, "limit": 3}
        # a body of the wrong shape is still the decode error, naming the type
        with pytest.raises(InvalidArgument, match="the run request does not decode"):
            await c.call("run", {"argv": "not a list"})
        assert await c.call("run", {"argv": []}) == 0   # the connection is still fine
        await c.close()
    finally:
        await server.close()


async def test_a_second_guess_pipelined_behind_a_wrong_one_is_not_served(
    router: Router,
) -> None:
    """One guess per connection, even when the guesses arrive in one write: the wrong
    token's refusal is a GOAWAY, and the right token sent right behind it is never checked
    (it used to be, before the close scheduled for the refusal had run)."""
    import asyncio

    server = await serve(router, "tcp:127.0.0.1:0")
    try:
        c = await connect(server.address)
        wrong, right = await asyncio.gather(
            c.call(AUTH_METHOD, b"guess"), c.call(AUTH_METHOD, b"s3cret-token"),
            return_exceptions=True)
        assert isinstance(wrong, Unauthenticated)
        assert isinstance(right, ConnectionLost), right
        assert right.detail.get("retryable") is True    # not processed: a retry is safe
        with pytest.raises(ConnectionLost):
            await c.call("echo", 1)
        await c.close()
    finally:
        await server.close()
