"""Image tags in the state store (issue 16): the names every apiserver replica shares.

A layer store keeps layer files and manifests on its host; the *names* (``[project/]
name:tag`` -> digest) used to live next to them in ``refs.json``, one table per host, so
two replicas on two hosts could answer the same tag with two layers. Here they live in
the state store, with the named layer's manifest (a replica that never built the layer
still knows what the name is: its kind, project, stack and image config, the things a
create's resolution checks), and one version for the whole table:

- ``image_tags``: key, digest, the manifest (JSON), the version that last wrote it;
- ``image_tag_clock``: one row, the table's version, bumped once per change (several
  keys at once are one change). A reader that cached the table re-reads it only when the
  version moved (:meth:`ImageTagTables.image_tags_version`); PostgreSQL also announces
  each new version on the ``dsec_tags`` channel in the committing transaction, so a
  replica learns of another's tag without asking (``listen_tags``).

Portable SQL through the dialect of :class:`~dsec.control.store.sql.SqlStore`, mixed into
it like :mod:`~dsec.control.store.membership`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["TAGS_SCHEMA", "HostNames", "ImageTagTables", "StoreTags"]

TAGS_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS image_tags (
        key TEXT PRIMARY KEY, digest TEXT NOT NULL, manifest TEXT NOT NULL,
        version BIGINT NOT NULL, updated_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS image_tags_digest ON image_tags (digest)",
    """CREATE TABLE IF NOT EXISTS image_tag_clock (
        id INTEGER PRIMARY KEY, version BIGINT NOT NULL)""",
    "INSERT INTO image_tag_clock (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
]


class ImageTagTables:
    """The image-tag methods of :class:`~dsec.control.store.sql.SqlStore`."""

    # provided by SqlStore
    _tx: Any
    _s: Any
    _d: Any

    def _all(self, text: str, args: Any = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _create_tag_tables(self) -> None:
        with self._tx() as cur:
            for stmt in getattr(self._d, "schema_lock", ()):
                cur.execute(stmt)
            for stmt in TAGS_SCHEMA:
                cur.execute(stmt)

    def _tags_changed(self, cur: Any, version: int) -> None:
        """Called in the transaction that moved the tag table to ``version`` (PostgreSQL
        notifies listeners at its commit)."""

    def image_tags_version(self) -> int:
        """The tag table's version: it moves on every change, by any replica."""
        rows = self._all("SELECT version FROM image_tag_clock WHERE id = 1")
        return int(rows[0][0]) if rows else 0

    def read_image_tags(self) -> tuple[int, dict[str, str]]:
        """The version and every name -> digest, read in one transaction."""
        with self._tx() as cur:
            cur.execute(self._s("SELECT version FROM image_tag_clock WHERE id = 1"))
            got = cur.fetchone()
            cur.execute(self._s("SELECT key, digest FROM image_tags"))
            rows = cur.fetchall()
        return (int(got[0]) if got else 0), {str(k): str(d) for k, d in rows}

    def image_tag_manifest(self, digest: str) -> str | None:
        """The manifest (JSON) stored with a name of ``digest``; None when nothing names it."""
        rows = self._all("SELECT manifest FROM image_tags WHERE digest = ? LIMIT 1", (digest,))
        return str(rows[0][0]) if rows else None

    def update_image_tags(self, changes: Mapping[str, tuple[str, str] | None], now: float,
                          *, only_if_absent: bool = False) -> int:
        """Apply ``changes`` (key -> ``(digest, manifest JSON)`` to set, None to remove) in
        one transaction and one version; returns the table's version after it.
        ``only_if_absent``: set only keys no row has yet (an import of ``refs.json``
        written by an older dsec must not move a name a replica set since)."""
        with self._tx() as cur:
            # The clock row is the lock: concurrent changes by two replicas serialise
            # here and each gets its own version.
            cur.execute(self._s("UPDATE image_tag_clock SET version = version + 1 "
                                "WHERE id = 1"))
            cur.execute(self._s("SELECT version FROM image_tag_clock WHERE id = 1"))
            version = int(cur.fetchone()[0])
            for key, value in changes.items():
                if value is None:
                    cur.execute(self._s("DELETE FROM image_tags WHERE key = ?"), (key,))
                    continue
                digest, manifest = value
                conflict = ("DO NOTHING" if only_if_absent else
                            "DO UPDATE SET digest = excluded.digest, manifest = "
                            "excluded.manifest, version = excluded.version, "
                            "updated_at = excluded.updated_at")
                cur.execute(self._s(
                    "INSERT INTO image_tags (key, digest, manifest, version, updated_at) "
                    f"VALUES (?, ?, ?, ?, ?) ON CONFLICT (key) {conflict}"),
                    (key, digest, manifest, version, now))
            self._tags_changed(cur, version)
        return version

    def listen_tags(self, callback: Callable[[int], None]) -> bool:
        """Call ``callback(version)`` when another connection changes the tags (-1: some
        announcements may have been missed). False: this store has no push; poll
        :meth:`image_tags_version`."""
        return False


