"""Red team 16 (img): IPv6 spellings of internal IPv4 addresses pass the egress policy.

``dsec.image.egress.is_internal`` unwraps IPv4-mapped addresses (``::ffff:a.b.c.d``)
and otherwise trusts ``ipaddress``'s ``is_global``, which on this Python (3.11) calls
global: NAT64 (``64:ff9b::/96`` RFC 6052 and the local-use ``64:ff9b:1::/48`` RFC 8215:
an IPv6-only host's NAT64 gateway carries them to the embedded IPv4 - the VPC's private
hosts, the metadata service), 6to4 ``2002::/16`` (embedded IPv4), IPv4-compatible
``::a.b.c.d`` and deprecated site-local ``fec0::/10``. A registry name whose DNS answer
(AAAA) is one of those is connected to by the apiserver's pull.

The real pull into a real layer store; the only fake is the DNS answer (an injected
resolver, as in tests/image/test_pull_egress.py).
"""

from __future__ import annotations

import pytest

from dsec.errors import PermissionDenied
from dsec.image import LayerStore
from dsec.image.egress import EgressPolicy
from dsec.image.pull import PullOptions, pull_image

INTERNAL_V6 = [
    "64:ff9b::7f00:1",          # NAT64 of 127.0.0.1
    "64:ff9b::a9fe:a9fe",       # NAT64 of 169.254.169.254 (cloud metadata)
    "64:ff9b::a00:5",           # NAT64 of 10.0.0.5
    "64:ff9b:1::a00:5",         # local-use NAT64 prefix
    "2002:a9fe:a9fe::1",        # 6to4 of 169.254.169.254
    "::127.0.0.1",              # IPv4-compatible
    "fec0::1",                  # site-local (deprecated, still routed where configured)
]


@pytest.mark.parametrize("addr", INTERNAL_V6)
def test_a_registry_name_resolving_to_an_ipv6_form_of_an_internal_address_is_refused(
        tmp_path: object, addr: str) -> None:
    store = LayerStore(f"{tmp_path}/store")
    tried: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        tried.append(host)
        return [addr]

    with pytest.raises(PermissionDenied, match="internal address"):
        pull_image(store, "registry.rt16.example:5000/team/app:1",
                   options=PullOptions(insecure=True, egress=EgressPolicy(),
                                       resolve=resolve, timeout_s=3.0))


@pytest.mark.parametrize("addr", INTERNAL_V6)
def test_a_ref_naming_an_ipv6_form_of_an_internal_address_is_refused(
        tmp_path: object, addr: str) -> None:
    store = LayerStore(f"{tmp_path}/store")
    with pytest.raises(PermissionDenied, match="does not pull from registry"):
        pull_image(store, f"[{addr}]:5000/team/app:1",
                   options=PullOptions(insecure=True, egress=EgressPolicy(), timeout_s=3.0))


@pytest.mark.parametrize("addr", ["2002:808:808::1", "64:ff9b::808:808", "2606:4700::1111",
                                  "::ffff:8.8.8.8"])
def test_ipv6_forms_of_public_addresses_stay_public(addr: str) -> None:
    """The fix refuses by what the embedding carries, not by prefix: a NAT64 or 6to4
    spelling of a public IPv4 (and a plain global IPv6) is not internal."""
    import ipaddress

    from dsec.image.egress import is_internal

    assert not is_internal(ipaddress.ip_address(addr))
