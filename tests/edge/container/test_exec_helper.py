"""The per-sandbox exec helper (nsexec.c, do_helper): a command forked from it is in
exactly the state one started by a per-exec intermediate is in (user, capabilities,
no_new_privs, seccomp, cgroups, session, fds); the helper is invisible inside, holds
nothing from earlier execs, goes with its sandbox, and when it dies the exec still runs."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.backend import HELPER_MAX_FAILS
from dsec.wire.spec import ExecRequest
from tests.edge.container.conftest import SPEC, new_sid

pytestmark = pytest.mark.root

# What a command can learn about its own confinement; pids and the exec cgroup's name
# differ between two execs, so they are normalised.
PROBE = ("id; grep -E '^(Cap|NoNewPrivs|Seccomp|Uid|Gid|Groups)' /proc/self/status; "
         "cat /proc/self/cgroup; ls /proc/self/fd; "
         "test \"$(cut -d' ' -f6 /proc/self/stat)\" = \"$$\" && echo session-leader; "
         "cat /proc/self/attr/current 2>/dev/null; ulimit -n; pwd; echo \"$HOME\"")


def _norm(out: bytes) -> str:
    return re.sub(r"/x\d+", "/xN", out.decode())


def _helper_pid(b: ContainerBackend, sid: str) -> int:
    """The sandbox's helper process: a zygote child named ``dsec-nsexec helper`` in the
    sandbox's cgroups. Looked for up to 5 s: the edge learns the helper's pid when it is
    forked, a moment before it has renamed itself and joined the cgroups (a full run
    under load once looked in that moment and found none)."""
    zpid = b._zygote.pid
    assert zpid is not None
    init = b.box(sid).init_pid
    deadline = time.monotonic() + 5
    while True:
        with open(f"/proc/{zpid}/task/{zpid}/children") as f:
            kids = [int(k) for k in f.read().split()]
        found = []
        for k in kids:
            try:
                with open(f"/proc/{k}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                if argv[:2] == [b"dsec-nsexec", b"helper"] and k != init:
                    # the helper of this sandbox: it is in the sandbox's pids cgroup
                    with open(f"/proc/{k}/cgroup") as f:
                        if b.box(sid).cg.procs_files and sid in f.read():
                            found.append(k)
            except FileNotFoundError:
                continue            # a child that went meanwhile
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(found) == 1, found
    return found[0]


def _spy(b: ContainerBackend) -> list[object]:
    """Every request the backend sends its zygote, in order."""
    sent: list[object] = []
    real = b._zygote.send

    def send(req: object, fds: list[int], handler: object) -> None:
        sent.append(req)
        real(req, fds, handler)  # type: ignore[arg-type]
    b._zygote.send = send  # type: ignore[method-assign]
    return sent


async def _helper_up(b: ContainerBackend, sid: str) -> None:
    """A sandbox's first exec starts its helper (and takes the per-exec path itself)."""
    assert (await b.exec(sid, ExecRequest(shell="true"))).exit_code == 0
    deadline = time.monotonic() + 10
    while not b.box(sid).helper and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert b.box(sid).helper


async def test_helper_exec_is_confined_exactly_like_the_per_exec_path(
        backend: ContainerBackend) -> None:
    from dsec.edge.backends.container.protocol import Exec, Helper
    sid = new_sid()
    await backend.create(sid, SPEC)
    box = backend.box(sid)
    sent = _spy(backend)
    assert (await backend.exec(sid, ExecRequest(shell="true"))).exit_code == 0
    # the first exec went the per-exec way and started the helper beside it
    assert [type(r) for r in sent] == [Helper, Exec] and sent[1].helper == 0  # type: ignore[attr-defined]
    await _helper_up(backend, sid)
    for user in (None, "agent"):
        req = ExecRequest(shell=PROBE, user=user, cwd="/tmp")
        del sent[:]
        new = await backend.exec(sid, req)
        assert [getattr(r, "helper", None) for r in sent] == [box.helper], sent
        old = await backend._native_exec(box, req, ["/bin/sh", "-c", PROBE],
                                         _env(backend, box), None, via_helper=False)
        assert new.exit_code == old.exit_code == 0, (new.stderr, old.stderr)
        assert _norm(new.stdout) == _norm(old.stdout)
        out = new.stdout.decode()
        assert "Seccomp:\t2" in out and "NoNewPrivs:\t1" in out and "session-leader" in out
        assert re.search(r"freezer:/x\d+", out), out          # in its own exec cgroup
        # only stdio and ls's own directory fd: nothing of the helper's
        assert re.search(r"^0\n1\n2\n3\nsession-leader$", out, re.MULTILINE), out
        if user == "agent":
            assert "uid=1000(agent)" in out and "CapEff:\t0000000000000000" in out
    assert (await backend.exec(sid, ExecRequest(shell="exit 7"))).exit_code == 7
    r = await backend.exec(sid, ExecRequest(shell="cat", stdin=b"in\n"))
    assert r.stdout == b"in\n"
    r = await backend.exec(sid, ExecRequest(shell="no-such-program"))
    assert r.exit_code == 127 and b"not found" in r.stderr


