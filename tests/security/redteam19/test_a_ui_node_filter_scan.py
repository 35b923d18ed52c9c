"""Dashboard ``/ui/sandboxes?node=X``: the node filter scans list pages of the page's own
``limit`` (1..200, the caller's choice) until ``NODE_SCAN_MAX`` (2,000) records were
looked at. With ``limit=1`` and a node no sandbox is on, **one page view makes 2,000
``list`` calls** (each a policy check, a registry read, a page of records copied), where
``limit=200`` makes 10: any reader key amplifies one cheap GET 200-fold on the control
plane (the docstring promises "at most NODE_SCAN_MAX records a page", which holds, but
the call count is what costs). The scan should read pages of a fixed size (e.g. 200)
whatever the display limit.

Below: 400 sandboxes; ``?node=nosuch&limit=1`` must cost at most ~10 list calls."""

from __future__ import annotations

import httpx

from dsec import LocalCluster
from dsec.control.ui import Dashboard
from tests.gcscan import live_instances


def test_node_filter_page_costs_a_bounded_number_of_list_calls(tmp_path: object) -> None:
    with LocalCluster(backend="simulated", state_dir=str(tmp_path)) as cl:
        with cl.client(session_lease_s=None) as c:
            for _ in range(4):
                c.sandboxes.create_many(100, cpu=0.01, memory="8MiB")
        # every live dashboard (other tests' clusters may still be up): only this
        # cluster's serves the request below
        calls = 0

        def wrap(dash: Dashboard) -> None:
            inner = dash._list

            async def counting(caller: object, req: object) -> object:
                nonlocal calls
                calls += 1
                return await inner(caller, req)

            dash._list = counting

        for o in live_instances(Dashboard):
            wrap(o)
        r = httpx.get(f"{cl.url}/ui/sandboxes", params={"node": "nosuch", "limit": "1"},
                      cookies={"dsec_ui": cl.api_key}, timeout=120)
        assert r.status_code == 200, r.text[:300]
        assert calls <= 12, (
            f"one dashboard page view (?node=nosuch&limit=1) made {calls} list calls over "
            "400 sandboxes: the node filter scans in pages of the display limit")
