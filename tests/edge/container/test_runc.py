"""The runc driver: same spec, same protocol, run by Debian's runc (the reference)."""

from __future__ import annotations

import json
import os

from dsec.edge.backends.container import ContainerBackend
from dsec.edge.backends.container.oci import oci_config
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
