"""INT4 routed experts inside the model and in checkpoints (CPU)."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdtree import weights
from kdtree.config import TINY_A, TINY_B
from kdtree.model import Int4Experts, MoE, build_model


@pytest.fixture(scope="module", params=[TINY_A, TINY_B], ids=["tiny-a", "tiny-b"])
def pair(request):
    m = build_model(request.param, seed=1)
    return m, copy.deepcopy(m).quantize_experts()


def test_int4_model_equals_the_model_holding_its_dequantized_weights(pair):
    m, q = pair
    ref = copy.deepcopy(m)
    n = 0
    for lq, lr in zip(q.model.layers, ref.model.layers):
        if isinstance(lq.mlp, MoE):
            assert isinstance(lq.mlp.experts, Int4Experts)
            for e, mlp in enumerate(lr.mlp.experts):
                w13, w2 = lq.mlp.experts.expert_weights(e)
                inter = w13.shape[0] // 2
                mlp.gate_proj.weight.data.copy_(w13[:inter])
                mlp.up_proj.weight.data.copy_(w13[inter:])
                mlp.down_proj.weight.data.copy_(w2)
                n += 1
    assert n > 0
    x = torch.randint(0, m.args.vocab_size, (2, 13))
    torch.testing.assert_close(q(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
    assert (q(x).logits - m(x).logits).abs().max() > 1e-3  # quantization did change the model


def test_int4_checkpoint_round_trip(pair, tmp_path):
    _, q = pair
    weights.save(q, tmp_path)
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    layer = q.args.first_k_dense_replace
    for n in ("gate", "up", "down"):
        for suf in ("weight_packed", "weight_scale", "weight_shape"):
            assert f"model.layers.{layer}.mlp.experts.0.{n}_proj.{suf}" in names
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["format"] \
        == "pack-quantized"
    back = weights.load(tmp_path)
    x = torch.randint(0, q.args.vocab_size, (1, 9))
    torch.testing.assert_close(back(x).logits, q(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("edit,match", [
    (lambda sd, p: sd.pop(f"{p}.3.up_proj.weight_scale"), r"experts.3.up_proj: expected the pack-quantized"),
    (lambda sd, p: sd.update({f"{p}.0.down_proj.weight_scale":
                              sd[f"{p}.0.down_proj.weight_scale"][:, :1].contiguous()}),
     r"experts.0.down_proj.weight_scale: expected shape"),
    (lambda sd, p: sd.update({f"{p}.1.gate_proj.weight_shape": torch.tensor([32, 256])}),
     r"experts.1.gate_proj.weight_packed: expected shape"),
])
def test_bad_int4_checkpoints_are_named(tmp_path, edit, match):
    q = build_model(TINY_A, seed=2).quantize_experts()
    weights.save(q, tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    edit(sd, f"model.layers.{TINY_A.first_k_dense_replace}.mlp.experts")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(weights.CheckpointError, match=match):
        weights.load(tmp_path)
