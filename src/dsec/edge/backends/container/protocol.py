"""Messages between the container backend and its helper process (the zygote,
``dsec-nsexec serve``, written in C: see nsexec.c).

One SOCK_SEQPACKET socketpair, one message per packet; file descriptors travel alongside
as SCM_RIGHTS (pipes for stdio, pidfds). Every request carries an ``id`` that its replies
repeat, so many creates and execs are in flight at once.

The structs below are what the backend works with; :func:`encode` and
:func:`decode_reply` turn them into the helper's binary format: a fixed header
(``struct req_hdr`` / ``struct rep_hdr`` in nsexec.c) followed by NUL-terminated strings,
which are the helper's own argv for the child it forks - so the C side parses nothing but
a header and a string list. Strings may not contain NUL (refused with ``ValueError``).
"""

from __future__ import annotations

import struct

import msgspec

from dsec.errors import BackendError, CannotRun, DsecError

__all__ = [
    "MAX_REQUEST_BYTES",
    "Create",
    "Created",
    "Exec",
    "Exited",
    "Failed",
    "Helper",
    "Kill",
    "Reply",
    "Request",
    "Running",
    "Started",
    "decode_reply",
    "encode",
    "exec_failure",
    "request_argv",
]


class Create(msgspec.Struct, tag="create", frozen=True):
    """Start a sandbox: new namespaces, overlay root, init as PID 1. fds: none, or with
    ``netns`` the slot's network namespace (joined instead of a new one)."""

    id: int
    lowerdirs: list[str]
    upper: str
    work: str
    root: str
    hostname: str
    cgroup_procs: list[str]
    loopback: bool
    nested: bool
    tmp_bytes: int
    #: (host uid/gid of the sandbox's root, how many ids) for a user namespace; None: none
    userns: tuple[int, int] | None = None
    #: join the network namespace passed as the request's one fd (a router slot)
    netns: bool = False
    #: bind this node-wide read-only sysfs (mounted from an empty network namespace) at
    #: /sys instead of a sysfs of the sandbox's own: one superblock less per sandbox
    #: (docs/container.md, Density). "": its own sysfs.
    sysfs: str = ""
    #: this sandbox's own empty directory (mode 0700) of the node's one scratch tmpfs:
    #: its dev/ and tmp/ become the sandbox's /dev, /dev/shm and /tmp instead of a tmpfs
    #: of its own - one superblock less per sandbox (docs/container.md, Density). "":
    #: a tmpfs of its own.
    scratch: str = ""
    #: no devpts instance at create: the first pty exec mounts the sandbox's own
    #: (nsexec.c ensure_devpts) - one superblock less per sandbox that never asks for a
    #: terminal; never with ``userns`` (its root may not mount then)
    lazy_pts: bool = False
    #: a memory group's member: its ipc namespace's SysV caps, ``(name, value)`` of
    #: kernel.shmmax/shmall/msgmni/sem (density.ipc_caps), written by its PID 1 through
    #: its own fresh /proc before anything of the tenant's runs (nsexec.c write_ipc_caps)
    ipc_caps: tuple[tuple[str, str], ...] = ()


class Exec(msgspec.Struct, tag="exec", frozen=True):
    """Run a process inside a sandbox. fds: [init pidfd, stdin, stdout, stderr]."""

    id: int
    argv: list[str]
    env: list[str]
    cwd: str | None
    user: str | None
    cgroup_procs: list[str]
    nested: bool
    background: bool
    userns: bool = False      # the sandbox has a user namespace: enter it too
    #: index in cgroup_procs of the one the task limit applies to, and the cgroup.procs
    #: the helper came from: at the limit it forks outside and moves the command in
    #: (nsexec.c, spawn_final); -1 / "": no fallback
    pids_index: int = -1
    home_procs: str = ""
    #: top-level names of the sandbox root the command's tree never reaches (Landlock)
    hide: tuple[str, ...] = ()
    #: the id of the request that started this sandbox's exec helper: the zygote hands the
    #: command to it (nsexec.c, forward_exec) instead of forking an intermediate. 0: none
    helper: int = 0
    #: a process of the edge's table (issue 19): Running (host and namespace pids) once
    #: the command runs, or Failed with why it could not start; then Exited
    track: bool = False
    #: (cols, rows): the command on a terminal inside the sandbox; fds[1] (stdin) is then
    #: a socket over which the command's side sends the terminal's master (SCM_RIGHTS)
    pty: tuple[int, int] | None = None


