"""Pulls from a real registry (Debian's docker-registry on loopback, started here) with
the pull (dsec.image.distribution), into a real layer store, mounted as real overlays (issue 15 §1)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from dsec.errors import (
    CorruptLayer,
    ImageNotFound,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
)
from dsec.image import LayerStore, MountCache
from dsec.image.busybox import stage_busybox_root
from dsec.image.compose import compose, mount_root
from dsec.image.localregistry import (
    Built,
    Entry,
    LocalRegistry,
    push,
    tar_dir,
    tar_entries,
    write_image,
)
from dsec.image.pull import DIFFID_LABEL, PullOptions, pull_image
from dsec.image.registry import defaults_from_labels, parse_platform

CREDS = ("puller", "s3cret-pw")
CONFIG = {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "FOO=from-image"],
          "WorkingDir": "/opt/data", "User": "1000:1000", "Cmd": ["sh"],
          "Labels": {"org.example.team": "infra"}}


@dataclass
class Seeded:
    open: LocalRegistry
    locked: LocalRegistry
    a: Built            # busybox + 2 layers: whiteout + opaque dir
    b: Built            # shares a's first two layers
    bad: Built          # a config whose last diff_id is wrong

    def ref(self, repo: str, *, locked: bool = False) -> str:
        return f"{(self.locked if locked else self.open).host}/{repo}"


def _layers() -> tuple[bytes, bytes, bytes, bytes]:
    root = tempfile.mkdtemp(prefix="dsec-bb-")
    try:
        stage_busybox_root(root)
        base = tar_dir(root)
    finally:
        shutil.rmtree(root)
    l2 = tar_entries([Entry("etc", "dir"), Entry("etc/greeting", data=b"hello\n"),
                      Entry("opt", "dir"), Entry("opt/data", "dir"),
                      Entry("opt/data/a", data=b"A"), Entry("opt/keep", "dir"),
                      Entry("opt/keep/x", data=b"x"), Entry("opt/keep/y", data=b"y")])
    l3 = tar_entries([Entry("etc", "dir"), Entry("etc/greeting", "whiteout"),
                      Entry("opt", "dir"), Entry("opt/keep", "dir"),
                      Entry("opt/keep", "opaque"), Entry("opt/keep/z", data=b"z")])
    l3b = tar_entries([Entry("app", "dir"), Entry("app/b", data=b"image b\n")])
    return base, l2, l3, l3b


@pytest.fixture(scope="module")
def seeded() -> Iterator[Seeded]:
    work = tempfile.mkdtemp(prefix="dsec-reg-")
    try:
        with LocalRegistry(os.path.join(work, "open")) as reg, \
                LocalRegistry(os.path.join(work, "locked"), auth=CREDS) as locked:
            base, l2, l3, l3b = _layers()
            lay = os.path.join(work, "layout")
            a = write_image(lay, "a", [base, l2, l3], CONFIG)["amd64"]
            b = write_image(lay, "b", [base, l2, l3b])["amd64"]
            write_image(lay, "multi", {
                "amd64": [tar_entries([Entry("arch", data=b"amd64\n")])],
                "arm64": [tar_entries([Entry("arch", data=b"arm64\n")])]})
            bad = write_image(lay, "bad", [tar_entries([Entry("f", data=b"bad")])],
                              bad_diff_id=True)["amd64"]
            write_image(lay, "corrupt", [tar_entries([Entry("c", data=b"c" * 5000)])])
            write_image(lay, "single", [tar_entries([Entry("one", data=b"1")])])
            for t in ("a", "b", "multi", "bad", "corrupt", "single"):
                push(lay, t, f"{reg.host}/dsec/{t}:1")
            push(lay, "a", f"{locked.host}/team/private:1", creds=":".join(CREDS))
            yield Seeded(reg, locked, a, b, bad)
    finally:
        shutil.rmtree(work, ignore_errors=True)


INSECURE = PullOptions(insecure=True)


def _tree(root: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p) and os.path.isfile(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = fh.read()[:64].decode(errors="replace")
    return out


def _state(store: LayerStore) -> tuple[list[str], dict[str, str], list[str]]:
    return ([m.digest for m in store.manifests()], store.refs(),
            sorted(os.listdir(os.path.join(store.root, "tmp"))))


def test_pull_three_layers_whiteouts_and_opaque_dirs(seeded: Seeded, store: LayerStore,
                                                      cache: MountCache,
                                                      tmp_path: object) -> None:
    res = pull_image(store, seeded.ref("dsec/a:1"), options=INSECURE)
    # one EROFS layer per OCI layer, the top one named and standing on the other two
    assert len(res.layers) == 3 and len(res.made) == 3
    assert [m.labels[DIFFID_LABEL] for m in res.layers] == seeded.a.diff_ids[::-1]
    top = store.get(f"127.0.0.1-{seeded.open.port}_dsec_a:1")
    assert top.digest == res.image.digest
    assert top.stack == tuple(m.digest for m in res.layers[1:])
    d = defaults_from_labels(top.labels)
    assert d.env["FOO"] == "from-image" and d.cwd == "/opt/data" and d.user == "1000:1000"
    assert d.labels == {"org.example.team": "infra"}
    stack = compose(top, base_lowers=[store.get(x) for x in top.stack])
    assert stack.digests == tuple(m.digest for m in res.layers)
    root = mount_root(store, cache, stack, os.path.join(str(tmp_path), "sb"))
    try:
        files = _tree(root.target)
        assert files["opt/data/a"] == "A"
        assert not os.path.lexists(os.path.join(root.target, "etc/greeting"))   # whiteout
        assert sorted(os.listdir(os.path.join(root.target, "opt/keep"))) == ["z"]  # opaque
        assert os.path.isfile(os.path.join(root.target, "bin/busybox"))
    finally:
        root.unmount()
    assert sorted(os.listdir(os.path.join(store.root, "tmp"))) == []


def _cached(store: LayerStore) -> set[str]:
    """The blobs in the store's blob cache, every scope (pull.cache_scope)."""
    import glob
    return {os.path.basename(p) for p in glob.glob(
        os.path.join(store.root, "oci-cache", "scopes", "*", "blobs", "sha256", "*"))}


