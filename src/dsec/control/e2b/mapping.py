"""E2B's control REST and envd messages <-> dsec's wire types (pure: no I/O).

What maps to what (docs/e2b.md has the table and the gaps):

- a *template id* is a dsec image ref (``base`` is dsec's busybox ``base``);
- ``metadata`` are sandbox labels (dsec's own ``dsec.io/...`` labels are never shown);
- ``timeout`` (seconds) is the sandbox TTL; ``envVars`` the sandbox env;
- ``autoPause`` (pause instead of kill on timeout) is the spec's ``ttl_action="pause"``;
- states ``running``/``paused`` are dsec's; a sandbox in a transition shows the state
  it is leaving, a destroyed one is "not found", as E2B answers for a killed sandbox.
"""

from __future__ import annotations

import base64
import datetime
import stat as stat_mod
from dataclasses import dataclass
from typing import Any

from dsec.errors import InvalidArgument, ResourceExhausted
from dsec.wire.api import CreateSandboxRequest
from dsec.wire.files import FileEvent
from dsec.wire.netpolicy import NetworkPolicy
from dsec.wire.spec import FileInfo, SandboxInfo, SandboxStats

__all__ = [
    "ENVD_VERSION",
    "create_request",
    "entry_info",
    "fs_event",
    "listed",
    "metadata_filter",
    "metrics",
    "sandbox_created",
    "sandbox_detail",
    "state_of",
    "watch_incomplete",
]

#: The envd version this layer reports. The SDK gates features on it: >= 0.4.0 sends no
#: user when none is given (the image's default user runs), >= 0.5.7 uploads file-like
#: data as a raw octet stream; < 0.6.2 makes file metadata and < 0.6.3 watch entry info
#: a client-side TemplateException (features dsec does not carry).
ENVD_VERSION = "0.5.7"

_PLATFORM_LABELS = ("dsec.io/",)
_CREATE_FIELDS = frozenset({"templateID", "timeout", "autoPause", "autoPauseMemory",
                            "autoResume", "allow_internet_access", "network", "metadata",
                            "envVars", "mcp", "iam", "volumeMounts", "secure"})


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace(
        "+00:00", "Z")


def state_of(info: SandboxInfo) -> str | None:
    """E2B's state of a dsec sandbox, or None when E2B would not list it (gone)."""
    s = info.state
    if s in ("paused", "pausing"):
        return "paused"
    if s in ("running", "creating", "resuming"):
        return "running"
    return None


def _metadata(info: SandboxInfo) -> dict[str, str]:
    return {k: v for k, v in info.spec.labels.items()
            if not any(k.startswith(p) or ".dsec.io/" in k for p in _PLATFORM_LABELS)}


def _end_at(info: SandboxInfo) -> float:
    expires = getattr(info, "expires_at", None)
    if isinstance(expires, (int, float)):
        return float(expires)
    ttl = info.spec.ttl_s
    return info.created_at + (ttl if ttl is not None else 0.0)


