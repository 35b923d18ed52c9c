"""Quotas per isolation tier (issue 21, Quota.tiers): a tier's usage is the sum over the
backends that give it (container: native, runc and simulated together, and fncall, which
gives no tier and is counted in the container tier), an ancestor's
tier limit binds its subtree, 0 forbids the tier in words that say so, and a tier quota
survives the store round trip and reads back through the API's view."""

from __future__ import annotations

import msgspec
import pytest

from dsec.control.quota import Limits, Quota, QuotaIndex
from dsec.control.records import SandboxRecord
from dsec.errors import InvalidArgument, QuotaExceeded
from dsec.wire.api import QuotaBody, TierQuota


def rec(i: int, project: str, backend: str) -> SandboxRecord:
    return SandboxRecord(id=f"sb-{i:012x}-n1", node="n1", project=project, backend=backend,
                         cpu_milli=1000, memory_bytes=1 << 30)


def test_a_tier_counts_every_backend_that_gives_it() -> None:
    q = QuotaIndex()
    q.set_quota("org", Quota(tiers={"container": Limits(max_sandboxes=2, memory_bytes=3 << 30)}))
    q.insert(rec(1, "org/a", "runc"))
    q.insert(rec(2, "org/b", "simulated"))
    with pytest.raises(QuotaExceeded, match="sandboxes for isolation container") as exc:
        q.check("org/c", backend="container", cpu_milli=1, memory_bytes=1)
    assert exc.value.detail["used"] == 2 and exc.value.detail["project"] == "org"
    # other tiers are not counted against it
    q.check("org/c", backend="gvisor", cpu_milli=1, memory_bytes=1 << 40)
    # fncall gives no tier and runs on the host kernel: counted in the container tier
    # (red team 21, B6)
    with pytest.raises(QuotaExceeded, match="sandboxes for isolation container"):
        q.check("org/c", backend="fncall", cpu_milli=1, memory_bytes=1)
    q.remove(rec(1, "org/a", "runc").id)
    with pytest.raises(QuotaExceeded, match="memory_bytes for isolation container"):
        q.check("org/c", backend="container", cpu_milli=1, memory_bytes=(2 << 30) + 1)
    q.check("org/c", backend="container", cpu_milli=1, memory_bytes=2 << 30)
    q.insert(rec(3, "org/d", "fncall"))         # and its sandboxes use the tier's room
    with pytest.raises(QuotaExceeded, match="sandboxes for isolation container"):
        q.check("org/c", backend="container", cpu_milli=1, memory_bytes=1)


def test_zero_forbids_a_tier_and_says_so() -> None:
    q = QuotaIndex()
    q.set_quota("org", Quota(tiers={"vm": Limits(max_sandboxes=0)}))
    with pytest.raises(QuotaExceeded, match="'org' does not allow isolation tier 'vm'"):
        q.check("org/team", backend="vm", cpu_milli=1, memory_bytes=1)
    q.check("org/team", backend="gvisor", cpu_milli=1, memory_bytes=1)
    q.set_quota("org", Quota(tiers={"container": Limits(max_sandboxes=0)}))
    with pytest.raises(QuotaExceeded, match="in which backend 'fncall' counts"):
        q.check("org/team", backend="fncall", cpu_milli=1, memory_bytes=1)


def test_a_tier_quota_names_a_tier() -> None:
    with pytest.raises(InvalidArgument, match="no such isolation tier"):
        QuotaIndex().set_quota("p", Quota(tiers={"kvm": Limits(max_sandboxes=1)}))
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"tiers": {"kvm": {}}}', type=QuotaBody)
    body = msgspec.json.decode(b'{"tiers": {"vm": {"max_sandboxes": 0}}}', type=QuotaBody)
    assert body.tiers == {"vm": TierQuota(max_sandboxes=0)}
    # stored as the Quota is (msgspec builtins), read back the same
    stored = msgspec.to_builtins(Quota(tiers={"vm": Limits(max_sandboxes=0)}))
    assert msgspec.convert(stored, Quota).tiers == {"vm": Limits(max_sandboxes=0)}
