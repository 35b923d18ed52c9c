"""A real Debian base layer from Debian's packages (mmdebstrap), and a local package repo.

``dsec image bootstrap debian --suite bookworm --include python3,git`` gives users without a
registry a real Linux image: mmdebstrap (Debian's own, the fast successor of debootstrap:
it resolves with apt and unpacks in one pass) installs the suite's ``apt`` variant plus
the packages asked into a staging directory of the layer store, and the tree becomes one
``base`` layer. Measured here (2 cores, shared): bookworm ``apt`` variant + python3 +
python3-pytest (122 packages, 47 MB of .debs, a 225 MB tree) takes 22 s from
deb.debian.org and ~15 s from a loopback mirror of the same packages; the EROFS build of
the tree adds ~3 s.

The tests never leave the machine: ``make debian-repo`` (setup, like ``apt-get``) runs
:func:`fetch_repo` once, which bootstraps against Debian's mirror keeping every .deb it
downloaded and turns them into a flat apt repository (``apt-ftparchive``) under
``/var/cache/dsec/debian/<suite>-<key>/``, keyed by suite, variant and package list; the
test serves that directory on loopback and bootstraps from it with ``--mirror``.

Device nodes: mmdebstrap's root mode creates ``/dev/null`` & co. in the tree. A sandbox
gets its own ``/dev`` from the runtime, so they are dropped from the layer (counted in
:class:`BootstrapResult`), which keeps the base buildable through every door (an
uploaded tar with device nodes is refused).

Pure parts (argument checks, the mmdebstrap argv, the cache key) are separate from the
I/O (running mmdebstrap, apt-ftparchive, the store).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from dsec.errors import ImageError, InvalidArgument
from dsec.image.erofs import ProgressFn
from dsec.image.manifest import LayerManifest
from dsec.image.store import LayerStore
from dsec.image.tree import special_skip
from dsec.mountshed import shed_argv
from dsec.rmtree import remove_tree

__all__ = ["DEFAULT_MIRROR", "DEFAULT_REPO_CACHE", "BootstrapPlan", "BootstrapResult",
           "bootstrap_debian", "bootstrap_tree", "fetch_repo", "repo_dir"]

DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_REPO_CACHE = "/var/cache/dsec/debian"
VARIANTS = ("essential", "apt", "minbase", "buildd", "required", "important", "standard")
_SUITE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,99}$")
_URL = re.compile(r"^(https?|file)://[^\s\[\]]+$")
_COMPLETE = ".complete"
#: mmdebstrap's hook that binds a file:// mirror into the target (Debian package mmdebstrap)
FILE_MIRROR_HOOKS = "/usr/share/mmdebstrap/hooks/file-mirror-automount"


@dataclass(frozen=True, slots=True)
class BootstrapPlan:
    """What to bootstrap, checked: ``suite`` (bookworm, trixie, ...), extra packages,
    mmdebstrap's ``variant`` and the mirror (``trusted``: an unsigned repository, such as
    the local one :func:`fetch_repo` makes)."""

    suite: str = "bookworm"
    include: tuple[str, ...] = ()
    variant: str = "apt"
    mirror: str = DEFAULT_MIRROR
    trusted: bool = False

    def __post_init__(self) -> None:
        if not _SUITE.match(self.suite):
            raise InvalidArgument(f"suite {self.suite!r} is not a Debian suite name "
                                  "(e.g. bookworm, trixie)", field="suite")
        for p in self.include:
            if not _PACKAGE.match(p):
                raise InvalidArgument(f"package name {p!r} is not a Debian package name "
                                      "([a-z0-9][a-z0-9+.-]*)", field="include")
        if self.variant not in VARIANTS:
            raise InvalidArgument(f"variant {self.variant!r}: use one of {', '.join(VARIANTS)}",
                                  field="variant")
        if not _URL.match(self.mirror):
            raise InvalidArgument(f"mirror {self.mirror!r} must be an http(s):// or file:// "
                                  "URL", field="mirror")
        if self.mirror.startswith("file:") and urlsplit(self.mirror).netloc not in (
                "", "localhost"):
            raise InvalidArgument(f"mirror {self.mirror!r}: a file:// URL names a directory "
                                  "of this machine (file:///path or file://localhost/path)",
                                  field="mirror")

    def mirror_dir(self) -> str | None:
        """A ``file://`` mirror's directory (percent-decoded, as apt reads it); None for
        an http(s) one."""
        if not self.mirror.startswith("file:"):
            return None
        return unquote(urlsplit(self.mirror).path)

    @classmethod
    def parse(cls, *, suite: str, include: str | Sequence[str] = (), variant: str = "apt",
              mirror: str = DEFAULT_MIRROR, trusted: bool = False) -> BootstrapPlan:
        """``include`` as the CLI takes it (``python3,git``) or a list; sorted, deduped."""
        items = include.split(",") if isinstance(include, str) else list(include)
        pkgs = tuple(sorted({p.strip() for p in items if p.strip()}))
        return cls(suite=suite, include=pkgs, variant=variant, mirror=mirror,
                   trusted=trusted)

    def source_line(self) -> str:
        """The apt sources line mmdebstrap is given (and the image keeps)."""
        opts = "[trusted=yes] " if self.trusted else ""
        return f"deb {opts}{self.mirror} {self.suite} main"

    def argv(self, target: str, *, keep_debs_in: str | None = None) -> list[str]:
        """The mmdebstrap command line bootstrapping into ``target`` (a directory).
        ``keep_debs_in``: also copy every downloaded .deb there (for :func:`fetch_repo`)."""
        argv = ["mmdebstrap", "--quiet", f"--variant={self.variant}", "--format=directory"]
        if self.mirror_dir() is not None:
            # root mode installs with dpkg inside the target: the mirror's .debs must be
            # visible there, which mmdebstrap's own hook does with a bind mount (made in
            # the contained namespace, so it goes with it; red team 28 B)
            argv.append(f"--hook-dir={FILE_MIRROR_HOOKS}")
        if self.include:
            argv.append("--include=" + ",".join(self.include))
        if keep_debs_in is not None:
            argv += ["--skip=download/empty", "--skip=essential/unlink",
                     f"--customize-hook=sync-out /var/cache/apt/archives {keep_debs_in}"]
        else:  # no .deb files and no apt lists in the layer: they are the mirror's
            argv.append('--customize-hook=rm -rf "$1"/var/lib/apt/lists/*_Packages '
                        '"$1"/var/cache/apt/*.bin')
        return [*argv, self.suite, target, self.source_line()]

    def keep_paths(self, target: str) -> list[str]:
        """What mmdebstrap reads or writes outside the system directories: the target
        and, for a ``file://`` mirror, its directory."""
        mirror = self.mirror_dir()
        return [target] if mirror is None else [target, mirror]

    def key(self) -> str:
        """The cache key of the package set (suite, variant, packages): not the mirror,
        which serves the same packages wherever it is."""
        text = "\n".join([self.suite, self.variant, *self.include])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def image_name(self) -> str:
        """The store name a bootstrap of this package set gets by default, and the one
        ``dsec.Image.debian`` looks for: ``debian-<suite>-<variant>-<key>``."""
        return f"debian-{self.suite}-{self.variant}-{self.key()}"

    def labels(self) -> dict[str, str]:
        return {"dsec.io/bootstrap": f"debian:{self.suite}:{self.variant}",
                "dsec.io/include": ",".join(self.include)}


