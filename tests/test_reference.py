"""kdtree vs transformers' DeepseekV3 on checkpoints transformers saved; checkpoint loading errors."""
import json

import pytest
import torch

from kdtree import weights
from kdtree.config import TINY_A, TINY_B
from kdtree.model import build_model
from kdtree.validate import hf_reference_model, rel_err, transformers_agreement

pytest.importorskip("transformers", reason="transformers is the test reference (pip install -e .[test])")


@pytest.mark.parametrize("name,args", [("tiny-a", TINY_A), ("tiny-b", TINY_B)])
def test_logits_match_transformers(name, args):
    r = transformers_agreement(args, seed=3)
    assert r["logits_std"] > 0.5, "reference logits too flat for a meaningful comparison"
    for impl in ("naive", "absorb"):
        for mode in ("prefill", "decode"):
            assert r[impl][mode] <= 1e-4, (name, impl, mode, r)


def test_comparison_can_fail(tmp_path):
    """A one-line mistake (the correction bias ignored) is caught by the same comparison."""
    hf = hf_reference_model(TINY_B, seed=1)
    hf.save_pretrained(tmp_path)
    ours = weights.load(tmp_path)
    x = torch.randint(0, TINY_B.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(x).logits
    assert rel_err(ours(x).logits, ref) < 1e-4
    for layer in ours.model.layers[TINY_B.first_k_dense_replace:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert rel_err(ours(x).logits, ref) > 1e-3


def test_save_load_round_trip(tmp_path):
    m = build_model(TINY_B, seed=5)
    weights.save(m, tmp_path)
    m2 = weights.load(tmp_path)
    x = torch.randint(0, TINY_B.vocab_size, (1, 9))
    assert torch.equal(m(x).logits, m2(x).logits)


def _ckpt(tmp_path):
    m = build_model(TINY_A, seed=2)
    weights.save(m, tmp_path)
    return weights.read_state_dict(tmp_path)


def _rewrite(tmp_path, sd):
    from safetensors.torch import save_file
    save_file(sd, str(tmp_path / "model.safetensors"))


def _drop_kv_b(sd):
    del sd["model.layers.2.self_attn.kv_b_proj.weight"]


def _add_bogus(sd):
    sd["model.layers.1.self_attn.bogus.weight"] = torch.zeros(2)


def _shrink_norm(sd):
    sd["model.norm.weight"] = torch.ones(255)


@pytest.mark.parametrize("edit,needle", [
    (_drop_kv_b, r"missing: model\.layers\.2\.self_attn\.kv_b_proj\.weight"),
    (_add_bogus, r"unexpected: model\.layers\.1\.self_attn\.bogus"),
    (_shrink_norm, r"mis-shaped: model\.norm\.weight: expected \(256,\)"),
])
def test_bad_tensors_are_named(tmp_path, edit, needle):
    sd = _ckpt(tmp_path)
    edit(sd)
    _rewrite(tmp_path, sd)
    with pytest.raises(weights.CheckpointError, match=needle):
        weights.load(tmp_path)


def test_extra_layers_are_skipped_not_fatal(tmp_path):
    """Real checkpoints carry a multi-token-prediction layer past num_hidden_layers: skipped when the config
    declares it (num_nextn_predict_layers), an error naming the tensor when it does not."""
    sd = _ckpt(tmp_path)
    sd["model.layers.4.eh_proj.weight"] = torch.zeros(2, 2)
    _rewrite(tmp_path, sd)
    with pytest.raises(weights.CheckpointError,
                       match=r"model\.layers\.4\.eh_proj\.weight is past num_hidden"):
        weights.load(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    m = weights.load(tmp_path)
    assert m.skipped_tensors == ["model.layers.4.eh_proj.weight"]


def test_config_mismatch_and_missing_files(tmp_path):
    _ckpt(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["kv_lora_rank"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(weights.CheckpointError, match="mis-shaped"):
        weights.load(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(weights.CheckpointError, match="no \\*.safetensors"):
        weights.load(empty)
