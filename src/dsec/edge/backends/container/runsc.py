"""The runsc driver: the runc driver's OCI bundle run by gVisor (the "gvisor" tier).

gVisor runs the sandbox's processes on a user-space kernel (the Sentry) instead of the
host's: a process inside reaches the host kernel only through the Sentry's own narrow
seccomp filter, so a Linux kernel bug reachable from a syscall is (mostly) not reachable
from the sandbox. The bundle, the overlay root, the cgroups (``cgroupsPath`` relative,
under the runtime's own cgroup, as runc: the :class:`~dsec.edge.governor.Governor` finds
the same directories) and the hardening in ``config.json`` are the runc driver's
(:class:`.runc.RuncDriver`); what differs, and why:

- **Global flags**: ``--platform`` (how the Sentry traps syscalls: ``systrap`` >
  ``kvm`` > ``ptrace`` by speed; :func:`probe_platform` picks the first that runs a
  command on this node, cached per node - here only ptrace works: the 2022 Debian build
  has no systrap and kvm hangs on this PVM-only /dev/kvm), ``--network=none`` (loopback
  only, in the Sentry's own netstack), ``--overlay2=none`` (writes go through the gofer to
  the upper dir on the host, so pack_diff snapshots and the disk cap see them; a Sentry
  memory overlay would hide them), ``--file-access=shared`` (the Sentry revalidates what
  it cached, so what the edge's file API changes in the root is seen inside at once -
  measured: with ``exclusive`` a file the file API had removed was still listed and read
  inside; ``find / -xdev`` p50 58-87 ms with either, no difference above the noise of a
  loaded 2-core box), ``--oci-seccomp`` (the deny list of ``linux.seccomp`` applied by
  the Sentry - to the init only: runsc starts an exec'd process with no filter, so
  every exec runs ``nsexec filter`` first (the native driver's static helper and the
  compiled profile, at :data:`NSEXEC_IN`, :data:`SECCOMP_IN`), which loads the same
  profile and execs the command - one more execve inside, ~ms).
- **What the edge runs inside is one read-only directory mount** at :data:`HELPERS_IN`
  (the filter helper, the profile, the timeout-kill busybox; a host directory per
  content, :meth:`RunscDriver._helpers_dir`), not files bound into a directory the
  Sentry made: root inside cannot write a bound file, but it could rename their
  (tmpfs, 0777) parent away and plant its own "nsexec" and "busybox" - every later exec
  then ran unfiltered and timeouts killed nothing (red team 21, A1). A mount point
  cannot be renamed or removed (EBUSY) and sandbox root has no CAP_SYS_ADMIN to mount
  or unmount over it; ``runsc exec`` resolves the path in the container's own mount
  namespace from its root, so a chroot inside changes nothing either.
- **/tmp is on the sandbox's disk**, not a tmpfs: a tmpfs would live in the Sentry's
  memory, out of the host file API's reach (the edge could neither read nor write it).
  runsc mounts such a tmpfs over an empty /tmp by itself unless the spec mounts /tmp, so
  the root's own /tmp directory is bind-mounted there (the same directory: writes land
  in the upper dir).
  /dev/shm stays a Sentry tmpfs; the file API refuses /dev, /proc and /sys (the host side
  would reach the image's empty mount point directories, not what the sandbox sees).
- **Processes are Sentry tasks**, not host processes: exec cgroups cannot catch them. A
  foreground exec is its own session in gVisor (``runsc exec`` starts it with setsid);
  a timeout kills that session, its process group and their descendants from inside
  (:data:`KILL_SCRIPT`, run by the host's static busybox bind-mounted read-only at
  :data:`BUSYBOX_IN` - any image works, with or without a shell). A process that left
  the session (setsid) and was reparented to init escapes the timeout kill; it dies with
  the sandbox.
- **OOM**: the Sentry and its memory are one process in the sandbox's memory cgroup.
  runsc gives the Sentry ``--total-memory`` = the limit, so an allocation past it may
  fail inside (ENOMEM); but the Sentry's own overhead can tip the cgroup over first,
  and then the host OOM-kills the Sentry and the whole sandbox stops (reported as
  ``oom``), where a native sandbox loses one process. Which happens is a race.
- **Its control sockets are in a network namespace of the driver's own**: runsc binds
  each sandbox's control server on the abstract Unix socket ``@runsc-sandbox.<id>`` in
  the netns of whoever ran ``runsc run``, and abstract sockets have no file mode. The
  Sentry's server admits a peer whose uid equals its own getuid() - 65534 in the user
  namespace runsc gives it, where every unmapped host uid also reads as 65534 - so in
  the host netns every host user could call ``containerManager.ExecuteAsync`` (a root
  shell inside), ``Processes`` or ``Checkpoint`` (found by hx, test
  tests/security/hx_hardening/test_gvisor_control_socket.py). Every runsc command runs
  under ``nsenter --net=<root_dir>/control.netns`` (a namespace pinned there, kept across
  edge restarts so re-adopted sandboxes stay reachable; ~1 ms per command), and the
  platform probe's ``runsc do`` in a throwaway one (``unshare --net``). Which sandboxes
  an older edge left in the host netns is decided from root-written state (a mark per
  sandbox, the Sentry's own socket inode), never from a name a host user can bind
  (:meth:`RunscDriver._legacy`).
- **An exec's argv, env, cwd and user** go in a 0600 ``--process`` file (as for runc,
  :meth:`.runc.RuncDriver._process_file`), not on the command line of ``runsc exec`` or
  of the waiter a background exec leaves on the host (red team 22, A3).
- **Logs**: ``run``'s log goes to a pipe read only while ``run`` runs, then closed: the
  Sentry and gofer keep the log descriptor for their lives, and a file there would be
  host disk a sandbox could fill (warnings it provokes) after its unlink.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet

from dsec import statedir
from dsec.edge.backends.container import linux
from dsec.edge.backends.container.box import Box
from dsec.edge.backends.container.census import cgroup_parents, remove_cgroup_dirs
from dsec.edge.backends.container.files import SandboxFiles
from dsec.edge.backends.container.nsexec import ensure_nsexec
from dsec.edge.backends.container.oci import oci_config
from dsec.edge.backends.container.runc import (
    INIT,
    PASSWD_MAX_BYTES,
    RuncDriver,
    _mount_overlay,
    _numeric_user,
)
from dsec.edge.governor import ExecCgroup
from dsec.errors import BackendError, CannotRun, DsecError, InvalidArgument
from dsec.net.netns import new_netns, open_pinned, pin, unpin
from dsec.net.seccomp import compile_profile
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult

__all__ = [
    "BUSYBOX",
    "BUSYBOX_IN",
    "HELPERS_IN",
    "HIDDEN_PREFIXES",
    "KILL_SCRIPT",
    "PLATFORMS",
    "RunscDriver",
    "choose_platform",
    "helpers_bound",
    "listed_platforms",
    "probe_platform",
    "runsc_config",
    "stale_helpers",
    "write_helpers",
]

#: platforms by preference (fastest first): systrap (seccomp traps, gVisor >= 2023),
#: kvm (hardware virtualisation, needs a usable /dev/kvm), ptrace (works everywhere)
PLATFORMS = ("systrap", "kvm", "ptrace")
BUSYBOX = "/bin/busybox"          # Debian's busybox-static (make setup)
HELPERS_IN = "/dev/.dsec"          # one read-only directory mount: nothing in it can move
BUSYBOX_IN = "/dev/.dsec/busybox"  # its basename must be "busybox" to dispatch applets
NSEXEC_IN = "/dev/.dsec/nsexec"    # the native driver's static helper: `filter` mode
SECCOMP_IN = "/dev/.dsec/seccomp"  # the sandbox's seccomp program (BPF)
#: paths the sandbox sees as Sentry-internal mounts: the host file API must not act on
#: the image's mount point directories under them (writes would be invisible inside)
HIDDEN_PREFIXES = ("/dev", "/proc", "/sys")
LOG_MAX_BYTES = 1 << 20
log = logging.getLogger("dsec.edge.container.runsc")
#: host tasks of the Sentry itself (Go threads; ~100 measured idle with ptrace) added to
#: the sandbox's pids.max on the host, so ``pids_max`` still means about what the
#: sandbox's own processes may number (each of them is also a host stub task on ptrace)
SENTRY_PIDS = 256
CONTROL_NETNS = "control.netns"   # under root_dir: the netns runsc commands run in
#: ``<state_root>/<sid>.control-netns``: written (by root, in the 0700 state dir) before
#: the ``runsc run`` of a sandbox whose control socket is in the control namespace
CONTROL_MARK = ".control-netns"
CREATE_TIMEOUT_S = 60.0           # a platform that hangs (kvm on PVM) must not hang create

# Kills, from inside the sandbox, every task of session/process group $1 and every
# descendant of one (by ppid), until none is left (bounded rounds). The whole set is found
# before anything is killed, then stopped, then killed: a parent killed first would have
# its children reparented to init before they were seen as its. busybox ash: `kill` and
# `read` are builtins, so nothing from the image is needed.
KILL_SCRIPT = r"""
s=$1; keep=" $s "; r=0
while [ $r -lt 50 ]; do
  live=; grow=1
  while [ -n "$grow" ]; do
    grow=
    for d in /proc/[0-9]*; do
      p=${d#/proc/}
      read -r st < $d/stat 2>/dev/null || continue
      set -- ${st##*) }
      case "$keep" in
        *" $p "*) ;;
        *" $2 "*) keep="$keep$p "; grow=1;;
        *) if [ "$3" = "$s" ] || [ "$4" = "$s" ]; then keep="$keep$p "; grow=1; else continue; fi;;
      esac
      [ "$1" = Z ] || case " $live " in *" $p "*) ;; *) live="$live $p";; esac
    done
  done
  [ -z "$live" ] && exit 0
  for p in $live; do kill -STOP $p 2>/dev/null; done
  for p in $live; do kill -9 $p 2>/dev/null; done
  r=$((r+1))
