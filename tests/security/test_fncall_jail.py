"""Hostile code inside a fncall call tries to break out (issue 11, item 2).

Every test is a real attempt made from inside a call (Python code run by the fncall
backend), answered by the host: a test passes when the attempt fails. They use only the
backend's public API (``FncallBackend(root=...)``, ``exec``, ``call``, the file API,
``EdgeNode`` events), so they also run against the unisolated backend of before the jail
- where each of them fails (checked with ``PYTHONPATH=<old src>``).

Nothing here is destructive on a host where the jail is missing: signals go only to a
recorder process the test starts, writes go to unique names that are removed again, and
the network probe targets a listener the test owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Iterator

import pytest

import dsec
from dsec.edge.backends.fncall import FncallBackend
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.conftest import make_node

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")]

A = "sb-0000000000a1-n1"
B = "sb-0000000000b2-n1"
SPEC = SandboxSpec(backend="fncall", memory_bytes=128 << 20, pids_max=32)  # type: ignore[arg-type]


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


def work_dir(b: FncallBackend, sid: str) -> str:
    """Host path of a sandbox's work dir (``<root>/<sid>`` in the backend before the jail,
    so these tests can still be run against it)."""
    return b.work_dir(sid) if hasattr(b, "work_dir") else os.path.join(b.root, sid)


async def run(b: FncallBackend, sid: str, code: str, timeout_s: float = 30) -> tuple[int, str]:
    r = await b.exec(sid, ExecRequest(shell=textwrap.dedent(code), timeout_s=timeout_s))  # type: ignore[arg-type]
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


@pytest.fixture
def host_secret() -> Iterator[str]:
    """A world-readable host file (0644 in a 0755 dir): nothing but the jail protects it."""
    d = tempfile.mkdtemp(prefix="dsec-fncall-host-")
    os.chmod(d, 0o755)
    path = os.path.join(d, "secret.txt")
    with open(path, "w") as f:
        f.write("host-secret-" + secrets.token_hex(8))
    os.chmod(path, 0o644)
    try:
        yield path
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _probe_read(paths: list[str]) -> str:
    return textwrap.dedent(f"""
    out = {{}}
    for p in {paths!r}:
        try:
            with open(p, 'rb') as f:
                out[p] = f.read(200).decode(errors='replace')
        except OSError as e:
            out[p] = 'E' + str(e.errno)
    import json; print(json.dumps(out))
    """)


async def test_host_files_and_other_sandboxes_are_not_there(fncall: FncallBackend,
                                                            host_secret: str) -> None:
    await fncall.write_file(B, "/b-secret.txt", b"b-secret")  # type: ignore[arg-type]
    targets = [host_secret, "/etc/shadow", "/root/.bash_history", "/proc/1/environ",
               os.path.join(work_dir(fncall, B), "b-secret.txt"), work_dir(fncall, A)]
    code, out = await run(fncall, A, _probe_read(targets) + textwrap.dedent("""
    import os
    print(sorted(os.listdir('/')))
    for d in ('/root', '/home', '/var', '/run', '/srv', '/mnt', '/opt'):
        print(d, sorted(os.listdir(d)) if os.path.isdir(d) else '-')
    """))
    assert code == 0, out
    found = json.loads(out.splitlines()[0])
    leaked = {p: v for p, v in found.items() if not v.startswith("E")}
    assert not leaked, f"host or other-sandbox files readable from a call: {leaked}"
    listing = dict(line.split(" ", 1) for line in out.splitlines()[2:])
    # /root may hold only the path down to a Python runtime under it (e.g. pyenv), never
    # the host's own files; /home, /var, /run, ... do not exist at all.
    assert listing["/root"] in ("-", "[]", "['.pyenv']"), listing
    assert all(listing[d] == "-" for d in ("/home", "/var", "/run", "/srv", "/mnt")), listing


async def test_the_cluster_state_dir_and_admin_key_are_unreachable() -> None:
    """`dsec up --backend fncall`: a sandbox made through the SDK (REST) looks for the
    cluster's state dir, its admin key in local.json and the SQLite state."""
    from dsec.cluster.local import LocalCluster

    with LocalCluster(backend="fncall", subprocess=True, gateway=False) as cl:
        state = cl.state_dir
        local = os.path.join(state, "local.json")
        assert os.path.exists(local)
        with cl.client() as client, client.sandboxes.create(backend="fncall") as sb:
            r = sb.exec(_probe_read([local, os.path.join(state, "control.sqlite")])
                        + f"import os\nprint(os.path.exists({state!r}), "
                          "os.environ.get('DSEC_API_KEY'))\n")
        assert r.exit_code == 0, r.stderr
        found = json.loads(r.stdout.decode().splitlines()[0])
        assert all(v.startswith("E") for v in found.values()), found
        assert cl.api_key not in r.stdout.decode()
        assert r.stdout.decode().splitlines()[1] == "False None"


