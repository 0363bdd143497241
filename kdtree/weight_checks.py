"""The checkpoint's tensors against the config, before and while a model is built: layer and expert
layout (`check_layout`), names and shapes (`check_state_dict`), floating and finite values (`check_values`),
and the pack-quantized INT4 routed experts taken into `Int4Experts` (`take_int4_experts`). Every failure is a
`CheckpointError` naming the tensor (`kdtree.weights` re-exports these)."""
from __future__ import annotations

import re

import torch

from . import quant
from .config import ModelArgs
from .model import Int4Experts

_PACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight_packed$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


class CheckpointError(ValueError):
    pass


def check_layout(found: dict[str, torch.Tensor], args: ModelArgs, nextn: int = 0, where: str = "checkpoint"):
    """The config against the tensors' names, before any model is built: layers 0..num_hidden_layers-1 all
    present, none past num_hidden_layers + nextn (the trailing multi-token-prediction layers), and in each MoE
    layer experts 0..n_routed_experts-1. CheckpointError naming a tensor otherwise."""
    L = args.num_hidden_layers
    layers: dict[int, str] = {}
    for k in found:
        if m := _LAYER.match(k):
            layers.setdefault(int(m.group(1)), k)
    absent = [i for i in range(L) if i not in layers]
    if absent:
        held = f"layers 0..{max(layers)}" if layers else "no layer tensors"
        raise CheckpointError(f"{where}: the config says num_hidden_layers={L} but the tensors hold {held} "
                              f"(no tensor model.layers.{absent[0]}.*)")
    past = sorted(i for i in layers if i >= L + nextn)
    if past:
        raise CheckpointError(f"{where}: tensor {layers[past[0]]} is past num_hidden_layers={L} + "
                              f"num_nextn_predict_layers={nextn}: the config has fewer layers than the "
                              "tensors")
    experts: dict[int, set[int]] = {}
    for k in found:
        if (m := _EXPERT.match(k)) and int(m.group(1)) < L:
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    for i in range(args.first_k_dense_replace, L):
        held = experts.get(i, set())
        if held != set(range(args.n_routed_experts)):
            desc = f"experts {min(held)}..{max(held)} ({len(held)})" if held else "no routed experts"
            raise CheckpointError(f"{where}: layer {i} holds {desc}; the config says n_routed_experts="
                                  f"{args.n_routed_experts}")


def check_values(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], allow_nonfinite: bool,
                 where: str = "checkpoint") -> None:
    """Floating tensors of the model from floating tensors of the checkpoint, all finite unless allowed."""
    for k, want in expected.items():
        t = found[k]
        if want.is_floating_point() and not t.is_floating_point():
            raise CheckpointError(f"{where}: tensor {k}: expected a floating-point tensor, found {t.dtype}")
        if not allow_nonfinite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: tensor {k} holds NaN or inf (allow_nonfinite=True loads it "
                                  "anyway)")


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


def take_int4_experts(found: dict[str, torch.Tensor], args: ModelArgs, allow_nonfinite: bool = False
                      ) -> dict[int, Int4Experts]:
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
                    raise CheckpointError(f"{pre}.{name}_proj.weight_shape: expected {want[name]}, "
                                          f"found {w.shape}")
                if not allow_nonfinite and not bool(torch.isfinite(w.scale).all()):
                    raise CheckpointError(f"{pre}.{name}_proj.weight_scale holds NaN or inf "
                                          "(allow_nonfinite=True loads it anyway)")
            w13.append(quant.Int4Weight(torch.cat([g.packed, u.packed]), torch.cat([g.scale, u.scale]),
                                        (2 * args.moe_intermediate_size, args.hidden_size)))
            w2.append(d)
            for n in ("gate", "up", "down"):
                for suf in quant.SUFFIXES:
                    found.pop(f"{pre}.{n}_proj.{suf}", None)
        extra = [k for k in found if k.startswith(f"model.layers.{i}.mlp.experts.") and ".weight" in k
                 and int(k.split(".")[4]) >= args.n_routed_experts]
        if extra:
            raise CheckpointError(f"layer {i}: experts beyond n_routed_experts={args.n_routed_experts}: "
                                  f"{extra[:4]}")
        out[i] = Int4Experts(*quant.stack_experts(w13), *quant.stack_experts(w2))
    return out
