"""Shared fixtures. Tests that need root or a kernel feature use ``requires_root``."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Every container/fncall backend makes a preallocated btrfs disk pool (its size is taken
# from the host while it exists; see dsec.edge.backends.container.disk). The default -
# half the free space, at most 64 GiB - is for a node; a test suite makes hundreds of
# backends, one at a time, so it asks for 2 GiB each (subprocesses inherit it).
os.environ.setdefault("DSEC_DISK_POOL_BYTES", str(2 << 30))

# Hypothesis' per-example deadline (200 ms) is a timing assertion, and timing belongs to
# `dsec bench`: on this 2-core machine under a full suite, pure property tests missed it
# (test_net_pure) with nothing wrong. Examples stay bounded by max_examples.
settings.register_profile("dsec", deadline=None)
settings.load_profile("dsec")

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")
