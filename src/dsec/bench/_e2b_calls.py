"""The stock E2B SDK's public calls, each checked against what E2B documents, run against
dsec's E2B layer (issue 20). Shared by ``tests/e2b`` (one test per call) and the ``e2b``
bench suite (``e2b_calls_compatible_ratio``: the fraction of these calls that behave as
E2B documents, computed from a run, never written down).

A :class:`Call` checks E2B's documented behaviour; where dsec's layer does not (yet) do
what E2B documents, it checks that the SDK raises the exact error docs/e2b.md names and
raises :class:`Gap`: the call then passes its test but never counts as compatible.

Needs the ``e2b`` extra (``pip install -e '.[e2b]'``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CALLS",
    "TEMPLATE_SETUP",
    "Call",
    "E2BTarget",
    "Gap",
    "Outcome",
    "harness_dsec",
    "harness_e2b",
    "run_calls",
    "stage_python_root",
]


#: What the tests' and the bench's ``e2b-base`` template adds to busybox ``base``: a
#: ``/bin/bash`` that runs busybox ``sh`` (the SDK's ``/bin/bash -l -c CMD`` then runs as
#: on E2B; ``base`` itself serves the no-bash fallback's check) and E2B's usual non-root
#: ``user`` (uid 1000) for ``user=`` calls.
TEMPLATE_SETUP = (
    "printf '#!/bin/sh\\nexec /bin/sh \"$@\"\\n' > /bin/bash && chmod 755 /bin/bash && "
    "mkdir -p /etc /home/user && touch /etc/passwd /etc/group && "
    "{ grep -q '^root:' /etc/passwd || echo 'root:x:0:0:root:/root:/bin/sh' >> /etc/passwd; } && "
    "{ grep -q '^root:' /etc/group || echo 'root:x:0:' >> /etc/group; } && "
    "echo 'user:x:1000:1000:user:/home/user:/bin/sh' >> /etc/passwd && "
    "echo 'user:x:1000:' >> /etc/group && chown 1000:1000 /home/user")


@dataclass(frozen=True)
class E2BTarget:
    """Where the stock SDK is pointed: ``url`` (E2B_API_URL = E2B_SANDBOX_URL), a member
    key of the default project, a reader key there, an admin key of another project,
    and the template (dsec image) with /bin/bash that commands run in."""

    url: str
    api_key: str
    reader_key: str
    stranger_key: str
    template: str
    # an image with python3 (the code interpreter's kernel); None: its calls are skipped
    # as failures naming the missing image
    python_template: str | None = None

    def opts(self, key: str | None = None) -> dict[str, Any]:
        return {"api_url": self.url, "sandbox_url": self.url,
                "api_key": key or self.api_key}


class Gap(Exception):
    """The call met a documented gap: the SDK raised exactly the error docs/e2b.md names."""


@dataclass(frozen=True)
class Call:
    name: str
    fn: Callable[[E2BTarget], None]


@dataclass
class Outcome:
    name: str
    ok: bool
    compatible: bool
    error: str = ""
    seconds: float = 0.0


CALLS: list[Call] = []


def _call(name: str) -> Callable[[Callable[[E2BTarget], None]],
                                  Callable[[E2BTarget], None]]:
    def deco(fn: Callable[[E2BTarget], None]) -> Callable[[E2BTarget], None]:
        CALLS.append(Call(name, fn))
        return fn
    return deco


def _gap(exc: BaseException, words: str) -> Gap:
    """``exc`` must carry ``words`` (the documented error); the Gap to raise."""
    assert words in str(exc), f"expected the documented error {words!r}, got {exc!r}"
    return Gap(str(exc)[:300])


def _create(t: E2BTarget, **kw: Any) -> Any:
    from e2b import Sandbox
    return Sandbox.create(t.template, timeout=kw.pop("timeout", 120), **t.opts(), **kw)


# ------------------------------------------------------------------ control (sync)
@_call("Sandbox.create")
def _c_create(t: E2BTarget) -> None:
    sb = _create(t, metadata={"run": "e2b-create"}, envs={"GREETING": "hi there"})
    try:
        assert sb.sandbox_id and sb.is_running()
        assert sb.commands.run("echo $GREETING").stdout == "hi there\n"
    finally:
        sb.kill()


@_call("Sandbox.get_info")
def _c_info(t: E2BTarget) -> None:
    sb = _create(t, metadata={"run": "e2b-info"}, timeout=200)
    try:
        info = sb.get_info()
        assert info.sandbox_id == sb.sandbox_id and info.state.value == "running"
        assert info.metadata == {"run": "e2b-info"}, info.metadata
        assert info.template_id.endswith(t.template)
        left = (info.end_at - info.started_at).total_seconds()
        assert 190 <= left <= 210, left
    finally:
        sb.kill()


@_call("Sandbox.connect")
def _c_connect(t: E2BTarget) -> None:
    from e2b.exceptions import SandboxNotFoundException

    from e2b import Sandbox
    sb = _create(t)
    try:
        sb.files.write("/tmp/mark", "x")
        again = Sandbox.connect(sb.sandbox_id, **t.opts())
        assert again.sandbox_id == sb.sandbox_id
        assert again.files.read("/tmp/mark") == "x"
    finally:
        sb.kill()
    try:
        Sandbox.connect(sb.sandbox_id, **t.opts())
    except SandboxNotFoundException:
        return
    raise AssertionError("connect to a killed sandbox did not raise SandboxNotFound")


@_call("Sandbox.list")
def _c_list(t: E2BTarget) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState
    tag = f"list-{os.getpid()}-{time.monotonic_ns()}"
    sbs = [_create(t, metadata={"tag": tag}) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}), limit=2,
                             **t.opts())
        seen: list[str] = []
        pages = 0
        while pager.has_next:
            seen += [s.sandbox_id for s in pager.next_items()]
            pages += 1
        assert sorted(seen) == sorted(s.sandbox_id for s in sbs), seen
        assert pages >= 2, pages
        # order by start time across the whole result, before paging; startedAfter and
        # template filter it
        orders: list[tuple[Literal["asc", "desc"], list[str]]] = [
            ("asc", [s.sandbox_id for s in sbs]),
            ("desc", [s.sandbox_id for s in reversed(sbs)])]
        for order, want in orders:
            pager = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}), order=order,
                                 limit=2, **t.opts())
            got: list[str] = []
            while pager.has_next:
                got += [s.sandbox_id for s in pager.next_items()]
            assert got == want, (order, got, want)
        second = sbs[1].get_info().started_at
        later = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, started_after=second),
                             order="asc", **t.opts()).next_items()
        assert [s.sandbox_id for s in later] == [s.sandbox_id for s in sbs[1:]], later
        assert len(Sandbox.list(query=SandboxQuery(metadata={"tag": tag},
                                                   template=t.template),
                                **t.opts()).next_items()) == 3
        assert Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, template="nope"),
                            **t.opts()).next_items() == []
        sbs[0].pause()
        paused = Sandbox.list(query=SandboxQuery(metadata={"tag": tag},
                                                 state=[SandboxState.PAUSED]),
                              **t.opts()).next_items()
        assert [s.sandbox_id for s in paused] == [sbs[0].sandbox_id], paused
        running = Sandbox.list(query=SandboxQuery(metadata={"tag": tag},
                                                  state=[SandboxState.RUNNING]),
                               **t.opts()).next_items()
        assert sorted(s.sandbox_id for s in running) == sorted(
            s.sandbox_id for s in sbs[1:])
    finally:
        for s in sbs:
            s.kill()


@_call("Sandbox.set_timeout")
def _c_timeout(t: E2BTarget) -> None:
    sb = _create(t, timeout=60)
    try:
        sb.set_timeout(900)
        info = sb.get_info()
        left = (info.end_at.timestamp() - time.time())
        assert 880 <= left <= 905, left
    finally:
        sb.kill()


@_call("Sandbox.pause")
def _c_pause(t: E2BTarget) -> None:
    from e2b import Sandbox
    sb = _create(t)
    try:
        sb.files.write("/tmp/kept", "state")
        assert sb.pause() is True
        assert sb.get_info().state.value == "paused"
        assert Sandbox.pause(sb.sandbox_id, **t.opts()) is False   # already paused: 409
        Sandbox.connect(sb.sandbox_id, **t.opts())                 # resumes
        assert sb.get_info().state.value == "running"
        assert sb.files.read("/tmp/kept") == "state"
    finally:
        sb.kill()


@_call("Sandbox lifecycle on_timeout pause, auto_resume")
def _c_lifecycle(t: E2BTarget) -> None:
    """The timeout pauses instead of killing (autoPause); the sandbox, its files and its
    processes come back on connect, or on a command (autoResume)."""
    from e2b import Sandbox
    sb = _create(t, timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        info = sb.get_info()
        assert info.lifecycle is not None and info.lifecycle["on_timeout"] == "pause", info
        sb.files.write("/tmp/kept", "state")
        sb.commands.run("sleep 600", background=True)
        deadline = time.monotonic() + 15
        while sb.get_info().state.value != "paused":
            assert time.monotonic() < deadline, "the timeout did not pause the sandbox"
            time.sleep(0.2)
        assert sb.sandbox_id in [s.sandbox_id for s in Sandbox.list(**t.opts()).next_items()]
        assert sb.commands.run("cat /tmp/kept").stdout == "state"     # auto-resumed
        assert sb.get_info().state.value == "running"
        assert "sleep 600" in sb.commands.run("ps -o args").stdout     # its processes too
        sb.set_timeout(60)
    finally:
        sb.kill()
    plain = _create(t)
    try:
        assert plain.get_info().lifecycle["on_timeout"] == "kill"
    finally:
        plain.kill()
    _auto_resume_off(t)


def _auto_resume_off(t: E2BTarget) -> None:
    """``auto_resume=False``: a command or a write on the paused sandbox fails as on E2B
    (SandboxNotRunningException) and leaves it paused; connect() resumes it."""
    from e2b import SandboxNotRunningException
    off = _create(t, lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        assert off.get_info().lifecycle["auto_resume"] is False
        off.files.write("/tmp/kept", "before")
        assert off.pause() is not False
        acts: tuple[tuple[str, Callable[[], object]], ...] = (
            ("commands.run", lambda: off.commands.run("true")),
            ("files.write", lambda: off.files.write("/tmp/kept", "after")),
            ("files.make_dir", lambda: off.files.make_dir("/tmp/d")))
        for what, act in acts:
            try:
                act()
            except SandboxNotRunningException as exc:
                assert "auto_resume=False" in str(exc), exc
            else:
                raise AssertionError(f"{what} resumed a paused auto_resume=False sandbox")
        assert off.get_info().state.value == "paused"
        off.connect()
        assert off.commands.run("cat /tmp/kept").stdout == "before"
    finally:
        off.kill()


@_call("Sandbox.kill")
def _c_kill(t: E2BTarget) -> None:
    from e2b.exceptions import SandboxNotFoundException

    from e2b import Sandbox
    sb = _create(t)
    assert sb.kill() is True
    assert Sandbox.kill(sb.sandbox_id, **t.opts()) is False    # 404: already gone
    assert Sandbox.kill("sb-000000000000-nowhere", **t.opts()) is False
    assert sb.is_running() is False
    try:
        sb.get_info()
    except SandboxNotFoundException:
        return
    raise AssertionError("get_info of a killed sandbox did not raise SandboxNotFound")


@_call("another project's key sees nothing")
def _c_tenancy(t: E2BTarget) -> None:
    from e2b.exceptions import SandboxNotFoundException

    from e2b import Sandbox
    sb = _create(t)
    try:
        stranger = t.opts(t.stranger_key)
        for fn in (lambda: Sandbox.get_info(sb.sandbox_id, **stranger),
                   lambda: Sandbox.connect(sb.sandbox_id, **stranger),
                   lambda: Sandbox.set_timeout(sb.sandbox_id, 10, **stranger),
                   lambda: Sandbox.pause(sb.sandbox_id, **stranger)):
            try:
                fn()
            except SandboxNotFoundException:
                continue
            raise AssertionError("another project's key reached the sandbox")
        assert Sandbox.kill(sb.sandbox_id, **stranger) is False
        listed = Sandbox.list(**stranger).next_items()
        assert sb.sandbox_id not in [s.sandbox_id for s in listed]
        assert sb.is_running()
    finally:
        sb.kill()


@_call("a reader key cannot create; no key is AuthenticationException")
def _c_auth(t: E2BTarget) -> None:
    from e2b.exceptions import AuthenticationException, SandboxException

    from e2b import Sandbox
    try:
        Sandbox.create(t.template, **t.opts(t.reader_key))
    except SandboxException as exc:
        assert "403" in str(exc), exc
    else:
        raise AssertionError("a reader key created a sandbox")
    try:
        Sandbox.list(**t.opts("dsk_0000000000000000_wrong")).next_items()
    except AuthenticationException:
        return
    raise AssertionError("a wrong key was not refused with AuthenticationException")


# ---------------------------------------------------------------------- commands
@_call("commands.run foreground")
def _c_run(t: E2BTarget) -> None:
    from e2b import CommandExitException
    sb = _create(t)
    try:
        r = sb.commands.run("echo out; echo err >&2", cwd="/tmp", envs={"A": "1"})
        assert (r.exit_code, r.stdout, r.stderr) == (0, "out\n", "err\n"), r
        assert sb.commands.run("pwd; echo $A", cwd="/tmp", envs={"A": "1"}).stdout == \
            "/tmp\n1\n"
        try:
            sb.commands.run("echo nope; exit 3")
        except CommandExitException as exc:
            assert exc.exit_code == 3 and exc.stdout == "nope\n", exc
        else:
            raise AssertionError("a failing command did not raise CommandExitException")
    finally:
        sb.kill()


@_call("commands.run on an image without bash")
def _c_no_bash(t: E2BTarget) -> None:
    from e2b import Sandbox
    sb = Sandbox.create("base", timeout=120, **t.opts())     # busybox: no /bin/bash
    try:
        r = sb.commands.run("echo $((6 * 7)) in $PWD; echo $V >&2", cwd="/tmp",
                            envs={"V": "env"})
        assert (r.exit_code, r.stdout, r.stderr) == (0, "42 in /tmp\n", "env\n"), r
        h = sb.commands.run("sleep 0.2; echo bg", background=True)
        assert h.wait().stdout == "bg\n"
    finally:
        sb.kill()


@_call("commands.run background")
def _c_background(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        h = sb.commands.run("sleep 0.5; echo done", background=True)
        assert h.pid > 0
        assert h.wait().stdout == "done\n"
    finally:
        sb.kill()


@_call("commands.run streaming callbacks")
def _c_callbacks(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        out: list[str] = []
        err: list[str] = []
        r = sb.commands.run("for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.1; done",
                            on_stdout=out.append, on_stderr=err.append)
        assert "".join(out) == "o1\no2\no3\n" == r.stdout, (out, r)
        assert "".join(err) == "e1\ne2\ne3\n", err
        assert len(out) >= 2, out     # streamed in pieces, not one at the end
    finally:
        sb.kill()


@_call("commands.run timeout")
def _c_cmd_timeout(t: E2BTarget) -> None:
    from e2b.exceptions import TimeoutException
    sb = _create(t)
    try:
        t0 = time.monotonic()
        try:
            sb.commands.run("sleep 30", timeout=1)
        except TimeoutException:
            assert time.monotonic() - t0 < 15
        else:
            raise AssertionError("a command past its timeout did not raise Timeout")
        assert sb.commands.run("echo alive").stdout == "alive\n"
    finally:
        sb.kill()


@_call("commands.kill")
def _c_cmd_kill(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        h = sb.commands.run("sleep 60", background=True)
        assert h.pid in [p.pid for p in sb.commands.list()]
        assert h.kill() is True
        deadline = time.monotonic() + 10
        while h.pid in [p.pid for p in sb.commands.list()]:
            assert time.monotonic() < deadline, "killed command still listed"
            time.sleep(0.1)
        assert sb.commands.kill(h.pid) is False     # gone: NOT_FOUND -> False
        ps = sb.commands.run("ps -o pid,args").stdout
        assert "sleep 60" not in ps, ps              # killed in the sandbox, not just here
    finally:
        sb.kill()


@_call("commands.run stdin")
def _c_stdin(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        h = sb.commands.run("cat; echo end", background=True, stdin=True)
        h.send_stdin("hello ")
        sb.commands.send_stdin(h.pid, b"world\n")
        h.close_stdin()
        assert h.wait().stdout == "hello world\nend\n"
    finally:
        sb.kill()


@_call("commands.connect")
def _c_cmd_connect(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        h = sb.commands.run("echo first; sleep 1; echo second", background=True)
        h.disconnect()
        again = sb.commands.connect(h.pid)          # output kept, then followed live
        assert again.wait().stdout == "first\nsecond\n"
        assert h.pid not in [p.pid for p in sb.commands.list()]
    finally:
        sb.kill()


@_call("pty.create/send_stdin/resize/kill")
def _c_pty(t: E2BTarget) -> None:
    from e2b.exceptions import InvalidArgumentException

    from e2b import PtySize
    sb = _create(t)
    try:
        out = bytearray()
        try:
            h = sb.pty.create(PtySize(rows=24, cols=80))
        except InvalidArgumentException as exc:
            raise _gap(exc, "backend has no terminals") from None
        sb.pty.resize(h.pid, PtySize(rows=30, cols=100))
        sb.pty.send_stdin(h.pid, b"stty size; echo pty-$((6*7)); exit 3\n")
        try:
            h.wait(on_pty=out.extend)
        except Exception as exc:   # noqa: BLE001 - exit 3: CommandExitException
            assert getattr(exc, "exit_code", None) == 3, exc
        text = out.decode(errors="replace")
        assert "30 100" in text and "pty-42" in text, text
        h2 = sb.pty.create(PtySize(rows=24, cols=80))
        assert sb.pty.kill(h2.pid) is True
    finally:
        sb.kill()


# ------------------------------------------------------------------------ files
@_call("files.write/read")
def _c_rw(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        info = sb.files.write("/tmp/w/a.txt", "héllo")      # parents made, as envd does
        assert info.path == "/tmp/w/a.txt" and info.name == "a.txt", info
        assert sb.files.read("/tmp/w/a.txt") == "héllo"
        sb.files.write("/tmp/w/b.bin", b"\x00\xff\x01")
        assert bytes(sb.files.read("/tmp/w/b.bin", format="bytes")) == b"\x00\xff\x01"
        assert b"".join(sb.files.read("/tmp/w/b.bin", format="stream")) == b"\x00\xff\x01"
        text = "zipped line\n" * 5000                      # gzip=True: inflated on the way
        sb.files.write("/tmp/w/g.txt", text, gzip=True)
        assert sb.files.read("/tmp/w/g.txt", gzip=True) == text
        assert sb.commands.run("wc -c < /tmp/w/g.txt").stdout.strip() == str(len(text))
    finally:
        sb.kill()


@_call("files.list")
def _c_list_files(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        sb.files.write("/tmp/l/x.txt", "12345")
        sb.files.make_dir("/tmp/l/sub")
        sb.files.write("/tmp/l/sub/y.txt", "y")
        top = {e.name: e for e in sb.files.list("/tmp/l")}
        assert set(top) == {"x.txt", "sub"}, top
        assert top["x.txt"].size == 5 and top["x.txt"].type.value == "file"
        assert top["sub"].type.value == "dir"
        deep = {e.path for e in sb.files.list("/tmp/l", depth=2)}
        assert "/tmp/l/sub/y.txt" in deep, deep
    finally:
        sb.kill()


@_call("files with user=")
def _c_files_user(t: E2BTarget) -> None:
    """Files written and directories made with ``user=`` are that user's (the busybox
    template's ``user``, uid 1000: TEMPLATE_SETUP); a directory the user may not write refuses."""
    from e2b.exceptions import SandboxException
    sb = _create(t)
    try:
        sb.files.write("/tmp/u/deep/owned.txt", "mine", user="user")
        sb.files.make_dir("/tmp/ud", user="user")
        sb.files.write("/tmp/rootfile", "root's")              # no user: root, as before
        out = sb.commands.run("stat -c '%U:%G %n' /tmp/u /tmp/u/deep /tmp/u/deep/owned.txt "
                              "/tmp/ud /tmp/rootfile").stdout
        assert out == ("user:user /tmp/u\nuser:user /tmp/u/deep\n"
                       "user:user /tmp/u/deep/owned.txt\nuser:user /tmp/ud\n"
                       "root:root /tmp/rootfile\n"), out
        assert sb.files.read("/tmp/u/deep/owned.txt", user="user") == "mine"
        sb.commands.run("mkdir -m 700 /tmp/closed")
        refused: list[Callable[[], object]] = [
            lambda: sb.files.write("/tmp/closed/x", "no", user="user"),
            lambda: sb.files.write("/tmp/rootfile", "no", user="user"),
            lambda: sb.files.make_dir("/tmp/closed/d", user="user")]
        for fn in refused:
            try:
                fn()
            except SandboxException as exc:
                assert "as user 'user'" in str(exc), exc
            else:
                raise AssertionError("a user wrote where it may not")
        assert sb.files.read("/tmp/rootfile") == "root's"
        # reads, lists, removes and renames with user= are done as the user (the kernel's
        # answer: EACCES, or EPERM for another's file in the sticky /tmp)
        sb.commands.run("echo s > /tmp/closed/secret && chmod 600 /tmp/rootfile")
        denied: list[tuple[Callable[[], object], str]] = [
            (lambda: sb.files.read("/tmp/rootfile", user="user"), "Permission denied"),
            (lambda: sb.files.list("/tmp/closed", user="user"), "Permission denied"),
            (lambda: sb.files.remove("/tmp/rootfile", user="user"), "Operation not permitted"),
            (lambda: sb.files.rename("/tmp/rootfile", "/tmp/mine", user="user"),
             "Operation not permitted")]
        for fn, words in denied:
            try:
                fn()
            except SandboxException as exc:
                assert "as user 'user'" in str(exc) and words in str(exc), exc
            else:
                raise AssertionError(f"user= did not refuse: {words}")
        assert sb.files.exists("/tmp/rootfile")
        sb.files.rename("/tmp/u/deep/owned.txt", "/tmp/u/moved.txt", user="user")
        assert [e.name for e in sb.files.list("/tmp/u", user="user")] == ["deep", "moved.txt"]
        sb.files.remove("/tmp/u/deep", user="user")
        assert not sb.files.exists("/tmp/u/deep")
    finally:
        sb.kill()


