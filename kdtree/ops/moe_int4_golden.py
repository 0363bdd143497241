"""Numpy golden twin of kdtree.ops.moe_int4 (cuda/moe_int4.cu): INT4 unpacking and dequantization of the
checkpoint format, token-expert grouping and work items, and the routed experts in float64.
"""
from __future__ import annotations

import numpy as np


def unpack_int4(packed) -> np.ndarray:
    """int32 [..., n / 8] (compressed-tensors pack-quantized) -> int8 [..., n] in [-8, 7]. Integer words
    only: a float array is refused (truncating it would unpack other values)."""
    w = np.asarray(packed)
    if not np.issubdtype(w.dtype, np.integer):
        raise ValueError(f"packed: expected integer (int32) words, got dtype {w.dtype}")
    w = w.astype(np.int64) & 0xFFFFFFFF
    u = (w[..., None] >> (4 * np.arange(8))) & 0xF
    return (u - 8).astype(np.int8).reshape(*w.shape[:-1], -1)


def dequant_int4(packed, scale) -> np.ndarray:
    """[..., out, in / 8] int32 + [..., out, in / 32] finite scales -> float64 [..., out, in] = q * scale."""
    q = unpack_int4(packed).astype(np.float64)
    s = np.asarray(scale, np.float64)
    if s.shape != q.shape[:-1] + (q.shape[-1] // 32,):
        raise ValueError(f"scale: expected shape {q.shape[:-1] + (q.shape[-1] // 32,)} (one per 32 inputs of "
                         f"packed {np.shape(packed)}), got {s.shape}")
    if not np.isfinite(s).all():
        raise ValueError(f"scale: expected finite scales, got {int((~np.isfinite(s)).sum())} NaN or infinite")
    return q * np.repeat(s, 32, axis=-1)


def group_pairs(topk_ids, topk_weights, n_experts: int):
    """Token-expert pairs grouped by expert (the contract of cuda/moe_int4.cu moe_group_*).

    topk_ids [T, k] expert ids; topk_weights [T, k]. Returns pair_tok int32 [P] (P = T k; pair p of the flat
    ids is token p // k), pair_w float32 [P], expert_off int32 [E + 1] (expert e owns [off[e], off[e + 1])),
    active int32 [min(E, P)]: experts with pairs by id, then empty ones by id. Here pairs keep their flat
    order within an expert (the kernel's order within an expert is unspecified); ids outside [0, E) are
    dropped."""
    ids = np.asarray(topk_ids).astype(np.int64)
    T, k = ids.shape
    flat, wf = ids.reshape(-1), np.asarray(topk_weights, np.float32).reshape(-1)
    keep = np.nonzero((flat >= 0) & (flat < n_experts))[0]
    order = keep[np.argsort(flat[keep], kind="stable")]
    counts = np.bincount(flat[keep], minlength=n_experts)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    active = np.concatenate([np.nonzero(counts > 0)[0], np.nonzero(counts == 0)[0]])[:min(n_experts, T * k)]
    return (order // k).astype(np.int32), wf[order], off, active.astype(np.int32)


def group_items(expert_off, chunk: int, rows: int) -> np.ndarray:
    """The expert GEMMs' work items (the contract of cuda/moe_int4.cu moe_group_*'s items): int32 [rows, 2],
    (expert, first pair) for every `chunk` pairs of each expert that has pairs, experts by id, an expert's
    chunks in order, then (-1, -1) rows. expert_off int [E + 1] as group_pairs returns it."""
    off = np.asarray(expert_off, np.int64)
    if chunk <= 0:
        raise ValueError(f"chunk: expected a positive number of pairs, got {chunk}")
    got = [(e, p) for e in range(off.shape[0] - 1) for p in range(int(off[e]), int(off[e + 1]), chunk)]
    if len(got) > rows:
        raise ValueError(f"rows: expected at least the {len(got)} items, got {rows}")
    items = np.full((rows, 2), -1, np.int32)
    if got:
        items[:len(got)] = np.asarray(got, np.int32)
    return items


def moe_int4(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale) -> np.ndarray:
    """Routed experts with INT4 weights, float64 (the contract of cuda/moe_int4.cu).

    x [T, D]; topk_ids [T, k] expert ids; topk_weights [T, k]; w13 [E, 2I, D/8] packed (+ [E, 2I, D/32]
    scales; rows [0, I) gate, [I, 2I) up); w2 [E, D, I/8] packed (+ [E, D, I/32] scales).
    Returns [T, D] = sum_j topk_weights[t, j] * down_e (silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j];
    pairs with an id outside [0, E) are dropped (expert parallelism marks another rank's experts -1)."""
    x = np.asarray(x, np.float64)
    ids = np.asarray(topk_ids)
    wts = np.asarray(topk_weights, np.float64)
    T, D = x.shape
    I = np.asarray(w13_packed).shape[1] // 2
    out = np.zeros((T, D))
    E = np.asarray(w13_packed).shape[0]
    for e in np.unique(ids):
        if not 0 <= e < E:
            continue
        w13 = dequant_int4(w13_packed[e], w13_scale[e])
        w2 = dequant_int4(w2_packed[e], w2_scale[e])
        t, j = np.nonzero(ids == e)
        gu = x[t] @ w13.T                                   # [n, 2I]
        g, u = gu[:, :I], gu[:, I:]
        hid = g / (1.0 + np.exp(-g)) * u
        np.add.at(out, t, wts[t, j][:, None] * (hid @ w2.T))   # a token listing e twice counts it twice
    return out
