"""Pure parts of the apiserver: rate limiter, idempotency cache, sweeper decisions, the
service's auth cache, failed-auth budget and error redaction."""

from __future__ import annotations

import asyncio

import pytest

from dsec.control.api.service import ApiConfig, ApiService, Caller
from dsec.control.idempotency import IdempotencyCache, fingerprint
from dsec.control.metrics import ApiMetrics
from dsec.control.ratelimit import RateLimitConfig, RateLimiter
from dsec.control.store import open_store
from dsec.control.sweeper import Session, SweepCandidate, plan_sweep
from dsec.errors import Conflict, ImageNotFound, InvalidArgument, RateLimited, Unauthenticated


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_refuses_after_burst_and_refills() -> None:
    clock = Clock()
    rl = RateLimiter(RateLimitConfig(rate_per_s=10.0, burst=3.0), clock=clock)
    assert [rl.acquire("k") for _ in range(3)] == [None, None, None]
    wait = rl.acquire("k")
    assert wait == pytest.approx(0.1)
    assert rl.acquire("other") is None  # buckets are per key
    clock.t += 0.11
    assert rl.acquire("k") is None
    assert RateLimiter.retry_after_header(0.1) == "1"
    assert RateLimiter.retry_after_header(2.2) == "3"


def test_rate_limiter_memory_is_bounded() -> None:
    rl = RateLimiter(RateLimitConfig(rate_per_s=1.0, burst=1.0, max_keys=100), clock=Clock())
    for i in range(1000):
        rl.acquire(f"k{i}")
    assert len(rl) == 100


def test_rate_limit_config_rejects_nonsense() -> None:
    with pytest.raises(InvalidArgument):
        RateLimitConfig(rate_per_s=0)
    assert RateLimiter(RateLimitConfig(rate_per_s=None), clock=Clock()).acquire("k") is None


async def test_idempotency_replay_wait_conflict_and_expiry(store_url: str) -> None:
    clock = Clock()
    store = open_store(store_url)
    cache = IdempotencyCache(clock=clock, ttl_s=300, store=store)
    key = IdempotencyCache.scoped("alice", "k1")
    fp = fingerprint(b'{"image":"base"}')
    first = cache.begin(key, fp)
    assert first.proceed
    second = cache.begin(key, fp)           # a racing retry waits for the first
    assert second.wait is not None and not second.wait.done()
    with pytest.raises(Conflict, match="different request body"):
        cache.begin(key, fingerprint(b"{}"))
    cache.finish(key, b"answer")
    assert await asyncio.wait_for(second.wait, 1) == b"answer"
    assert cache.begin(key, fp).replay == b"answer"
    # Another replica (fresh cache, same store) honours the key.
    other = IdempotencyCache(clock=clock, ttl_s=300, store=store)
    assert other.begin(key, fp).replay == b"answer"
    clock.t += 301
    assert other.begin(IdempotencyCache.scoped("alice", "k1"), fp).proceed  # expired
    store.close()


async def test_idempotency_abort_lets_a_retry_proceed() -> None:
    cache = IdempotencyCache(clock=Clock(), ttl_s=300, max_entries=10)
    key = IdempotencyCache.scoped("bob", "k")
    assert cache.begin(key, "fp").proceed
    waiter = cache.begin(key, "fp").wait
    cache.abort(key, InvalidArgument("create failed"))
    assert waiter is not None and isinstance(waiter.exception(), InvalidArgument)
    assert cache.begin(key, "fp").proceed
    for i in range(50):
        k = IdempotencyCache.scoped("bob", f"x{i}")
        cache.begin(k, "fp")
        cache.finish(k, b"r")
    assert len(cache) <= 10
    with pytest.raises(InvalidArgument):
        IdempotencyCache.scoped("bob", "")


def test_sweeper_plan() -> None:
    sessions = {
        "ses-live": Session("ses-live", "p", 60, expires_at=200.0),
        "ses-dead": Session("ses-dead", "p", 60, expires_at=50.0),
        "ses-closed": Session("ses-closed", "p", 60, expires_at=500.0, closed=True),
    }
    cands = [SweepCandidate("a", "ses-live", "running"), SweepCandidate("b", "ses-dead", "paused"),
             SweepCandidate("c", "ses-closed", "running"),
             SweepCandidate("d", "ses-unknown", "running"),
             SweepCandidate("e", "ses-dead", "destroyed")]
    assert plan_sweep(100.0, cands, sessions, started_at=0.0, unknown_grace_s=180) == [
        ("b", "session_expired"), ("c", "session_closed")]
    assert ("d", "session_unknown") in plan_sweep(
        300.0, cands, sessions, started_at=0.0, unknown_grace_s=180)


