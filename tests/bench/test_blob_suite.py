"""Suite ``blob`` runs against its loopback servers and records its figures by name."""

from __future__ import annotations

from dsec.bench import BenchContext, suites


def test_blob_suite_records_every_figure() -> None:
    fn, _ = suites()["blob"]
    ctx = BenchContext("blob", quick=True)
    fn(ctx)
    got = {r.name: r.value for r in ctx.results}
    for backend in ("file", "http", "s3"):
        for fig in ("upload_mb_s", "range_p50_ms", "range_p99_ms", "range_mb_s"):
            assert got[f"blob_{backend}_{fig}"] > 0, (backend, fig)
    assert got["blob_s3_range_small_p50_ms"] > 0