def _common(info: SandboxInfo) -> dict[str, Any]:
    spec = info.spec
    return {
        "templateID": spec.image,
        "sandboxID": info.id,
        "clientID": info.node,
        "startedAt": _iso(info.created_at),
        "endAt": _iso(_end_at(info)),
        "cpuCount": max(1, -(-spec.cpu_milli // 1000)),
        "memoryMB": spec.memory_bytes >> 20,
        "diskSizeMB": (spec.disk_bytes or 0) >> 20,
        "envdVersion": ENVD_VERSION,
        "metadata": _metadata(info),
    }


def listed(info: SandboxInfo) -> dict[str, Any]:
    """``ListedSandbox`` (``GET /v2/sandboxes``)."""
    return {**_common(info), "state": state_of(info) or "running"}


#: The label a create with ``autoResume: {"enabled": false}`` sets (caller-settable: it
#: only ever makes the layer refuse a resume, never grants anything).
AUTO_RESUME_LABEL = "e2b.dsec.io/auto-resume"


def auto_resume(info: SandboxInfo) -> bool:
    """Whether a command or a write resumes ``info`` when paused (E2B's autoResume): yes
    unless it was created with ``auto_resume=False``."""
    return info.spec.labels.get(AUTO_RESUME_LABEL) != "false"


def sandbox_detail(info: SandboxInfo, token: str) -> dict[str, Any]:
    """``SandboxDetail`` (``GET /sandboxes/{id}``), with its ``lifecycle``: what its
    timeout does, and ``autoResume`` (false only when created with it off: dsec resumes
    a paused sandbox on a command or a write otherwise). ``token``: the sandbox's envd
    token (as the create answer's)."""
    return {**listed(info), "envdAccessToken": token, "lifecycle": {
        "autoResume": auto_resume(info),
        "onTimeout": "pause" if info.spec.ttl_action == "pause" else "kill"}}


def sandbox_created(info: SandboxInfo, envd_token: str,
                    traffic_token: str) -> dict[str, Any]:
    """``Sandbox`` (create and connect answers). ``envdAccessToken``: what the SDK sends
    back as ``X-Access-Token`` on every envd call; ``trafficAccessToken``: what
    e2b-code-interpreter sends as ``E2B-Traffic-Access-Token`` on its context calls (port
    49999), which carry no other credential. Both are tokens of this sandbox alone
    (:mod:`dsec.control.e2b.tokens`), never the caller's key: opened by the layer, the
    call is authorized as the caller, with every rule dsec's REST applies."""
    return {"templateID": info.spec.image, "sandboxID": info.id, "clientID": info.node,
            "envdVersion": ENVD_VERSION, "envdAccessToken": envd_token,
            "trafficAccessToken": traffic_token}


def create_request(body: dict[str, Any], *, max_ttl_s: float) -> CreateSandboxRequest:
    """dsec's create request for E2B's ``NewSandbox``/``NewSandboxV2`` body. Fields dsec
    cannot honour are refused by name (never dropped silently)."""
    unknown = set(body) - _CREATE_FIELDS
    if unknown:
        raise InvalidArgument(f"unknown field {min(unknown)!r} in the create body",
                              field=min(unknown))
    template = body.get("templateID")
    if not isinstance(template, str) or not template:
        raise InvalidArgument("templateID (a dsec image name) is required",
                              field="templateID")
    auto_pause = body.get("autoPause")
    if auto_pause is not None and not isinstance(auto_pause, bool):
        raise InvalidArgument("autoPause must be true or false", field="autoPause")
    resume = body.get("autoResume")
    if resume is not None and not (isinstance(resume, dict)
                                   and isinstance(resume.get("enabled"), bool)):
        raise InvalidArgument('autoResume must be {"enabled": true|false}',
                              field="autoResume")
    # autoPause: the timeout pauses (dsec's ttl_action="pause"); the pause keeps memory
    # whatever autoPauseMemory says. autoResume: dsec resumes a paused sandbox on any
    # command or write (reads leave it paused: docs/sdk.md "Paused sandboxes"); with
    # {"enabled": false} the layer refuses those instead (AUTO_RESUME_LABEL)
    for name in ("mcp", "iam", "volumeMounts", "network"):
        if body.get(name):
            raise InvalidArgument(f"{name} is not supported by dsec's E2B layer "
                                  "(docs/e2b.md, 'Gaps')", field=name)
    internet = body.get("allow_internet_access")
    network: NetworkPolicy | None = None
    if isinstance(internet, bool):
        # E2B's switch is dsec's egress mode: any public address, or loopback only;
        # left out, the cluster's default policy (dsec up --net-default) applies
        network = NetworkPolicy(mode="open" if internet else "none")
    timeout = body.get("timeout")
    ttl: float | None = None
    if timeout is not None:
        if not isinstance(timeout, int) or isinstance(timeout, bool) or \
                not 0 < timeout <= max_ttl_s:
            raise InvalidArgument(f"timeout={timeout!r} must be whole seconds in "
                                  f"(0, {max_ttl_s:g}]", field="timeout")
        ttl = float(timeout)
    else:
        ttl = 300.0   # E2B's default sandbox timeout (SandboxBase.default_sandbox_timeout)
    meta = body.get("metadata") or {}
    env = body.get("envVars") or {}
    for name, d in (("metadata", meta), ("envVars", env)):
        if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in d.items()):
            raise InvalidArgument(f"{name} must map strings to strings", field=name)
    labels = dict(meta)
    if isinstance(resume, dict) and resume.get("enabled") is False:
        labels[AUTO_RESUME_LABEL] = "false"
    return CreateSandboxRequest(image=template, labels=labels, env=dict(env),
                                ttl_s=ttl, network=network,
                                ttl_action="pause" if auto_pause else "destroy")


#: the most sandboxes an ordered or filtered list reads (E2B orders across the whole
#: result before paging; dsec's own list pages by id)
MAX_VIEW = 10_000


@dataclass(frozen=True, slots=True)
class ListView:
    """E2B's list ``order`` (by start time: ``asc``/``desc``), ``startedAfter`` (ISO
    8601; naive: local time, as the SDK documents) and ``template`` (the image name,
    with or without its tag) over dsec's list rows."""

    descending: bool
    started_after: float | None
    template: str | None

    @classmethod
    def of(cls, *, order: str | None, started_after: str | None,
           template: str | None) -> ListView | None:
        """The view the query asks for; None when it asks for none (dsec's order)."""
        if order is None and started_after is None and template is None:
            return None
        if order is not None and order not in ("asc", "desc"):
            raise InvalidArgument(f"order={order[:20]!r} must be asc or desc",
                                  field="order")
        after = None
        if started_after is not None:
            try:
                after = datetime.datetime.fromisoformat(started_after).timestamp()
            except ValueError:
                raise InvalidArgument(f"startedAfter={started_after[:40]!r} is not an ISO "
                                      "8601 time", field="startedAfter") from None
        return cls(order == "desc", after, template or None)

    def keeps(self, info: SandboxInfo) -> bool:
        # at the microsecond E2B's times are given in (startedAt's ISO form)
        if self.started_after is not None and \
                round(info.created_at, 6) < self.started_after - 5e-7:
            return False
        if self.template is not None:
            # the image as stored ("[project/]name[:tag]") or as named without its
            # project and/or tag
            image = info.spec.image
            bare = image.rpartition("/")[2]
            names = {image, bare, *(x.rpartition(":")[0] for x in (image, bare)
                                    if ":" in x)}
            return self.template in names
        return True

    def sorted(self, rows: list[SandboxInfo],
               after: tuple[float, str] | None) -> list[SandboxInfo]:
        """``rows`` by (start time, id) in the view's direction, those past ``after``."""
        out = sorted(rows, key=lambda i: (i.created_at, i.id), reverse=self.descending)
        if after is None:
            return out
        if self.descending:
            return [i for i in out if (i.created_at, i.id) < after]
        return [i for i in out if (i.created_at, i.id) > after]

    @staticmethod
    def token(info: SandboxInfo) -> str:
        return f"k:{info.created_at!r}:{info.id}"

    @staticmethod
    def token_key(token: str) -> tuple[float, str] | None:
        """The key a :meth:`token` names, or None when it is not one."""
        kind, _, rest = token.partition(":")
        when, _, sid = rest.partition(":")
        try:
            t = float(when)
        except ValueError:
            return None
        if kind != "k" or not sid or len(sid) > 128:
            return None
        return t, sid


def metadata_filter(raw: str | None) -> dict[str, str]:
    """The ``metadata`` query parameter (``k1=v1&k2=v2``, each part percent-encoded,
    then the whole percent-encoded once more by the query string) as label filters."""
    if not raw:
        return {}
    from urllib.parse import parse_qsl
    out: dict[str, str] = {}
    for k, v in parse_qsl(raw, keep_blank_values=True, strict_parsing=False):
        out[k] = v
    return out


def metrics(info: SandboxInfo, stats: SandboxStats, now: float) -> dict[str, Any]:
    """One ``SandboxMetric`` (``GET /sandboxes/{id}/metrics``) from dsec's ``stats``:
    memory and disk now; CPU as the average use since the sandbox started (dsec keeps
    no history of samples)."""
    spec = info.spec
    cores = max(1, -(-spec.cpu_milli // 1000))
    up = max(now - info.created_at, 1e-3)
    return {"cpuCount": cores,
            "cpuUsedPct": round(100.0 * stats.cpu_seconds / up / cores, 2),
            "memTotal": spec.memory_bytes, "memUsed": stats.memory_bytes,
            "memCache": stats.memory_tmpfs_bytes,
            "diskTotal": stats.disk_cap_bytes or spec.disk_bytes or 0,
            "diskUsed": stats.disk_bytes, "timestamp": _iso(now),
            "timestampUnix": int(now)}


_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY",
          "symlink": "FILE_TYPE_SYMLINK"}


def entry_info(fi: FileInfo) -> dict[str, Any]:
    """envd's ``EntryInfo`` (protobuf JSON) for a dsec ``FileInfo``."""
    kind = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR,
            "symlink": stat_mod.S_IFLNK}.get(fi.type, 0)
    mtime = datetime.datetime.fromtimestamp(fi.mtime, datetime.UTC)
    out: dict[str, Any] = {
        "name": fi.name, "path": fi.path, "size": str(fi.size), "mode": fi.mode,
        "permissions": stat_mod.filemode(kind | fi.mode),
        "owner": "", "group": "",
        "modifiedTime": mtime.isoformat().replace("+00:00", "Z"),
    }
    if fi.type in _TYPES:
        out["type"] = _TYPES[fi.type]
    if fi.link_target is not None:
        out["symlinkTarget"] = fi.link_target
    return out


_EVENTS = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE",
           "remove": "EVENT_TYPE_REMOVE", "rename": "EVENT_TYPE_RENAME",
           "chmod": "EVENT_TYPE_CHMOD"}