@dataclass(frozen=True, slots=True)
class BootstrapResult:
    layer: LayerManifest
    seconds_bootstrap: float           # mmdebstrap
    seconds_layer: float               # EROFS build + hash
    special_files_dropped: list[str] = field(default_factory=list)


def repo_dir(plan: BootstrapPlan, cache_root: str = DEFAULT_REPO_CACHE) -> str:
    """Where :func:`fetch_repo` keeps the local repository of ``plan``'s package set."""
    return os.path.join(cache_root, f"{plan.suite}-{plan.variant}-{plan.key()}")


def contained(argv: Sequence[str], keep: Sequence[str] = ()) -> list[str]:
    """``argv`` run so that its mounts and processes die with it and with us: in a
    private mount namespace (made by :mod:`dsec.mountshed`, its first process) and its
    own pid namespace (util-linux ``unshare --pid --fork``), tied to this process by ``setpriv
    --pdeathsig KILL`` (unshare dies with us) and ``--kill-child=KILL`` (its child, the
    namespace's init, dies with unshare; the kernel then kills every process of the
    pid namespace, and the mount namespace, with the binds of the host's /dev/shm,
    /proc, /sys and the devpts that root-mode mmdebstrap makes in its target, goes with
    its last process). Before this, a kill -9 of dsec + mmdebstrap left those binds in
    the store's tmp/ for good, visible to every process of the host (red team 15, F18).
    The tree mmdebstrap writes is on the shared filesystem, so the result is seen.

    The mount namespace is made by :mod:`dsec.mountshed` itself (an outer one from
    ``unshare --mount`` would keep a full copy of the host's mounts in the waiting
    ``unshare``), which sheds the copy first:
    all but ``/``, the system and API filesystems and those holding ``keep`` (the
    target, a file mirror) and ``$TMPDIR`` - a bootstrap no longer pins an edge's disk
    pool, layers or network namespace pins for its whole run."""
    # env --chdir=/: a working directory on a host mount would pin it for the whole run
    # in whichever process still held it (unshare itself waits there; red team 28 A)
    return ["setpriv", "--pdeathsig", "KILL", "--", "env", "--chdir=/",
            "unshare", "--pid", "--fork", "--kill-child=KILL", "--",
            *shed_argv(argv, [*keep, tempfile.gettempdir()])]


