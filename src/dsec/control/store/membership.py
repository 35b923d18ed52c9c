"""Cluster membership in the state store: join tokens and joined edges (issue 16).

Two tables, portable SQL through the dialect of :class:`~dsec.control.store.sql.SqlStore`
(``?`` placeholders rewritten, ``{blob}`` the dialect's binary type), mixed into it so
SQLite and PostgreSQL stores both have them:

- ``join_tokens``: id, sha256 of the secret, uses allowed/used, expiry, revoked.
- ``spent_nonces``: challenge nonces a join or rejoin used, until they expire: a nonce
  is good once across every replica (a replay to another replica is refused).
- ``nodes``: one row per joined edge: its advertised address, its certificate's
  fingerprint, the token it joined with, when, and whether it is revoked. Every
  apiserver replica dials the rows that are not revoked; a revoked row's fingerprint is
  refused at every handshake.

:meth:`MembershipTables.join_node` spends a token use and inserts the node row in one
transaction: a join that fails for any reason leaves neither.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["MEMBERSHIP_SCHEMA", "JoinTokenRow", "MembershipTables", "NodeRow"]


class JoinTokenRow(msgspec.Struct, frozen=True, kw_only=True):
    """A join token as stored: never the secret, its sha256."""

    id: str
    secret_hash: bytes
    uses: int                  # how many joins it allows
    used: int = 0
    created_at: float = 0.0
    expires_at: float = 0.0
    revoked: bool = False
    description: str = ""


class NodeRow(msgspec.Struct, frozen=True, kw_only=True):
    """A joined edge."""

    node_id: str
    address: str               # tcp:HOST:PORT the apiserver replicas dial
    cert_fingerprint: str      # sha256 of its certificate's DER, hex
    token_id: str
    joined_at: float
    revoked: bool = False
    revoked_at: float | None = None
    key_fingerprint: str = ""  # sha256 of its public key: a retried join is recognised


MEMBERSHIP_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS join_tokens (
        id TEXT PRIMARY KEY, secret_hash {blob} NOT NULL, uses BIGINT NOT NULL,
        used BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL, revoked INTEGER NOT NULL,
        description TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS nodes (
        node_id TEXT PRIMARY KEY, address TEXT NOT NULL, cert_fingerprint TEXT NOT NULL,
        token_id TEXT NOT NULL, joined_at DOUBLE PRECISION NOT NULL,
        revoked INTEGER NOT NULL, revoked_at DOUBLE PRECISION,
        key_fingerprint TEXT NOT NULL DEFAULT '')""",
    # Challenge nonces spent by a join or rejoin, kept until they expire (issue 16: per
    # replica before, so a replay to another replica within the window was taken).
    """CREATE TABLE IF NOT EXISTS spent_nonces (
        nonce TEXT PRIMARY KEY, expires_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS spent_nonces_expiry ON spent_nonces (expires_at)",
    # Every fingerprint a node ever had: a revoked edge's old certificate stays refused
    # even after its node id joins again with a new one.
    """CREATE TABLE IF NOT EXISTS revoked_certs (
        fingerprint TEXT PRIMARY KEY, node_id TEXT NOT NULL,
        revoked_at DOUBLE PRECISION NOT NULL)""",
    # The capacity each joined node registered with (its first heartbeat any replica
    # heard after its join), as msgspec JSON of dsec.wire.node.Resources: every replica
    # clamps the node's later claims to it, and a restart keeps it (red17 F5: it lived
    # in one apiserver process's memory). A fresh join starts it over.
    """CREATE TABLE IF NOT EXISTS node_capacity (
        node_id TEXT PRIMARY KEY, capacity TEXT NOT NULL,
        registered_at DOUBLE PRECISION NOT NULL)""",
]

_NODE_COLS = ("node_id, address, cert_fingerprint, token_id, joined_at, revoked, revoked_at, "
              "key_fingerprint")
_TOKEN_COLS = "id, secret_hash, uses, used, created_at, expires_at, revoked, description"


class MembershipTables:
    """The membership methods of :class:`~dsec.control.store.sql.SqlStore`."""

    # provided by SqlStore
    _tx: Any
    _s: Any
    _d: Any

    def _all(self, text: str, args: Any = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _exec(self, text: str, args: Any = ()) -> int:
        raise NotImplementedError

    def _create_membership_tables(self) -> None:
        with self._tx() as cur:
            # the dialect's lock around schema changes, where it has one (PostgreSQL:
            # replicas starting at once must not race their CREATE TABLEs)
            for stmt in getattr(self._d, "schema_lock", ()):
                cur.execute(stmt)
            for stmt in MEMBERSHIP_SCHEMA:
                cur.execute(stmt.format(blob=self._d.blob))

    # --- tokens -----------------------------------------------------------------------
    def put_join_token(self, row: JoinTokenRow) -> None:
        self._exec(f"INSERT INTO join_tokens ({_TOKEN_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (row.id, row.secret_hash, row.uses, row.used, row.created_at,
                    row.expires_at, int(row.revoked), row.description))

    def get_join_token(self, token_id: str) -> JoinTokenRow | None:
        rows = self._all(f"SELECT {_TOKEN_COLS} FROM join_tokens WHERE id = ?", (token_id,))
        return _token(rows[0]) if rows else None

    def list_join_tokens(self) -> list[JoinTokenRow]:
        return [_token(r) for r in self._all(
            f"SELECT {_TOKEN_COLS} FROM join_tokens ORDER BY created_at, id")]

    def revoke_join_token(self, token_id: str) -> bool:
        return self._exec("UPDATE join_tokens SET revoked = 1 WHERE id = ?", (token_id,)) > 0

    def join_node(self, token_id: str, secret_hash: bytes, now: float, row: NodeRow) -> str:
        """Spend one use of the token and record ``row``, in one transaction. Returns ""
        on success, else why not (``token``: no such token, wrong secret, expired, revoked
        or used up — one answer for all, so a guesser learns nothing; ``taken``: a node
        of that id is joined and not revoked)."""
        try:
            with self._tx() as cur:
                self._join_tx(cur, token_id, secret_hash, now, row)
        except _Refused as exc:
            return str(exc)
        return ""

    def _join_tx(self, cur: Any, token_id: str, secret_hash: bytes, now: float,
                 row: NodeRow) -> None:
        cur.execute(self._s("SELECT revoked, token_id, key_fingerprint, cert_fingerprint "
                            "FROM nodes WHERE node_id = ?"), (row.node_id,))
        old = cur.fetchone()
        retry = (old is not None and not old[0] and old[1] == token_id
                 and row.key_fingerprint != "" and old[2] == row.key_fingerprint)
        if retry:
            # The same join again (same token, same key): its answer was lost. The token
            # must still be good, but no further use is spent; the certificate the edge
            # never received is denied.
            cur.execute(self._s("SELECT 1 FROM join_tokens WHERE id = ? AND secret_hash = ? "
                                "AND revoked = 0 AND expires_at > ?"),
                        (token_id, secret_hash, now))
            if cur.fetchone() is None:
                raise _Refused("token")
            cur.execute(self._s("INSERT INTO revoked_certs (fingerprint, node_id, revoked_at) "
                                "VALUES (?, ?, ?) ON CONFLICT (fingerprint) DO NOTHING"),
                        (old[3], row.node_id, now))
        else:
            cur.execute(self._s(
                "UPDATE join_tokens SET used = used + 1 WHERE id = ? AND secret_hash = ? "
                "AND revoked = 0 AND expires_at > ? AND used < uses"),
                (token_id, secret_hash, now))
            if cur.rowcount != 1:
                raise _Refused("token")
            if old is not None and not old[0]:
                # the token use is given back: the whole transaction is rolled back
                raise _Refused("taken")
            # a new membership: the size it registers with is its next first heartbeat
            cur.execute(self._s("DELETE FROM node_capacity WHERE node_id = ?"),
                        (row.node_id,))
        cur.execute(self._s(
            f"INSERT INTO nodes ({_NODE_COLS}) VALUES (?, ?, ?, ?, ?, 0, NULL, ?) "
            "ON CONFLICT (node_id) DO UPDATE SET address = excluded.address, "
            "cert_fingerprint = excluded.cert_fingerprint, token_id = excluded.token_id, "
            "joined_at = excluded.joined_at, revoked = 0, revoked_at = NULL, "
            "key_fingerprint = excluded.key_fingerprint"),
            (row.node_id, row.address, row.cert_fingerprint, row.token_id, row.joined_at,
             row.key_fingerprint))

    # --- nonces -----------------------------------------------------------------------
    def spend_nonce(self, nonce: str, expires_at: float, now: float) -> bool:
        """Spend ``nonce`` (kept until ``expires_at``); False when it was spent already,
        by any replica. Expired ones go in the same transaction."""
        with self._tx() as cur:
            cur.execute(self._s("DELETE FROM spent_nonces WHERE expires_at <= ?"), (now,))
            cur.execute(self._s("INSERT INTO spent_nonces (nonce, expires_at) VALUES (?, ?) "
                                "ON CONFLICT (nonce) DO NOTHING"), (nonce, expires_at))
            return int(cur.rowcount) == 1

    def nonce_spent(self, nonce: str, now: float) -> bool:
        return bool(self._all("SELECT 1 FROM spent_nonces WHERE nonce = ? AND expires_at > ?",
                              (nonce, now)))

    # --- nodes ------------------------------------------------------------------------
    def get_node(self, node_id: str) -> NodeRow | None:
        rows = self._all(f"SELECT {_NODE_COLS} FROM nodes WHERE node_id = ?", (node_id,))
        return _node(rows[0]) if rows else None

    def list_nodes(self) -> list[NodeRow]:
        return [_node(r) for r in self._all(f"SELECT {_NODE_COLS} FROM nodes ORDER BY node_id")]

    def set_node_address(self, node_id: str, fingerprint: str, address: str) -> bool:
        """A rejoin: the address of an unrevoked node whose certificate is ``fingerprint``."""
        return self._exec("UPDATE nodes SET address = ? WHERE node_id = ? AND "
                          "cert_fingerprint = ? AND revoked = 0",
                          (address, node_id, fingerprint)) > 0

    def revoke_node(self, node_id: str, now: float) -> bool:
        """Revoke a joined node: its row and its certificate's fingerprint, for good."""
        with self._tx() as cur:
            cur.execute(self._s("SELECT cert_fingerprint FROM nodes WHERE node_id = ?"),
                        (node_id,))
            got = cur.fetchone()
            if got is None:
                return False
            cur.execute(self._s("UPDATE nodes SET revoked = 1, revoked_at = ? "
                                "WHERE node_id = ? AND revoked = 0"), (now, node_id))
            cur.execute(self._s("INSERT INTO revoked_certs (fingerprint, node_id, revoked_at) "
                                "VALUES (?, ?, ?) ON CONFLICT (fingerprint) DO NOTHING"),
                        (got[0], node_id, now))
        return True

    def register_capacity(self, node_id: str, capacity: str, now: float) -> str:
        """Record ``capacity`` as what ``node_id`` registered with unless a size is
        recorded already; return the recorded one (the first replica to write wins)."""
        with self._tx() as cur:
            cur.execute(self._s("INSERT INTO node_capacity (node_id, capacity, registered_at) "
                                "VALUES (?, ?, ?) ON CONFLICT (node_id) DO NOTHING"),
                        (node_id, capacity, now))
            cur.execute(self._s("SELECT capacity FROM node_capacity WHERE node_id = ?"),
                        (node_id,))
            return str(cur.fetchone()[0])

    def revoked_fingerprints(self) -> set[str]:
        return {str(r[0]) for r in self._all("SELECT fingerprint FROM revoked_certs")}


class _Refused(Exception):
    """Raised inside join_node's transaction to roll it back; the message is the reason."""


def _token(r: tuple[Any, ...]) -> JoinTokenRow:
    return JoinTokenRow(id=r[0], secret_hash=bytes(r[1]), uses=int(r[2]), used=int(r[3]),
                        created_at=float(r[4]), expires_at=float(r[5]), revoked=bool(r[6]),
                        description=r[7])


def _node(r: tuple[Any, ...]) -> NodeRow:
    return NodeRow(node_id=r[0], address=r[1], cert_fingerprint=r[2], token_id=r[3],
                   joined_at=float(r[4]), revoked=bool(r[5]),
                   revoked_at=None if r[6] is None else float(r[6]), key_fingerprint=r[7])
