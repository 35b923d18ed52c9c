"""Records that describe a sandbox and the operations on it.

These are msgspec structs so the same type travels over Aether (msgpack), over REST
(JSON) and is persisted in the edge state dir, without a second schema to keep in sync.
Units are in the field names; ``None`` means "none/unlimited", never 0 or -1.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

import msgspec

from dsec.errors import InvalidArgument, PayloadTooLarge
from dsec.wire.netpolicy import (
    MAX_NET_CONNECTIONS,
    MAX_NET_DOMAIN_BYTES,
    MAX_NET_DOMAIN_PORTS,
    MAX_NET_ENTRY_CHARS,
    MAX_NET_LABEL_BYTES,
    MAX_NET_RATE_MBIT,
    MAX_NET_RULES,
    NetworkPolicy,
)

__all__ = [
    "BACKEND_ISOLATION",
    "CALLER_DSEC_LABELS",
    "DEFAULT_CPU_MILLI",
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_PIDS_MAX",
    "FILE_CHUNK_BYTES",
    "MAX_ARGV_BYTES",
    "MAX_ARGV_ITEMS",
    "MAX_ARG_BYTES",
    "MAX_BATCH_ITEMS",
    "MAX_CPU_MILLI",
    "MAX_CWD_BYTES",
    "MAX_DISK_BYTES",
    "MAX_ENV_ITEMS",
    "MAX_EXEC_TIMEOUT_S",
    "MAX_FILE_MODE",
    "MAX_FILE_READ_BYTES",
    "MAX_IDEMPOTENCY_KEY_CHARS",
    "MAX_ID_CHARS",
    "MAX_LABELS",
    "MAX_LABEL_KEY_CHARS",
    "MAX_LABEL_VALUE_CHARS",
    "MAX_MEMORY_BYTES",
    "MAX_NET_CONNECTIONS",
    "MAX_NET_DOMAIN_BYTES",
    "MAX_NET_DOMAIN_PORTS",
    "MAX_NET_ENTRY_CHARS",
    "MAX_NET_LABEL_BYTES",
    "MAX_NET_RATE_MBIT",
    "MAX_NET_RULES",
    "MAX_OUTPUT_CAP_BYTES",
    "MAX_PATH_BYTES",
    "MAX_PIDS",
    "MAX_PRIORITY",
    "MAX_REASON_CHARS",
    "MAX_REF_CHARS",
    "MAX_SPEC_ENV_BYTES",
    "MAX_STDIN_BYTES",
    "MAX_STRIP_PATTERNS",
    "MAX_STRIP_PATTERN_CHARS",
    "MAX_TOOLKITS",
    "MAX_TTL_S",
    "MAX_USER_BYTES",
    "MIN_PRIORITY",
    "PAUSED_RETENTION_S",
    "QUOTA_TIER",
    "RESERVED_LABEL_DOMAIN",
    "TIER_BACKENDS",
    "TIMEOUT_EXIT_CODE",
    "BackendName",
    "ExecChunk",
    "ExecRequest",
    "ExecResult",
    "FileInfo",
    "FileType",
    "IdleAction",
    "Isolation",
    "NetworkPolicy",
    "NetworkView",
    "PauseStats",
    "QosClass",
    "SandboxEvent",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxState",
    "SandboxStats",
    "SnapshotInfo",
    "backend_for",
    "backend_of",
    "check_batch",
    "check_id",
    "check_idempotency_key",
    "check_isolation",
    "check_label_filter",
    "check_mode",
    "check_path",
    "check_project_path",
    "check_read_range",
    "check_reason",
    "check_snapshot_ref",
    "check_strip",
    "isolation_of",
    "not_offered",
    "project_of",
    "qos_of",
    "quota_tier",
    "read_in_chunks",
    "reserved_label",
    "resolve",
    "stored",
]

SandboxState = Literal[
    "creating", "running", "pausing", "paused", "resuming", "destroying", "destroyed", "failed"
]
BackendName = Literal["simulated", "fncall", "container", "runc", "gvisor", "vm"]
#: Isolation tiers (issue 21, docs/isolation.md): what stands between a sandbox and the
#: host kernel. "container": namespaces + cgroups + seccomp on the host kernel (native or
#: runc); "gvisor": the same, with gVisor's user-space kernel (runsc) answering the
#: sandbox's syscalls; "vm": a microVM (QEMU) with its own guest kernel. A tier IS a
#: backend (a node offers it by running that backend): see :data:`TIER_BACKENDS`.
Isolation = Literal["container", "gvisor", "vm"]
#: The backend a tier asks for when the create names no backend (and the serving side's
#: default backend is not of that tier: :func:`resolve`).
TIER_BACKENDS: dict[Isolation, BackendName] = {
    "container": "container", "gvisor": "gvisor", "vm": "vm"}
#: The tier each backend gives. ``simulated`` stands in for a container (no real
#: isolation: it is the test and benchmark backend, and a cluster of simulated nodes
#: answers ``isolation="container"``); ``runc`` is the container tier through Debian's
#: runc. ``fncall`` is in no tier (a jailed function call, not a sandbox with a root
#: filesystem): a create asking for a tier never lands on it; tier quotas count it in
#: the container tier (:data:`QUOTA_TIER`).
BACKEND_ISOLATION: dict[BackendName, Isolation] = {
    "simulated": "container", "container": "container", "runc": "container",
    "gvisor": "gvisor", "vm": "vm"}
#: The tier each backend is COUNTED in by tier quotas (``Quota.tiers``): its own tier, and
#: for a backend in no tier (``fncall``: a jailed process on the host kernel, no more
#: than the container tier gives) the container tier, the weakest. So a project whose
#: quota forbids the container tier ("microVMs only") is refused fncall too (red team 21,
#: B6). Total over :data:`BackendName` (tests/wire check it); :func:`quota_tier` also
#: counts a name it does not know as the container tier.
QUOTA_TIER: dict[BackendName, Isolation] = {**BACKEND_ISOLATION, "fncall": "container"}
IdleAction = Literal["destroy", "pause"]
#: A sandbox's QoS class (issue 22, dsec.edge.qos): latency-sensitive or best-effort
QosClass = Literal["ls", "be"]

# What a sandbox gets when its create names no size: one core, 512 MiB, 1024 tasks (a
# fork-bomb guard). The spec's defaults, the API's create body, the registry's record,
# the SDK's and the CLI's keywords all say these, never their own numbers.
DEFAULT_CPU_MILLI = 1000
DEFAULT_MEMORY_BYTES = 512 * 2**20
DEFAULT_PIDS_MAX = 1024

# Sanity ceilings: a spec above these is a typo (e.g. bytes given as KiB), not a request.
MAX_CPU_MILLI = 1024 * 1000          # 1024 cores
MAX_MEMORY_BYTES = 16 * 2**40         # 16 TiB
MAX_DISK_BYTES = 1024 * 2**40         # 1 PiB
MAX_TTL_S = 30 * 24 * 3600.0          # 30 days
# How long an edge keeps a paused sandbox (from its pause) unless configured otherwise
# (NodeConfig.paused_retention_s, ``dsec edge --paused-retention``): then it is destroyed
# with reason "paused_retention" (red team 19, B4; E2B bounds paused sandboxes too).
PAUSED_RETENTION_S = 7 * 24 * 3600.0  # 7 days
MAX_PIDS = 4_194_304                  # the kernel's pid_max ceiling (PID_MAX_LIMIT)

# Exec and file limits: one set of rules whatever the door (REST, the Aether gateway, the
# edge itself). ExecRequest checks them whenever one is made (__post_init__: built,
# replaced or decoded); the request types of the file API call check_path the same way
# (dsec.wire.calls), and the edge checks again for its in-process callers.
# Linux refuses an execve whose argv+envp exceed ARG_MAX (2 MiB with the default 8 MiB
# stack) and any single string over MAX_ARG_STRLEN (32 pages = 128 KiB, NUL included);
# we refuse earlier with a clear error instead of an opaque E2BIG (exit 126) inside.
MAX_ARGV_BYTES = 1 << 20              # argv (or shell) + env, UTF-8, with separators
MAX_ARG_BYTES = (128 << 10) - 1       # one argv/env string (MAX_ARG_STRLEN minus its NUL)
MAX_ARGV_ITEMS = 65_536               # argv entries
MAX_ENV_ITEMS = 65_536                # environment entries
MAX_STDIN_BYTES = 8 << 20             # larger inputs: write a file first
MAX_CWD_BYTES = 4096                  # PATH_MAX
MAX_USER_BYTES = 256                  # a user name or numeric uid[:gid]
MAX_EXEC_TIMEOUT_S = 7 * 24 * 3600.0  # a command timeout; null = none
MAX_OUTPUT_CAP_BYTES = 1 << 30        # captured output per stream
MAX_PATH_BYTES = 4096                 # PATH_MAX, for the file API
# File contents cross the Aether links (SDK <-> gateway, apiserver <-> edge) in pieces of
# FILE_CHUNK_BYTES, well inside a 16 MiB frame, so the size a door accepts is the size
# that arrives; one read answers at most MAX_FILE_READ_BYTES (pass offset/length for
# more). Cost: one extra round trip per 8 MiB; nothing for files below it.
FILE_CHUNK_BYTES = 8 << 20
MAX_FILE_READ_BYTES = 64 << 20
MAX_FILE_MODE = 0o7777                # permission bits a write may set
# Items in one batched request (create_many, exec_many, destroy_many): a wire sanity
# bound; the apiserver's own caps (ApiConfig.max_create_batch, ...) are policy, lower.
MAX_BATCH_ITEMS = 100_000
MAX_IDEMPOTENCY_KEY_CHARS = 255
# An id in a request (sandbox, snapshot, session, key): it is a REST path segment, so it
# never holds '/' (a %2F in it used to route the request to another operation).
MAX_ID_CHARS = 255
# A sandbox's own environment rides along with every exec's argv+env: capped at half an
# exec's budget so the two together stay under the kernel's ARG_MAX (2 MiB). Before, a
# 2 MiB spec env was accepted by every door and then every exec failed with E2BIG.
MAX_SPEC_ENV_BYTES = MAX_ARGV_BYTES // 2
MAX_LABELS = 64                       # labels per sandbox (listings filter on them)
MAX_LABEL_KEY_CHARS = 253
MAX_LABEL_VALUE_CHARS = 1024
# Label keys in dsec's own domains (``dsec.io/...``, ``<anything>.dsec.io/...``) are the
# platform's: a caller may not set them on a create, at any door (this type's
# ``validate`` is what every door decodes through), because the platform trusts what
# they say. Before, any member's ``build.dsec.io/step`` label forged an image build's
# step-cache entry (red team 15, F7); the step key now rides in the dedicated field
# ``SandboxSpec.build_step``. The exceptions are labels the platform never trusts on
# their word: ``dsec.io/session`` (the apiserver checks it names a live session of the
# caller's), ``dsec.io/build`` (display only) and ``dsec.io/build-run`` (a builder's own
# random token to find its build sandbox after an interrupted create), and
# ``e2b.dsec.io/auto-resume`` (E2B's ``auto_resume=False``: it only makes the E2B layer
# refuse to resume the sandbox on a command or a write, docs/e2b.md).
RESERVED_LABEL_DOMAIN = "dsec.io"
CALLER_DSEC_LABELS = frozenset({"dsec.io/session", "dsec.io/build", "dsec.io/build-run",
                                "e2b.dsec.io/auto-resume"})
_BUILD_STEP = re.compile(r"^[0-9a-f]{64}$")


def reserved_label(key: str) -> bool:
    """Whether a caller may not set label ``key`` (see :data:`RESERVED_LABEL_DOMAIN`). Pure;
    case-insensitive in the domain, as DNS names are."""
    if key in CALLER_DSEC_LABELS or "/" not in key:
        return False
    domain = key.split("/", 1)[0].lower().rstrip(".")
    return domain == RESERVED_LABEL_DOMAIN or domain.endswith("." + RESERVED_LABEL_DOMAIN)
# Preemption priority: a 32-bit int at every door (REST's single create said so first;
# the batch, gateway and edge doors took any 64-bit value).
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1
# Layer refs (image, workspace, each toolkit, snapshot): ``[project/]name[:tag]`` or a
# digest, the length ``ImageTagRequest`` allows. Toolkits per sandbox: each is a layer of
# the sandbox's overlay stack (the kernel's overlayfs takes ~500 lower dirs); 400,000
# refs held the apiserver's loop ~3 s resolving them (red team, issue 13).
MAX_REF_CHARS = 1200
MAX_TOOLKITS = 64
# Path patterns a snapshot leaves out; a destroy's reason (it goes into the last event).
MAX_STRIP_PATTERNS = 256
MAX_STRIP_PATTERN_CHARS = 1024
MAX_REASON_CHARS = 1024


def _bad_exec(field: str, why: str, **detail: object) -> InvalidArgument:
    return InvalidArgument(f"exec {field} {why}", field=field, **detail)


def _arg_name(field: str | int) -> str:
    return f"argv[{field}]" if isinstance(field, int) else field


def _utf8_len(text: str, field: str | int) -> int:
    """UTF-8 length of ``text``; NUL (which would silently cut the string at execve)
    and unencodable text (lone surrogates) are refused naming ``field`` (an int is an
    argv index)."""
    if "\0" in text:
        raise _bad_exec(_arg_name(field), "contains a NUL character; strings passed to a "
                        "program cannot")
    try:
        return len(text.encode())
    except UnicodeEncodeError:
        raise _bad_exec(_arg_name(field), "is not valid Unicode text (a lone "
                        "surrogate)") from None


def _encodes(text: str) -> bool:
    """``text`` is valid Unicode (no lone surrogate), so it encodes as UTF-8."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


