"""Model configuration: one dataclass, HF DeepseekV3 / kimi_k2 keys, presets and JSON shapes.

`ModelArgs()` is the tiny-a preset. `ModelArgs.from_hf_config(path_or_dict)` reads a HF
`config.json` (either the hub's `rope_theta` + `rope_scaling` or transformers 5.x's
`rope_parameters`, and Kimi's nested `text_config`). `load_config(name_or_path)` accepts a preset
name (`tiny-a`, `tiny-b`), a name under `data/configs/` (`kimi-k2.6`) or a path.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

def _config_dir() -> Path:
    """data/configs of the checkout, or kdtree/configs/ inside an installed (non-editable) package."""
    here = Path(__file__).resolve().parent
    installed = here / "configs"
    return installed if installed.is_dir() else here.parent / "data" / "configs"


CONFIG_DIR = _config_dir()

_ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")
# keys a HF config must hold (they fix the tensors' shapes); the others default as the dataclass says
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                 "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "num_attention_heads",
                 "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# keys of DeepSeek-V3 / Kimi configs the model does not use; an unknown key close to a field name is a typo
OTHER_HF_KEYS = frozenset((
    "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "text_config",
    "vision_config", "quantization_config", "hidden_act", "num_key_value_heads", "attention_bias",
    "attention_dropout", "bos_token_id", "pad_token_id", "use_cache", "initializer_range", "moe_layer_freq",
    "ep_size", "num_nextn_predict_layers", "aux_loss_alpha", "seq_aux", "pretraining_tp", "rope_parameters",
    "head_dim", "qk_head_dim", "mlp_bias"))


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class ModelArgs:
    """Hyper-parameters of the MLA + MoE transformer (defaults: the tiny-a preset)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    num_attention_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    @property
    def yarn(self) -> bool:
        return self.rope_scaling is not None

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times DeepSeek's YaRN mscale(factor, mscale_all_dim)^2."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None:
            m = yarn_mscale(self.rope_scaling["factor"], self.rope_scaling.get("mscale_all_dim", 0.0) or 0.0)
            scale *= m * m
        return scale

    def param_count(self) -> int:
        """Number of parameters (routed experts included)."""
        h, a = self.hidden_size, self
        attn = (h * a.num_attention_heads * a.qk_head_dim if a.q_lora_rank is None else
                h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.num_attention_heads * a.qk_head_dim)
        attn += h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        attn += a.kv_lora_rank * a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
        attn += a.num_attention_heads * a.v_head_dim * h
        dense = 3 * h * a.intermediate_size
        moe = (3 * h * a.moe_intermediate_size * (a.n_routed_experts + a.n_shared_experts)
               + a.n_routed_experts * h + a.n_routed_experts)
        layers = a.num_hidden_layers * (attn + 2 * h) + a.first_k_dense_replace * dense + a.n_moe_layers * moe
        emb = a.vocab_size * h * (1 if a.tie_word_embeddings else 2)
        return layers + emb + h

    # --------------------------------------------------------------- validation
    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it should be."""
        def need(cond: bool, name: str, expected: str):
            if not cond:
                raise ValueError(f"ModelArgs.{name}={getattr(self, name)!r}: expected {expected}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group",
                     "topk_group", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "a positive int")
        need(isinstance(self.n_shared_experts, int) and not isinstance(self.n_shared_experts, bool)
             and self.n_shared_experts >= 0, "n_shared_experts", "an int >= 0")
        for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
            need(isinstance(getattr(self, name), bool), name, "true or false (a JSON bool)")
        need(not self.tie_word_embeddings, "tie_word_embeddings",
             "false: no DeepSeek-V3 / Kimi checkpoint ties lm_head to the embedding, nor does the model")
        need(self.eos_token_id is None or (isinstance(self.eos_token_id, int) and not isinstance(
            self.eos_token_id, bool) and 0 <= self.eos_token_id < self.vocab_size), "eos_token_id",
             f"null or a token id in [0, vocab_size={self.vocab_size})")
        need(isinstance(self.first_k_dense_replace, int)
             and 0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             "first_k_dense_replace", f"an int in [0, num_hidden_layers={self.num_hidden_layers}]")
        need(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and not isinstance(
            self.q_lora_rank, bool) and self.q_lora_rank > 0),
             "q_lora_rank", "null or a positive int")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "an even number")
        need(self.n_routed_experts % self.n_group == 0, "n_group",
             f"a divisor of n_routed_experts={self.n_routed_experts}")
        need(self.topk_group <= self.n_group, "topk_group", f"<= n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        need(self.n_group == 1 or per_group >= 2, "n_group",
             "small enough that each group holds >= 2 experts")
        need(self.num_experts_per_tok <= self.topk_group * per_group, "num_experts_per_tok",
             f"<= topk_group * experts per group = {self.topk_group * per_group}")
        need(self.scoring_func == "sigmoid", "scoring_func", "'sigmoid'")
        need(self.topk_method == "noaux_tc", "topk_method",
             "'noaux_tc' (sigmoid scores, bias for selection only)")
        need(_finite(self.routed_scaling_factor) and self.routed_scaling_factor > 0, "routed_scaling_factor",
             "a positive finite number")
        need(_finite(self.rope_theta) and self.rope_theta > 1, "rope_theta", "a finite number > 1")
        need(_finite(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1, "rms_norm_eps", "a number in (0, 1)")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            need(isinstance(rs, dict), "rope_scaling", "null or a dict")
            need(rs.get("type", "yarn") == "yarn", "rope_scaling", "type 'yarn' (or null for plain RoPE)")
            missing = [k for k in ("factor", "original_max_position_embeddings") if k not in rs]
            need(not missing, "rope_scaling", f"a dict with keys {missing}")
            unknown = sorted(set(rs) - set(_ROPE_KEYS) - {"type"})
            need(not unknown, "rope_scaling", f"only the keys {('type',) + _ROPE_KEYS}, not {unknown}")
            need(_finite(rs["factor"]) and rs["factor"] >= 1, "rope_scaling", "factor a finite number >= 1")
            ompe = rs["original_max_position_embeddings"]
            need(isinstance(ompe, int) and not isinstance(ompe, bool) and ompe > 0, "rope_scaling",
                 "original_max_position_embeddings a positive int")
            for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                need(k not in rs or _finite(rs[k]), "rope_scaling", f"{k} a finite number")

    # ---------------------------------------------------------------- HF in/out
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict) -> "ModelArgs":
        """Build from a HF config (a dict, a config.json path or a checkpoint directory)."""
        if isinstance(path_or_dict, dict):
            cfg = dict(path_or_dict)
        else:
            p = Path(path_or_dict)
            if p.is_dir():
                p = p / "config.json"
            if not p.exists():
                raise FileNotFoundError(f"from_hf_config: no config at {p}")
            try:
                cfg = json.loads(p.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"from_hf_config: {p} is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"from_hf_config: expected a JSON object, got {type(cfg).__name__}")
        if "text_config" in cfg:  # Kimi K2.x multimodal wrapper
            cfg = {**cfg["text_config"]}
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ValueError(f"from_hf_config: the config lacks the required key(s) {missing}")
        for k in cfg:
            close = [] if k in names or k in OTHER_HF_KEYS else difflib.get_close_matches(k, names, 1, 0.8)
            if close:
                raise ValueError(f"from_hf_config: unknown key {k!r}: did you mean {close[0]!r}?")
        kw: dict[str, Any] = {k: cfg[k] for k in names
                              if k in cfg and k not in ("rope_scaling", "rope_theta")}
        rp = cfg.get("rope_parameters") or {}
        rs = cfg.get("rope_scaling")
        theta = cfg.get("rope_theta", rp.get("rope_theta"))
        if theta is not None:
            kw["rope_theta"] = float(theta)
        src = rs if rs else rp
        rtype = (src or {}).get("rope_type", (src or {}).get("type", "default"))
        if src and rtype == "yarn":
            kw["rope_scaling"] = {"type": "yarn",
                                  **{k: src[k] for k in _ROPE_KEYS if k in src and src[k] is not None}}
        elif src and rtype not in ("default", None):
            raise ValueError(f"from_hf_config: rope type {rtype!r} is not supported; expected 'yarn' or "
                             "'default'")
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    def to_hf_config(self) -> dict:
        """A HF-style config dict (hub layout: rope_theta + rope_scaling)."""
        d = dataclasses.asdict(self)
        d.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
                 num_key_value_heads=self.num_attention_heads, attention_bias=False)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = {"type": "yarn", **d["rope_scaling"]}
        return d

    def replace(self, **kw) -> "ModelArgs":
        return dataclasses.replace(self, **kw)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


TINY_A = ModelArgs()
"""tiny-a: hidden 256, 4 layers (1 dense), q_lora_rank null, 8 experts top-2 ungrouped, plain RoPE."""

TINY_B = ModelArgs(
    vocab_size=1024, hidden_size=192, num_hidden_layers=4, first_k_dense_replace=2,
    intermediate_size=384, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4,
    n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.827,
    num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, rope_theta=50000.0, max_position_embeddings=1024,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
)
"""tiny-b: q_lora_rank set, 16 experts in 4 groups (top-2 groups, top-4 experts), 2 dense layers, YaRN."""

PRESETS = {"tiny-a": TINY_A, "tiny-b": TINY_B}


def load_config(name_or_path: str | os.PathLike | ModelArgs) -> ModelArgs:
    """A preset name, a JSON name under data/configs/ (e.g. 'kimi-k2.6'), or a HF config path."""
    if isinstance(name_or_path, ModelArgs):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(os.fspath(name_or_path)).strip():
        known = sorted(PRESETS) + sorted(q.stem for q in CONFIG_DIR.glob("*.json"))
        raise ValueError(f"config={name_or_path!r}: expected a ModelArgs, one of {known} or a path to a HF "
                         "config.json")
    s = str(os.fspath(name_or_path))
    if s in PRESETS:
        return dataclasses.replace(PRESETS[s])
    shipped = CONFIG_DIR / (s if s.endswith(".json") else s + ".json")
    if os.sep not in s and "/" not in s and shipped.is_file():  # a shipped name: never a file of the cwd
        return ModelArgs.from_hf_config(shipped)
    p = Path(s)
    if not p.exists():
        known = sorted(PRESETS) + sorted(q.stem for q in CONFIG_DIR.glob("*.json"))
        raise ValueError(f"config={s!r}: expected one of {known} or a path to a HF config.json")
    return ModelArgs.from_hf_config(p)