def test_images_sharing_a_base_share_its_layers(seeded: Seeded, store: LayerStore,
                                                cache: MountCache, tmp_path: object) -> None:
    a = pull_image(store, seeded.ref("dsec/a:1"), options=INSECURE)
    b = pull_image(store, seeded.ref("dsec/b:1"), options=INSECURE)
    assert len(b.made) == 1                            # only b's own top layer was built
    assert b.layers[1:] == a.layers[1:]                # the shared base: the same layers
    assert len(os.listdir(os.path.join(store.root, "layers"))) == 4
    # the blob cache keeps no second copy of pulled images: their layers are stored
    assert _cached(store) == set()
    ra = mount_root(store, cache, compose(a.image, base_lowers=a.layers[1:]),
                    os.path.join(str(tmp_path), "a"))
    rb = mount_root(store, cache, compose(b.image, base_lowers=b.layers[1:]),
                    os.path.join(str(tmp_path), "b"))
    try:
        assert ra.lowerdirs[1:] == rb.lowerdirs[1:]    # one mount per shared layer
        assert len(cache.mounted()) == 4
        with open(os.path.join(rb.target, "app/b")) as f:
            assert f.read() == "image b\n"
        assert os.path.isfile(os.path.join(rb.target, "etc/greeting"))
    finally:
        ra.unmount()
        rb.unmount()
    # pulling the same image again builds nothing and fetches nothing
    again = pull_image(store, seeded.ref("dsec/a:1"), options=INSECURE)
    assert again.made == [] and again.image.digest == a.image.digest
    assert again.fetched_bytes == 0


def test_index_picks_platform(seeded: Seeded, store: LayerStore, cache: MountCache,
                              tmp_path: object) -> None:
    host = pull_image(store, seeded.ref("dsec/multi:1"), options=INSECURE, tag="host")
    arm = pull_image(store, seeded.ref("dsec/multi:1"), tag="arm",
                     options=PullOptions(insecure=True, platform=parse_platform("linux/arm64")))
    assert host.image.labels["oci.platform"] == "linux/amd64"
    assert arm.image.labels["oci.platform"] == "linux/arm64"
    for res, want in ((host, "amd64\n"), (arm, "arm64\n")):
        r = mount_root(store, cache, compose(res.image), os.path.join(str(tmp_path), want[:5]))
        try:
            with open(os.path.join(r.target, "arch")) as f:
                assert f.read() == want
        finally:
            r.unmount()
    with pytest.raises(ImageNotFound, match="no linux/s390x variant.*linux/amd64, linux/arm64"):
        pull_image(store, seeded.ref("dsec/multi:1"),
                   options=PullOptions(insecure=True, platform=parse_platform("linux/s390x")))


