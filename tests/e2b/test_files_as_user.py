"""``files.*(user=...)`` at every door: dsec's SDK over REST and over the gateway, and the
E2B layer. The calls run AS that sandbox user on the edge (red team 21, B1 B4 B10 B11):
the kernel refuses what the user may not do, and what they make is theirs."""

from __future__ import annotations

import pytest

from dsec import LocalCluster
from dsec.bench._e2b_calls import E2BTarget
from dsec.errors import PermissionDenied

pytestmark = pytest.mark.root

SETUP = ("mkdir -p /srv/h /tmp/u/a/b && echo secret > /srv/h/s && chmod 700 /srv/h && "
         "chown -R user /tmp/u && ln -s /tmp/u/a/b /tmp/u/l")


@pytest.mark.parametrize("protocol", ["http", "aether"])
def test_sdk_files_as_a_user(e2b_cluster: LocalCluster, e2b_target: E2BTarget,
                             protocol: str) -> None:
    with e2b_cluster.client(session_lease_s=None, protocol=protocol) as c:
        sb = c.sandboxes.create(image=e2b_target.template)
        try:
            assert sb.exec(SETUP, user="root").exit_code == 0
            passwd = sb.files.read("/etc/passwd")
            for call in (lambda: sb.files.read("/srv/h/s", user="user"),
                         lambda: sb.files.read("/srv/h/s", user="user", stream=True),
                         lambda: sb.files.list("/srv/h", user="user"),
                         lambda: sb.files.write("/tmp/u/l/../../../etc/passwd", "x",
                                                user="user"),
                         lambda: sb.files.write("/etc/passwd", "x", user="user",
                                                append=True),
                         lambda: sb.files.remove("/etc/passwd", user="user"),
                         lambda: sb.files.mkdir("/srv/new", user="user")):
                with pytest.raises(PermissionDenied):
                    r = call()
                    if not isinstance(r, (bytes, list, type(None))):
                        b"".join(r)     # type: ignore[arg-type]  # a stream: read it
            assert sb.files.read("/etc/passwd") == passwd
            sb.files.write("/tmp/u/d/f", "mine", user="user")
            sb.files.rename("/tmp/u/d/f", "/tmp/u/d/g", user="user")
            assert sb.files.read("/tmp/u/d/g", user="user") == b"mine"
            assert sb.files.stat("/tmp/u/d/g", user="user").size == 4
            assert sb.exec("stat -c '%U' /tmp/u/d /tmp/u/d/g").stdout.split() == \
                [b"user", b"user"]
            # a symlinked file reads whole (its size is the target's: B5)
            assert sb.exec("ln -s /tmp/u/d/g /tmp/u/link").exit_code == 0
            assert b"".join(sb.files.read("/tmp/u/link", stream=True,
                                          user="user")) == b"mine"
            assert sb.files.read("/tmp/u/link") == b"mine"
        finally:
            sb.kill()


def test_e2b_files_as_a_user(e2b_target: E2BTarget) -> None:
    from e2b import Sandbox
    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        sb.commands.run(SETUP, user="root")
        for call in (lambda: sb.files.read("/srv/h/s", user="user"),
                     lambda: sb.files.list("/srv/h", user="user"),
                     lambda: sb.files.remove("/etc/passwd", user="user"),
                     lambda: sb.files.rename("/etc/passwd", "/etc/p2", user="user"),
                     lambda: sb.files.make_dir("/srv/new", user="user"),
                     # a watch as the user needs the user's right to list the directory
                     lambda: sb.files.watch_dir("/srv/h", user="user"),
                     lambda: sb.files.watch_dir("/srv/h/sub", user="user")):
            with pytest.raises(Exception, match="(?i)permission|denied|forbidden"):
                call()
        w = sb.files.watch_dir("/tmp/u", user="user")      # the user's own: watched
        w.stop()
        sb.files.write("/tmp/u/d/e/f", "mine", user="user")
        sb.files.make_dir("/tmp/u/m", user="user")
        assert sb.files.read("/tmp/u/d/e/f", user="user") == "mine"
        out = sb.commands.run("stat -c '%U' /tmp/u/d /tmp/u/d/e /tmp/u/d/e/f /tmp/u/m",
                              user="root").stdout
        assert out.split() == ["user"] * 4, out
        # depth listing: what the user may list, entries below a 700 root dir left out
        names = {e.path for e in sb.files.list("/srv", depth=2, user="user")}
        assert "/srv/h" in names and "/srv/h/s" not in names, names
        sb.files.remove("/tmp/u/d", user="user")
        assert not sb.files.exists("/tmp/u/d", user="user")
    finally:
        sb.kill()


def test_cli_cp_copies_a_symlinked_file_whole(e2b_cluster: LocalCluster,
                                              e2b_target: E2BTarget, tmp_path: object) -> None:
    """``dsec sandbox cp ID:/link local``: the link's stat said "symlink" (size: its
    target's name), which cp refused; it copies the file it names (B5's class)."""
    import os

    from click.testing import CliRunner

    from dsec.cli.main import cli
    with e2b_cluster.client(session_lease_s=None) as c:
        sb = c.sandboxes.create(image=e2b_target.template)
        try:
            sb.files.write("/tmp/real.bin", b"z" * 5001)
            assert sb.exec("ln -s /tmp/real.bin /tmp/link").exit_code == 0
            out = os.path.join(str(tmp_path), "got.bin")
            r = CliRunner().invoke(cli, ["sandbox", "cp", f"{sb.id}:/tmp/link", out],
                                   env={"DSEC_URL": e2b_cluster.url,
                                        "DSEC_API_KEY": e2b_cluster.api_key},
                                   catch_exceptions=False)
            assert r.exit_code == 0, r.output
            with open(out, "rb") as f:
                assert f.read() == b"z" * 5001
        finally:
            sb.kill()
