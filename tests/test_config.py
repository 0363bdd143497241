import json

import pytest

from kdtree.config import CONFIG_DIR, TINY_A, TINY_B, ModelArgs, load_config


def test_presets_differ_where_the_card_says():
    assert TINY_A.hidden_size == 256 and TINY_A.num_hidden_layers == 4
    assert (TINY_A.q_lora_rank is None) != (TINY_B.q_lora_rank is None)
    assert TINY_A.n_group == 1 and TINY_B.n_group > 1
    assert TINY_A.first_k_dense_replace != TINY_B.first_k_dense_replace
    assert TINY_A.rope_scaling is None and TINY_B.rope_scaling["type"] == "yarn"


def test_kimi_k26_values():
    a = load_config("kimi-k2.6")
    want = dict(hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=1, intermediate_size=18432,
                moe_intermediate_size=2048, n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1,
                n_group=1, topk_group=1, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                routed_scaling_factor=2.827, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840,
                rope_theta=50000.0, max_position_embeddings=262144)
    for k, v in want.items():
        assert getattr(a, k) == v, k
    assert a.rope_scaling == {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert 1.0e12 < a.param_count() < 1.1e12  # about a trillion parameters
    # YaRN mscale enters the softmax scale: (0.1 ln 64 + 1)^2 / sqrt(192)
    assert a.softmax_scale == pytest.approx((0.1 * 4.1588830833596715 + 1) ** 2 / 192 ** 0.5)


def test_hf_round_trip_both_rope_layouts(tmp_path):
    for args in (TINY_A, TINY_B):
        d = args.to_hf_config()
        assert ModelArgs.from_hf_config(d) == args
        # transformers 5.x layout: rope_parameters instead of rope_theta + rope_scaling
        d2 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
        rp = {"rope_theta": args.rope_theta, "rope_type": "yarn" if args.rope_scaling else "default"}
        rp.update({k: v for k, v in (args.rope_scaling or {}).items() if k != "type"})
        d2["rope_parameters"] = rp
        (tmp_path / "config.json").write_text(json.dumps(d2))
        assert ModelArgs.from_hf_config(tmp_path) == args
        assert ModelArgs.from_hf_config({"text_config": d}) == args


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", 0, "hidden_size"),
    ("n_group", 3, "n_group"),
    ("topk_group", 4, "topk_group"),
    ("q_lora_rank", -1, "q_lora_rank"),
    ("qk_rope_head_dim", 15, "qk_rope_head_dim"),
    ("scoring_func", "softmax", "scoring_func"),
    ("first_k_dense_replace", 9, "first_k_dense_replace"),
    ("num_experts_per_tok", 100, "num_experts_per_tok"),
    ("rope_scaling", {"type": "yarn"}, "rope_scaling"),
    ("rope_scaling", {"type": "linear", "factor": 2}, "rope_scaling"),
])
def test_bad_values_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        TINY_A.replace(**{field: value})


def test_unknown_config_name_lists_the_choices():
    with pytest.raises(ValueError, match="kimi-k2.6"):
        load_config("no-such-model")
    assert (CONFIG_DIR / "kimi-k2.6.json").exists()


@pytest.mark.parametrize("field,value,needle", [
    ("rope_theta", float("inf"), "rope_theta=inf: expected a finite number > 1"),
    ("rms_norm_eps", float("inf"), "rms_norm_eps=inf: expected a number in"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan"),
    ("routed_scaling_factor", float("nan"), "routed_scaling_factor=nan"),
    ("rope_interleave", "false", "rope_interleave='false': expected true or false"),
    ("norm_topk_prob", 1, "norm_topk_prob=1: expected true or false"),
    ("tie_word_embeddings", True, "tie_word_embeddings=True: expected false"),
    ("eos_token_id", 1024, r"eos_token_id=1024: expected null or a token id in \[0, vocab_size=1024\)"),
    ("eos_token_id", True, "eos_token_id=True"),
    ("q_lora_rank", True, "q_lora_rank=True"),
    ("n_shared_experts", False, "n_shared_experts=False"),
    ("rope_scaling", {"factor": float("inf"), "original_max_position_embeddings": 256}, "factor a finite"),
    ("rope_scaling", {"factor": 4.0, "original_max_position_embeddings": 256.5}, "a positive int"),
    ("rope_scaling", {"factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": float("nan")},
     "beta_fast a finite number"),
    ("rope_scaling", {"factor": 4.0, "original_max_position_embeddings": 256, "mscale_al_dim": 1.0},
     "not \\['mscale_al_dim'\\]"),
])
def test_model_args_refuse_what_the_model_cannot_honour(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        ModelArgs(**{field: value})


def test_hf_configs_need_their_shape_keys_and_typos_are_named():
    d = TINY_B.to_hf_config()
    with pytest.raises(ValueError, match=r"lacks the required key\(s\) \['hidden_size'\]"):
        ModelArgs.from_hf_config({k: v for k, v in d.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="unknown key 'rope_interleaved': did you mean 'rope_interleave'"):
        ModelArgs.from_hf_config({**d, "rope_interleaved": False})
    hub_extras = {"bos_token_id": 0, "head_dim": 64, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
    assert ModelArgs.from_hf_config({**d, **hub_extras}) == TINY_B


def test_a_shipped_config_name_is_not_shadowed_by_a_file_in_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kimi-k2.6").write_text(json.dumps(TINY_A.to_hf_config()))
    assert load_config("kimi-k2.6").num_hidden_layers == 61
    assert load_config("./kimi-k2.6").num_hidden_layers == TINY_A.num_hidden_layers  # a path stays a path
