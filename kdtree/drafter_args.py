"""The DFlash drafter's configuration: DrafterArgs, checked on construction, sized to a target
(`DrafterArgs.for_target`) or read from and written to a DFlash drafter's config.json (`from_hf_config`,
`to_hf_config`; DRAFTER_REQUIRED_KEYS must be present there)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


DRAFTER_REQUIRED_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "vocab_size", "num_hidden_layers",
                         "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                         "intermediate_size")


@dataclass
class DrafterArgs:
    block_size: int = 8
    mask_token_id: int = 1023
    target_layer_ids: tuple = (0, 1, 3)
    target_hidden_size: int = 256
    vocab_size: int = 1024
    num_hidden_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self):
        ids = self.target_layer_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"DrafterArgs.target_layer_ids={ids!r}: expected a list of target layer "
                             "indices (ints)")
        self.target_layer_ids = tuple(ids)
        for name in ("block_size", "mask_token_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"DrafterArgs.{name}={v!r}: expected an int")
        for name in ("vocab_size", "target_hidden_size", "num_hidden_layers", "hidden_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DrafterArgs.{name}={v!r}: expected a positive int")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"DrafterArgs.{name}={v!r}: expected a finite number > 0")
        if min(self.target_layer_ids, default=0) < 0:
            raise ValueError(f"DrafterArgs.target_layer_ids={self.target_layer_ids}: expected layer indices "
                             ">= 0")
        if not (isinstance(self.block_size, int) and self.block_size >= 2):
            raise ValueError(f"DrafterArgs.block_size={self.block_size!r}: expected an int >= 2")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DrafterArgs.mask_token_id={self.mask_token_id}: expected in "
                             f"[0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("DrafterArgs.target_layer_ids: expected at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DrafterArgs.num_key_value_heads={self.num_key_value_heads}: expected a "
                             f"divisor of num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"DrafterArgs.head_dim={self.head_dim}: expected an even number")

    @classmethod
    def for_target(cls, target, block_size: int = 8, num_hidden_layers: int = 2, **kw) -> "DrafterArgs":
        """Defaults sized to a target's ModelArgs: layers spread over its depth, its vocab, a mask id at
        V-1."""
        n = target.num_hidden_layers
        k = min(n, 3)
        ids = tuple(sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)}))
        heads = kw.pop("num_attention_heads", 4)
        base = dict(block_size=block_size, mask_token_id=target.vocab_size - 1, target_layer_ids=ids,
                    target_hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                    num_hidden_layers=num_hidden_layers, hidden_size=target.hidden_size,
                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                    head_dim=target.hidden_size // heads, intermediate_size=2 * target.hidden_size,
                    rms_norm_eps=target.rms_norm_eps, max_position_embeddings=target.max_position_embeddings)
        base.update(kw)
        return cls(**base)

    def to_hf_config(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d.update(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_act="silu")
        return d

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DrafterArgs":
        """From a DFlash drafter's config.json (its DFlash keys at the top or under dflash_config); the keys
        that fix its shapes and its tie to the target are required."""
        if not isinstance(cfg, dict) or not isinstance(cfg.get("dflash_config", {}), dict):
            raise ValueError(f"DrafterArgs.from_hf_config: expected a JSON object, got {type(cfg).__name__}")
        names = set(cls.__dataclass_fields__)
        merged = {**cfg, **cfg.get("dflash_config", {})}
        missing = [k for k in DRAFTER_REQUIRED_KEYS if k not in merged]
        if missing:
            raise ValueError(f"DrafterArgs.from_hf_config: the drafter config lacks the required key(s) "
                             f"{missing}")
        return cls(**{k: v for k, v in merged.items() if k in names})
