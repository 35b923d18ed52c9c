"""The runc driver: the same sandbox as an OCI bundle run by Debian's runc.

The bundle is the sandbox directory: ``config.json`` (:func:`.oci.oci_config`) and
``root`` with the overlay mounted on it in the host mount namespace (runc wants a rootfs
path). cgroupsPath is *relative* (``dsec-<name>/<sid>``), which runc's cgroupfs driver
places under the runtime's own cgroup per controller - the same directories the
:class:`~dsec.edge.governor.Governor` computes, so pause/stats/OOM watching are shared.
Each exec is a ``runc exec`` process (Go, ~15-20 ms here): that cost is what the native
driver is measured against. A foreground exec runs in its own sub-cgroup (``runc exec
--cgroup``), made and killed by the backend exactly as for the native driver; nothing here
signals a pid number.

**Nothing tenant-chosen goes on a command line.** ``runc exec``'s process (argv, env,
cwd, user) is a ``process.json`` (``--process``) in a 0700 directory of the private
state dir, 0600, removed when the exec returns: a host process's command line is
world-readable (``/proc/<pid>/cmdline``, 0444, without hidepid), and ``--env KEY=VALUE``
put every exec's secrets (API tokens in env) in front of every host user (red team 22,
A3). The runsc driver does the same for ``runsc exec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dsec import ownership
from dsec.edge.backends.container import linux
from dsec.edge.backends.container.box import Box
from dsec.edge.backends.container.execio import OutputPump, StdinFeeder
from dsec.edge.backends.container.files import SandboxFiles
from dsec.edge.backends.container.oci import oci_config
from dsec.edge.backends.container.rootfs import overlay_options
from dsec.edge.fdkeeper import reset_ignored_signals
from dsec.edge.governor import ExecCgroup
from dsec.errors import BackendError, CannotRun, DsecError
from dsec.wire.spec import ExecChunk, ExecRequest, ExecResult

__all__ = ["RuncDriver", "merge_env", "process_spec"]

INIT = "/usr/bin/catatonit"
PASSWD_MAX_BYTES = 1 << 20  # the sandbox's /etc/passwd is read as hostile: capped
PROC_PREFIX = ".proc-"      # state_root/.proc-<owner>-*: an exec's process.json (0700 dir)


def merge_env(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``base`` with ``extra`` applied over it by key (a later ``KEY=`` replaces the
    earlier one in place; new keys are appended), as ``runc/runsc exec --env`` merge an
    exec's variables into the container's (pure). A process file's env is used as given,
    and a duplicate key would leave the program's getenv() the *first* one."""
    out: dict[str, str] = {}
    for e in (*base, *extra):
        out[e.partition("=")[0]] = e
    return list(out.values())


def process_spec(base: dict[str, Any], *, argv: Sequence[str], env: Sequence[str],
                 cwd: str, user: str | None) -> dict[str, Any]:
    """The OCI process of one exec (pure): the bundle's own ``process`` (capabilities,
    rlimits, noNewPrivileges: what ``exec`` without ``--process`` inherits) with the
    exec's argv, env (merged over the bundle's, :func:`merge_env`), cwd and ``user``
    (``uid[:gid]``, numeric; None: root)."""
    proc = dict(base)
    uid, _, gid = (user or "0:0").partition(":")
    if not uid.isdigit() or not (gid or "0").isdigit():
        raise ValueError(f"user {(user or '')[:64]!r} is not uid[:gid] (numbers)")
    proc.update(terminal=False, args=list(argv), cwd=cwd,
                env=merge_env(base.get("env") or (), env),
                user={"uid": int(uid), "gid": int(gid or 0)})
    return proc


def _default_rt_signals() -> None:
    """Real-time signals (32-64) this process holds ignored back to the default before a
    runc/runsc start: runc passes an ignored one on to the sandbox's init and commands
    (an ignored signal survives execve), and neither libuv nor Python's subprocess
    resets 32-64 in a child (red team 23, A1: CI's parent left 32 ignored). ~35 raw
    syscalls, against runc's 15-20 ms; 1-31 are reset in the child by libuv (uvloop)
    and by runc's own start-up."""
    reset_ignored_signals(first=32)


