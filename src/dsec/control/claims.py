"""What an edge's heartbeat claims, as far as the control plane can check it (issue 16:
trusted claims). Pure functions; the plane applies them to each heartbeat of an edge
whose word it does not take (a joined node: another machine, whose root may be hostile).

- **Capacity**: a node's capacity claim is clamped to the size it registered with (the
  first size any replica heard from it after it joined, recorded in the state store's
  ``node_capacity`` so every replica and a restart use the same one): a node cannot grow
  itself into taking
  more of the cluster's placements than it announced. A node that really grew is
  revoked and joins again.
- **Held layers**: placement prefers nodes that hold an image's layers. A claim to hold a
  *project's* layer (a snapshot, an image built or pulled in a project) counts only when
  the control plane put it there (relayed it, or recorded the snapshot being taken
  there): otherwise a hostile node could list another project's image digests and attract
  that project's sandboxes, their files and secrets. Cluster-wide layers and digests the
  control plane has no record of are kept (they attract nothing of anyone's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from dsec.wire.node import Resources

__all__ = ["clamp_capacity", "trusted_layers"]


def clamp_capacity(claimed: Resources, registered: Resources | None) -> Resources:
    """``claimed``, no amount above ``registered`` (None: nothing registered yet)."""
    if registered is None:
        return claimed
    if (claimed.cpu_milli <= registered.cpu_milli
            and claimed.memory_bytes <= registered.memory_bytes
            and claimed.sandboxes <= registered.sandboxes
            and (registered.disk_bytes is None or (claimed.disk_bytes is not None
                                                   and claimed.disk_bytes
                                                   <= registered.disk_bytes))):
        return claimed
    disk = claimed.disk_bytes
    if registered.disk_bytes is not None:
        disk = registered.disk_bytes if disk is None else min(disk, registered.disk_bytes)
    return msgspec.structs.replace(
        claimed, cpu_milli=min(claimed.cpu_milli, registered.cpu_milli),
        memory_bytes=min(claimed.memory_bytes, registered.memory_bytes),
        sandboxes=min(claimed.sandboxes, registered.sandboxes), disk_bytes=disk)


def trusted_layers(claimed: Iterable[str], *, granted: Callable[[str], bool],
                   project_of: Callable[[str], str | None]) -> frozenset[str]:
    """The claims placement may believe: every claim except a project's layer (by the
    control plane's record, ``project_of``) or a project's name (``proj/name:tag``) that
    was not ``granted`` to the node (relayed there, or a snapshot recorded there)."""
    out = []
    for ref in claimed:
        if ref.startswith("sha256:"):
            if project_of(ref) is not None and not granted(ref):
                continue
        elif "/" in ref.split(":", 1)[0]:
            continue        # a project's name in the node's own store means nothing here
        out.append(ref)
    return frozenset(out)
