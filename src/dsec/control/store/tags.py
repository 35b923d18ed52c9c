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

__all__ = ["TAGS_SCHEMA", "ImageTagTables", "StoreTags"]

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
