"""Pure logic of registry pulls: refs, local names, platform selection, layer pairing,
image config -> sandbox defaults (dsec.image.registry)."""

from __future__ import annotations

import pytest

from dsec.errors import ImageError, ImageNotFound, InvalidArgument
from dsec.image.manifest import parse_ref
from dsec.image.registry import (
    ImageDefaults,
    Platform,
    defaults_from_labels,
    defaults_labels,
    host_platform,
    image_defaults,
    image_layers,
    is_registry_ref,
    local_name,
    parse_platform,
    parse_registry_ref,
    select_manifest,
)

D = "sha256:" + "a" * 64
E = "sha256:" + "b" * 64


@pytest.mark.parametrize(("ref", "host", "repo", "tag", "digest"), [
    ("127.0.0.1:5000/team/python:3.12", "127.0.0.1:5000", "team/python", "3.12", None),
    ("registry.example.com/app", "registry.example.com", "app", "latest", None),
    ("docker://localhost/a/b:t", "localhost", "a/b", "t", None),
    (f"reg.io/x@{D}", "reg.io", "x", None, D),
    (f"reg.io/x:1@{D}", "reg.io", "x", "1", D),
    ("docker.io/python:3.11", "docker.io", "library/python", "3.11", None),
    ("[::1]:5000/a:1", "[::1]:5000", "a", "1", None),
])
def test_parse_registry_ref(ref: str, host: str, repo: str, tag: str | None,
                            digest: str | None) -> None:
    r = parse_registry_ref(ref)
    assert (r.host, r.repo, r.tag, r.digest) == (host, repo, tag, digest)
    assert is_registry_ref(ref)


@pytest.mark.parametrize("ref", ["python:3.11", "teama/tools:v1", "base", "org/team/x:1",
                                 "sha256:" + "a" * 64])
def test_store_names_are_not_registry_refs(ref: str) -> None:
    assert not is_registry_ref(ref)
    with pytest.raises(InvalidArgument, match="not a registry ref"):
        parse_registry_ref(ref)


@pytest.mark.parametrize("ref", ["reg.io/UPPER:1", "reg.io/a:b:c", "reg.io/x@sha256:12",
                                 "reg.io/a:" + "t" * 200, "reg.io/a//b", "reg.io/", ""])
