"""Image names are the state store's (issue 16): two apiserver replicas, each with its own
layer store (two hosts), over one state store answer a name with the same layer at every
door, and a name moved or removed through one is moved or removed at the other at once.

Real components: two whole clusters (apiserver, gateway, edge) over one real state store
(SQLite file or PostgreSQL database), the SDK over HTTP and over the Aether gateway,
plain REST. (No sandboxes: the two clusters' edges share a node id.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from dsec.client.sync import Client
from dsec.cluster.local import LocalCluster
from dsec.control.store import StateStore
from dsec.control.store.tags import StoreTags
from dsec.errors import ImageNotFound, InvalidArgument


def _tree(d: Path, text: str) -> Path:
    (d / "opt").mkdir(parents=True)
    (d / "opt" / "what").write_text(text)
    return d


def _rest(c: LocalCluster, ref: str) -> httpx.Response:
    return httpx.get(f"{c.url}/v1/images/{ref}",
                     headers={"authorization": f"Bearer {c.api_key}"}, timeout=30)


def _until(what: str, ok: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_name_is_one_answer_from_every_replica_and_door(tmp_path: Path,
                                                          store_url: str) -> None:
    with LocalCluster(edges=1, state_dir=str(tmp_path / "a"), store=store_url) as a, \
            LocalCluster(edges=1, state_dir=str(tmp_path / "b"), store=store_url) as b, \
            Client(a.url, a.api_key, protocol="http") as sdk_a, \
            Client(b.url, b.api_key, protocol="http") as sdk_b, \
            Client(b.url, b.api_key, protocol="aether") as gw_b:
        assert a.gateway and b.gateway
        v1 = sdk_a.images.build(_tree(tmp_path / "t1", "one"), name="tools", kind="toolkit")
        # B never stored the layer (its own layer store): it knows the name and the layer
        for view in (sdk_b.images.get("tools"), gw_b.images.get("tools:latest")):
            assert (view.digest, view.kind) == (v1.digest, "toolkit")
        r = _rest(b, "tools")
        assert r.status_code == 200 and r.json()["digest"] == v1.digest, r.text
        assert v1.digest in {i.digest for i in sdk_b.images.list()}
        assert not (tmp_path / "b" / "layers" / "manifests" /
                    (v1.digest.removeprefix("sha256:") + ".json")).exists()
        # the name moves on B: A answers the new layer at every door, at once
        v2 = sdk_b.images.build(_tree(tmp_path / "t2", "two"), name="tools", kind="toolkit")
        assert v2.digest != v1.digest
        assert sdk_a.images.get("tools").digest == v2.digest
        assert _rest(a, "tools").json()["digest"] == v2.digest
        with Client(a.url, a.api_key, protocol="aether") as gw_a:
            assert gw_a.images.get("tools").digest == v2.digest
            # a create on A resolves the name B moved: a toolkit is no image
            with pytest.raises(InvalidArgument, match="toolkit layer"):
                gw_a.sandboxes.create(image="tools")
            # removed on A: gone at B's doors
            sdk_a.images.delete("tools:latest")
            with pytest.raises(ImageNotFound):
                gw_b.images.get("tools")
            assert _rest(b, "tools").status_code == 404
            assert not [i for i in sdk_b.images.list() if "tools:latest" in i.refs]


def test_the_tag_table_is_versioned_and_announced(store: StateStore) -> None:
    """One version per change, names set only where absent on an import, and on
    PostgreSQL a change is announced to other connections (a replica's cache learns of it
    without asking)."""
    heard: list[int] = []
    pushed = store.listen_tags(heard.append)
    if pushed:
        _until("the LISTEN connection", lambda: bool(getattr(store, "listening", False)))
    assert store.image_tags_version() == 0
    v = store.update_image_tags({"a:latest": ("sha256:" + "1" * 64, "{}"),
                                 "p/b:1": ("sha256:" + "2" * 64, "{}")}, 1.0)
    assert v == 1 == store.image_tags_version()
    v = store.update_image_tags({"a:latest": ("sha256:" + "3" * 64, "{}"),
                                 "c:latest": ("sha256:" + "4" * 64, "{}")}, 2.0,
                                only_if_absent=True)
    assert v == 2
    assert store.read_image_tags() == (2, {"a:latest": "sha256:" + "1" * 64,
                                           "p/b:1": "sha256:" + "2" * 64,
                                           "c:latest": "sha256:" + "4" * 64})
    assert store.update_image_tags({"p/b:1": None}, 3.0) == 3
    assert "p/b:1" not in store.read_image_tags()[1]
    if pushed:
        _until("the announcement of version 3", lambda: 3 in heard)


def test_a_replicas_cached_names_follow_another_replicas_change(store_url: str) -> None:
    from dsec.control.store import open_store

    s1, s2 = open_store(store_url), open_store(store_url)
    try:
        t1, t2 = StoreTags(s1), StoreTags(s2)
        assert t2.read() == {}
        s1.update_image_tags({"x:latest": ("sha256:" + "5" * 64, "{}")}, 1.0)
        _until("replica 2 sees x", lambda: t2.read() == {"x:latest": "sha256:" + "5" * 64})
        sig = t1.signature()
        assert t1.signature() == sig          # nothing changed: the same signature
    finally:
        s1.close()
        s2.close()


def test_a_hosts_refs_json_and_the_table_stay_in_step(tmp_path: Path, store_url: str) -> None:
    """``refs.json`` is what a host's own processes read and write (``dsec image`` on the
    host, the edges of ``dsec up``): a name written there reaches the table, a change in
    the table reaches the file, and a host copy older than another replica's removal
    does not bring the name back, even across a restart."""
    import json

    from dsec.control.store import open_store
    from dsec.control.store.tags import HostNames
    from dsec.image import LayerStore

    def names(store: StateStore, ls: LayerStore) -> HostNames:
        return HostNames(StoreTags(store), ls.root,
                         lambda d: ls._load_opt(d.removeprefix("sha256:")))

    def file_of(ls: LayerStore) -> dict[str, str]:
        return dict(json.loads(Path(ls.root, "refs.json").read_text()))

    s1, s2 = open_store(store_url), open_store(store_url)
    try:
        a, b = LayerStore(str(tmp_path / "a")), LayerStore(str(tmp_path / "b"))
        m1 = a.add_tree(str(_tree(tmp_path / "t1", "one")), kind="toolkit", name="t1")
        a.tag(m1.digest, "t2")                       # the host's own names (refs.json)
        na = names(s1, a)
        assert na.read() == {"t1:latest": m1.digest, "t2:latest": m1.digest}
        a.tag(m1.digest, "t3")                       # a host build after the first sync
        assert na.read()["t3:latest"] == m1.digest
        # another replica (another host) removes t1 through its table-backed store
        LayerStore(b.root, refs=names(s2, b)).untag("t1:latest")
        assert "t1:latest" not in na.read() and "t1:latest" not in file_of(a)
        # A's host file lags a removal made while A was down; A restarts: not brought back
        LayerStore(b.root, refs=names(s2, b)).untag("t2:latest")
        assert "t2:latest" in file_of(a)
        restarted = names(s1, a)
        assert set(restarted.read()) == {"t3:latest"}
        assert set(file_of(a)) == {"t3:latest"}
        # a name set through a table-backed store is in the host's file at once
        table_a = LayerStore(a.root, refs=restarted)
        table_a.tag(m1.digest, "t4")
        assert file_of(a)["t4:latest"] == m1.digest
    finally:
        s1.close()
        s2.close()
