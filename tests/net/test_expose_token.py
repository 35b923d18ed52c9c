"""Port URL tokens (dsec.net.expose), pure: a token names exactly one (sandbox, port,
generation, expiry); changing any of them, or any character of the MAC, or using another
key, fails; an expired one says so."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.errors import PermissionDenied, Unauthenticated
from dsec.net.expose import TokenKey, proxy_path

KEY = TokenKey(b"k" * 32)
SID = "sb-0123456789ab-edge-0"
NOW = 1_800_000_000.0

sids = st.from_regex(r"sb-[0-9a-f]{12}-[a-z0-9-]{1,20}", fullmatch=True)
ports = st.integers(1, 65535)
gens = st.integers(1, 2**62)


@settings(max_examples=200, deadline=None)
@given(sids, ports, gens, st.integers(1, 30 * 86400))
def test_a_token_opens_exactly_what_it_names(sid: str, port: int, gen: int, ttl: int) -> None:
    tok = KEY.mint(sid, port, gen, NOW + ttl)
    assert KEY.verify(tok, sid, port, NOW) == gen
    with pytest.raises(Unauthenticated):
        KEY.verify(tok, sid, port % 65535 + 1, NOW)
    with pytest.raises(Unauthenticated):
        KEY.verify(tok, sid + "x", port, NOW)
    with pytest.raises(Unauthenticated):
        TokenKey(b"x" * 32).verify(tok, sid, port, NOW)
    _, g, exp, mac = tok.split(".")
    for forged in (f"v1.{int(g) + 1}.{exp}.{mac}", f"v1.{g}.{int(exp) + 86400}.{mac}"):
        with pytest.raises(Unauthenticated):
            KEY.verify(forged, sid, port, NOW)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 42), st.sampled_from("ABab019_-"))
def test_any_changed_mac_character_fails(i: int, c: str) -> None:
    tok = KEY.mint(SID, 8000, 7, NOW + 60)
    head, mac = tok.rsplit(".", 1)
    if mac[i] == c:
        return
    with pytest.raises(Unauthenticated, match="not valid for port 8000"):
        KEY.verify(f"{head}.{mac[:i]}{c}{mac[i + 1:]}", SID, 8000, NOW)


def test_malformed_and_expired_tokens_are_named() -> None:
    for bad in ("", "v1", "v2.1.2." + "A" * 43, "v1.1.2." + "A" * 42, "v1.-1.2." + "A" * 43,
                "v1.1.2." + "A" * 43 + "\n", "v1.1.2." + "=" * 43):
        with pytest.raises(Unauthenticated, match="malformed port token"):
            KEY.verify(bad, SID, 8000, NOW)
    tok = KEY.mint(SID, 8000, 7, NOW + 10)
    assert KEY.verify(tok, SID, 8000, NOW + 9) == 7
    with pytest.raises(PermissionDenied, match="expired"):
        KEY.verify(tok, SID, 8000, NOW + 10)
    with pytest.raises(ValueError):
        TokenKey(b"short")
    assert proxy_path(SID, 80) == f"/v1/proxy/{SID}/80/"


def test_the_cluster_keeps_one_token_key_in_its_state_dir(tmp_path: object) -> None:
    """A restarted apiserver honours the URLs it handed out: the key is made once (0600,
    whole or not at all) and read back; a damaged one is refused, not silently replaced."""
    import os
    import stat

    from dsec.cluster.runtime import _port_token_key
    from dsec.errors import InvalidArgument

    d = str(tmp_path)
    key = _port_token_key(d)
    assert len(key) == 32 and _port_token_key(d) == key
    path = os.path.join(d, "port-token.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(d)) == ["port-token.key"]     # no temporary file left
    with open(path, "wb") as f:
        f.write(b"short")
    with pytest.raises(InvalidArgument, match="holds 5 bytes, not a 32-byte key"):
        _port_token_key(d)
