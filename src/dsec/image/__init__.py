"""Images: composable read-only EROFS layers, overlay roots, OCI import and pack_diff.

An image is a stack of layers: one base (OS), an optional workspace (task repo + deps)
and any number of toolkits (highest priority). Each layer is an EROFS file stored by its
sha256 (:class:`LayerStore`), mounted file-backed once per node (:class:`MountCache`) and
shared by every sandbox; :func:`compose` orders a stack and :func:`mount_root` puts one
overlay over it with a per-sandbox upperdir. :func:`snapshot` (pack_diff) turns what a
sandbox changed into a new layer; :func:`restore_stack` starts sandboxes from it.
See docs/images.md.
"""

from dsec.image.archive import ExtractLimits, extract_tar
from dsec.image.busybox import ensure_busybox_base
from dsec.image.compose import RootStack, SandboxRoot, compose, mount_overlay, mount_root
from dsec.image.manifest import LayerKind, LayerManifest, parse_ref
from dsec.image.merge import merge_layers, plan_merges
from dsec.image.mount import MountCache
from dsec.image.oci import import_oci
from dsec.image.packdiff import DEFAULT_RESIDUE, restore_stack, snapshot
from dsec.image.store import LayerStore

__all__ = [
    "DEFAULT_RESIDUE",
    "ExtractLimits",
    "LayerKind",
    "LayerManifest",
    "LayerStore",
    "MountCache",
    "RootStack",
    "SandboxRoot",
    "compose",
    "ensure_busybox_base",
    "extract_tar",
    "import_oci",
    "merge_layers",
    "mount_overlay",
    "mount_root",
    "parse_ref",
    "plan_merges",
    "restore_stack",
    "snapshot",
]
