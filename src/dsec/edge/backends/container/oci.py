"""An OCI runtime-spec ``config.json`` for a sandbox (pure: spec in, dict out).

Same tree as the native driver builds (:mod:`.rootfs` tables), same init (catatonit -P
bind-mounted read-only at /dev/.init), same limits, same hardening (capabilities,
no_new_privs, masked/read-only paths). The seccomp deny list is not duplicated in JSON:
runc here is the *reference* for speed, and the hostile-agent suite runs on the native
driver; see docs/container.md.
"""

from __future__ import annotations

from typing import Any

from dsec.edge.backends.container.linux import DEFAULT_CAPS
from dsec.edge.backends.container.rootfs import MASKED_DIRS, MASKED_FILES, READONLY_PATHS
from dsec.edge.governor import CFS_PERIOD_US
from dsec.edge.spec import SandboxSpec

__all__ = ["CAP_NAMES", "oci_config"]

CAP_NAMES = {0: "CAP_CHOWN", 1: "CAP_DAC_OVERRIDE", 3: "CAP_FOWNER", 4: "CAP_FSETID",
             5: "CAP_KILL", 6: "CAP_SETGID", 7: "CAP_SETUID", 8: "CAP_SETPCAP",
             10: "CAP_NET_BIND_SERVICE", 13: "CAP_NET_RAW", 18: "CAP_SYS_CHROOT",
             29: "CAP_AUDIT_WRITE", 31: "CAP_SETFCAP"}


def oci_config(*, spec: SandboxSpec, hostname: str, cgroups_path: str, init_path: str,
               rootfs: str = "root") -> dict[str, Any]:
    caps = [CAP_NAMES[c] for c in DEFAULT_CAPS]
    namespaces = [{"type": t} for t in ("pid", "mount", "network", "uts", "ipc", "cgroup")]
    resources: dict[str, Any] = {
        "memory": {"limit": spec.memory_bytes, "swap": spec.memory_bytes},
        "cpu": {"shares": max(2, spec.cpu_milli * 1024 // 1000),
                "quota": max(1000, spec.cpu_milli * CFS_PERIOD_US // 1000),
                "period": CFS_PERIOD_US},
        "devices": [{"allow": False, "access": "rwm"}],
    }
    if spec.pids_max is not None:
        resources["pids"] = {"limit": spec.pids_max}
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
        },
    }