def fs_event(ev: FileEvent, watched: str) -> dict[str, Any] | None:
    """envd's ``FilesystemEvent``: ``name`` relative to the watched directory (None for
    dsec's ``overflow``, which envd has no event for)."""
    kind = _EVENTS.get(ev.type)
    if kind is None:
        return None
    base = watched.rstrip("/") + "/"
    name = ev.path[len(base):] if ev.path.startswith(base) else (ev.name or ev.path)
    return {"name": name, "type": kind}


def watch_incomplete(ev: FileEvent, watched: str) -> ResourceExhausted | None:
    """dsec's ``incomplete`` (the watch stopped following directory ``ev.path``: its
    project is over its share of the node's watched directories, red team 22 C1) has no
    envd event: the E2B watch ends with this error rather than miss changes silently."""
    if ev.type != "incomplete":
        return None
    return ResourceExhausted(
        f"the watch of {watched[:200]!r} stopped following {ev.path[:200]!r}: this "
        "project's file watches follow more than its share of the node's watched "
        "directories while another project needs room; watch a smaller tree or close "
        "other watches, then watch again", path=ev.path)


def write_info(fi: FileInfo) -> dict[str, Any]:
    """One entry of a ``/files`` upload answer."""
    return {"name": fi.name, "path": fi.path,
            "type": {"file": "file", "dir": "dir"}.get(fi.type, "file")}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: Any, field: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidArgument(f"{field} must be base64 text", field=field)
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise InvalidArgument(f"{field} is not valid base64", field=field) from None
