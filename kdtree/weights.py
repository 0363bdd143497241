"""Checkpoints in the HF hub layout: config.json + model.safetensors (or sharded with an index).

`load(dir)` reads a checkpoint written by transformers' `DeepseekV3ForCausalLM.save_pretrained` (or by
`save` below) into a `kdtree.model.Transformer`. Every tensor is checked by name and shape first; a
mismatch raises `CheckpointError` listing the missing, unexpected and mis-shaped tensors.
Tensors of layers past num_hidden_layers (the multi-token-prediction layer real checkpoints ship) are
skipped and reported in `Transformer.skipped_tensors`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelArgs
from .model import Transformer


class CheckpointError(ValueError):
    pass


def _tensor_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [d / f for f in sorted(set(weight_map.values()))]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"load: no *.safetensors (or model.safetensors.index.json) in {d}")
    return files


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by name."""
    d = Path(path)
    out: dict[str, torch.Tensor] = {}
    for f in _tensor_files(d):
        if not f.exists():
            raise CheckpointError(f"load: the index names {f.name}, which is not in {d}")
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def check_state_dict(expected: dict[str, torch.Size], found: dict[str, torch.Tensor], args: ModelArgs,
                     where: str = "checkpoint") -> list[str]:
    """Raise CheckpointError naming missing / unexpected / mis-shaped tensors; return the skipped names."""
    extra_layer = re.compile(r"model\.layers\.(\d+)\.")
    skipped, unexpected = [], []
    for k in found:
        if k in expected:
            continue
        m = extra_layer.match(k)
        if m and int(m.group(1)) >= args.num_hidden_layers:
            skipped.append(k)
        elif k.endswith("rotary_emb.inv_freq"):
            skipped.append(k)
        else:
            unexpected.append(k)
    missing = [k for k in expected if k not in found]
    shapes = [f"{k}: expected {tuple(expected[k])}, found {tuple(found[k].shape)}"
              for k in expected if k in found and tuple(found[k].shape) != tuple(expected[k])]
    if missing or unexpected or shapes:
        parts = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)):
            if items:
                more = f" (+{len(items) - 12} more)" if len(items) > 12 else ""
                parts.append(f"{len(items)} {title}: " + ", ".join(items[:12]) + more)
        raise CheckpointError(f"{where} does not match the config: " + "; ".join(parts))
    return skipped


def load(path: str | os.PathLike, dtype=torch.float32, device="cpu", attn_impl: str = "absorb",
         args: ModelArgs | None = None) -> Transformer:
    """Load a hub-layout checkpoint directory into a Transformer (config from its config.json unless given)."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"load: {d} is not a directory")
    args = args or ModelArgs.from_hf_config(d)
    found = read_state_dict(d)
    with torch.device("meta"):
        skeleton = Transformer(args, attn_impl)
    expected = {k: v.shape for k, v in skeleton.state_dict().items()}
    skipped = check_state_dict(expected, found, args, where=f"checkpoint {d}")
    model = Transformer(args, attn_impl)
    model.load_state_dict({k: found[k] for k in expected}, strict=True)
    model.skipped_tensors = skipped
    return model.to(device=device, dtype=dtype).eval()


def save(model: Transformer, path: str | os.PathLike, dtype=None) -> Path:
    """Write config.json + model.safetensors in the hub layout."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in model.state_dict().items()}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(model.args.to_hf_config(), indent=2) + "\n")
    return d
