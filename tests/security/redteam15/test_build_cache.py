"""Red team, issue 15 stream ic (dsec.Image builder): the step cache. Run with
PYTHONPATH=<ic tree>/src (branch ic @ a60a612); fails there."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest


def test_tree_digest_collides_for_different_trees(tmp_path: Path) -> None:
    """Attack: ``tree_digest`` (a COPY step's content digest, part of its cache key)
    feeds ``rel\\0type\\0mode\\0`` + the file bytes + ``\\0`` into one sha256 with no
    lengths, so a file's bytes can spell the framing of further entries. Tree 1 = files
    ``a`` ("X") and ``b`` ("Y"); tree 2 = one file ``a`` whose content is
    ``X\\0b\\0<S_IFREG>\\0<0o644>\\0Y``. Same digest -> same step key -> a build copying tree
    2 reuses the layer made from tree 1 (or vice versa): the image silently holds files
    that are not in the source (a contributor who controls one file in a build context
    can make the cache serve a different tree).

    Safe: length-prefixed (or netstring / tar-of-canonical-entries) hashing: different
    trees never share a digest. Observed: equal digests."""
    from dsec.client.build import tree_digest

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "a").write_bytes(b"X")
    (one / "b").write_bytes(b"Y")
    for p in (one / "a", one / "b"):
        p.chmod(0o644)
    fmt = stat.S_IFREG
    (two / "a").write_bytes(b"X\0" + f"b\0{fmt}\0{0o644}\0".encode() + b"Y")
    (two / "a").chmod(0o644)
    assert sorted(os.listdir(one)) != sorted(os.listdir(two))
    assert tree_digest(str(one)) != tree_digest(str(two)), \
        "two different trees give one COPY content digest"


@pytest.mark.root
@pytest.mark.slow
def test_any_sandbox_label_forges_a_step_cache_entry(tmp_path: Path) -> None:
    """Attack: the step cache's index is the ``build.dsec.io/step`` label of snapshot
    layers, and that label is copied from the *sandbox's create labels*, which any member
    sets freely. The key is computable by anyone (parent digests + step text + config +
    network). A member (or any key with a role on the project; with ``project=None``
    the builder reads every project the key sees) creates a sandbox with
    ``labels={"build.dsec.io/step": K}``, writes a backdoor, snapshots it. A colleague's
    ``Image.from_image("base").run("echo good > /f").build(c)`` then finds K, runs
    nothing and hands out the planted layer (its /f says EVIL).

    Safe: a cache entry is only trusted if the builder made it: the label is reserved
    (refused on create at every door, or set only by the apiserver for a build
    sandbox it created, bound to the step's parent, and the hit's parent chain checked
    == the step's parent).
    Observed: ran == 0, cached == 1, /f == EVIL."""
    from dsec import Image, LocalCluster
    from dsec.client.build import BUILD_STEP_LABEL
    from dsec.errors import InvalidArgument
    from dsec.image.build import BuildConfig, Run, step_key

    step = Run("echo good > /f")
    with LocalCluster(edges=1, backend="container", state_dir=str(tmp_path / "st")) as cl, \
            cl.client() as c:
        base = c.images.get("base").digest
        key = step_key((base,), step, BuildConfig(), network="none")
        # the forger: an ordinary sandbox with the label (refused now: the label is the
        # platform's), then the dedicated field on a sandbox whose stack is NOT the
        # step's parent (a snapshot holding the backdoor under it), a snapshot
        with pytest.raises(InvalidArgument, match="build.dsec.io/step"):
            c.sandboxes.create(image="base", labels={BUILD_STEP_LABEL: key})
        with c.sandboxes.create(image="base") as sb:
            assert sb.exec("echo EVIL > /f").exit_code == 0
            evil = sb.snapshot()
        with c.sandboxes.create(snapshot=evil, build_step=key) as sb:
            assert sb.exec("touch /g").exit_code == 0
            forged = sb.snapshot()
        assert forged.view.build_step == key and forged.view.parent == evil.id
        built = Image.from_image("base").run(step.command).build(c)
        with c.sandboxes.create(**built.create_args()) as sb:
            content = sb.exec("cat /f").stdout
        assert (built.ran, content) == (1, b"good\n"), (
            f"the build reused a forged cache entry: ran={built.ran} cached={built.cached} "
            f"/f={content!r}")
