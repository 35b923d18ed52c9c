"""Secret and state files made whole or not at all (red team 22 A4): a crash between
creating a file and writing it used to leave an empty file every later start refused."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from dsec.statedir import create_private_file, write_private_file


def test_made_once_0600_never_replaced(tmp_path: object) -> None:
    os.umask(0o022)
    p = os.path.join(str(tmp_path), "k")
    assert create_private_file(p, lambda: b"first")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert not create_private_file(p, lambda: b"second")
    with open(p, "rb") as f:
        assert f.read() == b"first"
    assert os.listdir(str(tmp_path)) == ["k"]            # no temporary file left


def test_an_empty_file_a_crash_left_is_made_again(tmp_path: object) -> None:
    p = os.path.join(str(tmp_path), "k")
    os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))   # ... kill -9
    assert create_private_file(p, lambda: b"token")
    with open(p, "rb") as f:
        assert f.read() == b"token"


def test_an_empty_symlink_target_or_foreign_file_is_not_touched(tmp_path: object) -> None:
    d = str(tmp_path)
    target = os.path.join(d, "elsewhere")
    open(target, "wb").close()
    link = os.path.join(d, "k")
    os.symlink(target, link)
    assert not create_private_file(link, lambda: b"token")
    assert os.path.islink(link) and os.path.getsize(target) == 0


def test_concurrent_makers_of_a_leftover_agree(tmp_path: object) -> None:
    p = os.path.join(str(tmp_path), "k")
    open(p, "wb").close()
    made: list[bool] = []
    threads = [threading.Thread(target=lambda i=i: made.append(
        create_private_file(p, lambda: f"t{i}".encode()))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made.count(True) == 1
    assert sorted(os.listdir(str(tmp_path))) == ["k"]


def test_write_replaces_whole(tmp_path: object) -> None:
    p = os.path.join(str(tmp_path), "local.json")
    write_private_file(p, b"{}")
    write_private_file(p, b'{"a": 1}')
    with open(p, "rb") as f:
        assert f.read() == b'{"a": 1}'
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    with pytest.raises(FileNotFoundError):
        write_private_file(os.path.join(p + ".d", "x"), b"")
