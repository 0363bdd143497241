"""Numpy golden twin of kdtree.ops.verify_attn (cuda/verify_attn.cu): MLA-absorb tree-verify attention of one
request in float64. The packed mask words verify_attn takes are tree_golden.pack_mask_bits' layout.
"""
from __future__ import annotations

import numpy as np


def mla_tree_attention(q_lat, q_pe, kv, pe, mask, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """MLA-absorb attention for one request, in float64.

    q_lat [N, H, R] (q_nope folded through W_uk), q_pe [N, H, P] (rotated), kv [S, R] latent cache,
    pe [S, P] rotated rope keys, S = prefix + N with the appended block last; mask [N, N] bool over the
    block (every prefix row visible). Returns (out [N, H, R] = softmax(scores) @ kv, lse [N, H])."""
    q_lat = np.asarray(q_lat, np.float64)
    q_pe = np.asarray(q_pe, np.float64)
    kv = np.asarray(kv, np.float64)
    pe = np.asarray(pe, np.float64)
    mask = np.asarray(mask, bool)
    N, H, R = q_lat.shape
    S = kv.shape[0]
    if (q_pe.shape[:2] != (N, H) or kv.shape != (S, R) or pe.shape != (S, q_pe.shape[2])
            or mask.shape != (N, N) or S < N):
        raise ValueError("mla_tree_attention: shapes q_lat [N,H,R], q_pe [N,H,P], kv [S,R], pe [S,P], "
                         "mask [N,N], S >= N")
    visible = np.concatenate([np.ones((N, S - N), bool), mask], axis=1)  # [N, S]
    return _attend(q_lat, q_pe, kv, pe, visible, scale)


def _attend(q_lat, q_pe, kv, pe, visible, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """softmax over the visible keys (visible bool [N, S], or None: all) of float64 inputs -> (out, lse)."""
    scores = (np.einsum("nhr,sr->nhs", q_lat, kv) + np.einsum("nhp,sp->nhs", q_pe, pe)) * scale
    if visible is not None:
        scores = np.where(visible[:, None, :], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - m)
    denom = p.sum(axis=-1, keepdims=True)
    return np.einsum("nhs,sr->nhr", p / denom, kv), (m + np.log(denom))[..., 0]



def prefix_attention(q_lat, q_pe, kv, pe, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The prefix half of a split verify (ops.attn_split): every query row sees every one of the S rows, in
    float64. q_lat [N, H, R], q_pe [N, H, P], kv [S, R], pe [S, P] (S may be 0). Returns (out [N, H, R], lse
    [N, H]); for S = 0, out 0 and lse -inf."""
    q_lat = np.asarray(q_lat, np.float64)
    q_pe = np.asarray(q_pe, np.float64)
    kv = np.asarray(kv, np.float64)
    pe = np.asarray(pe, np.float64)
    N, H, R = q_lat.shape
    S = kv.shape[0]
    if q_pe.shape[:2] != (N, H) or kv.shape != (S, R) or pe.shape != (S, q_pe.shape[2]):
        raise ValueError("prefix_attention: shapes q_lat [N,H,R], q_pe [N,H,P], kv [S,R], pe [S,P]")
    if S == 0:
        return np.zeros((N, H, R)), np.full((N, H), -np.inf)
    return _attend(q_lat, q_pe, kv, pe, None, scale)
