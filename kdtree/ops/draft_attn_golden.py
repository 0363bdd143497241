"""Numpy golden twin of kdtree.ops.draft_attn (cuda/draft_attn.cu): the drafter's GQA attention over a
preallocated context, in float64.
"""
from __future__ import annotations

import numpy as np


def draft_attention(q, k, v, ctx_len, C: int, scale: float) -> np.ndarray:
    """q [B, Hk, R, hd]; k, v [B, Hk, S, hd] with S = C + T, T >= 1; ctx_len [B] ints in [0, C]. Request b's
    rows attend to its columns [0, ctx_len[b]) and [C, S) only: out[b, h] = softmax(scale q[b, h] k^T) v over
    those columns (no other column is read), float64. Returns out [B, Hk, R, hd]."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    ctx_len = np.asarray(ctx_len)
    if (q.ndim != 4 or k.ndim != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]
            or v.shape != k.shape):
        raise ValueError("draft_attention: shapes q [B, Hk, R, hd], k and v [B, Hk, S, hd]")
    B, S = q.shape[0], k.shape[2]
    if not 0 <= C < S:
        raise ValueError(f"draft_attention: C={C}: expected 0 <= C < S={S} (T = S - C >= 1)")
    if ctx_len.shape != (B,) or not np.issubdtype(ctx_len.dtype, np.integer):
        raise ValueError(f"draft_attention: ctx_len: expected {B} ints, got {ctx_len.dtype} {ctx_len.shape}")
    if B and (ctx_len.min() < 0 or ctx_len.max() > C):
        raise ValueError(f"draft_attention: ctx_len: expected values in [0, C={C}]")
    out = np.empty(q.shape, np.float64)
    for b in range(B):
        cols = np.concatenate([np.arange(int(ctx_len[b])), np.arange(C, S)])
        kb, vb = k[b][:, cols], v[b][:, cols]                       # [Hk, L, hd]
        s = np.einsum("hrd,hld->hrl", q[b], kb) * scale
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[b] = np.einsum("hrl,hld->hrd", p / p.sum(axis=-1, keepdims=True), vb)
    return out
