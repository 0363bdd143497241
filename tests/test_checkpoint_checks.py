"""weights.load / load_drafter refuse what they cannot honour, before building anything: the config against
the tensors' names, dtypes, non-finite values, shard paths outside the folder, unreadable files."""
import json
import os
import time

import pytest
import torch
from safetensors.torch import save_file

from kdtree import weights
from kdtree.config import TINY_A
from kdtree.drafter import build_drafter
from kdtree.model import build_model


@pytest.fixture
def ckpt(tmp_path):
    """A saved tiny-a checkpoint: (folder, its tensors, its config dict)."""
    d = tmp_path / "ckpt"
    weights.save(build_model(TINY_A, seed=4), d)
    return d, weights.read_state_dict(d), json.loads((d / "config.json").read_text())


def _config(d, cfg):
    (d / "config.json").write_text(json.dumps(cfg))


def _tensors(d, sd):
    save_file(sd, str(d / "model.safetensors"))


def test_a_config_with_fewer_layers_than_the_tensors_is_refused(ckpt):
    d, _, cfg = ckpt
    _config(d, {**cfg, "num_hidden_layers": 3})
    with pytest.raises(weights.CheckpointError,
                       match=r"tensor model\.layers\.3\..* is past num_hidden_layers=3"):
        weights.load(d)


@pytest.mark.parametrize("key,value,needle", [
    ("num_hidden_layers", 100_000, r"num_hidden_layers=100000 but the tensors hold layers 0\.\.3"),
    ("n_routed_experts", 2 ** 20,
     r"layer 1 holds experts 0\.\.7 \(8\); the config says n_routed_experts=1048576"),
])
def test_huge_configs_are_refused_before_any_model_is_built(ckpt, key, value, needle):
    d, _, cfg = ckpt
    _config(d, {**cfg, key: value})
    t0 = time.perf_counter()
    with pytest.raises(weights.CheckpointError, match=needle):
        weights.load(d)
    assert time.perf_counter() - t0 < 10  # it used to build the model first (minutes)


@pytest.mark.parametrize("cfg,needle", [
    ({}, "lacks the required key"),
    ({"n_routed_expert": 8}, "unknown key 'n_routed_expert': did you mean 'n_routed_experts'"),
    ({"rope_interleave": "false"}, "rope_interleave='false': expected true or false"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True: expected false"),
])
def test_bad_configs_are_refused_naming_the_key(ckpt, cfg, needle):
    d, _, base = ckpt
    _config(d, cfg if not cfg else {**base, **cfg})
    with pytest.raises(weights.CheckpointError, match=needle):
        weights.load(d)


def test_an_integer_tensor_in_a_float_weight_is_refused(ckpt):
    d, sd, _ = ckpt
    sd["model.norm.weight"] = torch.ones(256, dtype=torch.int64)
    _tensors(d, sd)
    with pytest.raises(weights.CheckpointError,
                       match=r"model\.norm\.weight: expected a floating-point tensor"):
        weights.load(d)


def test_non_finite_weights_are_refused_unless_allowed(ckpt):
    d, sd, _ = ckpt
    sd["model.layers.2.self_attn.o_proj.weight"][0, 3] = float("nan")
    _tensors(d, sd)
    with pytest.raises(weights.CheckpointError, match=r"o_proj\.weight holds NaN or inf"):
        weights.load(d)
    m = weights.load(d, allow_nonfinite=True)
    assert torch.isnan(m.model.layers[2].self_attn.o_proj.weight).any()


def test_non_finite_int4_scales_are_refused(tmp_path):
    d = tmp_path / "q"
    weights.save(build_model(TINY_A, seed=5).quantize_experts(), d)
    sd = weights.read_state_dict(d)
    name = "model.layers.1.mlp.experts.3.up_proj.weight_scale"
    sd[name][0, 0] = float("inf")
    _tensors(d, sd)
    with pytest.raises(weights.CheckpointError, match=r"experts\.3\.up_proj\.weight_scale holds NaN or inf"):
        weights.load(d)


@pytest.mark.parametrize("shard", ["../outside/x.safetensors", "/etc/hostname", "/dev/zero", "sub/../../y"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(ckpt, shard):
    d, sd, _ = ckpt
    (d.parent / "outside").mkdir(exist_ok=True)
    save_file({"model.norm.weight": sd["model.norm.weight"]}, str(d.parent / "outside" / "x.safetensors"))
    index = {"weight_map": {**{k: "model.safetensors" for k in sd if k != "model.norm.weight"},
                            "model.norm.weight": shard}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(weights.CheckpointError, match="not a file name inside|outside|not a file in"):
        weights.load(d)


def test_a_shard_linked_to_outside_the_folder_is_refused(ckpt):
    d, sd, _ = ckpt
    out = d.parent / "elsewhere.safetensors"
    os.replace(d / "model.safetensors", out)
    os.symlink(out, d / "model.safetensors")
    with pytest.raises(weights.CheckpointError, match="resolves outside"):
        weights.load(d)


@pytest.mark.parametrize("target,content,needle", [
    ("config.json", "{not json", r"config\.json is not a readable JSON file"),
    ("config.json", "[1, 2]", "expected a JSON object"),
    ("model.safetensors", "garbage", r"model\.safetensors is not a readable safetensors file"),
    ("model.safetensors.index.json", '{"weight_map": 3}', "expected a non-empty 'weight_map'"),
])
def test_unreadable_files_are_checkpoint_errors_naming_the_file(ckpt, target, content, needle):
    d, _, _ = ckpt
    (d / target).write_text(content)
    with pytest.raises(weights.CheckpointError, match=needle):
        weights.load(d)


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.pop("target_layer_ids", None) or c.get("dflash_config", {}).pop("target_layer_ids"),
     r"lacks the required key\(s\) \['target_layer_ids'\]"),
    (lambda c: c.update(target_layer_ids=[0, 1.5]), "expected a list of target layer indices"),
])
def test_a_drafter_config_must_name_its_target_layers(tmp_path, edit, needle):
    t = build_model(TINY_A, seed=6)
    d = weights.save_drafter(build_drafter(t, block_size=4), tmp_path / "drafter")
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    _config(d, cfg)
    with pytest.raises(weights.CheckpointError, match=needle):
        weights.load_drafter(d, t)


def test_a_drafter_with_nan_weights_is_refused(tmp_path):
    t = build_model(TINY_A, seed=6)
    d = weights.save_drafter(build_drafter(t, block_size=4), tmp_path / "drafter")
    sd = weights.read_state_dict(d)
    k = next(k for k, v in sd.items() if v.is_floating_point())
    sd[k].view(-1)[0] = float("nan")
    _tensors(d, sd)
    with pytest.raises(weights.CheckpointError, match="holds NaN or inf"):
        weights.load_drafter(d, t)