class Helper(msgspec.Struct, tag="helper", frozen=True):
    """Start a sandbox's exec helper (nsexec.c, do_helper): in the sandbox's namespaces
    (pid: for its children only), ``cgroup_procs`` (the sandbox's), capabilities,
    no_new_privs and seccomp, once; then every exec sent with ``helper=id`` is forked from
    it. fds: [init pidfd]. Replies: Started (its host pid), Exited when it is gone."""

    id: int
    cgroup_procs: list[str]


class Kill(msgspec.Struct, tag="kill", frozen=True):
    """SIGKILL a running exec's intermediate and command (by pidfd; a command reported
    later is killed on arrival). The rest of the exec's processes go with its cgroup."""

    id: int


Request = Create | Exec | Kill | Helper


class Created(msgspec.Struct, tag="created", frozen=True):
    """The sandbox's init runs; its pidfd rides along (fds: [pidfd])."""

    id: int
    pid: int


class Started(msgspec.Struct, tag="started", frozen=True):
    id: int
    pid: int
    ns_pid: int


class Running(msgspec.Struct, tag="running", frozen=True):
    """A tracked exec's command runs (its execve succeeded): host and namespace pids."""

    id: int
    pid: int
    ns_pid: int


class Exited(msgspec.Struct, tag="exited", frozen=True):
    id: int
    status: int         # raw wait status
    #: host pid of the command; 0 when the intermediate died before it forked the command
    #: (it failed, with its reason on stderr, or was killed)
    pid: int = 0


class Failed(msgspec.Struct, tag="failed", frozen=True):
    id: int
    message: str
    errno: int = 0


Reply = Created | Started | Exited | Failed | Running

#: The largest request the helper takes: its receive buffer (``buf`` in nsexec.c's
#: ``do_serve``). The edge sizes its socket's send buffer to carry one this big and
#: refuses bigger ones with ValueError (an exec's argv + env beyond Linux's ARG_MAX,
#: 2 MiB here, fails at execve anyway, with "Argument list too long").
MAX_REQUEST_BYTES = 4 << 20

# struct req_hdr { uint32_t type, flags; uint64_t id; }
_REQ = struct.Struct("=IIQ")
# struct rep_hdr { uint32_t type; int32_t pid; uint64_t id; int32_t ns_pid, status, err;
#                  uint32_t len; }  (natural alignment: no padding with these sizes)
_REP = struct.Struct("=iiQiiiI")
REQ_CREATE, REQ_EXEC, REQ_KILL, REQ_HELPER = 1, 2, 3, 4
REP_CREATED, REP_STARTED, REP_EXITED, REP_FAILED, REP_RUNNING = 1, 2, 3, 4, 5
F_BACKGROUND, F_NESTED, F_USERNS, F_NETNS, F_HELPER = 1, 2, 4, 8, 16
F_TRACK, F_PTY, F_SYSFS, F_SCRATCH, F_LAZYPTS, F_IPCCAPS = 32, 64, 128, 256, 512, 1024
_PTY_MAX = 1023       # cols and rows ride in the flags' bits 12..21 and 22..31


def _strings(items: list[str]) -> bytes:
    out = bytearray()
    for s in items:
        b = s.encode()
        if b"\0" in b:
            raise ValueError(f"{s[:60]!r} contains a NUL byte, which no argv, env entry "
                             "or path can hold")
        out += b + b"\0"
    return bytes(out)


def request_argv(req: Request) -> list[str]:
    """The strings a request carries: the helper child's argv after the program name
    (the init binary is the helper's own setting). Pure."""
    if isinstance(req, Create):
        # The layer paths travel one by one; the helper opens them and mounts the overlay
        # from /proc/self/fd names, so none of them shows in the sandbox's mountinfo.
        return ["create", req.root, str(len(req.lowerdirs)), *req.lowerdirs, req.upper,
                req.work, req.hostname, "1" if req.loopback else "0", str(req.tmp_bytes),
                str(len(req.cgroup_procs)), *req.cgroup_procs,
                *((str(req.userns[0]), str(req.userns[1])) if req.userns else ()),
                *((req.sysfs,) if req.sysfs else ()),
                *((req.scratch,) if req.scratch else ()),
                *((";".join(f"{k}={v}" for k, v in req.ipc_caps),) if req.ipc_caps else ())]
    if isinstance(req, Helper):
        return ["helper", str(len(req.cgroup_procs)), *req.cgroup_procs]
    if isinstance(req, Exec):
        if req.helper:
            return ["exec", str(req.helper),
                    req.cwd or "", req.user or "", str(len(req.cgroup_procs)),
                    *req.cgroup_procs, str(req.pids_index), req.home_procs, str(len(req.env)),
                    *req.env, "--", *req.argv]
        return ["exec", req.cwd or "", req.user or "", str(len(req.cgroup_procs)),
                *req.cgroup_procs, str(req.pids_index), req.home_procs, ":".join(req.hide),
                str(len(req.env)), *req.env, "--", *req.argv]
    return []


