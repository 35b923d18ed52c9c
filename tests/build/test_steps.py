"""The builder's pure logic: step cache keys, config steps, the Dockerfile compiler and
the copy content digest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.client.build import Image, _pack_for_copy, tree_digest
from dsec.errors import InvalidArgument
from dsec.image.build import (
    BuildConfig,
    Cmd,
    Copy,
    Entrypoint,
    Env,
    Label,
    Run,
    User,
    Workdir,
    apply_config,
    compile_dockerfile,
    step_key,
)

P = ("sha256:" + "a" * 64,)


def test_step_key_changes_with_everything_a_layer_depends_on() -> None:
    cfg = BuildConfig()
    k = step_key(P, Run("make"), cfg, network="none")
    assert len(k) == 64 and k == step_key(P, Run("make"), cfg, network="none")
    others = {
        step_key(("sha256:" + "b" * 64,), Run("make"), cfg, network="none"),
        step_key(P, Run("make all"), cfg, network="none"),
        step_key(P, Run(("make",)), cfg, network="none"),
        step_key(P, Run("make"), apply_config(cfg, Env((("A", "1"),))), network="none"),
        step_key(P, Run("make"), apply_config(cfg, Workdir("/src")), network="none"),
        step_key(P, Run("make"), apply_config(cfg, User("nobody")), network="none"),
        step_key(P, Run("make"), cfg, network="host"),
        step_key(P, Copy("/x", "/y"), cfg, network="none", content_digest="1"),
        step_key(P, Copy("/x", "/y"), cfg, network="none", content_digest="2"),
        step_key(P, Copy("/x", "/z"), cfg, network="none", content_digest="1"),
    }
    assert k not in others and len(others) == 10
    # labels and CMD are config only: they do not change what a command makes
    assert step_key(P, Run("make"), apply_config(cfg, Label((("a", "b"),))),
                    network="none") == k
    # the local source path of a copy is not its content
    assert step_key(P, Copy("/x", "/y"), cfg, network="none", content_digest="1") == \
        step_key(P, Copy("/elsewhere", "/y"), cfg, network="none", content_digest="1")
    with pytest.raises(InvalidArgument):
        step_key(P, Copy("/x", "/y"), cfg, network="none")


def test_config_steps() -> None:
    c = BuildConfig()
    for s in (Env((("B", "2"), ("A", "1"))), Workdir("/src"), Workdir("pkg/../lib"),
              User("1000"), Env((("A", "3"),)), Label((("k", "v"),)), Cmd(("a",)),
              Entrypoint(("e",))):
        c = apply_config(c, s)
    assert c == BuildConfig(env=(("A", "3"), ("B", "2")), workdir="/src/lib", user="1000",
                            labels=(("k", "v"),), cmd=("a",), entrypoint=("e",))
    assert apply_config(c, Run("x")) is c
    with pytest.raises(InvalidArgument, match="variable name"):
        apply_config(c, Env((("1BAD", "x"),)))
    with pytest.raises(InvalidArgument):
        apply_config(c, User("a b"))


DOCKERFILE = """\
# syntax comment
FROM debian-test
ARG VERSION=1.0
ARG FLAVOUR
ENV APP_HOME=/opt/app \\
    MODE="fast mode"
LABEL org.example.version=$VERSION
WORKDIR ${APP_HOME}
COPY src/ ./src
ADD notes.txt /etc/notes.txt
RUN echo building $VERSION \\
    && touch built