_FILE_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[0-9]{1,10})?$")


def check_file_user(user: object) -> str | None:
    """Validate the ``user`` of a file call (the sandbox user it runs as: a name or uid,
    optionally ``:gid``; None: the edge's own identity, root). Returns ``user``."""
    if user is None:
        return None
    if not isinstance(user, str) or not _FILE_USER.match(user):
        raise InvalidArgument(f"user {str(user)[:40]!r} is not a user name or uid[:gid] "
                              "(letters, digits, '_', '.', '-'; at most 32)", field="user")
    return user


def check_path(path: object, *, field: str = "path") -> str:
    """Validate a path of the file API (read, write, list, stat, mkdir, remove): a
    non-empty string of at most ``MAX_PATH_BYTES`` UTF-8 bytes without NUL. The error
    never echoes more than 60 characters of it. Returns ``path``."""
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"{field} must be a non-empty string (a path inside the "
                              "sandbox)", field=field)
    n = len(path) if len(path) > MAX_PATH_BYTES else None
    if n is None:
        try:
            n = len(path.encode())
        except UnicodeEncodeError:
            raise InvalidArgument(f"{field} {path[:60]!r} is not valid Unicode text",
                                  field=field) from None
    if n > MAX_PATH_BYTES:
        raise InvalidArgument(f"{field} is {n} bytes long, over the {MAX_PATH_BYTES}-byte "
                              f"limit (PATH_MAX): {path[:60]!r}...", field=field, size=n,
                              limit=MAX_PATH_BYTES)
    if "\0" in path:
        raise InvalidArgument(f"{field} {path[:60]!r} contains a NUL character",
                              field=field)
    return path


