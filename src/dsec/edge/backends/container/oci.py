"""An OCI runtime-spec ``config.json`` for a sandbox (pure: spec in, dict out).

Same tree as the native driver builds (:mod:`.rootfs` tables), same init (catatonit -P
bind-mounted read-only at /dev/.init), same limits, same hardening (capabilities,
no_new_privs, masked/read-only paths) and the same seccomp deny list: :func:`oci_seccomp`
translates :func:`dsec.net.seccomp.profile_rules` into ``linux.seccomp``, with only the
native architecture listed, so runc's libseccomp refuses the i386/x32 ABIs as the native
driver's filter does.
"""

from __future__ import annotations

import platform
from typing import Any

from dsec.edge.backends.container.linux import DEFAULT_CAPS, SANDBOX_NOFILE
from dsec.edge.backends.container.rootfs import MASKED_DIRS, MASKED_FILES, READONLY_PATHS
from dsec.edge.governor import CFS_PERIOD_US
from dsec.net.seccomp import profile_rules
from dsec.wire.spec import SandboxSpec

__all__ = ["CAP_NAMES", "oci_config", "oci_seccomp"]

_SCMP_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64",
              "ppc64le": "SCMP_ARCH_PPC64LE", "s390x": "SCMP_ARCH_S390X",
              "riscv64": "SCMP_ARCH_RISCV64"}

CAP_NAMES = {0: "CAP_CHOWN", 1: "CAP_DAC_OVERRIDE", 3: "CAP_FOWNER", 4: "CAP_FSETID",
             5: "CAP_KILL", 6: "CAP_SETGID", 7: "CAP_SETUID", 8: "CAP_SETPCAP",
             10: "CAP_NET_BIND_SERVICE", 13: "CAP_NET_RAW", 18: "CAP_SYS_CHROOT",
             29: "CAP_AUDIT_WRITE", 31: "CAP_SETFCAP"}


def oci_seccomp(*, allow_nested: bool, machine: str | None = None) -> dict[str, Any]:
    """The default seccomp profile as an OCI ``linux.seccomp`` object (pure).

    Same rules as the native driver's filter (``profile_rules``): unconditional denials
    grouped by errno, argument rules one each (``clone`` namespace flags as
    ``SCMP_CMP_MASKED_EQ``, ``socket(AF_VSOCK)`` as ``SCMP_CMP_EQ``). Syscall names
    runc's libseccomp does not know are skipped by runc, as by ``compile_profile``.
    """
    machine = machine or platform.machine()
    arch = _SCMP_ARCH.get(machine)
    if arch is None:
        raise ValueError(f"no seccomp architecture name for machine {machine!r}; "
                         f"known: {sorted(_SCMP_ARCH)}")
    plain: dict[int, list[str]] = {}
    syscalls: list[dict[str, Any]] = []
    for rule in profile_rules(allow_nested=allow_nested):
        if rule.arg0_mask is None and rule.arg0_eq is None:
            plain.setdefault(rule.errno, []).append(rule.syscall)
            continue
        if rule.arg0_eq is not None:
            arg = {"index": 0, "value": rule.arg0_eq, "op": "SCMP_CMP_EQ"}
        else:
            arg = {"index": 0, "value": rule.arg0_mask, "valueTwo": rule.arg0_mask,
                   "op": "SCMP_CMP_MASKED_EQ"}
        syscalls.append({"names": [rule.syscall], "action": "SCMP_ACT_ERRNO",
                         "errnoRet": rule.errno, "args": [arg]})
    syscalls[:0] = [{"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": err}
                    for err, names in sorted(plain.items())]
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": [arch], "syscalls": syscalls}


def oci_config(*, spec: SandboxSpec, hostname: str, cgroups_path: str, init_path: str,
               rootfs: str = "root", pids_max: int | None = None) -> dict[str, Any]:
    """``config.json`` for ``spec``. ``pids_max`` is the effective task limit the backend
    decided (spec.pids_max capped by the node); None falls back to ``spec.pids_max``."""
    caps = [CAP_NAMES[c] for c in DEFAULT_CAPS]
    namespaces = [{"type": t} for t in ("pid", "mount", "network", "uts", "ipc", "cgroup")]
    # QoS (issue 22, dsec.edge.qos): best-effort gets the lowest weight and soft limit 0;
    # runc 1.1 has no SCHED_IDLE process field, so the edge sets it on the init itself
    be = spec.qos == "be"
    cap = spec.cpu_milli if spec.cpu_quota_milli is None else spec.cpu_quota_milli
    resources: dict[str, Any] = {
        "memory": {"limit": spec.memory_bytes, "swap": spec.memory_bytes,
                   "reservation": 0 if be else spec.memory_bytes},
        "cpu": {"shares": 2 if be else max(2, spec.cpu_milli * 1024 // 1000),
                "quota": max(1000, cap * CFS_PERIOD_US // 1000),
                "period": CFS_PERIOD_US},
        "devices": [{"allow": False, "access": "rwm"}],
    }
    pids = spec.pids_max if pids_max is None else pids_max
    if pids is not None:
        resources["pids"] = {"limit": pids}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/dev/.init", "-P"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": True,
            # not the edge's raised limit: a sandbox's open files stay a share of the
            # node's file table (red team 19, B5; nsexec.c SANDBOX_NOFILE)
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": SANDBOX_NOFILE,
                         "soft": SANDBOX_NOFILE}],
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/.init", "type": "bind", "source": init_path,
             "options": ["bind", "ro", "nosuid", "nodev"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", f"size={spec.memory_bytes}"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": cgroups_path,
            "resources": resources,
            "maskedPaths": list(MASKED_FILES + MASKED_DIRS),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": oci_seccomp(allow_nested=spec.allow_nested),
        },
    }
