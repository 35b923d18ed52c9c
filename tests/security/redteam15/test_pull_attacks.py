"""Red team, issue 15 stream ia (dsec.image.pull): a hostile registry / hostile tenant
against the pull path. Real docker-registry on loopback, real skopeo, real layer store.
Every test here FAILS on the code it was written against (branch ia @ 991607a)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.errors import DsecError
from dsec.image import LayerStore
from dsec.image.localregistry import Entry, LocalRegistry, push, tar_entries, write_image
from dsec.image.pull import PullOptions, pull_image

pytestmark = [pytest.mark.root]

CREDS = ("owner-b", "b-private-pw")
SECRET = b"TEAM-B PRIVATE MODEL WEIGHTS\n"
INSECURE = PullOptions(insecure=True)


@pytest.fixture
def regs(tmp_path: Path) -> Iterator[tuple[LocalRegistry, LocalRegistry, str]]:
    """An auth-protected registry holding team B's private image, and an open registry
    an attacker controls. Yields (locked, open, layout dir)."""
    work = tempfile.mkdtemp(prefix="rt15-reg-")
    try:
        with LocalRegistry(os.path.join(work, "locked"), auth=CREDS) as locked, \
                LocalRegistry(os.path.join(work, "open")) as reg:
            yield locked, reg, os.path.join(work, "layout")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _read_layer_files(store: LayerStore, digest: str, tmp: Path) -> bytes:
    """All the bytes of the regular files of one EROFS layer (fsck.erofs --extract)."""
    import subprocess
    out = tmp / "x"
    subprocess.run(["fsck.erofs", f"--extract={out}", store.layer_path(digest)],
                   check=True, capture_output=True)
    data = b""
    for dp, _, fs in os.walk(out):
        for f in fs:
            p = os.path.join(dp, f)
            if os.path.isfile(p) and not os.path.islink(p):
                data += Path(p).read_bytes()
    return data


def test_blob_cache_hands_another_projects_private_blob_to_a_digest_guesser(
        regs: tuple[LocalRegistry, LocalRegistry, str], tmp_path: Path) -> None:
    """Attack: project B pulls its private image from an auth-protected registry and the
    pull fails after skopeo fetched the blobs (here its layer quota; equally a kill -9,
    a timeout, a full disk, a bad diff_id in another layer). The blobs stay in the
    store-wide ``oci-cache`` for a day. Project A, who has no credentials for B's
    registry, pulls from its OWN registry an image whose manifest names B's layer blob
    by digest (A's registry does not even hold the blob). ``link_into`` hard-links the
    cached blob into A's scratch layout, skopeo sees it present and never asks A's
    registry for it, the digests all check out, and A gets B's private content as a
    layer of A's project.

    Safe: a cached blob is only reused for a pull that proved access to it (same
    registry+repository+credentials, or the cache keyed per namespace/registry); A's
    pull fails because its registry cannot serve the blob.
    Observed: A's pull succeeds and A's layer holds B's secret file."""
    locked, reg, lay = regs
    secret_tar = tar_entries([Entry("weights.bin", data=SECRET)])
    built = write_image(lay, "priv", [secret_tar])["amd64"]
    push(lay, "priv", f"{locked.host}/teamb/model:1", creds=":".join(CREDS))
    # A's registry: the same manifest (A learnt the digests: image views list the
    # oci.blob label, configs leak, or the layer is a known one) - then the blob is
    # removed from A's registry storage: A does not have the content.
    push(lay, "priv", f"{reg.host}/teama/steal:1")
    os.unlink(reg.blob_path(built.layers[0]))

    store = LayerStore(str(tmp_path / "store"))
    # (img: a pull refuses blobs over its quota room before fetching them; this room lets
    # the blob in - 4 unpacked bytes per byte of room - and the unpack, whose tar is
    # larger than its gzip, over it: the pull fails after the fetch)
    blob_size = os.path.getsize(os.path.join(lay, "blobs", "sha256", built.layers[0][7:]))
    with pytest.raises(DsecError):
        pull_image(store, f"{locked.host}/teamb/model:1", namespace="teamb",
                   options=PullOptions(insecure=True, creds=":".join(CREDS)),
                   max_bytes=blob_size // 4 + 1)
    assert store.refs() == {}            # B's pull stored nothing...
    # (fix15a: the cache is partitioned per pull scope, pull.cache_scope)
    import glob
    cached = [os.path.basename(p) for p in glob.glob(os.path.join(
        store.root, "oci-cache", "scopes", "*", "blobs", "sha256", "*"))]
    assert built.layers[0][7:] in cached  # ...but B's blob waits in the shared cache

    stolen = None
    try:
        stolen = pull_image(store, f"{reg.host}/teama/steal:1", namespace="teama",
                            options=INSECURE)
    except DsecError:
        pass                             # the safe outcome: A's registry has no blob
    if stolen is not None:
        content = _read_layer_files(store, stolen.image.digest, tmp_path)
        assert SECRET not in content, "project A obtained project B's private layer"
    assert stolen is None, "a pull was served a blob its registry does not hold"


def test_pull_without_creds_uses_the_apiserver_hosts_registry_login(
        regs: tuple[LocalRegistry, LocalRegistry, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: the operator logged the apiserver host into a private registry (skopeo /
    podman / docker login: ``$REGISTRY_AUTH_FILE``, ``$XDG_RUNTIME_DIR/containers/
    auth.json``, ``~/.docker/config.json``) - e.g. for one team's images. Any member of
    any project pulls (``images.pull`` without creds, or ``create(image=REF)``, whose
    first-use pull is documented to use "the apiserver host's" credentials) from that
    registry into their own project: skopeo picks the host's login up by itself.

    Safe: a pull on behalf of a caller uses only the credentials that caller gave (or
    credentials the operator bound to that project); skopeo runs with an empty auth
    file when the caller gave none, so the private repository answers 401.
    Observed: project A's creds-less pull of the private image succeeds."""
    locked, _reg, lay = regs
    write_image(lay, "priv", [tar_entries([Entry("weights.bin", data=SECRET)])])
    push(lay, "priv", f"{locked.host}/teamb/model:1", creds=":".join(CREDS))
    auth = tmp_path / "host-auth.json"
    auth.write_text(json.dumps({"auths": {locked.host: {"auth": base64.b64encode(
        ":".join(CREDS).encode()).decode()}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))   # the apiserver host's login

    store = LayerStore(str(tmp_path / "store"))
    got = None
    try:
        got = pull_image(store, f"{locked.host}/teamb/model:1", namespace="teama",
                         options=INSECURE)
    except DsecError:
        pass
    assert got is None, ("project A pulled a private image with the apiserver host's "
                         "registry login, having given no credentials")


@pytest.mark.parametrize("config", [{"WorkingDir": "../.."}, {"Env": ["A\x00B=1"]},
                                    {"Env": ["BIG=" + "x" * (600 << 10)]}])
def test_a_config_every_create_will_refuse_is_pulled_and_named(
        config: dict[str, object], regs: tuple[LocalRegistry, LocalRegistry, str],
        tmp_path: Path) -> None:
    """Attack (hostile image author, or just a sloppy one): an image config the sandbox
    spec rules refuse - a relative WorkingDir, an Env name with NUL, 600 KiB of Env
    (over the spec's 512 KiB env limit). The pull stores and names it; then every
    ``create`` from it fails with "sandbox spec field cwd='../..' is invalid", blaming a
    field the caller never set (with_image_defaults validates the merged spec).

    Safe: the pull checks the config against the same rules (SandboxSpec's cwd/env/user
    checks) and refuses with an error naming the image and the config field, storing
    nothing. Observed: pulled and named."""
    from dsec.control.api.images import with_image_defaults
    from dsec.wire.spec import SandboxSpec

    _locked, reg, lay = regs
    write_image(lay, "cfg", [tar_entries([Entry("f", data=b"f")])], config)
    push(lay, "cfg", f"{reg.host}/t/cfg:1")
    store = LayerStore(str(tmp_path / "store"))
    try:
        res = pull_image(store, f"{reg.host}/t/cfg:1", namespace="teama", options=INSECURE)
    except DsecError:
        assert store.refs() == {}
        return
    with pytest.raises(DsecError) as info:
        with_image_defaults(SandboxSpec(image=res.key, project="teama"), res.image)
    pytest.fail(f"pulled and named {res.key}, whose every create fails: {info.value}")
