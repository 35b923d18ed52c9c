"""What the rollout worker knows about bearer keys, and how often it may ask (red17 F6).

The worker cannot check a project API key itself: it asks the apiserver (``info``). Anyone
who reaches the trainer API may send keys, so without bounds an unauthenticated flood of
distinct junk keys is a flood of apiserver calls from the worker's address (which the
apiserver then rate-limits *against the worker*: the trainer's own re-checks fail). The
bounds, pure and clock-injected (the worker's HTTP layer carries them out):

- a key that cannot be a dsec key (``dsk_<16 hex>_<43 chars>``, the shape
  :mod:`dsec.control.iam` mints) is refused without asking;
- verdicts are cached by the key's sha256 in a bounded LRU (a refused key for
  ``unknown_s``, a good one for the worker's ``auth_cache_s``); a full cache drops its
  least recently used entry, never every entry;
- asking about a key this worker has never seen good spends a token of a per-peer bucket
  and of one global bucket: past them the request gets 429 at once. A key seen good
  before (a trainer's key whose cache entry aged out) does not wait on those buckets, so
  a flood cannot lock the trainer out.

So a flood costs at most ``global_burst + global_per_s * seconds`` apiserver calls,
whatever the number of keys or peers.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from dsec.net.dnspolicy import TokenBucket

__all__ = ["AuthLimits", "KeyVerdict", "KeyVerdicts", "looks_like_api_key"]

#: the shape of a key minted by dsec.control.iam (``dsk_<key id>_<secret>``)
_KEY_RE = re.compile(r"dsk_[0-9a-f]{16}_[A-Za-z0-9_-]{43}")


def looks_like_api_key(key: str) -> bool:
    """Whether ``key`` has the shape of a dsec API key (anything else is refused unasked)."""
    return _KEY_RE.fullmatch(key) is not None


class KeyVerdict(msgspec.Struct, frozen=True):
    """The apiserver's answer about one key, until ``until`` (monotonic seconds)."""

    ok: bool
    role: str | None
    until: float
    unknown: bool = False       # the apiserver did not know the key (401)


@dataclass(frozen=True, kw_only=True)
class AuthLimits:
    """Bounds on the worker's key lookups."""

    max_entries: int = 10_000       # cached verdicts (LRU); ~200 B each
    unknown_s: float = 5.0          # how long a refused key stays refused unasked
    global_per_s: float = 2.0       # lookups of never-good keys, all peers together
    global_burst: float = 8.0
    peer_per_s: float = 0.5         # ... from one peer address
    peer_burst: float = 4.0
    max_peers: int = 4096           # per-peer buckets kept (LRU)


@dataclass
class KeyVerdicts:
    """Cached verdicts by key hash, plus the lookup budget."""

    limits: AuthLimits = field(default_factory=AuthLimits)
    _cache: OrderedDict[str, KeyVerdict] = field(default_factory=OrderedDict)
    _good: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _peers: OrderedDict[str, TokenBucket] = field(default_factory=OrderedDict)
    _global: TokenBucket | None = None

    def get(self, key_hash: str, now: float) -> KeyVerdict | None:
        """The cached verdict, or None when there is none or it expired."""
        got = self._cache.get(key_hash)
        if got is None or got.until < now:
            return None
        self._cache.move_to_end(key_hash)
        return got

    def put(self, key_hash: str, verdict: KeyVerdict) -> None:
        self._cache[key_hash] = verdict
        self._cache.move_to_end(key_hash)
        while len(self._cache) > self.limits.max_entries:
            self._cache.popitem(last=False)
        if verdict.ok:
            self._good[key_hash] = None
            self._good.move_to_end(key_hash)
            while len(self._good) > self.limits.max_entries:
                self._good.popitem(last=False)

    def may_ask(self, key_hash: str, peer: str, now: float) -> bool:
        """Whether the apiserver may be asked about this key now (spends the budget)."""
        if key_hash in self._good:
            return True
        lim = self.limits
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = self._peers[peer] = TokenBucket(lim.peer_per_s, lim.peer_burst)
            while len(self._peers) > lim.max_peers:
                self._peers.popitem(last=False)
        self._peers.move_to_end(peer)
        if self._global is None:
            self._global = TokenBucket(lim.global_per_s, lim.global_burst)
        # the peer's token first: a peer over its own budget spends nobody else's
        return bucket.take(now) and self._global.take(now)
