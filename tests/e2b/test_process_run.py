"""The E2B layer's ``commands.run`` is one edge call (issue 20): ``process.Process/Start``
goes through ``process_run`` (the process started as ``process_start`` starts it, its
output on the same stream), never ``process_start`` then ``process_connect``. Counted on
the edge's process table, through the real listener and the stock SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dsec import LocalCluster
from dsec.bench._e2b_calls import E2BTarget

pytestmark = pytest.mark.root


@pytest.fixture
def counted(e2b_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch,
            ) -> Iterator[dict[str, int]]:
    calls = {"start": 0, "connect": 0, "run": 0}
    for node in e2b_cluster.runtime.nodes:
        table = node.processes
        for name in calls:
            real = getattr(table, name)

            def wrap(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                calls[_name] += 1
                return _real(*a, **kw)
            monkeypatch.setattr(table, name, wrap)
    yield calls


def test_commands_run_is_one_edge_call(e2b_target: E2BTarget,
                                       counted: dict[str, int]) -> None:
    from e2b.sandbox.commands.command_handle import CommandExitException

    from e2b import Sandbox

    sb = Sandbox.create(e2b_target.template, timeout=120, **e2b_target.opts())
    try:
        seen: list[str] = []
        r = sb.commands.run("echo one; echo two >&2", on_stdout=seen.append)
        assert (r.exit_code, r.stdout, r.stderr) == (0, "one\n", "two\n")
        assert "".join(seen) == "one\n"
        assert counted == {"start": 1, "connect": 0, "run": 1}, counted
        with pytest.raises(CommandExitException) as failed:
            sb.commands.run("exit 3")
        assert failed.value.exit_code == 3
        # a background command's handle: connect by its pid still works
        h = sb.commands.run("sleep 0.2; echo late", background=True)
        assert h.pid > 0
        res = sb.commands.connect(h.pid).wait()
        assert res.stdout == "late\n"
        assert counted["run"] == 3 and counted["connect"] == 1, counted
    finally:
        sb.kill()
