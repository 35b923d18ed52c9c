"""``client.images``: build layers through the API and start sandboxes on them."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from dsec import Client, InvalidArgument, LocalCluster, PermissionDenied


def test_build_from_directory_and_tar_then_run_on_it(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    tools = tmp_path / "tools"
    (tools / "opt/t").mkdir(parents=True)
    (tools / "opt/t/run.sh").write_text("#!/bin/sh\necho tool says $1\n")
    (tools / "opt/t/run.sh").chmod(0o755)
    ws = tmp_path / "ws.tar"
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo/README").write_text("the task\n")
    with tarfile.open(ws, "w") as tar:
        tar.add(tmp_path / "repo", arcname="workspace")
    with LocalCluster(backend="container") as cl, cl.client() as c:
        tool = c.images.build(tools, name="tools", kind="toolkit")
        assert (tool.ref, tool.kind) == ("tools:latest", "toolkit") and tool.digest
        wsv = c.images.build(ws, name="repo", kind="workspace", tag="v1")
        assert wsv.ref == "repo:v1"
        refs = {i.ref for i in c.images.list()}
        assert {"tools:latest", "repo:v1"} <= refs
        with c.sandboxes.create(image="base", workspace="repo:v1", toolkits=["tools"]) as sb:
            r = sb.exec("/opt/t/run.sh hi && cat /workspace/README")
            assert r.stdout == b"tool says hi\nthe task\n", r
            # the layers are read-only lowers: writes land in the sandbox's own upper
            sb.exec("echo changed > /workspace/README")
        with c.sandboxes.create(image="base", workspace="repo:v1") as other:
            assert other.exec("cat /workspace/README").stdout == b"the task\n"
        with pytest.raises(InvalidArgument):
            c.images.build(tmp_path / "missing", name="x")
        member = cl.create_key("builder", project="default", role="member")
        with Client(cl.url, member) as m, pytest.raises(PermissionDenied):
            m.images.build(tools, name="nope", kind="toolkit")
