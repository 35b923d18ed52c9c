"""``dsec image`` build / ls / rm through click."""

from __future__ import annotations

import io
import json
import os
import tarfile

from click.testing import CliRunner

from dsec.cli.main import cli
from tests.conftest import requires_root
from tests.image.conftest import write_tree

pytestmark = requires_root


def test_build_ls_rm(tmp_path: object) -> None:
    tmp = str(tmp_path)
    root = os.path.join(tmp, "store")
    src = os.path.join(tmp, "src")
    write_tree(src, {"bin/tool": "#!/bin/sh\n"})
    run = CliRunner().invoke
    r = run(cli, ["image", "--root", root, "build", src, "--kind", "toolkit", "--name", "tk",
                  "--tag", "v1", "--label", "a=b", "-q"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("tk:v1 sha256:")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname=".")
    tar_path = os.path.join(tmp, "x.tar")
    with open(tar_path, "wb") as f:
        f.write(buf.getvalue())
    r = run(cli, ["image", "--root", root, "build", tar_path, "--kind", "base", "--name", "b",
                  "--lz4"])
    assert r.exit_code == 0, r.output
    r = run(cli, ["image", "--root", root, "ls", "--json"])
    docs = [json.loads(line) for line in r.output.splitlines()]
    assert sorted(d["kind"] for d in docs) == ["base", "toolkit"]
    assert [d["compression"] for d in docs if d["kind"] == "base"] == ["lz4"]
    r = run(cli, ["image", "--root", root, "rm", "tk:v1"])
    assert r.exit_code == 0 and "removed" in r.output
    r = run(cli, ["image", "--root", root, "rm", "tk:v1"])
    assert r.exit_code != 0 and "no image named tk:v1" in r.output
    r = run(cli, ["image", "--root", root, "build", os.path.join(tmp, "nope"), "--kind",
                  "base", "--name", "n"])
    assert r.exit_code != 0


def test_prune(tmp_path: object) -> None:
    """A rebuild under the same name leaves the old layer unnamed: prune removes it
    (--dry-run only says so); the same tree rebuilt adds nothing (reproducible)."""
    tmp = str(tmp_path)
    root = os.path.join(tmp, "store")
    src = os.path.join(tmp, "src")
    write_tree(src, {"f": "one"})
    run = CliRunner().invoke
    args = ["image", "--root", root, "build", src, "--kind", "base", "--name", "b", "-q"]
    first = run(cli, args).output.split()[1]
    assert run(cli, args).output.split()[1] == first          # same tree, same layer
    write_tree(src, {"f": "two"})
    second = run(cli, args).output.split()[1]
    assert second != first
    r = run(cli, ["image", "--root", root, "prune", "--dry-run"])
    assert r.exit_code == 0 and f"would remove {first}" in r.output, r.output
    assert len(os.listdir(os.path.join(root, "layers"))) == 2
    r = run(cli, ["image", "--root", root, "prune", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert [m["digest"] for m in res["removed"]] == [first] and res["kept_layers"] == 1
    assert os.listdir(os.path.join(root, "layers")) == [second.removeprefix("sha256:")
                                                       + ".erofs"]
    r = run(cli, ["image", "--root", root, "prune"])
    assert r.exit_code == 0 and "removed 0 layers" in r.output
