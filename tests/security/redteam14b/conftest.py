"""Red-team round 14b (issue 14 finish: host uplink, router reconcile, IPv6).

Reuses the network suite's fixtures (a test internet in namespaces this test makes)."""

from tests.net.conftest import internet, router  # noqa: F401