class StoreTags:
    """A layer store's names (:class:`dsec.image.store.RefTable`) in the state store's
    tag table: what every replica's :class:`~dsec.image.store.LayerStore` and
    :class:`~dsec.image.catalog.StoreIndex` read and write instead of ``refs.json``.

    The table is cached with its version. On PostgreSQL a replica learns of another's
    change by its ``dsec_tags`` notification and only then asks for the version (while
    the LISTEN connection is down, at every check); on SQLite every check reads the
    version (one single-row read of the local file, microseconds). Every create resolves
    its image name through :meth:`signature`, so a create costs no store round trip
    while the names do not move.

    ``seed``: names found in ``refs.json`` of a layer store written before tags moved
    to the state store, imported once where the table has no such name yet."""

    def __init__(self, store: Any, *, clock: Callable[[], float] | None = None) -> None:
        import threading
        import time

        self._store = store
        self._clock = clock or time.time
        self._lock = threading.Lock()
        self._version = -1
        self._refs: dict[str, str] = {}
        self._heard = True
        self._pushed = bool(store.listen_tags(self._on_change))

    def _on_change(self, version: int) -> None:     # on the store's listener thread
        self._heard = True

    def signature(self, *, exact: bool = False) -> int:
        if (not exact and self._pushed and not self._heard
                and getattr(self._store, "listening", False)):
            return self._version
        # cleared before the read: a change announced while reading is heard again
        self._heard = False
        version = int(self._store.image_tags_version())
        if version != self._version:
            with self._lock:
                self._version, self._refs = self._store.read_image_tags()
        return self._version

    def read(self) -> dict[str, str]:
        self.signature(exact=True)
        return dict(self._refs)

    def update(self, changes: Mapping[str, Any]) -> None:
        import msgspec

        enc = msgspec.json.Encoder()
        rows = {k: None if m is None else (m.digest, enc.encode(m).decode())
                for k, m in changes.items()}
        self._store.update_image_tags(rows, self._clock())
        self._heard = True

    def manifest(self, digest: str) -> Any:
        import msgspec

        from dsec.image.manifest import LayerManifest

        raw = self._store.image_tag_manifest(digest)
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=LayerManifest)
        except msgspec.DecodeError:
            return None

    def seed(self, refs: Mapping[str, str], manifest: Callable[[str], Any]) -> int:
        """Import ``refs`` (``refs.json`` of an older dsec) where the table has no such
        name; ``manifest(digest)``: the layer's manifest (None: skipped). Returns how many
        names were offered."""
        import msgspec

        enc = msgspec.json.Encoder()
        rows: dict[str, tuple[str, str] | None] = {}
        for key, digest in refs.items():
            m = manifest(digest)
            if m is not None:
                rows[key] = (digest, enc.encode(m).decode())
        if rows:
            self._store.update_image_tags(rows, self._clock(), only_if_absent=True)
            self._heard = True
        return len(rows)


