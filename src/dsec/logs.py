"""Logging for the long-running commands (``dsec up``, ``dsec apiserver``, ``dsec edge``;
issue 19): levels and formats, the access log, and the audit log of admin actions.

- :func:`configure`: ``--log-level debug|info|warning|error`` and ``--log-format
  text|json``. Text lines carry an ISO 8601 UTC timestamp with milliseconds, the level
  and the logger; JSON lines are one object each (``ts``, ``level``, ``logger``, ``msg``,
  ``exc`` when there is a traceback) for log shippers. The stdlib's ``logging`` does the
  work (handlers, levels, thread safety); this module only formats.
- **Access log** (``--access-log PATH|-``): one line per REST request (method, route
  template, path, status, duration, client, request id, principal) and per Aether gateway
  call (op, outcome, duration, peer), on the logger ``dsec.access``, in the chosen format.
  Off unless asked: :func:`access_enabled` is one attribute read on the hot path.
- **Audit log** (:class:`AuditLog`, ``<state dir>/audit.log``): who did what to which
  admin object (keys, quotas and projects, images, join tokens and joined nodes, node
  drains), when, and whether it succeeded, as JSON lines. Audited before acting: an
  intent line is fsynced before the action runs (if it cannot be, the action is refused:
  :func:`dsec.control.audit.audited`); durable before acknowledged: the outcome line is
  written and fsynced before the answer goes out (an admin action that was
  answered is in the log after a kill -9). The file is created mode 0600 in the state dir
  (0700): only the state dir's owner (the admin running the cluster) reads it; an
  existing file with looser bits is tightened at open. Secrets never enter it: a created
  key's secret is not part of the record, only its id and name.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, TextIO

__all__ = [
    "AUDIT_FILE",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "AuditLog",
    "JsonFormatter",
    "TextFormatter",
    "access",
    "access_enabled",
    "configure",
    "escape_text",
    "open_private",
    "private_fd",
]

LogFormat = Literal["text", "json"]
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMATS: Final = ("text", "json")
AUDIT_FILE: Final = "audit.log"

_access = logging.getLogger("dsec.access")
_access.propagate = False          # its own destination (--access-log), never the console's
_access.setLevel(logging.INFO)


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def escape_text(s: str) -> str:
    """``s`` with every non-printable character escaped (``\\n``, ``\\r``, ``\\t``,
    ``\\xNN``, ``\\uNNNN``) and backslashes doubled: peer-chosen text (a path, a label,
    an error message) can neither end a log line nor reach an operator's terminal as a
    control sequence (red team 19, B7/B10)."""
    if s.isprintable() and "\\" not in s:
        return s
    out = []
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])
    return "".join(out)


def _logfmt_value(v: Any) -> str:
    """A ``k=v`` value, logfmt rules: escaped (:func:`escape_text`) and double-quoted
    when empty or holding a space, ``=`` or ``"`` (so a request id ``r1 status=200``
    stays one field)."""
    s = escape_text(v if isinstance(v, str) else str(v))
    if s == "" or any(c in s for c in ' ="'):
        return '"' + s.replace('"', '\\"') + '"'
    return s


class TextFormatter(logging.Formatter):
    """``2026-12-02T08:30:00.123Z WARNING dsec.edge: message`` (UTC, milliseconds). The
    message and the ``k=v`` fields are escaped (:func:`escape_text`; values quoted by
    logfmt rules): one record is one line, whatever a peer put into it; a traceback
    (``exc_info``, the server's own) follows on its own lines."""

    def format(self, record: logging.LogRecord) -> str:
        line = (f"{_iso(record.created)} {record.levelname} {record.name}: "
                f"{escape_text(record.getMessage())}")
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{escape_text(str(k))}={_logfmt_value(v)}"
                                   for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg`` (and the record's
    structured ``fields``, ``exc``)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _iso(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def configure(level: str = "warning", fmt: str = "text", *, access_log: str | None = None,
              stream: TextIO | None = None, handler: logging.Handler | None = None) -> None:
    """Set the root logger's level and format (``stream``: stderr by default, or a
    ``handler`` of the caller's, e.g. the status line's console), and the access log:
    ``access_log`` a file path (appended), ``"-"`` for stderr, or None (off)."""
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    f = _formatter(fmt)  # type: ignore[arg-type]
    h = handler if handler is not None else logging.StreamHandler(stream or sys.stderr)
    h.setFormatter(f)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(h)
    root.setLevel(level.upper())
    for old in list(_access.handlers):
        _access.removeHandler(old)
        old.close()
    if access_log is not None:
        ah: logging.Handler
        if access_log == "-":
            ah = logging.StreamHandler(stream or sys.stderr)
        else:
            # client addresses and principals: not for others. Created 0600 by the open
            # itself (never 0644-then-chmod: a reader could open it in between), never
            # through a symlink, and not a file another user owns (red team 19, B8).
            ah = logging.StreamHandler(open_private(access_log))
        ah.setFormatter(f)
        _access.addHandler(ah)


def open_private(path: str) -> TextIO:
    """``path`` opened for appending text, created mode 0600 whatever the umask (the
    mode is the ``open``'s own, so the file never exists with looser bits), never
    through a symlink (``O_NOFOLLOW``); an existing file with looser bits is tightened,
    one owned by another user is refused (its owner could read it)."""
    fd = private_fd(path)
    return os.fdopen(fd, "a", encoding="utf-8", buffering=1)


def private_fd(path: str) -> int:
    """The descriptor of :func:`open_private` (``O_WRONLY|O_APPEND``)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        stt = os.fstat(fd)
        if stt.st_uid != os.geteuid():
            raise PermissionError(
                f"{path} is owned by uid {stt.st_uid}, not by this process's uid "
                f"{os.geteuid()}: a log another user owns is readable by them; remove it "
                "or choose another path")
        if stt.st_mode & 0o077:
            os.fchmod(fd, 0o600)     # a file made before, or by someone's looser umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def access_enabled() -> bool:
    """Whether an access log is configured (one attribute read per request)."""
    return bool(_access.handlers)


def access(msg: str, **fields: Any) -> None:
    """One access-log line (``fields`` are structured: JSON keys, ``k=v`` in text)."""
    _access.info(msg, extra={"fields": fields})


class AuditLog:
    """The audit log of admin actions (see the module docstring). ``record`` blocks for
    a write and an fsync: call it off the event loop (:meth:`arecord`)."""

    def __init__(self, path: str, *, clock: Callable[[], float] | None = None,
                 fsync: Callable[[int], None] = os.fsync) -> None:
        import time

        self.path = path
        self._clock = clock or time.time
        self._fsync = fsync
        self._lock = threading.Lock()
        self._fd = private_fd(path)
        self.records = 0

    def record(self, *, actor: str, actor_id: str, action: str, target: Mapping[str, Any],
               outcome: str, peer: str | None = None, detail: str = "",
               phase: str | None = None, op: str | None = None) -> None:
        """Append one line and fsync it: ``actor`` (the principal's name), ``action``
        (the operation), ``target`` (what it named: project, key id, image ref, node),
        ``outcome`` ("ok" or the error code), ``phase`` ("intent" before the action,
        "outcome" after it) and ``op`` (the id pairing the two). Raises OSError when
        the line cannot be written and synced."""
        line = json.dumps({"ts": _iso(self._clock()), "actor": actor, "actor_id": actor_id,
                           "action": action, "target": dict(target), "outcome": outcome,
                           **({"peer": peer} if peer else {}),
                           **({"phase": phase} if phase else {}),
                           **({"op": op} if op else {}),
                           **({"detail": detail[:500]} if detail else {})},
                          default=str, sort_keys=True).encode() + b"\n"
        with self._lock:
            end = os.fstat(self._fd).st_size
            view = memoryview(line)
            try:
                while view:
                    view = view[os.write(self._fd, view):]
                self._fsync(self._fd)
            except OSError:
                # a disk that filled mid-line: no half line is left for a reader to trip on
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, end)
                raise
            self.records += 1

    async def arecord(self, **kw: Any) -> None:
        import asyncio

        await asyncio.to_thread(lambda: self.record(**kw))

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    @staticmethod
    def read(path: str) -> list[dict[str, Any]]:
        """Every record of an audit log file (for ``tests`` and tools)."""
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
