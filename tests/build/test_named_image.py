"""Naming a built image (issue 15, from ic's report): ``Image.build(client, name=...)``
and ``dsec image build -f Dockerfile -t NAME CONTEXT`` make a named image of the project
(its step layers laid into one layer on the base's stack, the config as a pulled image's
``oci.*`` labels), and ``create(image=NAME)`` runs it with its env, workdir and user,
through both SDK transports (REST and the Aether gateway)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec import Image
from dsec.errors import ImageNotFound, InvalidArgument
from dsec.wire.api import ImagePromoteRequest
from tests.build.conftest import Debian

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.mark.parametrize("protocol", ["http", "aether"])
def test_a_built_image_named_runs_with_its_config(debian: Debian, protocol: str) -> None:
    image = (Image.from_image(debian.image)
             .env({"GREETING": f"hello {protocol}"})
             .workdir("/app")
             .run("echo \"$GREETING\" > greeting.txt && rm -f /etc/issue.net")
             .user("nobody"))
    with debian.cluster.client(protocol=protocol) as c:
        built = image.build(c, name=f"py-{protocol}:1")
        assert built.name == f"default/py-{protocol}:1" and built.top is not None
        view = c.images.get(built.name)
        assert view.kind == "base" and view.namespace == "default"
        assert json.loads(view.labels["oci.workingdir"]) == "/app"
        assert built.create_args() == {"image": built.name}
        with c.sandboxes.create(image=built.name) as sb:
            r = sb.exec("cat greeting.txt; pwd; id -un; echo \"$GREETING\"; "
                        "test -e /etc/issue.net || echo whiteout-kept; "
                        "test -e /etc/issue && echo base-below")
            assert r.exit_code == 0, r
            assert r.stdout.decode().split("\n") == [
                f"hello {protocol}", "/app", "nobody", f"hello {protocol}",
                "whiteout-kept", "base-below", ""]
        # rebuilt: every step cached, named again (the name moves to the same content)
        again = image.build(c, name=f"py-{protocol}:1")
        assert again.ran == 0 and again.name == built.name


def test_promote_refuses_what_is_not_a_build_of_that_base(debian: Debian) -> None:
    with debian.cluster.client() as c:
        base = c.images.get(debian.image).digest
        with pytest.raises((InvalidArgument, ImageNotFound)):
            c.images.promote(ImagePromoteRequest(top=base, base=base, target="x:1"))
        built = Image.from_image(debian.image).run("true > /t").build(c)
        assert built.top is not None
        with c.sandboxes.create(snapshot=built.top) as sb:     # a chain on another base
            sb.exec("echo x > /u")
            other = sb.snapshot()
        with pytest.raises(InvalidArgument, match="not on the image"):
            c.images.promote(ImagePromoteRequest(top=other.id, base="base", target="y:1"))
        with pytest.raises(ImageNotFound):
            c.images.get("default/y:1")


def test_cli_build_dash_t_names_the_image(debian: Debian, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "hello.txt").write_text("from the context\n")
    (ctx / "Dockerfile").write_text(
        f"FROM {debian.image}\nENV MODE=cli\nWORKDIR /srv\nCOPY hello.txt ./\n"
        "RUN cp hello.txt copied.txt\n")
    cl = debian.cluster
    out = subprocess.run(
        [sys.executable, "-c", "from dsec.cli.main import main; main()", "image", "build",
         "-q", "-f", str(ctx / "Dockerfile"), "-t", "cli-img:2", str(ctx),
         "--url", cl.url, "--api-key", cl.api_key],
        capture_output=True, text=True, timeout=600, env={**os.environ}, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["name"] == "default/cli-img:2"
    with cl.client() as c, c.sandboxes.create(image="default/cli-img:2") as sb:
        r = sb.exec("cat copied.txt; pwd; echo $MODE")
        assert r.stdout.decode().split("\n") == ["from the context", "/srv", "cli", ""], r