RECORDER = """
import os, signal, sys, time
out = sys.argv[1]
def record(sig, frame):
    with open(out, 'a') as f:
        f.write(f'{sig}\\n')
for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, record)
open(out + '.ready', 'w').close()
while True:
    time.sleep(1)
"""


@pytest.fixture
def recorder(fncall: FncallBackend) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A host process running as sandbox A's own host uid (the owner of its work dir) -
    so only namespaces stand between a call and it - that records every signal it
    receives."""
    uid = os.stat(work_dir(fncall, A)).st_uid
    d = tempfile.mkdtemp(prefix="dsec-fncall-sig-")
    os.chmod(d, 0o777)
    out = os.path.join(d, "signals")
    script = os.path.join(d, "rec.py")
    with open(script, "w") as f:
        f.write(RECORDER)
    os.chmod(script, 0o644)
    proc = subprocess.Popen(["/usr/bin/python3", "-I", script, out], user=uid, group=uid,
                            extra_groups=[], stdin=subprocess.DEVNULL,
                            start_new_session=True)  # its own group: killpg hits only it
    try:
        for _ in range(200):
            if os.path.exists(out + ".ready"):
                break
            time.sleep(0.025)
        else:
            pytest.fail("the signal recorder did not start")
        yield proc, out
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


async def test_host_processes_cannot_be_signalled(
        fncall: FncallBackend, recorder: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, out = recorder
    pids = [proc.pid]
    _, text = await run(fncall, A, f"""
    import os, signal
    for pid in {pids!r}:
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP):
            try:
                os.kill(pid, sig)
                print('sent', pid, int(sig))
            except OSError as e:
                print('refused', pid, e.errno)
        try:
            os.killpg(pid, signal.SIGUSR2)
            print('sent group', pid)
        except OSError as e:
            print('refused group', pid, e.errno)
    """)
    await asyncio.sleep(0.3)
    got = open(out).read().split() if os.path.exists(out) else []  # noqa: ASYNC230, SIM115
    assert got == [], f"the host process received signals {got} from a call: {text}"
    assert "sent" not in text, text
    assert proc.poll() is None


async def test_no_network_beyond_its_own_loopback(fncall: FncallBackend) -> None:
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    lst.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0dsec-fncall-test-{secrets.token_hex(4)}"
    abstract.bind(name)
    abstract.listen(8)
    abstract.setblocking(False)
    port = lst.getsockname()[1]
    try:
        code, out = await run(fncall, A, f"""
        import socket
        print(sorted(n for _, n in socket.if_nameindex()))
        for fam, addr in ((socket.AF_INET, ('127.0.0.1', {port})),
                          (socket.AF_UNIX, {name!r}),
                          (socket.AF_INET, ('10.0.2.2', 80)),
                          (socket.AF_INET, ('1.1.1.1', 53))):
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect(addr)
                print('connected', addr)
            except OSError as e:
                print('refused', e.errno)
        # its own loopback works (servers inside a call keep working)
        srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)
        c = socket.create_connection(srv.getsockname(), timeout=2)
        print('own loopback ok')
        """)
        assert code == 0, out
        lines = out.splitlines()
        assert lines[0] == "['lo']", out
        assert "connected" not in out, out
        assert "own loopback ok" in out
        for s in (lst, abstract):
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        lst.close()
        abstract.close()


async def test_proc_does_not_lead_out(fncall: FncallBackend, host_secret: str) -> None:
    me = os.getpid()
    code, out = await run(fncall, A, f"""
    import os
    res = {{}}
    for p in ('/proc/1/root{host_secret}', '/proc/1/cwd{host_secret}',
              '/proc/self/root{host_secret}', '/proc/{me}/environ', '/proc/{me}/root/etc/shadow'):
        try:
            open(p, 'rb').read(10); res[p] = 'ok'
        except OSError as e:
            res[p] = e.errno
    print(res)
    print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))  # JSON too
    seen = b''
    for p in os.listdir('/proc'):
        if p.isdigit() or p == 'self':
            for f in ('cmdline', 'environ'):
                try:
                    seen += open(f'/proc/{{p}}/{{f}}', 'rb').read() + b'\\n'
                except OSError:
                    pass
    print(repr(seen))
    print(open('/proc/self/mountinfo').read())
    """)
    assert code == 0, out
    lines = out.splitlines()
    assert "'ok'" not in lines[0], lines[0]
    pids = json.loads(lines[1])
    assert me not in pids and max(pids) < 100, pids  # its own pid namespace, nothing else
    src = os.path.dirname(os.path.dirname(os.path.abspath(dsec.__file__)))
    procs = lines[2]  # every process's argv and environment, as the call sees them
    # The Python runtime is bound read-only on purpose (sys.prefix: the venv, and its base):
    # a checkout under /tmp puts the venv there; every other line must name no host path.
    runtime = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    mountinfo = "\n".join(ln for ln in lines[3:]
                           if len(ln.split()) < 5 or ln.split()[4] not in runtime)
    for r in runtime:   # (the interpreter's own path is in its argv)
        procs = procs.replace(repr(r)[1:-1], "<runtime>")
    for host_path in (fncall.root, os.path.dirname(host_secret), tempfile.gettempdir() + "/",
                      src):
        assert host_path not in mountinfo, f"{host_path} visible in mountinfo:\n{mountinfo}"
        assert host_path not in procs, f"{host_path} in a jailed process's argv/env: {procs}"


async def test_the_root_is_read_only_and_only_the_work_dir_persists(
        fncall: FncallBackend) -> None:
    name = f"dsec-fncall-probe-{secrets.token_hex(4)}"
    targets = [f"/{name}", f"/usr/{name}", f"/etc/{name}", f"/usr/bin/{name}"]
    private = [f"/tmp/{name}", f"/dev/shm/{name}"]
    try:
        code, out = await run(fncall, A, f"""
        import os
        res = {{}}
        for p in {targets!r}:
            try:
                open(p, 'w').write('x'); res[p] = 'written'
            except OSError as e:
                res[p] = e.errno
        for p in {private!r} + ['w']:  # private per call, and the work dir (cwd)
            open(p, 'w').write('ok')
        print(res)
        print(os.getuid(), os.geteuid(), os.getgid())
        """)
        assert code == 0, out
        assert "written" not in out.splitlines()[0], out
        uid, euid, gid = map(int, out.splitlines()[1].split())
        assert uid == euid == gid == os.stat(work_dir(fncall, A)).st_uid, out
        assert uid not in (0, 65534), out  # the sandbox's own host uid
        assert await fncall.read_file(A, "/w") == b"ok"  # type: ignore[arg-type]
        code, out = await run(fncall, A, f"""
        import os
        print([os.path.exists(p) for p in {private!r}], os.path.exists('w'))
        """)
        assert out.strip() == "[False, False] True", out  # /tmp, /dev/shm: per call
    finally:
        for p in targets + private:  # only exist on the host if the jail was missing
            with contextlib.suppress(OSError):
                os.unlink(p)


async def test_privileges_are_gone(fncall: FncallBackend) -> None:
    code, out = await run(fncall, A, """
    import ctypes, os
    st = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
    print(st['CapEff'].strip(), st['CapBnd'].strip(), st['NoNewPrivs'].strip(), st['Seccomp'].strip())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    print(libc.unshare(0x00020000), ctypes.get_errno())        # CLONE_NEWNS
    print(libc.unshare(0x02000000), ctypes.get_errno())        # CLONE_NEWCGROUP
    print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())
    print(libc.syscall(429, -1, b'', -100, b'/tmp', 4), ctypes.get_errno())  # move_mount
    print(libc.syscall(428, -100, b'/', 1), ctypes.get_errno())  # open_tree(CLONE)
    """)
    assert code == 0, out
    caps, *calls = out.splitlines()
    assert caps == "0000000000000000 0000000000000000 1 2", caps
    assert all(c == "-1 1" for c in calls), out  # EPERM from seccomp, caps or both


async def test_memory_and_pids_limits_hold_and_are_events() -> None:
    backend = FncallBackend(pool_size=1)
    try:
        async with make_node(backend) as node:
            info = await node.create(SandboxSpec(backend="fncall", memory_bytes=64 << 20,  # type: ignore[arg-type]
                                                 pids_max=8))
            r = await node.exec(info.id, ExecRequest(shell=textwrap.dedent("""
            chunks = []
            for _ in range(64):
                chunks.append(bytearray(8 << 20))   # 512 MiB in 8 MiB steps
            print('survived', len(chunks))
            """), timeout_s=60))
            assert b"survived" not in r.stdout, r
            assert r.exit_code == 137, r
            r = await node.exec(info.id, ExecRequest(shell=textwrap.dedent("""
            import subprocess
            procs, refused = [], 0
            for _ in range(32):
                try:
                    procs.append(subprocess.Popen(['sleep', '30']))
                except OSError:
                    refused += 1
            print(len(procs), refused)
            """), timeout_s=60))
            started, refused = map(int, r.stdout.split())
            assert started < 8 and refused > 0, r
            reasons = [e.reason for e in node.events(info.id)]
            assert "oom_kill" in reasons and "pids_limit" in reasons, reasons
            assert node.get(info.id).state == "running"  # a limit hit is not a death
    finally:
        await backend.close()


def _host_pids_with(marker: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(name))
            except OSError:
                pass
    return out


async def test_no_process_outlives_its_call(fncall: FncallBackend) -> None:
    marker = f"77.{secrets.randbelow(10**6)}"
    try:
        code, out = await run(fncall, A, f"""
        import os, subprocess
        if os.fork() == 0:            # a daemon: double fork + new session
            os.setsid()
            if os.fork() == 0:
                os.execvp('sleep', ['sleep', '{marker}'])
            os._exit(0)
        subprocess.Popen(['sleep', '{marker}'])
        import time
        for _ in range(400):  # return only once both really run 'sleep <marker>'
            n = 0
            for p in os.listdir('/proc'):
                try:
                    n += b'{marker}' in open(f'/proc/{{p}}/cmdline', 'rb').read()
                except OSError:
                    pass
            if n >= 2:
                break
            time.sleep(0.01)
        print('left behind', n)
        """)
        assert code == 0 and "left behind 2" in out, out
        assert _host_pids_with(marker) == [], "processes of a finished call still run"
    finally:
        for pid in _host_pids_with(marker):  # only if the jail was missing
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(pid)
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                os.close(fd)


async def test_concurrent_calls_do_not_see_each_other(fncall: FncallBackend) -> None:
    marker = f"88.{secrets.randbelow(10**6)}"
    b_tmp = f"/tmp/dsec-fncall-b-{marker}"
    b_file = os.path.join(work_dir(fncall, B), f"b-{marker}")
    slow = asyncio.ensure_future(run(fncall, B, f"""
    import subprocess, time
    open({b_tmp!r}, 'w').write('b')
    open('b-{marker}', 'w').write('b')
    p = subprocess.Popen(['sleep', '{marker}'])
    time.sleep(3)
    """))
    try:
        await asyncio.sleep(1.0)
        code, out = await run(fncall, A, f"""
        import os
        cmds = []
        for p in os.listdir('/proc'):
            if p.isdigit():
                try:
                    cmds.append(open(f'/proc/{{p}}/cmdline', 'rb').read())
                except OSError:
                    pass
        print(any(b'{marker}' in c for c in cmds), os.path.exists({b_tmp!r}),
              os.path.exists({b_file!r}))
        """)
        assert code == 0, out
        assert out.strip() == "False False False", out
    finally:
        await slow
        with contextlib.suppress(OSError):
            os.unlink(b_tmp)  # only on the host if the jail was missing


async def test_file_api_cannot_be_raced_out_of_the_work_dir(fncall: FncallBackend,
                                                            host_secret: str) -> None:
    """While a call swaps ``x`` between a regular file and a symlink to a host file, the
    edge (root) reads ``x`` through the file API: it must never return the host file."""
    await fncall.write_file(A, "/x", b"inside")  # type: ignore[arg-type]
    swapper = asyncio.ensure_future(run(fncall, A, f"""
    import os, time
    end = time.time() + 4
    while time.time() < end:
        try:
            os.unlink('x.tmp')
        except FileNotFoundError:
            pass
        os.symlink({host_secret!r}, 'x.tmp'); os.rename('x.tmp', 'x')
        open('x.tmp', 'w').write('inside'); os.rename('x.tmp', 'x')
    """))
    seen: set[bytes] = set()
    try:
        await asyncio.sleep(0.5)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            for _ in range(50):
                with contextlib.suppress(Exception):
                    seen.add(await fncall.read_file(A, "/x"))  # type: ignore[arg-type]
            await asyncio.sleep(0)
    finally:
        await swapper
    assert not any(s.startswith(b"host-secret") for s in seen), seen
    assert b"inside" in seen


@pytest.mark.parametrize("uid", [0, 1000])
async def test_the_jail_user_is_configurable(tmp_path: object, uid: int) -> None:
    b = FncallBackend(pool_size=1, root=os.path.join(str(tmp_path), "r"), uid=uid)
    try:
        await b.create(A, SPEC)  # type: ignore[arg-type]
        code, out = await run(b, A, """
        import os
        st = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
        open('/workspace/mine', 'w').write('x')
        print(os.getuid(), st['CapEff'].strip(), st['Seccomp'].strip())
        """)
        assert code == 0, out
        u, caps, sec = out.split()
        assert (int(u), sec) == (uid, "2"), out
        assert (caps == "0000000000000000") == (uid != 0), out  # root keeps the container set
        assert os.stat(os.path.join(work_dir(b, A), "mine")).st_uid == uid
    finally:
        with contextlib.suppress(Exception):
            await b.destroy(A)  # type: ignore[arg-type]
        await b.close()


def test_a_non_root_edge_refuses_to_run_unjailed_calls_silently(tmp_path: object) -> None:
    """Without root the backend cannot jail: it says so instead of running calls bare."""
    code = ("import os\n"
            "from dsec.edge.backends.fncall import FncallBackend\n"
            "from dsec.errors import BackendError\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "try:\n    FncallBackend()\nexcept BackendError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=False, cwd="/",
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.stdout.startswith("refused:") and "isolate=False" in r.stdout, (r.stdout, r.stderr)


async def test_the_work_dir_disk_cap_holds_and_btrfs_calls_are_refused() -> None:
    """A call cannot write past its sandbox's disk cap (the event says so), nor escape
    the cap's quota with a btrfs subvolume or snapshot of its own inside the work dir."""
    backend = FncallBackend(pool_size=1)  # its own root: close() removes everything
    try:
        async with make_node(backend) as node:
            info = await node.create(SandboxSpec(backend="fncall", disk_bytes=16 << 20))  # type: ignore[arg-type]
            r = await node.exec(info.id, ExecRequest(shell=textwrap.dedent("""
            import errno, fcntl, os, struct
            try:
                with open('big', 'wb') as f:
                    for _ in range(64):
                        f.write(b'x' * (1 << 20))
                        f.flush()
                        os.fsync(f.fileno())
                print('wrote 64 MiB')
            except OSError as e:
                print('refused', errno.errorcode[e.errno], os.path.getsize('big') >> 20)
            os.unlink('big')
            args = bytearray(struct.pack('q4088s', 0, b'escape'))  # btrfs_ioctl_vol_args
            fd = os.open('.', os.O_RDONLY | os.O_DIRECTORY)
            for name, cmd in (('subvol_create', 0x5000940E), ('snap_create', 0x50009401)):
                try:
                    fcntl.ioctl(fd, cmd, args)
                    print(name, 'ok')
                except OSError as e:
                    print(name, errno.errorcode[e.errno])
            print(sorted(os.listdir('.')))
            """), timeout_s=60))
            lines = r.stdout.decode().splitlines()
            assert r.exit_code == 0, r
            assert lines[0].startswith("refused EDQUOT"), lines
            assert int(lines[0].split()[-1]) <= 16, lines
            assert lines[1:] == ["subvol_create ENOTTY", "snap_create ENOTTY", "[]"], lines
            reasons = [e.reason for e in node.events(info.id)]
            assert "disk_full" in reasons, reasons
            await node.destroy(info.id)
    finally:
        await backend.close()
