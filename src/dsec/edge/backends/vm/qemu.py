"""QEMU for the vm backend: the command line (a pure function of :class:`VmSpec`), the
process marker reconcile looks for, and a small QMP client.

Choices measured on the dev machine (QEMU 7.2, TCG only: /dev/kvm is PVM-only):

- ``-M pc``: boots to userspace in ~1.6 s on a quiet machine; ``-M microvm`` hung in
  25-60% of runs.
- QEMU never opens a path of ours. Everything it needs is an inherited descriptor: the
  kernel and initramfs (``/proc/self/fd/N``: QEMU loads them by path; a reopen through
  /proc checks only the inode's mode, and both are world-readable), the disks
  (``-add-fd`` + ``/dev/fdset/N``: dup'd, never reopened, so a root-owned 0600 scratch
  file works), the listening agent and QMP sockets (``socket,fd=N``) and a migration
  file (``-incoming fd:N`` / QMP ``getfd``). So QEMU runs as an unprivileged uid of its
  own from its first instruction, in a sandbox directory it cannot even list.
- Why not ``-runas``: with ``-sandbox ...,elevateprivileges=deny`` QEMU 7.2 installs its
  seccomp filter before ``-runas`` drops privileges, and the setgid(2) is killed with
  SIGSYS (measured: audit syscall=106). We start it unprivileged instead (stronger: it
  never held root).
- ``-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny``
  forbids fork/exec, so QEMU 7.2 (which has no ``file:`` migration URI) migrates to an
  ``fd:`` only.
- TCG's translation cache defaults to 1 GiB of host memory (``-accel tcg,tb-size=``
  caps it, in MiB): it would dwarf a small guest's RAM.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import math
import os
import socket
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import BackendError, RemoteProtocolError, Timeout

__all__ = [
    "MARKER_PREFIX",
    "Disk",
    "Qmp",
    "QmpError",
    "VmSpec",
    "marker_of",
    "memory_mib",
    "parse_marker",
    "qemu_argv",
    "unix_path",
    "vcpus",
]

#: ``-name guest=<marker>``: how reconcile recognizes a QEMU of this backend in
#: /proc/<pid>/cmdline after an edge was killed (with the backend's key: two edges on one
#: host never touch each other's VMs).
MARKER_PREFIX = "dsec-vm"
#: Longest QMP line accepted: replies of the commands we send are a few hundred bytes;
#: QEMU runs the (hostile) guest, so it is read as a bounded peer too.
MAX_QMP_LINE = 1 << 20
MAX_QMP_EVENTS = 64


@dataclass(frozen=True, slots=True)
class Disk:
    """One virtio-blk disk from inherited descriptors: ``fd`` opened ``O_RDONLY`` for a
    read-only disk; a writable one also needs ``rw_fd`` (``O_RDWR``): QEMU opens a
    writable image read-only first, and takes from the fd set the descriptor whose
    access mode matches (measured: with only an O_RDWR one, "Could not dup FD ...
    flags 0: Permission denied")."""

    fd: int
    readonly: bool = True
    rw_fd: int | None = None


@dataclass(frozen=True, slots=True)
class VmSpec:
    """Everything one QEMU process is started with. Descriptors must be inheritable by
    the child (listed in ``pass_fds``: :meth:`fds`)."""

    marker: str                          # from marker_of()
    kernel_fd: int
    initrd_fd: int
    memory_mib: int
    vcpus: int
    agent_fd: int                        # listening unix socket (the agent's chardev)
    qmp_fd: int                          # listening unix socket (QMP)
    disks: tuple[Disk, ...] = ()         # guest /dev/vda, vdb, ... in this order
    incoming_fd: int | None = None       # a memory file written by migrate (resume)
    incoming_defer: bool = False         # wait for QMP migrate-incoming (capabilities first)
    console_fd: int | None = None        # serial console output (a file of the VM's uid)
    extra_fds: tuple[int, ...] = ()      # descriptors ``extra`` names (/proc/self/fd/N)
    tb_size_mib: int | None = 32         # None: QEMU's default translation cache
    append: str = "panic=-1 quiet"       # kernel command line (console= added as needed)
    extra: tuple[str, ...] = ()          # more arguments (vm/density.py's qemu_args)
    binary: str = "qemu-system-x86_64"

    def fds(self) -> list[int]:
        fds = [self.kernel_fd, self.initrd_fd, self.agent_fd, self.qmp_fd,
               *(d.fd for d in self.disks),
               *(d.rw_fd for d in self.disks if d.rw_fd is not None)]
        for fd in (self.incoming_fd, self.console_fd):
            if fd is not None:
                fds.append(fd)
        return fds + list(self.extra_fds)


#: First PCI slot of the disks (slot 0 host bridge, 1 PIIX3, 2 the virtio-serial
#: controller): explicit addresses keep /dev/vdX in command-line order.
_FIRST_DISK_SLOT = 4
_MAX_DISKS = 24


def qemu_argv(spec: VmSpec) -> list[str]:
    """The QEMU command line for ``spec`` (pure)."""
    if len(spec.disks) > _MAX_DISKS:
        raise BackendError(f"{len(spec.disks)} disks exceed the {_MAX_DISKS} PCI slots this "
                           "machine type gives the vm backend; merge image layers")
    append = spec.append
    accel = "tcg" if spec.tb_size_mib is None else f"tcg,tb-size={spec.tb_size_mib}"
    argv = [
        spec.binary, "-M", "pc", "-accel", accel,
        "-m", str(spec.memory_mib), "-smp", str(spec.vcpus),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-name", f"guest={spec.marker}",
        "-kernel", f"/proc/self/fd/{spec.kernel_fd}",
        "-initrd", f"/proc/self/fd/{spec.initrd_fd}",
    ]
    if spec.console_fd is not None:
        argv += ["-chardev", f"file,id=con,path=/proc/self/fd/{spec.console_fd}",
                 "-serial", "chardev:con"]
        append = f"console=ttyS0 {append}"
    else:
        argv += ["-serial", "none"]
    argv += ["-append", append,
             "-chardev", f"socket,id=qmp,fd={spec.qmp_fd},server=on,wait=off",
             "-mon", "chardev=qmp,mode=control",
             "-chardev", f"socket,id=agent,fd={spec.agent_fd},server=on,wait=off",
             # a new generation id per QEMU start, restores included: the guest kernel
             # (CONFIG_VMGENID=y) reseeds its RNG, so warm-pool clones and a resumed
             # sandbox do not replay the saved guest's random numbers
             "-device", "vmgenid,guid=auto",
             "-device", "virtio-serial-pci,id=vser0,addr=0x2",
             "-device", "virtserialport,bus=vser0.0,chardev=agent,name=dsec.agent"]
    for i, d in enumerate(spec.disks):
        # writable: a full host filesystem is an I/O error in the guest, not a VM
        # silently stopped (QEMU's default werror=enospc pauses it). Guest
        # discards are ignored: the scratch file is fallocated at create (the reservation
        # that keeps one tenant from filling the node's disk, backend.py) and a discard
        # would punch the reservation away; zero writes keep their blocks (ZERO_RANGE)
        ro = (",readonly=on" if d.readonly else
              ",werror=report,rerror=report,discard=ignore,detect-zeroes=on")
        argv += ["-add-fd", f"fd={d.fd},set={i + 1}"]
        if not d.readonly:
            if d.rw_fd is None:
                raise BackendError(f"writable disk {i} needs an O_RDWR descriptor (rw_fd)")
            argv += ["-add-fd", f"fd={d.rw_fd},set={i + 1}"]
        argv += [
                 "-drive", (f"file=/dev/fdset/{i + 1},format=raw,if=none,id=d{i},"
                           f"cache=writeback,file.locking=off{ro}"),
                 "-device", f"virtio-blk-pci,drive=d{i},addr={_FIRST_DISK_SLOT + i:#x}"]
    argv += list(spec.extra)
    if spec.incoming_defer:
        argv += ["-incoming", "defer"]
    elif spec.incoming_fd is not None:
        argv += ["-incoming", f"fd:{spec.incoming_fd}"]
    argv += ["-sandbox", ("on,obsolete=deny,elevateprivileges=deny,spawn=deny,"
                         "resourcecontrol=deny")]
    return argv


def vcpus(cpu_milli: int, *, max_vcpus: int) -> int:
    """Guest CPUs for a sandbox of ``cpu_milli`` (pure): whole cores rounded up, at
    least 1, at most the host's (TCG runs one host thread per vCPU; the cgroup's CPU
    limit is what bounds the time they get)."""
    return max(1, min(max_vcpus, math.ceil(cpu_milli / 1000)))


def memory_mib(memory_bytes: int) -> int:
    """Guest RAM in MiB for ``memory_bytes`` (pure): rounded up, at least 64 MiB (the
    6.12 cloud kernel with its initramfs needs ~40 MiB to reach userspace)."""
    return max(64, -(-memory_bytes // (1 << 20)))


def marker_of(key: str, sid: str) -> str:
    """The ``-name guest=`` value for sandbox ``sid`` of the backend with ``key``."""
    return f"{MARKER_PREFIX}.{key}.{sid}"


def parse_marker(cmdline: bytes, key: str) -> str | None:
    """The sandbox id in a ``/proc/<pid>/cmdline`` (NUL-separated) if it is a QEMU this
    backend (``key``) started, else None (pure)."""
    args = cmdline.split(b"\0")
    prefix = f"guest={MARKER_PREFIX}.{key}.".encode()
    for i, a in enumerate(args[:-1]):
        if a == b"-name" and args[i + 1].startswith(prefix):
            sid = args[i + 1][len(prefix):]
            try:
                text = sid.decode("ascii")
            except UnicodeDecodeError:
                return None
            return text if text and "/" not in text and "\0" not in text else None
    return None


#: what sun_path holds (108 bytes with its NUL); a little less, to be safe
_SUN_PATH_MAX = 100


@contextlib.contextmanager
def unix_path(path: str) -> Iterator[str]:
    """A name for the unix socket ``path`` that fits ``sun_path``: the path itself when
    short, else ``/proc/self/fd/N/NAME`` through a descriptor of its directory, open
    while the caller binds or connects. Sockets live in the sandbox's directory under
    ``root_dir``, whose length the backend does not choose (a pytest temp dir made one
    107 bytes long: "AF_UNIX path too long"); the kernel resolves the magic link, so
    the socket is the same file."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    d, name = os.path.split(path)
    fd = os.open(d or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


class QmpError(BackendError):
    """QEMU answered a QMP command with an error."""


@dataclass(slots=True)
class _QmpState:
    buf: bytearray = field(default_factory=bytearray)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_QMP_EVENTS))


class Qmp:
    """A QMP client over a unix socket: one command at a time (a lock), descriptors sent
    with ``SCM_RIGHTS`` (``getfd``), asynchronous events kept (the last
    ``MAX_QMP_EVENTS``) for :meth:`events`."""

    def __init__(self, sock: socket.socket, *, what: str) -> None:
        self._sock = sock
        self._what = what
        self._st = _QmpState()
        self._lock = asyncio.Lock()
        self.greeting: dict[str, Any] = {}

    @classmethod
    async def connect(cls, path: str, *, what: str, timeout: float = 10.0) -> Qmp:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                with unix_path(path) as short:
                    await loop.sock_connect(sock, short)
                self = cls(sock, what=what)
                self.greeting = await self._read_message()
                await self.execute("qmp_capabilities")
        except TimeoutError:
            sock.close()
            raise Timeout(f"QMP of {what} did not answer within {timeout}s") from None
        except OSError as exc:
            sock.close()
            raise BackendError(f"cannot connect to QMP of {what} at {path}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return self

    def close(self) -> None:
        self._sock.close()

    def events(self) -> list[dict[str, Any]]:
        """Events received so far (oldest first), cleared."""
        out = list(self._st.events)
        self._st.events.clear()
        return out

    async def _read_message(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        st = self._st
        while True:
            nl = st.buf.find(b"\n")
            if nl >= 0:
                line = bytes(st.buf[:nl])
                del st.buf[:nl + 1]
                try:
                    msg = json.loads(line)
                except ValueError as exc:
                    raise RemoteProtocolError(f"QMP of {self._what} sent invalid JSON: "
                                              f"{line[:200]!r}") from exc
                if not isinstance(msg, dict):
                    raise RemoteProtocolError(f"QMP of {self._what} sent a non-object")
                return msg
            if len(st.buf) > MAX_QMP_LINE:
                raise RemoteProtocolError(f"QMP of {self._what} sent a line over "
                                          f"{MAX_QMP_LINE} bytes")
            data = await loop.sock_recv(self._sock, 65536)
            if not data:
                raise BackendError(f"QMP of {self._what} closed the connection (QEMU exited?)")
            st.buf += data

    async def execute(self, command: str, arguments: dict[str, Any] | None = None, *,
                      fds: Sequence[int] = (), timeout: float = 30.0) -> Any:
        """Run ``command`` and return its ``return`` value; QmpError for an ``error``."""
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        data = json.dumps(msg).encode() + b"\n"
        loop = asyncio.get_running_loop()
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):
                    if fds:
                        # a few dozen bytes on a fresh, empty socket buffer: never EAGAIN
                        self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                     array.array("i", fds))])
                    else:
                        await loop.sock_sendall(self._sock, data)
                    while True:
                        reply = await self._read_message()
                        if "event" in reply:
                            self._st.events.append(reply)
                            continue
                        if "error" in reply:
                            err = reply["error"]
                            desc = err.get("desc", err) if isinstance(err, dict) else err
                            raise QmpError(f"QMP {command} on {self._what} failed: "
                                           f"{str(desc)[:500]}")
                        if "return" in reply:
                            return reply["return"]
            except TimeoutError:
                raise Timeout(f"QMP {command} on {self._what} got no answer within "
                              f"{timeout}s") from None
            except OSError as exc:
                raise BackendError(f"QMP {command} on {self._what}: {exc}") from exc

    async def wait_event(self, name: str, *, timeout: float) -> dict[str, Any]:
        """Wait for event ``name`` (one already received counts)."""
        for i, ev in enumerate(self._st.events):
            if ev.get("event") == name:
                del self._st.events[i]
                return ev
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):
                    while True:
                        msg = await self._read_message()
                        if msg.get("event") == name:
                            return msg
                        if "event" in msg:
                            self._st.events.append(msg)
            except TimeoutError:
                raise Timeout(f"{self._what}: no QMP event {name} within {timeout}s") from None