class HostNames:
    """The names of one host's layer store directory kept in step with the state store's
    tag table (:class:`StoreTags`): the :class:`~dsec.image.store.RefTable` an apiserver's
    :class:`~dsec.image.store.LayerStore` and :class:`~dsec.image.catalog.StoreIndex` use.

    ``refs.json`` stays what processes sharing the directory read and write without the
    state store (the edges of ``dsec up`` resolve names there; ``dsec image build/tag``
    on the host writes there), so:

    - the table is the truth; ``refs.json`` is rewritten from it whenever this replica
      sees the table move (another replica's tag) or changes it;
    - a change made to ``refs.json`` by such a process (a host build) is carried into
      the table, as the difference between the file and ``refs.synced.json`` (what the
      file held when it was last in step): a name another replica removed meanwhile is
      not brought back by this host's older copy;
    - a directory never in step before (no ``refs.synced.json``: a store written before
      names moved to the state store) offers its names where the table has none.

    Writes to the files take the layer store's lock; from the lookups of a create they
    only try it (a write in progress: the next lookup does it), so a lookup never waits
    and never deadlocks under a store operation that holds it."""

    def __init__(self, tags: StoreTags, root: str,
                 manifest: Callable[[str], Any]) -> None:
        import os

        self._tags = tags
        self._root = root
        self._manifest = manifest
        self._refs = os.path.join(root, "refs.json")
        self._synced = os.path.join(root, "refs.synced.json")
        self._file_sig: tuple[int, int, int] | None = None
        self._mirrored = -1

    # ---------------------------------------------------------------- RefTable
    def signature(self, *, exact: bool = False) -> int:
        if self._stat() != self._file_sig:
            with self._trylock() as got:
                if got:
                    self._in_step()
        version = self._tags.signature(exact=exact)
        if version != self._mirrored:
            with self._trylock() as got:
                if got:
                    self._in_step()
        return version

    def read(self) -> dict[str, str]:
        self.signature(exact=True)
        return self._tags.read()

    def update(self, changes: Mapping[str, Any]) -> None:
        """Called by the layer store with its lock held."""
        self._carry_file()
        self._tags.update(changes)
        self._mirror()

    def manifest(self, digest: str) -> Any:
        return self._tags.manifest(digest)

    # ------------------------------------------------------------------- files
    def _stat(self) -> tuple[int, int, int] | None:
        import os
        try:
            st = os.stat(self._refs)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _trylock(self) -> Any:
        import contextlib
        import fcntl
        import os

        @contextlib.contextmanager
        def held() -> Any:
            fd = os.open(os.path.join(self._root, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    yield False
                    return
                yield True
            finally:
                os.close(fd)
        return held()

    def _in_step(self) -> None:
        """The lock held: the file's changes into the table, then the table into the file."""
        self._carry_file()
        self._mirror()

    def _load(self, path: str) -> dict[str, str] | None:
        import msgspec
        try:
            with open(path, "rb") as f:
                return msgspec.json.decode(f.read(), type=dict[str, str])
        except FileNotFoundError:
            return None
        except msgspec.DecodeError:
            return {}

    def _carry_file(self) -> None:
        if self._stat() == self._file_sig:
            return
        import msgspec

        now = self._load(self._refs) or {}
        before = self._load(self._synced)
        if before is None:
            self._tags.seed(now, self._manifest)
            return
        enc = msgspec.json.Encoder()
        rows: dict[str, tuple[str, str] | None] = {}
        for key, digest in now.items():
            if before.get(key) != digest:
                m = self._manifest(digest)
                if m is not None:      # a name of a layer this host does not hold: not ours
                    rows[key] = (digest, enc.encode(m).decode())
        for key in before.keys() - now.keys():
            rows[key] = None
        if rows:
            self._tags._store.update_image_tags(rows, self._tags._clock())
            self._tags._heard = True

    def _mirror(self) -> None:
        import msgspec

        from dsec.image.store import _write_private

        version = self._tags.signature(exact=True)
        names = msgspec.json.encode(dict(sorted(self._tags.read().items())))
        # refs.json first: a crash between the two leaves a file whose difference from
        # refs.synced.json is the table's own state, which carrying it again keeps
        _write_private(self._refs, names)
        _write_private(self._synced, names)
        self._file_sig = self._stat()
        self._mirrored = version
