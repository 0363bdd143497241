"""Numpy golden twin of kdtree.ops.moe_bf16 (cuda/moe_bf16.cu): the routed experts with bf16 weights, float64.
"""
from __future__ import annotations

import numpy as np


def moe_bf16(x, topk_ids, topk_weights, w13, w2, round_h: bool = False) -> np.ndarray:
    """Routed experts, float64 (the contract of cuda/moe_bf16.cu).

    x [T, D]; topk_ids [T, k] expert ids in [0, E); topk_weights [T, k]; w13 [E, 2I, D] (rows [0, I) gate,
    [I, 2I) up); w2 [E, D, I]. Returns [T, D] = sum_j topk_weights[t, j] * down_e (silu(gate_e x_t) *
    up_e x_t), e = topk_ids[t, j] (a token listing an expert twice counts it twice). round_h: the hidden
    activations silu(gate) * up rounded to bf16 (round to nearest even) before the down projection, as the
    kernel keeps them."""
    x = np.asarray(x, np.float64)
    ids = np.asarray(topk_ids)
    wts = np.asarray(topk_weights, np.float64)
    w13, w2 = np.asarray(w13, np.float64), np.asarray(w2, np.float64)
    E, I2, D = w13.shape
    if x.ndim != 2 or x.shape[1] != D or ids.shape != wts.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_bf16: x {x.shape}, topk_ids {ids.shape}, topk_weights {wts.shape}, w13 "
                         f"{w13.shape}: expected x [T, {D}] and ids / weights [T, k]")
    if ids.size and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"topk_ids: expected expert ids in [0, {E}), got [{ids.min()}, {ids.max()}]")
    I = I2 // 2
    out = np.zeros_like(x)
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        gu = x[t] @ w13[e].T                                # [n, 2I]
        g, u = gu[:, :I], gu[:, I:]
        h = g / (1.0 + np.exp(-g)) * u
        if round_h:
            h = _round_bf16(h)
        np.add.at(out, t, wts[t, j][:, None] * (h @ w2[e].T))
    return out


def _round_bf16(a: np.ndarray) -> np.ndarray:
    """float64 -> the nearest bfloat16 (ties to even) as float64, through float32 (exact for bf16's range)."""
    f = np.asarray(a, np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = r.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isfinite(f), out, a)
