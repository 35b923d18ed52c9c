"""A throwaway PostgreSQL server in a directory: for tests, benchmarks and demos.

``PgServer(dir)`` runs ``initdb`` and ``pg_ctl`` from Debian's packages
(``/usr/lib/postgresql/<major>/bin``, the newest found; ``$DSEC_PG_BIN`` overrides) into
``dir``: the cluster in ``dir/data``, the log in ``dir/postgres.log`` and the Unix socket
in ``dir`` itself. By default it listens on that socket only (``listen_addresses=''``),
so nothing outside this machine, and no user who cannot enter ``dir``, reaches it;
``tcp_port=`` adds a loopback TCP listener with a generated password (in the DSN).

Running as root: PostgreSQL refuses to run as root, so the server runs as an unprivileged
account of its own, ``dsec-pg`` (a system account without a login shell, created with
``useradd --system`` when missing), and ``dir`` is made 0700 and handed to it. Root still
connects (root passes any directory mode); other local users cannot reach the socket.
Local connections are trusted for that reason: the directory is the access control.
``dir`` must be traversable by that account (``/tmp/...`` is; pytest's ``tmp_path``
under a 0700 parent is not): a clear error says so.

``fsync=False`` (tests) trades crash-durability of the whole machine for speed; a
``kill9()`` of the server alone loses nothing committed either way (the WAL is written
before commit returns; only the OS's flush to disk is skipped).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from dsec import ownership
from dsec.errors import InvalidArgument, Unavailable

__all__ = ["PgServer", "find_pg_bin", "reap_orphan_servers"]

SERVER_USER = "dsec-pg"
SUPERUSER = "dsec"
# Running servers, one file each, named by the owning process (dsec.ownership.token): a
# server whose owner died (kill -9, SIGTERM past its cleanup) is stopped by the next
# PgServer.start on the host, as dead edges' mounts and cgroups are reaped.
REGISTRY = "/run/dsec/pgserver"
_SOCKET_MAX = 100   # sun_path is 108 bytes; ".s.PGSQL.NNNNN" is appended to the directory


def find_pg_bin() -> Path:
    """The directory holding ``initdb``/``pg_ctl``: ``$DSEC_PG_BIN``, else the newest
    ``/usr/lib/postgresql/<major>/bin``, else the ones on ``$PATH``."""
    env = os.environ.get("DSEC_PG_BIN")
    if env:
        if not (Path(env) / "pg_ctl").exists():
            raise InvalidArgument(f"DSEC_PG_BIN={env!r} holds no pg_ctl; point it at "
                                  "PostgreSQL's bin directory")
        return Path(env)

    def major(p: str) -> int:
        m = re.search(r"/postgresql/(\d+)/bin", p)
        return int(m.group(1)) if m else 0
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=major, reverse=True)
    if found:
        return Path(found[0]).parent
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    raise InvalidArgument("PostgreSQL's server programs (initdb, pg_ctl) are not installed: "
                          "apt-get install postgresql-15 (the Makefile's APT_PACKAGES has "
                          "it), or set DSEC_PG_BIN to their directory")


@dataclass(frozen=True, slots=True)
class _Account:
    uid: int
    gid: int
    name: str


def _server_account() -> _Account | None:
    """The account the server runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir",
                        "/nonexistent", "--shell", "/usr/sbin/nologin", SERVER_USER],
                       check=False, capture_output=True)
        try:
            pw = pwd.getpwnam(SERVER_USER)
        except KeyError as exc:
            raise InvalidArgument(
                f"PostgreSQL refuses to run as root and the account {SERVER_USER!r} could "
                f"not be created (useradd failed); create it: useradd --system "
                f"{SERVER_USER}") from exc
    return _Account(pw.pw_uid, pw.pw_gid, pw.pw_name)


def _check_traversable(path: Path, acct: _Account) -> None:
    for parent in path.resolve().parents:
        st = parent.stat()
        if st.st_uid == acct.uid:
            continue
        if not st.st_mode & 0o001:
            raise InvalidArgument(
                f"the PostgreSQL server runs as {acct.name!r}, which cannot enter {parent} "
                f"(mode {st.st_mode & 0o777:o}); put the server directory under a "
                "traversable directory such as /tmp")


