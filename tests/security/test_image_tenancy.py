"""Tenancy of images and snapshots (issue 11, item 1), against a real container cluster.

Principals: the bootstrap superuser owns the cluster-wide names; ``alice`` administers
``teama`` only; ``bob`` is a member of ``teamb``; ``mallory`` of ``teamc``. Every door is
tried: the SDK over the Aether gateway (its default transport), the SDK over REST, and
raw REST; what the edge is asked to resolve is checked in the created sandbox's spec.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import shutil
import tarfile
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from dsec import Client, LocalCluster
from dsec.errors import DsecError
from tests.security.conftest import _rmdir_everywhere

DOORS = ("aether", "http")


def _tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class World:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.root_key = cluster.api_key
        self.alice = cluster.create_key("alice", "teama", "admin")
        self.bob = cluster.create_key("bob", "teamb", "member")
        self.mallory = cluster.create_key("mallory", "teamc", "member")
        self.http = httpx.Client(base_url=cluster.url, timeout=60)
        self.alices_victim: dict[str, Any] = {}

    def h(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    def client(self, key: str, door: str) -> Client:
        return Client(self.cluster.url, key, gateway=self.cluster.gateway, protocol=door,
                      session_lease_s=None)

    def build(self, key: str, name: str, text: str, kind: str = "toolkit") -> httpx.Response:
        """POST /v1/images: a one-file tree (/etc/whoami.txt) as layer ``name``."""
        return self.http.post("/v1/images", params={"name": name, "kind": kind},
                              content=_tar({"etc/whoami.txt": text}), headers=self.h(key))

    def tag(self, key: str, source: str, target: str) -> httpx.Response:
        return self.http.post("/v1/images/tag", json={"source": source, "target": target},
                              headers=self.h(key))

    def snapshot_in(self, key: str, project: str, secret: str) -> str:
        r = self.http.post("/v1/sandboxes", json={"project": project}, headers=self.h(key))
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = self.http.post(f"/v1/sandboxes/{sid}/exec", headers=self.h(key),
                           json={"shell": f"echo {secret} > /root/secret"})
        assert r.json()["exit_code"] == 0, r.text
        r = self.http.post(f"/v1/sandboxes/{sid}/snapshot", headers=self.h(key))
        assert r.status_code == 201, r.text
        self.http.delete(f"/v1/sandboxes/{sid}", headers=self.h(key))
        return str(r.json()["id"])


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    with LocalCluster(edges=1, backend="container") as cl:
        w = World(cl)
        root_dir = os.path.abspath(os.path.join(cl.state_dir, "container", "edge-0"))
        try:
            r = w.build(w.root_key, "victim", "superuser\n")
            assert r.status_code == 201, r.text
            r = w.build(w.alice, "teama/victim", "alice\n")
            assert r.status_code == 201, r.text
            w.alices_victim = r.json()["items"][0]
            yield w
        finally:
            w.http.close()
    _rmdir_everywhere("dsec-" + hashlib.sha1(root_dir.encode()).hexdigest()[:10])


def _whoami(c: Client, **create: Any) -> tuple[str, Any]:
    with c.sandboxes.create(**create) as sb:
        r = sb.exec("cat /etc/whoami.txt")
        return r.stdout.decode(), sb.info.spec


def test_a_project_admin_cannot_move_a_cluster_wide_name(world: World) -> None:
    # The repro of issue 11: the superuser built `victim`; alice, admin of teama only,
    # rebuilt `victim` from her own tree (it succeeded); bob (teamb) started from
    # `victim` and ran alice's files. The same path moved `base`.
    r = world.build(world.alice, "victim", "alice\n")
    assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
    assert "cluster-wide" in r.json()["message"] and "teama/" in r.json()["message"]
    r = world.build(world.alice, "base", "alice\n", kind="base")
    assert r.status_code == 403, r.text
    # nor by tagging her own tree (or anything) with a cluster-wide name
    assert world.build(world.alice, "teama/mine", "alice\n").status_code == 201
    for target in ("victim", "base", "victim:v2"):
        r = world.tag(world.alice, "teama/mine", target)
        assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
    for door in DOORS:
        with world.client(world.bob, door) as c:
            who, spec = _whoami(c, toolkits=["victim"], project="teamb")
            assert c.transport_name == door
            assert who == "superuser\n", door
            # the base is still the busybox one: its shell ran `cat`
            assert spec.image == "base" and spec.toolkits == ("victim",)


def test_bare_names_resolve_in_the_sandboxs_project_then_cluster_wide(world: World) -> None:
    made = world.alices_victim     # built by alice as teama/victim
    assert (made["ref"], made["namespace"], made["owner"]) == (
        "teama/victim:latest", "teama", "alice")
    for door in DOORS:
        with world.client(world.alice, door) as c:
            who, spec = _whoami(c, toolkits=["victim"], project="teama")
            assert who == "alice\n"
            # what the edge was asked to resolve: the name qualified by its project, which
            # a store looks up exactly (never "the caller's project" on the edge)
            assert spec.toolkits == ("teama/victim",)
            who, spec = _whoami(c, toolkits=["sha256:" + made["digest"][7:19]],
                                project="teama")
            assert who == "alice\n" and spec.toolkits == (made["digest"],)
        with world.client(world.bob, door) as c:
            assert _whoami(c, toolkits=["victim"], project="teamb")[0] == "superuser\n"
    # the listing says whose each layer is, and shows another project's to nobody else
    with world.client(world.bob, "http") as c:
        mine = {i.ref: i for i in c.images.list()}
    assert "teama/victim:latest" not in mine and made["digest"] not in {
        i.digest for i in mine.values()}
    assert mine["victim:latest"].namespace is None and mine["victim:latest"].owner == "admin"
    assert mine["base:latest"].namespace is None
    with world.client(world.alice, "http") as c:
        # by every name: builds are reproducible, so teama/mine (the same tree, built by
        # alice in the first test) is the same layer as teama/victim
        hers = {r: i for i in c.images.list() for r in i.refs}
        assert hers["teama/victim:latest"].owner == "alice"
        assert c.images.get("victim").namespace == "teama"       # her project first
        assert c.images.get("victim:latest").digest == made["digest"]
    raw = world.http.get("/v1/images", headers=world.h(world.bob)).json()["items"]
    assert all("namespace" in i and "owner" in i for i in raw)   # always in the JSON


def _create_answers(world: World, key: str, field: str, ref: str) -> list[tuple[str, str]]:
    """(code, message with the ref replaced) of a create naming ``ref`` in ``field``,
    through raw REST and the SDK over both doors."""
    body: dict[str, Any] = {"project": "teamb"}
    body[field] = [ref] if field == "toolkits" else ref
    out = []
    r = world.http.post("/v1/sandboxes", json=body, headers=world.h(key))
    out.append((r.json().get("code", str(r.status_code)),
                r.json().get("message", "").replace(ref, "X")))
    for door in DOORS:
        with world.client(key, door) as c:
            try:
                sb = c.sandboxes.create(**body)
            except DsecError as exc:
                out.append((exc.code, exc.message.replace(ref, "X")))
            else:
                sb.kill()
                out.append(("created", ""))
    return out


def test_other_projects_layers_answer_exactly_like_missing_ones(world: World) -> None:
    # Was an oracle: another project's snapshot digest (or 12-hex prefix) as image=
    # answered "is a snapshot layer" with the full id, an unknown one "no image".
    r = world.build(world.alice, "teama/ws", "alice ws\n", kind="workspace")
    assert r.status_code == 201, r.text
    ws = r.json()["items"][0]["digest"]
    r = world.build(world.alice, "teama/tools", "alice tools\n")
    assert r.status_code == 201, r.text
    tools = r.json()["items"][0]["digest"]
    snap = world.snapshot_in(world.alice, "teama", "teama-secret")
    foreign = ["teama/tools", "teama/tools:latest", "teama/ws", tools, tools[:19], ws,
               ws[:19], snap, snap[:19], snap[:30]]
    missing = ["teama/nope", "teamz/victim", "sha256:" + secrets.token_hex(32),
               "sha256:" + secrets.token_hex(6)]
    for field in ("image", "workspace", "toolkits"):
        answers = {ref: _create_answers(world, world.bob, field, ref)
                   for ref in foreign + missing}
        first = answers[missing[0]][0]
        assert first[0] == "image_not_found", first
        for ref, got in answers.items():
            assert got == [first] * 3, (field, ref, got)
    # the same refs through the image routes: get, delete, tag
    for ref in foreign + missing:
        g = world.http.get(f"/v1/images/{ref}", headers=world.h(world.bob))
        d = world.http.delete(f"/v1/images/{ref}", headers=world.h(world.bob))
        t = world.tag(world.bob, ref, "teamb/stolen")
        for resp in (g, d, t):
            assert resp.status_code == 404, (ref, resp.request.method, resp.text)
            assert resp.json()["message"].replace(ref, "X") == \
                g.json()["message"].replace(ref, "X") or resp is g
        assert g.json()["message"].replace(ref, "X") == world.http.get(
            f"/v1/images/{missing[0]}", headers=world.h(world.bob)).json()["message"].replace(
            missing[0], "X")
    # nothing was created, nothing deleted, nothing tagged
    assert world.http.get("/v1/images/teama/ws", headers=world.h(world.alice)).status_code == 200
    assert world.http.get("/v1/images/teamb/stolen", headers=world.h(world.bob)).status_code \
        == 404
    listed = world.http.get("/v1/sandboxes", params={"project": "teamb"},
                            headers=world.h(world.bob)).json()["items"]
    assert listed == []
    # the owner gets the helpful answers for its own layers
    r = world.http.post("/v1/sandboxes", json={"project": "teama", "image": snap[:19]},
                        headers=world.h(world.alice))
    assert r.status_code == 400 and "snapshot=" in r.json()["message"], r.text
    r = world.http.post("/v1/sandboxes", json={"project": "teama", "image": tools},
                        headers=world.h(world.alice))
    assert r.status_code == 400 and "toolkit layer" in r.json()["message"], r.text


def test_a_tag_never_moves_to_a_tree_built_outside_its_namespace(world: World) -> None:
    r = world.build(world.bob, "teamb/bobs", "bob\n")       # a member writes its project
    assert r.status_code == 201, r.text
    assert world.build(world.bob, "teama/x", "bob\n").status_code == 403
    assert world.build(world.bob, "tools", "bob\n").status_code == 403   # cluster-wide
    # nor can an upload pass for a snapshot (it would list under another project)
    r = world.build(world.bob, "teamb/fake", "bob\n", kind="snapshot")
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    # even the superuser cannot give a project's tree a cluster-wide name ...
    r = world.tag(world.root_key, "teama/victim", "victim")
    assert r.status_code == 403 and "built in project 'teama'" in r.json()["message"], r.text
    # ... nor another project's name; a descendant of its project is fine
    assert world.tag(world.root_key, "teama/victim", "teamb/victim").status_code == 403
    r = world.tag(world.root_key, "teama/victim", "teama/sub/victim")
    assert r.status_code == 200 and r.json()["namespace"] == "teama", r.text
    # a cluster-wide layer may carry a project's name (its builder had every right)
    r = world.tag(world.alice, "base", "teama/mybase")
    assert r.status_code == 200 and "teama/mybase:latest" in r.json()["refs"], r.text
    # and snapshots are no images
    snap = world.snapshot_in(world.alice, "teama", "s")
    r = world.tag(world.alice, snap, "teama/snap")
    assert r.status_code == 403 and "snapshot=" in r.json()["message"], r.text
    # the victim is still the superuser's everywhere
    with world.client(world.bob, "aether") as c:
        assert _whoami(c, toolkits=["victim"], project="teamb")[0] == "superuser\n"
    # deleting: a name of one's own project goes (the shared layer under it stays) ...
    d = world.http.delete("/v1/images/teama/mybase", headers=world.h(world.alice))
    assert d.status_code == 204, d.text
    assert world.http.get("/v1/images/base", headers=world.h(world.bob)).status_code == 200
    # ... a cluster-wide one is the superuser's
    d = world.http.delete("/v1/images/base", headers=world.h(world.alice))
    assert d.status_code == 403, d.text
    base = world.http.get("/v1/images/base", headers=world.h(world.alice)).json()["digest"]
    d = world.http.delete(f"/v1/images/{base}", headers=world.h(world.alice))
    assert d.status_code == 403, d.text
    # the last name of a project's own layer takes the layer with it (a tree of its own:
    # builds are reproducible, and "alice\n" is teama/victim's layer, named twice)
    r = world.build(world.alice, "teama/short-lived", "alice, short-lived\n")
    assert r.status_code == 201, r.text
    digest = r.json()["items"][0]["digest"]
    assert world.http.delete("/v1/images/teama/short-lived",
                             headers=world.h(world.alice)).status_code == 204
    assert world.http.get(f"/v1/images/{digest}",
                          headers=world.h(world.alice)).status_code == 404


def test_snapshot_prefixes_never_expand_across_projects(world: World) -> None:
    # A prefix used to go to the edges, whose store expanded it over every project's
    # layers: a prefix shared with another project's snapshot answered "ambiguous"
    # (naming both ids, or "it matches 2 layers"). Real digests almost never share 12
    # hex digits, so the collision is planted: a copy of mallory's snapshot manifest
    # under a digest that starts like alice's snapshot.
    theirs = world.snapshot_in(world.alice, "teama", "teama-secret")
    mine = world.snapshot_in(world.mallory, "teamc", "teamc-data")
    store = os.path.join(world.cluster.state_dir, "layers")
    planted = theirs[:19] + mine[19:]
    with open(os.path.join(store, "manifests", mine[7:] + ".json")) as f:
        manifest = json.load(f)
    manifest["digest"] = planted
    planted_path = os.path.join(store, "manifests", planted[7:] + ".json")
    with open(planted_path, "w") as f:
        json.dump(manifest, f)
    shutil.copy(os.path.join(store, "layers", mine[7:] + ".erofs"),
                os.path.join(store, "layers", planted[7:] + ".erofs"))
    # ... and recorded as mallory's (a snapshot is visible to tenants only with the
    # control plane's record of it, never on an edge's word: red team 16, F2)
    plane = world.cluster.runtime.plane
    rec = plane.snapshot_record(mine)
    assert rec is not None and rec.project == "teamc"
    plane.store.charge_snapshot(msgspec.structs.replace(rec, id=planted), [])
    try:
        prefix = theirs[:19]
        for door in DOORS:
            with world.client(world.mallory, door) as c:
                got = c.snapshots.get(prefix)
                assert got.id == planted and got.view.project == "teamc", door
                assert theirs not in [s.id for s in c.snapshots.list()]
        r = world.http.get(f"/v1/snapshots/{prefix}", headers=world.h(world.mallory))
        assert r.status_code == 200 and r.json()["id"] == planted, r.text
        r = world.http.get(f"/v1/images/{prefix}", headers=world.h(world.mallory))
        assert r.status_code == 200 and r.json()["digest"] == planted, r.text
        r = world.http.post("/v1/sandboxes", json={"project": "teamc", "image": prefix},
                            headers=world.h(world.mallory))
        assert r.status_code == 400 and theirs not in r.text and planted in r.text, r.text
        # the owner's prefix finds the owner's snapshot only
        r = world.http.get(f"/v1/snapshots/{prefix}", headers=world.h(world.alice))
        assert r.status_code == 200 and r.json()["id"] == theirs, r.text
        # the superuser sees both: a real ambiguity, said without guessing
        r = world.http.get(f"/v1/snapshots/{prefix}", headers=world.h(world.root_key))
        assert r.status_code == 400 and "ambiguous" in r.json()["message"], r.text
        # another project's full id, through every door and every snapshot operation,
        # answers like an id nobody has; list filters answer like an unknown sandbox
        nobody = "sha256:" + secrets.token_hex(32)
        for door in DOORS:
            with world.client(world.mallory, door) as c:
                answers = []
                for ref in (theirs, nobody):
                    for call in (lambda r: c.snapshots.get(r), lambda r: c.snapshots.delete(r),
                                 lambda r: c.sandboxes.create(snapshot=r, project="teamc")):
                        with pytest.raises(DsecError) as e:
                            call(ref)
                        answers.append((e.value.code, e.value.message.replace(ref, "X")))
                assert answers[:3] == answers[3:], (door, answers)
                assert {a[0] for a in answers} == {"image_not_found"}
        with world.client(world.alice, "http") as c:
            alice_sb = c.snapshots.get(theirs).view.sandbox_id
        with world.client(world.mallory, "aether") as c:
            assert c.snapshots.list(sandbox_id=alice_sb) == []
            assert c.snapshots.list(sandbox_id="sb-000000000000-edge-0") == []
        assert world.http.get(f"/v1/snapshots/{theirs}",
                              headers=world.h(world.alice)).status_code == 200
    finally:
        plane.store.delete_snapshot_charge(planted)
        os.unlink(planted_path)
        os.unlink(os.path.join(store, "layers", planted[7:] + ".erofs"))


def test_project_builds_share_the_projects_layer_storage_quota(world: World) -> None:
    # Members may build into their project now; the layer store is one disk, so a
    # project's images count against its layer-storage quota (snapshot_bytes) like its
    # snapshots do. A refused build leaves nothing behind and moves no name.
    admin = world.h(world.root_key)
    quinn = world.cluster.create_key("quinn", "teamq", "member")
    first = world.build(quinn, "teamq/img", "one\n")
    assert first.status_code == 201, first.text
    size = first.json()["items"][0]["size_bytes"]
    r = world.http.put("/v1/quotas/teamq", json={"snapshot_bytes": size + size // 2},
                       headers=admin)
    assert r.status_code == 200, r.text
    assert world.http.get("/v1/projects/teamq", headers=admin).json()["usage"][
        "snapshot_bytes"] == size
    before = set(os.listdir(os.path.join(world.cluster.state_dir, "layers", "layers")))
    r = world.build(quinn, "teamq/img", "two\n")
    assert r.status_code == 429 and r.json()["code"] == "quota_exceeded", r.text
    assert set(os.listdir(os.path.join(world.cluster.state_dir, "layers", "layers"))) == before
    got = world.http.get("/v1/images/teamq/img", headers=world.h(quinn)).json()
    assert got["digest"] == first.json()["items"][0]["digest"]      # the name did not move
    # deleting gives the room back
    assert world.http.delete("/v1/images/teamq/img", headers=world.h(quinn)).status_code == 204
    assert world.http.get("/v1/projects/teamq", headers=admin).json()["usage"][
        "snapshot_bytes"] == 0
    assert world.build(quinn, "teamq/img", "two\n").status_code == 201
    # cluster-wide layers (a superuser's) are nobody's quota
    assert world.build(world.root_key, "shared-tools", "x\n").status_code == 201


def test_prune_is_a_superusers_at_every_door(world: World) -> None:
    """``image_prune`` (issue 15): a rebuild leaves the old layer unnamed; only a
    superuser may prune (the store is every project's), through the SDK over the gateway
    and over REST and raw REST alike; dry_run removes nothing; a real prune removes the
    garbage, gives its bytes back to the project's quota and keeps every named layer."""
    admin = world.h(world.root_key)
    pat = world.cluster.create_key("pat", "teamp", "admin")
    old = world.build(pat, "teamp/img", "one\n").json()["items"][0]
    new = world.build(pat, "teamp/img", "two\n").json()["items"][0]
    assert old["digest"] != new["digest"]
    usage = world.http.get("/v1/projects/teamp", headers=admin).json()["usage"]
    assert usage["snapshot_bytes"] == old["size_bytes"] + new["size_bytes"]
    layers = os.path.join(world.cluster.state_dir, "layers", "layers")
    before = set(os.listdir(layers))
    for key in (pat, world.alice, world.bob):
        r = world.http.post("/v1/images/prune", json={}, headers=world.h(key))
        assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
        for door in DOORS:
            with world.client(key, door) as c, pytest.raises(DsecError) as err:
                c.images.prune()
            assert err.value.code == "permission_denied", door
    assert set(os.listdir(layers)) == before
    r = world.http.post("/v1/images/prune", json={"dry_run": True}, headers=admin)
    assert r.status_code == 200, r.text
    assert old["digest"] in [m["digest"] for m in r.json()["removed"]]
    with world.client(world.root_key, "aether") as c:
        dry = c.images.prune(dry_run=True)
        assert old["digest"] in [m.digest for m in dry.removed] and dry.dry_run
        assert set(os.listdir(layers)) == before
        done = c.images.prune()
    gone = {m.digest for m in done.removed}
    assert old["digest"] in gone and new["digest"] not in gone
    assert done.freed_bytes == sum(m.size_bytes for m in done.removed)
    assert old["digest"].removeprefix("sha256:") + ".erofs" not in os.listdir(layers)
    assert world.http.get("/v1/projects/teamp", headers=admin).json()["usage"][
        "snapshot_bytes"] == new["size_bytes"]
    for ref, key in (("teamp/img", pat), ("victim", admin), ("teama/victim", world.alice),
                     ("base", admin)):
        assert world.http.get(f"/v1/images/{ref}", headers=world.h(key) if key != admin
                              else admin).status_code == 200, ref
    with world.client(world.bob, "http") as c:
        assert _whoami(c, toolkits=["victim"], project="teamb")[0] == "superuser\n"


def test_project_image_storage_shows_and_binds_at_every_door(world: World) -> None:
    """``usage.image_bytes`` (issue 15): the layers a project's names reach, shared ones
    counted in full, at REST and the gateway; an ``image_bytes`` quota binds every way a
    name lands in the project (build, tag) under the store's lock, and a refused one
    names nothing and leaves no layer."""
    from dsec.wire import ops
    from dsec.wire.api import QuotaBody
    from dsec.wire.calls import ProjectRef, QuotaSet

    admin = world.h(world.root_key)
    uma = world.cluster.create_key("uma", "teamu", "member")
    made = world.build(uma, "teamu/one", "uma one\n").json()["items"][0]
    base = world.http.get("/v1/images/base", headers=admin).json()

    def usage(door: str) -> int:
        if door == "rest":
            view = world.http.get("/v1/projects/teamu", headers=admin).json()
            return int(view["usage"]["image_bytes"])
        with world.client(world.root_key, "aether") as c:
            got: int = c.call(ops.PROJECT_GET, ProjectRef(path="teamu")).usage["image_bytes"]
            return got

    assert usage("rest") == usage("aether") == made["size_bytes"]
    # a cluster-wide layer the project names is charged to it in full
    assert world.tag(uma, "base", "teamu/mybase").status_code == 200
    assert usage("rest") == usage("aether") == made["size_bytes"] + base["size_bytes"]
    limit = made["size_bytes"] + base["size_bytes"] + made["size_bytes"] // 2
    with world.client(world.root_key, "aether") as c:
        view = c.call(ops.QUOTA_SET, QuotaSet(path="teamu",
                                               quota=QuotaBody(image_bytes=limit)))
        assert view.quota is not None and view.quota.image_bytes == limit
    layers = os.path.join(world.cluster.state_dir, "layers", "layers")
    before = set(os.listdir(layers))
    r = world.build(uma, "teamu/two", "uma two, a different tree\n")
    assert r.status_code == 429 and r.json()["code"] == "quota_exceeded", r.text
    assert "image_bytes" in r.json()["message"]
    assert set(os.listdir(layers)) == before
    assert world.http.get("/v1/images/teamu/two", headers=world.h(uma)).status_code == 404
    # a name moving within the same layers costs nothing; one more layer does
    assert world.tag(uma, "teamu/one", "teamu/again").status_code == 200
    r = world.tag(uma, "victim", "teamu/victim")
    assert r.status_code == 429 and r.json()["code"] == "quota_exceeded", r.text
    # a subproject's names count for its ancestors
    world.cluster.create_key("uma2", "teamu/sub", "member")
    r = world.http.put("/v1/quotas/teamu", json={"image_bytes": None}, headers=admin)
    assert r.status_code == 200, r.text
    assert world.build(uma, "teamu/sub/x", "uma sub\n").status_code == 201
    assert usage("rest") > made["size_bytes"] + base["size_bytes"]


def test_a_prune_behind_the_control_planes_back_gives_the_bytes_back(world: World) -> None:
    """`dsec image prune` on the host (or the store budget) removes a project's rebuilt-
    over layer without the apiserver: its charge goes at the next look, not forever."""
    from dsec.image import LayerStore

    admin = world.h(world.root_key)
    rita = world.cluster.create_key("rita", "teamr", "member")
    old = world.build(rita, "teamr/img", "rita one\n").json()["items"][0]
    new = world.build(rita, "teamr/img", "rita two\n").json()["items"][0]
    usage = world.http.get("/v1/projects/teamr", headers=admin).json()["usage"]
    assert usage["snapshot_bytes"] == old["size_bytes"] + new["size_bytes"]
    res = LayerStore(os.path.join(world.cluster.state_dir, "layers")).prune()
    assert old["digest"] in {m.digest for m in res.removed}
    for _ in range(2):     # and stays so (the charge row is gone, not skipped)
        usage = world.http.get("/v1/projects/teamr", headers=admin).json()["usage"]
        assert usage["snapshot_bytes"] == new["size_bytes"]
        assert usage["image_bytes"] == new["size_bytes"]
