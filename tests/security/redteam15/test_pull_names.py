"""Red team, issue 15 stream ia: what a registry ref turns into on the apiserver
(``ImageAdmin.pull_on_create``, ``dsec.image.registry.local_name``, ``check_registry``).
The real ImageAdmin over a real layer store; only the network pull itself is replaced
(by a recorder) where the test is about what would be pulled, not the pulling."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dsec.control.api.images import ImageAdmin, check_registry
from dsec.control.api.service import Caller
from dsec.errors import DsecError
from dsec.image import LayerStore
from dsec.image.registry import local_name, parse_registry_ref
from dsec.wire.api import ImageList, ImagePullRequest
from dsec.wire.spec import SandboxSpec


class _Charges:
    def snapshot_room(self, project: str) -> int | None:
        return None

    def registry_pull(self, project: str) -> tuple[bool, str | None]:
        return True, None

    def check_snapshot(self, project: str, size_bytes: int) -> None:
        pass

    def charge_snapshot(self, snapshot_id: str, project: str, node: str,
                        size_bytes: int, *, kind: str | None = None,
                        parent: str | None = None, stack: tuple[str, ...] = ()) -> None:
        pass

    def release_snapshot(self, snapshot_id: str) -> None:
        pass

    # (fix15a) the merged SnapshotCharges protocol (ib's image_bytes quota)
    def image_limits(self, project: str) -> list[tuple[str, int]]:
        return []


MEMBER = Caller(id="k-mallory", name="mallory", roles={"teama": "member"},
                default_project="teama")
VICTIM = Caller(id="k-victor", name="victor", roles={"teama": "member"},
                default_project="teama")


def _admin(tmp_path: Path) -> tuple[ImageAdmin, list[ImagePullRequest]]:
    admin = ImageAdmin(_Charges(), layer_dir=str(tmp_path / "layers"))
    pulls: list[ImagePullRequest] = []

    async def record(caller: Caller, req: ImagePullRequest) -> ImageList:
        pulls.append(req)
        return ImageList(items=[])
    admin.pull_image = record
    return admin, pulls


def test_first_use_pull_turns_off_tls_for_public_hosts_named_127_something(
        tmp_path: Path) -> None:
    """Attack: ``create(image="127.attacker.example/app:1")``. ``_pull_for_create`` decides
    "loopback -> plain HTTP, no TLS verification" with ``host.startswith("127.")`` on the
    host NAME, so a public DNS name beginning with ``127.`` is pulled over plain HTTP /
    unverified TLS: anyone on the path serves the image (tags are not digest-pinned).

    Safe: only an IP literal in 127.0.0.0/8 (ipaddress.ip_address(host).is_loopback),
    ``localhost`` and ``[::1]`` are insecure by default.
    Observed: the pull request carries insecure=True for 127.attacker.example."""
    admin, pulls = _admin(tmp_path)
    spec = SandboxSpec(image="127.attacker.example/app:1", project="teama")
    asyncio.run(admin.pull_on_create(VICTIM, spec))
    assert len(pulls) == 1
    assert pulls[0].insecure is False, "TLS verification turned off for a public host name"


def test_digest_pinned_create_runs_whatever_a_member_tagged_under_the_derived_name(
        tmp_path: Path) -> None:
    """Attack: a project member tags any layer of the project as the local name a
    digest-pinned registry ref maps to (``<host-port>_<repo>:sha256-<hex>``: images.tag /
    build / pull with ``name=``). Another member's ``create(image="reg:5000/app@sha256:D")``
    - a pin meant to guarantee exactly the image with manifest digest D - is resolved by
    ``pull_on_create`` to that name without checking anything, and runs the planted layer.

    Safe: a digest-pinned ref resolves only to a layer pulled from that manifest digest
    (record it as a label on the top layer and check it), else pull.
    Observed: the create is pointed at the planted layer."""
    admin, _pulls = _admin(tmp_path)
    admin.registries = ("127.0.0.1",)    # (fix15a) loopback is opened by the operator (F6)
    store = LayerStore(str(tmp_path / "layers"))

    # (fix15a) the stand-in pull does what a real one does: it stores the image pulled
    # from the ref (its oci.ref label) and moves the name to it; an empty answer is
    # nothing pull_image ever returns.
    async def record(caller: Caller, req: ImagePullRequest) -> ImageList:
        _pulls.append(req)
        d = tmp_path / "real"
        d.mkdir()
        (d / "app").write_text("the image with manifest digest D\n")
        real = store.add_tree(str(d), kind="base", namespace="teama", owner=caller.id,
                              labels={"oci.ref": req.ref})
        store.tag(real.digest, name, tag, namespace="teama")
        return ImageList(items=[])
    admin.pull_image = record
    src = tmp_path / "evil"
    src.mkdir()
    (src / "backdoor").write_text("planted by mallory\n")
    D = "sha256:" + "d" * 64
    name, tag = local_name(parse_registry_ref(f"127.0.0.1:5000/app@{D}"))
    evil = store.add_tree(str(src), kind="base", namespace="teama", owner=MEMBER.id)
    store.tag(evil.digest, name, tag, namespace="teama")     # what images.tag lets a member do

    spec = SandboxSpec(image=f"127.0.0.1:5000/app@{D}", project="teama")
    out = asyncio.run(admin.pull_on_create(VICTIM, spec))
    resolved = store.get(out.image)
    assert resolved.digest != evil.digest, (
        f"create(image=...@{D[:19]}...) resolved to the layer a member planted "
        f"({out.image}) without the pull ever seeing manifest {D[:19]}...")


@pytest.mark.parametrize(("a", "b"), [
    ("quay.io/org/python:3.12", "quay.io/org_python:3.12"),
    ("127.0.0.1:5000/team/app:1", "127.0.0.1-5000/team/app:1"),
    ("[::1]:5000/app:1", "[::1:5000]/app:1"),
])
def test_two_registry_refs_share_one_local_name(a: str, b: str, tmp_path: Path) -> None:
    """Attack: ``local_name`` flattens ``/`` to ``_`` and ``:`` to ``-`` and drops IPv6
    brackets, so two different images (another repository on the same registry, or a
    different host) get the same store name. A member pulls ``quay.io/org_python:3.12``
    (their own repo) into the project; every later ``create(image="quay.io/org/python:3.12")``
    in the project finds that name already there and runs the other repository's image.

    Safe: the local name is injective (escape, or append a hash of the canonical ref),
    or pull_on_create checks the stored image's ``oci.ref`` label equals the ref.
    Observed: equal names; pull_on_create resolves b to a's image without a pull."""
    assert local_name(parse_registry_ref(a)) != local_name(parse_registry_ref(b))