def check_project_path(project: object, *, field: str = "project") -> str:
    """A project path (``org/team/exp1``: 1..16 lowercase names, ``/``-separated), in the
    words every door uses (:func:`dsec.ids.parse_project_path`, the one rule): the API
    doors, the edge and the spec's :meth:`SandboxSpec.validate`. Returns ``project``."""
    from dsec.ids import parse_project_path

    if not isinstance(project, str):
        raise InvalidArgument(f"invalid project path {project!r}: use '/'-separated "
                              "lowercase names like 'org/team/exp1'", field=field)
    try:
        return parse_project_path(project)
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message, field=field) from None


def check_read_range(offset: int, length: int | None) -> None:
    """A file read's ``offset`` and ``length`` (None: to the end) are not negative, and
    ``length`` asks for at most ``MAX_FILE_READ_BYTES`` (the edge used to take a larger
    one that the API doors refused)."""
    if offset < 0 or (length is not None and length < 0):
        raise InvalidArgument(f"read_file offset={offset} length={length} must be >= 0",
                              field="offset" if offset < 0 else "length")
    if length is not None and length > MAX_FILE_READ_BYTES:
        raise PayloadTooLarge(f"read of {length} bytes asked, the limit is "
                              f"{MAX_FILE_READ_BYTES}; pass offset/length to read in parts",
                              field="length", size=length, limit=MAX_FILE_READ_BYTES)


def check_snapshot_ref(ref: object, *, field: str = "id") -> str:
    """A snapshot ref: ``sha256:`` and 12..64 lowercase hex digits (a full id or a unique
    prefix; ``dsec.wire.api.SNAPSHOT_PATTERN`` in the OpenAPI schema). The edge and the
    apiserver refuse a bad one in these words; the error never echoes more than 80
    characters of it. Returns ``ref``."""
    if (not isinstance(ref, str) or not ref.startswith("sha256:") or not 19 <= len(ref) <= 71
            or not all(c in "0123456789abcdef" for c in ref[7:])):
        raise InvalidArgument(f"invalid snapshot id {str(ref)[:80]!r}: expected 'sha256:' "
                              "and 12-64 lowercase hex digits", field=field)
    return ref


def check_mode(mode: int) -> None:
    """A file mode is permission bits only (0..0o7777)."""
    if not 0 <= mode <= MAX_FILE_MODE:
        raise InvalidArgument(f"write_file mode={mode:o} must be within 0..0o7777",
                              field="mode", limit=MAX_FILE_MODE)


def check_batch(n: int, field: str) -> None:
    """A batch of ``n`` items is within :data:`MAX_BATCH_ITEMS`."""
    if n > MAX_BATCH_ITEMS:
        raise InvalidArgument(f"a batch of {n} {field} is over the limit of "
                              f"{MAX_BATCH_ITEMS} items per request; split it", field=field,
                              size=n, limit=MAX_BATCH_ITEMS)


