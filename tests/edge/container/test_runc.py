"""The runc driver: same spec, same protocol, run by Debian's runc (the reference)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.oci import oci_config
from dsec.edge.backends.container.runc import RuncDriver, merge_env, process_spec
from dsec.wire.spec import ExecRequest, SandboxSpec
from tests.edge.container.conftest import SPEC, new_sid


def test_oci_config_carries_the_spec() -> None:
    cfg = oci_config(spec=SandboxSpec(cpu_milli=500, memory_bytes=64 << 20, pids_max=10),
                     hostname="sb-x", cgroups_path="dsec-n/sb-x", init_path="/usr/bin/catatonit")
    res = cfg["linux"]["resources"]
    assert res["memory"] == {"limit": 64 << 20, "swap": 64 << 20, "reservation": 64 << 20}
    assert res["cpu"]["quota"] == 50_000 and res["pids"] == {"limit": 10}
    assert res["cpu"]["shares"] == 512
    # best-effort (issue 22): lowest weight, soft limit 0; cpu_quota_milli is the cap
    be = oci_config(spec=SandboxSpec(cpu_milli=500, memory_bytes=64 << 20, qos="be",
                                     cpu_quota_milli=2000),
                    hostname="sb-x", cgroups_path="p", init_path="/i")["linux"]["resources"]
    assert be["cpu"]["shares"] == 2 and be["cpu"]["quota"] == 200_000
    assert be["memory"]["reservation"] == 0
    assert "/proc/kcore" in cfg["linux"]["maskedPaths"]
    assert "CAP_SYS_ADMIN" not in cfg["process"]["capabilities"]["bounding"]
    assert cfg["process"]["noNewPrivileges"] is True
    json.dumps(cfg)


def test_oci_seccomp_carries_the_native_profile() -> None:
    from dsec.net.seccomp import AF_VSOCK, CLONE_NEWCGROUP, CLONE_NS_FLAGS

    sec = oci_config(spec=SandboxSpec(pids_max=None), hostname="h", cgroups_path="p",
                     init_path="/i", pids_max=77)
    assert sec["linux"]["resources"]["pids"] == {"limit": 77}  # the backend's effective cap
    seccomp = sec["linux"]["seccomp"]
    assert seccomp["defaultAction"] == "SCMP_ACT_ALLOW"
    assert seccomp["architectures"] == ["SCMP_ARCH_X86_64"]  # i386/x32 are bad-arch
    by_name: dict[str, list[dict]] = {}
    for rule in seccomp["syscalls"]:
        assert rule["action"] == "SCMP_ACT_ERRNO"
        for name in rule["names"]:
            by_name.setdefault(name, []).append(rule)
    assert by_name["clone3"][0]["errnoRet"] == 38 and by_name["keyctl"][0]["errnoRet"] == 1
    assert by_name["io_uring_setup"][0]["errnoRet"] == 38
    assert {r["args"][0]["value"] for r in by_name["clone"]} == set(CLONE_NS_FLAGS)
    assert all(r["args"][0]["op"] == "SCMP_CMP_MASKED_EQ" for r in by_name["clone"])
    assert by_name["socket"][0]["args"] == [{"index": 0, "value": AF_VSOCK,
                                             "op": "SCMP_CMP_EQ"}]
    nested = oci_config(spec=SandboxSpec(allow_nested=True), hostname="h",
                        cgroups_path="p", init_path="/i")["linux"]["seccomp"]
    names = {n for r in nested["syscalls"] for n in r["names"]}
    assert "mount" not in names and "ptrace" in names
    # nesting: namespaces pass, but never a cgroup namespace (test_nested_cgroups.py)
    masked = {(n, r["args"][0]["value"]) for r in nested["syscalls"] if r.get("args")
              for n in r["names"] if n in ("unshare", "clone")}
    assert masked == {("unshare", CLONE_NEWCGROUP), ("clone", CLONE_NEWCGROUP)}


def test_an_execs_env_merges_over_the_bundles_by_key() -> None:
    """A ``--process`` file's env is used as given (no merge by runc/runsc), and getenv()
    takes the first of duplicates: the exec's value must replace the bundle's in place."""
    assert merge_env(["PATH=/bin", "A=1"], ["B=2", "PATH=/x", "A=3=4"]) == \
        ["PATH=/x", "A=3=4", "B=2"]


def test_the_process_file_keeps_the_bundles_hardening() -> None:
    """``exec --process`` takes nothing from the bundle's process: capabilities, rlimits
    and noNewPrivileges must come along, the exec's argv/env/cwd/user replace the rest."""
    base = oci_config(spec=SPEC, hostname="h", cgroups_path="p", init_path="/i")["process"]
    p = process_spec(base, argv=["sh", "-c", "x"], env=["SECRET=s"], cwd="/w", user="7:8")
    assert p["args"] == ["sh", "-c", "x"] and p["cwd"] == "/w"
    assert p["user"] == {"uid": 7, "gid": 8} and p["env"][-1] == "SECRET=s"
    assert p["env"][0].startswith("PATH=") and p["terminal"] is False
    for k in ("capabilities", "rlimits", "noNewPrivileges"):
        assert p[k] == base[k]
    assert process_spec(base, argv=["a"], env=[], cwd="/", user="5")["user"] == \
        {"uid": 5, "gid": 0}
    assert process_spec(base, argv=["a"], env=[], cwd="/", user=None)["user"] == \
        {"uid": 0, "gid": 0}
    with pytest.raises(ValueError, match="uid"):
        process_spec(base, argv=["a"], env=[], cwd="/", user="5:staff")


