"""IPv6 allow entries that name never-reachable IPv4 addresses through an embedding, or
the sandboxes' own v6 pool (nf, wire/netpolicy.py NEVER_REACHABLE; nftrules PRIVATE6).
Run against nf: PYTHONPATH=/work/wt/rt14b-nf/src:/work/wt/rt14b.

Attack: a member writes ``allow=["[64:ff9b::a9fe:a9fe]"]`` (NAT64 of 169.254.169.254),
``[64:ff9b::7f00:1]`` (of 127.0.0.1), ``[2002:a9fe:a9fe::]/48`` (6to4 of the metadata
address), ``[::a9fe:a9fe]`` (v4-compatible) or the whole ``[64:ff9b::]/96`` (all of IPv4,
private ranges included, through a NAT64 on the node's path - a host running CLAT/Jool/
Tayga translates into the node's own IPv4 network). The v4 spellings of the same
destinations are refused ("never reachable, whatever the policy says"); the v6 ones are
accepted (the router only treats them as private, and "private is reachable when a
policy names it").
GCP's IPv6 metadata address fd20:ce::254 is only "private" (AWS's fd00:ec2::254 is in
never6), so ``[fd20:ce::254]`` or a ceiling's ``[fd00::]/8`` reaches it.
Also: ``[fd00:d5ec::]/48`` (the sandboxes' own v6 pool, where the v4 pool is refused
naming 'sandbox:<id>') is accepted and then silently dropped by never6: bad input without
a clear error.
Expected safe behaviour: refused with the never-reachable message naming the embedded
IPv4 address (and the pool).
Observed: accepted.
"""

from __future__ import annotations

import pytest

from dsec.errors import InvalidArgument
from dsec.wire.netpolicy import NetworkPolicy

EMBEDDED = [
    "[64:ff9b::a9fe:a9fe]",     # NAT64 (RFC 6052) of 169.254.169.254
    "[64:ff9b::7f00:1]",        # NAT64 of 127.0.0.1
    "[64:ff9b:1::a9fe:a9fe]",   # local-use NAT64 prefix (RFC 8215)
    "[2002:a9fe:a9fe::]/48",    # 6to4 of 169.254.169.254
    "[::a9fe:a9fe]",            # v4-compatible
    "[fd00:d5ec::]/48",         # the sandboxes' own v6 pool
    "[fd20:ce::254]",           # GCP's metadata server over IPv6 (only "private" here)
]


@pytest.mark.parametrize("entry", EMBEDDED)
def test_v6_spelling_of_a_never_reachable_address_is_refused(entry: str) -> None:
    with pytest.raises(InvalidArgument):
        NetworkPolicy(mode="policy", allow=(entry,)).validate("network")