def check_label_filter(labels: dict[str, str], *, field: str = "labels") -> None:
    """A listing's label filter: at most :data:`MAX_LABELS` pairs (no sandbox has more),
    each within a label's own limits. The gateway took 100,000 (REST: what the header
    cap let through)."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"{field} filter has {len(labels)} pairs, over the limit of "
                              f"{MAX_LABELS} (a sandbox has at most that many labels)",
                              field=field, size=len(labels), limit=MAX_LABELS)
    for k, v in labels.items():
        if len(k) > MAX_LABEL_KEY_CHARS or len(v) > MAX_LABEL_VALUE_CHARS:
            raise InvalidArgument(f"{field} filter {k[:40]!r}: keys are up to "
                                  f"{MAX_LABEL_KEY_CHARS} chars, values up to "
                                  f"{MAX_LABEL_VALUE_CHARS}", field=field,
                                  limit=MAX_LABEL_KEY_CHARS if len(k) > MAX_LABEL_KEY_CHARS
                                  else MAX_LABEL_VALUE_CHARS)


def check_strip(strip: list[str] | tuple[str, ...]) -> None:
    """A snapshot's ``strip`` patterns: at most :data:`MAX_STRIP_PATTERNS` non-empty glob
    patterns of at most :data:`MAX_STRIP_PATTERN_CHARS` without NUL (the edge's rule,
    now the request type's at every door)."""
    if len(strip) > MAX_STRIP_PATTERNS:
        raise InvalidArgument(f"snapshot strip has {len(strip)} patterns; at most "
                              f"{MAX_STRIP_PATTERNS}", field="strip", size=len(strip),
                              limit=MAX_STRIP_PATTERNS)
    for p in strip:
        if not isinstance(p, str) or not p or len(p) > MAX_STRIP_PATTERN_CHARS or "\0" in p:
            raise InvalidArgument(f"snapshot strip pattern {str(p)[:60]!r} must be a "
                                  f"non-empty glob of at most {MAX_STRIP_PATTERN_CHARS} "
                                  "chars without NUL", field="strip",
                                  limit=MAX_STRIP_PATTERN_CHARS)


def check_reason(reason: str, field: str = "reason") -> None:
    """A destroy's reason or detail: at most :data:`MAX_REASON_CHARS` characters."""
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidArgument(f"{field} is {len(reason)} characters, over the limit of "
                              f"{MAX_REASON_CHARS}", field=field, size=len(reason),
                              limit=MAX_REASON_CHARS)


def check_id(value: str, field: str = "id") -> None:
    """An id a request names (it travels as one REST path segment): 1..MAX_ID_CHARS
    printable characters, no '/'. Ids the platform makes (``sb-<hex>-<node>``,
    ``sha256:<hex>``, ``ses-<hex>``) always are; anything else is no id of ours."""
    if (not value or len(value) > MAX_ID_CHARS or "/" in value
            or not value.isprintable()):
        raise InvalidArgument(f"invalid {field} {value[:60]!r}: an id is 1..{MAX_ID_CHARS} "
                              "printable characters without '/'", field=field,
                              limit=MAX_ID_CHARS)


def check_idempotency_key(key: str | None) -> None:
    """An idempotency key is 1..255 printable ASCII characters (it travels as an HTTP
    header, ``Idempotency-Key``)."""
    if key is not None and (not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS
                            or not key.isascii() or not key.isprintable()):
        raise InvalidArgument("idempotency_key must be 1..255 printable ASCII characters",
                              field="idempotency_key", limit=MAX_IDEMPOTENCY_KEY_CHARS)


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True,
                  forbid_unknown_fields=True):
    """What a caller asks for. Validated by :meth:`validate` at every trust boundary (not
    on decode: it is also stored, and a tightened limit must not make old state
    unreadable). A field this release does not know is refused by name, never dropped
    (say a newer network rule: running without it would be a hole)."""

    image: str = "base"                     # image ref: name[:tag] or sha256:<digest>
    workspace: str | None = None            # optional workspace layer ref
    toolkits: tuple[str, ...] = ()          # toolkit layer refs, later ones win
    snapshot: str | None = None             # start from a pack_diff snapshot instead
    # None: whoever serves the create decides (the apiserver: its default backend; an
    # edge reached directly: its own default). Stored specs are always resolved
    # (:func:`resolve`), so ``info.spec.backend`` is set.
    backend: BackendName | None = None
    # The isolation tier (:data:`Isolation`). None: whatever ``backend`` gives (the
    # default backend's when both are None). Given alone it picks the backend
    # (:func:`resolve`); given with ``backend`` the two must agree (:meth:`validate`).
    # Stored specs are resolved: ``info.spec.isolation`` is the tier the sandbox runs in
    # (None only for a backend in no tier, fncall; see :func:`isolation_of`).
    isolation: Isolation | None = None
    cpu_milli: int = DEFAULT_CPU_MILLI      # millicores (1000 = one core)
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    disk_bytes: int | None = None           # upper-layer size cap; None = the node's default
    pids_max: int | None = DEFAULT_PIDS_MAX  # fork-bomb guard; None = no cap
    priority: int = 0                       # higher wins preemption
    labels: dict[str, str] = {}
    # None: the API key's default project; at an edge reached directly, "default"
    project: str | None = None
    # lifetime from creation. None: no lifetime asked; the apiserver's policy gives such a
    # sandbox its default TTL (6 h, per-project override), an edge keeps it forever
    ttl_s: float | None = None
    # what the TTL does when it runs out: "destroy", or "pause" (E2B's autoPause; a
    # sandbox its TTL paused gets its whole ttl_s again when it resumes)
    ttl_action: IdleAction = "destroy"
    idle_timeout_s: float | None = None     # no operation for this long -> idle_action
    idle_action: IdleAction = "destroy"
    env: dict[str, str] = {}
    # egress (dsec.wire.netpolicy); None: the serving side's default (the apiserver's
    # --net-default, an edge reached directly: NodeConfig.net_default), which the edge
    # stores resolved
    network: NetworkPolicy | None = None
    allow_nested: bool = False              # permit unshare/clone namespace flags inside
    user_namespace: bool = False            # root inside = unprivileged uid on the host
    # Defaults of every exec (an exec's own cwd/user win). None: the image config's
    # WorkingDir/User (filled in by the control plane at create), else "/" and root.
    cwd: str | None = None
    user: str | None = None
    # An image build step's cache key (dsec.image.build.step_key, 64 hex): the edge
    # writes it into the snapshot layer's manifest beside the stack the sandbox really
    # ran on, which a builder checks on a cache hit (never a label: see reserved_label).
    build_step: str | None = None
    # QoS (issue 22, docs/container.md "QoS classes"): "ls" latency-sensitive, "be"
    # best-effort (SCHED_IDLE, lowest CPU weight, reclaimed first). None: the serving
    # side decides (the apiserver: "ls" unless the project's quota says qos_ls=false,
    # then "be"; an edge reached directly: "ls"); see :func:`qos_of`.
    qos: QosClass | None = None
    # The CPU cap in millicores (cpu.cfs_quota_us / cpu.max); None: capped at cpu_milli.
    # Above cpu_milli lets a sandbox burst into idle CPU while its weight stays its request.
    cpu_quota_milli: int | None = None

    def validate(self) -> SandboxSpec:
        """Raise :class:`InvalidArgument` naming the field and the fix; return the spec,
        with its network policy in canonical form (self when it already was)."""
        def bad(field: str, value: object, why: str, **limit: object) -> InvalidArgument:
            return InvalidArgument(f"sandbox spec field {field}={value!r} is invalid: {why}",
                                   field=field, **limit)
        if self.isolation is not None:
            check_isolation(self.isolation, self.backend)
        if not (1 <= self.cpu_milli <= MAX_CPU_MILLI):
            raise bad("cpu_milli", self.cpu_milli, f"use 1..{MAX_CPU_MILLI} millicores",
                      limit=MAX_CPU_MILLI)
        if self.qos is not None and self.qos not in ("ls", "be"):
            raise bad("qos", self.qos, 'use "ls" (latency-sensitive) or "be" (best-effort)')
        if self.cpu_quota_milli is not None and not (
                1 <= self.cpu_quota_milli <= MAX_CPU_MILLI):
            raise bad("cpu_quota_milli", self.cpu_quota_milli,
                      f"use 1..{MAX_CPU_MILLI} millicores or null (capped at cpu_milli)",
                      limit=MAX_CPU_MILLI)
        if not (1 << 20 <= self.memory_bytes <= MAX_MEMORY_BYTES):
            raise bad("memory_bytes", self.memory_bytes, "use 1 MiB..16 TiB (bytes)",
                      limit=MAX_MEMORY_BYTES)
        if self.disk_bytes is not None and not (1 << 20 <= self.disk_bytes <= MAX_DISK_BYTES):
            raise bad("disk_bytes", self.disk_bytes, "use 1 MiB..1 PiB (bytes) or null",
                      limit=MAX_DISK_BYTES)
        if self.pids_max is not None and not (1 <= self.pids_max <= MAX_PIDS):
            raise bad("pids_max", self.pids_max, f"use 1..{MAX_PIDS} or null", limit=MAX_PIDS)
        for name in ("ttl_action", "idle_action"):
            if getattr(self, name) not in ("destroy", "pause"):
                raise bad(name, getattr(self, name), 'use "destroy" or "pause"')
        for name in ("ttl_s", "idle_timeout_s"):
            v = getattr(self, name)
            if v is not None and not (0 < v <= MAX_TTL_S):
                raise bad(name, v, "use a positive number of seconds up to 30 days, or null",
                          limit=MAX_TTL_S)
        if not (MIN_PRIORITY <= self.priority <= MAX_PRIORITY):
            raise bad("priority", self.priority,
                      f"use {MIN_PRIORITY}..{MAX_PRIORITY} (a 32-bit integer)",
                      limit=MAX_PRIORITY)
        if not self.image:
            raise bad("image", self.image, "name an image")
        for name, ref in (("image", self.image), ("workspace", self.workspace),
                          ("snapshot", self.snapshot)):
            if ref is not None and len(ref) > MAX_REF_CHARS:
                raise bad(name, ref[:60] + "...", f"a ref is at most {MAX_REF_CHARS} "
                          "characters", size=len(ref), limit=MAX_REF_CHARS)
        if len(self.toolkits) > MAX_TOOLKITS:
            raise InvalidArgument(f"sandbox spec field toolkits has {len(self.toolkits)} "
                                  f"entries, over the limit of {MAX_TOOLKITS}",
                                  field="toolkits", size=len(self.toolkits),
                                  limit=MAX_TOOLKITS)
        for ref in self.toolkits:
            if not ref or len(ref) > MAX_REF_CHARS:
                raise bad("toolkits", ref[:60], f"a toolkit ref is 1..{MAX_REF_CHARS} "
                          "characters", size=len(ref), limit=MAX_REF_CHARS)
        if self.project is not None:
            check_project_path(self.project)
        if not isinstance(self.user_namespace, bool):
            raise bad("user_namespace", self.user_namespace, "use true or false")
        if len(self.env) > MAX_ENV_ITEMS:
            raise InvalidArgument(f"sandbox spec field env has {len(self.env)} entries, over "
                                  f"the limit of {MAX_ENV_ITEMS}", field="env",
                                  size=len(self.env), limit=MAX_ENV_ITEMS)
        total = 0
        for k, v in self.env.items():
            if not k or "=" in k or "\0" in k:
                raise bad("env", k[:60], "environment names must be non-empty without '=' "
                          "or NUL")
            if "\0" in v:
                raise bad("env", k[:60], "environment values cannot hold NUL")
            total += len(k.encode("utf-8", "surrogatepass")) + len(
                v.encode("utf-8", "surrogatepass")) + 2
        if total > MAX_SPEC_ENV_BYTES:
            raise InvalidArgument(
                f"sandbox spec field env is {total} bytes, over the {MAX_SPEC_ENV_BYTES}-byte "
                "limit (it is passed to every exec beside the exec's own argv and env, under "
                "the kernel's 2 MiB ARG_MAX); put large settings in a file",
                field="env", size=total, limit=MAX_SPEC_ENV_BYTES)
        if self.cwd is not None and (not self.cwd.startswith("/") or "\0" in self.cwd
                                     or not 0 < len(self.cwd.encode("utf-8", "surrogatepass"))
                                     <= MAX_CWD_BYTES):
            raise bad("cwd", self.cwd[:60], f"use an absolute directory of 1..{MAX_CWD_BYTES} "
                      "bytes without NUL", limit=MAX_CWD_BYTES)
        if self.user is not None and ("\0" in self.user or not 0 < len(
                self.user.encode("utf-8", "surrogatepass")) <= MAX_USER_BYTES):
            raise bad("user", self.user[:60], f"use a user name or uid[:gid] of "
                      f"1..{MAX_USER_BYTES} bytes", limit=MAX_USER_BYTES)
        if len(self.labels) > MAX_LABELS:
            raise InvalidArgument(f"sandbox spec field labels has {len(self.labels)} entries, "
                                  f"over the limit of {MAX_LABELS}", field="labels",
                                  size=len(self.labels), limit=MAX_LABELS)
        for k, v in self.labels.items():
            if not k or len(k) > MAX_LABEL_KEY_CHARS:
                raise bad("labels", k[:40], f"keys are 1..{MAX_LABEL_KEY_CHARS} chars",
                          limit=MAX_LABEL_KEY_CHARS)
            if len(v) > MAX_LABEL_VALUE_CHARS:
                raise bad("labels", k[:40], f"values are up to {MAX_LABEL_VALUE_CHARS} chars",
                          limit=MAX_LABEL_VALUE_CHARS)
            if not k.isprintable() or not v.isprintable():
                # a newline or a terminal escape in a label forges rows in (and writes
                # into) another user's `dsec sandbox ls` (red team 19, B10): refused here,
                # at every door; the CLI escapes what it prints regardless
                raise bad("labels", k[:40], "label keys and values are printable "
                          "text: no newline, tab or other control character")
            if reserved_label(k):
                raise bad("labels", k[:80], f"label keys in the {RESERVED_LABEL_DOMAIN} "
                          "domains are set by the platform only (an image build step's "
                          "key goes in the build_step field); use a key of your own "
                          f"domain (caller-settable: {sorted(CALLER_DSEC_LABELS)})")
        if self.build_step is not None and (not isinstance(self.build_step, str)
                                            or not _BUILD_STEP.match(self.build_step)):
            raise bad("build_step", str(self.build_step)[:80],
                      "an image build step key is 64 lowercase hex (dsec.image.build.step_key)")
        if self.network is not None:
            net = self.network.validate()
            if net is not self.network:
                return msgspec.structs.replace(self, network=net)
        return self

    @property
    def net(self) -> NetworkPolicy:
        """The network policy, ``"none"`` where unresolved (an edge stores resolved
        specs, so backends see the policy the sandbox was created with)."""
        return _NO_NETWORK if self.network is None else self.network


