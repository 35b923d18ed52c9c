"""The fncall backend with real worker processes."""

from __future__ import annotations

import asyncio
import operator
import os
from collections.abc import AsyncIterator

import pytest

from dsec.edge.backends.fncall import FncallBackend, WorkerPool
from dsec.edge.spec import ExecRequest, SandboxSpec
from dsec.errors import InvalidArgument

from .conftest import make_node

SID = "sb-00000000000a-n1"


@pytest.fixture
async def fn() -> AsyncIterator[FncallBackend]:
    b = FncallBackend(pool_size=2)
    await b.create(SID, SandboxSpec(backend="fncall", env={"GREETING": "hi"}))  # type: ignore[arg-type]
    await b.pool.wait_ready()
    try:
        yield b
    finally:
        await b.close()
        assert not os.path.exists(b.root)


async def test_calls_run_code_and_functions_without_leaking_state(fn: FncallBackend) -> None:
    r = await fn.exec(SID, ExecRequest(shell="import os\nX = 41\nprint(os.environ['GREETING'])\n"
                                               "open('f.txt', 'w').write('kept')\nX + 1"))
    assert (r.exit_code, r.stdout) == (0, b"hi\n42\n")
    r = await fn.exec(SID, ExecRequest(shell="print(globals().get('X'))\nprint(open('f.txt').read())"))
    assert r.stdout == b"None\nkept\n"  # process state gone, files kept
    await fn.pool.wait_ready()  # two calls used both warm workers; let the refill catch up
    res = await fn.call(SID, operator.mul, 6, 7)  # type: ignore[arg-type]
    assert res.value == 42 and res.exit_code == 0 and not res.cold
    assert fn.pool.hits >= 3 and fn.pool.misses == 0
    r = await fn.exec(SID, ExecRequest(argv=("python3", "-c", "import sys; sys.exit(4)")))
    assert r.exit_code == 4
    r = await fn.exec(SID, ExecRequest(shell="raise KeyError('k')"))
    assert r.exit_code == 1 and r.stderr.endswith(b"KeyError: 'k'\n") and b"fncall_worker" not in r.stderr
    r = await fn.exec(SID, ExecRequest(shell="print('x' * 100)", output_cap_bytes=10))
    assert r.stdout == b"x" * 10 and r.stdout_truncated


async def test_timeout_kills_the_whole_process_group(fn: FncallBackend, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, time\n"
            f"p = subprocess.Popen(['sleep', '60'])\nopen({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)")
    r = await fn.exec(SID, ExecRequest(shell=code, timeout_s=1.0))
    assert r.timed_out and r.exit_code == 137
    child = int(pidfile.read_text())
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:  # noqa: ASYNC230
            if f.read().split()[2] == "Z":
                break
        await asyncio.sleep(0.02)
    else:
        pytest.fail(f"child {child} of a timed-out call survived")


@pytest.mark.parametrize("zygote", [True, False])
async def test_empty_pool_cold_starts_and_counts_it(zygote: bool) -> None:
    pool = WorkerPool(pool_size=0, zygote=zygote)
    try:
        res = await pool.run({"code": "1"}, 30)
        assert res.cold and res.value == 1 and pool.misses == 1 and pool.hit_rate == 0.0
    finally:
        await pool.close()


async def test_pool_survives_its_zygote_dying() -> None:
    pool = WorkerPool(pool_size=1)
    try:
        await pool.wait_ready()
        z = pool._zygote
        assert z is not None
        z.proc.kill()
        await z.proc.wait()
        for _ in range(3):  # the warm worker, then workers from a restarted zygote
            assert (await pool.run({"code": "2 * 21"}, 30)).value == 42
        assert pool._zygote is not None and pool._zygote.proc.returncode is None
    finally:
        await pool.close()


async def test_paths_cannot_escape_and_argv_must_be_python(fn: FncallBackend) -> None:
    with pytest.raises(InvalidArgument, match="leaves"):
        os.symlink("/etc", os.path.join(fn.root, SID, "etc"))
        await fn.read_file(SID, "/etc/passwd")
    with pytest.raises(InvalidArgument, match="runs Python code"):
        await fn.exec(SID, ExecRequest(argv=("ls", "-l")))
    await fn.write_file(SID, "/../../a.txt", b"x")  # clamps to the work dir root
    assert await fn.read_file(SID, "a.txt") == b"x"


async def test_edge_node_over_fncall_cleans_up() -> None:
    backend = FncallBackend(pool_size=1)
    async with make_node(backend) as node:
        info = await node.create(SandboxSpec(backend="fncall"))
        r = await node.exec(info.id, ExecRequest(shell="sum(range(10))"))
        assert r.stdout == b"45\n"
        await node.pause(info.id)
        r = await node.exec(info.id, ExecRequest(shell="'resumed'"))
        assert r.stdout == b"'resumed'\n"
        await node.destroy(info.id)
        assert os.listdir(backend.root) == []
