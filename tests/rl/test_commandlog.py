"""Command digests: one command, one digest, however it is spelled, and a log written by
an older release keeps replaying (the digest is versioned per record)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import msgspec
import pytest

from dsec.rl.access import EdgeAccess
from dsec.rl.commandlog import (
    DIGEST_VERSION,
    CommandLog,
    LoggedAccess,
    ReplayDiverged,
    digest_version,
    request_digest,
)
from dsec.wire.spec import ExecRequest, SandboxSpec

LS = ExecRequest(argv=("ls", "-l"))


def _old_digest(req: ExecRequest) -> str:
    """What the command log wrote before versioned digests (version 1)."""
    return hashlib.sha256(msgspec.msgpack.encode(req)).hexdigest()[:32]


@pytest.mark.parametrize("spelled", [
    ExecRequest(argv=("ls", "-l"), timeout_s=60.0),          # a float default, spelled out
    ExecRequest(argv=("ls", "-l"), timeout_s=60),            # ... as an int
    ExecRequest(argv=("ls", "-l"), output_cap_bytes=1 << 20),
    ExecRequest(argv=("ls", "-l"), env={}, stdin=b"", cwd=None, background=False),
    msgspec.json.decode(b'{"argv": ["ls", "-l"], "timeout_s": 60.0, '
                        b'"output_cap_bytes": 1048576}', type=ExecRequest),
], ids=["timeout-float", "timeout-int", "output-cap", "falsy", "decoded-json"])
def test_a_field_at_its_default_digests_as_if_absent(spelled: ExecRequest) -> None:
    assert spelled == LS                        # the same command ...
    assert request_digest(spelled) == request_digest(LS)   # ... the same digest


def test_what_changes_the_command_changes_the_digest() -> None:
    base = request_digest(LS)
    for other in (ExecRequest(argv=("ls",)), ExecRequest(argv=("ls", "-l"), timeout_s=61.0),
                  ExecRequest(argv=("ls", "-l"), timeout_s=None),
                  ExecRequest(argv=("ls", "-l"), env={"A": "1"}),
                  ExecRequest(argv=("ls", "-l"), stdin=b"x"),
                  ExecRequest(shell="ls -l")):
        assert request_digest(other) != base, other
    # a whole number in a float field is that number, not a different command
    assert request_digest(ExecRequest(argv=("ls",), timeout_s=30)) == \
        request_digest(ExecRequest(argv=("ls",), timeout_s=30.0))


def test_env_order_is_not_part_of_the_command() -> None:
    a = ExecRequest(argv=("env",), env={"A": "1", "B": "2"})
    b = ExecRequest(argv=("env",), env={"B": "2", "A": "1"})
    assert request_digest(a) == request_digest(b)


class _ExecRequestNext(ExecRequest, frozen=True, kw_only=True):
    """ExecRequest as a later release might define it: one more defaulted field."""

    nice_s: float = 1.5


def test_a_new_defaulted_field_keeps_old_digests() -> None:
    assert request_digest(_ExecRequestNext(argv=("ls", "-l"))) == request_digest(LS)
    # spelled out at its default (a fresh float object, not the default's identity)
    assert request_digest(_ExecRequestNext(argv=("ls", "-l"), nice_s=float("1.5"))) == \
        request_digest(LS)
    assert request_digest(_ExecRequestNext(argv=("ls", "-l"), nice_s=2.0)) != \
        request_digest(LS)


def test_version_2_digests_never_change() -> None:
    # written into logs that outlive releases: a change here breaks every old log
    assert request_digest(LS) == "v2:b47d365d1280585aab0f2e590c147ecf"
    assert request_digest(ExecRequest(shell="echo hi", env={"B": "2", "A": "1"},
                                      timeout_s=30, stdin=b"x", cwd="/w")) == \
        "v2:038b79ea399a48cd1afdcc0210c99317"


def test_digests_say_their_version() -> None:
    assert DIGEST_VERSION == 2
    d = request_digest(LS)
    assert d.startswith("v2:") and digest_version(d) == 2
    assert digest_version(_old_digest(LS)) == 1
    assert request_digest(LS, 1) == _old_digest(LS)      # version 1 is computed as it was
    assert digest_version("v2:") is None and digest_version("x9:abc") is None
    with pytest.raises(ValueError, match="version 7 is not one this release knows"):
        request_digest(LS, 7)


_LEN = struct.Struct("<I")


def _write_old_log(path: Path, records: list[list[object]]) -> None:
    """A log as the release before versioned digests wrote it (array-like records:
    sandbox id, seq, digest, result)."""
    with open(path, "wb") as f:
        for rec in records:
            body = msgspec.msgpack.encode(rec)
            f.write(_LEN.pack(len(body)) + body)


def test_a_log_written_before_versioned_digests_still_replays(
        sim_access: EdgeAccess, tmp_path: Path) -> None:
    sid = sim_access.create(SandboxSpec())
    try:
        req = ExecRequest(shell="echo a >> /tmp/x; cat /tmp/x")
        live = sim_access.exec_batch([(sid, req)])[0]
        assert not isinstance(live, BaseException)
        path = tmp_path / "old.log"
        _write_old_log(path, [[sid, 0, _old_digest(req), None],
                              [sid, 0, _old_digest(req), live]])
        acc = LoggedAccess(sim_access, CommandLog(str(path)))
        # replayed from the log (not run again: the file still holds one line) ...
        again = acc.exec_batch([(sid, req)])[0]
        assert again == live and acc.replayed == 1
        assert sim_access.read_file(sid, "/tmp/x") == b"a\n"
        # ... and a different command at that position is still refused
        acc.seek({sid: 0})
        with pytest.raises(ReplayDiverged, match="#0"):
            acc.exec_batch([(sid, ExecRequest(shell="echo b"))])
        # past the old records, new ones are written with the current version
        acc.seek({sid: 1})
        acc.exec_batch([(sid, req)])
        acc.log.close()
        reread = CommandLog(str(path))
        assert reread.get(sid, 0).digest == _old_digest(req)        # type: ignore[union-attr]
        assert reread.get(sid, 1).digest == request_digest(req)     # type: ignore[union-attr]
        assert digest_version(reread.get(sid, 1).digest) == DIGEST_VERSION  # type: ignore[union-attr]
        reread.close()
    finally:
        sim_access.destroy(sid)


def test_a_log_from_a_newer_release_is_refused_clearly(
        sim_access: EdgeAccess, tmp_path: Path) -> None:
    sid = sim_access.create(SandboxSpec())
    try:
        path = tmp_path / "new.log"
        _write_old_log(path, [[sid, 0, "v9:" + "0" * 32, None]])
        acc = LoggedAccess(sim_access, CommandLog(str(path)))
        with pytest.raises(ReplayDiverged, match="cannot check .*'v9:.*known versions 1, 2"):
            acc.exec_batch([(sid, LS)])
        acc.log.close()
    finally:
        sim_access.destroy(sid)


def test_file_operations_replay_in_the_command_sequence(sim_access: EdgeAccess,
                                                        tmp_path: Path) -> None:
    """A replay must neither re-write a file a later command changed nor show the policy
    a read different from the one the crashed trainer saw (issue 18)."""
    sid = sim_access.create(SandboxSpec())
    try:
        path = str(tmp_path / "c.log")
        a = LoggedAccess(sim_access, CommandLog(path))
        a.write_file(sid, "/tmp/f", b"a\n")
        first_read = a.read_file(sid, "/tmp/f")
        a.exec_batch([(sid, ExecRequest(shell="echo b >> /tmp/f"))])
        a.log.close()                                   # the trainer dies here
        b = LoggedAccess(sim_access, CommandLog(path))
        b.seek({sid: 0})
        b.write_file(sid, "/tmp/f", b"a\n")             # replayed: not written again
        assert b.read_file(sid, "/tmp/f") == first_read == b"a\n"   # what A saw
        b.exec_batch([(sid, ExecRequest(shell="echo b >> /tmp/f"))])
        assert b.replayed == 3
        assert sim_access.read_file(sid, "/tmp/f") == b"a\nb\n"     # not clobbered
        b.seek({sid: 0})
        with pytest.raises(ReplayDiverged, match="#0"):
            b.write_file(sid, "/tmp/f", b"other\n")
        b.log.close()
    finally:
        sim_access.destroy(sid)