_NO_NETWORK = NetworkPolicy()



# What a stored spec written before ``backend``/``project`` could be left unset meant by
# leaving them out (omit_defaults wrote neither at its old default).
LEGACY_BACKEND: BackendName = "simulated"
LEGACY_PROJECT = "default"


def check_isolation(isolation: object, backend: object = None) -> Isolation:
    """``isolation`` is a tier (:data:`Isolation`) and, when ``backend`` is given, the tier
    that backend gives; raise :class:`InvalidArgument` naming the fix. Pure. Returns it."""
    tier = next((t for t in TIER_BACKENDS if t == isolation), None)
    if tier is None:
        raise InvalidArgument(
            f"sandbox spec field isolation={str(isolation)[:40]!r} is invalid: use one of "
            f"{', '.join(repr(t) for t in TIER_BACKENDS)} (or leave it unset for the default "
            "backend's tier)", field="isolation")
    if backend is not None:
        gives = next((i for b, i in BACKEND_ISOLATION.items() if b == backend), None)
        if gives != tier:
            raise InvalidArgument(
                f"sandbox spec asks for isolation={tier!r} and backend={str(backend)[:40]!r}, "
                f"but that backend gives "
                + (f"isolation {gives!r}" if gives else "no isolation tier")
                + f": leave backend unset (isolation {tier!r} picks backend "
                f"{TIER_BACKENDS[tier]!r}) or drop isolation", field="isolation",
                backend=str(backend)[:40])
    return tier


def backend_for(isolation: Isolation | None, default: BackendName) -> BackendName:
    """The backend a create with no backend runs on: ``default`` when it gives
    ``isolation`` (or no tier is asked), else the tier's own (:data:`TIER_BACKENDS`). So a
    cluster whose default backend is ``runc`` keeps runc for ``isolation="container"``,
    and a simulated test cluster answers it with ``simulated``. Pure."""
    if isolation is None or BACKEND_ISOLATION.get(default) == isolation:
        return default
    return TIER_BACKENDS[isolation]


def resolve(spec: SandboxSpec, *, backend: BackendName, project: str,
            ttl_s: float | None = None,
            network: NetworkPolicy | None = None) -> SandboxSpec:
    """``spec`` with what it leaves to the server filled in: ``backend`` and ``project``
    when None, ``ttl_s`` when None and a default lifetime is given, ``network`` when None
    and a default policy is given. Every other field is the caller's, unchanged. Both
    doors that create (the apiserver, an edge reached directly) resolve through this one
    function, so a stored spec names its backend, project and policy (a later change
    of a default moves nothing already made).

    ``isolation`` and ``backend`` (issue 21): a spec naming a tier but no backend gets
    :func:`backend_for` (the default backend if it gives that tier, else the tier's
    backend); one naming neither gets the default backend; then ``isolation`` is set to
    the tier the backend gives (None for a backend in no tier). A spec naming both must
    already agree (:meth:`SandboxSpec.validate`; resolve does not check)."""
    if spec.backend is not None and spec.project is not None and (
            spec.ttl_s is not None or ttl_s is None) and (
            spec.network is not None or network is None) and (
            spec.isolation is not None or spec.backend not in BACKEND_ISOLATION):
        return spec
    chosen = backend_for(spec.isolation, backend) if spec.backend is None else spec.backend
    return msgspec.structs.replace(
        spec, backend=chosen,
        isolation=spec.isolation if spec.isolation is not None
        else BACKEND_ISOLATION.get(chosen),
        project=project if spec.project is None else spec.project,
        ttl_s=ttl_s if spec.ttl_s is None else spec.ttl_s,
        network=network if spec.network is None else spec.network)


