"""The microVM guest: kernel files, the agent binary and the initramfs (docs/vm.md).

Three artefacts, each cached and rebuilt only when its inputs change:

- **Kernel.** Debian bookworm's ``linux-image-6.12.*+deb12-cloud-amd64-unsigned``: the
  6.12 cloud flavour has what the density work needs (DAMON_RECLAIM, page reporting,
  FS_DAX) and is small; the 6.1 one has no DAMON. ``make setup`` runs
  ``python -m dsec.edge.backends.vm.guest fetch-kernel`` which downloads the newest 6.12
  package with ``apt-get download`` and unpacks ``vmlinuz`` and its modules into
  ``/var/cache/dsec/vm-kernel/<version>/`` (``current`` points at it; a ``.complete``
  stamp makes it idempotent). Runtime code only *finds* the kernel (:func:`find_kernel`);
  it never downloads.
- **Agent.** ``agent.c`` compiled with ``cc -O2 -static`` on first use into the cache
  directory nsexec uses (root-owned, private), named by a hash of source and flags.
- **Initramfs.** An uncompressed newc cpio written from Python (no cpio tool, no gzip:
  the kernel unpacks it fastest uncompressed, and it is ~1.5 MB): the agent as ``/init``,
  ``/dev/console``, the empty mount points, and the modules the guest needs decompressed
  (the kernel's own ``.ko.xz`` would need its in-kernel xz, and finit_module of a
  compressed file needs MODULE_INIT_COMPRESSED_FILE flags: plain is simpler) with
  ``/lib/modules/load.order`` in dependency order. Nothing else: the sandbox's userland
  comes from its image's EROFS layers (``setup``).

All functions take explicit paths (the cache dir, the kernel dir) so tests use temp dirs.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dsec import statedir
from dsec.edge.backends.container.nsexec import check_private, default_cache_dir
from dsec.errors import BackendError

__all__ = [
    "AGENT_CFLAGS",
    "DEFAULT_MODULES",
    "KERNEL_DIR",
    "GuestKernel",
    "agent_source",
    "ensure_agent",
    "ensure_initramfs",
    "fetch_kernel",
    "find_kernel",
    "kernel_cmdline",
    "module_load_order",
    "newc_archive",
]

#: Where ``make setup`` unpacks the guest kernel (override: ``$DSEC_VM_KERNEL_DIR``).
KERNEL_DIR = "/var/cache/dsec/vm-kernel"
#: The Debian package family of the guest kernel (6.12: DAMON, page reporting, FS_DAX).
KERNEL_PACKAGE_RE = re.compile(r"^linux-image-(6\.12\.(\d+)\+deb12-cloud-amd64)-unsigned$")
#: Modules the guest loads at boot (their dependencies are added): block devices for the
#: layers and the scratch disk, the filesystems, virtio-pmem for DAX layers, the balloon.
#: ext4, virtio-console and virtio-pci are built into the cloud kernel.
DEFAULT_MODULES: tuple[str, ...] = ("virtio_blk", "erofs", "overlay", "virtio_balloon",
                                    "virtio_pmem", "nd_pmem")
AGENT_CFLAGS: tuple[str, ...] = ("-O2", "-static", "-Wall", "-Wextra",
                                 "-Wno-unused-parameter", "-Wno-format-truncation")
_COMPILERS = ("cc", "gcc", "clang")
_STAMP = ".complete"


# ---------------------------------------------------------------------------- kernel
@dataclass(frozen=True, slots=True)
class GuestKernel:
    version: str          # uname -r, e.g. "6.12.118+deb12-cloud-amd64"
    vmlinuz: str          # path of the bzImage
    modules_dir: str      # .../lib/modules/<version>


def kernel_dir() -> str:
    return os.environ.get("DSEC_VM_KERNEL_DIR") or KERNEL_DIR


def find_kernel(base: str | None = None) -> GuestKernel:
    """The unpacked guest kernel under ``base`` (default :func:`kernel_dir`), or a
    BackendError saying how to get one."""
    base = base or kernel_dir()
    cur = os.path.join(base, "current")
    if not os.path.exists(os.path.join(cur, _STAMP)):
        raise BackendError(
            f"no guest kernel in {base} (missing {cur}/{_STAMP}): run `make setup` or "
            f"`python -m dsec.edge.backends.vm.guest fetch-kernel {base}` (downloads "
            "Debian's 6.12 cloud kernel with apt-get), or set DSEC_VM_KERNEL_DIR")
    with open(os.path.join(cur, "version")) as f:
        version = f.read().strip()
    vmlinuz = os.path.join(cur, "vmlinuz")
    mods = os.path.join(cur, "modules")
    return GuestKernel(version=version, vmlinuz=vmlinuz, modules_dir=mods)


def newest_kernel_package(apt_cache_output: str) -> tuple[str, str] | None:
    """(package, version) of the newest 6.12 cloud kernel in ``apt-cache search``
    output, comparing the patch level numerically (6.12.9 < 6.12.118)."""
    best: tuple[int, str, str] | None = None
    for line in apt_cache_output.splitlines():
        pkg = line.split(" ", 1)[0].strip()
        m = KERNEL_PACKAGE_RE.match(pkg)
        if m and (best is None or int(m.group(2)) > best[0]):
            best = (int(m.group(2)), pkg, m.group(1))
    return (best[1], best[2]) if best else None


def fetch_kernel(base: str | None = None, *, refresh: bool = False) -> GuestKernel:
    """Download and unpack the newest 6.12 cloud kernel into ``base`` (idempotent: an
    existing complete ``current`` is kept unless ``refresh``). Needs apt-get/dpkg-deb
    and network access to the Debian mirror; only ``make setup`` calls it."""
    base = base or kernel_dir()
    if not refresh:
        try:
            return find_kernel(base)
        except BackendError:
            pass
    os.makedirs(base, mode=0o755, exist_ok=True)
    out = subprocess.run(["apt-cache", "search", "--names-only",
                          r"^linux-image-6\.12\..*-cloud-amd64-unsigned$"],
                         capture_output=True, text=True, check=False).stdout
    found = newest_kernel_package(out)
    if found is None:
        raise BackendError("apt-cache knows no linux-image-6.12.*+deb12-cloud-amd64-unsigned "
                           "package: enable bookworm-updates/security (or backports) in "
                           "the apt sources and run apt-get update")
    pkg, version = found
    dest = os.path.join(base, version)
    if not os.path.exists(os.path.join(dest, _STAMP)):
        with tempfile.TemporaryDirectory(prefix="dsec-kernel-", dir=base) as tmp:
            r = subprocess.run(["apt-get", "download", pkg], cwd=tmp, capture_output=True,
                               text=True, check=False)
            debs = [f for f in os.listdir(tmp) if f.endswith(".deb")]
            if r.returncode != 0 or not debs:
                raise BackendError(f"apt-get download {pkg} failed: {r.stderr.strip()[-500:]}")
            x = os.path.join(tmp, "x")
            subprocess.run(["dpkg-deb", "-x", os.path.join(tmp, debs[0]), x], check=True)
            stage = os.path.join(tmp, "stage")
            os.makedirs(stage)
            shutil.move(os.path.join(x, "boot", f"vmlinuz-{version}"),
                        os.path.join(stage, "vmlinuz"))
            shutil.move(os.path.join(x, "boot", f"config-{version}"),
                        os.path.join(stage, "config"))
            shutil.move(os.path.join(x, "lib", "modules", version), os.path.join(stage, "modules"))
            with open(os.path.join(stage, "version"), "w") as f:
                f.write(version + "\n")
            open(os.path.join(stage, _STAMP), "w").close()
            if os.path.exists(dest):
                shutil.rmtree(dest)
            os.rename(stage, dest)
    link = os.path.join(base, f".current-{os.getpid()}")
    with _suppress_missing():
        os.unlink(link)
    os.symlink(version, link)
    os.replace(link, os.path.join(base, "current"))
    return find_kernel(base)


class _suppress_missing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, et: object, ev: object, tb: object) -> bool:
        return isinstance(ev, FileNotFoundError)


def kernel_cmdline(extra: Iterable[str] = ()) -> str:
    """The guest kernel command line. ``console=ttyS0`` (the host may log the serial
    port; the agent writes one line per boot and errors only), ``panic=-1`` (a guest
    panic reboots, and QEMU's ``-no-reboot`` turns that into an exit the host sees),
    ``quiet``; ``extra`` appended (density options, debugging)."""
    return " ".join(["console=ttyS0", "quiet", "loglevel=3", "panic=-1", "rdinit=/init",
                     *extra])


# ---------------------------------------------------------------------------- modules
_DEPENDS_RE = re.compile(rb"(?:^|\x00)depends=([^\x00]*)\x00")


def _module_index(modules_dir: str) -> dict[str, str]:
    idx: dict[str, str] = {}
    for root, _dirs, files in os.walk(os.path.join(modules_dir, "kernel")):
        for f in files:
            if f.endswith((".ko", ".ko.xz")):
                name = f.split(".ko", 1)[0]
                idx[name.replace("-", "_")] = os.path.join(root, f)
    return idx


def _module_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    return lzma.decompress(data) if path.endswith(".xz") else data


def module_depends(data: bytes) -> list[str]:
    """The ``depends=`` list of a module's .modinfo (module file bytes, decompressed)."""
    m = _DEPENDS_RE.search(data)
    if not m or not m.group(1):
        return []
    return [d.replace("-", "_") for d in m.group(1).decode().split(",") if d]


def module_load_order(modules_dir: str, wanted: Sequence[str]) -> list[tuple[str, bytes]]:
    """``wanted`` modules and everything they depend on, each after its dependencies,
    as (name, decompressed bytes). A module built into the kernel (in
    ``modules.builtin``) is skipped; an unknown one is a BackendError."""
    idx = _module_index(modules_dir)
    builtin: set[str] = set()
    with _suppress_missing(), open(os.path.join(modules_dir, "modules.builtin")) as f:
        builtin = {os.path.basename(line.strip()).split(".ko")[0].replace("-", "_")
                   for line in f if line.strip()}
    order: list[tuple[str, bytes]] = []
    state: dict[str, int] = {}       # 1 visiting, 2 done

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if state.get(name) == 2 or name in builtin:
            return
        if state.get(name) == 1:
            raise BackendError(f"module dependency cycle: {' -> '.join((*chain, name))}")
        path = idx.get(name)
        if path is None:
            raise BackendError(f"kernel module {name} (needed by {chain[-1] if chain else 'the guest'}) "
                               f"is not in {modules_dir}: is the kernel the 6.12 cloud one?")
        state[name] = 1
        data = _module_bytes(path)
        for dep in module_depends(data):
            visit(dep, (*chain, name))
        state[name] = 2
        order.append((name, data))

    for w in wanted:
        visit(w.replace("-", "_"), ())
    return order


# ---------------------------------------------------------------------------- agent
def agent_source() -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent.c")) as f:
        return f.read()


def ensure_agent(cache_dir: str | None = None, *,
                 compilers: tuple[str, ...] = _COMPILERS) -> str:
    """Path of an up-to-date static ``dsec-vm-agent`` (compiled on first use, ~1 s)."""
    cache_dir = cache_dir or default_cache_dir()
    src = agent_source()
    digest = hashlib.sha256(json.dumps([src, *AGENT_CFLAGS]).encode()).hexdigest()[:16]
    target = os.path.join(cache_dir, f"dsec-vm-agent-{digest}")
    os.makedirs(cache_dir, mode=0o755, exist_ok=True)
    # the agent built there runs as the guest's PID 1, and the host gives the guest its
    # files: same private cache as the container helper (DSEC_NSEXEC_DIR, /var/cache/dsec)
    check_private(cache_dir, what="the guest agent built there runs as the guest's PID 1")
    if os.path.exists(target):
        return target
    cc = next((c for c in compilers if shutil.which(c)), None)
    if cc is None:
        raise BackendError(f"the vm tier compiles its guest agent on first use, but none of "
                           f"{list(compilers)} is on PATH: install gcc and libc6-dev "
                           "(`make setup`)")
    with tempfile.TemporaryDirectory(prefix="dsec-vm-agent-", dir=cache_dir) as tmp:
        c = os.path.join(tmp, "agent.c")
        with open(c, "w") as f:
            f.write(src)
        out = os.path.join(tmp, "dsec-vm-agent")
        r = subprocess.run([cc, *AGENT_CFLAGS, "-o", out, c], capture_output=True, text=True,
                           check=False)
        if r.returncode != 0:
            raise BackendError(f"compiling the vm guest agent with {cc} failed (exit "
                               f"{r.returncode}): {r.stderr.strip()[-2000:]}; a static "
                               "build needs libc6-dev (`make setup`)")
        os.chmod(out, 0o755)
        # durable before it is named: the name alone is trusted from then on (an empty
        # agent after a power loss would be every guest's PID 1; see ensure_nsexec)
        statedir.fsync_file(out)
        os.rename(out, target)
        statedir.fsync_dir(cache_dir)
    return target


# ---------------------------------------------------------------------------- initramfs
def _newc_entry(name: str, mode: int, data: bytes = b"", *, ino: int, rdev: tuple[int, int] = (0, 0),
                nlink: int = 1) -> bytes:
    nb = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(nb), 0)
    head = b"070701" + b"".join(b"%08X" % v for v in fields)
    out = head + nb
    out += b"\0" * (-len(out) % 4)
    out += data
    out += b"\0" * (-len(out) % 4)
    return out