def test_default_registry_policy_lets_any_member_make_the_apiserver_fetch_internal_urls(
        ) -> None:
    """Attack: with the default ``registries=None`` ("any"), ``create(image=
    "169.254.169.254/latest:1")`` or ``"127.0.0.1:<apiserver/edge/etcd port>/x:1"``
    makes the apiserver connect wherever a caller says (plain HTTP for loopback, see
    above), and skopeo's error text (classified into "cannot reach" vs "refused" vs
    "not found", with up to 600 chars of it echoed) turns it into a port scanner of the
    apiserver's network, cloud metadata included. Redirects from any allowed registry
    are followed by skopeo to any host too.

    Safe: the default refuses loopback, link-local, private and the apiserver's own
    addresses unless an operator lists them (``--registry``); a literal allow-list entry
    does not extend to redirect targets.
    Observed: every internal address is allowed by default."""
    from dsec.cluster.runtime import ClusterConfig  # the default the apiserver starts with

    default = ClusterConfig(state_dir="/nonexistent").registries
    refused = 0
    for host in ("169.254.169.254", "127.0.0.1:2379", "10.0.0.1:8080", "[::1]:9000"):
        try:
            check_registry(host, default)
        except DsecError:
            refused += 1
    assert refused == 4, "internal / metadata addresses are pullable by default"