def stored(spec: SandboxSpec) -> SandboxSpec:
    """A spec read back from storage written by any release: resolved, an omitted
    ``backend``/``project`` meaning what it meant when written (:data:`LEGACY_BACKEND`,
    :data:`LEGACY_PROJECT`)."""
    return resolve(spec, backend=LEGACY_BACKEND, project=LEGACY_PROJECT)


def qos_of(spec: SandboxSpec) -> QosClass:
    """The QoS class a sandbox runs in: its spec's, "ls" when it names none."""
    return spec.qos or "ls"


def project_of(spec: SandboxSpec) -> str:
    """The project of a resolved spec (the edge stores only resolved ones)."""
    if spec.project is None:
        from dsec.errors import InternalError
        raise InternalError("a sandbox spec reached storage without a project (it was "
                            "not resolved)")
    return spec.project


def quota_tier(backend: str) -> Isolation:
    """The tier quotas count a sandbox of ``backend`` in (:data:`QUOTA_TIER`): the tier
    it gives, else the container tier (fncall, or any backend in no tier: never outside
    every tier, so a tier quota cannot be walked around by picking such a backend)."""
    for name, tier in QUOTA_TIER.items():
        if name == backend:
            return tier
    return "container"


def isolation_of(spec: SandboxSpec) -> Isolation | None:
    """The isolation tier a sandbox runs in: its spec's, else the tier its backend gives
    (a spec stored before issue 21 names only a backend); None for a backend in no tier
    (fncall) or an unresolved spec that names neither."""
    if spec.isolation is not None:
        return spec.isolation
    return None if spec.backend is None else BACKEND_ISOLATION.get(spec.backend)


def not_offered(spec: SandboxSpec, offered: Iterable[str], where: str) -> InvalidArgument:
    """The error for a resolved ``spec`` whose backend ``where`` (a node, "any node of
    this cluster") does not offer: it names the tier when the backend is one's, what is
    offered (with each backend's tier) and how a node comes to offer it. A request
    problem (400), never a lack of capacity a retry could fix."""
    have = sorted(set(offered))
    listed = ", ".join(f"{b} ({BACKEND_ISOLATION[b]})" if b in BACKEND_ISOLATION else b
                       for b in have) or "nothing"
    tier = isolation_of(spec)
    what = (f"isolation {tier!r} (backend {spec.backend!r})" if tier is not None
            else f"backend {spec.backend!r}")
    return InvalidArgument(
        f"{what} is not offered by {where}; offered: {listed}. A node offers it by running "
        f"that backend (`dsec edge --backend {spec.backend}`"
        + (f", or `dsec up --tiers {tier}`" if tier in ("gvisor", "vm") else "") + ")",
        field="isolation" if tier is not None else "backend",
        backend=str(spec.backend), isolation=tier, offered=have)


def backend_of(spec: SandboxSpec) -> BackendName:
    """The backend of a resolved spec."""
    if spec.backend is None:
        from dsec.errors import InternalError
        raise InternalError("a sandbox spec reached storage without a backend (it was "
                            "not resolved)")
    return spec.backend


MAX_HIDE_ENTRIES = 16
# Processes and terminals (issue 19, dsec.wire.process): a terminal's size in character
# cells (TIOCSWINSZ takes unsigned shorts; no terminal is wider than this), a process
# tag (a caller's label for `processes.list`), one stdin write.
MAX_PTY_CELLS = 1000
MAX_PROCESS_TAG_BYTES = 256
MAX_PROCESS_INPUT_BYTES = 1 << 20


