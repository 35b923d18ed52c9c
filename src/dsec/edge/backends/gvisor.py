"""The "gvisor" backend: the container backend with gVisor's runsc as its runtime.

One isolation tier (``isolation="gvisor"``): the same images, overlay root, cgroups,
disk caps, pause (cgroup freezer), snapshots (pack_diff of the same upper dir) and
events as the "container" backend, but the sandbox's processes run on gVisor's
user-space kernel instead of the host's (see :mod:`dsec.edge.backends.container.runsc`
for what that changes: network loopback only, /tmp on the disk, a memory-limit hit stops
the whole sandbox). Costs more per create and per exec than the native runtime; the
point is a much smaller host kernel surface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.edge.backends.container.backend import ContainerBackend

__all__ = ["make_backend"]


def make_backend(**opts: Any) -> ContainerBackend:
    """Registry hook (``make_backend("gvisor", ...)``): the container backend's options
    (``root_dir``, ``images`` or ``images_dir``, ...) plus ``platform`` (gVisor's:
    ``ptrace``, ``kvm``, ``systrap``; None probes once per node) and ``runsc_binary``.
    ``runtime`` is runsc by definition and may not be given."""
    from dsec.edge.backends.container import make_backend as container_backend
    from dsec.errors import InvalidArgument

    if opts.get("runtime", "runsc") != "runsc":
        raise InvalidArgument(f"the gvisor backend runs runtime 'runsc', not "
                              f"{opts['runtime']!r}; use the container backend for that",
                              field="runtime")
    opts = {**opts, "runtime": "runsc"}
    if "platform" in opts:
        opts["gvisor_platform"] = opts.pop("platform")
    return container_backend(**opts)