RUN ["python3", "-c", "print(1)"]
USER nobody
CMD python3 -m app
ENTRYPOINT ["/bin/sh", "-c"]
"""


def test_dockerfile_compiles_to_builder_steps() -> None:
    df = compile_dockerfile(DOCKERFILE, {"FLAVOUR": "x"})
    assert df.base == "debian-test"
    assert df.steps == (
        Env((("APP_HOME", "/opt/app"), ("MODE", "fast mode"))),
        Label((("org.example.version", "1.0"),)),
        Workdir("/opt/app"),
        Copy("src/", "./src"),
        Copy("notes.txt", "/etc/notes.txt"),
        Run("export FLAVOUR=x VERSION=1.0; echo building $VERSION     && touch built"),
        Run(("env", "FLAVOUR=x", "VERSION=1.0", "python3", "-c", "print(1)")),
        User("nobody"),
        Cmd(("/bin/sh", "-c", "python3 -m app")),
        Entrypoint(("/bin/sh", "-c")),
    )
    assert df.lines == (5, 7, 8, 9, 10, 11, 13, 14, 15, 16)
    assert compile_dockerfile(DOCKERFILE, {"VERSION": "2"}).steps[1] == \
        Label((("org.example.version", "2"),))


@pytest.mark.parametrize(("text", "match"), [
    ("FROM a\nHEALTHCHECK CMD true\n", "line 2: HEALTHCHECK is not supported"),
    ("FROM a\nADD https://x.org/f /f\n", "line 2: ADD https://x.org/f: remote URLs"),
    ("FROM a\nADD f.tar.gz /f\n", "archives are not unpacked"),
    ("FROM a\nCOPY --chown=1 a /b\n", "--chown=1 is not supported"),
    ("FROM a\nCOPY --from=b a /b\n", "--from=b is not supported"),
    ("RUN true\n", "line 1: RUN before FROM"),
    ("FROM a\nFROM b\n", "line 2: a second FROM"),
    ("LABEL a=b\n", "before FROM"),
    ("# nothing\n", "no FROM"),
    ("FROM a\nRUN --mount=type=cache true\n", "RUN flags"),
])
def test_dockerfile_errors_name_the_line(text: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        compile_dockerfile(text)


def test_undeclared_build_arg_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="--build-arg NOPE not declared"):
        compile_dockerfile("FROM a\n", {"NOPE": "1"})


def test_from_dockerfile_keeps_copies_inside_the_context(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "Dockerfile").write_text("FROM base\nCOPY src /src\nCOPY ../etc /x\n")
    with pytest.raises(InvalidArgument, match="line 3: COPY '../etc' is outside"):
        Image.from_dockerfile(tmp_path / "Dockerfile")
    (tmp_path / "Dockerfile").write_text("FROM base\nCOPY missing /src\n")
    with pytest.raises(InvalidArgument, match="line 2: COPY 'missing': no such file"):
        Image.from_dockerfile(tmp_path / "Dockerfile")


def test_tree_digest_is_content_not_time_or_place(tmp_path: Path) -> None:
    a = tmp_path / "a"
    (a / "d").mkdir(parents=True)
    (a / "d" / "f").write_text("x")
    os.symlink("d/f", a / "l")
    d1 = tree_digest(str(a))
    b = tmp_path / "b"
    (b / "d").mkdir(parents=True)
    (b / "d" / "f").write_text("x")
    os.symlink("d/f", b / "l")
    os.utime(b / "d" / "f", (1, 1))
    assert tree_digest(str(b)) == d1
    (b / "d" / "f").chmod(0o755)
    assert tree_digest(str(b)) != d1
    (a / "d" / "f").write_text("y")
    assert tree_digest(str(a)) != d1


def test_copy_tar_places_and_owns_like_docker(tmp_path: Path) -> None:
    import io
    import tarfile

    (tmp_path / "d" / "s").mkdir(parents=True)
    (tmp_path / "d" / "s" / "f").write_text("1")
    os.mkfifo(tmp_path / "d" / "fifo")
    def members(src: str, dest: str) -> list[tarfile.TarInfo]:
        with tarfile.open(fileobj=io.BytesIO(_pack_for_copy(src, dest))) as tar:
            return tar.getmembers()

    names = {m.name: m for m in members(str(tmp_path / "d"), "/app/")}
    assert set(names) == {"app/s", "app/s/f"}          # the fifo is not content
    assert all(m.uid == 0 and m.uname == "root" for m in names.values())
    f = str(tmp_path / "d" / "s" / "f")
    assert [m.name for m in members(f, "/etc/x")] == ["etc/x"]
    assert [m.name for m in members(f, "/etc/")] == ["etc/f"]


def test_recipe_methods_check_their_input(tmp_path: Path) -> None:
    img = Image.from_image("base")
    with pytest.raises(InvalidArgument):
        img.apt_install()
    with pytest.raises(InvalidArgument):
        img.apt_install("git; rm -rf /")
    with pytest.raises(InvalidArgument):
        img.copy(tmp_path / "nope", "/x")
    with pytest.raises(InvalidArgument):
        img.copy(tmp_path, "relative")
    chained = img.run("a").env({"X": "1"})
    assert img.steps == () and len(chained.steps) == 2     # immutable recipes
    assert "RUN a" in repr(chained)