class PtySize(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A terminal's size: ``cols`` x ``rows`` character cells, each within
    1..``MAX_PTY_CELLS``."""

    cols: int = 80
    rows: int = 24

    def __post_init__(self) -> None:
        check_pty_size(self.cols, self.rows)


def check_pty_size(cols: int, rows: int) -> None:
    for name, v in (("cols", cols), ("rows", rows)):
        if not 1 <= v <= MAX_PTY_CELLS:
            raise InvalidArgument(f"pty {name}={v!r} must be within 1..{MAX_PTY_CELLS} "
                                  "character cells", field=name, limit=MAX_PTY_CELLS)


def check_process_tag(tag: str | None) -> None:
    if tag is None:
        return
    n = len(tag.encode("utf-8", "surrogatepass"))
    if not tag or n > MAX_PROCESS_TAG_BYTES or "\0" in tag:
        raise InvalidArgument(f"process tag is {n} bytes; a tag is 1..{MAX_PROCESS_TAG_BYTES} "
                              "bytes of UTF-8 without NUL", field="tag", size=n,
                              limit=MAX_PROCESS_TAG_BYTES)


def _check_hide(hide: tuple[str, ...]) -> None:
    if len(hide) > MAX_HIDE_ENTRIES:
        raise InvalidArgument(f"exec hide has {len(hide)} entries, over the limit of "
                              f"{MAX_HIDE_ENTRIES}", field="hide", size=len(hide),
                              limit=MAX_HIDE_ENTRIES)
    for name in hide:
        if (not name or name in (".", "..") or "/" in name or ":" in name or "\0" in name
                or len(name.encode("utf-8", "surrogatepass")) > 255):
            raise InvalidArgument(f"exec hide entry {name[:60]!r} must be the name of a "
                                  "top-level entry of the sandbox root (no '/', ':' or NUL, "
                                  "not '.' or '..', at most 255 bytes), e.g. '.dsec-judge'",
                                  field="hide")


class ExecRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True,
                  forbid_unknown_fields=True):
    """One command. Exactly one of ``argv`` / ``shell``."""

    argv: tuple[str, ...] = ()
    shell: str | None = None
    env: dict[str, str] = {}
    cwd: str | None = None
    user: str | None = None
    stdin: bytes = b""
    timeout_s: float | None = 60.0          # command timeout; kills the process group
    output_cap_bytes: int = 1 << 20         # per stream; beyond it output is dropped
    background: bool = False                # start and return at once (pid in result)
    # Top-level entries of the sandbox root this command's whole process tree can never
    # reach, whatever its uid (Landlock, applied before execve): e.g. (".dsec-judge",)
    # keeps a judge's or harness's files out of an agent's reach even as root. Needs the
    # container backend's native runtime; refused elsewhere. Issue 18.
    hide: tuple[str, ...] = ()
    # Processes (issue 19, `process_start`; refused by plain exec): run the command on a
    # terminal of this size inside the sandbox (stdin/stdout/stderr are the pty), keep
    # stdin a pipe for `process_input`, and a caller's label shown by `process_list`.
    pty: PtySize | None = None
    stdin_open: bool = False
    tag: str | None = None

    def __post_init__(self) -> None:
        # Runs on construction, msgspec.structs.replace, convert and every decode, so an
        # ExecRequest that exists is within every limit, whichever door it came through.
        # Measured (small argv+env, loaded 2-core VM): the exact check alone 2.8 us, the
        # plain-case test below ~0.6 us; decoding the struct itself costs ~0.4 us.
        if not self._plainly_valid():
            self._check()
        if self.hide:
            _check_hide(self.hide)
        if self.tag is not None:
            check_process_tag(self.tag)

    def validate(self) -> ExecRequest:
        """Return self: an ExecRequest that exists has passed every limit (checked in
        ``__post_init__``). Kept so older callers' ``req.validate()`` still reads right."""
        return self

    def _plainly_valid(self) -> bool:
        """True when every limit obviously holds, False for "check exactly" (:meth:`_check`
        then passes or raises the precise error). Obvious: all the strings together, NUL
        separated, are under a quarter of one argument's limit (UTF-8 takes at most 4
        bytes a character, so every per-string and total size limit holds), hold no NUL
        of their own and encode."""
        argv, shell, env = self.argv, self.shell, self.env
        if shell is None:
            if not argv:
                return False
            parts = [*argv, *env, *env.values()] if env else argv
        elif argv:
            return False
        else:
            parts = [shell, *env, *env.values()] if env else (shell,)
        text = "\0".join(parts)
        if (4 * len(text) > MAX_ARG_BYTES or text.count("\0") != len(parts) - 1
                or not (text.isascii() or _encodes(text))):
            return False
        for k in env:
            if not k or "=" in k:
                return False
        for small in (self.cwd, self.user):   # both far under their limit when obvious
            if small is not None and (not small or 4 * len(small) > MAX_USER_BYTES
                                      or "\0" in small or not _encodes(small)):
                return False
        t = self.timeout_s
        return (len(self.stdin) <= MAX_STDIN_BYTES
                and (t is None or 0 < t <= MAX_EXEC_TIMEOUT_S)
                and 0 <= self.output_cap_bytes <= MAX_OUTPUT_CAP_BYTES)

    def _check(self) -> None:
        """Check every limit (the ``MAX_*`` constants of this module); raise
        :class:`InvalidArgument` naming the field, the size and the limit, without
        echoing a large value. Cost: one pass over the strings."""
        if bool(self.argv) == (self.shell is not None):
            raise InvalidArgument("exec needs exactly one of argv (a non-empty list of "
                                  "strings) or shell (a string)", field="argv")
        if len(self.argv) > MAX_ARGV_ITEMS:
            raise _bad_exec("argv", f"has {len(self.argv)} entries, over the limit of "
                            f"{MAX_ARGV_ITEMS}", size=len(self.argv), limit=MAX_ARGV_ITEMS)
        if len(self.env) > MAX_ENV_ITEMS:
            raise _bad_exec("env", f"has {len(self.env)} entries, over the limit of "
                            f"{MAX_ENV_ITEMS}", size=len(self.env), limit=MAX_ENV_ITEMS)
        total = 0
        strings = self.argv if self.shell is None else (self.shell,)
        for i, text in enumerate(strings):
            n = _utf8_len(text, i if self.shell is None else "shell")
            if n > MAX_ARG_BYTES:
                raise _bad_exec(_arg_name(i if self.shell is None else "shell"),
                                f"is {n} bytes, over the {MAX_ARG_BYTES}-byte limit for one "
                                "argument; pass large data via stdin or a file",
                                size=n, limit=MAX_ARG_BYTES)
            total += n + 1
        for k, v in self.env.items():
            if not k or "=" in k:
                raise _bad_exec("env", f"name {k[:60]!r} is invalid: names are non-empty "
                                "without '='")
            n = _utf8_len(k, "env") + _utf8_len(v, "env") + 1
            if n > MAX_ARG_BYTES:
                raise _bad_exec("env", f"entry {k[:60]!r} is {n} bytes, over the "
                                f"{MAX_ARG_BYTES}-byte limit for one string", size=n,
                                limit=MAX_ARG_BYTES)
            total += n + 1
        if total > MAX_ARGV_BYTES:
            raise InvalidArgument(
                f"exec argv+env is {total} bytes, over the {MAX_ARGV_BYTES}-byte limit; "
                "pass large data via stdin or write it to a file first", field="argv",
                size=total, limit=MAX_ARGV_BYTES)
        if len(self.stdin) > MAX_STDIN_BYTES:
            raise _bad_exec("stdin", f"is {len(self.stdin)} bytes, over the "
                            f"{MAX_STDIN_BYTES}-byte limit; write large inputs to a file "
                            "first", size=len(self.stdin), limit=MAX_STDIN_BYTES)
        if self.cwd is not None:
            n = _utf8_len(self.cwd, "cwd")
            if not 0 < n <= MAX_CWD_BYTES:
                raise _bad_exec("cwd", f"is {n} bytes; use 1..{MAX_CWD_BYTES} bytes (a "
                                f"directory in the sandbox): {self.cwd[:60]!r}", size=n,
                                limit=MAX_CWD_BYTES)
        if self.user is not None:
            n = _utf8_len(self.user, "user")
            if not 0 < n <= MAX_USER_BYTES:
                raise _bad_exec("user", f"is {n} bytes; use 1..{MAX_USER_BYTES} (a user "
                                f"name or uid): {self.user[:60]!r}", size=n,
                                limit=MAX_USER_BYTES)
        if self.timeout_s is not None and not (0 < self.timeout_s <= MAX_EXEC_TIMEOUT_S):
            raise InvalidArgument(
                f"exec timeout_s={self.timeout_s!r} must be a positive number of seconds up "
                f"to {MAX_EXEC_TIMEOUT_S:g} (or null for no command timeout)",
                field="timeout_s", limit=MAX_EXEC_TIMEOUT_S)
        if not (0 <= self.output_cap_bytes <= MAX_OUTPUT_CAP_BYTES):
            raise InvalidArgument(
                f"exec output_cap_bytes={self.output_cap_bytes} must be within "
                f"0..{MAX_OUTPUT_CAP_BYTES} (1 GiB)", field="output_cap_bytes",
                limit=MAX_OUTPUT_CAP_BYTES)


# The exit code of a command killed by its timeout (``timed_out``): 128 + SIGKILL, as a
# shell reports it and as a real process killed so reports it; backends that stand in
# for one (simulated, fncall) answer the same.
TIMEOUT_EXIT_CODE = 128 + 9


class ExecResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a finished command did. ``timed_out`` means the command timeout fired."""

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    pid: int | None = None                  # set for background execs
    # issue 19: the OOM killer killed a process of the sandbox while this command ran (the
    # sandbox's counter moved during it: with concurrent execs, maybe another's process);
    # the sandbox's events carry an "oom_kill" notice as before
    oom_killed: bool = False


class SandboxEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One lifecycle transition: never does a sandbox change state without one."""

    time: float
    sandbox_id: str
    from_state: SandboxState | None
    to_state: SandboxState
    reason: str
    detail: str = ""


class SandboxInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The edge's view of one sandbox, as returned by get/list/create."""

    id: str
    node: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    last_active_at: float
    reason: str = ""                        # reason of the last transition
    # Lifetimes (issue 19, docs/sdk.md "Lifetimes"): when the edge ends it (unix seconds;
    # None: no TTL, or paused), what is left while paused (the clock stops), and why it
    # was paused ("requested", "idle": its idle_timeout_s with idle_action=pause, or
    # "ttl": its TTL with ttl_action=pause).
    expires_at: float | None = None
    ttl_left_s: float | None = None
    paused_reason: str = ""
    # paused: when the edge destroys it if nobody resumes it first (reason
    # "paused_retention", the node's paused_retention_s from the pause; None: never)
    paused_until: float | None = None


class NetworkView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A sandbox's egress policy as its edge enforces it (``network_get``,
    ``network_update``): ``policy`` in canonical form (without the ceilings' denies, which
    are ``ceiling_deny``); ``generation`` moves on every change that took effect (pass it
    as ``expect_generation`` to update only what you read); ``address``: the sandbox's
    IPv4 address (None: mode none, or a node without routed sandbox networking yet);
    ``ipv6``: whether v6 entries are enforced (else v6 is dropped whole);
    ``denied_packets``/``recent_denied``/``pins``: what the node counted."""

    policy: NetworkPolicy
    generation: int = 0
    ceiling_deny: tuple[str, ...] = ()
    address: str | None = None
    ipv6: bool = False
    denied_packets: int = 0
    recent_denied: tuple[str, ...] = ()
    pins: int = 0


class ExecChunk(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a streaming exec's output (Aether STREAM frame body)."""

    stream: Literal["stdout", "stderr"]
    data: bytes


