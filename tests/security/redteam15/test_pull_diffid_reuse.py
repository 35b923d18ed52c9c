"""Red team, issue 15 stream ia: layer reuse by diff_id trusts the (attacker's) config.
The attacker's registry is a minimal OCI distribution server of our own
(hostile_registry.Hostile, loopback) that serves whatever manifest/config/blobs it is
given - what a hostile registry does."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from dsec.errors import DsecError
from dsec.image import LayerStore
from dsec.image.localregistry import Entry, tar_entries
from dsec.image.pull import PullOptions, pull_image
from tests.security.redteam15.hostile_registry import Hostile

pytestmark = [pytest.mark.root]


def _sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def _put(h: Hostile, repo: str, tag: str, layers: list[tuple[bytes, str]]) -> str:
    """Serve an image whose layer blobs and config diff_ids are given as they are."""
    descs, diffs = [], []
    for gz, diff in layers:
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                      "digest": h.blob(gz), "size": len(gz)})
        diffs.append(diff)
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                      "rootfs": {"type": "layers", "diff_ids": diffs}}).encode()
    return h.manifest(repo, tag, {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": h.blob(cfg), "size": len(cfg)},
        "layers": descs})


def test_a_child_project_member_stacks_the_parents_private_layer_by_naming_its_diff_id(
        tmp_path: Path) -> None:
    """Attack: project ``org`` pulled a private image (its own registry, credentials);
    its layers live in namespace ``org``. Mallory is a member of ``org/team`` only - no
    role on ``org``, so she cannot see or use org's images. She serves from her own
    registry an image of two layers, both the SAME harmless blob E, with a config whose
    diff_ids are [diff_id of org's private layer, diff_id of E]. skopeo fetches and
    verifies blob E; ``_find`` then reuses org's layer for position 0 purely by the
    diff_id her config claims (``may_point_at``: an ancestor's layer), without ever
    checking that position 0's blob (E) unpacks to that diff_id. Her image in
    ``org/team`` now stacks org's private layer: any sandbox she starts from it reads it.

    Safe: a layer is reused for a position only when that position's blob is verified to
    be that layer (same blob digest label AND the blob fetched/verified from the
    caller's registry), or - for layers of namespaces the caller cannot read - never.
    Observed: the pull succeeds and its stack contains org's layer."""
    store = LayerStore(str(tmp_path / "store"))
    h = Hostile()
    try:
        secret = tar_entries([Entry("secret.txt", data=b"ORG PRIVATE\n")])
        top = tar_entries([Entry("top.txt", data=b"top\n")])
        _put(h, "org/private", "1", [(gzip.compress(secret, mtime=0), _sha(secret)),
                                     (gzip.compress(top, mtime=0), _sha(top))])
        org = pull_image(store, f"{h.host}/org/private:1", namespace="org",
                         options=PullOptions(insecure=True))
        private = org.layers[-1]                 # bottom: the secret layer, namespace org
        assert private.namespace == "org"

        h.blobs.clear()                          # mallory never has org's blobs
        h.manifests.clear()
        evil = tar_entries([Entry("evil.txt", data=b"mallory\n")])
        egz = gzip.compress(evil, mtime=0)
        _put(h, "team/steal", "1", [(egz, _sha(secret)), (egz, _sha(evil))])
        try:
            got = pull_image(store, f"{h.host}/team/steal:1", namespace="org/team",
                             options=PullOptions(insecure=True))
        except DsecError:
            return                               # refused: safe
        stack = [store.get(d) for d in got.image.stack]
        assert private.digest not in got.image.stack, (
            f"org/team's image {got.key} stands on org's private layer {private.digest} "
            f"(namespaces of its stack: {[m.namespace for m in stack]})")
    finally:
        h.close()


def test_a_foreign_layer_escapes_the_error_tree_as_filenotfounderror(tmp_path: Path) -> None:
    """Attack: a manifest whose layer is ``...nondistributable...`` with ``urls`` (a
    "foreign" layer, one of the media types ia accepts). skopeo copies to an oci: layout
    without fetching foreign layers, and ``_pull`` then stats the blob that is not there:
    a raw ``FileNotFoundError`` (an internal error at the API door, a traceback at the
    CLI) instead of a DsecError saying foreign layers are not pulled.

    Safe: refused up front with ImageError naming the layer (or the URL fetched under
    the same registry rules). Observed: FileNotFoundError."""
    store = LayerStore(str(tmp_path / "store"))
    h = Hostile()
    try:
        raw = tar_entries([Entry("f", data=b"f")])
        gz = gzip.compress(raw, mtime=0)
        cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                          "rootfs": {"type": "layers", "diff_ids": [_sha(raw)]}}).encode()
        h.manifest("t/foreign", "1", {
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": h.blob(cfg), "size": len(cfg)},
            "layers": [{"mediaType":
                        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
                        "digest": _sha(gz), "size": len(gz),
                        "urls": ["http://127.0.0.1:9/never"]}]})
        with pytest.raises(DsecError):
            pull_image(store, f"{h.host}/t/foreign:1", namespace="teama",
                       options=PullOptions(insecure=True))
    finally:
        h.close()
