"""A request timeout shorter than a create. The SDK retries a timed-out create with the
same Idempotency-Key; the gateway cancels the timed-out request's handler on the server
(an Aether CANCEL). That cancellation used to reach the create itself - and through the
apiserver's own link, the edge's create - so every attempt was cut off before the
sandbox existed and the next one started over: a create slower than the timeout never
happened, however long the SDK retried. A keyed create is the key's work, not one
request's: it runs to its end, and the retry gets its sandbox.
"""

from __future__ import annotations

import asyncio

import pytest

from dsec.cluster.local import LocalCluster


@pytest.mark.parametrize("transport", ["aether", "http"])
def test_a_create_slower_than_the_request_timeout_is_made_once(transport: str) -> None:
    async def run(cluster: LocalCluster) -> None:
        async with cluster.async_client(protocol=transport, timeout=0.3,
                                        create_retry_s=60, session_lease_s=None) as c:
            made = await asyncio.gather(*(c.sandboxes.create(
                memory="16MiB", cpu=0.01, labels={"t": transport}) for _ in range(4)))
            ids = {s.id for s in made}
            assert len(ids) == 4
            listed = {s.id for s in await c.sandboxes.list(labels={"t": transport})}
            assert listed == ids, (listed, ids)
    # paper-microvm: 0.9 s per create, three times the request timeout
    with LocalCluster(edges=1, simulated_profile="paper-microvm", cpu_milli=8000,
                      memory_bytes=8 << 30) as cluster:
        asyncio.run(run(cluster))