@_call("files.exists")
def _c_exists(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        sb.files.write("/tmp/e.txt", "e")
        assert sb.files.exists("/tmp/e.txt") is True
        assert sb.files.exists("/tmp/none.txt") is False
    finally:
        sb.kill()


@_call("files.make_dir")
def _c_mkdir(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        assert sb.files.make_dir("/tmp/m/n") is True
        assert sb.files.make_dir("/tmp/m/n") is False       # exists: False
        assert sb.files.get_info("/tmp/m/n").type.value == "dir"
    finally:
        sb.kill()


@_call("files.remove")
def _c_remove(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        sb.files.write("/tmp/r/f.txt", "f")
        sb.files.remove("/tmp/r/f.txt")
        assert not sb.files.exists("/tmp/r/f.txt")
        sb.files.write("/tmp/r/d/g.txt", "g")
        sb.files.remove("/tmp/r")                          # a whole tree
        assert not sb.files.exists("/tmp/r")
    finally:
        sb.kill()


@_call("files.rename")
def _c_rename(t: E2BTarget) -> None:
    from e2b.exceptions import SandboxException
    sb = _create(t)
    try:
        sb.files.write("/tmp/a.txt", "a")
        try:
            sb.files.rename("/tmp/a.txt", "/tmp/b.txt")
        except SandboxException as exc:
            raise _gap(exc, "filesystem.Filesystem/Move is not supported") from None
        assert not sb.files.exists("/tmp/a.txt") and sb.files.read("/tmp/b.txt") == "a"
    finally:
        sb.kill()


@_call("files.watch_dir")
def _c_watch(t: E2BTarget) -> None:
    from e2b.exceptions import SandboxException
    sb = _create(t)
    try:
        try:
            w = sb.files.watch_dir("/tmp")
        except SandboxException as exc:
            raise _gap(exc, "filesystem.Filesystem/CreateWatcher is not supported"
                       ) from None
        sb.files.write("/tmp/watched.txt", "w")
        deadline = time.monotonic() + 10
        names: set[str] = set()
        while "watched.txt" not in names:
            assert time.monotonic() < deadline, names
            names |= {e.name for e in w.get_new_events()}
            time.sleep(0.1)
        w.stop()
    finally:
        sb.kill()


@_call("big file upload/download")
def _c_big(t: E2BTarget) -> None:
    import io
    sb = _create(t)
    try:
        data = os.urandom(40 << 20)
        digest = hashlib.sha256(data).hexdigest()
        sb.files.write("/tmp/big.bin", io.BytesIO(data))        # streamed (octet-stream)
        r = sb.commands.run("sha256sum /tmp/big.bin")
        assert r.stdout.split()[0] == digest
        back = hashlib.sha256()
        for chunk in sb.files.read("/tmp/big.bin", format="stream"):
            back.update(chunk)
        assert back.hexdigest() == digest
        sb.files.write("/tmp/big2.bin", data[: 20 << 20])          # multipart, in memory
        assert hashlib.sha256(bytes(sb.files.read("/tmp/big2.bin", format="bytes"))
                              ).digest() == hashlib.sha256(data[: 20 << 20]).digest()
    finally:
        sb.kill()


@_call("Sandbox.get_metrics")
def _c_metrics(t: E2BTarget) -> None:
    sb = _create(t)
    try:
        sb.commands.run("dd if=/dev/zero of=/var/z bs=1M count=8 2>/dev/null; sync")
        (m,) = sb.get_metrics()
        assert m.cpu_count >= 1 and m.mem_total > 0 and 0 < m.mem_used <= m.mem_total, m
        assert m.disk_used >= 8 << 20 and 0 <= m.cpu_used_pct <= 100 * m.cpu_count, m
    finally:
        sb.kill()


@_call("unsupported create options and routes")
def _c_unsupported(t: E2BTarget) -> None:
    """Each refused with a message that names it (never dropped silently), and an
    unserved route on a live sandbox is never "sandbox not found"."""
    from e2b.exceptions import SandboxException

    from e2b import Sandbox
    o = t.opts()
    # the test cluster's nodes have no uplink: 'open' egress is refused by name
    words = "network mode 'open' needs this node's network router"
    try:
        Sandbox.create(t.template, allow_internet_access=True, **o)
    except SandboxException as exc:
        assert words in str(exc), exc
    else:
        raise AssertionError(f"not refused: {words}")
    sb = _create(t)
    try:
        try:
            sb.create_snapshot()
        except SandboxException as exc:
            assert type(exc) is SandboxException and "501:" in str(exc), exc
        else:
            raise AssertionError("create_snapshot answered")
    finally:
        sb.kill()
    raise Gap("refused as documented: network rules without an uplink, snapshots")


# ------------------------------------------------------------------------ async
@_call("AsyncSandbox create/connect/list/get_info/set_timeout/pause/kill")
def _c_async(t: E2BTarget) -> None:
    asyncio.run(_async_lifecycle(t))


async def _async_lifecycle(t: E2BTarget) -> None:
    from e2b import AsyncSandbox, SandboxQuery
    tag = f"async-{os.getpid()}-{time.monotonic_ns()}"
    sb = await AsyncSandbox.create(t.template, timeout=120, metadata={"tag": tag},
                                   **t.opts())
    try:
        assert (await sb.get_info()).metadata == {"tag": tag}
        listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"tag": tag}),
                                         **t.opts()).next_items()
        assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
        await sb.set_timeout(600)
        assert await sb.pause() is True
        assert (await sb.get_info()).state.value == "paused"
        again = await AsyncSandbox.connect(sb.sandbox_id, **t.opts())
        assert (await again.get_info()).state.value == "running"
        r = await again.commands.run("echo async")
        assert r.stdout == "async\n"
        await again.files.write("/tmp/a.txt", "A")
        assert await again.files.read("/tmp/a.txt") == "A"
        chunks: list[str] = []
        h = await again.commands.run("echo 1; sleep 0.2; echo 2", background=True,
                                     on_stdout=chunks.append)
        assert (await h.wait()).stdout == "1\n2\n" and "".join(chunks) == "1\n2\n"
    finally:
        assert await sb.kill() is True
    assert await AsyncSandbox.kill(sb.sandbox_id, **t.opts()) is False


