"""The bench runner: suite registry, running, merging per suite, markdown."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import bench
from dsec.bench import BenchContext, merge_json, run_suites, suite, suites, write_markdown
from dsec.errors import InvalidArgument


@pytest.fixture
def tiny_suites() -> Iterator[None]:
    """Two tiny suites registered for the test, removed afterwards."""

    @suite("tiny_a", "a tiny suite for tests")
    def tiny_a(ctx: BenchContext) -> None:
        ctx.record("ops", ctx.scale(1000, 10), "ops/s", quick=ctx.quick)
        ctx.note("bounded by nothing at all")

    @suite("tiny_broken")
    def tiny_broken(ctx: BenchContext) -> None:
        """Records one figure, then fails."""
        ctx.record("before_failure", 1.5, "s")
        raise RuntimeError("disk on fire")

    try:
        yield
    finally:
        bench._SUITES.pop("tiny_a", None)
        bench._SUITES.pop("tiny_broken", None)


def test_registry_discovers_package_suites_and_docs(tiny_suites: None) -> None:
    reg = suites()
    assert "protocol" in reg  # discovered by importing dsec.bench.protocol
    assert reg["tiny_a"][1] == "a tiny suite for tests"
    assert reg["tiny_broken"][1] == "Records one figure, then fails."


def test_run_suites_keeps_going_after_a_broken_suite(tiny_suites: None) -> None:
    seen: list[str] = []
    results, notes, errors = run_suites(["tiny_broken", "tiny_a"], quick=True,
                                        echo=lambda r: seen.append(r.name))
    assert [(r.suite, r.name, r.value, r.unit, r.params) for r in results] == [
        ("tiny_broken", "before_failure", 1.5, "s", {}),
        ("tiny_a", "ops", 10.0, "ops/s", {"quick": True}),
    ]
    assert seen == ["before_failure", "ops"]
    assert errors == {"tiny_broken": "RuntimeError: disk on fire"}
    assert notes["tiny_a"] == ["bounded by nothing at all"]


def test_run_suites_rejects_unknown_names(tiny_suites: None) -> None:
    with pytest.raises(InvalidArgument, match="unknown benchmark suite 'nope'"):
        run_suites(["tiny_a", "nope"], quick=True)


def test_merge_replaces_only_the_suites_that_ran(tiny_suites: None, tmp_path: Path) -> None:
    path = tmp_path / "bench-results.json"
    path.write_text(json.dumps({
        "machine": {"cpu": "old"},
        "notes": {"other": ["kept"], "tiny_a": ["stale"]},
        "results": [
            {"suite": "other", "name": "x", "value": 1.0, "unit": "u", "params": {}},
            {"suite": "tiny_a", "name": "ops", "value": 1.0, "unit": "ops/s", "params": {}},
        ],
    }))
    results, notes, _ = run_suites(["tiny_a"], quick=False)
    doc = merge_json(str(path), results, ["tiny_a"], notes)
    on_disk = json.loads(path.read_text())
    assert on_disk == doc
    assert set(doc["machine"]) >= {"cpu", "cores", "python", "kernel"}
    assert doc["machine"]["cpu"] != "old"
    assert doc["results"] == [
        {"suite": "other", "name": "x", "value": 1.0, "unit": "u", "params": {}},
        {"suite": "tiny_a", "name": "ops", "value": 1000.0, "unit": "ops/s",
         "params": {"quick": False}},
    ]
    assert doc["notes"] == {"other": ["kept"], "tiny_a": ["bounded by nothing at all"]}


def test_merge_starts_fresh_from_a_missing_or_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text("{not json")
    doc = merge_json(str(path), [], ["x"])
    assert doc["results"] == [] and json.loads(path.read_text())["results"] == []


def test_markdown_has_a_section_per_suite_with_notes_and_failures(
    tiny_suites: None, tmp_path: Path
) -> None:
    results, notes, errors = run_suites(["tiny_a", "tiny_broken"], quick=True)
    doc = merge_json(str(tmp_path / "r.json"), results, ["tiny_a", "tiny_broken"], notes)
    md = tmp_path / "r.md"
    write_markdown(str(md), doc, errors)
    text = md.read_text()
    assert "## tiny_a" in text and "## tiny_broken" in text
    assert "| ops | 10.00 | ops/s | quick=True |" in text
    assert "- bounded by nothing at all" in text
    assert "**suite failed:** RuntimeError: disk on fire" in text