done
"""


def listed_platforms(help_text: str) -> list[str]:
    """The platform names ``runsc help platforms`` prints, one a line (pure)."""
    return [w for w in (ln.strip() for ln in help_text.splitlines())
            if re.fullmatch(r"[a-z0-9_-]+", w)]


def choose_platform(listed: Sequence[str], works: Callable[[str], bool]) -> str | None:
    """The first of :data:`PLATFORMS` that ``listed`` has and ``works`` accepts (pure
    apart from ``works``, which runs the probe)."""
    for name in PLATFORMS:
        if name in listed and works(name):
            return name
    return None


def _probe_one(binary: str, state: str, platform: str, timeout_s: float) -> bool:
    """``runsc --platform=P do /bin/true`` (the host root under an overlay, no network):
    True if it exited 0 within ``timeout_s``. On a timeout the process group (a new
    session: ours, unreaped, so its id names nobody else) is killed."""
    if platform == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    # --ignore-cgroups: `runsc do` otherwise makes a ``runsc-<n>`` cgroup in every
    # hierarchy and removes it only when it exits on its own - a probe killed on its
    # timeout left one behind in each (36 found on the dev VM after a day of test runs;
    # an empty memory cgroup costs ~300 KiB of kernel memory here, docs/container.md).
    proc = subprocess.Popen(   # a netns of its own: the probe's control socket (below)
        ["unshare", "--net", "--", binary, "--root", state, "--ignore-cgroups",
         f"--platform={platform}", "--network=none",
         "do", "/bin/true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
        # `runsc do` makes $TMPDIR/runsc-do<n> and removes it only when it exits on its
        # own: inside ``state``, which the caller removes (red team 24 E1)
        env={**os.environ, "TMPDIR": state})
    try:
        return proc.wait(timeout_s) == 0
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


_PROBED: dict[tuple[str, str], str] = {}   # (binary, cache_dir) -> platform, per process


def probe_platform(binary: str, cache_dir: str | None = None, *,
                   timeout_s: float = 5.0) -> str:
    """The fastest platform that works here, probed once per node: the answer is kept in
    ``cache_dir/runsc-platform.json`` (default: the node's cache dir, where the native
    helper is built: /var/cache/dsec for root) keyed by the runsc version and the kernel
    release (either changing probes again), and in this process. Measured here: ptrace
    ~0.2 s, kvm hangs until the timeout (5 s, paid once per node), systrap is unknown
    to the 2022 build."""
    if cache_dir is None:
        from dsec.edge.backends.container.nsexec import default_cache_dir
        cache_dir = default_cache_dir()
    memo = _PROBED.get((binary, cache_dir))
    if memo is not None:
        return memo
    chosen = _probe_cached(binary, cache_dir, timeout_s)
    _PROBED[(binary, cache_dir)] = chosen
    return chosen


def _probe_cached(binary: str, cache_dir: str, timeout_s: float) -> str:
    try:
        ver = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=30, check=False).stdout.splitlines()[:1]
        listed = listed_platforms(subprocess.run(
            [binary, "help", "platforms"], capture_output=True, text=True,
            timeout=30, check=False).stdout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendError(f"cannot run {binary} to probe gVisor's platforms: {exc}; "
                           "install runsc (make setup) or give platform=") from exc
    key = f"{ver[0] if ver else '?'} / {os.uname().release}"
    path = os.path.join(cache_dir, "runsc-platform.json")
    try:
        with open(path) as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise ValueError("written by someone else: probe again")
            rec = json.load(f)
        if rec.get("key") == key and rec.get("platform") in listed:
            return str(rec["platform"])
    except (OSError, ValueError, AttributeError):
        pass
    state = tempfile.mkdtemp(prefix="dsec-runsc-probe-")
    try:
        chosen = choose_platform(listed, lambda p: _probe_one(binary, state, p, timeout_s))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    if chosen is None:
        raise BackendError(f"no gVisor platform works on this node ({binary} lists "
                           f"{listed or 'none'}; each was tried with `runsc do /bin/true`): "
                           "the gvisor tier is unavailable here")
    try:  # the next edge start skips the probe; not fatal if the cache is not writable
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"key": key, "platform": chosen, "listed": listed}, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("gVisor platform %s not cached in %s: %s", chosen, cache_dir, exc)
    return chosen


def runsc_config(cfg: dict[str, object], *, tmp_dir: str | None,
                 helpers: str | None = None) -> dict[str, object]:
    """The runc bundle config adjusted for runsc (pure; a new dict): /tmp on the disk -
    ``tmp_dir``, the root's own /tmp, bound over it (None: the image has no /tmp
    directory; runsc then makes a Sentry tmpfs) - and the host directory ``helpers``
    (busybox, nsexec, seccomp: :func:`write_helpers`) read-only at :data:`HELPERS_IN`,
    the directory itself the mount point (see the module docstring)."""
    mounts = [m for m in cfg["mounts"] if m["destination"] != "/tmp"]  # type: ignore[attr-defined]
    if tmp_dir is not None:
        mounts.append({"destination": "/tmp", "type": "bind", "source": tmp_dir,
                       "options": ["rbind", "rw", "nosuid", "nodev"]})
    if helpers is not None:
        mounts.append({"destination": HELPERS_IN, "type": "bind", "source": helpers,
                       "options": ["bind", "ro", "nosuid", "nodev"]})
    return {**cfg, "mounts": mounts}


def write_helpers(parent: str, *, busybox: str, nsexec: str, seccomp: bytes) -> str:
    """The host directory bound at :data:`HELPERS_IN`: ``parent``/<digest of the
    contents> holding ``busybox``, ``nsexec`` (copies, 0555) and ``seccomp`` (0444),
    made once (built aside, renamed into place) and never changed after: running
    sandboxes keep it mounted, so a new content is a new directory."""
    with open(busybox, "rb") as f:
        bb = f.read()
    with open(nsexec, "rb") as f:
        nx = f.read()
    h = hashlib.sha256()
    for part in (bb, nx, seccomp):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    path = os.path.join(parent, h.hexdigest()[:16])
    if os.path.isdir(path):
        return path
    os.makedirs(parent, mode=0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=parent)
    try:
        for name, data, mode in (("busybox", bb, 0o555), ("nsexec", nx, 0o555),
                                 ("seccomp", seccomp, 0o444)):
            fd = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                # durable before the directory is named: a directory of that name is
                # trusted whole from then on (an empty nsexec after a power loss broke
                # every sandbox of the tier until someone deleted it)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(os.path.join(tmp, name), mode)
        os.chmod(tmp, 0o555)
        statedir.fsync_dir(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.isdir(path):   # not a concurrent maker's: a real failure
                raise
        statedir.fsync_dir(parent)
    finally:
        if os.path.isdir(tmp):
            os.chmod(tmp, 0o700)
            shutil.rmtree(tmp, ignore_errors=True)
    return path


#: a ``.build-*`` directory younger than this may be a maker's in flight
BUILD_KEEP_S = 600.0


def stale_helpers(names: Sequence[str], keep: AbstractSet[str], ages: dict[str, float],
                  *, build_keep_s: float = BUILD_KEEP_S) -> list[str]:
    """The entries of the helpers parent to remove (pure): every content directory no
    sandbox binds and this driver does not use (``keep``: names), and ``.build-*`` left
    over older than ``build_keep_s`` (``ages``: seconds since their mtime)."""
    out = []
    for n in names:
        if n.startswith(".build-"):
            if ages.get(n, 0.0) > build_keep_s:
                out.append(n)
        elif n not in keep:
            out.append(n)
    return sorted(out)


def helpers_bound(config_paths: Iterable[str]) -> set[str]:
    """The host directories the bundles at ``config_paths`` bind at :data:`HELPERS_IN`
    (a bundle that cannot be read binds nothing we could know of)."""
    out = set()
    for path in config_paths:
        try:
            with open(path, "rb") as f:
                cfg = json.loads(f.read(1 << 22))
            for m in cfg.get("mounts") or ():
                if isinstance(m, dict) and m.get("destination") == HELPERS_IN:
                    out.add(os.path.realpath(str(m.get("source"))))
        except (OSError, ValueError, AttributeError):
            continue
    return out


def pin_control_netns(path: str) -> str:
    """A private network namespace pinned at ``path`` (the one already pinned there,
    e.g. by the edge before a restart, is kept): where runsc's abstract control sockets
    live, out of host users' reach (module docstring)."""
    fd = open_pinned(path)
    if fd is None:
        fd = new_netns()
        try:
            pin(fd, path)
        except OSError as exc:
            raise BackendError(f"cannot pin the gvisor tier's control network namespace "
                               f"at {path}: {exc}") from exc
        finally:
            os.close(fd)
    else:
        os.close(fd)
    return path


