"""The worker's key verdict cache and lookup budget (pure; red17 F6)."""

from __future__ import annotations

from dsec.rl.worker.auth import AuthLimits, KeyVerdict, KeyVerdicts, looks_like_api_key


def test_only_the_shape_iam_mints_passes_the_local_check() -> None:
    assert looks_like_api_key("dsk_0123456789abcdef_" + "A" * 43)
    for bad in ("junk-0001", "dsec_nope", "dsk_0123456789abcdef_" + "A" * 42,
                "dsk_0123456789ABCDEF_" + "A" * 43, "dsk_0123456789abcdef_" + "A" * 43 + "\n"):
        assert not looks_like_api_key(bad), bad


def test_a_full_cache_drops_its_oldest_entry_not_every_entry() -> None:
    v = KeyVerdicts(AuthLimits(max_entries=3))
    good = KeyVerdict(ok=True, role="member", until=100.0)
    v.put("trainer", good)
    for i in range(10):
        v.get("trainer", 1.0)       # in use: stays
        v.put(f"junk{i}", KeyVerdict(ok=False, role=None, until=100.0, unknown=True))
    assert v.get("trainer", 1.0) == good
    assert v.get("junk0", 1.0) is None and v.get("junk9", 1.0) is not None
    assert v.get("trainer", 101.0) is None      # expired


def test_the_budget_bounds_lookups_per_peer_and_overall_but_not_known_good_keys() -> None:
    v = KeyVerdicts(AuthLimits(global_per_s=1.0, global_burst=4.0, peer_per_s=0.5,
                               peer_burst=2.0))
    v.put("trainer", KeyVerdict(ok=True, role="member", until=0.0))     # aged out
    assert [v.may_ask(f"k{i}", "p1", 0.0) for i in range(4)] == [True, True, False, False]
    assert [v.may_ask(f"j{i}", f"p{i + 2}", 0.0) for i in range(4)] == [
        True, True, False, False]      # the global burst (4) is spent
    assert v.may_ask("trainer", "p1", 0.0)  # a key seen good is asked about regardless
    assert v.may_ask("k9", "p9", 1.0)       # a second later: one global token back
    assert not v.may_ask("k10", "p8", 1.0)
