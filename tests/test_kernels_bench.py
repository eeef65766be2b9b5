"""Smoke test of ``terminus bench kernels``: keys and positive figures, never a timing bound."""

from __future__ import annotations

import json

import kernels.bench as bench


def test_quick_run_reports_every_figure_as_json():
    result = bench.run(quick=True)
    json.dumps(result)
    assert set(result["release_ms"]) >= {"per_request", "free_group", "batched"}
    assert all(v > 0 for v in result["release_ms"].values())
    assert isinstance(result["bitmap_overhead_pct"], float)
    assert result["alloc_per_s"] > 0 and result["free_per_s"] > 0
    rows = bench.table(result)
    assert rows and all(isinstance(k, str) and isinstance(v, str) for k, v in rows)
    assert any(" ms" in v for _, v in rows)
