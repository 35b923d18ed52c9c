"""B6: per-tier quotas (``Quota.tiers``, issue 21) cannot keep a project off the host
kernel: ``fncall`` is "in no tier" (``BACKEND_ISOLATION`` has no entry for it), so
``QuotaIndex._check_tier`` returns without a limit for it. A project whose quota forbids
the container and gVisor tiers - "this project's code runs in microVMs only", the point of
a tier quota as a security control - still creates ``backend="fncall"`` sandboxes (a
jailed process on the host kernel: less isolation than the container tier it forbids),
wherever a node runs the fncall backend. Only an explicit ``backends={"fncall": ...}``
entry, which nothing in the tier docs mentions, closes it.

Secure behaviour: a project that forbids the container tier (the weakest tier) is refused
fncall too (fncall counted as container for tier quotas, or refused where any tier is
forbidden)."""

from __future__ import annotations

import pytest

from dsec.control.quota import Limits, Quota, QuotaIndex
from dsec.errors import QuotaExceeded


def test_vm_only_project_cannot_run_code_on_the_host_kernel() -> None:
    idx = QuotaIndex()
    idx.set_quota("acme", Quota(tiers={"container": Limits(max_sandboxes=0),
                                       "gvisor": Limits(max_sandboxes=0)}))
    for backend in ("container", "runc", "simulated", "gvisor"):
        with pytest.raises(QuotaExceeded):
            idx.check("acme/agents", backend=backend, cpu_milli=1000,
                      memory_bytes=1 << 29)
    idx.check("acme/agents", backend="vm", cpu_milli=1000, memory_bytes=1 << 29)
    with pytest.raises(QuotaExceeded):      # fncall: host kernel, weaker than container
        idx.check("acme/agents", backend="fncall", cpu_milli=1000, memory_bytes=1 << 29)