# -------------------------------------------------------------- code interpreter
@_call("e2b_code_interpreter run_code")
def _c_code(t: E2BTarget) -> None:
    from e2b_code_interpreter import Sandbox as CodeSandbox
    assert t.python_template, "no python3 template given (E2BTarget.python_template)"
    sb = CodeSandbox.create(t.python_template, timeout=120, **t.opts())
    try:
        first = sb.run_code("x = 41\nprint('hi')\nimport sys; print('oops', file=sys.stderr)")
        assert first.error is None, first.error
        assert first.logs.stdout == ["hi\n"] and first.logs.stderr == ["oops\n"], first.logs
        # output streams while the code runs: the first line long before the end
        seen: list[tuple[str, float]] = []
        t0 = time.monotonic()
        slow = sb.run_code("import time\nfor i in range(3):\n    print(i)\n    time.sleep(0.4)",
                           on_stdout=lambda m: seen.append((m.line, time.monotonic())))
        done = time.monotonic()
        assert [line for line, _ in seen] == ["0\n", "1\n", "2\n"], seen
        assert slow.logs.stdout == ["0\n", "1\n", "2\n"] and done - t0 >= 1.2, slow
        assert done - seen[0][1] >= 0.7, (seen, done)
        results: list[Any] = []
        ex = sb.run_code("x + 1", on_result=results.append)
        assert ex.text == "42" and ex.results[0].is_main_result, ex
        assert results and results[0].text == "42", results
        assert ex.execution_count is not None and first.execution_count is not None
        assert ex.execution_count == first.execution_count + 2
        rich = sb.run_code("class P:\n    def _repr_html_(self): return '<b>p</b>'\n"
                           "    def __repr__(self): return 'P()'\nP()")
        assert rich.results[0].html == "<b>p</b>" and rich.text == "P()", rich
        err = sb.run_code("1 / 0")
        assert err.error is not None and err.error.name == "ZeroDivisionError", err
        assert "division by zero" in err.error.value and err.error.traceback
        env = sb.run_code("import os; os.environ.get('RUN_VAR')", envs={"RUN_VAR": "v1"})
        assert env.text == "'v1'", env
        assert sb.run_code("import os; os.environ.get('RUN_VAR')").text is None  # this run only
        from e2b.exceptions import SandboxException
        try:
            sb.run_code("1", language="r")
        except SandboxException as exc:
            assert "language 'r' is not supported" in str(exc), exc
        else:
            raise AssertionError("language r answered")
    finally:
        sb.kill()


