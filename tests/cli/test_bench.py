"""``dsec bench``: JSON shape, merging across runs, errors, listing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsec import bench
from dsec.bench import BenchContext, suite
from dsec.cli.main import cli


@pytest.fixture
def tiny() -> Iterator[None]:
    @suite("cli_tiny", "tiny suite for the CLI tests")
    def cli_tiny(ctx: BenchContext) -> None:
        ctx.record("speed", 2.0 if ctx.quick else 3.0, "x/s", size=8)

    @suite("cli_other")
    def cli_other(ctx: BenchContext) -> None:
        """Another tiny suite."""
        ctx.record("latency", 0.5, "ms")

    @suite("cli_broken")
    def cli_broken(ctx: BenchContext) -> None:
        """Fails."""
        raise ValueError("no such device")

    try:
        yield
    finally:
        for name in ("cli_tiny", "cli_other", "cli_broken"):
            bench._SUITES.pop(name, None)


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["bench", *args])
    return result.exit_code, result.output


def test_json_shape_and_markdown(tiny: None, tmp_path: Path) -> None:
    j, md = tmp_path / "b.json", tmp_path / "b.md"
    code, out = _run("cli_tiny", "--quick", "--json", str(j), "--md", str(md))
    assert code == 0, out
    doc = json.loads(j.read_text())
    assert {"cpu", "cores", "python", "kernel"} <= set(doc["machine"])
    assert isinstance(doc["machine"]["cores"], int)
    assert doc["results"] == [
        {"suite": "cli_tiny", "name": "speed", "value": 2.0, "unit": "x/s", "params": {"size": 8}}
    ]
    assert "## cli_tiny" in md.read_text()
    assert "speed" in out and f"wrote {j}" in out


def test_runs_merge_per_suite(tiny: None, tmp_path: Path) -> None:
    j, md = str(tmp_path / "b.json"), str(tmp_path / "b.md")
    assert _run("cli_tiny", "cli_other", "--quick", "--json", j, "--md", md)[0] == 0
    assert _run("cli_tiny", "--json", j, "--md", md)[0] == 0  # full run of one suite only
    rows = {(r["suite"], r["name"]): r["value"] for r in json.loads(Path(j).read_text())["results"]}
    assert rows == {("cli_other", "latency"): 0.5, ("cli_tiny", "speed"): 3.0}


def test_unknown_suite_is_a_usage_error(tiny: None, tmp_path: Path) -> None:
    j = tmp_path / "b.json"
    code, out = _run("cli_tiny", "warp_drive", "--json", str(j))
    assert code == 2
    assert "unknown suite(s) warp_drive" in out and "cli_tiny" in out
    assert not j.exists()  # nothing ran, nothing written


def test_a_failing_suite_exits_nonzero_but_keeps_the_others(tiny: None, tmp_path: Path) -> None:
    j, md = tmp_path / "b.json", tmp_path / "b.md"
    code, out = _run("cli_broken", "cli_other", "--json", str(j), "--md", str(md))
    assert code == 1
    assert "suite cli_broken failed: ValueError: no such device" in out
    assert [r["suite"] for r in json.loads(j.read_text())["results"]] == ["cli_other"]
    assert "**suite failed:** ValueError: no such device" in md.read_text()


def test_list(tiny: None) -> None:
    code, out = _run("--list")
    assert code == 0
    assert "cli_tiny  tiny suite for the CLI tests" in out
    assert "protocol" in out