def encode(req: Request) -> bytes:
    if isinstance(req, Create):
        kind = REQ_CREATE
        flags = (F_NESTED if req.nested else 0) | (F_USERNS if req.userns else 0) \
            | (F_NETNS if req.netns else 0) | (F_SYSFS if req.sysfs else 0) \
            | (F_SCRATCH if req.scratch else 0) | (F_LAZYPTS if req.lazy_pts else 0) \
            | (F_IPCCAPS if req.ipc_caps else 0)
    elif isinstance(req, Exec):
        kind = REQ_EXEC
        flags = (F_NESTED if req.nested else 0) | (F_BACKGROUND if req.background else 0) \
            | (F_USERNS if req.userns else 0) | (F_HELPER if req.helper else 0) \
            | (F_TRACK if req.track else 0)
        if req.pty is not None:
            cols, rows = req.pty
            if not (0 < cols <= _PTY_MAX and 0 < rows <= _PTY_MAX):
                raise ValueError(f"a terminal of {cols}x{rows} cells is beyond what the "
                                 f"helper carries (1..{_PTY_MAX} each)")
            flags |= F_PTY | cols << 12 | rows << 22
    elif isinstance(req, Helper):
        kind, flags = REQ_HELPER, 0
    else:
        kind, flags = REQ_KILL, 0
    data = _REQ.pack(kind, flags, req.id) + _strings(request_argv(req))
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError(f"the request is {len(data)} bytes (argv, env and paths), over the "
                         f"{MAX_REQUEST_BYTES}-byte most the sandbox helper takes; an exec's "
                         "argv + env must stay within Linux's ARG_MAX (2 MiB) - pass large "
                         "data as stdin or a file")
    return data


def decode_reply(data: bytes) -> Reply:
    if len(data) < _REP.size:
        raise ValueError(f"reply of {len(data)} bytes is shorter than its {_REP.size}-byte "
                         "header")
    kind, pid, rid, ns_pid, status, err, n = _REP.unpack_from(data)
    if kind == REP_CREATED:
        return Created(rid, pid)
    if kind == REP_STARTED:
        return Started(rid, pid, ns_pid)
    if kind == REP_EXITED:
        return Exited(rid, status, pid)
    if kind == REP_RUNNING:
        return Running(rid, pid, ns_pid)
    if kind == REP_FAILED:
        return Failed(rid, data[_REP.size:_REP.size + n].decode(errors="replace").strip(), err)
    raise ValueError(f"unknown reply type {kind}")


# What an exec child reports before it runs the command ("dsec: cannot run 'X': WHAT:
# strerror", see die() in nsexec.c) when the caller named something the sandbox does not
# have: the program, the user or the working directory. Anything else that fails there
# (setns, capset, seccomp...) is the node's problem, not the caller's.
_CALLER_MISTAKES = ("unknown user", "user name too long", "chdir ", "execve", "execvpe")


def exec_failure(sid: str, message: str) -> DsecError:
    """The error for an exec whose command could not start (a background exec's Failed
    reply; a foreground one exits 127/126 with the same message on stderr)."""
    text = message.strip()
    what = text.removeprefix("dsec: ")
    if text.startswith("dsec: cannot run") and any(m in what for m in _CALLER_MISTAKES):
        code = 127 if ("execv" in what and "No such file" in what) else 126
        return CannotRun(f"exec in sandbox {sid} could not start: {what[:300]} (a "
                         f"foreground exec exits {code}); check the program, user and cwd",
                         sandbox_id=sid, exit_code=code)
    return BackendError(f"exec in sandbox {sid} failed to start: {text[:500]}",
                        sandbox_id=sid)