@_call("e2b_code_interpreter contexts")
def _c_code_contexts(t: E2BTarget) -> None:
    from e2b_code_interpreter import Sandbox as CodeSandbox
    assert t.python_template, "no python3 template given (E2BTarget.python_template)"
    sb = CodeSandbox.create(t.python_template, timeout=120, **t.opts())
    try:
        sb.run_code("y = 'default'")
        ctx = sb.create_code_context(cwd="/tmp")
        assert ctx.language == "python" and ctx.cwd == "/tmp", ctx
        assert sb.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
        assert sb.run_code("y = 'ctx'; y", context=ctx).text == "'ctx'"
        assert sb.run_code("y").text == "'default'"           # contexts are apart
        assert ctx.id in [c.id for c in sb.list_code_contexts()]
        sb.restart_code_context(ctx)
        gone = sb.run_code("y", context=ctx)
        assert gone.error is not None and gone.error.name == "NameError", gone
        assert sb.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
        sb.remove_code_context(ctx.id)
        assert ctx.id not in [c.id for c in sb.list_code_contexts()]
        from e2b.exceptions import NotFoundException
        try:
            sb.run_code("1", context=ctx)
        except NotFoundException:
            pass
        else:
            raise AssertionError("a removed context ran code")
    finally:
        sb.kill()