def test_peek_takes_nothing() -> None:
    clock = Clock()
    rl = RateLimiter(RateLimitConfig(rate_per_s=1.0, burst=2.0), clock=clock)
    assert rl.peek("a") is None                       # unknown key: a full bucket
    assert rl.acquire("a") is None and rl.acquire("a") is None
    assert rl.peek("a") == pytest.approx(1.0)
    assert rl.peek("a") == pytest.approx(1.0)         # peeking again took nothing
    clock.t += 1.0
    assert rl.peek("a") is None and rl.acquire("a") is None


class _Keys:
    """Authority fake (the boundary under test is ApiService's cache and limiter)."""

    def __init__(self) -> None:
        self.valid = {"dsk_00000000000000aa_" + "a" * 43: "alice"}
        self.calls = 0

    def authenticate(self, api_key: str) -> Caller:
        self.calls += 1
        who = self.valid.get(api_key)
        if who is None:
            raise Unauthenticated("API key is not valid")
        return Caller(id=who, name=who, roles={"team": "member"})


def _service(keys: _Keys, clock: Clock, **cfg: object) -> ApiService:
    return ApiService(authority=keys, directory=None, placer=None, quotas=None,  # type: ignore[arg-type]
                      limiter=RateLimiter(RateLimitConfig(rate_per_s=None), clock=clock),
                      idempotency=IdempotencyCache(clock=clock), metrics=ApiMetrics(),
                      config=ApiConfig(**cfg), clock=clock,  # type: ignore[arg-type]
                      anon_limiter=RateLimiter(RateLimitConfig(rate_per_s=1.0, burst=2.0),
                                               clock=clock))


def test_failed_auth_budget_is_per_address_and_spares_known_keys() -> None:
    keys, clock = _Keys(), Clock()
    svc = _service(keys, clock)
    good = next(iter(keys.valid))
    assert svc.authenticate(f"Bearer {good}", "10.0.0.1").id == "alice"
    for _ in range(2):
        with pytest.raises(Unauthenticated):
            svc.authenticate("Bearer dsk_bad", "10.0.0.1")
    calls = keys.calls
    with pytest.raises(RateLimited) as over:
        svc.authenticate("Bearer dsk_bad", "10.0.0.1")
    assert keys.calls == calls                        # refused before any key check
    assert over.value.detail["retry_after"] == pytest.approx(1.0)
    with pytest.raises(RateLimited):
        svc.authenticate(None, "10.0.0.1")
    with pytest.raises(Unauthenticated):              # another address has its own budget
        svc.authenticate("Bearer dsk_bad", "10.0.0.2")
    clock.t += 60.0                                   # cache entry due for re-checking
    assert svc.authenticate(f"Bearer {good}", "10.0.0.1").id == "alice"
    keys.valid.clear()                                # revoked elsewhere
    clock.t += 60.0
    with pytest.raises(Unauthenticated):              # re-checked: refused, and charged
        svc.authenticate(f"Bearer {good}", "10.0.0.1")
    with pytest.raises(Unauthenticated):
        svc.authenticate(f"Bearer {good}", "10.0.0.1")
    with pytest.raises(RateLimited):                  # no longer known good: pre-checked
        svc.authenticate(f"Bearer {good}", "10.0.0.1")


def test_forget_key_and_principal_drop_cached_authentications() -> None:
    keys, clock = _Keys(), Clock()
    svc = _service(keys, clock)
    good = next(iter(keys.valid))
    svc.authenticate(good)
    keys.valid.clear()
    assert svc.authenticate(good).id == "alice"       # cached for principal_cache_s
    svc.forget_principal("bob")
    assert svc.authenticate(good).id == "alice"
    svc.forget_key("00000000000000aa")
    with pytest.raises(Unauthenticated):
        svc.authenticate(good)


def test_redact_replaces_host_paths_and_keeps_the_class() -> None:
    svc = _service(_Keys(), Clock(), redact_paths=("/var/lib/dsec-state",))
    err = ImageNotFound("no image x:latest in /var/lib/dsec-state/layers", ref="x",
                        path="/var/lib/dsec-state/layers/x")
    out = svc.redact(err)
    assert type(out) is ImageNotFound and out.code == "image_not_found"
    assert out.message == "no image x:latest in <state-dir>/layers"
    assert out.detail == {"ref": "x", "path": "<state-dir>/layers/x"}
    same = InvalidArgument("nothing to hide")
    assert svc.redact(same) is same
