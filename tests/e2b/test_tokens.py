"""The E2B layer's per-sandbox access tokens (dsec.control.e2b.tokens; red team 21, B8),
pure: a token opens only for its sandbox and scope, under the key that sealed it, never
shows the API key, and a forged, cut or grown one is refused without echoing it."""

from __future__ import annotations

import base64
import itertools

import pytest

from dsec.control.e2b.tokens import PREFIX, SandboxTokens, is_token
from dsec.errors import Unauthenticated

KEY = "dsk_0123456789abcdef_" + "A" * 43
SECRET = b"s" * 32


def test_a_token_opens_for_its_sandbox_and_scope_only() -> None:
    t = SandboxTokens(SECRET)
    envd = t.mint(KEY, "sb-aaaa-n1", "envd")
    traffic = t.mint(KEY, "sb-aaaa-n1", "traffic")
    assert is_token(envd) and is_token(traffic) and envd != traffic
    assert KEY not in envd and "0123456789abcdef" not in envd    # the key never shows
    assert t.open(envd, "sb-aaaa-n1", ("envd",)) == KEY
    assert t.open(traffic, "sb-aaaa-n1", ("envd", "traffic")) == KEY
    with pytest.raises(Unauthenticated, match="not valid for sandbox sb-bbbb-n1"):
        t.open(envd, "sb-bbbb-n1", ("envd",))
    with pytest.raises(Unauthenticated, match="traffic access token is not accepted"):
        t.open(traffic, "sb-aaaa-n1", ("envd",))
    # the scope written in the token is only a hint: relabelled, the seal breaks
    relabelled = envd.replace(f"{PREFIX}envd.", f"{PREFIX}traffic.")
    with pytest.raises(Unauthenticated, match="not valid"):
        t.open(relabelled, "sb-aaaa-n1", ("traffic",))


def test_every_replica_with_the_same_secret_opens_it_and_no_other_does() -> None:
    token = SandboxTokens(SECRET).mint(KEY, "sb-1", "envd")
    assert SandboxTokens(SECRET).open(token, "sb-1", ("envd",)) == KEY
    with pytest.raises(Unauthenticated, match="not valid"):
        SandboxTokens(b"t" * 32).open(token, "sb-1", ("envd",))


def test_forged_cut_and_hostile_tokens_are_refused_without_echo() -> None:
    t = SandboxTokens(SECRET, nonce=lambda n: bytes(n))
    good = t.mint(KEY, "sb-1", "envd")
    body = good[len(PREFIX) + len("envd."):]
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    flipped = raw[:20] + bytes([raw[20] ^ 1]) + raw[21:]
    forged = [
        good[:-1], good + "A", PREFIX + "envd." + base64.urlsafe_b64encode(
            flipped).rstrip(b"=").decode(), PREFIX + "envd.", PREFIX + "envd.!!!!",
        PREFIX + "admin." + body, PREFIX + "envd." + "A" * 600, "dsk_" + good, "x" * 10]
    for bad in forged:
        with pytest.raises(Unauthenticated) as exc:
            t.open(bad, "sb-1", ("envd",))
        assert body[:20] not in exc.value.message and KEY not in exc.value.message
    # a fresh nonce per mint: two tokens of one sandbox differ, both open
    counter = itertools.count()
    t2 = SandboxTokens(SECRET, nonce=lambda n: next(counter).to_bytes(n, "big"))
    a, b = t2.mint(KEY, "sb-1", "envd"), t2.mint(KEY, "sb-1", "envd")
    assert a != b and t2.open(a, "sb-1", ("envd",)) == t2.open(b, "sb-1", ("envd",)) == KEY
    with pytest.raises(ValueError):
        SandboxTokens(b"short")


def test_opened_tokens_are_cached_but_still_bound_to_sandbox_and_scope() -> None:
    """The LRU of opened tokens (one AES-GCM open per token, not per call) answers only
    for the sandbox and scope a token was opened for, and stays bounded."""
    import dsec.control.e2b.tokens as tokmod

    t = SandboxTokens(SECRET)
    envd = t.mint(KEY, "sb-aaaa-n1", "envd")
    assert t.open(envd, "sb-aaaa-n1", ("envd",)) == KEY
    assert t.open(envd, "sb-aaaa-n1", ("envd",)) == KEY          # from the cache
    with pytest.raises(Unauthenticated, match="not valid for sandbox sb-bbbb-n1"):
        t.open(envd, "sb-bbbb-n1", ("envd",))
    with pytest.raises(Unauthenticated, match="envd access token is not accepted"):
        t.open(envd, "sb-aaaa-n1", ("traffic",))
    # a refused token is never cached: it is refused again, the same way
    forged = envd[:-2] + ("AA" if envd[-2:] != "AA" else "BB")
    for _ in range(2):
        with pytest.raises(Unauthenticated, match="not valid"):
            t.open(forged, "sb-aaaa-n1", ("envd",))
    for i in range(tokmod.OPENED_CACHE + 10):
        t.open(t.mint(KEY, f"sb-{i}", "envd"), f"sb-{i}", ("envd",))
    assert len(t._opened) == tokmod.OPENED_CACHE
    assert envd not in t._opened                                   # the oldest went
    assert t.open(envd, "sb-aaaa-n1", ("envd",)) == KEY            # and opens again