FileType = Literal["file", "dir", "symlink", "other"]


class FileInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    path: str
    type: FileType
    size: int = 0
    mode: int = 0                           # permission bits (st_mode & 0o7777)
    mtime: float = 0.0
    link_target: str | None = None


class PauseStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a pause gave back: ``reclaimed_bytes`` of ``resident_before_bytes``."""

    resident_before_bytes: int = 0
    reclaimed_bytes: int = 0
    duration_s: float = 0.0


class SandboxStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Resource use now. ``disk_bytes`` of ``disk_cap_bytes`` (None: the backend has no
    per-sandbox disk cap); ``disk_full`` says writes are failing for lack of space (the
    cap, or the node's disk pool) - free space inside or recreate with more disk."""

    memory_bytes: int = 0
    memory_peak_bytes: int = 0
    #: of memory_bytes, what tmpfs files hold (/tmp, /dev/shm): no OOM kill frees it, so
    #: near the limit every new process is OOM-killed (notice "tmpfs_full")
    memory_tmpfs_bytes: int = 0
    cpu_seconds: float = 0.0
    pids: int = 0
    disk_bytes: int = 0
    disk_cap_bytes: int | None = None
    disk_full: bool = False
    # issue 19: cpu use in percent of one core over the last ``cpu_interval_s`` seconds
    # (since the previous stats call, or a short sample when there was none: 100 = one
    # core busy); memory_limit_bytes the cgroup's limit; network bytes through the
    # sandbox's own network namespace (None: the backend gives it none); oom_kills: the
    # processes the OOM killer killed in it so far
    cpu_percent: float | None = None
    cpu_interval_s: float | None = None
    memory_limit_bytes: int | None = None
    pids_max: int | None = None
    net_rx_bytes: int | None = None
    net_tx_bytes: int | None = None
    oom_kills: int = 0
    #: dens (issue 22): memory_bytes plus the kernel memory the host spends on the sandbox
    #: outside its memory cgroup (its cgroups, superblocks and the memcg's shrinker map:
    #: an estimate, see docs/container.md "Density"); 0 where the backend does not know
    memory_host_bytes: int = 0
    # QoS (issue 22): the class, and what the sandbox really holds (dsec.edge.qos.
    # MemoryHeld): of memory_bytes, anonymous/RSS, page cache charged to it, and the
    # shared memory (tmpfs files, SysV and POSIX segments) it created; its writable
    # (upper) layer's bytes are disk_bytes
    qos: str = ""
    # issue 21: the isolation tier it runs in ("container", "gvisor", "vm"; "" for a
    # backend in no tier), filled in by the edge whichever backend answered
    isolation: str = ""
    memory_rss_bytes: int = 0
    memory_cache_bytes: int = 0
    memory_shm_bytes: int = 0
    #: issue 22, opt-in memory groups: the memory cgroup this sandbox shares with
    #: ``memory_group_members - 1`` others of its project ("" for its own). Then every
    #: memory_* figure above, and memory_limit_bytes, is the group's
    memory_group: str = ""
    memory_group_members: int = 0


class SnapshotInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A pack_diff snapshot of a sandbox (edge ``snapshot`` capability).

    ``id`` is its layer ref (``sha256:<hex>``); ``parent`` the snapshot it builds on
    (the sandbox's previous snapshot, or the snapshot the sandbox was started from;
    ``None`` when it sits directly on the image). ``unchanged`` says nothing changed since
    ``parent``-or-previous, so this *is* that earlier snapshot and nothing was written.
    ``size_bytes`` is the stored size of this one layer (not of the chain).
    """

    id: str
    parent: str | None = None
    sandbox_id: str = ""
    project: str = "default"
    image: str = ""                         # the image refs the chain applies to
    workspace: str | None = None
    toolkits: tuple[str, ...] = ()
    backend: str = ""
    node: str = ""                          # the node that answered (set by the edge)
    created: float = 0.0                    # unix seconds
    size_bytes: int = 0
    unchanged: bool = False
    build_step: str = ""                    # an image build's step cache key, if any
    # the image layers the snapshot chain applies to (highest first): with ``parent``,
    # what the sandbox really ran on, which a build checks on a cache hit
    stack: tuple[str, ...] = ()


async def read_in_chunks(read: Callable[[int, int], Awaitable[bytes]], offset: int,
                         length: int | None) -> bytes:
    """Read ``length`` bytes from ``offset`` (None: to the end) through ``read(offset, n)``
    calls of at most ``FILE_CHUNK_BYTES``, stopping at the first short piece. More than
    ``MAX_FILE_READ_BYTES`` in all is refused (``PayloadTooLarge``), as one read would be."""
    from dsec.errors import PayloadTooLarge

    if length is not None and length > MAX_FILE_READ_BYTES:
        raise PayloadTooLarge(f"read of {length} bytes asked, the limit is "
                              f"{MAX_FILE_READ_BYTES}; pass offset/length to read in parts",
                              size=length, limit=MAX_FILE_READ_BYTES)
    parts: list[bytes] = []
    total = 0
    while True:
        n = FILE_CHUNK_BYTES if length is None else min(FILE_CHUNK_BYTES, length - total)
        if n <= 0:
            break
        piece = await read(offset + total, n)
        parts.append(piece)
        total += len(piece)
        if len(piece) < n:
            break
        if total > MAX_FILE_READ_BYTES or (length is None and total == MAX_FILE_READ_BYTES
                                           and await read(offset + total, 1)):
            raise PayloadTooLarge(f"the file is larger than the {MAX_FILE_READ_BYTES}-byte "
                                  "limit of one read; pass offset/length to read in parts",
                                  limit=MAX_FILE_READ_BYTES)
    return b"".join(parts)