def test_bad_registry_refs(ref: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_registry_ref(ref)


def test_local_name_is_a_valid_store_name() -> None:
    name, tag = local_name(parse_registry_ref("127.0.0.1:5000/team/python:3.12"))
    assert (name, tag) == ("127.0.0.1-5000_team_python", "3.12")
    assert parse_ref(f"teama/{name}:{tag}").name == name
    name, tag = local_name(parse_registry_ref(f"reg.io/x@{D}"))
    assert tag == "sha256-" + "a" * 64 and parse_ref(f"{name}:{tag}").tag == tag
    long = parse_registry_ref("reg.io/" + "/".join(["abcdefghij"] * 20) + ":1")
    name, _ = local_name(long)
    assert len(name) <= 128 and parse_ref(name).name == name
    other = parse_registry_ref("reg.io/" + "/".join(["abcdefghij"] * 19) + "/x:1")
    assert local_name(other)[0] != name


def test_platforms() -> None:
    assert host_platform("x86_64") == Platform("linux", "amd64")
    assert host_platform("aarch64") == Platform("linux", "arm64")
    assert parse_platform("linux/arm/v7") == Platform("linux", "arm", "v7")
    for bad in ("linux", "linux/", "a/b/c/d", "Linux/AMD64"):
        with pytest.raises(InvalidArgument):
            parse_platform(bad)


def _desc(digest: str, arch: str, variant: str | None = None,
          os_: str = "linux") -> dict[str, object]:
    p: dict[str, str] = {"os": os_, "architecture": arch}
    if variant:
        p["variant"] = variant
    return {"digest": digest, "platform": p}


def test_select_manifest() -> None:
    idx = {"manifests": [_desc(D, "arm64", "v8"), _desc(E, "arm64"),
                         _desc("sha256:" + "c" * 64, "amd64"),
                         _desc("sha256:" + "d" * 64, "unknown", os_="unknown")]}
    assert select_manifest(idx, Platform("linux", "amd64"))["digest"] == "sha256:" + "c" * 64
    assert select_manifest(idx, Platform("linux", "arm64"))["digest"] == E   # no variant wins
    assert select_manifest(idx, Platform("linux", "arm64", "v8"))["digest"] == D
    with pytest.raises(ImageNotFound, match=r"no linux/s390x .*linux/amd64, linux/arm64"):
        select_manifest(idx, Platform("linux", "s390x"))
    with pytest.raises(ImageError):
        select_manifest({"manifests": []}, Platform("linux", "amd64"))


def test_image_layers_pair_with_diff_ids() -> None:
    gz = "application/vnd.oci.image.layer.v1.tar+gzip"
    m = {"layers": [{"digest": D, "mediaType": gz, "size": 3},
                    {"digest": E, "mediaType": gz, "size": 4}]}
    out = image_layers(m, {"rootfs": {"diff_ids": [E, D]}})
    assert [(x.digest, x.diff_id, x.size) for x in out] == [(D, E, 3), (E, D, 4)]
    with pytest.raises(ImageError, match="1 rootfs.diff_ids for 2 layers"):
        image_layers(m, {"rootfs": {"diff_ids": [E]}})
    with pytest.raises(ImageError, match="zstd"):
        image_layers({"layers": [{"digest": D, "mediaType":
                                  "application/vnd.oci.image.layer.v1.tar+zstd"}]},
                     {"rootfs": {"diff_ids": [E]}})


def test_config_to_defaults_and_back() -> None:
    cfg = {"config": {"Env": ["PATH=/bin", "FOO=a=b", "BAD"], "WorkingDir": "/w",
                      "User": "app:staff", "Entrypoint": ["/init"], "Cmd": ["sh", "-c", "x"],
                      "Labels": {"k": "v"}}}
    d = image_defaults(cfg)
    assert d == ImageDefaults(env={"PATH": "/bin", "FOO": "a=b"}, cwd="/w", user="app:staff",
                              entrypoint=("/init",), cmd=("sh", "-c", "x"), labels={"k": "v"})
    assert defaults_from_labels(defaults_labels(d)) == d
    assert image_defaults({}) == ImageDefaults()
    assert defaults_from_labels({"oci.env": "not json"}) == ImageDefaults()
    # the importer's labels read the same way
    assert defaults_from_labels({"oci.workingdir": '"/srv"'}).cwd == "/srv"


def test_image_defaults_under_the_create() -> None:
    from dsec.control.api.images import with_image_defaults
    from dsec.image.manifest import LayerManifest
    from dsec.wire.spec import SandboxSpec

    labels = defaults_labels(ImageDefaults(env={"PATH": "/img", "FOO": "img"}, cwd="/w",
                                           user="app"))
    m = LayerManifest(digest="sha256:" + "a" * 64, kind="base", size_bytes=1, created=0.0,
                      labels=labels)
    out = with_image_defaults(SandboxSpec(env={"FOO": "create"}), m)
    assert (out.env, out.cwd, out.user) == ({"PATH": "/img", "FOO": "create"}, "/w", "app")
    out = with_image_defaults(SandboxSpec(cwd="/tmp", user="root"), m)
    assert (out.cwd, out.user) == ("/tmp", "root")
    plain = SandboxSpec()
    bare = LayerManifest(digest="sha256:" + "b" * 64, kind="base", size_bytes=1, created=0.0)
    assert with_image_defaults(plain, bare) is plain
    with pytest.raises(InvalidArgument, match="cwd"):
        SandboxSpec(cwd="relative").validate()


def test_auth_challenges_are_parsed() -> None:
    from dsec.image.registry import parse_challenge
    assert parse_challenge('Bearer realm="https://auth.example/token",service="reg.io",'
                           'scope="repository:a/b:pull,push"') == (
        "bearer", {"realm": "https://auth.example/token", "service": "reg.io",
                   "scope": "repository:a/b:pull,push"})
    assert parse_challenge('Basic realm="dsec-test"') == ("basic", {"realm": "dsec-test"})
    assert parse_challenge('Bearer realm="a\\"b", error=insufficient_scope') == (
        "bearer", {"realm": 'a"b', "error": "insufficient_scope"})
    assert parse_challenge("") == ("", {})


def test_loopback_is_decided_on_ip_literals_only() -> None:
    from dsec.image.registry import is_loopback_host
    for h in ("localhost", "localhost:5000", "127.0.0.1", "127.9.9.9:443", "[::1]",
              "[::1]:5000"):
        assert is_loopback_host(h), h
    # names are never judged by their spelling (red team F3)
    for h in ("127.attacker.example", "127.0.0.1.nip.io:5000", "localhost.example",
              "10.0.0.1:5000", "[::2]:5000", "registry.example.com"):
        assert not is_loopback_host(h), h


def test_an_image_over_the_layer_ceiling_is_refused_before_any_fetch() -> None:
    from dsec.errors import ImageError
    from dsec.image.registry import MAX_IMAGE_LAYERS, image_layers

    def image(n: int) -> tuple[dict[str, object], dict[str, object]]:
        digests = [f"sha256:{i:064x}" for i in range(n)]
        return ({"layers": [{"digest": d, "size": 1} for d in digests]},
                {"rootfs": {"type": "layers", "diff_ids": digests}})
    assert len(image_layers(*image(MAX_IMAGE_LAYERS))) == MAX_IMAGE_LAYERS
    # red team F11: 501 layers were pulled, charged and named, then never ran
    with pytest.raises(ImageError, match="501 layers"):
        image_layers(*image(501))
