"""Golden twins of cuda/decode_fused.cu (numpy): the same contracts, float64 sums, bf16 rounding where the
kernels round (`rb`). Inputs are float arrays holding the kernels' bf16 / fp32 values; outputs float64 arrays
of bf16 values (router_scores, router_select: float32 / int32 as the kernels write them).

    add_rmsnorm(x, w, eps, routed=None, shared=None, delta=None) -> (x_out [M, D], y [M, D])
    mla_latent(qkv, QL, R, wq, wkv, cos, sin, eps, interleave)  -> (q_out [M, QL], rows [M, R + P])
    q_absorb(qb, wkvb, cos, sin, Dn, interleave)                -> qk [M, H, R + P]
    uv_absorb(o_lat, wkvb, Dn)                                  -> out [M, H * Dv]
    router_scores(x, w)                                         -> scores float32 [M, E]
    router_select(scores, bias, n_group, topk_group, k, norm, scale) -> (weights float32 [M, k], ids int32)
    silu_mul(g, u)                                              -> out [M, I]
"""
from __future__ import annotations

import numpy as np


def rb(a) -> np.ndarray:
    """Values rounded to bf16 (nearest, ties to even) through float32, returned as float64."""
    f = np.asarray(a, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = (r & 0xFFFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isfinite(f), out, f.astype(np.float64))


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    inv = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return rb(w * rb(x * inv))


def add_rmsnorm(x, w, eps: float, routed=None, shared=None, delta=None):
    """x [M, D] residual; routed [M, D] (fp32, the routed experts' sum) with optional shared [M, D], or
    delta [M, D]: x_out = rb(x + s) with s = rb(rb(routed) + shared) / rb(routed) / delta; y = RMSNorm."""
    x = np.asarray(x, np.float64)
    if routed is not None:
        s = rb(routed)
        if shared is not None:
            s = rb(s + np.asarray(shared, np.float64))
        x = rb(x + s)
    elif delta is not None:
        x = rb(x + np.asarray(delta, np.float64))
    return x, _rmsnorm(x, np.asarray(w, np.float64), eps)


def rope(x, cos, sin, interleave: bool) -> np.ndarray:
    """x [..., P] with cos / sin [..., P/2] (broadcast): model.apply_rope's bf16 steps."""
    x = np.asarray(x, np.float64)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = np.split(x, 2, axis=-1)
    c, s = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    return np.concatenate([rb(rb(x1 * c) - rb(x2 * s)), rb(rb(x2 * c) + rb(x1 * s))], -1)


def mla_latent(qkv, QL: int, R: int, wq, wkv, cos, sin, eps: float, interleave: bool):
    """qkv [M, QL + R + P] -> (RMSNorm(q part) * wq [M, QL], latent rows [M, R + P]: RMSNorm(kv part) * wkv
    then the roped key)."""
    qkv = np.asarray(qkv, np.float64)
    q = _rmsnorm(qkv[:, :QL], np.asarray(wq, np.float64), eps) if QL else qkv[:, :0]
    kv = _rmsnorm(qkv[:, QL:QL + R], np.asarray(wkv, np.float64), eps)
    return q, np.concatenate([kv, rope(qkv[:, QL + R:], cos, sin, interleave)], -1)


def q_absorb(qb, wkvb, cos, sin, Dn: int, interleave: bool) -> np.ndarray:
    """qb [M, H, Dn + P], wkvb [H, Dn + Dv, R], cos / sin [M, P/2] -> qk [M, H, R + P]."""
    qb, w = np.asarray(qb, np.float64), np.asarray(wkvb, np.float64)
    lat = rb(np.einsum("mhd,hdr->mhr", qb[..., :Dn], w[:, :Dn]))
    pe = rope(qb[..., Dn:], np.asarray(cos)[:, None], np.asarray(sin)[:, None], interleave)
    return np.concatenate([lat, pe], -1)


def uv_absorb(o_lat, wkvb, Dn: int) -> np.ndarray:
    """o_lat [M, H, R], wkvb [H, Dn + Dv, R] -> [M, H * Dv]."""
    o = np.einsum("mhr,hdr->mhd", np.asarray(o_lat, np.float64), np.asarray(wkvb, np.float64)[:, Dn:])
    return rb(o).reshape(o.shape[0], -1)


def router_scores(x, w) -> np.ndarray:
    """x [M, D], w [E, D] -> sigmoid(x w^T) float32 [M, E]."""
    s = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return (1.0 / (1.0 + np.exp(-s))).astype(np.float32)


def router_select(scores, bias, n_group: int, topk_group: int, k: int, norm: bool, scale: float):
    """scores float32 [M, E], bias float32 [E] -> (weights float32 [M, k], ids int32 [M, k]): the k largest
    of c = scores + bias (float32; ties to the lower id) among the topk_group groups of largest top-2 sum
    (n_group > 1), in order; weights = scores at ids, normalised by their float32 sum + 1e-20 when norm,
    times scale."""
    sc = np.asarray(scores, np.float32)
    M, E = sc.shape
    c = sc + np.asarray(bias, np.float32)[None]
    ids = np.zeros((M, k), np.int32)
    wts = np.zeros((M, k), np.float32)
    for m in range(M):
        cm = c[m].astype(np.float64)
        if n_group > 1:
            gs = E // n_group
            g2 = np.sort(cm.reshape(n_group, gs), axis=1)[:, ::-1][:, :2]
            gscore = (g2[:, 0].astype(np.float32) + g2[:, 1].astype(np.float32)).astype(np.float64)
            keep = np.lexsort((np.arange(n_group), -gscore))[:topk_group]
            mask = np.zeros(n_group, bool)
            mask[keep] = True
            cm = np.where(np.repeat(mask, gs), cm, -np.inf)
        order = np.lexsort((np.arange(E), -cm))[:k]
        ids[m] = order
        w = sc[m, order]
        if norm:
            total = np.float32(0)
            for v in w:
                total = np.float32(total + v)
            w = (w / np.float32(total + np.float32(1e-20))).astype(np.float32)
        wts[m] = (w * np.float32(scale)).astype(np.float32)
    return wts, ids


def silu_mul(g, u) -> np.ndarray:
    """g, u [M, I] -> rb(rb(silu(g)) * u)."""
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    return rb(rb(g / (1.0 + np.exp(-g))) * u)
