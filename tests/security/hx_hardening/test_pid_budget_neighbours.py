"""An edge started without --pids-share takes the whole host pid budget; with other
edges on the host their sandboxes together could exhaust the pid table (hx). The edge
finds the others through the host's cgroup-name claims (/run/dsec/cgroup-names) and
warns; shares summing to at most 1 are the fix (docs/host-security.md)."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from dsec.edge.backends.container.census import live_owners, other_edges, process_identity


def _bind(names_dir: str, name: str, root: str, owner: str) -> None:
    with open(os.path.join(names_dir, name), "w") as f:
        f.write(f"{root}\n{owner}\n")


def test_live_owners_are_the_other_live_claimers() -> None:
    alive = {"10 5", "11 7"}.__contains__
    got = live_owners({"a": ("/r/a", "10 5"), "b": ("/r/b", "10 5"), "c": ("/r/c", "11 7"),
                       "d": ("/r/d", "12 9"), "e": ("/r/e", ""), "f": ("/r/f", "11 7")},
                      alive=alive, me=11)
    assert got == {10: ["/r/a", "/r/b"]}


def test_an_edge_finds_and_warns_about_other_live_edges(tmp_path: object,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    d = os.path.join(str(tmp_path), "names")
    os.makedirs(d)
    other = subprocess.Popen(["sleep", "60"])
    try:
        _bind(d, "e1", "/srv/edge1/container", process_identity(other.pid))
        _bind(d, "e2", "/srv/edge2/container", f"{other.pid} 1")   # a recycled pid
        _bind(d, "me", "/srv/me/container", process_identity(os.getpid()))
        assert other_edges(names_dir=d) == {other.pid: ["/srv/edge1/container"]}
        from dsec.cli.edge import _warn_shared_pid_budget
        with caplog.at_level(logging.WARNING, logger="dsec.edge"):
            _warn_shared_pid_budget(("container",), names_dir=d)
        assert f"pids {other.pid}" in caplog.text and "--pids-share" in caplog.text
    finally:
        other.kill()
        other.wait()
    assert other_edges(names_dir=d) == {}


def test_the_edge_says_when_host_users_can_read_sandbox_command_lines(
        tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    from dsec.cli.edge import _warn_host_proc, proc_hides_pids

    open_ = "22 27 0:21 / /proc rw,relatime shared:12 - proc proc rw\n"
    hidden = "22 27 0:21 / /proc rw,relatime - proc proc rw,hidepid=invisible,gid=4\n"
    assert not proc_hides_pids("1 0 0:1 / / rw - ext4 /dev/sda rw\n" + open_)
    assert proc_hides_pids(hidden)
    assert proc_hides_pids(hidden.replace("invisible", "2"))
    assert not proc_hides_pids(hidden.replace("invisible", "1"))
    path = os.path.join(str(tmp_path), "mountinfo")
    for text, warns in ((open_, True), (hidden, False)):
        with open(path, "w") as f:
            f.write(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dsec.edge"):
            assert _warn_host_proc(("container",), mountinfo_path=path) is warns
        assert ("hidepid=invisible" in caplog.text) is warns
    assert _warn_host_proc(("gvisor", "vm"), mountinfo_path=path) is False
