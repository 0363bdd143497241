"""kdtree.bench.drafter: the drafter's attention impls timed at one shape; on the GPU only."""
import pytest
import torch


@pytest.mark.gpu
def test_both_drafter_attention_impls_time_the_same_pass():
    """One small cell: both impls timed (positive medians, min <= median) and their outputs agree within
    float32's tolerance; a wrong mask (a context column hidden in the math impl only) would fail it."""
    from kdtree.bench.drafter import SHAPES, cell
    dims = SHAPES[0][1]
    r = cell(dims, batch=2, C=128, dtype=torch.float32, repeats=5)
    for impl in ("math", "sdpa"):
        assert 0 < r[impl]["min_s"] <= r[impl]["median_s"]
    assert r["rel_diff"] < 1e-4 and r["auto"] == "math"
    assert r["rows"] == 2 * dims["block_size"] and r["context"] == 128


def test_the_cli_needs_a_gpu(monkeypatch):
    from kdtree.bench import drafter
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        drafter.main([])
