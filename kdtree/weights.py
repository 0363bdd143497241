"""Checkpoints in the HF hub layout: config.json + model.safetensors (or sharded with an index).

`load(dir)` reads a checkpoint written by transformers' `DeepseekV3ForCausalLM.save_pretrained` (or by
`save` below) into a `kdtree.model.Transformer`. Every tensor is checked by name and shape first; a
mismatch raises `CheckpointError` listing the missing, unexpected and mis-shaped tensors.
Tensors of layers past num_hidden_layers (the multi-token-prediction layer real checkpoints ship) are
skipped and reported in `Transformer.skipped_tensors`.

Routed experts stored INT4 (compressed-tensors `pack-quantized`, as K2 checkpoints store them:
`...experts.{j}.{gate,up,down}_proj.weight_packed / weight_scale / weight_shape`) load into
`Int4Experts` for that layer, packed as they are; `save` writes a quantized model back the same way.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import quant
from .config import ModelArgs
from .model import Int4Experts, MoE, Transformer

_PACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight_packed$")


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
    where: dict[str, str] = {}
    for f in _tensor_files(d):
        if not f.exists():
            raise CheckpointError(f"load: the index names {f.name}, which is not in {d}")
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if k in out:
                    raise CheckpointError(f"load: tensor {k} is in both {where[k]} and {f.name} ({d})")
                out[k], where[k] = fh.get_tensor(k), f.name
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


def _take_int4_experts(found: dict[str, torch.Tensor], args: ModelArgs) -> dict[int, Int4Experts]:
    """Pop every pack-quantized routed-expert tensor from `found`; per layer, the stacked Int4Experts."""
    layers = sorted({int(m.group(1)) for k in found if (m := _PACKED.match(k))})
    out = {}
    for i in layers:
        if i >= args.num_hidden_layers:
            continue  # skipped with the other extra-layer tensors
        if i < args.first_k_dense_replace:
            raise CheckpointError(f"layer {i} has INT4 routed experts but is dense (first_k_dense_replace="
                                  f"{args.first_k_dense_replace})")
        w13, w2 = [], []
        for j in range(args.n_routed_experts):
            pre = f"model.layers.{i}.mlp.experts.{j}"
            try:
                g, u, d = (quant.read_int4(found, f"{pre}.{n}_proj") for n in ("gate", "up", "down"))
            except quant.QuantFormatError as e:
                raise CheckpointError(f"INT4 experts of layer {i}: {e}") from None
            want = {"gate": (args.moe_intermediate_size, args.hidden_size), "up": (args.moe_intermediate_size,
                    args.hidden_size), "down": (args.hidden_size, args.moe_intermediate_size)}
            for name, w in (("gate", g), ("up", u), ("down", d)):
                if w.shape != want[name]:
                    raise CheckpointError(f"{pre}.{name}_proj.weight_shape: expected {want[name]}, found {w.shape}")
            w13.append(quant.Int4Weight(torch.cat([g.packed, u.packed]), torch.cat([g.scale, u.scale]),
                                        (2 * args.moe_intermediate_size, args.hidden_size)))
            w2.append(d)
            for n in ("gate", "up", "down"):
                for suf in quant.SUFFIXES:
                    found.pop(f"{pre}.{n}_proj.{suf}", None)
        extra = [k for k in found if k.startswith(f"model.layers.{i}.mlp.experts.") and ".weight" in k
                 and int(k.split(".")[4]) >= args.n_routed_experts]
        if extra:
            raise CheckpointError(f"layer {i}: experts beyond n_routed_experts={args.n_routed_experts}: {extra[:4]}")
        out[i] = Int4Experts(*quant.stack_experts(w13), *quant.stack_experts(w2))
    return out


def load(path: str | os.PathLike, dtype=torch.float32, device="cpu", attn_impl: str = "absorb",
         args: ModelArgs | None = None) -> Transformer:
    """Load a hub-layout checkpoint directory into a Transformer (config from its config.json unless given).
    INT4 routed experts stay packed (Int4Experts); `dtype` applies to the floating-point weights."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"load: {d} is not a directory")
    args = args or ModelArgs.from_hf_config(d)
    found = read_state_dict(d)
    int4 = _take_int4_experts(found, args)
    with torch.device("meta"):
        skeleton = Transformer(args, attn_impl)
        for i, ex in int4.items():
            skeleton.model.layers[i].mlp.experts = Int4Experts(*(torch.empty_like(t, device="meta") for t in (
                ex.w13_packed, ex.w13_scale, ex.w2_packed, ex.w2_scale)))
    expected = {k: v.shape for k, v in skeleton.state_dict().items() if ".mlp.experts.w" not in k}
    skipped = check_state_dict(expected, found, args, where=f"checkpoint {d}")
    model = Transformer(args, attn_impl)
    for i, ex in int4.items():
        model.model.layers[i].mlp.experts = ex
    model.load_state_dict({k: found[k] for k in expected} | {k: v for k, v in model.state_dict().items()
                                                              if ".mlp.experts.w" in k}, strict=True)
    model.skipped_tensors = skipped
    model = model.to(device=device)
    for name, p in model.named_parameters():
        p.data = p.data.to(dtype)
    for name, b in model.named_buffers():
        if b.is_floating_point() and ".mlp.experts.w" not in name:
            b.data = b.data.to(dtype)
    return model.eval()