def test_auth_protected_repo(seeded: Seeded, store: LayerStore) -> None:
    ref = seeded.ref("team/private:1", locked=True)
    before = _state(store)
    with pytest.raises(PermissionDenied, match="--creds"):
        pull_image(store, ref, options=INSECURE)
    with pytest.raises(PermissionDenied) as wrong:
        pull_image(store, ref, options=PullOptions(insecure=True, creds="puller:nope"))
    assert "nope" not in str(wrong.value)
    assert _state(store) == before
    res = pull_image(store, ref, options=PullOptions(insecure=True, creds=":".join(CREDS)))
    assert len(res.layers) == 3
    # a docker-style auth file works too
    import base64
    import json
    auth = os.path.join(store.root, "..", "auth.json")
    with open(auth, "w") as f:
        json.dump({"auths": {seeded.locked.host: {
            "auth": base64.b64encode(":".join(CREDS).encode()).decode()}}}, f)
    res2 = pull_image(store, ref, options=PullOptions(insecure=True, authfile=auth))
    assert res2.image.digest == res.image.digest and res2.made == []


def test_clear_errors_and_nothing_half_created(seeded: Seeded, store: LayerStore) -> None:
    before = _state(store)
    with pytest.raises(ImageNotFound, match="no image"):
        pull_image(store, seeded.ref("dsec/nothere:1"), options=INSECURE)
    with pytest.raises(ImageNotFound):
        pull_image(store, seeded.ref("dsec/a:nosuchtag"), options=INSECURE)
    with pytest.raises(Unavailable, match="cannot reach registry"):
        pull_image(store, "127.0.0.1:1/dsec/a:1", options=INSECURE)
    with pytest.raises(Unavailable, match="--insecure"):
        pull_image(store, seeded.ref("dsec/a:1"))
    with pytest.raises(InvalidArgument, match="not a registry ref"):
        pull_image(store, "python:3.11", options=INSECURE)
    with pytest.raises(InvalidArgument):
        pull_image(store, seeded.ref("Dsec/UPPER:1"), options=INSECURE)
    # a config whose diff_id does not match the layer: checked by us, nothing kept
    with pytest.raises(CorruptLayer, match="diff_id"):
        pull_image(store, seeded.ref("dsec/bad:1"), options=INSECURE)
    assert _state(store) == before
    # what a failed pull fetched stays cached for its retry
    assert seeded.bad.layers[0][7:] in _cached(store)


def test_corrupt_blob_in_registry(seeded: Seeded, store: LayerStore) -> None:
    # the registry serves bytes that do not match the digest: the pull refuses them
    import json
    import subprocess
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                          f"docker://{seeded.ref('dsec/corrupt:1')}"],
                         capture_output=True, check=True).stdout
    digest = json.loads(raw)["layers"][0]["digest"]
    path = seeded.open.blob_path(digest)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)
    before = _state(store)
    with pytest.raises(CorruptLayer):
        pull_image(store, seeded.ref("dsec/corrupt:1"), options=INSECURE)
    assert _state(store) == before
    assert digest[7:] not in _cached(store)


def test_pulled_layer_in_use_is_not_removed(seeded: Seeded, store: LayerStore) -> None:
    from dsec.errors import InUse
    res = pull_image(store, seeded.ref("dsec/a:1"), options=INSECURE)
    with pytest.raises(InUse, match="image .* builds on it"):
        store.remove(res.layers[-1].digest)


def test_cli_pull_and_inspect(seeded: Seeded, store: LayerStore) -> None:
    import json

    from click.testing import CliRunner

    from dsec.cli.image import image
    ref = seeded.ref("dsec/a:1")
    r = CliRunner().invoke(image, ["--root", store.root, "pull", ref, "--insecure", "-q",
                                   "--name", "teama/app:v1"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("teama/app:v1 sha256:") and "3 layers (3 new, 0 shared)" \
        in r.output
    r = CliRunner().invoke(image, ["--root", store.root, "inspect", "teama/app:v1"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["defaults"]["cwd"] == "/opt/data" and doc["defaults"]["user"] == "1000:1000"
    assert doc["defaults"]["env"]["FOO"] == "from-image" and len(doc["layers"]) == 3
    assert doc["namespace"] == "teama"
    # a refusal is one line naming the fix, and nothing is stored
    r = CliRunner().invoke(image, ["--root", store.root, "pull", seeded.ref("dsec/a:1"),
                                   "-q", "--name", "teama/app:v2"])
    assert r.exit_code != 0 and "--insecure" in r.output
    assert "teama/app:v2" not in store.refs()
