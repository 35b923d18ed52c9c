"""Red team of the fncall jail, one layer out: the hostile call attacks the edge through
its reply channel, other tenants through what the kernel accounts per host uid, and the
whole node through the file API (findings of the review of the s3-fncall change).

As in ``test_fncall_jail.py`` every attack is real code run by the fncall backend (or, at
the end, what another host user can plant in /tmp) and a test passes when the attack
fails. The attacks are contained: the reply forgery hurts
only the edge process of the test, the per-uid hog runs as the jail's own uid for a few
seconds, the big directory lives in the test's own disk pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import os
import pickle
import shutil
import subprocess
import textwrap
import tracemalloc
from collections.abc import AsyncIterator

import pytest

from dsec import ownership
from dsec.edge.backends import fncall as fncall_mod
from dsec.edge.backends.container import files as files_mod
from dsec.edge.backends.fncall import FncallBackend, _reclaim_dead_roots
from dsec.errors import BackendError, PayloadTooLarge
from dsec.wire.spec import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

A = "sb-0000000000c1-n1"
B = "sb-0000000000d2-n1"
# (getattr: so these tests also run, and fail, against the code before the fixes)
MAX_VALUE_BYTES: int = getattr(fncall_mod, "MAX_VALUE_BYTES", 1 << 20)
MAX_LIST_ENTRIES: int = getattr(files_mod, "MAX_LIST_ENTRIES", 100_000)
SPEC = SandboxSpec(backend="fncall", memory_bytes=256 << 20, pids_max=64)  # type: ignore[arg-type]


@pytest.fixture
async def fncall(tmp_path: object) -> AsyncIterator[FncallBackend]:
    root = os.path.join(str(tmp_path), "fncall-root")
    b = FncallBackend(pool_size=2, root=root)
    try:
        await b.create(A, SPEC)  # type: ignore[arg-type]
        await b.create(B, SPEC)  # type: ignore[arg-type]
        await b.pool.wait_ready()
        yield b
    finally:
        for sid in (A, B):
            with contextlib.suppress(Exception):
                await b.destroy(sid)  # type: ignore[arg-type]
        await b.close()
        shutil.rmtree(root, ignore_errors=True)


async def run(b: FncallBackend, sid: str, code: str, timeout_s: float = 60,
              cap: int = 1 << 20) -> tuple[int, str]:
    r = await b.exec(sid, ExecRequest(shell=textwrap.dedent(code), timeout_s=timeout_s,  # type: ignore[arg-type]
                                      output_cap_bytes=cap))
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


# The call finds its reply socket (its only socket) and answers for itself: a reply whose
# `value` is a msgpack array of N empty arrays - 1 byte each on the wire, a ~64-byte list
# each once decoded.
FORGE = """
import os, socket, stat, struct, msgspec
for fd in range(3, 1024):
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            break
    except OSError:
        pass
