"""`dsec image build -f Dockerfile CONTEXT` end to end: the real CLI against a container
cluster, the same builder steps as dsec.Image (one implementation), the step cache."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.build.conftest import DSEC, Debian

pytestmark = [pytest.mark.root, pytest.mark.slow]

DOCKERFILE = """\
FROM {image}
ARG GREETING=hello
ENV APP=/opt/app \\
    MODE="two words"
WORKDIR $APP
COPY src/ ./src/
ADD notes.txt /etc/notes.txt
RUN echo "$GREETING from $MODE" > built.txt && \\
    test -f src/lib/util.py
RUN ["python3", "-c", "import sys; open('/opt/app/py.txt', 'w').write(sys.argv[0])"]
LABEL org.example.team=infra
USER nobody
CMD ["python3", "src/main.py"]
"""


def _cli(debian: Debian, *args: str) -> subprocess.CompletedProcess[str]:
    cl = debian.cluster
    return subprocess.run([*DSEC, "image", "build", "--url", cl.url, "--api-key",
                           cl.api_key, *args], capture_output=True, text=True, check=False,
                          timeout=600)


def test_dockerfile_build_and_cached_rebuild(debian: Debian, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "src" / "lib").mkdir(parents=True)
    (ctx / "src" / "main.py").write_text("from lib.util import f\nprint(f())\n")
    (ctx / "src" / "lib" / "util.py").write_text("def f():\n    return 'main ran'\n")
    (ctx / "notes.txt").write_text("notes\n")
    df = tmp_path / "Dockerfile"
    df.write_text(DOCKERFILE.format(image=debian.image))

    r = _cli(debian, "-f", str(df), "--build-arg", "GREETING=hi", str(ctx))
    assert r.returncode == 0, r.stderr
    assert "4 ran, 0 cached" in r.stderr
    out = json.loads(r.stdout)
    cfg = out["config"]
    assert cfg["workdir"] == "/opt/app" and cfg["user"] == "nobody"
    assert dict(cfg["env"]) == {"APP": "/opt/app", "MODE": "two words"}
    assert cfg["cmd"] == ["python3", "src/main.py"]
    assert dict(cfg["labels"]) == {"org.example.team": "infra"}
    with debian.cluster.client() as c, c.sandboxes.create(
            snapshot=out["snapshot"], env=dict(cfg["env"])) as sb:
        res = sb.exec(cfg["cmd"], cwd=cfg["workdir"], user=cfg["user"])
        assert res.exit_code == 0 and res.stdout == b"main ran\n", res
        res = sb.exec("cat built.txt py.txt /etc/notes.txt; id -un", cwd=cfg["workdir"],
                      user=cfg["user"])
        assert res.stdout.decode() == "hi from two words\n-cnotes\nnobody\n", res

    again = _cli(debian, "-f", str(df), "--build-arg", "GREETING=hi", str(ctx))
    assert again.returncode == 0, again.stderr
    assert "0 ran, 4 cached" in again.stderr
    assert json.loads(again.stdout)["snapshot"] == out["snapshot"]
    # another build arg changes the RUN steps that see it, not the copies before them
    other = _cli(debian, "-f", str(df), str(ctx))
    assert other.returncode == 0, other.stderr
    assert "2 ran, 2 cached" in other.stderr


def test_dockerfile_errors_are_clear_and_build_nothing(debian: Debian,
                                                      tmp_path: Path) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text(f"FROM {debian.image}\nRUN true\nEXPOSE 80\n")
    r = _cli(debian, "-f", str(df), str(tmp_path))
    assert r.returncode != 0 and "line 3: EXPOSE is not supported" in r.stderr
    df.write_text(f"FROM {debian.image}\nADD http://example.org/x /x\n")
    r = _cli(debian, "-f", str(df), str(tmp_path))
    assert r.returncode != 0 and "remote URLs are not supported" in r.stderr
    df.write_text(f"FROM {debian.image}\nRUN exit 5\n")
    r = _cli(debian, "-f", str(df), str(tmp_path))
    assert r.returncode != 0
    assert "step 1/1 (RUN exit 5) exited with code 5" in r.stderr
