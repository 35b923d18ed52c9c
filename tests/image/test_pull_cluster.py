"""Registry pulls through the API, against a real container cluster and a real local
registry (issue 15 §1, §2): images.pull at every door with the namespace rules of
builds, create(image=<registry ref>) pulling on first use as the project's
``registry_pull`` setting says, and the image config (Env, WorkingDir, User) becoming the
sandbox's defaults, overridable per create and per exec."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from dsec import Client, LocalCluster
from dsec.errors import ImageNotFound, PermissionDenied
from dsec.image.busybox import stage_busybox_root
from dsec.image.localregistry import Entry, LocalRegistry, push, tar_dir, tar_entries, write_image
from dsec.image.store import LayerStore
from tests.security.conftest import _rmdir_everywhere

DOORS = ("aether", "http")
CONFIG = {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "FOO=from-image", "KEEP=1"],
          "WorkingDir": "/srv/app", "User": "1000:1000", "Cmd": ["sh"],
          "Labels": {"org.example.team": "infra"}}


@dataclass
class World:
    cluster: LocalCluster
    registry: LocalRegistry
    alice: str              # admin of teama
    bob: str                # member of teamb
    http: httpx.Client
    layout: str = ""        # the OCI layout the registry was seeded from (image "app")

    def ref(self, repo: str) -> str:
        return f"{self.registry.host}/{repo}"

    def client(self, key: str, door: str) -> Client:
        return Client(self.cluster.url, key, gateway=self.cluster.gateway, protocol=door,
                      session_lease_s=None)

    def store(self) -> LayerStore:
        return LayerStore(os.path.join(self.cluster.state_dir, "layers"))


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    work = tempfile.mkdtemp(prefix="dsec-regc-")
    root = tempfile.mkdtemp(prefix="dsec-bb-")
    try:
        stage_busybox_root(root)
        os.makedirs(os.path.join(root, "srv/app"))
        with open(os.path.join(root, "etc/passwd"), "a") as f:
            f.write("app:x:1000:1000:app:/srv/app:/bin/sh\n")
        base = tar_dir(root)
        lay = os.path.join(work, "layout")
        write_image(lay, "app", [base, tar_entries([Entry("srv", "dir"), Entry("srv/app", "dir"),
                                                    Entry("srv/app/hello", data=b"hi\n")])],
                    CONFIG)
        with LocalRegistry(os.path.join(work, "reg")) as reg, \
                LocalCluster(edges=1, backend="container", registries=("127.0.0.1",)) as cl:
            for repo in ("team/app:1", "team/app:2", "team/app:3", "team/denied:1"):
                push(lay, "app", f"{reg.host}/{repo}")
            cgroup = os.path.abspath(os.path.join(cl.state_dir, "container", "edge-0"))
            http = httpx.Client(base_url=cl.url, timeout=120)
            try:
                yield World(cl, reg, cl.create_key("alice", "teama", "admin"),
                            cl.create_key("bob", "teamb", "member"), http, lay)
            finally:
                http.close()
        _rmdir_everywhere("dsec-" + hashlib.sha1(cgroup.encode()).hexdigest()[:10])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def test_pull_at_every_door_with_the_namespace_rules(world: World) -> None:
    for door in DOORS:
        with world.client(world.alice, door) as c:
            v = c.images.pull(world.ref("team/app:1"), project="teama", insecure=True)
            host = world.registry.host.replace(":", "-")
            assert f"teama/{host}_team_app:1" in v.refs and v.namespace == "teama"
            assert v.labels["oci.workingdir"] == '"/srv/app"'
            named = c.images.pull(world.ref("team/app:1"), name="teama/myapp:v1",
                                  insecure=True)
            assert named.digest == v.digest         # the same layers, another name
            # a member of teama may not write cluster-wide names, nor another project's
            with pytest.raises(PermissionDenied, match="cluster-wide"):
                c.images.pull(world.ref("team/app:1"), insecure=True)
            with pytest.raises(PermissionDenied):
                c.images.pull(world.ref("team/app:1"), project="teamb", insecure=True)
            with pytest.raises(ImageNotFound):
                c.images.pull(world.ref("team/nothere:1"), project="teama", insecure=True)
        with world.client(world.bob, door) as c:
            with pytest.raises(PermissionDenied):
                c.images.pull(world.ref("team/app:1"), name="teama/bobs", insecure=True)
            # bob does not see teama's pulled image
            with pytest.raises(ImageNotFound):
                c.images.get(f"teama/{world.registry.host.replace(':', '-')}_team_app:1")
    # raw REST: the same rule, the same words
    r = world.http.post("/v1/images/pull", json={"ref": world.ref("team/app:1"),
                                                 "project": "teama", "insecure": True},
                        headers={"authorization": f"Bearer {world.bob}"})
    assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text


def test_create_pulls_on_first_use_and_honours_the_image_config(world: World) -> None:
    ref = world.ref("team/app:2")
    store = world.store()
    before = set(store.refs())
    with world.client(world.alice, "aether") as c:
        with c.sandboxes.create(image=ref, project="teama") as sb:
            host = world.registry.host.replace(":", "-")
            assert sb.info.spec.image == f"teama/{host}_team_app:2"
            r = sb.exec("pwd; id -u; id -g; echo $FOO; cat hello")
            assert r.stdout.decode().split() == ["/srv/app", "1000", "1000", "from-image",
                                                 "hi"], r
            # per exec: env, cwd and user win over the image's
            r = sb.exec("pwd; id -un; echo $FOO", env={"FOO": "exec"}, cwd="/", user="root")
            assert r.stdout.decode().split() == ["/", "root", "exec"], r
        assert set(store.refs()) - before == {f"teama/{host}_team_app:2"}
        # per create: env, cwd and user win over the image's (the image is pulled now)
        with c.sandboxes.create(image=ref, project="teama", env={"FOO": "create"},
                                cwd="/tmp", user="app") as sb:
            r = sb.exec("pwd; id -un; echo $FOO $KEEP")
            assert r.stdout.decode().split() == ["/tmp", "app", "create", "1"], r
        assert set(store.refs()) - before == {f"teama/{host}_team_app:2"}


def test_registry_pull_setting_refuses_and_names_itself(world: World) -> None:
    root = {"authorization": f"Bearer {world.cluster.api_key}"}
    r = world.http.put("/v1/quotas/teamb", json={"registry_pull": False}, headers=root)
    assert r.status_code == 200, r.text
    assert r.json()["quota"]["registry_pull"] is False
    before = set(world.store().refs())
    try:
        for door in DOORS:
            with world.client(world.bob, door) as c, \
                    pytest.raises(PermissionDenied, match="registry_pull=false"):
                c.sandboxes.create(image=world.ref("team/denied:1"), project="teamb")
        assert set(world.store().refs()) == before
        # an explicit pull by a member is still allowed; then create finds it
        with world.client(world.bob, "http") as c:
            c.images.pull(world.ref("team/denied:1"), project="teamb", insecure=True)
            with c.sandboxes.create(image=world.ref("team/denied:1"), project="teamb") as sb:
                assert sb.exec("echo $FOO").stdout == b"from-image\n"
    finally:
        world.http.put("/v1/quotas/teamb", json={}, headers=root)


def test_a_batch_of_creates_pulls_once(world: World) -> None:
    ref = world.ref("team/app:3")
    with world.client(world.alice, "http") as c:
        boxes = c.sandboxes.create_many(3, image=ref, project="teama")
        try:
            for sb in boxes:
                assert sb.exec("echo $FOO").stdout == b"from-image\n"
        finally:
            for sb in boxes:
                sb.kill()
    tops = [m for m in world.store().manifests()
            if m.labels.get("oci.ref") == ref and m.namespace == "teama"]
    assert len(tops) == 1


def test_the_apiserver_pulls_only_from_allowed_registries(world: World) -> None:
    from dsec.control.api.images import check_registry

    images = world.cluster.runtime.plane.images
    host = world.registry.host
    check_registry(host, ("127.0.0.1",))                      # any port
    check_registry(host, (host,))
    check_registry("reg.example.com:443", ("*.example.com:*",))
    with pytest.raises(PermissionDenied):
        check_registry(host, ("127.0.0.1:1",))
    # the default opens no loopback, link-local or private address (red team F6)
    for internal in ("127.0.0.1:5000", "localhost:5000", "169.254.169.254", "10.1.2.3:80",
                     "[::1]:5000", "192.168.1.1", "0.0.0.0:5000"):
        with pytest.raises(PermissionDenied, match="by default"):
            check_registry(internal, None)
    check_registry("registry.example.com", None)
    check_registry("8.8.8.8:5000", None)
    before = set(world.store().refs())
    was = images.registries
    images.registries = ("registry.example.com",)
    try:
        for door in DOORS:
            with world.client(world.alice, door) as c:
                with pytest.raises(PermissionDenied, match="does not pull from registry"):
                    c.images.pull(world.ref("team/app:1"), project="teama", name="teama/x",
                                  insecure=True)
                with pytest.raises(PermissionDenied, match="does not pull from registry"):
                    c.sandboxes.create(image=world.ref("team/denied:1"), project="teama")
    finally:
        images.registries = was
    assert set(world.store().refs()) == before


def test_a_build_from_a_registry_image_runs_on_its_layers_under_its_config(
        world: World, tmp_path: object) -> None:
    """Image.from_registry and a Dockerfile's FROM <registry ref> (issue 15 §3): the base
    is pulled into the build's project (images.pull rules), the steps run on its layers
    as its User in its WorkingDir with its Env, the named result keeps that config; a
    rebuild hits the step cache; a tag moved to another image is a miss."""
    from dsec.client.build import Image

    ref = world.ref("team/build:1")
    push(world.layout, "app", ref)
    img = (Image.from_registry(ref)
           .run('pwd > /var/tmp/pwd && id -u > /var/tmp/uid && echo "$FOO" > /var/tmp/foo')
           .env({"B": "2"}))
    with world.client(world.alice, "aether") as c:
        built = img.build(c, project="teama", name="teama/fromreg:1")
        assert (built.ran, built.cached) == (1, 0)
        assert (built.config.workdir, built.config.user) == ("/srv/app", "1000:1000")
        assert built.config.env_dict["FOO"] == "from-image" and built.config.env_dict["B"] == "2"
        with c.sandboxes.create(image="teama/fromreg:1", project="teama") as sb:
            r = sb.exec("cat /var/tmp/pwd /var/tmp/uid /var/tmp/foo hello; echo $B; id -u")
            assert r.stdout.decode().split() == ["/srv/app", "1000", "from-image", "hi", "2",
                                                 "1000"], r
        again = img.build(c, project="teama")
        assert (again.ran, again.cached) == (0, 1) and again.top == built.top

        # the same recipe as a Dockerfile
        ctx = os.path.join(str(tmp_path), "ctx")
        os.makedirs(ctx)
        with open(os.path.join(ctx, "Dockerfile"), "w") as f:
            f.write(f"FROM {ref}\nUSER root\nRUN echo df > /etc/df\n")
        df = Image.from_dockerfile(os.path.join(ctx, "Dockerfile"))
        assert repr(df).startswith(f"Image.from_registry({ref!r})")
        d = df.build(c, project="teama")
        assert d.ran == 1 and d.config.user == "root" and d.config.workdir == "/srv/app"
        with c.sandboxes.create(**d.create_args(), project="teama") as sb:
            assert sb.exec("cat /etc/df; echo $FOO").stdout == b"df\nfrom-image\n"

        # the tag moves to another image: the pulled base differs, the cache misses
        lay = os.path.join(str(tmp_path), "layout2")
        root = tempfile.mkdtemp(prefix="dsec-bb-")
        try:
            stage_busybox_root(root)
            write_image(lay, "moved", [tar_dir(root), tar_entries([Entry("moved", data=b"m")])],
                        CONFIG)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        push(lay, "moved", ref)
        moved = img.build(c, project="teama")
        assert (moved.ran, moved.cached) == (1, 0) and moved.base != built.base
    # the pull went through the apiserver's policy: a registry it does not allow fails
    # the build before any step
    images = world.cluster.runtime.plane.images
    was = images.registries
    images.registries = ("registry.example.com",)
    try:
        with world.client(world.alice, "http") as c, \
                pytest.raises(PermissionDenied, match="does not pull from registry"):
            img.build(c, project="teama")
    finally:
        images.registries = was


def test_promote_squash_flattens_the_base_in(world: World) -> None:
    """image_promote (issue 15 §3): by default the steps become one layer over the
    base's own layers (shared); squash=True makes one standalone layer holding the base
    too, whiteouts applied, and runs the same."""
    from dsec.client.build import Image

    ref = world.ref("team/squash:1")
    push(world.layout, "app", ref)
    img = (Image.from_registry(ref).user("root")
           .run("echo one > /etc/one && rm /srv/app/hello")
           .run("echo two > /etc/two"))
    store = world.store()
    with world.client(world.alice, "http") as c:
        shared = img.build(c, project="teama", name="teama/shared:1")
        flat = img.build(c, project="teama", name="teama/flat:1", squash=True)
        assert (flat.ran, flat.cached) == (0, 2)          # the steps came from the cache
        s_top = store.get(c.images.get("teama/shared:1").digest)
        f_top = store.get(c.images.get("teama/flat:1").digest)
        pulled = store.get(shared.base)
        assert list(s_top.stack) == [pulled.digest, *pulled.stack]   # 2 shared layers
        assert list(f_top.stack) == [] and f_top.size_bytes > s_top.size_bytes
        for name in ("teama/shared:1", "teama/flat:1"):
            with c.sandboxes.create(image=name, project="teama") as sb:
                r = sb.exec("cat /etc/one /etc/two; ls /srv/app; echo $FOO; ls /bin/sh")
                assert r.stdout.decode().split() == ["one", "two", "from-image", "/bin/sh"], (
                    name, r)


def test_every_door_refuses_a_redirect_off_the_allowed_registries(world: World) -> None:
    """Red team F16 through the API: the apiserver's pulls (images.pull, a create's
    first-use pull) hold its registry list on the redirects a listed registry answers;
    the refused host is never contacted, nothing is stored."""
    from tests.image.registry_server import Listener, Registry

    reg = Registry(world.layout, "team/app")
    cdn = Registry(world.layout, "team/app")
    trap = Listener()
    images = world.cluster.runtime.plane.images
    was = images.registries
    images.registries = (reg.host,)
    store = world.store()
    before = set(store.refs())
    try:
        reg.redirect_blobs = f"http://{trap.host}"
        for door in DOORS:
            with world.client(world.alice, door) as c:
                with pytest.raises(PermissionDenied, match=f"redirect.*{trap.host}"):
                    c.images.pull(f"{reg.host}/team/app:app", project="teama", insecure=True)
                with pytest.raises(PermissionDenied, match=f"redirect.*{trap.host}"):
                    c.sandboxes.create(image=f"{reg.host}/team/app:app", project="teama")
        assert trap.accepted == 0 and set(store.refs()) == before
        # a blob host the operator lists: the same pull goes through it
        images.registry_blob_hosts = (cdn.host,)
        reg.redirect_blobs = cdn.url
        with world.client(world.alice, "http") as c:
            c.images.pull(f"{reg.host}/team/app:app", project="teama", insecure=True)
        assert any(p.startswith("/blob/") for _, p, _ in cdn.log)
    finally:
        cdn.close()
        images.registries = was
        images.registry_blob_hosts = ()
        trap.close()
        reg.close()