s = socket.socket(fileno=fd)
N = {n}
value = b'\\xdd' + struct.pack('!I', N) + b'\\x90' * N
reply = msgspec.msgpack.encode({{"exit_code": 0, "value": value}})
s.sendall(struct.pack('!I', len(reply)) + reply)
import time; time.sleep(30)
"""


async def test_a_forged_reply_cannot_make_the_edge_allocate_without_bound(
        fncall: FncallBackend) -> None:
    """The edge decoded every reply's `value`, even for an exec that drops it: a 10 MiB
    reply (what a default exec's reply limit allowed) became ~750 MiB of Python lists in
    the edge, on its event loop - and with output_cap_bytes=1 GiB a 2 GiB reply was
    allowed (~130 GiB). An exec never decodes a value now, and a function call's value
    is bounded (MAX_VALUE_BYTES)."""
    n = 5 << 19  # 2.5 MiB: ~160 MiB of lists when decoded
    tracemalloc.start()
    try:
        code, out = await run(fncall, A, FORGE.format(n=n))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"the edge allocated {peak >> 20} MiB for one forged reply"
    assert (code, out) == (0, ""), out  # what it forged: an exec's value is dropped
    # A function call's value: one just over the limit is refused, whatever its content.
    with pytest.raises(BackendError, match="value"):
        await fncall.call(A, exec, FORGE.format(n=MAX_VALUE_BYTES), timeout_s=60)  # type: ignore[arg-type]


class _AtUnpickle:
    """Runs ``expr`` in the worker when the call's pickle is loaded (``__reduce__``)."""

    def __init__(self, expr: str) -> None:
        self.expr = expr

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return eval, (self.expr,)


async def test_a_pickled_payload_runs_only_once_the_call_is_jailed(
        fncall: FncallBackend) -> None:
    """The pickle of a function call is loaded after admission: code a pickle runs while
    it is loaded (``__reduce__``) already has no capability, its seccomp profile, the
    sandbox's uid and nothing of the host."""
    status = _AtUnpickle("open('/proc/self/status').read() + open('/proc/self/cgroup').read()")
    pickle.dumps(status)  # picklable by reference: eval is a builtin
    r = await fncall.call(A, operator.add, status, "", timeout_s=60)  # type: ignore[arg-type]
    assert r.exit_code == 0, r
    st = dict(line.split(":\t", 1) for line in r.value.splitlines() if ":\t" in line)
    assert st["CapEff"].strip() == st["CapBnd"].strip() == "0000000000000000", st
    assert st["Seccomp"].strip() == "2" and st["NoNewPrivs"].strip() == "1", st
    assert int(st["Uid"].split()[0]) != 0, st
    assert "::/" in r.value and fncall.root not in r.value  # its own cgroup namespace


HOG = """
import array, ctypes, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while libc.inotify_init1(0) >= 0:   # fs.inotify.max_user_instances is per host uid
    n += 1
a, b = socket.socketpair()          # fds in flight over unix sockets: per host uid too
a.setblocking(False)
inflight = 0
try:
    while True:
        a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [0] * 250))])
        inflight += 250
except OSError:
    pass
print(n, inflight, flush=True)
open('/workspace/hogging', 'w').close()
time.sleep({hold})
"""

VICTIM = """
import array, ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print('inotify', 'ok' if fd >= 0 else os.strerror(ctypes.get_errno()))
a, b = socket.socketpair()
try:
    a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [0]))])
    print('fd passing ok')
except OSError as e:
    print('fd passing', e.strerror)
"""


async def test_one_tenant_cannot_use_up_what_the_kernel_counts_per_user_for_others(
        fncall: FncallBackend) -> None:
    """Every call ran as host uid 65534, and the kernel counts some things per host uid
    for all processes of that uid together: inotify instances (128 here), fds in flight
    over unix sockets (RLIMIT_NOFILE), pipe buffer pages, RLIMIT_NPROC/SIGPENDING/
    MSGQUEUE. One call holding them made every other tenant's calls - and host processes
    running as nobody - fail inotify_init (EMFILE) and fd passing (ETOOMANYREFS). Each
    sandbox runs as a host uid of its own now."""
    hog = asyncio.ensure_future(run(fncall, A, HOG.format(hold=20)))
    marker = os.path.join(fncall.work_dir(A), "hogging")
    try:
        for _ in range(1200):
            if os.path.exists(marker) or hog.done():
                break
            await asyncio.sleep(0.05)
        assert os.path.exists(marker), await hog
        code, out = await run(fncall, B, VICTIM)
        assert code == 0, out
        assert out.split("\n")[:2] == ["inotify ok", "fd passing ok"], out
        host = await asyncio.create_subprocess_exec(
            "/usr/bin/python3", "-I", "-c", VICTIM, user=65534, group=65534, extra_groups=[],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/")
        text = (await asyncio.wait_for(host.communicate(), 60))[0].decode()
        assert text.split("\n")[:2] == ["inotify ok", "fd passing ok"], text
    finally:
        hog.cancel()
        with contextlib.suppress(BaseException):
            await hog


async def test_sandboxes_get_host_uids_of_their_own_that_survive_a_restart(
        tmp_path: object) -> None:
    """Each sandbox's calls run as its own host uid (from the backend's range), which
    owns its work dir and is still its uid after an edge restart; inside, it has a name
    (git, ssh, getpass look it up) and no capability."""
    root = os.path.join(str(tmp_path), "r")
    b = FncallBackend(pool_size=1, root=root)
    probe = ("import os, pwd\n"
             "print(os.getuid(), os.getgid(), pwd.getpwuid(os.getuid()).pw_name, "
             "pwd.getpwuid(os.getuid()).pw_dir)")
    try:
        for sid in (A, B):
            await b.create(sid, SPEC)  # type: ignore[arg-type]
        outs = {sid: (await run(b, sid, probe))[1].split() for sid in (A, B)}
        ua, ub = int(outs[A][0]), int(outs[B][0])
        assert ua != ub and 0 not in (ua, ub) and 65534 not in (ua, ub), outs
        for sid, u in ((A, ua), (B, ub)):
            assert outs[sid] == [str(u), str(u), "sandbox", "/workspace"], outs
            assert os.stat(b.work_dir(sid)).st_uid == u
            await b.write_file(sid, "/d/f", b"x")  # type: ignore[arg-type]
            assert os.stat(os.path.join(b.work_dir(sid), "d", "f")).st_uid == u
            assert os.stat(os.path.join(b.work_dir(sid), "d")).st_uid == u
    except BaseException:
        for sid in (A, B):
            with contextlib.suppress(Exception):
                await b.destroy(sid)  # type: ignore[arg-type]
        raise
    finally:
        await b.close()  # a given root: both stay
    # B as an older edge left it: every sandbox as 65534, its files too.
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "pool", B)):
        for name in [".", *dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), 65534, 65534)
    b = FncallBackend(pool_size=1, root=root)
    try:
        for sid in (A, B):
            assert await b.adopt(sid, SPEC)  # type: ignore[arg-type]
        # B got a uid of the range again (not the shared 65534), and its files with it
        ub = os.stat(b.work_dir(B)).st_uid
        assert ub not in (65534, ua) and os.stat(os.path.join(b.work_dir(B), "d", "f")).st_uid == ub
        c = "sb-0000000000e3-n1"
        await b.create(c, SPEC)  # type: ignore[arg-type]
        again = {sid: int((await run(b, sid, probe))[1].split()[0]) for sid in (A, B, c)}
        assert (again[A], again[B]) == (ua, ub), again
        assert again[c] not in (ua, ub), again  # a new sandbox never gets a live one's uid
    finally:
        for sid in (A, B, "sb-0000000000e3-n1"):
            with contextlib.suppress(Exception):
                await b.destroy(sid)  # type: ignore[arg-type]
        await b.close()


