"""Nothing inside a sandbox can hold the machinery that starts processes in it.

An exec's final process is visible in the sandbox's /proc from its birth (issue 11.3:
born fully inside). Found by the rt-kernel review:

- A process inside that SIGSTOPped it before its execve held its intermediate (the final
  process was a CLONE_VFORK clone: the intermediate waited for the execve before reporting)
  for good: a background exec never answered (both drivers: ``runc exec -d`` waits too).
- While any intermediate was pending, the zygote reaped no child it could not place, and
  ``waitid(P_ALL)`` always returns the oldest exited child: one unplaced zombie - which any
  sandbox process can make with ``clone(CLONE_PARENT)``, as its parent is the zygote -
  stopped the reaping of every later child. Other sandboxes' inits stayed zombies after
  their destroy (their pids with them) for as long as the hold lasted.
- At the task limit the final process is forked outside the pids cgroup and moved in
  before it runs; it took EOF on its go pipe for "moved in", so if the intermediate died
  in between (a timeout or cancel kills it) the command ran outside the sandbox's pids
  cgroup (on v2: outside every cgroup of the sandbox).

The zygote-level tests send requests straight to the helper with a FIFO among the
"cgroup.procs" files, a real way to hold an intermediate at an exact step (a full FIFO
blocks its write) without timing games.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends.container import ContainerBackend, DirectoryImages
from dsec.edge.backends.container.protocol import Exec, Exited, Failed, Reply
from dsec.errors import BackendError
from dsec.ids import SandboxId
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import _cleanup
from tests.security.conftest import PROBE_SPEC, new_sid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

START_TIMEOUT_S = 2.0
F_SETPIPE_SZ = 1031


@pytest.fixture
async def quick(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    """A native backend that gives a background exec START_TIMEOUT_S to start."""
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "qroot"),
                         images=DirectoryImages(images_dir),
                         exec_start_timeout_s=START_TIMEOUT_S)
    try:
        yield b
    finally:
        await _cleanup(b)


@pytest.fixture
async def quick_runc(tmp_path: object, images_dir: str) -> AsyncIterator[ContainerBackend]:
    import shutil

    if shutil.which("runc") is None:
        pytest.skip("needs runc")
    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "qrroot"),
                         images=DirectoryImages(images_dir), runtime="runc",
                         exec_start_timeout_s=START_TIMEOUT_S)
    try:
        yield b
    finally:
        await _cleanup(b)


def _put(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _listed(cgroup_dir: str) -> list[int]:
    with open(os.path.join(cgroup_dir, "cgroup.procs")) as f:
        return [int(p) for p in f.read().split()]


def _state(pid: int) -> str:
    """'Z' for a zombie, 'gone' once reaped, else the process state letter."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


async def _stopped_background_exec_fails_in_bounded_time(
        b: ContainerBackend, spec: SandboxSpec = PROBE_SPEC) -> None:
    sid = new_sid()
    await b.create(sid, spec)
    await b.exec(sid, ExecRequest(argv=("/probe", "stop_newcomers", "120"), background=True))
    await asyncio.sleep(0.2)
    held = None
    for _ in range(40):  # the stopper catches most starts; one is enough
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(b.exec(sid, ExecRequest(argv=("sleep", "1000"),
                                                           background=True)),
                                   START_TIMEOUT_S + 20)
        except BackendError as exc:
            held = (str(exc), time.monotonic() - t0)
            break
    assert held is not None, "the stopper never caught a start"
    msg, took = held
    assert "did not start its command within" in msg, msg
    assert took < START_TIMEOUT_S + 15, took
    # the sandbox and the backend still work once the stopper is gone (told through the
    # file API: any process started now would be stopped too)
    await b.write_file(sid, "/tmp/stop", b"")
    await asyncio.sleep(0.5)
    await b.exec(sid, ExecRequest(shell="kill -CONT -1", timeout_s=10))
    r = await b.exec(sid, ExecRequest(argv=("echo", "fine"), timeout_s=10))
    assert r.stdout == b"fine\n"


@pytest.mark.parametrize("userns", [False, True], ids=["plain", "userns"])
async def test_a_stopped_background_exec_fails_in_bounded_time(
        quick: ContainerBackend, userns: bool) -> None:
    await _stopped_background_exec_fails_in_bounded_time(quick, SandboxSpec(
        backend="container", toolkits=("probe",), memory_bytes=256 << 20, pids_max=256,
        user_namespace=userns))


async def test_runc_a_stopped_background_exec_fails_in_bounded_time(
        quick_runc: ContainerBackend) -> None:
    await _stopped_background_exec_fails_in_bounded_time(quick_runc)


