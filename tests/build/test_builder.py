"""The image builder end to end (dsec.Image): real build sandboxes from a bootstrapped
Debian base, each layer step captured with pack_diff, the step cache in the layer store,
the config (env/workdir/user) carried to sandboxes started from the result, and the
"Done when" check: a real project's test suite passes the same in the built image as
on the host."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsec import BuildStepFailed, Client, Image
from tests.build.conftest import Debian

pytestmark = [pytest.mark.root, pytest.mark.slow]

PROJECT = Path(__file__).parent / "project" / "inflection"


def _build_sandboxes(c: Client) -> list[str]:
    return [s.id for s in c.sandboxes.list() if s.spec.labels.get("dsec.io/build")]


def test_builder_layers_cache_and_config(debian: Debian, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "x.txt").write_text("payload\n")
    (data / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (data / "sub" / "run.sh").chmod(0o755)
    image = (Image.from_image(debian.image)
             .env({"GREETING": "hello from the build"})
             .workdir("/app")
             .run("echo \"$GREETING\" > greeting.txt && pwd > where.txt")
             .copy(data, "/app/data")
             .run(["sh", "-c", "id -un > /app/builder-user"])
             .user("nobody")
             .env({"LATE": "1"}))
    with debian.cluster.client() as c:
        built = image.build(c)
        assert built.ran == 3 and built.cached == 0 and built.top is not None
        assert built.config.workdir == "/app" and built.config.user == "nobody"
        assert built.config.env_dict == {"GREETING": "hello from the build", "LATE": "1"}
        chain = c.snapshots.get(built.top)
        assert chain.view.build_step and chain.parent is not None
        with c.sandboxes.create(**built.create_args()) as sb:
            r = sb.exec("cat greeting.txt where.txt data/x.txt builder-user; "
                        "stat -c '%U %a' data/x.txt data/sub/run.sh; data/sub/run.sh; "
                        "id -un; echo \"$GREETING/$LATE\"", **built.exec_args())
            assert r.exit_code == 0, r
            assert r.stdout.decode().split("\n") == [
                "hello from the build", "/app", "payload", "root",
                "root 644", "root 755", "ran", "nobody", "hello from the build/1", ""]

        # Every step cached: nothing runs, the same layers come back.
        again = image.build(c)
        assert (again.ran, again.cached, again.top) == (0, 3, built.top)
        print(f"image_build_cached_ms={again.seconds * 1000:.1f} "
              f"steps={[round(s, 2) for s in built.step_seconds]}")
        # A changed step reruns from there on; the prefix stays cached.
        changed = image.run("echo more > /tmp/more.txt")
        third = changed.build(c)
        assert (third.ran, third.cached) == (1, 3)
        # Changed copied content is a different key.
        (data / "x.txt").write_text("payload 2\n")
        fourth = image.build(c)
        assert (fourth.ran, fourth.cached) == (2, 1)
        assert _build_sandboxes(c) == []


def test_image_debian_finds_the_bootstrapped_base(debian: Debian) -> None:
    assert Image.debian_name("bookworm", include=["python3-pytest", "python3"]) == debian.image
    image = Image.debian("bookworm", include=["python3", "python3-pytest"]).run(
        "python3 -c 'import pytest; print(pytest.__version__)' > /pytest-version")
    with debian.cluster.client() as c:
        built = image.build(c)
        assert built.base == c.images.get(debian.image).digest and built.ran == 1
        with c.sandboxes.create(**built.create_args()) as sb:
            assert sb.files.read("/pytest-version").startswith(b"7.")


def test_a_failing_step_names_itself_and_leaves_nothing(debian: Debian) -> None:
    image = Image.from_image(debian.image).run("touch /ok").run(
        "echo compiling; echo 'oops: no such thing' >&2; exit 7")
    with debian.cluster.client() as c:
        before = {s.id for s in c.snapshots.list()}
        with pytest.raises(BuildStepFailed) as exc:
            image.build(c)
        msg = str(exc.value)
        assert "step 2/2 (RUN echo compiling" in msg and "exited with code 7" in msg
        assert "oops: no such thing" in msg
        assert _build_sandboxes(c) == []
        # the first step's layer is kept (a cache entry), the failed one made none
        assert len({s.id for s in c.snapshots.list()} - before) == 1


def test_build_sandboxes_have_no_network_by_default(debian: Debian) -> None:
    image = Image.from_image(debian.image).run(
        "python3 -c \"import socket; socket.create_connection(('10.255.255.1', 80), 2)\"")
    with debian.cluster.client() as c, pytest.raises(BuildStepFailed, match="exited with"):
        image.build(c)


def _passed(out: str) -> int:
    m = re.search(r"(\d+) passed", out)
    assert m, out[-2000:]
    assert not re.search(r"\d+ (failed|error)", out), out[-2000:]
    return int(m.group(1))


def test_done_when_a_real_project_passes_the_same_in_the_built_image(
        debian: Debian, tmp_path: Path) -> None:
    """python3 + pytest from Debian packages (the bootstrapped base), the vendored
    inflection project copied in, its suite run in a sandbox from the built image: the
    same pass count as on the host."""
    host_copy = tmp_path / "inflection"
    shutil.copytree(PROJECT, host_copy)
    host = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_inflection.py"], cwd=host_copy, capture_output=True,
                          text=True, check=False, env={**os.environ, "PYTHONPATH": ""})
    host_passed = _passed(host.stdout)
    assert host_passed >= 400

    image = (Image.from_image(debian.image)
             .copy(PROJECT, "/src/inflection")
             .workdir("/src/inflection")
             .env({"PYTHONDONTWRITEBYTECODE": "1"}))
    with debian.cluster.client() as c:
        built = image.build(c)
        with c.sandboxes.create(**built.create_args()) as sb:
            r = sb.exec("python3 -m pytest -q -p no:cacheprovider test_inflection.py",
                        timeout=300, **built.exec_args())
            assert r.exit_code == 0, r
            assert _passed(r.stdout.decode()) == host_passed


def test_the_step_cache_is_per_project(debian: Debian) -> None:
    """Project members build into their project; another project's identical recipe never
    reuses (or even sees) those layers: it runs the step itself."""
    from dsec import Client

    cl = debian.cluster
    image = Image.from_image(debian.image).run("echo secret-ish > /layer.txt")
    alice = Client(cl.url, cl.create_key("alice-b", "teama", "member"), protocol="http")
    bob = Client(cl.url, cl.create_key("bob-b", "teamb", "member"), protocol="http")
    try:
        a = image.build(alice, project="teama")
        assert (a.ran, a.cached) == (1, 0)
        assert alice.snapshots.get(a.top).project == "teama"
        assert (image.build(alice, project="teama").cached) == 1
        b = image.build(bob, project="teamb")
        assert (b.ran, b.cached) == (1, 0) and b.top != a.top
        assert a.top not in {s.id for s in bob.snapshots.list()}
    finally:
        alice.close()
        bob.close()
