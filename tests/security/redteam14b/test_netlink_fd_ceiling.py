"""Netlink waits with select(2): the node's network stops past fd 1023 (net/kernel.py
Netlink._recv, on main since N3; used by every new nd/ne path: slot builds, reconcile's
DeleteLink, HostUplink attach/detach/_del_link, the uplink peer's addressing).

``select.select`` raises ValueError for an fd >= FD_SETSIZE (1024). An edge raises its
RLIMIT_NOFILE to the hard limit on purpose (three fds per sandbox, one netns fd per slot,
exec pipes), so 1,024 fds are reached with ~300 networked sandboxes, or a tenant's
concurrent execs (each holding pipes) - the issue's own target is 1,000 live sandboxes
with policies on one node. From then on every netlink socket opened per operation gets a
high fd: a slot build raises ValueError (not even a DsecError), so creates with a network
fail for every tenant, and an uplink detach/_del_link at stop cannot run.

Attack/fault: fds 0..1100 in use in the edge (here: held /dev/null fds, as sandboxes'
pidfds/pipes/netns fds would be), then the router builds and hands out a slot.
Expected safe behaviour: works (poll/epoll or a blocking recv with SO_RCVTIMEO, no fd
ceiling), or at worst a clear ResourceExhausted.
Observed: ValueError: filedescriptor out of range in select().
"""

from __future__ import annotations

import os
import resource

import pytest

from dsec.net.router import Router, RouterConfig
from dsec.net.testinternet import Internet
from dsec.net.uplink import NetnsUplink

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


def test_slots_still_build_with_more_than_1024_fds_open(internet: Internet) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip(f"hard fd limit {hard} < 2048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # as the edge does
    held: list[int] = []
    r = None
    try:
        while True:
            fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            held.append(fd)
            if fd >= 1100:
                break
        r = Router.create(RouterConfig(pool_min=2, build_batch=2),
                          NetnsUplink(internet.fd, "rt14bfd"))
        s = r.take()
        assert s.fd >= 0
    except ValueError as exc:
        pytest.fail(f"the router failed past fd 1023 (select): {exc}")
    finally:
        if r is not None:
            r.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
