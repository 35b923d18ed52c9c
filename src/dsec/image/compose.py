"""Compose layers into a sandbox root: one overlay mount over shared EROFS lowers.

Priority (highest first): toolkits, later ones winning, then the workspace, then the
base; a pack_diff snapshot chain sits above all of them. Each sandbox gets its own
upper and work directory; nothing of the image is copied or unpacked per sandbox.

The overlay is mounted with ``redirect_dir=nofollow,metacopy=off`` (``OVERLAY_FLAGS``,
whatever the module's defaults; plain ``off`` still *follows* redirects when
``redirect_always_follow=Y``): renaming a directory that lives in a lower layer then
fails with EXDEV and tools fall back to
copy+delete, so the upperdir only ever holds plain files, whiteouts and opaque dirs,
which is exactly what :mod:`dsec.image.packdiff` knows how to capture.

mount(2) takes its options in one page (4095 bytes); a stack whose lowerdir list does not
fit is mounted with the new mount API instead (``fsconfig(lowerdir+)``, kernel >= 6.8),
one lowerdir per call, so the number of layers is bounded only by overlay's own limit
(500 lowers).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Self

from dsec.errors import ImageError, ImageNotFound, InvalidArgument
from dsec.image.manifest import LayerManifest
from dsec.image.mount import MountCache, _libc, sys_mount, sys_umount
from dsec.image.store import LayerStore

__all__ = ["MAX_MOUNT_DATA", "RootStack", "SandboxRoot", "compose", "mount_overlay",
           "mount_root", "overlay_options"]

MAX_MOUNT_DATA = 4095                  # one page including the terminating NUL
MAX_LOWERS = 500                       # overlayfs' OVL_MAX_STACK
OVERLAY_FLAGS = ("redirect_dir=nofollow", "metacopy=off")  # neither written nor followed


@dataclass(frozen=True, slots=True)
class RootStack:
    """An ordered stack of read-only layers, highest priority first."""

    layers: tuple[LayerManifest, ...]

    @property
    def digests(self) -> tuple[str, ...]:
        return tuple(m.digest for m in self.layers)

    def with_top(self, *layers: LayerManifest) -> RootStack:
        """This stack with ``layers`` (highest first) placed above it."""
        return RootStack(tuple(layers) + self.layers)


def compose(base: LayerManifest, workspace: LayerManifest | None = None,
            toolkits: Sequence[LayerManifest] = (),
            base_lowers: Sequence[LayerManifest] = ()) -> RootStack:
    """Order base, workspace and toolkits into a :class:`RootStack` (pure).

    ``base_lowers``: the layers below ``base`` when the base is the top of a multi-layer
    image (a pulled image's top layer names them in its ``stack``, highest first; see
    :func:`base_stack`); they sit below it in that order."""
    def need(m: LayerManifest, role: str, kinds: tuple[str, ...]) -> None:
        if m.kind not in kinds:
            raise InvalidArgument(f"layer {m.ref} is a {m.kind} layer and cannot be used as "
                                  f"the {role}; build it with --kind {kinds[0]}")
    need(base, "base", ("base",))
    layers: list[LayerManifest] = []
    for t in reversed(toolkits):
        need(t, "toolkit", ("toolkit",))
        layers.append(t)
    if workspace is not None:
        need(workspace, "workspace", ("workspace",))
        layers.append(workspace)
    layers.append(base)
    if [m.digest for m in base_lowers] != list(base.stack):
        raise InvalidArgument(f"base {base.ref} stands on {list(base.stack)}, not on the "
                              f"{len(base_lowers)} layers given")
    for m in base_lowers:
        need(m, "base", ("base",))
        layers.append(m)
    digests = [m.digest for m in layers]
    if len(set(digests)) != len(digests):
        raise InvalidArgument(f"a layer appears twice in the stack {digests}")
    return RootStack(tuple(layers))


def _check_path(p: str) -> str:
    if any(c in p for c in ",:\\\n") or not os.path.isabs(p):
        raise InvalidArgument(f"overlay path {p!r} must be absolute and free of ',' ':' '\\'")
    return p


def overlay_options(lowerdirs: Sequence[str], upper: str | None, work: str | None) -> str:
    """The mount(2) data string for an overlay of ``lowerdirs`` (highest first)."""
    opts = "lowerdir=" + ":".join(_check_path(p) for p in lowerdirs)
    if upper is not None and work is not None:
        opts += f",upperdir={_check_path(upper)},workdir={_check_path(work)}"
    return opts + "," + ",".join(OVERLAY_FLAGS)


# New mount API (syscall numbers are shared by all architectures since 5.2).
_SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 429, 430, 431, 432
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_FDCWD = -100


def _syscall(nr: int, *args: object) -> int:
    rc = int(_libc.syscall(nr, *args))
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return rc


def _mount_overlay_new_api(lowerdirs: Sequence[str], upper: str | None, work: str | None,
                           target: str) -> None:
    fsfd = _syscall(_SYS_FSOPEN, b"overlay", ctypes.c_uint(1))
    try:
        def cfg(key: str, value: str) -> None:
            _syscall(_SYS_FSCONFIG, fsfd, ctypes.c_uint(_FSCONFIG_SET_STRING), key.encode(),
                     value.encode(), 0)
        for p in lowerdirs:
            cfg("lowerdir+", _check_path(p))
        if upper is not None and work is not None:
            cfg("upperdir", _check_path(upper))
            cfg("workdir", _check_path(work))
        for flag in OVERLAY_FLAGS:
            k, _, v = flag.partition("=")
            cfg(k, v)
        _syscall(_SYS_FSCONFIG, fsfd, ctypes.c_uint(_FSCONFIG_CMD_CREATE), None, None, 0)
        mfd = _syscall(_SYS_FSMOUNT, fsfd, ctypes.c_uint(1), ctypes.c_uint(0))
        try:
            _syscall(_SYS_MOVE_MOUNT, mfd, b"", _AT_FDCWD, target.encode(),
                     ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH))
        finally:
            os.close(mfd)
    finally:
        os.close(fsfd)


def mount_overlay(lowerdirs: Sequence[str], upper: str | None, work: str | None,
                  target: str, *, api: Literal["auto", "legacy", "new"] = "auto") -> None:
    """Mount one overlay; without upper/work it is read-only."""
    if not lowerdirs:
        raise InvalidArgument("an overlay needs at least one lowerdir")
    if len(lowerdirs) > MAX_LOWERS:
        raise InvalidArgument(f"{len(lowerdirs)} layers exceed overlay's limit of {MAX_LOWERS}; "
                              "merge consecutive small layers (dsec.image.merge)")
    for p in lowerdirs:
        if not os.path.isdir(p):
            raise ImageError(f"overlay lowerdir {p} is missing (layer not mounted?)")
    data = overlay_options(lowerdirs, upper, work)
    use_new = api == "new" or (api == "auto" and len(data) > MAX_MOUNT_DATA)
    try:
        if use_new:
            _mount_overlay_new_api(lowerdirs, upper, work, target)
        else:
            sys_mount("overlay", target, "overlay", 0, data)
    except OSError as exc:
        raise ImageError(f"overlay mount of {len(lowerdirs)} layers on {target} failed: "
                         f"{exc.strerror} (options {len(data)} bytes)") from exc


@dataclass(slots=True)
class SandboxRoot:
    """A mounted sandbox root: the overlay, its private upper/work, the shared lowers."""

    stack: RootStack
    target: str
    upper: str
    work: str
    lowerdirs: tuple[str, ...]
    _cache: MountCache
    mounted: bool = True

    def unmount(self) -> None:
        """Unmount the overlay and release the layers (idempotent)."""
        if not self.mounted:
            return
        try:
            sys_umount(self.target)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                sys_umount(self.target, detach=True)
            elif exc.errno != errno.EINVAL:
                raise ImageError(f"unmounting sandbox root {self.target} failed: {exc}") from exc
        self.mounted = False
        for d in self.stack.digests:
            self._cache.release(d)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unmount()


def acquire_stack(store: LayerStore, cache: MountCache, stack: RootStack) -> list[str]:
    """Mount (or share) every layer of ``stack``; all or nothing. Returns lowerdirs.

    Under the store's shared lock (:meth:`LayerStore.using`), each layer checked to be
    still there: a prune either sees these mounts or has removed the layer before we
    look (``ImageNotFound``), never a layer in use."""
    got: list[str] = []
    try:
        with store.using():
            for m in stack.layers:
                if not store.has(m.digest):
                    raise ImageNotFound(f"layer {m.digest} is no longer in {store.root} "
                                        "(pruned: nothing named it)", ref=m.digest)
                got.append(cache.acquire(m, store.layer_path(m)))
                store.touch(m.digest)
    except BaseException:
        for m in stack.layers[: len(got)]:
            cache.release(m.digest)
        raise
    return got


def mount_root(store: LayerStore, cache: MountCache, stack: RootStack, sandbox_dir: str, *,
               api: Literal["auto", "legacy", "new"] = "auto") -> SandboxRoot:
    """Mount ``stack`` at ``sandbox_dir/root`` with ``upper``/``work`` beside it."""
    upper = os.path.join(sandbox_dir, "upper")
    work = os.path.join(sandbox_dir, "work")
    target = os.path.join(sandbox_dir, "root")
    for d in (upper, work, target):
        os.makedirs(d, exist_ok=True)
    lowers = acquire_stack(store, cache, stack)
    try:
        mount_overlay(lowers, upper, work, target, api=api)
    except BaseException:
        for d in stack.digests:
            cache.release(d)
        raise
    return SandboxRoot(stack, target, upper, work, tuple(lowers), cache)
