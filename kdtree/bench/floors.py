"""Byte floors of engine rounds: the bytes one round must read at least, by part, and the fraction of that
floor a measured round reaches at the copy rate measured in the same run (`ceilings.copy_bandwidth`).

    parts = round_floor_parts(target, drafter, "ddtree", experts_touched=41.5, context=4096, batch=1)
    floor = round_floor(parts, copy_bytes_per_s, round_s)   # {"bytes", "s", "fraction", "parts"}

A round reads every target layer's weights but its routed experts, the routed experts its tokens touch, each
request's cached latent rows, the final norm and lm_head (AR: nothing else); a speculative round also runs
the drafter once: its own weights, the shared lm_head again (its logits are a separate pass), and its
context's keys and values of every live row. Embedding rows and the verify block's own rows are a few KB and
left out. Nothing here reads a tensor's values: parameter sizes and shapes only, on any device.
"""
from __future__ import annotations

from ..model import MoE
from .decode_layers import _nbytes, expert_bytes, layer_floor_parts

PARTS = ("weights", "experts", "kv", "head", "drafter", "drafter_kv")


def _check(what: str, v, lo: float = 0) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= lo:
        raise ValueError(f"{what}={v!r}: expected a number >= {lo}")


def round_floor_parts(target, drafter, mode: str, experts_touched: float, context: int, batch: int) -> dict:
    """{part: bytes} of one engine round (module docstring) over target's layers as built: experts_touched is
    the mean routed experts one MoE layer reads a round (`bench.k26.measure_routing`); context the cached rows
    each of the batch's requests holds. mode "ar" reads no drafter (drafter may be None)."""
    if mode not in ("ar", "dflash", "ddtree"):
        raise ValueError(f"mode={mode!r}: expected 'ar', 'dflash' or 'ddtree'")
    _check("experts_touched", experts_touched)
    for what, v, lo in (("context", context, 0), ("batch", batch, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{what}={v!r}: expected an int >= {lo}")
    if mode != "ar" and drafter is None:
        raise ValueError(f"mode={mode!r}: a speculative round's floor needs its drafter")
    kv_item = _itemsize(target.cache_dtype)
    parts = dict.fromkeys(PARTS, 0)
    for layer in target.model.layers:
        p = layer_floor_parts(layer, 0, context, batch, kv_item)
        parts["weights"] += p["weights"]
        parts["kv"] += p["kv"]
        if isinstance(layer.mlp, MoE):
            parts["experts"] += round(experts_touched * expert_bytes(layer.mlp.experts))
    head = sum(_nbytes(t) for t in list(target.model.norm.parameters()) + list(target.lm_head.parameters()))
    parts["head"] = head
    if mode != "ar":
        from .. import k26
        da = drafter.args
        parts["drafter"] = k26.weight_bytes(drafter) + _nbytes(target.lm_head.weight)
        parts["drafter_kv"] = (batch * context * len(drafter.layers) * 2 * da.num_key_value_heads
                               * da.head_dim * drafter.fc.weight.element_size())
    return parts


def draft_stage_parts(parts: dict, drafter) -> dict:
    """The part of a round's floor (`round_floor_parts`) that the engine's draft stage reads: the drafter's
    weights but its context projection (fc and hidden_norm run in the commit stage, on the accepted rows),
    the shared lm_head, and its context K/V; the target's parts zero."""
    proj = sum(_nbytes(p) for p in list(drafter.fc.parameters()) + list(drafter.hidden_norm.parameters()))
    return {k: (parts[k] - proj if k == "drafter" else parts[k] if k == "drafter_kv" else 0) for k in parts}


def _itemsize(dtype) -> int:
    import torch
    return torch.empty(0, dtype=dtype).element_size()


def round_floor(parts: dict, copy_bytes_per_s: float | None, round_s: float | None) -> dict:
    """{"bytes": the parts' sum, "parts", "s": bytes at the copy rate, "fraction": s / round_s}; "s" and
    "fraction" None where the rate or the round's time is unknown (a CPU run, an engine that failed)."""
    if set(parts) != set(PARTS):
        raise ValueError(f"parts: expected the keys {PARTS}, got {sorted(parts)}")
    total = int(sum(parts.values()))
    s = None if not copy_bytes_per_s else total / copy_bytes_per_s
    frac = None if s is None or not round_s else s / round_s
    return {"bytes": total, "parts": dict(parts), "s": s, "fraction": frac}