# ------------------------------------------------------------- python image
# What the minimal python image leaves out of the host's stdlib: big packages the code
# interpreter's kernel and the checks never import (keeps the COPY layer ~10 MB).
_STDLIB_SKIP = {"__pycache__", "site-packages", "dist-packages", "test", "idlelib",
                "tkinter", "ensurepip", "lib2to3", "pydoc_data", "turtledemo", "distutils",
                "venv", "curses", "sqlite3"}


def stage_python_root(dest: str, python: str = "/usr/bin/python3.11") -> str:
    """A root tree at ``dest`` holding the host's Debian ``python3`` (binary, stdlib
    without tests and big packages, the shared libraries it links), to COPY over the
    busybox ``base`` image: a python3 image built in a second, with no network (the
    tests' and the bench's code-interpreter template)."""
    import shutil
    import subprocess
    import sysconfig  # noqa: F401 - the layout below is Debian's /usr/lib/python3.X
    ver = os.path.basename(python).removeprefix("python")
    lib = f"/usr/lib/python{ver}"
    if not os.path.exists(python) or not os.path.isdir(lib):
        raise FileNotFoundError(f"no Debian python at {python} with {lib}: install "
                                "python3 (apt-get install -y python3)")
    os.makedirs(dest + "/usr/bin", exist_ok=True)
    shutil.copy2(python, dest + "/usr/bin/python3")
    shutil.copytree(lib, dest + lib, symlinks=True, dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if n in _STDLIB_SKIP
                                             or n.startswith("config-")])
    libs = set()
    # the libraries of the interpreter and of hashlib's OpenSSL module; an extension
    # module whose libraries are left out (sqlite, curses, ...) fails only when imported
    for exe in [python, *[os.path.join(lib, "lib-dynload", n)
                          for n in os.listdir(lib + "/lib-dynload")
                          if n.startswith("_hashlib")]]:
        out = subprocess.run(["ldd", exe], capture_output=True, text=True, check=False)
        for line in out.stdout.splitlines():
            parts = line.split()
            path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
            if path.startswith("/"):
                libs.add(path)
    for path in libs:
        real = os.path.realpath(path)
        os.makedirs(dest + os.path.dirname(path), exist_ok=True)
        shutil.copy2(real, dest + path)
    return dest