def newc_archive(entries: Iterable[tuple[str, int, bytes, tuple[int, int]]]) -> bytes:
    """An SVR4 "newc" cpio archive (what the kernel's initramfs unpacker reads) of
    (name, st_mode, data, (rdev major, minor)) entries, owner root, mtime 0, ended by
    the TRAILER!!! entry. Names are relative ("init", "dev/console"); parents first."""
    parts = []
    ino = 1
    for name, mode, data, rdev in entries:
        if name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"initramfs entry name {name!r} must be relative, without '..'")
        parts.append(_newc_entry(name, mode, data, ino=ino, rdev=rdev,
                                 nlink=2 if stat.S_ISDIR(mode) else 1))
        ino += 1
    parts.append(_newc_entry("TRAILER!!!", 0, ino=0, nlink=1))
    out = b"".join(parts)
    return out + b"\0" * (-len(out) % 512)


def initramfs_entries(agent: bytes, modules: Sequence[tuple[str, bytes]]
                      ) -> list[tuple[str, int, bytes, tuple[int, int]]]:
    d = stat.S_IFDIR | 0o755
    ents: list[tuple[str, int, bytes, tuple[int, int]]] = [
        (n, d, b"", (0, 0)) for n in ("dev", "proc", "sys", "lib", "lib/modules", "sb",
                                      "layers", "scratch")]
    ents.append(("tmp", stat.S_IFDIR | 0o1777, b"", (0, 0)))
    ents.append(("dev/console", stat.S_IFCHR | 0o600, b"", (5, 1)))
    ents.append(("init", stat.S_IFREG | 0o755, agent, (0, 0)))
    for name, data in modules:
        ents.append((f"lib/modules/{name}.ko", stat.S_IFREG | 0o644, data, (0, 0)))
    order = "".join(f"{name}.ko\n" for name, _ in modules).encode()
    ents.append(("lib/modules/load.order", stat.S_IFREG | 0o644, order, (0, 0)))
    return ents


