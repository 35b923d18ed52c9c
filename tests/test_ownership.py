"""Owner records decide what a root process deletes (mount roots, fncall temp dirs,
scratch space): they must name exactly one live process, and nobody else may forge one.
Red-team of issue 12's reclaim paths (pid reuse, pid namespaces, hostile local users)."""

from __future__ import annotations

import os

import pytest

from dsec import ownership


def test_a_recycled_pid_is_not_the_owner(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = str(tmp_path / "d")
    os.mkdir(d)
    ownership.claim(d)
    assert ownership.owner_alive(d) is True
    me = os.getpid()
    start = ownership.start_time(me)
    assert start is not None
    ns = os.stat("/proc/self/ns/pid").st_ino
    # the same pid, started at another time: a recycled pid
    with open(d + ".owner", "w") as f:
        f.write(f"{me} {start + 1} {ns}\n")
    assert ownership.owner_alive(d) is False
    # the same pid in another pid namespace names another process: no telling
    with open(d + ".owner", "w") as f:
        f.write(f"{me} {start} {ns + 1}\n")
    assert ownership.owner_alive(d) is None
    tok = ownership.token()
    assert ownership.token_alive(tok) is True
    n, p, s = tok.split(".")
    assert ownership.token_alive(f"{n}.{p}.{int(s) + 1}") is False
    assert ownership.token_alive(f"{int(n) + 1}.{p}.{s}") is None
    assert ownership.token_alive("stage-abc") is None


def test_claim_never_writes_through_a_planted_link(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Beside a directory in /tmp (fncall's default root) another local user can plant
    the claim's temp file as a symlink: root wrote "pid start" into whatever it pointed
    at (fs.protected_symlinks is 0 on this machine class)."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    d = str(tmp_path / "d")
    os.mkdir(d)
    for trap in (d + ".owner.tmp", f"{d}.owner.{os.getpid()}.tmp"):
        os.symlink(victim, trap)
    ownership.claim(d)
    assert victim.read_text() == "precious\n"
    assert ownership.owner_alive(d) is True


def test_an_owner_record_written_by_another_user_is_not_believed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A hostile local user plants ``<dir>.owner`` naming a dead process beside a
    directory in a shared place: root must not reclaim (delete, kill in) it on that
    word; nor may a symlink stand in for the record."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file of another user")
    d = str(tmp_path / "d")
    os.mkdir(d)
    with open(d + ".owner", "w") as f:
        f.write("999999 1 0\n")
    os.chown(d + ".owner", 65534, 65534)
    assert ownership.owner_alive(d) is None
    os.unlink(d + ".owner")
    real = tmp_path / "elsewhere"
    real.write_text("999999 1\n")
    os.symlink(real, d + ".owner")
    assert ownership.owner_alive(d) is None


def test_fncall_reclaim_leaves_another_users_planted_root_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """fncall's default roots live in /tmp; at start it removes the ones whose owner
    died and kills the process groups of "fncall_worker" processes working in them.
    A directory and owner record planted by another user were believed."""
    import subprocess

    from dsec.edge.backends.fncall import _reclaim_dead_roots

    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    planted = tmp_path / "dsec-fncall-planted"
    planted.mkdir()
    (planted / "keep").write_text("mine")
    (tmp_path / "dsec-fncall-planted.owner").write_text("999999 1\n")
    for p in (planted, planted / "keep", tmp_path / "dsec-fncall-planted.owner"):
        os.chown(p, 65534, 65534)
    os.chmod(tmp_path, 0o755)
    worker = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               "bash", "-c", "exec -a fncall_worker sleep 1000"], cwd=planted,
                              start_new_session=True)
    try:
        _reclaim_dead_roots(str(tmp_path))
        assert (planted / "keep").read_text() == "mine"
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()


def test_start_time_of_a_zombie_is_none_when_running_is_asked() -> None:
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        # exited but not reaped: a zombie still has a start time, but is not running
        while ownership.start_time(p.pid, running=True) is not None:
            assert time.monotonic() < deadline, "child did not exit"
            time.sleep(0.01)
        assert ownership.start_time(p.pid) is not None
    finally:
        p.wait()
    assert ownership.start_time(p.pid) is None
