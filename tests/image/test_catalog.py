"""The tenancy rule over image layers (pure), and the store index that feeds it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.errors import ImageNotFound, InvalidArgument
from dsec.image.catalog import (
    CanSee,
    MemoryIndex,
    StoreIndex,
    image_not_found,
    resolve,
    visible,
)
from dsec.image.manifest import PROJECT_LABEL, LayerManifest, ref_key


def layer(hx: str, kind: str = "toolkit", namespace: str | None = None,
          labels: dict[str, str] | None = None) -> LayerManifest:
    return LayerManifest(digest="sha256:" + hx.ljust(64, "0"), kind=kind,  # type: ignore[arg-type]
                         size_bytes=1, created=0.0, namespace=namespace,
                         labels=labels or {})


def roles(*projects: str) -> CanSee:
    def see(ns: str | None) -> bool:
        return ns is None or any(ns == p or ns.startswith(p + "/") for p in projects)
    return see


BASE = layer("b0", "base")
A_TOOL = layer("a1", namespace="teama")
B_TOOL = layer("b1", namespace="teamb")
A_SNAP = layer("a2", "snapshot", labels={PROJECT_LABEL: "teama"})
LOST_SNAP = layer("c3", "snapshot")                       # names no project: nobody's
LEGACY = layer("d4")                                      # pre-namespace, named globally
INDEX = MemoryIndex([BASE, A_TOOL, B_TOOL, A_SNAP, LOST_SNAP, LEGACY], {
    "base:latest": BASE.digest, "teama/tools:latest": A_TOOL.digest,
    "teamb/tools:latest": B_TOOL.digest, "tools:latest": LEGACY.digest,
    "teama/sub/base:latest": BASE.digest})


def test_visibility_follows_the_layers_project_and_its_names() -> None:
    bob = roles("teamb")
    assert [visible(INDEX, m, bob) for m in (BASE, A_TOOL, B_TOOL, A_SNAP, LOST_SNAP,
                                             LEGACY)] == [True, False, True, False, False,
                                                          True]
    assert visible(INDEX, A_SNAP, roles("teama/x")) is False   # a child is no parent
    assert visible(INDEX, A_SNAP, roles("teama")) is True
    assert visible(INDEX, LOST_SNAP, lambda ns: True) is True  # the superuser


def test_a_bare_name_is_the_projects_first_then_cluster_wide() -> None:
    bob, alice = roles("teamb"), roles("teama")
    got = resolve(INDEX, "tools", project="teamb", can_see=bob)
    assert got is not None and (got.layer, got.exact) == (B_TOOL, "teamb/tools")
    got = resolve(INDEX, "tools:latest", project="teama", can_see=alice)
    assert got is not None and (got.layer, got.exact) == (A_TOOL, "teama/tools:latest")
    got = resolve(INDEX, "tools", project="teamc", can_see=roles("teamc"))
    assert got is not None and (got.layer, got.exact) == (LEGACY, "tools")
    # a project the caller cannot see is never searched, even as "its" project
    got = resolve(INDEX, "tools", project="teama", can_see=bob)
    assert got is not None and got.layer == LEGACY
    assert resolve(INDEX, "nothing", project="teamb", can_see=bob) is None
    got = resolve(INDEX, "teama/sub/base", project="teamb", can_see=alice)
    assert got is not None and got.layer == BASE


@pytest.mark.parametrize("ref", ["teama/tools", "teama/tools:latest", A_TOOL.digest,
                                 A_TOOL.digest[:19], A_SNAP.digest, A_SNAP.digest[:19],
                                 LOST_SNAP.digest, "teama/nothing", "teamz/x",
                                 "sha256:" + "f" * 64, "sha256:" + "f" * 12])
def test_what_the_caller_may_not_see_answers_like_what_does_not_exist(ref: str) -> None:
    for role in (None, "image", "workspace", "toolkit"):
        with pytest.raises(ImageNotFound) as e:
            resolve(INDEX, ref, project="teamb", can_see=roles("teamb"),
                    role=role)  # type: ignore[arg-type]
        want = image_not_found(ref)
        assert (e.value.message, e.value.detail) == (want.message, want.detail)


def test_prefixes_and_kinds_are_judged_among_visible_layers_only() -> None:
    twins = [layer("abcdef012345" + "1"), layer("abcdef012345" + "2", namespace="teama")]
    index = MemoryIndex(twins, {})
    got = resolve(index, "sha256:abcdef012345", project=None, can_see=roles("teamb"))
    assert got is not None and got.layer == twins[0]            # not ambiguous for bob
    with pytest.raises(InvalidArgument, match="matches 2 layers visible"):
        resolve(index, "sha256:abcdef012345", project=None, can_see=roles("teama"))
    alice = roles("teama")
    with pytest.raises(InvalidArgument, match="snapshot="):
        resolve(INDEX, A_SNAP.digest[:19], project="teama", can_see=alice, role="image")
    with pytest.raises(InvalidArgument, match="toolkit layer"):
        resolve(INDEX, "teama/tools", project="teama", can_see=alice, role="image")
    got = resolve(INDEX, A_TOOL.digest[:19], project="teama", can_see=alice, role="toolkit")
    assert got is not None and got.exact == A_TOOL.digest          # the edge gets it whole


_projects = st.sampled_from(["p", "p/q", "r", "r/s/t"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.none() | _projects, st.sampled_from(
    ["base", "toolkit", "snapshot"]), st.none() | st.sampled_from(["x", "y"]),
    st.none() | _projects), min_size=1, max_size=8),
    st.lists(_projects, max_size=2), st.none() | _projects)
def test_resolution_never_yields_a_layer_the_caller_cannot_see(
        spec: list[tuple[str | None, str, str | None, str | None]], caller: list[str],
        project: str | None) -> None:
    layers, refs = [], {}
    for i, (ns, kind, name, name_ns) in enumerate(spec):
        m = layer(f"{i:02x}" + "ab" * 5, kind,
                  namespace=ns if kind != "snapshot" else None,
                  labels={PROJECT_LABEL: ns} if kind == "snapshot" and ns else {})
        layers.append(m)
        if name is not None and kind != "snapshot":
            refs[ref_key(name_ns, name, "latest")] = m.digest
    index = MemoryIndex(layers, refs)
    see = roles(*caller)
    candidates = [m.digest for m in layers] + [m.digest[:19] for m in layers] + [
        "sha256:" + "ab" * 6] + list(refs) + ["x", "y", "p/x", "r/s/t/y"]
    for ref in candidates:
        try:
            got = resolve(index, ref, project=project, can_see=see)
        except ImageNotFound as exc:
            assert exc.message == image_not_found(ref).message
            continue
        except InvalidArgument:
            continue    # an ambiguous prefix among visible layers
        if got is not None:
            assert visible(index, got.layer, see), (ref, got)
            # what an edge would be handed resolves to the same layer without context
            again = resolve(index, got.exact, project=None, can_see=lambda ns: True)
            assert again is not None and again.layer == got.layer


def test_store_index_follows_the_store(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("builds EROFS layers")
    from dsec.image.store import LayerStore
    store = LayerStore(str(tmp_path / "s"))
    index = StoreIndex(store.root)
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc/f").write_text("1")
    assert index.sync(listing=True).manifests() == [] and index.digest_of("a:latest") is None
    a = store.add_tree(str(src), kind="toolkit", name="a", namespace="teama", owner="alice")
    # lookups read no disk until the next sync, then see the change at once: refs.json
    # is replaced (new inode), a new digest's manifest is read on first use
    assert index.digest_of("teama/a:latest") is None
    assert index.sync().digest_of("teama/a:latest") == a.digest
    assert index.manifest(a.hex) == a
    assert [m.digest for m in index.sync(listing=True).manifests()] == [a.digest]
    b = store.add_tree(str(src), kind="base")
    assert {m.digest for m in index.sync(listing=True).manifests()} == {a.digest, b.digest}
    assert index.by_prefix(b.hex[:12]) == [b]
    store.tag(b.digest, "b", namespace="teama")
    assert index.sync().names_of(b.digest) == ("teama/b:latest",)
    store.remove(a.digest)
    time.sleep(0.06)   # past the racy window of the directory's mtime
    index.sync(listing=True)
    assert index.manifest(a.hex) is None and index.digest_of("teama/a:latest") is None
    assert [m.digest for m in index.manifests()] == [b.digest]
