"""The INT4 expert format (kdtree/quant.py) against compressed-tensors, and the MoE golden twin."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kdtree import golden, quant


@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (33, 7168 // 8 * 8)])
def test_pack_matches_compressed_tensors(shape):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(shape[0] * shape[1])
    q = torch.randint(-8, 8, shape, dtype=torch.int8, generator=g)
    ours = quant.pack(q)
    ref = helpers.pack_to_int32(q, 4)
    assert ours.dtype == torch.int32 and torch.equal(ours, ref)
    assert torch.equal(quant.unpack(ours, shape[1]), q)
    assert torch.equal(helpers.unpack_from_int32(ours, 4, torch.Size(shape)), q)
    np.testing.assert_array_equal(golden.unpack_int4(ours.numpy()), q.numpy())  # the numpy twin


def test_pack_rejects_out_of_range_values():
    with pytest.raises(quant.QuantFormatError, match=r"\[-8, 7\]"):
        quant.pack(torch.tensor([[8, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int8))


def test_quantize_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g) * 3
    iw = quant.quantize(w)
    assert iw.scale.dtype == torch.bfloat16 and iw.packed.shape == (48, 32) and iw.scale.shape == (48, 8)
    err = (iw.dequantize() - w).abs().view(48, 8, 32)
    step = iw.scale.float()[..., None]
    # round to nearest, except where the bf16-rounded scale makes the top value clip (then < one step)
    assert (err <= 0.5 * step + 1e-6).float().mean() > 0.99 and (err <= step + 1e-6).all()
    q = iw.unpack()
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and int(q.max()) > 4  # the range is used
    np.testing.assert_array_equal(golden.dequant_int4(iw.packed.numpy(), iw.scale.float().numpy()),
                                  iw.dequantize().double().numpy())


def test_checkpoint_round_trip(tmp_path):
    g = torch.Generator().manual_seed(2)
    iw = quant.quantize(torch.randn(64, 96, generator=g))
    save_file(iw.state_dict("model.layers.1.mlp.experts.3.up_proj"), str(tmp_path / "m.safetensors"))
    back = quant.read_int4(load_file(str(tmp_path / "m.safetensors")), "model.layers.1.mlp.experts.3.up_proj")
    assert back.shape == (64, 96) and torch.equal(back.packed, iw.packed) \
        and torch.equal(back.scale, iw.scale)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("p.weight_scale"), r"missing \['p.weight_scale'\]"),
    (lambda t: t.update({"p.weight_packed": t["p.weight_packed"][:, :-1]}),
     r"weight_packed: expected shape \(16, 8\)"),
    (lambda t: t.update({"p.weight_scale": t["p.weight_scale"][:, :1]}),
     r"weight_scale: expected shape \(16, 2\)"),
    (lambda t: t.update({"p.weight_packed": t["p.weight_packed"].to(torch.int64)}),
     "expected an int32 tensor"),
    (lambda t: t.update({"p.weight_shape": torch.tensor([16, 60])}), "positive multiple of 32"),
    (lambda t: t.update({"p.weight_shape": torch.tensor([16.0, 64.0])}), "integer tensor of 2 values"),
])
def test_read_int4_names_the_bad_tensor(edit, match):
    t = quant.quantize(torch.randn(16, 64)).state_dict("p")
    edit(t)
    with pytest.raises(quant.QuantFormatError, match=match):
        quant.read_int4(t, "p")


def _random_moe(rng, T, D, I, E, k):
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    w13 = [quant.quantize(torch.randn(2 * I, D, generator=g) / D ** 0.5) for _ in range(E)]
    w2 = [quant.quantize(torch.randn(D, I, generator=g) / I ** 0.5) for _ in range(E)]
    p13, s13 = quant.stack_experts(w13)
    p2, s2 = quant.stack_experts(w2)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, k, generator=g)
    return x, ids, wts, p13, s13, p2, s2


def test_moe_golden_matches_an_independent_torch_reference():
    rng = np.random.default_rng(3)
    x, ids, wts, p13, s13, p2, s2 = _random_moe(rng, 7, 64, 32, 5, 2)
    got = golden.moe_int4(x.float().numpy(), ids.numpy(), wts.numpy(), p13.numpy(), s13.float().numpy(),
                          p2.numpy(), s2.float().numpy())
    ref = torch.zeros(7, 64, dtype=torch.float64)
    for t in range(7):
        for j in range(2):
            e = int(ids[t, j])
            w13 = quant.Int4Weight(p13[e], s13[e], (64, 64)).dequantize(torch.float64)
            w2 = quant.Int4Weight(p2[e], s2[e], (64, 32)).dequantize(torch.float64)
            gu = w13 @ x[t].double()
            ref[t] += wts[t, j].double() * (w2 @ (torch.nn.functional.silu(gu[:32]) * gu[32:]))
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-10, atol=1e-12)
    wrong = golden.moe_int4(x.float().numpy(), ids.numpy(), wts.numpy()[:, ::-1], p13.numpy(),
                            s13.float().numpy(), p2.numpy(), s2.float().numpy())
    assert np.abs(wrong - ref.numpy()).max() > 1e-3  # the comparison can fail


def test_benchmark_dequantization_is_exact():
    """bench.dequant_bf16 (the baselines' torch dequantization) = q * scale rounded once to bf16."""
    from kdtree import bench
    g = torch.Generator().manual_seed(8)
    ws = [quant.quantize(torch.randn(32, 96, generator=g)) for _ in range(3)]
    p, s = quant.stack_experts(ws)
    assert torch.equal(bench.dequant_bf16(p, s), torch.stack([w.dequantize() for w in ws]).to(torch.bfloat16))
