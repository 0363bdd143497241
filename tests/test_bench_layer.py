"""kdtree.bench.layer: the model the per-layer verify benchmark builds."""
import torch


def test_the_layer_benchmark_model_takes_every_real_config():
    """bench.layer's two-layer model at each real shape: its arguments pass the model's checks (the real
    special-token ids lie past its small vocabulary), built on the meta device (no memory)."""
    from kdtree.bench.layer import layer_args
    from kdtree.model import Transformer
    for config in ("kimi-k2.6", "data/configs/mid.json"):
        a = layer_args(config)
        got = (a.num_hidden_layers, a.first_k_dense_replace, a.vocab_size, a.eos_token_id)
        assert got == (2, 1, 1024, None)
        with torch.device("meta"):
            Transformer(a)


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tiny_b():
    from kdtree.config import TINY_B
    from kdtree.model import build_model
    return build_model(TINY_B, seed=3).quantize_experts()


def test_paged_inputs_take_a_tree_mask_and_refuse_a_bad_one(tiny_b):
    from kdtree.bench import decode_layers as dl
    from kdtree.bench.layer import _tree_mask
    m = _tree_mask(np.random.default_rng(0), 9)
    pool, x, cos, sin, meta = dl.paged_inputs(tiny_b, 100, 2, 9, "loop", mask=m)
    depth = m.sum(-1) - 1
    assert meta.positions.tolist() == [list(100 + depth)] * 2
    assert depth.tolist() != list(range(9))   # a tree, not a chain
    _, _, _, _, chain = dl.paged_inputs(tiny_b, 100, 1, 9, "loop")
    assert chain.positions.tolist() == [list(range(100, 109))]
    with pytest.raises(ValueError, match="mask: expected bool"):
        dl.paged_inputs(tiny_b, 100, 1, 9, "loop", mask=np.eye(8, dtype=bool))
    with pytest.raises(ValueError, match="diagonal"):
        dl.paged_inputs(tiny_b, 100, 1, 9, "loop", mask=np.zeros((9, 9), bool))


def test_the_fused_layer_rows_refuse_what_they_cannot_time(tiny_b):
    from kdtree.bench import bench_layer_fused
    with pytest.raises(ValueError, match="fused path does not apply here: needs a CUDA device"):
        bench_layer_fused(tiny_b, contexts=(64,), nodes=(1,), batches=(1,), progress=False)


def test_the_fused_layer_rows_have_bench_layers_shape(tiny_b, monkeypatch):
    """The fused path's rows (its step replaced by the torch step, which a CPU runs): one per (context,
    batch, nodes, layer), marked fused, MoE rows with their distinct experts."""
    from kdtree import fused
    from kdtree.bench import decode_layers as dl
    monkeypatch.setattr(fused, "unsupported", lambda model, meta: None)
    monkeypatch.setattr(dl, "fused_layer_step", lambda model, i, x, cos, sin, pool, meta: (
        lambda: model.model.layers[i](x, cos, sin, pool[i], meta)))
    rows = dl.bench_layer_fused(tiny_b, contexts=(64,), nodes=(1, 8), batches=(1, 2), repeats=2,
                                progress=False)
    assert len(rows) == 2 * 2 * 4
    assert {r["path"] for r in rows} == {"fused"} and all(r["time_s"] > 0 for r in rows)
    assert [r["kind"] for r in rows[:4]] == ["dense", "dense", "moe", "moe"]
    assert all(1 <= r["experts_touched"] <= 16 for r in rows if r["kind"] == "moe")
    assert all("experts_touched" not in r for r in rows if r["kind"] == "dense")
