"""What a sandbox root looks like besides the image: one table for both drivers.

The native driver (zygote) and the runc driver (OCI config.json) build the same tree from
these lists, so a hostile-agent test passing on one says something about the other.
"""

from __future__ import annotations

from dsec.image.compose import OVERLAY_FLAGS

__all__ = [
    "DEFAULT_ENV",
    "DEVICES",
    "MASKED_DIRS",
    "MASKED_FILES",
    "READONLY_PATHS",
    "SHM_BYTES",
    "build_env",
    "overlay_options",
]

# (name under /dev, major, minor, mode) - the OCI "default devices".
DEVICES: tuple[tuple[str, int, int, int], ...] = (
    ("null", 1, 3, 0o666),
    ("zero", 1, 5, 0o666),
    ("full", 1, 7, 0o666),
    ("random", 1, 8, 0o666),
    ("urandom", 1, 9, 0o666),
    ("tty", 5, 0, 0o666),
)
# Files that leak host memory, keys or kernel internals: /dev/null is bind-mounted on them.
MASKED_FILES: tuple[str, ...] = (
    "/proc/kcore", "/proc/kpagecgroup", "/proc/kpageflags", "/proc/kpagecount",
    "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/latency_stats",
    "/proc/timer_stats", "/proc/interrupts",
)
# Directories hidden under an empty read-only tmpfs.
MASKED_DIRS: tuple[str, ...] = ("/proc/acpi", "/proc/scsi", "/sys/firmware",
                                "/sys/devices/virtual/powercap")
# Kernel knobs kept visible but read-only (sysrq-trigger can crash or reboot the host).
READONLY_PATHS: tuple[str, ...] = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq",
                                   "/proc/bus", "/proc/fs", "/proc/asound")
SHM_BYTES = 64 << 20

DEFAULT_ENV: dict[str, str] = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "TERM": "xterm",
    "LANG": "C.UTF-8",
}


def build_env(hostname: str, *layers: dict[str, str]) -> list[str]:
    """``KEY=VALUE`` list: defaults, then each layer (spec env, request env) overriding."""
    env = dict(DEFAULT_ENV)
    env["HOSTNAME"] = hostname
    for layer in layers:
        env.update(layer)
    return [f"{k}={v}" for k, v in env.items()]


def overlay_options(lowerdirs: tuple[str, ...] | list[str], upper: str, work: str) -> str:
    """overlayfs mount data. ``:`` separates lowerdirs and ``,`` options, so paths holding
    them (or longer than the one-page option limit) are refused with the reason."""
    for p in (*lowerdirs, upper, work):
        if ":" in p or "," in p or "\n" in p:
            raise ValueError(f"overlay path {p!r} contains ':' or ',': use plain paths")
    data = (f"lowerdir={':'.join(lowerdirs)},upperdir={upper},workdir={work},"
            + ",".join(OVERLAY_FLAGS))
    if len(data) >= 4096:
        raise ValueError(f"overlay options are {len(data)} bytes (limit 4095): use shorter "
                         f"layer paths or fewer layers ({len(lowerdirs)} given)")
    return data

