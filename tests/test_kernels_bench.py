"""Smoke test of ``terminus bench kernels``: keys and positive figures, never a timing bound."""

from __future__ import annotations

import json

import pytest

import terminus.kernels.bench as bench


def test_quick_run_reports_every_figure_as_json():
    result = bench.run(quick=True)
    json.dumps(result)
    assert set(result["release_ms"]) >= {"per_request", "free_group", "batched"}
    assert all(v > 0 for v in result["release_ms"].values())
    assert isinstance(result["bitmap_overhead_pct"], float)
    assert result["alloc_per_s"] > 0 and result["free_per_s"] > 0
    assert set(result["release_small_batch_ms"]) == {"threads_1", "threads_default"}
    assert all(v > 0 for v in result["release_small_batch_ms"].values())
    assert set(result["expand_rows_us"]) == {
        f"{op}.threads_{t}" for op in ("repeat_interleave", "repeat_rows") for t in ("1", "default")
    }
    for key in ("lora_roundtrip_us", "lora_roundtrip_nowait_us", "sglang_lora_roundtrip_us",
                "lora_roundtrip_group8_us", "sglang_lora_roundtrip_group8_us"):
        assert result[key] > 0 and result[key.replace("_us", "_cpu_us")] > 0
    rows = bench.table(result)
    assert rows and all(isinstance(k, str) and isinstance(v, str) for k, v in rows)
    assert any(" ms" in v for _, v in rows)


def test_a_device_torch_cannot_use_here_is_named():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is usable here")
    with pytest.raises(ValueError, match=r"device 'cuda': torch.cuda.is_available\(\) is false"):
        bench.run(quick=True, device="cuda")


@pytest.mark.gpu
def test_quick_run_on_cuda_reports_its_device():
    result = bench.run(quick=True, device="cuda")
    assert result["device"].startswith("cuda") and result["device_name"] != "cpu"
    assert all(v > 0 for v in result["release_ms"].values())