# ------------------------------------------------------------------------ runner
def run_calls(target: E2BTarget, calls: list[Call] | None = None) -> list[Outcome]:
    """Run ``calls`` (all of :data:`CALLS`) against ``target``; one Outcome each."""
    out: list[Outcome] = []
    for c in calls if calls is not None else CALLS:
        t0 = time.perf_counter()
        try:
            c.fn(target)
        except Gap as gap:
            out.append(Outcome(c.name, True, False, f"gap: {gap}",
                               time.perf_counter() - t0))
            continue
        except Exception as exc:  # noqa: BLE001 - an outcome, reported by name
            out.append(Outcome(c.name, False, False, f"{type(exc).__name__}: {exc}"[:500],
                               time.perf_counter() - t0))
            continue
        out.append(Outcome(c.name, True, True, "", time.perf_counter() - t0))
    return out


# ---------------------------------------------------------------- agent harness
HARNESS_REPO = {
    "calc.sh": "add() { echo $(( $1 + $2 )); }\n",
    "test_calc.sh": (". ./calc.sh\nfail=0\n"
                     "[ \"$(add 2 3)\" = 5 ] && echo 'PASS add' || { echo 'FAIL add'; fail=1; }\n"
                     "[ \"$(add -1 1)\" = 0 ] && echo 'PASS neg' || { echo 'FAIL neg'; fail=1; }\n"
                     "echo \"result=$fail\" > results.txt\nexit $fail\n"),
}


