"""File descriptor limits of the processes that manage sandboxes (issue 22).

A node that destroyed 10,000 sandboxes failed with ``EMFILE`` (on ``cgroup.procs`` and in
``rmtree``) because the edge ran with a soft ``RLIMIT_NOFILE`` far below what it held, and
the failed run left 9,997 sandboxes running. Two rules since:

- every process that manages sandboxes (``dsec edge``, ``dsec up``, the benches, and any
  process that constructs a container backend) raises its soft limit to the hard limit at
  start (:func:`raise_nofile`): the soft limit is a default for programs that use
  ``select(2)``; nothing here does. The hard limit is the administrator's and is left
  alone.
- the container backend holds no descriptor per idle sandbox (docs/container.md,
  "Descriptors"), so the count of sandboxes is not bounded by the limit at all; what is
  bounded is the operations in flight.
"""

from __future__ import annotations

import resource

__all__ = ["raise_nofile"]


def raise_nofile() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (children inherit
    it). Returns ``(soft before, soft now)``. Never fails: a limit that cannot be raised
    (an unprivileged process under a hard limit of ``RLIM_INFINITY`` it may not take) is
    left as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        # Linux never reports infinity for NOFILE (it is capped by fs.nr_open), but be safe
        try:
            with open("/proc/sys/fs/nr_open") as f:
                hard = int(f.read())
        except (OSError, ValueError):
            return soft, soft
    if soft >= hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
    except (ValueError, OSError):
        return soft, soft
    return soft, hard