def control_inodes(net_unix: bytes, sid: str) -> set[int]:
    """The inodes of the sockets named ``@runsc-sandbox.<sid>`` (with or without the
    trailing NUL runsc binds) in a ``/proc/net/unix`` table (pure)."""
    names = {f"@runsc-sandbox.{sid}".encode(), f"@runsc-sandbox.{sid}@".encode()}
    out = set()
    for line in net_unix.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7] in names and parts[6].isdigit():
            out.add(int(parts[6]))
    return out


def sandbox_pid(state_file: str) -> int | None:
    """The Sentry's host pid recorded in a runsc container state file (None: unknown)."""
    try:
        with open(state_file, "rb") as f:
            rec = json.loads(f.read(1 << 22))
        box = rec.get("sandbox") or rec.get("Sandbox")   # (the 2022 build: lower case)
        pid = box.get("pid", box.get("Pid"))
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return pid if isinstance(pid, int) and pid > 1 else None


def socket_inodes(pid: int | None) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open (empty: none, or gone)."""
    out: set[int] = set()
    if pid is None:
        return out
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link.endswith("]"):
                out.add(int(link[8:-1]))
    return out


def _caller_mistake(err: str) -> int | None:
    """127 (no such program), 126 (no such cwd) for ``runsc exec``'s error text, or None."""
    if "failed to find initial working directory" in err:
        return 126
    if "error finding executable" in err or "failed to load" in err:
        return 127
    return None