def save(model: Transformer, path: str | os.PathLike, dtype=None) -> Path:
    """Write config.json + model.safetensors in the hub layout (INT4 routed experts as pack-quantized
    tensors per expert, the way compressed-tensors writes them)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r}: expected a floating torch dtype (torch.bfloat16, torch.float32, ...)")
    d = Path(path)
    if (d / "model.safetensors.index.json").exists():
        raise ValueError(f"{d}: holds a sharded checkpoint (model.safetensors.index.json), which load() would read "
                         "instead of the file written here: save into an empty folder")
    d.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        if ".mlp.experts.w" in k:
            continue
        sd[k] = (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
    quantized = False
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts if isinstance(layer.mlp, MoE) else None
        if not isinstance(ex, Int4Experts):
            continue
        quantized = True
        I, D = ex.w13_packed.shape[1] // 2, ex.w13_packed.shape[2] * 8
        for j in range(ex.w13_packed.shape[0]):
            pre = f"model.layers.{i}.mlp.experts.{j}"
            p13, s13 = ex.w13_packed[j].cpu(), ex.w13_scale[j].cpu()
            for n, rows in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
                sd.update(quant.Int4Weight(p13[rows].contiguous(), s13[rows].contiguous(), (I, D)).state_dict(
                    f"{pre}.{n}_proj"))
            sd.update(quant.Int4Weight(ex.w2_packed[j].cpu(), ex.w2_scale[j].cpu(), (D, I)).state_dict(
                f"{pre}.down_proj"))
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.args.to_hf_config()
    if quantized:
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                          "group_size": quant.GROUP}}}}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def save_drafter(drafter, path: str | os.PathLike, dtype=None) -> Path:
    """A DFlash drafter as config.json (DFlashDraftModel keys) + model.safetensors (its own weights: the
    embedding and lm_head are the target's and are not written)."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in drafter.state_dict().items()}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(drafter.args.to_hf_config(), indent=2) + "\n")
    return d


def load_drafter(path: str | os.PathLike, target: Transformer, dtype=torch.float32):
    """The drafter saved by save_drafter, attached to `target` (checked like load: names and shapes)."""
    from .drafter import DFlashDrafter, DrafterArgs
    d = Path(path)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"load_drafter: no config.json in {d}")
    args = DrafterArgs.from_hf_config(json.loads((d / "config.json").read_text()))
    found = read_state_dict(d)
    drafter = DFlashDrafter(args)
    expected = {k: v.shape for k, v in drafter.state_dict().items()}
    check_state_dict(expected, found, ModelArgs(), where=f"drafter checkpoint {d}")
    drafter.load_state_dict({k: found[k] for k in expected}, strict=True)
    return drafter.to(device=target.device, dtype=dtype).eval().attach(target)