class PgServer:
    """One PostgreSQL server in ``dir`` (created if missing; the caller removes it, or
    ``remove=True`` removes it on :meth:`stop`). A context manager: ``with
    PgServer(d) as dsn: ...`` starts it and stops it (and its processes) after."""

    def __init__(self, dir: str | os.PathLike[str], *, fsync: bool = True,
                 tcp_port: int | None = None, remove: bool = False,
                 settings: dict[str, str] | None = None) -> None:
        self.dir = Path(dir).absolute()
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.fsync = fsync
        self.tcp_port = tcp_port
        self.remove = remove
        self.settings = dict(settings or {})
        self.port = tcp_port or 5432   # the socket file's name carries the port too
        self._bin = find_pg_bin()
        self._acct = _server_account()
        self._password = secrets.token_urlsafe(18) if tcp_port is not None else None
        self._entry: str | None = None     # this server's file under REGISTRY while it runs
        if len(str(self.dir)) + len("/.s.PGSQL.65535") > _SOCKET_MAX:
            raise InvalidArgument(
                f"PostgreSQL server directory {self.dir} is too long for a Unix socket path "
                f"(at most {_SOCKET_MAX - 16} characters); use a shorter one such as "
                "tempfile.mkdtemp(dir='/tmp')")

    # ------------------------------------------------------------------ plumbing
    def _run(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        kw: dict[str, Any] = {}
        if self._acct is not None:
            kw = {"user": self._acct.uid, "group": self._acct.gid, "extra_groups": []}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8",
               "LANG": "C.UTF-8", "TZ": "UTC"}
        return subprocess.run([str(self._bin / argv[0]), *argv[1:]], cwd=self.dir, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False,
                              **kw)

    def _initdb(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if self._acct is not None:
            _check_traversable(self.dir, self._acct)
            os.chown(self.dir, self._acct.uid, self._acct.gid)
        if (self.data / "PG_VERSION").exists():
            return
        args = ["initdb", "-D", str(self.data), "-U", SUPERUSER, "-E", "UTF8",
                "--locale=C", "--auth-local=trust"]
        pwfile = self.dir / "pwfile"
        if self._password is not None:
            pwfile.write_text(self._password + "\n")
            os.chmod(pwfile, 0o600)
            if self._acct is not None:
                os.chown(pwfile, self._acct.uid, self._acct.gid)
            args += ["--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        else:
            args += ["--auth-host=reject"]
        if not self.fsync:
            args.append("--no-sync")
        try:
            r = self._run(*args, timeout=120.0)
        finally:
            pwfile.unlink(missing_ok=True)
        if r.returncode != 0:
            raise InvalidArgument(f"initdb into {self.data} failed (exit {r.returncode}): "
                                  f"{r.stderr.strip()[-2000:]}")
        conf = {
            "listen_addresses": "'127.0.0.1'" if self.tcp_port is not None else "''",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.dir}'",
            "unix_socket_permissions": "0700",
            "max_connections": "200",
            "shared_buffers": "32MB",
            "fsync": "on" if self.fsync else "off",
            "full_page_writes": "on" if self.fsync else "off",
            "logging_collector": "off",
            "log_min_messages": "warning",
            **self.settings,
        }
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("\n# dsec.cluster.pgserver\n")
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())

    # ------------------------------------------------------------------ lifecycle
    @property
    def dsn(self) -> str:
        """The connection URL of database ``postgres`` (see :meth:`dsn_for`)."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """A ``postgresql://`` URL of ``database`` on this server: the Unix socket, or
        with ``tcp_port`` loopback TCP with the generated password."""
        if self.tcp_port is not None:
            pw = urllib.parse.quote(self._password or "", safe="")
            return f"postgresql://{SUPERUSER}:{pw}@127.0.0.1:{self.port}/{database}"
        host = urllib.parse.quote(str(self.dir), safe="")
        return f"postgresql://{SUPERUSER}@/{database}?host={host}&port={self.port}"

    def start(self) -> str:
        """initdb (first time) and start; returns the DSN of database ``postgres``."""
        reap_orphan_servers()
        self._initdb()
        self._register()
        r = self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data),
                      "-l", str(self.log), timeout=90.0)
        if r.returncode != 0:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise Unavailable(f"PostgreSQL in {self.data} did not start "
                              f"(pg_ctl exit {r.returncode}): {r.stderr.strip()} {tail}")
        return self.dsn

    def pid(self) -> int | None:
        """The postmaster's pid while it runs (from ``postmaster.pid``)."""
        try:
            first = (self.data / "postmaster.pid").read_text().split("\n", 1)[0]
            pid = int(first)
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def stop(self) -> None:
        """Stop (fast: roll back open transactions) and, with ``remove``, delete ``dir``."""
        if self.pid() is not None:
            r = self._run("pg_ctl", "stop", "-w", "-t", "60", "-m", "fast", "-D",
                          str(self.data), timeout=90.0)
            if r.returncode != 0 and self.pid() is not None:
                self.kill9()
        if self.remove:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._entry is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._entry)
            self._entry = None

    def _register(self) -> None:
        """Record this server under :data:`REGISTRY` as this process's (once)."""
        if self._entry is not None:
            return
        os.makedirs(REGISTRY, mode=0o700, exist_ok=True)
        entry = os.path.join(REGISTRY, f"{ownership.token()}-{secrets.token_hex(4)}")
        with open(entry + ".tmp", "w") as f:
            json.dump({"dir": str(self.dir), "remove": self.remove}, f)
        os.replace(entry + ".tmp", entry)
        self._entry = entry

    def restart(self) -> str:
        """A clean restart (every client connection is cut); returns the same DSN."""
        r = self._run("pg_ctl", "restart", "-w", "-t", "60", "-m", "fast", "-D",
                      str(self.data), "-l", str(self.log), timeout=120.0)
        if r.returncode != 0:
            raise Unavailable(f"PostgreSQL in {self.data} did not restart: {r.stderr}")
        return self.dsn

    def kill9(self) -> None:
        """SIGKILL the postmaster and every backend of it, as a crash of the server host
        process would; returns once they are gone. :meth:`start` then recovers from WAL."""
        pid = self.pid()
        if pid is None:
            return
        victims = [pid, *_children(pid)]
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and any(_alive(p) for p in victims):
            time.sleep(0.02)
        # A reaped-late zombie keeps its pid "alive" for kill(pid, 0), which is what the
        # next postmaster checks the stale lock file against: the file goes once all are
        # dead (the shared-memory check still guards against a live one).
        if not any(_alive(p) for p in victims):
            (self.data / "postmaster.pid").unlink(missing_ok=True)
            (self.dir / f".s.PGSQL.{self.port}.lock").unlink(missing_ok=True)
            (self.dir / f".s.PGSQL.{self.port}").unlink(missing_ok=True)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def reap_orphan_servers(registry: str = REGISTRY) -> list[str]:
    """Stop the servers whose owning process is gone (and remove their directories when
    they were made with ``remove=True``); returns their directories. Servers of live
    owners, of owners in another pid namespace, and files not this user's are left."""
    try:
        st = os.stat(registry)
        names = os.listdir(registry)
    except OSError:
        return []
    if st.st_uid != os.geteuid():
        return []                       # not ours: never act on what another user wrote
    reaped = []
    for name in names:
        owner = name.rsplit("-", 1)[0]
        if name.endswith(".tmp") or ownership.token_alive(owner) is not False:
            continue
        path = os.path.join(registry, name)
        try:
            with open(path) as f:
                got = json.load(f)
            server = PgServer(str(got["dir"]), remove=bool(got.get("remove")))
        except (OSError, ValueError, KeyError, TypeError, InvalidArgument):
            server = None
        if server is not None and server.data.is_dir():
            server.stop()
            reaped.append(str(server.dir))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return reaped


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False