class RunscDriver(RuncDriver):
    """gVisor's runsc in place of runc (see the module docstring)."""

    detach_flag = "--detach"

    def __init__(self, *, binary: str, root_dir: str, cgroup_parent: str,
                 platform: str | None = None, busybox: str = BUSYBOX) -> None:
        """``platform``: gVisor's platform (None: :func:`probe_platform`, cached per
        node)."""
        if not os.path.isfile(busybox):
            raise BackendError(f"{busybox} not found: the gvisor tier kills timed-out execs "
                               "with it; install busybox-static (make setup)")
        super().__init__(binary=binary, root_dir=root_dir, cgroup_parent=cgroup_parent)
        if platform is not None and platform not in PLATFORMS:
            raise InvalidArgument(f"gVisor platform {platform!r} is unknown; use one of "
                                  f"{', '.join(PLATFORMS)} or leave it out to probe",
                                  field="platform")
        self.platform = platform or probe_platform(binary)
        self.busybox = busybox
        self.nsexec = ensure_nsexec()
        self.root_dir = root_dir
        self._helpers: dict[bool, str] = {}
        self.control_netns = pin_control_netns(os.path.join(root_dir, CONTROL_NETNS))
        #: sandbox -> its control socket is in the host's netns (:meth:`_legacy`)
        self._legacy_known: dict[str, bool] = {}
        self._host_sockets: tuple[float, bytes] | None = None

    def _launcher(self, args: Sequence[str] = ()) -> list[str]:
        """``nsenter`` into the control namespace - except for a sandbox an edge of
        before it started (its control socket is in the host's netns, where ``runsc``
        must connect: :meth:`_legacy`)."""
        if any(self._legacy(a) for a in args):
            return []
        return ["nsenter", f"--net={self.control_netns}", "--"]

    def _mark(self, sid: str) -> str:
        return os.path.join(self.state_root, f"{sid}{CONTROL_MARK}")

    def _legacy(self, arg: str) -> bool:
        """Whether ``arg`` names a sandbox whose control socket is in the host's network
        namespace (started by an edge before the control namespace: it stays reachable
        by host users until it is recreated, and is logged once). Checked once per
        sandbox, and only for names that have runsc state here.

        Decided from what only root writes, never from a name in the host's socket
        table alone: abstract names are free for any host user to bind and sandbox ids
        are public on the host, so "``@runsc-sandbox.<id>`` is listed" made a restarted
        edge send a sandbox's execs (env, stdio fds) to a host user's socket (red team
        22, A1). A sandbox this driver started has its mark (:data:`CONTROL_MARK`, in
        the 0700 state dir): never legacy. One without (an older edge's) is legacy only
        if the listed socket's inode is an open file of the sandbox's own Sentry
        (its pid from the runsc state); else its commands stay in the control
        namespace (where a truly unreachable one fails, rather than talk to a stranger)."""
        known = self._legacy_known.get(arg)
        if known is not None:
            return known
        if not arg or arg[0] == "-" or "/" in arg or len(arg) > 128:
            return False
        state = os.path.join(self.state_root, f"{arg}_sandbox:{arg}.state")
        if not os.path.exists(state):
            return False
        if os.path.exists(self._mark(arg)):
            self._legacy_known[arg] = False
            return False
        now = time.monotonic()
        if self._host_sockets is None or now - self._host_sockets[0] > 5.0:
            try:   # the host netns's socket table, read at most every 5 s (adoption)
                with open("/proc/self/net/unix", "rb") as f:
                    self._host_sockets = (now, f.read())
            except OSError:
                self._host_sockets = (now, b"")
        inodes = control_inodes(self._host_sockets[1], arg)
        legacy = bool(inodes) and bool(inodes & socket_inodes(sandbox_pid(state)))
        if inodes and not legacy:
            log.warning("gvisor sandbox %s: a socket named like its control socket is in "
                        "the host's network namespace but is not its Sentry's (a host "
                        "user's?): not used; its runsc commands stay in %s", arg,
                        self.control_netns)
        if legacy:
            log.warning("gvisor sandbox %s was started by an older edge: its control socket "
                        "is in the host's network namespace, open to every host user, "
                        "until it is recreated (docs/host-security.md)", arg)
        self._legacy_known[arg] = legacy
        return legacy

    def release(self) -> None:
        """Unpin the control namespace (only when no sandbox of this root is left: a
        live one's control socket is in it)."""
        with contextlib.suppress(OSError):
            unpin(self.control_netns)

    def _global_args(self) -> list[str]:
        return [f"--platform={self.platform}", "--network=none", "--overlay2=none",
                "--file-access=shared", "--oci-seccomp"]

    def _config(self, box: Box) -> dict[str, object]:
        return runsc_config(oci_config(spec=box.spec, hostname=box.sid[:63],
                                       cgroups_path=f"{self.cgroup_parent}/{box.sid}",
                                       init_path=INIT,
                                       pids_max=None if box.pids_max is None
                                       else box.pids_max + SENTRY_PIDS),
                            tmp_dir=_tmp_dir(os.path.join(box.dir, "root")),
                            helpers=self._helpers_dir(box.spec.allow_nested))

    def _helpers_dir(self, nested: bool) -> str:
        """The read-only directory bound at :data:`HELPERS_IN` for sandboxes of this
        ``allow_nested`` value (the native profile compiled once per value)."""
        if nested not in self._helpers:
            self._helpers[nested] = write_helpers(
                os.path.join(self.root_dir, "runsc-helpers"), busybox=self.busybox,
                nsexec=self.nsexec, seccomp=compile_profile(allow_nested=nested))
        return self._helpers[nested]

    def gc_helpers(self, box_dirs: Iterable[str]) -> list[str]:
        """Remove the helper directories (``<root_dir>/runsc-helpers/<digest>``) that no
        sandbox in ``box_dirs`` binds and this driver does not use: every edge upgrade
        that changes nsexec, busybox or the seccomp profile made a new one, and nothing
        removed the old (hx). A directory a live sandbox binds must stay whole: the bind
        shares its inodes, so deleting inside it would delete in the sandbox too.
        Returns the names removed (blocking: run in a thread)."""
        parent = os.path.join(self.root_dir, "runsc-helpers")
        try:
            entries = {e.name: e for e in os.scandir(parent)}
        except FileNotFoundError:
            return []
        keep = {os.path.basename(p) for p in self._helpers.values()}
        keep |= {os.path.basename(p) for p in helpers_bound(
            os.path.join(d, "config.json") for d in box_dirs)
            if os.path.dirname(p) == os.path.realpath(parent)}
        now = time.time()
        ages = {}
        for n, e in entries.items():
            with contextlib.suppress(OSError):
                ages[n] = now - e.stat(follow_symlinks=False).st_mtime
        gone = stale_helpers(sorted(entries), keep, ages)
        for n in gone:
            path = os.path.join(parent, n)
            with contextlib.suppress(OSError):
                os.chmod(path, 0o700)   # made 0555: its entries cannot go otherwise
            shutil.rmtree(path, ignore_errors=True)
        return gone

    def files(self, box: Box, **kw: object) -> SandboxFiles:
        """The sandbox's files: its overlay root as the gofer serves it (the Sentry's own
        process has an empty root: /proc/<pid>/root shows nothing of the sandbox)."""
        fd = os.open(os.path.join(box.dir, "root"), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return SandboxFiles(fd, box.sid, hidden=HIDDEN_PREFIXES, **kw)  # type: ignore[arg-type]

    async def create(self, box: Box) -> int:
        root = os.path.join(box.dir, "root")
        _mount_overlay(root, box.layers.lowerdirs, box.upper, box.work)
        with open(os.path.join(box.dir, "config.json"), "w") as f:  # noqa: ASYNC230
            json.dump(self._config(box), f)
        pid_file = os.path.join(box.dir, "init.pid")
        self._legacy_known[box.sid] = False   # started now, in the control namespace
        if self._launcher([box.sid]):   # (an old driver's run, in tests, has no mark)
            fd = os.open(self._mark(box.sid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                         | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.control_netns)
        code, err = await self._run_piped_log(
            "run", "--detach", "--bundle", box.dir, "--pid-file", pid_file, box.sid)
        if code != 0:
            raise BackendError(f"runsc run failed for sandbox {box.sid} (platform "
                               f"{self.platform}): {err or f'exit code {code}'}")
        with open(pid_file) as f:  # noqa: ASYNC230 - a few bytes on local disk
            return int(f.read().strip())

    async def destroy(self, sid: str, box_dir: str) -> None:
        """Forget a sandbox the backend already killed: its state files, the cgroups runsc
        made in hierarchies the governor does not manage (blkio, cpuset, devices,
        name=systemd), the rootfs mount. Not ``runsc delete --force``: it waits for the
        killed Sandbox process to be reaped by whoever its parent is now (``run``
        exits, so init), polling - 1.1-1.6 s per destroy here."""
        for name in (f"{sid}_sandbox:{sid}.state", f"{sid}_sandbox:{sid}.lock",
                     f"{sid}{CONTROL_MARK}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.state_root, name))
        self._legacy_known.pop(sid, None)
        name = self.cgroup_parent.removeprefix("dsec-")
        try:
            dirs = [os.path.join(p, sid) for p in cgroup_parents(name)]
        except OSError:
            dirs = []
        with contextlib.suppress(OSError):
            await remove_cgroup_dirs([d for d in dirs if os.path.isdir(d)])
        root = os.path.join(box_dir, "root")
        for _ in range(3):
            try:
                linux.umount2(root, linux.MNT_DETACH)
            except OSError:
                break

    async def _run_piped_log(self, *args: str) -> tuple[int, str]:
        """Run a runsc command whose log descriptor the sandbox keeps (``run``): a pipe,
        read while the command runs (at most LOG_MAX_BYTES kept), closed after."""
        loop = asyncio.get_running_loop()
        r, w = os.pipe2(os.O_CLOEXEC)
        buf = bytearray()
        os.set_blocking(r, False)

        def readable() -> None:
            with contextlib.suppress(BlockingIOError):
                data = os.read(r, 65536)
                if len(buf) < LOG_MAX_BYTES:
                    buf.extend(data[:LOG_MAX_BYTES - len(buf)])
                if not data:
                    loop.remove_reader(r)
        loop.add_reader(r, readable)
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self._launcher(args), self.binary, "--root", self.state_root,
                    "--log-fd", str(w),
                    "--log-format", "json", *self._global_args(), *args,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL, pass_fds=(w,))
            finally:
                os.close(w)
            try:
                await asyncio.wait_for(proc.wait(), CREATE_TIMEOUT_S)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise BackendError(f"runsc {args[0]} did not finish within "
                                   f"{CREATE_TIMEOUT_S:g} s (platform {self.platform}) and "
                                   "was killed") from None
            readable()
        finally:
            loop.remove_reader(r)
            os.close(r)
        return proc.returncode or 0, _errors(bytes(buf))

    async def exec(self, box: Box, req: ExecRequest, argv: list[str], env: list[str],
                   on_chunk: Callable[[ExecChunk], None] | None, *,
                   cgroup: ExecCgroup | None = None,
                   kill: Callable[[], object] = lambda: None,
                   start_timeout_s: float | None = None) -> ExecResult:
        """``runsc exec``; ``cgroup``/``kill`` are not used (Sentry tasks are in no exec
        cgroup): a timeout kills the exec's session from inside (:meth:`_kill_session`)."""
        del cgroup, kill
        t0 = time.monotonic()
        args = ["exec"]
        if req.user is not None:
            # HOME is the user's from the sandbox's passwd, as the native driver does
            env = [e for e in env if not e.startswith("HOME=")]
            env.append(f"HOME={self._home(box, req.user)}")
        user = None
        if req.user is not None:
            try:
                user = self._user(box, req.user)
            except CannotRun as exc:
                if req.background:
                    raise
                # a foreground exec reports it as a shell would (nsexec.c: 126)
                return ExecResult(exit_code=126, stderr=f"cannot run: {exc.message}\n".encode(),
                                  duration_s=time.monotonic() - t0)
        stamp = time.monotonic_ns()
        ipid_file = os.path.join(box.dir, f"exec-{stamp}.ipid")
        args += ["--internal-pid-file", ipid_file]
        pid_file = os.path.join(box.dir, f"exec-{stamp}.pid")
        if req.background and not self._runnable(box, argv[0], env, req.cwd or "/"):
            raise CannotRun(f"exec in sandbox {box.sid} could not start: {argv[0][:200]!r} "
                            "is not an executable file in the sandbox (nor in its PATH); "
                            "check the program", sandbox_id=box.sid, exit_code=127)
        if req.background:
            # --pid-file is needed: without it this runsc appends its own --pid-file to
            # the command's argv (`sleep: invalid number '--pid-file=...'`)
            args += ["--detach", "--pid-file", pid_file]
        try:
            # argv, env, cwd, user in a 0600 process.json, never on the command line (the
            # detached waiter of a background exec lives as long as the command); through
            # the filter: runsc gives an exec'd process no OCI seccomp filter
            with self._process_file(box, argv=[NSEXEC_IN, "filter", SECCOMP_IN, *argv],
                                    env=env, cwd=req.cwd or "/", user=user) as process:
                args += ["--process", process, box.sid]
                if req.background:
                    return await self._background(box, args, ipid_file, pid_file,
                                                  start_timeout_s, t0)
                return await self._foreground(box, req, args, ipid_file, on_chunk, t0)
        finally:
            for path in (ipid_file, pid_file):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _home(self, box: Box, user: str) -> str:
        """The home directory of ``user`` (a name or uid) in the sandbox's /etc/passwd,
        read through the confined file API; "/" if it has no entry (nsexec.c does the
        same)."""
        name = user.partition(":")[0]
        try:
            with self.files(box) as f:
                data = f.read("/etc/passwd", 0, PASSWD_MAX_BYTES)
        except (OSError, DsecError):
            return "/"
        for line in data.decode(errors="replace").splitlines():
            parts = line.split(":")
            if len(parts) >= 6 and name in (parts[0], parts[2]):
                return parts[5]
        return "/"

    def _runnable(self, box: Box, prog: str, env: list[str], cwd: str) -> bool:
        """Whether ``prog`` names an executable file in the sandbox, looked up as execvp
        would (in the exec's PATH unless it has a slash): a background exec of a
        missing program is refused here (CannotRun), since the filter helper that
        runs it would only fail after the exec was answered."""
        if "/" in prog:
            candidates = [prog if prog.startswith("/") else posixpath.join(cwd, prog)]
        else:
            path = next((e[5:] for e in env if e.startswith("PATH=")), "")
            candidates = [posixpath.join(d or ".", prog) for d in path.split(":")]
        try:
            with self.files(box) as f:
                return any(f.executable(c) for c in candidates)
        except OSError:
            return False

    def _user(self, box: Box, user: str) -> str:
        return _numeric_user(box, user, files=lambda: self.files(box))

    async def _background(self, box: Box, args: list[str], ipid_file: str, pid_file: str,
                          start_timeout_s: float | None, t0: float) -> ExecResult:
        try:
            code, err = await self._run(*args, timeout_s=start_timeout_s)
        except BackendError as exc:
            raise BackendError(
                f"background exec in sandbox {box.sid} did not start its command within "
                f"{start_timeout_s:g} s: {exc}") from exc
        if code != 0:
            mistake = _caller_mistake(err)
            if mistake is not None:
                raise CannotRun(f"exec in sandbox {box.sid} could not start: runsc: "
                                f"{err.strip()[:300]}; check the program and cwd",
                                sandbox_id=box.sid, exit_code=mistake)
            raise BackendError(f"runsc exec failed in sandbox {box.sid}: {err}")
        _charge_waiter(box, pid_file)
        return ExecResult(exit_code=0, pid=_read_int(ipid_file),
                          duration_s=time.monotonic() - t0)

    async def _foreground(self, box: Box, req: ExecRequest, args: list[str], ipid_file: str,
                          on_chunk: Callable[[ExecChunk], None] | None,
                          t0: float) -> ExecResult:
        log = os.path.join(self.state_root, f".log-{self._owner}-{next(self._seq)}")
        proc, pump, feeder = await self._spawn_piped(
            [*self._launcher(args), self.binary, "--root", self.state_root, "--log", log,
             "--log-format", "json",
             *self._global_args(), *args], req, on_chunk)
        timed_out = False
        died = asyncio.ensure_future(box.exited.wait())
        waited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait({waited, died}, timeout=req.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                timed_out = True
                await self._kill_session(box, ipid_file)
            if not waited.done():
                # the sandbox died, or its command is killed: runsc exec ends soon (it
                # never does if the Sentry is gone: bounded, then killed)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(waited), 10.0)
                if not waited.done():
                    proc.kill()
                    await waited
        except BaseException:
            if not waited.done():   # cancelled: the command goes too
                await asyncio.shield(self._kill_session(box, ipid_file))
                proc.kill()
            raise
        finally:
            died.cancel()
            pump.finish()
            if feeder is not None:
                feeder.close()
            err = ""
            with contextlib.suppress(OSError):
                with open(log, "rb") as f:  # noqa: ASYNC230 - local, bounded
                    err = _errors(f.read(LOG_MAX_BYTES))
                os.unlink(log)
        code = proc.returncode if proc.returncode is not None else -1
        if code < 0:
            code = 128 - code
        stderr = bytes(pump.bufs["stderr"])
        if code == 128 and (mistake := _caller_mistake(err)) is not None:
            code, stderr = mistake, f"cannot run: {err.strip()[:300]}\n".encode()
        elif box.exited.is_set() and not timed_out:
            raise BackendError(f"sandbox {box.sid} stopped while its exec ran (its Sentry "
                               "exited: an OOM kill, or too many processes for its task "
                               "limit, stops a gvisor sandbox; its events say which)")
        return ExecResult(
            exit_code=code, stdout=bytes(pump.bufs["stdout"]), stderr=stderr,
            stdout_truncated=pump.truncated["stdout"], stderr_truncated=pump.truncated["stderr"],
            timed_out=timed_out, duration_s=time.monotonic() - t0)

    async def _kill_session(self, box: Box, ipid_file: str) -> None:
        """SIGKILL the exec's session, group and descendants from inside (see
        :data:`KILL_SCRIPT`); nothing if its internal pid was never written."""
        try:
            pid = _read_int(ipid_file)
        except (OSError, ValueError):
            return
        if pid <= 1:
            return
        with contextlib.suppress(BackendError):
            await self._run("exec", "--user", "0:0", box.sid, BUSYBOX_IN, "sh", "-c",
                            KILL_SCRIPT, "kill", str(pid), timeout_s=10.0)


def _tmp_dir(root: str) -> str | None:
    """``root``/tmp if it is a directory (lstat: never a symlink, which the runtime
    would resolve on the host; the sandbox is not running yet, nothing can swap it);
    made 1777 if the image has none; None if something else is there."""
    path = os.path.join(root, "tmp")
    try:
        os.mkdir(path, 0o1777)
        os.chmod(path, 0o1777)
    except FileExistsError:
        pass
    return path if stat.S_ISDIR(os.lstat(path).st_mode) else None


def _charge_waiter(box: Box, pid_file: str) -> None:
    """Move the host process a detached ``runsc exec`` leaves to wait for its command
    (a Go process, ~17 MiB RSS measured) into the sandbox's cgroups: its memory and task
    count are the sandbox's, a pause freezes it, a destroy's cgroup kill takes it. Left
    in the edge's cgroup, a sandbox starting background commands in a loop would spend
    the node's memory outside its limit."""
    try:
        pid = _read_int(pid_file)
    except (OSError, ValueError):
        return
    for procs in box.cg.procs_files:
        with contextlib.suppress(OSError), open(procs, "w") as f:
            f.write(str(pid))


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


def _errors(log: bytes) -> str:
    """The error/fatal messages of a runsc ``--log-format json`` log ("" if none)."""
    msgs = []
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("level") in ("error", "fatal"):
            msgs.append(str(rec.get("msg", "")))
    return "; ".join(msgs)