class _RawExec:
    """An exec request sent straight to the zygote (the test owns its fds and cgroup
    list), with its replies collected."""

    def __init__(self, b: ContainerBackend, sid: str, procs: list[str], *,
                 argv: list[str], pids_index: int = -1, home_procs: str = "") -> None:
        self.b = b
        self.replies: list[Reply] = []
        self.done = asyncio.get_running_loop().create_future()
        self.out_r, out_w = os.pipe2(os.O_CLOEXEC)
        self.err_r, err_w = os.pipe2(os.O_CLOEXEC)
        null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self.rid = b._zygote.next_id()
        pidfd = b.netns_fd(SandboxId(sid))  # the init's pidfd (dens: none is held)
        try:
            b._zygote.send(Exec(id=self.rid, argv=argv, env=["PATH=/bin:/usr/bin"],
                                cwd=None, user=None, cgroup_procs=procs, nested=False,
                                background=False, pids_index=pids_index,
                                home_procs=home_procs),
                           [pidfd, null, out_w, err_w], self._on_reply)
        finally:
            for fd in (out_w, err_w, null, pidfd):
                os.close(fd)

    def _on_reply(self, reply: Reply, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        self.replies.append(reply)
        if isinstance(reply, (Exited, Failed)) and not self.done.done():
            self.b._zygote.done(self.rid)
            self.done.set_result(reply)

    def output(self) -> tuple[bytes, bytes]:
        outs = []
        for fd in (self.out_r, self.err_r):
            os.set_blocking(fd, False)
            try:
                outs.append(os.read(fd, 1 << 16))
            except BlockingIOError:
                outs.append(b"")
        return outs[0], outs[1]

    def close(self) -> None:
        os.close(self.out_r)
        os.close(self.err_r)


class _FullFifo:
    """A FIFO with one page of buffer, filled to ``room`` bytes short of full: a writer of
    more than ``room`` bytes blocks until the test reads."""

    def __init__(self, path: str, room: int) -> None:
        self.path = path
        os.mkfifo(path, 0o600)
        self.r = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        w = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
        os.write(w, b"x" * (4096 - room))
        os.close(w)

    def drain(self) -> None:
        try:
            while os.read(self.r, 1 << 16):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.drain()
        os.close(self.r)
        os.unlink(self.path)


async def test_a_held_intermediate_does_not_stop_the_zygote_reaping(
        backend: ContainerBackend, tmp_path: object) -> None:
    b = backend
    attacker, victim = new_sid(), new_sid()
    await b.create(attacker, PROBE_SPEC)
    fifo = _FullFifo(os.path.join(str(tmp_path), "held"), room=0)
    raw = _RawExec(b, attacker, [fifo.path], argv=["true"])  # blocks joining "cgroups"
    try:
        await asyncio.sleep(0.2)
        # a zombie the zygote cannot place: a child of the zygote made from inside
        r = await b.exec(attacker, ExecRequest(argv=("/probe", "clone_parent", "1")))
        assert r.stdout == b"clone_parent=1\n", r
        await asyncio.sleep(0.2)
        # another tenant's sandbox, made and destroyed after that zombie
        await b.create(victim, PROBE_SPEC)
        init = b.init_pid(victim)
        await b.destroy(victim)
        for _ in range(100):
            if _state(init) == "gone":
                break
            await asyncio.sleep(0.05)
        assert _state(init) == "gone", f"the destroyed sandbox's init {init} is still a " \
                                       f"zombie of the zygote ({_state(init)})"
        # a background exec of that tenant is reaped as well
    finally:
        fifo.drain()
        await asyncio.wait_for(raw.done, 20)
        raw.close()
        fifo.close()


async def test_at_the_task_limit_a_command_whose_helper_died_never_runs(
        backend: ContainerBackend, tmp_path: object) -> None:
    """The intermediate is held after forking the command outside the task limit and
    before moving it in (a full FIFO as the pids cgroup.procs), then killed - as a
    timeout or cancel kills it. The command must not run."""
    b = backend
    sid = new_sid()
    await b.create(sid, PROBE_SPEC)
    base = b.governor.layout.bases.get("pids") or b.governor.layout.bases["unified"]
    limited, home = os.path.join(base, "rtk-limited"), os.path.join(base, "rtk-home")
    for d in (limited, home):
        os.mkdir(d)
    fifo = None
    raw = None
    try:
        _put(os.path.join(limited, "pids.max"), "1")  # the intermediate alone fills it
        # room for the "0" of the join, not for the command's pid
        fifo = _FullFifo(os.path.join(str(tmp_path), "pids.procs"), room=1)
        raw = _RawExec(b, sid, [os.path.join(limited, "cgroup.procs"), fifo.path],
                       argv=["sh", "-c", "echo ran; cat /proc/self/cgroup"], pids_index=1,
                       home_procs=os.path.join(home, "cgroup.procs"))
        procs: list[int] = []
        for _ in range(200):  # intermediate + the command it forked, both in `home`
            procs = _listed(home)
            if len(procs) == 2:
                break
            await asyncio.sleep(0.02)
        assert len(procs) == 2, procs

        def levels(pid: int) -> int:
            with open(f"/proc/{pid}/status") as f:
                return next(len(line.split()) - 1 for line in f if line.startswith("NSpid:"))
        mid = next(p for p in procs if levels(p) == 1)  # the one in the host pid namespace
        fd = os.pidfd_open(mid)
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)
        reply = await asyncio.wait_for(raw.done, 10)
        assert isinstance(reply, Exited) and reply.pid == 0, reply
        for _ in range(50):  # the orphaned command's fate shows within moments
            if not _listed(home):
                break
            await asyncio.sleep(0.05)
        out, err = raw.output()
        assert b"ran" not in out, f"the command ran outside the task limit: {out!r}"
        assert b"helper died before the command started" in err, err
    finally:
        if fifo is not None:
            fifo.drain()
        if raw is not None:
            try:
                await asyncio.wait_for(raw.done, 10)
            finally:
                raw.close()
        if fifo is not None:
            fifo.close()
        for d in (limited, home):
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    await asyncio.sleep(0.05)