async def test_backends_on_one_host_never_share_a_sandbox_uid(tmp_path: object) -> None:
    """One host may run several edges (``dsec up --edges N``), each with its own fncall
    backend drawing from the same uid range: the host-wide registry keeps every live
    sandbox's uid its own (each backend alone would start at the range's first uid)."""
    backends = [FncallBackend(pool_size=0, root=os.path.join(str(tmp_path), f"r{i}"))
                for i in range(2)]
    try:
        for b in backends:
            await b.create(A, SPEC)  # type: ignore[arg-type]
        uids = [os.stat(b.work_dir(A)).st_uid for b in backends]
        assert uids[0] != uids[1], uids
    finally:
        for b in backends:
            with contextlib.suppress(Exception):
                await b.destroy(A)  # type: ignore[arg-type]
            await b.close()


async def test_a_huge_directory_neither_stalls_the_edge_nor_exhausts_its_memory(
        fncall: FncallBackend) -> None:
    """The file API ran on the edge's event loop: listing or removing a directory a call
    filled with files (a 10 GiB default cap holds tens of millions) stopped every other
    sandbox's calls, heartbeats and connections for the whole walk (300,000 files: 15 s
    list, 25 s remove on the dev VM), and a listing built one entry per file in memory.
    File operations now run beside the loop, and a listing has a bound."""
    n = MAX_LIST_ENTRIES + 1
    code, out = await run(fncall, A, f"""
    import os
    os.mkdir('d')
    for i in range({n}):
        os.close(os.open(f'd/{{i:0>40}}', os.O_CREAT | os.O_WRONLY, 0o644))
    print('made')
    """, timeout_s=900)
    assert (code, out) == (0, "made\n"), out
    with pytest.raises(PayloadTooLarge, match=str(MAX_LIST_ENTRIES)):
        await fncall.list_dir(A, "/d")  # type: ignore[arg-type]
    removing = asyncio.ensure_future(fncall.remove(A, "/d", recursive=True))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(0)  # the remove has started
        code, out = await run(fncall, B, "print('served')")
        assert (code, out) == (0, "served\n")
        assert not removing.done(), "another sandbox's call waited for the remove to finish"
    finally:
        await removing
    assert [i.name for i in await fncall.list_dir(A, "/")] == []  # type: ignore[arg-type]



# ------------------------------------------------- another host user vs. the default root
# FncallBackend() without root= makes its root in the host's /tmp, a directory every host
# user can write (sticky). Its owner record (<root>.owner, so the next backend can reclaim
# what a crashed one left) was written as root through a fixed temp name, following
# whatever another user planted there; and any dsec-fncall-* directory with an owner
# record naming a dead process was "reclaimed" as root, whoever made it.

def test_the_owner_record_never_follows_what_another_user_planted(tmp_path: object) -> None:
    base = str(tmp_path)
    os.chmod(base, 0o1777)  # like /tmp
    victim = os.path.join(base, "victim")  # stands in for /etc/passwd
    with open(victim, "w") as f:
        f.write("root:x:0:0::/root:/bin/sh\n")
    root = os.path.join(base, "dsec-fncall-x1")
    os.mkdir(root, 0o700)
    os.symlink(victim, root + ".owner.tmp")  # planted before the backend claims it
    os.lchown(root + ".owner.tmp", 65534, 65534)
    ownership.claim(root)
    with open(victim) as f:
        assert f.read() == "root:x:0:0::/root:/bin/sh\n", "claim wrote through a symlink"
    assert not os.path.islink(root + ".owner") and ownership.owner_alive(root) is True
    ownership.disown(root)


def test_a_root_another_user_made_is_never_reclaimed(tmp_path: object) -> None:
    base = str(tmp_path)
    os.chmod(base, 0o1777)
    theirs = os.path.join(base, "dsec-fncall-theirs")
    os.mkdir(theirs)
    with open(os.path.join(theirs, "keep"), "w") as f:
        f.write("their file")
    open(os.path.join(theirs, "pool.img"), "w").close()  # it claims to be a jailed root
    with open(theirs + ".owner", "w") as f:
        f.write("999999999 1\n")  # a process that is not running: "reclaim me"
    for p in (theirs, os.path.join(theirs, "keep"), os.path.join(theirs, "pool.img"),
              theirs + ".owner"):
        os.chown(p, 65534, 65534)
    # Had its name's hash matched a live backend's cgroup name (a 40-bit prefix of sha1),
    # root would have killed every process of that backend's sandboxes and removed them.
    _reclaim_dead_roots(base)
    assert os.path.exists(os.path.join(theirs, "keep")), "root reclaimed another user's dir"
