"""Red team of the tenancy rules (after issue 11 item 1 landed): hostile tenants against a
real in-process cluster (apiserver + edge over a Unix socket + SQLite), every door.

Principals: the bootstrap superuser (the operator); ``bob`` administers ``teamb``;
``mallory`` is a member of ``teamc``. Each test is one attack that worked before its
fix: the test says what the attacker did and what it must get now.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from dsec.aether import connect
from dsec.cluster.local import LocalCluster
from dsec.errors import DsecError


class Tenants:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.root = cluster.api_key
        self.bob = cluster.create_key("bob", "teamb", "admin")
        self.mallory = cluster.create_key("mallory", "teamc", "member")
        self.http = httpx.Client(base_url=cluster.url, timeout=30)

    def h(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    def gateway(self, method: str, body: dict[str, Any], *, key: str) -> Any:
        """One raw call on the Aether gateway (the SDK's default door) on a connection
        that authenticated with ``key``; a ``DsecError`` is returned, not raised."""
        async def go() -> Any:
            assert self.cluster.gateway is not None
            conn = await connect(self.cluster.gateway, token=key)
            try:
                return await conn.call(method, body)
            except DsecError as exc:
                return exc
            finally:
                await conn.close()
        return asyncio.run(go())


@pytest.fixture(scope="module")
def t() -> Iterator[Tenants]:
    with LocalCluster(edges=1) as cl:
        w = Tenants(cl)
        try:
            yield w
        finally:
            w.http.close()


# ------------------------------------------------------------------ principal squatting
@pytest.mark.parametrize("door", ["rest", "gateway"])
def test_a_squatted_principal_name_gains_nothing_from_a_later_grant(t: Tenants,
                                                                      door: str) -> None:
    # Was a hole (high): principal ids are one cluster-wide namespace and project admins
    # create principals in it. bob (admin of teamb only) created "carol-<door>" ahead of
    # the real carol and kept her key; when the operator later "created" carol as admin
    # of teama, POST /v1/keys silently granted the EXISTING principal, and bob's key for
    # carol became an admin key of teama.
    name = f"carol-{door}"
    r = t.http.post("/v1/keys", json={"name": name, "project": "teamb", "role": "reader"},
                    headers=t.h(t.bob))
    assert r.status_code == 201, r.text
    squatter_key = r.json()["api_key"]
    onboard = {"name": name, "project": "teama", "role": "admin"}
    if door == "rest":
        r = t.http.post("/v1/keys", json=onboard, headers=t.h(t.root))
        code, message = r.json().get("code"), r.json().get("message", "")
    else:
        got = t.gateway("api.create_key", onboard, key=t.root)
        assert isinstance(got, DsecError), got
        code, message = got.code, got.message
    assert code == "conflict" and "already exists" in message and "existing" in message
    # the squatter's key holds nothing on teama
    assert t.http.get("/v1/projects/teama", headers=t.h(squatter_key)).status_code == 403
    r = t.http.post("/v1/sandboxes", json={"project": "teama"}, headers=t.h(squatter_key))
    assert r.status_code == 403, r.text
    # an operator who does mean that principal says so, and then knows what it grants
    r = t.http.post("/v1/keys", json={**onboard, "existing": True}, headers=t.h(t.root))
    assert r.status_code == 201, r.text


# ------------------------------------------------------------------------- quotas
def test_a_project_admin_cannot_lift_its_own_projects_quota(t: Tenants) -> None:
    # Was a hole (medium): PUT /v1/quotas/{path} needed admin on the path itself, so the
    # admin of a project lifted the quota the operator gave it (sandboxes, CPU, memory,
    # snapshot_bytes: all of it, e.g. {"max_sandboxes": null}).
    admin = t.h(t.root)
    assert t.http.put("/v1/quotas/teamb", json={"max_sandboxes": 1, "snapshot_bytes": 10},
                      headers=admin).status_code == 200
    for body in ({"max_sandboxes": None}, {"max_sandboxes": 1000}, {}):
        r = t.http.put("/v1/quotas/teamb", json=body, headers=t.h(t.bob))
        assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
        assert "parent" in r.json()["message"] or "superuser" in r.json()["message"]
    got = t.http.get("/v1/projects/teamb", headers=t.h(t.bob)).json()["quota"]
    assert got == {"max_sandboxes": 1, "snapshot_bytes": 10}
    # still one sandbox only
    a = t.http.post("/v1/sandboxes", json={"project": "teamb"}, headers=t.h(t.bob))
    assert a.status_code == 201, a.text
    b = t.http.post("/v1/sandboxes", json={"project": "teamb"}, headers=t.h(t.bob))
    assert b.status_code == 429 and b.json()["code"] == "quota_exceeded", b.text
    t.http.delete(f"/v1/sandboxes/{a.json()['id']}", headers=t.h(t.bob))
    # nor through a subproject's path upwards: an admin sets its subprojects' quotas only
    r = t.http.put("/v1/quotas/teamb/exp", json={"max_sandboxes": 5}, headers=t.h(t.bob))
    assert r.status_code == 200, r.text
    b2 = t.http.post("/v1/keys", json={"name": "bob2", "project": "teamb/exp",
                                       "role": "admin"}, headers=t.h(t.bob))
    assert b2.status_code == 201, b2.text
    r = t.http.put("/v1/quotas/teamb/exp", json={"max_sandboxes": None},
                   headers=t.h(b2.json()["api_key"]))
    assert r.status_code == 403, r.text
    assert t.http.put("/v1/quotas/teamb", json={}, headers=admin).status_code == 200
    assert msgspec.json.decode(t.http.get("/v1/projects/teamb/exp", headers=admin).content)[
        "quota"] == {"max_sandboxes": 5}


# ------------------------------------------------------------- the edge's Unix socket
NOBODY = 65534


def _as_nobody(fn: Any) -> Any:
    """Run ``fn()`` in a forked child that dropped root for uid/gid 65534; returns its
    result (or the ``OSError`` it raised, as ``(errno, strerror)``)."""
    import json
    import os
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out: Any = fn()
            except OSError as exc:
                out = ["oserror", exc.errno, exc.strerror]
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.fixture
def public_dir() -> Iterator[str]:
    """A fresh 0755 directory in /tmp (every ancestor traversable by other users)."""
    import os
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="dsec-rt-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_an_edge_socket_cannot_be_swapped_by_another_host_user(public_dir: str) -> None:
    # Was a hole (medium, under a permissive umask): `dsec edge --listen unix:PATH`
    # created PATH's missing directories with the umask's mode (0777 under umask 0), and
    # the socket itself with the umask's mode, chmod'ing it to 0600 only after it was
    # listening. Another host user could then delete the edge's socket and listen in its
    # place: the apiserver's next (re)connect went to an impostor edge, which received
    # every tenant's create specs (env secrets), commands and file writes.
    import os
    import socket
    import stat
    import subprocess
    import sys
    import time
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    from pathlib import Path
    base = Path(public_dir)
    sock = str(base / "run" / "dsec" / "edge.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from dsec.cli.main import main; main()", "edge",
         "--listen", f"unix:{sock}", "--node-id", "rt"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        umask=0)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline, \
                proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.05)
        def swap() -> Any:
            os.unlink(sock)
            s = socket.socket(socket.AF_UNIX)
            s.bind(sock)
            return "swapped"

        def dial() -> Any:
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            return "connected"
        got = _as_nobody(swap)
        assert got != "swapped" and got[0] == "oserror", got
        assert _as_nobody(dial)[0] == "oserror"
        assert os.path.exists(sock) and proc.poll() is None
        for d in (base / "run", base / "run" / "dsec"):
            assert stat.S_IMODE(os.stat(d).st_mode) & 0o022 == 0, (d, oct(os.stat(d).st_mode))
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        # nothing but the socket is left next to it (the private bind directory is gone)
        assert os.listdir(base / "run" / "dsec") == ["edge.sock"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


# ------------------------------------------------------------------ the state dir path
def test_a_state_dir_another_user_can_redirect_is_refused(public_dir: str) -> None:
    # Was a hole (medium): ensure_private_dir made the state dir 0700 and checked its
    # owner through the path it was given, then dsec kept using that path. A path
    # through another user's symlink (one planted in /tmp ahead of `dsec up --state-dir
    # /tmp/dsec`) passed every check while the link pointed at a root-owned directory;
    # its owner then re-pointed it at a directory of theirs, and the keys (local.json),
    # control.sqlite, every tenant's layers and the edge sockets were written there. A
    # directory under a parent others may write (no sticky bit) can be renamed away and
    # replaced the same way.
    import os
    import subprocess
    import sys

    from dsec.errors import InvalidArgument
    from dsec.statedir import ensure_private_dir
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    sticky = os.path.join(public_dir, "tmp")
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    target = os.path.join(public_dir, "root-owned")
    os.mkdir(target, 0o700)
    theirs = os.path.join(sticky, "theirs")
    link = os.path.join(sticky, "dsec")

    def plant() -> Any:
        os.mkdir(theirs, 0o777)
        os.symlink(target, link)
        return "planted"
    assert _as_nobody(plant) == "planted"
    with pytest.raises(InvalidArgument, match="symlink .* owned by uid 65534"):
        ensure_private_dir(link)
    r = subprocess.run([sys.executable, "-c", "from dsec.cli.main import main; main()", "up",
                        "--state-dir", link, "--listen", "127.0.0.1:0", "--quiet"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "symlink" in r.stderr, r.stderr[-2000:]
    assert os.listdir(target) == [] and os.listdir(theirs) == []
    # a parent that others may write (not sticky): the directory can be moved away
    loose = os.path.join(public_dir, "loose")
    os.mkdir(loose)
    os.chmod(loose, 0o777)
    with pytest.raises(InvalidArgument, match="other users may write"):
        ensure_private_dir(os.path.join(loose, "state"))
    # root's own symlink is fine, and the real path is what dsec goes on with
    mine = os.path.join(public_dir, "mine")
    os.symlink(target, mine)
    assert ensure_private_dir(mine) == os.path.realpath(target)
    assert ensure_private_dir(os.path.join(sticky, "state")) == os.path.join(sticky, "state")


# ------------------------------------------------------------- the gateway's budget
def test_one_peer_flooding_bad_keys_does_not_lock_others_out_of_the_gateway() -> None:
    # Was a hole (medium; one key holder against every tenant): the gateway (the SDK's
    # default door) charged every failed per-call key to ONE budget ("gateway"), because
    # Aether handlers did not see the peer. A peer spent it with bad keys (100, then
    # 20/s), and from then on every key not already in the principal cache was refused
    # with 429 on every connection: a freshly minted key, a proxy's other tenants' keys,
    # and after an apiserver restart every key. Keys now come once per connection (the
    # bodies carry none) and every failure is charged to the peer's address.
    from dsec.aether import Connection
    from dsec.aether.connection import AUTH_METHOD
    from dsec.control.ratelimit import RateLimitConfig

    async def calls(addr: str, local: str, keys: list[str]) -> list[str]:
        """One connection from ``local`` per key: authenticate with it, call api.info."""
        host, _, port = addr.removeprefix("tcp:").rpartition(":")
        out = []
        for k in keys:
            reader, writer = await asyncio.open_connection(host, int(port),
                                                           local_addr=(local, 0))
            conn = Connection(reader, writer)
            try:
                await conn.call(AUTH_METHOD, k.encode())
                await conn.call("api.info", {})
                out.append("ok")
            except DsecError as exc:
                out.append(exc.code)
            finally:
                await conn.close()
        return out

    with LocalCluster(edges=1, anon_rate=RateLimitConfig(rate_per_s=0.01, burst=6)) as cl:
        assert cl.gateway is not None and cl.gateway.startswith("tcp:127.0.0.1:")
        cl.create_key("mallory", "teamc", "reader")
        victim = cl.create_key("victim", "teamv", "member")
        fresh = cl.create_key("fresh", "teamv", "member")          # never used yet
        guess = "dsk_0123456789abcdef_" + "A" * 43
        flood = asyncio.run(calls(cl.gateway, "127.0.0.2", [guess] * 9))
        assert flood[:6] == ["unauthenticated"] * 6 and flood[6:] == ["rate_limited"] * 3
        # the flooding peer's own new keys wait (its address spent its budget) ...
        assert asyncio.run(calls(cl.gateway, "127.0.0.2", [fresh])) == ["rate_limited"]
        # ... another peer's do not
        assert asyncio.run(calls(cl.gateway, "127.0.0.1", [victim, fresh, guess])) == [
            "ok", "ok", "unauthenticated"]


# ------------------------------------------------------------------------- sessions
def test_a_least_role_key_cannot_fill_the_store_with_sessions() -> None:
    # Was a hole (medium; the least role against every tenant): any key, a reader's
    # included, opened sessions without limit (20,000 in 3.3 s here, kept up to two days
    # each), and the sweeper reads every session row on each pass on the apiserver's
    # event loop (0.15 s per 20,000): minutes of it stalled the apiserver for everyone.
    from dsec.control.api.plane import PlaneConfig

    with LocalCluster(edges=1, plane=PlaneConfig(max_sessions_per_principal=5)) as cl:
        rita = cl.create_key("rita", "teamr", "reader")
        other = cl.create_key("olga", "teamo", "reader")
        h = {"authorization": f"Bearer {rita}"}
        with httpx.Client(base_url=cl.url, timeout=30) as http:
            opened = [http.post("/v1/sessions", json={"lease_s": 86400}, headers=h)
                      for _ in range(3)]
            assert [r.status_code for r in opened] == [201] * 3

            async def gw(n: int) -> list[str]:
                assert cl.gateway is not None
                conn = await connect(cl.gateway, token=rita)
                out = []
                try:
                    for _ in range(n):
                        try:
                            await conn.call("api.session_open", {"lease_s": 60})
                            out.append("ok")
                        except DsecError as exc:
                            out.append(exc.code)
                finally:
                    await conn.close()
                return out
            assert asyncio.run(gw(3)) == ["ok", "ok", "quota_exceeded"]
            r = http.post("/v1/sessions", json={"lease_s": 60}, headers=h)
            assert r.status_code == 429 and r.json()["code"] == "quota_exceeded", r.text
            assert "limit is 5" in r.json()["message"]
            # renewing is fine, and so is another principal; closing and sweeping frees one
            sid = opened[0].json()["id"]
            assert http.post(f"/v1/sessions/{sid}/renew", headers=h).status_code == 200
            assert http.post("/v1/sessions", json={"lease_s": 60}, headers={
                "authorization": f"Bearer {other}"}).status_code == 201
            assert http.delete(f"/v1/sessions/{sid}", headers=h).status_code == 204
            cl._on_loop(cl.runtime.plane.sweep())
            assert http.post("/v1/sessions", json={"lease_s": 60},
                             headers=h).status_code == 201


def test_a_principal_cannot_mint_keys_of_its_own_without_limit() -> None:
    # Was a hole (low; same class as sessions): any principal minted extra keys of its
    # own without limit, each a row in the state store (~20,000 a second per key).
    from dsec.control.api.plane import PlaneConfig

    with LocalCluster(edges=1, plane=PlaneConfig(max_keys_per_principal=3)) as cl:
        rita = cl.create_key("rita", "teamr", "reader")
        body = {"name": "rita", "project": "teamr", "role": "reader"}
        with httpx.Client(base_url=cl.url, timeout=30) as http:
            h = {"authorization": f"Bearer {rita}"}
            got = [http.post("/v1/keys", json=body, headers=h) for _ in range(3)]
            assert [r.status_code for r in got] == [201, 201, 429], got[-1].text
            assert got[-1].json()["code"] == "quota_exceeded"
            # the superuser's grant to her is refused whole: no role without a key
            r = http.post("/v1/keys", json={"name": "rita", "project": "teamx",
                                            "role": "admin", "existing": True},
                          headers={"authorization": f"Bearer {cl.api_key}"})
            assert r.status_code == 429, r.text
            assert http.get("/v1/projects/teamx", headers=h).status_code == 403


# ------------------------------------------------------------- prefix lookups' cost
class _DirOpens:
    """Counts how often the kernel saw the directory ``path`` itself opened (inotify
    IN_OPEN with IN_ISDIR and no name: what listdir does) since the last ``count()``;
    inotify merges an event equal to the last one queued, so count after each step."""

    IN_OPEN, IN_ISDIR, IN_NONBLOCK = 0x20, 0x40000000, 0o4000

    def __init__(self, path: str) -> None:
        import ctypes
        import ctypes.util
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = self._libc.inotify_init1(self.IN_NONBLOCK)
        assert self.fd >= 0
        assert self._libc.inotify_add_watch(self.fd, path.encode(), self.IN_OPEN) >= 0

    def count(self, files: bool = False) -> int:
        """Opens of the directory itself (``files``: of entries in it) since last time."""
        import os
        import struct
        n = 0
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return n
            off = 0
            while off < len(buf):
                _, mask, _, ln = struct.unpack_from("iIII", buf, off)
                if (ln > 0) if files else (mask & self.IN_ISDIR and ln == 0):
                    n += 1
                off += 16 + ln

    def close(self) -> None:
        import os
        os.close(self.fd)


def test_a_digest_prefix_lookup_does_not_reread_the_whole_store(tmp_path: Any) -> None:
    # Was a hole (low-medium; any key against the apiserver): every digest prefix (GET
    # /v1/images/sha256:<12 hex>, or image=sha256:<12 hex> in a create) re-listed the
    # store's manifests/ directory and re-sorted every digest, on the event loop: 72 ms a
    # lookup at 20,000 layers here, so a reader's loop of them stalled every tenant's
    # requests. A lookup while the store is unchanged now reads no directory.
    import os
    import time

    import msgspec

    from dsec.image.catalog import StoreIndex
    from dsec.image.manifest import LayerManifest
    d = tmp_path / "store"
    (d / "manifests").mkdir(parents=True)
    enc = msgspec.json.Encoder()

    def add(hx: str) -> None:
        m = LayerManifest(digest="sha256:" + hx, kind="base", size_bytes=1, created=0.0)
        (d / "manifests" / f"{hx}.json").write_bytes(enc.encode(m))
    for i in range(200):
        add(f"{i:04x}" + "0" * 60)
    index = StoreIndex(str(d)).sync(listing=True)
    time.sleep(0.06)                      # past the racy window of the directory's mtime
    watch = _DirOpens(str(d / "manifests"))
    try:
        reads = 0
        for _ in range(50):
            assert [m.hex for m in index.by_prefix("0012" + "0" * 8)] == ["0012" + "0" * 60]
            reads += watch.count()       # read each time: the kernel merges equal events
        assert reads <= 1                # at most once (the first, after the sync above)
        # and still exact: a layer added since is found by the next lookup
        add("0fff" + "a" * 60)
        assert [m.hex for m in index.by_prefix("0fffaaaa")] == ["0fff" + "a" * 60]
        os.unlink(d / "manifests" / ("0012" + "0" * 60 + ".json"))
        time.sleep(0.06)
        index.sync(listing=True)
        assert index.by_prefix("0012" + "0" * 8) == []
    finally:
        watch.close()


def test_listing_snapshots_does_not_reread_every_manifest(tmp_path: Any) -> None:
    # Was a hole (medium; any key against the edges): GET /v1/snapshots, and every
    # snapshot id prefix (resolved by listing the caller's snapshots), made every edge
    # open and decode every manifest of its layer store: 1.1 s per call at 20,000 layers
    # here, in the edge's small worker-thread pool that its snapshot and file operations
    # share. And a snapshot whose manifest names no project was reported as project
    # "default" (visible to everyone with a role there), not as nobody's.
    import time
    from types import SimpleNamespace

    import msgspec

    from dsec.edge.backends.container.images import StoreImages
    from dsec.edge.backends.container.snapshot import ContainerSnapshots
    from dsec.image.manifest import PROJECT_LABEL, LayerManifest
    from dsec.image.mount import MountCache
    from dsec.image.store import LayerStore
    store = LayerStore(str(tmp_path / "store"))
    enc = msgspec.json.Encoder()
    for i in range(100):
        hx = f"{i:04x}" + "0" * 60
        m = LayerManifest(digest="sha256:" + hx, kind="snapshot", size_bytes=1, created=i,
                          labels={PROJECT_LABEL: "teama"} if i else {})
        (tmp_path / "store" / "manifests" / f"{hx}.json").write_bytes(enc.encode(m))
    cache = MountCache(mount_root=str(tmp_path / "mnt"))
    # the backend is a boundary this test is not about: only its resolver is used
    snaps = ContainerSnapshots(SimpleNamespace(images=StoreImages(store, cache)))  # type: ignore[arg-type]
    first = asyncio.run(snaps.snapshots())
    assert len(first) == 100
    assert first[0].project == "" and {i.project for i in first[1:]} == {"teama"}
    time.sleep(0.06)                      # past the racy window of the directory's mtime
    asyncio.run(snaps.snapshots())
    watch = _DirOpens(str(tmp_path / "store" / "manifests"))
    try:
        opened = 0
        for _ in range(10):
            assert len(asyncio.run(snaps.snapshots())) == 100
            opened += watch.count(files=True)
        assert opened == 0
    finally:
        watch.close()


def test_listing_images_visits_only_what_the_caller_may_see(tmp_path: Any) -> None:
    # Was a hole (medium; any key against the apiserver): GET /v1/images filtered every
    # layer of the cluster for every call (190 ms at 20,000 layers here, 0.04 ms now for
    # a caller that sees none of them), so one reader's loop of listings stalled every
    # tenant. The per-namespace index must answer exactly what the rule says.
    import json
    import random

    import msgspec

    from dsec.image.catalog import StoreIndex, visible
    from dsec.image.manifest import PROJECT_LABEL, LayerManifest
    rng = random.Random(11)
    d = tmp_path / "store"
    (d / "manifests").mkdir(parents=True)
    spaces = [None, "teama", "teama/sub", "teamb", "team", "team2", "org/x"]
    enc = msgspec.json.Encoder()
    refs: dict[str, str] = {}
    digests = []
    for i in range(300):
        hx = f"{i:04x}" + "0" * 60
        ns = rng.choice(spaces)
        kind = rng.choice(["base", "toolkit", "snapshot"])
        labels = {PROJECT_LABEL: ns} if kind == "snapshot" and ns and rng.random() < .5 else {}
        m = LayerManifest(digest="sha256:" + hx, kind=kind, size_bytes=1,  # type: ignore[arg-type]
                          created=float(i), namespace=None if labels else ns, labels=labels)
        (d / "manifests" / f"{hx}.json").write_bytes(enc.encode(m))
        digests.append(m.digest)
        if rng.random() < .3:
            where = rng.choice(spaces)
            refs[(f"{where}/" if where else "") + f"n{i}:latest"] = m.digest
    (d / "refs.json").write_text(json.dumps(refs))
    index = StoreIndex(str(d)).sync(listing=True)
    for roles in ([], ["teama"], ["team"], ["team2"], ["teama/sub", "org"], ["teamb"]):
        def see(ns: str | None, roles: list[str] = roles) -> bool:
            return ns is None or any(ns == p or ns.startswith(p + "/") for p in roles)
        want = [m for m in index.manifests() if visible(index, m, see)]
        assert index.visible_manifests(see) == want, roles
