"""``dsec sandbox cp`` (issue 19): both directions with ``ID:/path``, stdin/stdout,
directories as destinations, clear refusals, and the progress bar on a real terminal."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import subprocess
import sys
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from dsec.cli.cp import parse_target
from dsec.cli.main import cli
from dsec.cluster.local import LocalCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(edges=1) as cl:
        yield cl


def _run(cluster: LocalCluster, *args: str, stdin: bytes | None = None) -> tuple[int, str]:
    env = {"DSEC_URL": cluster.url, "DSEC_API_KEY": cluster.api_key}
    r = CliRunner().invoke(cli, list(args), env=env, input=stdin, catch_exceptions=False)
    return r.exit_code, r.output


def test_targets_parse_like_docker_cp() -> None:
    assert parse_target("sb-1:/a/b") == ("sb-1", "/a/b")
    assert parse_target("sb-1:a") == ("sb-1", "/a")
    assert parse_target("./x:y") == (None, "./x:y")
    assert parse_target("/tmp/x") == (None, "/tmp/x")
    assert parse_target("-") == (None, "-")


def test_cp_both_ways(cluster: LocalCluster, tmp_path: object) -> None:
    d = str(tmp_path)
    data = os.urandom(3 << 20)
    with open(os.path.join(d, "in.bin"), "wb") as f:
        f.write(data)
    with cluster.client(session_lease_s=None) as c:
        sb = c.sandboxes.create()
        try:
            code, out = _run(cluster, "sandbox", "cp", os.path.join(d, "in.bin"),
                             f"{sb.id}:/tmp/in.bin", "--json")
            assert code == 0, out
            assert json.loads(out)["bytes"] == len(data)
            assert sb.files.read("/tmp/in.bin") == data
            # into a directory: the file's own name
            sb.files.mkdir("/tmp/dir")
            assert _run(cluster, "sandbox", "cp", os.path.join(d, "in.bin"),
                        f"{sb.id}:/tmp/dir")[0] == 0
            assert sb.files.stat("/tmp/dir/in.bin").size == len(data)
            # back, to a file and to a directory
            code, out = _run(cluster, "sandbox", "cp", f"{sb.id}:/tmp/in.bin",
                             os.path.join(d, "out.bin"))
            assert code == 0, out
            with open(os.path.join(d, "out.bin"), "rb") as f:
                assert hashlib.sha256(f.read()).digest() == hashlib.sha256(data).digest()
            os.mkdir(os.path.join(d, "o"))
            assert _run(cluster, "sandbox", "cp", f"{sb.id}:/tmp/dir/in.bin",
                        os.path.join(d, "o"))[0] == 0
            assert os.path.getsize(os.path.join(d, "o", "in.bin")) == len(data)
            # stdin and stdout
            assert _run(cluster, "sandbox", "cp", "-", f"{sb.id}:/tmp/s",
                        stdin=b"from stdin")[0] == 0
            assert sb.files.read("/tmp/s") == b"from stdin"
            code, out = _run(cluster, "sandbox", "cp", f"{sb.id}:/tmp/s", "-")
            assert code == 0 and out == "from stdin"
            # refusals that say what to do
            code, out = _run(cluster, "sandbox", "cp", "a", "b")
            assert code == 2 and "SANDBOX_ID:/path" in out
            code, out = _run(cluster, "sandbox", "cp", d, f"{sb.id}:/tmp/x")
            assert code == 2 and "is a directory" in out
            code, out = _run(cluster, "sandbox", "cp", f"{sb.id}:/tmp/dir", d)
            assert code == 2 and "is a dir" in out
            code, out = _run(cluster, "sandbox", "cp", f"{sb.id}:/tmp/none", d)
            assert code == 1 and "not_found" in out
        finally:
            sb.kill()


def test_cp_shows_a_progress_bar_on_a_terminal(cluster: LocalCluster, tmp_path: object) -> None:
    src = os.path.join(str(tmp_path), "p.bin")
    with open(src, "wb") as f:
        f.write(os.urandom(2 << 20))
    with cluster.client(session_lease_s=None) as c:
        sb = c.sandboxes.create()
        try:
            master, slave = pty.openpty()
            env = {**os.environ, "DSEC_URL": cluster.url, "DSEC_API_KEY": cluster.api_key,
                   "COLUMNS": "120"}
            p = subprocess.run(
                [sys.executable, "-c", "from dsec.cli.main import main; main()", "sandbox",
                 "cp", src, f"{sb.id}:/tmp/p.bin"], env=env, stdout=subprocess.PIPE,
                stderr=slave, timeout=60, check=False)
            os.close(slave)
            seen = b""
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                seen += chunk
            os.close(master)
            assert p.returncode == 0, seen
            text = seen.decode(errors="replace")
            assert "p.bin" in text and "2.1" in text and "MB" in text, text   # the bar
            assert sb.files.stat("/tmp/p.bin").size == 2 << 20
        finally:
            sb.kill()