@dataclass
class HarnessReport:
    exit_code: int
    stdout: str
    results: str
    steps: list[str] = field(default_factory=list)


def _harness(create: Callable[[], Any], write: Callable[[Any, str, str], None],
             run: Callable[[Any, str], tuple[int, str]],
             read: Callable[[Any, str], str], kill: Callable[[Any], None]) -> HarnessReport:
    """An agent harness's episode, written once: create a sandbox, write a repo, run its
    tests, read the results file, kill the sandbox. The two SDKs differ only in the five
    verbs passed in (one line each)."""
    sb = create()
    try:
        for name, text in HARNESS_REPO.items():
            write(sb, f"/tmp/repo/{name}", text)
        code, out = run(sb, "cd /tmp/repo && sh test_calc.sh")
        return HarnessReport(code, out, read(sb, "/tmp/repo/results.txt"))
    finally:
        kill(sb)


def harness_e2b(target: E2BTarget) -> HarnessReport:
    """The harness on the stock E2B SDK pointed at dsec."""
    from e2b import CommandExitException, Sandbox

    def run(sb: Any, cmd: str) -> tuple[int, str]:
        try:
            r = sb.commands.run(cmd)
        except CommandExitException as exc:
            return exc.exit_code, exc.stdout
        return r.exit_code, r.stdout
    return _harness(lambda: Sandbox.create(target.template, **target.opts()),
                    lambda sb, p, s: sb.files.write(p, s), run,
                    lambda sb, p: sb.files.read(p), lambda sb: sb.kill())


def harness_dsec(client: Any, image: str) -> HarnessReport:
    """The same harness on dsec's own SDK."""
    def run(sb: Any, cmd: str) -> tuple[int, str]:
        r = sb.exec(cmd)
        return r.exit_code, r.stdout.decode()

    def write(sb: Any, path: str, text: str) -> None:
        sb.files.mkdir(path.rpartition("/")[0])
        sb.files.write(path, text)
    return _harness(lambda: client.sandboxes.create(image=image), write, run,
                    lambda sb, p: sb.files.read(p).decode(), lambda sb: sb.kill())
