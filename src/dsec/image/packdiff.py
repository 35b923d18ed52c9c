"""pack_diff: incremental snapshots of a sandbox's overlay upperdir as layers.

A sandbox root is ``overlay(lower = image stack, upper = per-sandbox dir)``; every change
the sandbox ever made is in the upperdir, already in overlay's encoding (whiteouts for
deletions, opaque dirs for "replaced everything below"). A snapshot stores only what
changed in the upperdir since the previous snapshot, as a layer whose ``parent`` is that
snapshot; stacking the chain above the image (:func:`restore_stack`) gives the tree the
sandbox had.

**Detecting change.** Each snapshot records the lstat of every upperdir entry (path ->
type, mode, owner, size, mtime, ctime, inode, opaque) in ``index/<digest>.idx``. The
next snapshot rescans the upperdir and compares: an entry is changed when any field
differs. ``ctime`` catches content, metadata and xattr writes (including writes through
a shared mmap, whose first fault after writeback stamps the times), ``ino`` catches a
file deleted and recreated. Paths present before and gone now become whiteouts. An
unchanged sandbox costs one lstat per upperdir entry and no reads, independent of the
image size and of file sizes; it returns the previous snapshot. The trade-off: this is
O(entries the sandbox ever changed) rather than the O(1) of a change journal, but it
needs no cooperation from (hostile) code in the sandbox, no fanotify mark on the host
filesystem and survives edge restarts; a generation counter bumped by the edge on exec
would be O(1) but misses writes by background processes.

*Racy entries* (git's "racy clean" problem): timestamps tick coarsely (ext4 uses the
jiffy clock, up to 10 ms), so a file changed again within the tick of the scan keeps
its ctime. Entries whose ctime is within ``RACY_WINDOW_NS`` of the scan are flagged and
re-captured by the next snapshot whatever their stat says.

Snapshots are consistent when the sandbox is frozen while they are taken (the edge
pauses it); a write racing the scan is captured by the next snapshot, since the index
holds the stat from before the copy.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import posixpath
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from dsec.errors import ImageError, InvalidArgument
from dsec.image.compose import RootStack
from dsec.image.erofs import Compression
from dsec.image.manifest import LayerManifest
from dsec.image.store import LayerStore
from dsec.image.tree import OPAQUE_XATTR, copy_entry, copy_meta, make_whiteout

__all__ = [
    "DEFAULT_RESIDUE",
    "RACY_WINDOW_NS",
    "Entry",
    "SnapshotPlan",
    "plan_snapshot",
    "restore_stack",
    "scan_upper",
    "snapshot",
]

RACY_WINDOW_NS = 50_000_000
"""Entries changed this close to a scan are re-captured next time (coarse timestamps)."""

DEFAULT_RESIDUE: tuple[str, ...] = (
    "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".cache", ".bash_history",
    ".python_history", ".viminfo", ".lesshst", "tmp/*", "var/tmp/*", "var/cache/apt/*",
    "root/.npm", "root/.wget-hsts",
)
"""Build residue stripped from a snapshot meant for reuse (extend with answer files).
A pattern without '/' matches a basename anywhere; with '/' it matches the whole path."""

_REDIRECT_XATTR = "trusted.overlay.redirect"
_METACOPY_XATTR = "trusted.overlay.metacopy"


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """The lstat of one upperdir entry, as compared between snapshots."""

    kind: str          # "f" file, "d" dir, "l" symlink, "w" whiteout, "o" other (fifo)
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    opaque: bool = False


class _Index(msgspec.Struct, array_like=True):
    upper_dev: int
    upper_ino: int
    entries: dict[str, Entry]
    racy: list[str]


_idx_enc = msgspec.msgpack.Encoder()
_idx_dec = msgspec.msgpack.Decoder(_Index)


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    if stat.S_ISDIR(m):
        return "d"
    if stat.S_ISREG(m):
        return "f"
    if stat.S_ISLNK(m):
        return "l"
    if stat.S_ISCHR(m) and st.st_rdev == 0:
        return "w"
    return "o"


def _stripped(rel: str, patterns: Sequence[str]) -> bool:
    base = posixpath.basename(rel)
    for p in patterns:
        if fnmatch.fnmatchcase(rel if "/" in p else base, p):
            return True
    return False


def scan_upper(upper: str, strip: Sequence[str] = (), *,
               racy_after_ns: int | None = None) -> tuple[dict[str, Entry], list[str]]:
    """lstat every entry of an upperdir; returns entries and the racy paths."""
    entries: dict[str, Entry] = {}
    racy: list[str] = []
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        abs_dir = os.path.join(upper, rel_dir) if rel_dir else upper
        try:
            it = os.scandir(abs_dir)
        except FileNotFoundError:
            continue
        with it:
            for de in it:
                rel = f"{rel_dir}/{de.name}" if rel_dir else de.name
                if strip and _stripped(rel, strip):
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                k = _kind(st)
                opaque = False
                if k == "d":
                    try:
                        names = os.listxattr(de.path, follow_symlinks=False)
                    except OSError:
                        names = []
                    if _REDIRECT_XATTR in names:
                        raise ImageError(
                            f"upperdir entry {rel!r} is an overlay redirect; mount sandbox "
                            "roots with redirect_dir=off (dsec.image.compose does)")
                    opaque = OPAQUE_XATTR in names and os.getxattr(
                        de.path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
                    stack.append(rel)
                elif k == "f" and st.st_size == 0 and _has_metacopy(de.path):
                    raise ImageError(f"upperdir entry {rel!r} is a metacopy-only file; mount "
                                     "sandbox roots with metacopy=off")
                entries[rel] = Entry(k, st.st_mode, st.st_uid, st.st_gid, st.st_size,
                                     st.st_mtime_ns, st.st_ctime_ns, st.st_ino, opaque)
                if racy_after_ns is not None and st.st_ctime_ns >= racy_after_ns:
                    racy.append(rel)
    return entries, racy


def _has_metacopy(path: str) -> bool:
    try:
        os.getxattr(path, _METACOPY_XATTR, follow_symlinks=False)
        return True
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise


@dataclass(slots=True)
class SnapshotPlan:
    """What a snapshot layer must hold (pure result of comparing two scans)."""

    copy: list[str] = field(default_factory=list)        # sorted, parents before children
    opaque: set[str] = field(default_factory=set)        # dirs to mark opaque
    whiteouts: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.copy and not self.whiteouts


def _under(rel: str, dirs: set[str]) -> bool:
    while "/" in rel:
        rel = rel.rsplit("/", 1)[0]
        if rel in dirs:
            return True
    return False


def plan_snapshot(cur: dict[str, Entry], prev: dict[str, Entry],
                  prev_racy: frozenset[str] = frozenset()) -> SnapshotPlan:
    """Which upperdir entries changed since ``prev`` (pure).

    Changed or new entries are copied (with their ancestor dirs for structure); a dir
    that became opaque (created over a whiteout) is copied with its whole subtree and
    the opaque mark, since it must hide the older snapshots too; a path that was in the
    upperdir and is gone, under a directory that still exists, becomes a whiteout.
    """
    plan = SnapshotPlan()
    changed: set[str] = set()
    for rel, e in cur.items():
        p = prev.get(rel)
        if e.kind == "d" and e.opaque and (
                p is None or p.kind != "d" or not p.opaque or p.ino != e.ino):
            plan.opaque.add(rel)
        if p != e or rel in prev_racy:
            changed.add(rel)
    if plan.opaque:
        changed.update(r for r in cur if _under(r, plan.opaque))
    for rel in prev:
        if rel in cur:
            continue
        parent = posixpath.dirname(rel)
        if parent and (parent not in cur or cur[parent].kind != "d"):
            continue                            # an ancestor's change covers it
        if _under(rel, plan.opaque):
            continue
        plan.whiteouts.append(rel)
    needed = set(changed)
    for rel in list(changed) + plan.whiteouts:
        while "/" in rel:
            rel = rel.rsplit("/", 1)[0]
            if rel in needed:
                break
            needed.add(rel)
    plan.copy = sorted(needed)
    plan.whiteouts.sort()
    return plan


def _materialize(upper: str, stage: str, plan: SnapshotPlan, cur: dict[str, Entry]) -> None:
    """Copy the planned entries into ``stage``. Holes stay holes (tree.copy_entry) and
    hardlinks stay hardlinks (mkfs.erofs keeps them as one inode), so the stage - and
    the layer - hold about what the upper really uses: a file linked 10,000 times is
    stored once, not 10,000 times."""
    dirs: list[tuple[str, str, os.stat_result]] = []
    linked: dict[tuple[int, int], str] = {}
    for rel in plan.copy:
        src = os.path.join(upper, rel)
        dst = os.path.join(stage, rel)
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            # Removed while we copied (sandbox not frozen): the next snapshot sees it gone.
            cur.pop(rel, None)
            continue
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(dst, 0o700)
            copy_meta(src, dst, st, times=False)
            if rel in plan.opaque:
                os.setxattr(dst, OPAQUE_XATTR, b"y", follow_symlinks=False)
            dirs.append((src, dst, st))
        else:
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and stat.S_ISREG(st.st_mode) and key in linked:
                os.link(linked[key], dst)
                continue
            try:
                copy_entry(src, dst, st)
            except FileNotFoundError:
                cur.pop(rel, None)
                continue
            if st.st_nlink > 1 and stat.S_ISREG(st.st_mode):
                linked[key] = dst
    for rel in plan.whiteouts:
        make_whiteout(os.path.join(stage, rel))
    for _, dst, st in reversed(dirs):
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    root_st = os.lstat(upper)
    copy_meta(upper, stage, root_st)


def snapshot(store: LayerStore, upperdir: str, previous: LayerManifest | None = None, *,
             base: RootStack | None = None, strip: Sequence[str] = (),
             name: str | None = None, tag: str = "latest",
             labels: dict[str, str] | None = None,
             compression: Compression | None = None,
             max_bytes: int | None = None, max_apparent_bytes: int | None = None,
             on_copied: Callable[[], None] | None = None,
             clock_ns: Callable[[], int] = time.time_ns) -> LayerManifest:
    """Capture the upperdir's changes since ``previous`` as a new snapshot layer.

    The first snapshot of a sandbox passes ``base``: the stack the sandbox was started
    from (an image, or a snapshot's :func:`restore_stack`). Later ones pass ``previous``.
    Returns ``previous`` itself when nothing changed.

    ``max_bytes`` bounds the stored layer and ``max_apparent_bytes`` the file sizes the
    build reads (see :meth:`LayerStore.add_tree`): over either, ``QuotaExceeded`` and
    nothing is stored. ``on_copied`` runs once the upper has been read (the caller may
    thaw the sandbox then: the EROFS build only reads the staging copy).
    """
    if previous is None and base is None:
        raise InvalidArgument("snapshot needs previous (the last snapshot of this sandbox) "
                              "or base (the stack it was started from)")
    if previous is not None and previous.kind != "snapshot":
        raise InvalidArgument(f"previous={previous.ref} is a {previous.kind} layer, not a "
                              "snapshot; pass the image as base instead")
    try:
        ust = os.stat(upperdir)
    except FileNotFoundError:
        raise InvalidArgument(f"upperdir {upperdir} does not exist") from None
    t0 = clock_ns()
    cur, racy = scan_upper(upperdir, strip, racy_after_ns=t0 - RACY_WINDOW_NS)

    prev_entries: dict[str, Entry] = {}
    prev_racy: frozenset[str] = frozenset()
    if previous is not None:
        parent: str | None = previous.digest
        stack = previous.stack
        raw = store.read_index(previous.digest)
        if raw is None:
            raise ImageError(
                f"snapshot {previous.digest} has no upperdir index in {store.root}, so what "
                "changed since it is unknown; take a full snapshot with base= instead")
        idx = _idx_dec.decode(raw)
        # The index only describes *this* upperdir if it was taken from it; a sandbox
        # started from `previous` has a fresh upperdir, relative to previous' stack.
        if (idx.upper_dev, idx.upper_ino) == (ust.st_dev, ust.st_ino):
            prev_entries, prev_racy = idx.entries, frozenset(idx.racy)
            if not prev_racy and prev_entries == cur:
                return previous
    else:
        assert base is not None
        top = base.layers[0]
        if top.kind == "snapshot":
            parent, stack = top.digest, top.stack
        else:
            parent, stack = None, base.digests
    plan = plan_snapshot(cur, prev_entries, prev_racy)
    if plan.empty and previous is not None:
        return previous
    with store.staging("snap-") as stage:
        try:
            _materialize(upperdir, stage, plan, cur)
        finally:
            if on_copied is not None:
                on_copied()
        m = store.add_tree(stage, kind="snapshot", name=name, tag=tag, labels=labels,
                           compression=compression, parent=parent, stack=stack,
                           max_bytes=max_bytes, max_apparent_bytes=max_apparent_bytes,
                           what="snapshot")
    store.write_index(m.digest, _idx_enc.encode(
        _Index(ust.st_dev, ust.st_ino, cur, [r for r in racy if r in cur])))
    return m


def restore_stack(store: LayerStore, snap: LayerManifest | str) -> RootStack:
    """The stack to start a sandbox from a snapshot: its chain above its image."""
    m = store.get(snap) if isinstance(snap, str) else snap
    if m.kind != "snapshot":
        raise InvalidArgument(f"{m.ref} is a {m.kind} layer, not a snapshot")
    return RootStack(tuple(store.lowers(m)))