def ensure_initramfs(kernel: GuestKernel, cache_dir: str | None = None, *,
                     modules: Sequence[str] = DEFAULT_MODULES) -> str:
    """Path of the initramfs for ``kernel`` with the current agent and ``modules``
    (built once per (agent, kernel, module list), ~0.3 s; written then renamed)."""
    cache_dir = cache_dir or default_cache_dir()
    agent_path = ensure_agent(cache_dir)
    key = hashlib.sha256(json.dumps([os.path.basename(agent_path), kernel.version,
                                     sorted(modules)]).encode()).hexdigest()[:16]
    target = os.path.join(cache_dir, f"dsec-vm-initramfs-{key}.cpio")
    if os.path.exists(target):
        return target
    with open(agent_path, "rb") as f:
        agent = f.read()
    mods = module_load_order(kernel.modules_dir, modules)
    data = newc_archive(initramfs_entries(agent, mods))
    fd, tmp = tempfile.mkstemp(prefix=".initramfs-", dir=cache_dir)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())        # the name alone is trusted from then on (as the agent)
    os.chmod(tmp, 0o644)
    os.rename(tmp, target)
    statedir.fsync_dir(cache_dir)
    return target


def _main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "fetch-kernel":
        k = fetch_kernel(argv[1] if len(argv) > 1 else None, refresh="--refresh" in argv)
        print(k.vmlinuz)
        return 0
    if len(argv) >= 1 and argv[0] == "initramfs":
        print(ensure_initramfs(find_kernel()))
        return 0
    print("usage: python -m dsec.edge.backends.vm.guest fetch-kernel [DIR] [--refresh] | "
          "initramfs", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