def _run(argv: Sequence[str], what: str, *, cwd: str | None = None) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, check=False)
    except FileNotFoundError as exc:
        raise ImageError(f"{what}: {argv[0]} is not installed (make setup installs it: "
                         "it is in the Makefile's APT_PACKAGES)") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise ImageError(f"{what} failed with exit code {proc.returncode}: {tail}")
    return proc.stdout


def _drop_special_files(root: str) -> list[str]:
    """Remove what the one special-files rule of every door leaves out of a layer
    (:func:`dsec.image.tree.special_skip`: device nodes but whiteouts, sockets) under
    ``root/dev`` (the sandbox runtime gives each sandbox its own /dev); return their
    paths relative to ``root``."""
    dropped: list[str] = []
    dev = os.path.join(root, "dev")
    for dirpath, _dirs, files in os.walk(dev):
        for name in files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if special_skip(st.st_mode, st.st_rdev) is not None:
                os.unlink(p)
                dropped.append(os.path.relpath(p, root))
    return sorted(dropped)


def bootstrap_tree(plan: BootstrapPlan, target: str) -> list[str]:
    """mmdebstrap ``plan`` into the directory ``target`` (created), device nodes under
    /dev left out; returns the paths left out."""
    _run(contained(plan.argv(target), plan.keep_paths(target)),
         f"mmdebstrap {plan.suite} from {plan.mirror}")
    if (mirror := plan.mirror_dir()) is not None:
        # the file-mirror hook's empty mount point chain, not part of the image
        with contextlib.suppress(OSError):
            os.removedirs(os.path.join(target, mirror.lstrip("/")))
    return _drop_special_files(target)