def test_a_dead_edges_process_files_are_swept(tmp_path: object) -> None:
    """A process.json holds an exec's env (secrets): one a crash left is removed at the
    next start (sweep_logs), one of this process is not."""
    d = RuncDriver(binary="runc", root_dir=str(tmp_path), cgroup_parent="dsec-x")
    dead = os.path.join(d.state_root, ".proc-deadowner-abc")
    os.makedirs(dead)
    Path(dead, "process.json").write_text("{}")
    mine = os.path.join(d.state_root, f".proc-{d._owner}-abc")
    os.makedirs(mine)
    assert d.sweep_logs() == 1
    assert not os.path.exists(dead) and os.path.isdir(mine)


async def test_runc_exec_process_file_carries_the_exec_and_goes(
        runc_backend: ContainerBackend) -> None:
    """argv, env, cwd and user reach the command (through the 0600 process file), and the
    file's directory is gone once the exec returned (foreground and background)."""
    b = runc_backend
    sid = new_sid()
    await b.create(sid, SPEC)
    await b.exec(sid, ExecRequest(shell="mkdir -p /tmp/w"))
    r = await b.exec(sid, ExecRequest(shell="echo $T; pwd; id -u; id -g", env={"T": "v 1"},
                                      cwd="/tmp/w", user="123:45"))
    assert (r.exit_code, r.stdout) == (0, b"v 1\n/tmp/w\n123\n45\n"), r
    bg = await b.exec(sid, ExecRequest(argv=("sleep", "1"), env={"T": "v"}, background=True))
    assert bg.exit_code == 0
    state = os.path.join(b.root_dir, "runc-state")
    assert not [n for n in os.listdir(state) if n.startswith(".proc-")]
    await b.destroy(sid)


async def test_runc_create_exec_files_pause_destroy(runc_backend: ContainerBackend) -> None:
    b = runc_backend
    assert b.name == "runc"
    sid = new_sid()
    mounts_before = _mounts_under(b.root_dir)
    await b.create(sid, SPEC)
    r = await b.exec(sid, ExecRequest(shell="hostname; cat; id -u", stdin=b"in\n", user="agent"))
    assert r.stdout == f"{sid}\nin\n1000\n".encode() and r.exit_code == 0
    r = await b.exec(sid, ExecRequest(argv=("sleep", "10"), timeout_s=0.3))
    assert r.timed_out
    bg = await b.exec(sid, ExecRequest(shell="sleep 100", background=True))
    assert bg.pid and bg.pid > 1
    await b.write_file(sid, "/root/x", b"data")
    assert await b.read_file(sid, "/root/x") == b"data"
    assert os.path.exists(os.path.join(b.upper_dir(sid), "root/x"))
    st = await b.pause(sid)
    assert st.resident_before_bytes > 0
    r = await b.exec(sid, ExecRequest(shell="cat /root/x; head -c 10 /proc/kcore | wc -c"))
    assert r.stdout == b"data0\n"
    await b.destroy(sid)
    assert _mounts_under(b.root_dir) == mounts_before == 1  # the disk pool
    assert b.governor.list_sandboxes() == []
    assert not os.path.exists(os.path.dirname(b.upper_dir(sid)))


def _mounts_under(root: str) -> int:
    """Mounts below ``root`` only: other processes on the machine may mount meanwhile."""
    root = os.path.realpath(root)
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if (line.split()[4] + "/").startswith(root + "/"))
