"""Nothing dsec keeps on the host is readable by another host user (issue 11, item 1).

The state dir holds API key hashes and stored create requests with their ``env``
(``control.sqlite``), every project's layers and snapshots (``layers/``), the sandboxes'
roots and the edges' journals and sockets. A pre-created 0755 state dir used to leave all
of it world-readable. Each test reads everything as ``nobody`` from a forked child that
dropped root (a real unprivileged host user, real permission checks by the kernel).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec import LocalCluster
from tests.security.conftest import _rmdir_everywhere

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")


def readable_by_nobody(paths: list[str]) -> list[str]:
    """The paths a process running as uid/gid 65534 (no supplementary groups) can open
    for reading (a file) or list (a directory), checked in a forked child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop root for good, then try every path
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            got = []
            for p in paths:
                try:
                    if os.path.isdir(p):
                        os.listdir(p)
                    else:
                        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
                        os.close(fd)
                    got.append(p)
                except OSError:
                    pass
            os.write(w, json.dumps(got).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return list(json.loads(data))


def everything_under(root: str, limit: int = 20_000) -> list[str]:
    """Every path below ``root`` (as root sees it), symlinks not followed."""
    out = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            out.append(os.path.join(dirpath, n))
        if len(out) > limit:
            break
    return out


def test_the_checker_is_not_vacuous() -> None:
    parent = Path(tempfile.mkdtemp(prefix="dsec-check-"))
    try:
        os.chmod(parent, 0o755)
        (parent / "f").write_text("x")
        os.chmod(parent / "f", 0o644)
        (parent / "g").write_text("x")
        os.chmod(parent / "g", 0o600)
        assert sorted(readable_by_nobody([str(parent), str(parent / "f"),
                                          str(parent / "g")])) == [str(parent),
                                                                   str(parent / "f")]
    finally:
        import shutil
        shutil.rmtree(parent)


@pytest.fixture
def preexisting_state_dir() -> Iterator[str]:
    """A state dir someone created by hand with the usual 0755 / 0644 modes, holding an
    older store's files, in a world-traversable parent."""
    parent = tempfile.mkdtemp(prefix="dsec-statedir-")
    os.chmod(parent, 0o755)
    d = os.path.join(parent, "state")
    os.mkdir(d)
    os.chmod(d, 0o755)
    with open(os.path.join(d, "control.sqlite"), "wb"):
        pass
    os.chmod(os.path.join(d, "control.sqlite"), 0o644)
    os.makedirs(os.path.join(d, "layers", "manifests"))
    for sub in ("layers", "layers/manifests"):
        os.chmod(os.path.join(d, sub), 0o755)
    try:
        yield d
    finally:
        import shutil
        shutil.rmtree(parent, ignore_errors=True)


def test_nothing_under_the_state_dir_is_readable_by_another_user(
        preexisting_state_dir: str, tmp_path: Path) -> None:
    d = preexisting_state_dir
    tools = tmp_path / "tools"
    (tools / "opt").mkdir(parents=True)
    (tools / "opt/tool").write_text("project tool\n")
    root_dir = os.path.abspath(os.path.join(d, "container", "edge-0"))
    try:
        with LocalCluster(edges=1, backend="container", state_dir=d) as cl:
            key = cl.create_key("alice", "teama", "member")
            with cl.client() as admin:
                admin.images.build(tools, name="tools", kind="toolkit")
            h = {"authorization": f"Bearer {key}"}
            with httpx.Client(base_url=cl.url, timeout=60, headers=h) as http:
                r = http.post("/v1/sandboxes", json={
                    "project": "teama", "toolkits": ["tools"],
                    "env": {"OPENAI_API_KEY": "sk-very-secret"}})
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                r = http.post(f"/v1/sandboxes/{sid}/exec",
                              json={"shell": "echo secret > /root/notes"})
                assert r.json()["exit_code"] == 0, r.text
                assert http.post(f"/v1/sandboxes/{sid}/snapshot").status_code == 201
                # while the sandbox runs: its root, its layers' mounts, the journal
                mounts = cl.runtime._mounts.root
                assert os.listdir(mounts), "the layers are mounted"
                paths = everything_under(d) + everything_under(mounts)
                assert len(paths) > 100
                assert readable_by_nobody(paths) == []
                # and the modes themselves (they matter where a store lives elsewhere)
                assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
                for name in ("control.sqlite", "control.sqlite-wal", "control.sqlite-shm"):
                    path = os.path.join(d, name)
                    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name
                store = os.path.join(d, "layers")
                for dirpath, dirnames, filenames in os.walk(store):
                    assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
                    for n in filenames:
                        mode = stat.S_IMODE(os.stat(os.path.join(dirpath, n)).st_mode)
                        want = 0o400 if n.endswith(".erofs") else 0o600
                        assert mode == want, (dirpath, n, oct(mode))
                # what is at stake: the stored create request, env included, is in the
                # SQLite files once the registry flushed (each heartbeat round, 1 s)
                deadline = time.monotonic() + 10
                while not _holds(d, b"sk-very-secret") and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert _holds(d, b"sk-very-secret")
    finally:
        _rmdir_everywhere("dsec-" + hashlib.sha1(root_dir.encode()).hexdigest()[:10])


def _holds(d: str, needle: bytes) -> bool:
    raw = b""
    for name in ("control.sqlite", "control.sqlite-wal"):
        with contextlib.suppress(FileNotFoundError), open(os.path.join(d, name), "rb") as f:
            raw += f.read()
    return needle in raw


def _dsec(*args: str) -> list[str]:
    return [sys.executable, "-c", "from dsec.cli.main import main; main()", *args]


@contextlib.contextmanager
def _running(cmd: list[str], ready: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise AssertionError(f"{cmd[3:]} did not come up: {err[-2000:]}")
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_dsec_edge_and_dsec_up_make_an_existing_state_dir_private(
        preexisting_state_dir: str) -> None:
    d = preexisting_state_dir
    sock = os.path.join(os.path.dirname(d), "edge.sock")
    with _running(_dsec("edge", "--listen", f"unix:{sock}", "--state-dir", d,
                        "--node-id", "e1"), sock):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert readable_by_nobody(everything_under(d)) == []
    os.chmod(d, 0o755)
    local = os.path.join(d, "local.json")
    with _running(_dsec("up", "--state-dir", d, "--listen", "127.0.0.1:0", "--quiet"),
                  local):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(local).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.join(d, "control.sqlite")).st_mode) == 0o600
        assert readable_by_nobody(everything_under(d)) == []


def test_a_state_dir_owned_by_another_user_is_refused(preexisting_state_dir: str) -> None:
    d = preexisting_state_dir
    os.chown(d, NOBODY, NOBODY)
    r = subprocess.run(_dsec("edge", "--listen", f"unix:{d}/e.sock", "--state-dir", d),
                       capture_output=True, text=True, timeout=20, check=False)
    assert r.returncode != 0 and "owned by uid 65534" in " ".join(r.stderr.split()), r.stderr
    r = subprocess.run(_dsec("up", "--state-dir", d, "--listen", "127.0.0.1:0", "--quiet"),
                       capture_output=True, text=True, timeout=20, check=False)
    assert r.returncode != 0 and "owned by uid 65534" in " ".join(r.stderr.split()), r.stderr
    assert not os.path.exists(os.path.join(d, "e.sock"))