def _env(b: ContainerBackend, box: object) -> list[str]:
    from dsec.edge.backends.container.rootfs import build_env
    return build_env(box.sid[:63], box.spec.env, {})  # type: ignore[attr-defined]


async def test_helper_is_invisible_inside_holds_nothing_and_goes_with_the_sandbox(
        backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    await _helper_up(backend, sid)
    for _ in range(5):   # fds of earlier execs must not pile up in the helper
        assert (await backend.exec(sid, ExecRequest(shell="echo hi"))).stdout == b"hi\n"
    hp = _helper_pid(backend, sid)
    # inside: init and the command, nothing else (the helper is in the host pid ns)
    r = await backend.exec(sid, ExecRequest(shell="ls /proc | grep -E '^[0-9]+$' | wc -l; "
                                                  "cat /proc/*/comm"))
    lines = r.stdout.decode().split()
    assert "dsec-nsexec" not in lines and "helper" not in r.stdout.decode()
    assert int(lines[0]) <= 5, r.stdout            # init, sh, ls, grep, wc of this exec
    assert set(lines[1:]) <= {".init", "sh", "cat"}, r.stdout   # nothing else lives there
    # the helper's own fds: /dev/null stdio, its request and report sockets
    fds = {int(f): os.readlink(f"/proc/{hp}/fd/{f}") for f in os.listdir(f"/proc/{hp}/fd")}
    assert sorted(fds) == [0, 1, 2, 5, 6], fds
    assert all(fds[k] == "/dev/null" for k in (0, 1, 2))
    assert all(fds[k].startswith("socket:") for k in (5, 6))
    st = _read(f"/proc/{hp}/status")
    assert "Seccomp:\t2" in st and "NoNewPrivs:\t1" in st
    assert re.search(r"CapBnd:\t00000000a00425fb", st), st   # the sandbox's set only
    await backend.destroy(sid)
    deadline = time.monotonic() + 10
    while not _zombie(hp) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert _zombie(hp), "the helper outlived its sandbox"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _zombie(pid: int) -> bool:
    """Gone, or dead and waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_a_killed_helper_costs_no_exec(backend: ContainerBackend) -> None:
    sid = new_sid()
    await backend.create(sid, SPEC)
    box = backend.box(sid)
    for k in range(HELPER_MAX_FAILS + 1):
        r = await backend.exec(sid, ExecRequest(shell="echo ok"))
        assert r.stdout == b"ok\n" and r.exit_code == 0
        if k == HELPER_MAX_FAILS:
            break
        await _helper_up(backend, sid)
        hp = _helper_pid(backend, sid)
        os.kill(hp, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while box.helper and time.monotonic() < deadline:   # its Exited comes back
            r = await backend.exec(sid, ExecRequest(shell="echo ok"))
            assert r.stdout == b"ok\n"
    # helpers that keep dying: the per-exec path serves this sandbox from now on
    assert box.helper_fails >= HELPER_MAX_FAILS and box.helper == 0
    r = await backend.exec(sid, ExecRequest(shell="echo still"))
    assert r.stdout == b"still\n" and box.helper == 0


async def test_exec_at_the_task_limit_still_gets_in(backend: ContainerBackend) -> None:
    """The helper counts in the sandbox's pids cgroup and cannot fork at the limit; the
    exec falls back to the per-exec path, which gets in (spawn_final)."""
    import msgspec
    sid = new_sid()
    await backend.create(sid, msgspec.structs.replace(SPEC, pids_max=12))
    box = backend.box(sid)
    await _helper_up(backend, sid)
    assert box.helper
    await backend.exec(sid, ExecRequest(
        # the shell keeps its own slot too: the cgroup stays full
        shell="for i in $(seq 40); do sleep 1000 & done; exec sleep 1000", background=True))
    pids = os.path.dirname(box.cg.procs_files[box.cg.pids_index])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # the loop's own exec helper counted while it forked: take the slot it left. At
        # the limit for 0.2 s: a process on its way out (a background start's
        # intermediate, the $(seq) subshell) was counted once, and its slot let the
        # helper fork after all (as in test_process_helper)
        if int(_read(f"{pids}/pids.current")) >= int(_read(f"{pids}/pids.max")):
            await asyncio.sleep(0.2)
            if int(_read(f"{pids}/pids.current")) >= int(_read(f"{pids}/pids.max")):
                break
        await backend.exec(sid, ExecRequest(shell="sleep 1000", background=True))
    assert int(_read(f"{pids}/pids.current")) >= 12
    sent = _spy(backend)
    r = await backend.exec(sid, ExecRequest(shell="echo in"))
    assert r.stdout == b"in\n", r
    # it was offered to the helper first, which could not fork: the per-exec path got in
    assert [getattr(q, "helper", None) for q in sent] == [box.helper, 0], sent


async def test_an_exec_with_hide_never_goes_through_the_helper(
        backend: ContainerBackend) -> None:
    """Landlock (``ExecRequest.hide``) is applied on the per-exec path only: an exec
    asking for it is never handed to the helper, and what it hides stays hidden."""
    if not backend.supports_hide:
        pytest.skip("no Landlock on this kernel")
    sid = new_sid()
    await backend.create(sid, SPEC)
    await _helper_up(backend, sid)
    sent = _spy(backend)
    r = await backend.exec(sid, ExecRequest(shell="cat /etc/passwd", hide=("etc",)))
    assert r.exit_code != 0 and b"root:" not in r.stdout
    assert [getattr(q, "helper", None) for q in sent] == [0], sent
    del sent[:]
    r = await backend.exec(sid, ExecRequest(shell="cat /etc/passwd"))
    assert b"root:" in r.stdout
    assert [getattr(q, "helper", None) for q in sent] == [backend.box(sid).helper]


async def test_idle_helper_is_retired_and_the_next_exec_starts_a_new_one(
        tmp_path: object, images_dir: str) -> None:
    """helper_idle_s (density, issue 22): a helper unused that long is stopped (its
    process gone, not counted as a failure); one serving a long exec is not; the next
    exec still answers and a new helper starts."""
    from dsec.edge.backends.container import DirectoryImages
    from dsec.ownership import start_time
    from tests.edge.container.conftest import _cleanup

    b = ContainerBackend(root_dir=os.path.join(str(tmp_path), "root"),
                         images=DirectoryImages(images_dir), helper_idle_s=0.3,
                         limits_poll_s=0.1)
    try:
        sid = new_sid()
        await b.create(sid, SPEC)

        async def helper_up() -> int:
            for _ in range(250):
                await b.exec(sid, ExecRequest(argv=["true"]))
                if b.box(sid).helper:
                    return b.box(sid).helper_pid
                await asyncio.sleep(0.02)
            raise AssertionError("no helper started")
        first = await helper_up()
        r = await b.exec(sid, ExecRequest(shell="sleep 1; echo done"))  # busy > idle_s
        assert r.stdout == b"done\n" and b.box(sid).helper_pid == first
        assert start_time(first, running=True) is not None
        deadline = time.monotonic() + 10
        while (b.box(sid).helper or start_time(first, running=True) is not None) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not b.box(sid).helper and start_time(first, running=True) is None
        assert b.box(sid).helper_fails == 0
        second = await helper_up()
        assert second != first
        r = await b.exec(sid, ExecRequest(shell="echo again"))
        assert r.stdout == b"again\n"
    finally:
        await _cleanup(b)