def bootstrap_debian(store: LayerStore, plan: BootstrapPlan, *, name: str | None,
                     tag: str = "latest", namespace: str | None = None,
                     owner: str | None = None, compression: str | None = None,
                     progress: ProgressFn | None = None) -> BootstrapResult:
    """Bootstrap ``plan`` with mmdebstrap into a staging dir of ``store`` and store the
    tree as one ``base`` layer named ``[namespace/]name:tag``. Nothing is stored when
    mmdebstrap fails (its exit code and output tail are in the error)."""
    with store.staging("bootstrap-") as stage:
        target = os.path.join(stage, "root")
        t0 = time.monotonic()
        dropped = bootstrap_tree(plan, target)
        t1 = time.monotonic()
        m = store.add_tree(target, kind="base", name=name, tag=tag, labels=plan.labels(),
                           namespace=namespace, owner=owner,
                           compression=compression,  # type: ignore[arg-type]
                           progress=progress)
        t2 = time.monotonic()
    return BootstrapResult(layer=m, seconds_bootstrap=t1 - t0, seconds_layer=t2 - t1,
                           special_files_dropped=dropped)


def _remove_or_raise(path: str) -> None:
    res = remove_tree(path, detach=True)
    if not res.clean:
        raise ImageError(f"cannot remove {path}: {res.describe()}")


def fetch_repo(plan: BootstrapPlan, cache_root: str = DEFAULT_REPO_CACHE) -> str:
    """Make (once) a local apt repository holding every package ``plan`` installs, as
    ``<repo>/pool/*.deb`` + ``dists/<suite>/main/binary-<arch>/Packages`` + ``Release``
    (apt-ftparchive), by bootstrapping once from ``plan.mirror`` and keeping the .debs.
    Idempotent: a complete repo (its ``.complete`` marker, written last) is reused; a
    half-made one is rebuilt. Returns its directory; serve it and bootstrap with
    ``mirror=<its URL>, trusted=True``."""
    out = repo_dir(plan, cache_root)
    if os.path.exists(os.path.join(out, _COMPLETE)):
        return out
    os.makedirs(cache_root, exist_ok=True)
    work = f"{out}.tmp-{os.getpid()}"
    remove_tree(work, detach=True)      # a killed earlier run's (dsec's own scratch)
    pool = os.path.join(work, "pool")
    os.makedirs(pool)
    try:
        root = os.path.join(work, "root")
        _run(contained(plan.argv(root, keep_debs_in=pool), [*plan.keep_paths(root), pool]),
             f"mmdebstrap {plan.suite} from {plan.mirror}")
        _remove_or_raise(root)
        debs = [n for n in os.listdir(pool) if n.endswith(".deb")]
        if not debs:
            raise ImageError(f"mmdebstrap kept no .deb files in {pool}")
        for n in os.listdir(pool):      # apt's lock file and partial/ dir
            if not n.endswith(".deb"):
                p = os.path.join(pool, n)
                _remove_or_raise(p)
        arch = _run(["dpkg", "--print-architecture"], "dpkg").strip()
        dist = os.path.join(work, "dists", plan.suite)
        bdir = os.path.join(dist, "main", f"binary-{arch}")
        os.makedirs(bdir)
        packages = _run(["apt-ftparchive", "packages", "pool"], "apt-ftparchive packages",
                        cwd=work)
        with open(os.path.join(bdir, "Packages"), "w") as f:
            f.write(packages)
        release = _run(["apt-ftparchive", "-o", f"APT::FTPArchive::Release::Suite={plan.suite}",
                        "-o", f"APT::FTPArchive::Release::Codename={plan.suite}",
                        "-o", "APT::FTPArchive::Release::Components=main",
                        "-o", f"APT::FTPArchive::Release::Architectures={arch}",
                        "release", "."], "apt-ftparchive release", cwd=dist)
        with open(os.path.join(dist, "Release"), "w") as f:
            f.write(release)
        with open(os.path.join(work, _COMPLETE), "w") as f:
            f.write(f"{len(debs)} packages\n")
        remove_tree(out)
        os.rename(work, out)
    finally:
        remove_tree(work, detach=True)
    return out