class RuncDriver:
    def __init__(self, *, binary: str, root_dir: str, cgroup_parent: str) -> None:
        self.binary = binary
        self.state_root = os.path.join(root_dir, "runc-state")
        self.cgroup_parent = cgroup_parent
        os.makedirs(self.state_root, mode=0o700, exist_ok=True)
        os.chmod(self.state_root, 0o700)
        self._seq = itertools.count()
        self._owner = ownership.token()  # names this process's --log files

    #: the flag of ``run``/``exec`` that returns once the process started (runsc: --detach)
    detach_flag = "-d"

    @contextlib.contextmanager
    def _process_file(self, box: Box, *, argv: Sequence[str], env: Sequence[str],
                      cwd: str, user: str | None) -> Iterator[str]:
        """The path of a ``process.json`` for ``exec --process`` (module docstring): 0600
        in a fresh 0700 directory of the private state dir, removed on the way out (one
        an edge crash leaves is a dead owner's: :meth:`sweep_logs` removes it)."""
        with open(os.path.join(box.dir, "config.json"), "rb") as f:
            base = json.loads(f.read(1 << 22)).get("process") or {}
        try:
            spec = process_spec(base, argv=argv, env=env, cwd=cwd, user=user)
        except ValueError as exc:
            raise CannotRun(f"exec in sandbox {box.sid} could not start: {exc}",
                            sandbox_id=box.sid, exit_code=126) from exc
        d = tempfile.mkdtemp(prefix=f"{PROC_PREFIX}{self._owner}-", dir=self.state_root)
        try:
            path = os.path.join(d, "process.json")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(spec, f)
            yield path
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def _global_args(self) -> list[str]:
        """Flags before the subcommand besides --root/--log (none for runc; runsc's
        platform, network and file access: :class:`.runsc.RunscDriver`)."""
        return []

    def _launcher(self, args: Sequence[str] = ()) -> list[str]:
        """What runs the runtime binary for the command ``args`` (runc: nothing; runsc:
        ``nsenter`` into the driver's private network namespace,
        :class:`.runsc.RunscDriver`)."""
        return []

    def _cmd(self, *args: str, idle: bool = False) -> list[str]:
        """``idle``: start runc under SCHED_IDLE (util-linux ``chrt``, ~1 ms against
        runc exec's 15-20 ms): runc init and the command it execs inherit the policy, the
        per-process half of a best-effort sandbox's class (issue 22; runc 1.1 has no
        scheduler field of its own)."""
        runc = [*self._launcher(args), self.binary, "--root", self.state_root,
                *self._global_args(), *args]
        return ["chrt", "--idle", "0", *runc] if idle else runc

    async def _spawn_piped(self, argv: list[str], req: ExecRequest,
                           on_chunk: Callable[[ExecChunk], None] | None,
                           ) -> tuple[asyncio.subprocess.Process, OutputPump,
                                      StdinFeeder | None]:
        """Start ``argv`` (a runc/runsc ``exec`` in the foreground) in a session of its
        own, its output through capped pipes and its stdin fed from ``req.stdin``."""
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        in_r, in_w = os.pipe2(os.O_CLOEXEC) if req.stdin else (-1, -1)
        _default_rt_signals()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=in_r if req.stdin else asyncio.subprocess.DEVNULL,
                stdout=out_w, stderr=err_w, start_new_session=True)
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, in_r):
                if fd >= 0:
                    os.close(fd)
        pump = OutputPump(loop, {"stdout": out_r, "stderr": err_r}, req.output_cap_bytes,
                          on_chunk)
        feeder = StdinFeeder(loop, in_w, req.stdin) if req.stdin else None
        return proc, pump, feeder

    async def _run(self, *args: str, timeout_s: float | None = None,
                   idle: bool = False) -> tuple[int, str]:
        """Run a runc command with /dev/null as stdin, stdout and stderr.

        ``run -d``/``exec -d`` hand their stdio to the container process: a pipe would be
        held open forever, and a host temp file would become init's fd 2 - reachable from
        inside as /proc/1/fd/2 (host disk the sandbox could write). runc's own error text
        goes to a ``--log`` file in the private state dir instead (runc's init reports
        through a pipe to its parent, so the container never holds that file).

        ``timeout_s``: kill runc (our own unreaped child: its pid is exact) after that long
        and raise :class:`BackendError` - for calls a process in the sandbox can hold, like
        ``exec -d``, which waits for its command to start (a SIGSTOP inside held it for
        good)."""
        log = os.path.join(self.state_root, f".log-{self._owner}-{next(self._seq)}")
        _default_rt_signals()
        try:
            proc = await asyncio.create_subprocess_exec(
                *(("chrt", "--idle", "0") if idle else ()),   # chrt execs runc: same pid
                *self._launcher(args), self.binary, "--root", self.state_root, "--log", log,
                "--log-format", "json",
                *self._global_args(), *args, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL)
            try:
                async with asyncio.timeout(timeout_s):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise BackendError(f"runc {args[0]} did not finish within {timeout_s:g} s "
                                   "and was killed") from None
            return proc.returncode or 0, _log_errors(log)
        finally:
            try:
                os.unlink(log)
            except FileNotFoundError:
                pass

    async def create(self, box: Box) -> int:
        root = os.path.join(box.dir, "root")
        _mount_overlay(root, box.layers.lowerdirs, box.upper, box.work)
        cfg = self._config(box)
        # Small local files (a few KiB config, a pid): blocking I/O is cheaper than a thread hop.
        with open(os.path.join(box.dir, "config.json"), "w") as f:  # noqa: ASYNC230
            json.dump(cfg, f)
        pid_file = os.path.join(box.dir, "init.pid")
        code, err = await self._run("run", self.detach_flag, "--bundle", box.dir,
                                    "--pid-file", pid_file, box.sid)
        if code != 0:
            raise BackendError(f"{os.path.basename(self.binary)} run failed for sandbox "
                               f"{box.sid}: {err}")
        with open(pid_file) as f:  # noqa: ASYNC230 - a few bytes on local disk
            return int(f.read().strip())

    def _config(self, box: Box) -> dict[str, object]:
        """The bundle's ``config.json`` (a runtime may adjust it: runsc)."""
        return oci_config(spec=box.spec, hostname=box.sid[:63],
                          cgroups_path=f"{self.cgroup_parent}/{box.sid}", init_path=INIT,
                          pids_max=box.pids_max)

    def sweep_logs(self) -> int:
        """Remove ``--log`` files of edge processes that died mid-command (a crash skips
        the unlink in :meth:`_run`); returns how many. Every file not of this process is
        a dead one's: the backend's root_dir lock means no other live process runs runc
        here. (A file named by a bare pid was kept while any process had that pid - a
        recycled pid kept a dead edge's file - and a reused pid could read a stale one.)"""
        n = 0
        for name in os.listdir(self.state_root):
            path = os.path.join(self.state_root, name)
            if name.startswith(PROC_PREFIX):    # a dead edge's exec process.json dir
                if not name.startswith(f"{PROC_PREFIX}{self._owner}-"):
                    shutil.rmtree(path, ignore_errors=True)
                    n += 1
                continue
            if not name.startswith(".log-") or name.startswith(f".log-{self._owner}-"):
                continue
            try:
                os.unlink(path)
                n += 1
            except FileNotFoundError:
                pass
        return n

    async def destroy(self, sid: str, box_dir: str) -> None:
        """Forget a container the backend already killed (init by pidfd, the rest through
        the cgroup): ``runc kill`` signals a pid number and is not used; ``delete`` of a
        stopped container only removes its state and cgroups."""
        await self._run("delete", "--force", sid)
        root = os.path.join(box_dir, "root")
        for _ in range(3):
            try:
                linux.umount2(root, linux.MNT_DETACH)
            except OSError:
                break

    async def exec(self, box: Box, req: ExecRequest, argv: list[str], env: list[str],
                   on_chunk: Callable[[ExecChunk], None] | None, *,
                   cgroup: ExecCgroup | None = None,
                   kill: Callable[[], object] = lambda: None,
                   start_timeout_s: float | None = None) -> ExecResult:
        """``cgroup``: the foreground exec's own cgroup (its process is started in it);
        ``kill``: kills everything in it - what a timeout does, until runc exits;
        ``start_timeout_s``: how long a background exec may take to start."""
        t0 = time.monotonic()
        args = ["exec"]
        if cgroup is not None:
            sub = os.path.basename(cgroup.dir)
            args += ["--cgroup", sub if cgroup.version == 2 else f"freezer:{sub}"]
        user = _numeric_user(box, req.user) if req.user is not None else None
        pid_file = os.path.join(box.dir, f"exec-{time.monotonic_ns()}.pid")
        args += ["--pid-file", pid_file]
        if req.background:
            args.append("-d")
        with self._process_file(box, argv=argv, env=env, cwd=req.cwd or "/",
                                user=user) as process:
            return await self._exec(box, req, [*args, "--process", process, box.sid],
                                    pid_file, on_chunk, kill, start_timeout_s, t0)

    async def _exec(self, box: Box, req: ExecRequest, args: list[str], pid_file: str,
                    on_chunk: Callable[[ExecChunk], None] | None,
                    kill: Callable[[], object], start_timeout_s: float | None,
                    t0: float) -> ExecResult:
        idle = box.spec.qos == "be"   # SCHED_IDLE, inherited by the command (see _cmd)
        if req.background:
            try:
                code, err = await self._run(*args, timeout_s=start_timeout_s, idle=idle)
            except BackendError as exc:
                raise BackendError(
                    f"background exec in sandbox {box.sid} did not start its command within "
                    f"{start_timeout_s:g} s (its process was stopped or held before it could "
                    f"run - e.g. by a SIGSTOP from a process inside): {exc}") from exc
            if code != 0:
                if _caller_mistake(err):
                    # a missing program or cwd: the caller's mistake (4xx), as natively
                    raise CannotRun(f"exec in sandbox {box.sid} could not start: runc: "
                                    f"{err.strip()[:300]}; check the program and cwd",
                                    sandbox_id=box.sid, exit_code=126
                                    if "chdir to cwd" in err else 127)
                raise BackendError(f"runc exec failed in sandbox {box.sid}: {err}")
            with open(pid_file) as f:  # noqa: ASYNC230 - a few bytes on local disk
                pid = int(f.read().strip())
            os.unlink(pid_file)
            return ExecResult(exit_code=0, pid=_ns_pid(pid), duration_s=time.monotonic() - t0)
        proc, pump, feeder = await self._spawn_piped(
            self._cmd(*args, idle=idle), req, on_chunk)
        timed_out = False
        try:
            async with asyncio.timeout(req.timeout_s):
                await asyncio.shield(proc.wait())
        except TimeoutError:
            timed_out = True
            # runc exec returns once its command is dead; the command may not be in its
            # cgroup yet when the kill reads it, so kill again until runc is done.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:  # bounded: runc itself may hang
                kill()
                try:
                    async with asyncio.timeout(0.05):
                        await asyncio.shield(proc.wait())
                    break
                except TimeoutError:
                    continue
        finally:
            pump.finish()
            if feeder is not None:
                feeder.close()
            try:
                os.unlink(pid_file)
            except FileNotFoundError:
                pass
        code = proc.returncode if proc.returncode is not None else -1
        if code < 0:
            code = 128 - code
        return ExecResult(
            exit_code=code, stdout=bytes(pump.bufs["stdout"]), stderr=bytes(pump.bufs["stderr"]),
            stdout_truncated=pump.truncated["stdout"], stderr_truncated=pump.truncated["stderr"],
            timed_out=timed_out, duration_s=time.monotonic() - t0)


