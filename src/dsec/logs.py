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
  drains), when, and whether it succeeded, as JSON lines. Durable before acknowledged:
  the line is written and fsynced before the answer goes out (an admin action that was
  answered is in the log after a kill -9). The file is created mode 0600 in the state dir
  (0700): only the state dir's owner (the admin running the cluster) reads it; an
  existing file with looser bits is tightened at open. Secrets never enter it: a created
  key's secret is not part of the record, only its id and name.
"""

from __future__ import annotations

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


class TextFormatter(logging.Formatter):
    """``2026-12-02T08:30:00.123Z WARNING dsec.edge: message`` (UTC, milliseconds)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_iso(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
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
            ah = logging.FileHandler(access_log, encoding="utf-8")
            os.chmod(access_log, 0o600)   # client addresses and principals: not for others
        ah.setFormatter(f)
        _access.addHandler(ah)


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
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchmod(self._fd, 0o600)     # a file made before, or by a looser umask
        self.records = 0

    def record(self, *, actor: str, actor_id: str, action: str, target: Mapping[str, Any],
               outcome: str, peer: str | None = None, detail: str = "") -> None:
        """Append one line and fsync it: ``actor`` (the principal's name), ``action``
        (the operation), ``target`` (what it named: project, key id, image ref, node),
        ``outcome`` ("ok" or the error code)."""
        line = json.dumps({"ts": _iso(self._clock()), "actor": actor, "actor_id": actor_id,
                           "action": action, "target": dict(target), "outcome": outcome,
                           **({"peer": peer} if peer else {}),
                           **({"detail": detail[:500]} if detail else {})},
                          default=str, sort_keys=True).encode() + b"\n"
        with self._lock:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
            self._fsync(self._fd)
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