def _mount_overlay(target: str, lowerdirs: tuple[str, ...] | list[str], upper: str,
                   work: str) -> None:
    """The overlay at ``target``, its layers named by fd: overlayfs shows its options in
    mountinfo as given, and this mount becomes the container's root, so absolute paths
    would show the state dir and the layer store inside (/proc/self/mountinfo)."""
    overlay_options(lowerdirs, upper, work)  # the same checks as the native driver
    fds: list[int] = []
    try:
        for p in (*lowerdirs, upper, work):
            fds.append(os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        names = [f"/proc/self/fd/{fd}" for fd in fds]
        linux.mount("overlay", target, "overlay", linux.MS_NODEV,
                    overlay_options(names[:-2], names[-2], names[-1]))
    finally:
        for fd in fds:
            os.close(fd)


def _log_errors(path: str) -> str:
    """The error/fatal messages of a runc ``--log-format json`` log ("" if none)."""
    msgs = []
    try:
        with open(path, "rb") as f:
            lines = f.read(1 << 20).splitlines()
    except FileNotFoundError:
        return ""
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("level") in ("error", "fatal"):
            msgs.append(str(rec.get("msg", "")))
    return "; ".join(msgs)


def _numeric_user(box: Box, user: str,
                  files: Callable[[], SandboxFiles] | None = None) -> str:
    """``uid:gid`` for ``user`` from the sandbox's own /etc/passwd, read through the
    confined file API (openat2 RESOLVE_IN_ROOT under /proc/<init>/root, non-blocking,
    regular files only, at most PASSWD_MAX_BYTES; ``files`` opens the root another way,
    runsc's): a symlink the sandbox planted resolves
    inside it, a FIFO or device is refused instead of blocking the edge."""
    name, _, group = user.partition(":")
    if name.isdigit():
        return user
    try:
        opened = (files() if files is not None
                  else SandboxFiles.of_process(box.pidfd, box.init_pid, box.sid))
        with opened as f:
            data = f.read("/etc/passwd", 0, PASSWD_MAX_BYTES)
    except OSError as exc:
        raise BackendError(f"sandbox {box.sid} is not running (its init is gone): {exc}"
                           ) from exc
    except DsecError as exc:
        raise BackendError(f"cannot look up user {name!r} in sandbox {box.sid}: its "
                           f"/etc/passwd is unusable ({exc})") from exc
    for line in data.decode(errors="replace").splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[0] == name:
            return f"{parts[2]}:{group or parts[3]}"
    raise CannotRun(f"exec in sandbox {box.sid} could not start: unknown user {name[:64]!r} "
                    "in the sandbox's /etc/passwd", sandbox_id=box.sid, exit_code=126)


def _caller_mistake(err: str) -> bool:
    """Whether runc exec failed because the caller named a program or cwd the sandbox
    does not have (``exec: "x": executable file not found``, ``exec: "/x": stat /x: no
    such file or directory``, ``chdir to cwd ... failed``)."""
    return ("executable file not found" in err or "chdir to cwd" in err
            or ('exec: "' in err and "no such file or directory" in err))


def _ns_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return pid
