"""The fused decode layer's small kernels (cuda/decode_fused.cu); golden twin: decode_golden.

Contract (bf16 tensors are torch.bfloat16; every tensor contiguous and on the current CUDA device):
  add_rmsnorm(x, w, eps, routed=None, shared=None, delta=None) -> (x_out, y), both bf16 [M, D]: the residual
      step then RMSNorm of a decoder layer (routed fp32 [M, D] with optional shared bf16, or delta bf16).
  mla_latent(qkv, wq, wkv, cos, sin, slots, pool, eps, interleave) -> q bf16 [M, QL]; writes the latent rows
      (RMSNorm'd latent, then the roped key) into pool rows `slots` (in place).
  q_absorb(qb, wkvb, cos, sin, Dn, interleave) -> qk bf16 [M, H, R + P]: the absorbed query verify_attn reads.
  uv_absorb(o_lat, wkvb, Dn) -> bf16 [M, H * Dv]: the attention's value heads, o_proj's input.
  router_scores(x, w) -> fp32 [M, E]; router_select(scores, bias, n_group, topk_group, k, norm, scale) ->
      (weights fp32 [M, k], ids int32 [M, k]): Gate.forward's routing.
  silu_mul(g, u) -> bf16 [M, I] (g and u may be the two halves of one [M, 2I] gate+up output).
Each is one launch on torch's current stream with no host read (graph-capturable); M may be any positive
number of rows.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .loader import _aligned, _empty, _i, _launch, _need, _on_one_gpu, _p

QA_ROWS, UV_ROWS, RS_ROWS = 4, 4, 8   # rows a block of q_absorb, uv_absorb, router_scores (decode_fused.cu)
SEL_MAX_E, SEL_MAX_K = 1024, 32      # router_select's limits
SEL_JS = (4, 8, 12, 16, 32)          # router_select_jJ builds: experts a lane holds (E <= 32 J)
NORM_CHUNKS = 4                      # add_rmsnorm: 8-wide chunks a thread keeps in registers (AN_CHUNKS)

_BF16 = (torch.bfloat16,)
_NULL = np.uint64(0)


def _norm_block(D: int) -> int:
    """add_rmsnorm's block: one 8-wide chunk a thread where D allows (a multiple of 32 threads, at most
    1024)."""
    return min(1024, -(-(D // 8) // 32) * 32)


def _f(v: float) -> np.float32:
    return np.float32(v)


def _rows(name: str, t: torch.Tensor, width: int | None = None) -> tuple[int, int]:
    _need(name, t, _BF16, ndim=2)
    M, W = t.shape
    if M == 0 or (width is not None and W != width):
        raise ValueError(f"{name}: expected a non-empty [M, {width if width is not None else 'D'}] tensor, "
                         f"got shape {tuple(t.shape)}")
    return M, W


def _eps(eps) -> float:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps={eps!r}: expected a positive finite float")
    return float(eps)


def add_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, routed: torch.Tensor | None = None,
                shared: torch.Tensor | None = None, delta: torch.Tensor | None = None):
    """x bf16 [M, D] (D % 8 == 0), w bf16 [D]; at most one of routed (fp32 [M, D], with optional shared bf16
    [M, D]) and delta (bf16 [M, D]). Returns (x_out, y) bf16 [M, D] (module docstring)."""
    M, D = _rows("x", x)
    if D % 8:
        raise ValueError(f"x: expected a row width that is a multiple of 8, got {D}")
    _need("w", w, _BF16, shape=(D,))
    if routed is not None and delta is not None:
        raise ValueError("add_rmsnorm: expected routed (with shared) or delta, not both")
    if shared is not None and routed is None:
        raise ValueError("add_rmsnorm: shared is added to routed: expected routed too")
    if routed is not None:
        _need("routed", routed, (torch.float32,), shape=(M, D))
    for name, t in (("shared", shared), ("delta", delta)):
        if t is not None:
            _need(name, t, _BF16, shape=(M, D))
    eps = _eps(eps)
    extra = {k: v for k, v in (("routed", routed), ("shared", shared), ("delta", delta)) if v is not None}
    _on_one_gpu(x=x, w=w, **extra)
    x_out = _empty(M, D, dtype=torch.bfloat16, device=x.device)
    y = _empty(M, D, dtype=torch.bfloat16, device=x.device)
    _aligned(x=x, w=w, **extra)
    null = _NULL
    _launch("decode_fused", "add_rmsnorm", (M,), (_norm_block(D),),
            (_p(x), _p(routed) if routed is not None else null, _p(shared) if shared is not None else null,
             _p(delta) if delta is not None else null, _p(w), _i(D), _f(eps), _p(x_out), _p(y)))
    return x_out, y


def _cos_sin(cos: torch.Tensor, sin: torch.Tensor, M: int, P: int) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        _need(name, t, _BF16, shape=(M, P // 2))


def mla_latent(qkv: torch.Tensor, wq: torch.Tensor | None, wkv: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, eps: float, interleave: bool,
               check_values: bool = True) -> torch.Tensor:
    """qkv bf16 [M, QL + R + P] (QL = wq's length, 0 when wq is None); wkv bf16 [R]; cos / sin bf16 [M, P/2];
    slots int64 [M] rows of pool bf16 [rows, R + P]. Returns q bf16 [M, QL]; writes pool[slots]."""
    M, W = _rows("qkv", qkv)
    _need("pool", pool, _BF16, ndim=2)
    R = wkv.shape[0] if isinstance(wkv, torch.Tensor) else -1
    _need("wkv", wkv, _BF16, shape=(R,))
    QL = 0
    if wq is not None:
        _need("wq", wq, _BF16, ndim=1)
        QL = wq.shape[0]
    P = pool.shape[1] - R
    if P <= 0 or P % 2 or QL + R + P != W:
        raise ValueError(f"qkv: expected [M, QL + R + P] = [M, {QL} + {R} + P] with pool rows of R + P "
                         f"({pool.shape[1]}) and P even, got shape {tuple(qkv.shape)}")
    _cos_sin(cos, sin, M, P)
    _need("slots", slots, (torch.int64,), shape=(M,))
    extra = {"wq": wq} if wq is not None else {}
    _on_one_gpu(qkv=qkv, wkv=wkv, cos=cos, sin=sin, slots=slots, pool=pool, **extra)
    if check_values:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= pool.shape[0]:
            raise ValueError(f"slots: expected pool rows in [0, {pool.shape[0]}), got [{lo}, {hi}]")
    eps = _eps(eps)
    q = _empty(M, QL, dtype=torch.bfloat16, device=qkv.device)
    _launch("decode_fused", "mla_latent", (M,), (512,),
            (_p(qkv), _i(QL), _i(R), _i(P), _p(wq) if wq is not None else _p(wkv), _p(wkv), _p(cos), _p(sin),
             _p(slots), _f(eps), _i(int(bool(interleave))), _p(q), _p(pool)))
    return q


def _wkvb(wkvb: torch.Tensor, Dn: int, R: int | None = None) -> tuple[int, int, int]:
    _need("wkvb", wkvb, _BF16, ndim=3)
    H, Dnv, Rw = wkvb.shape
    if R is not None and Rw != R:
        raise ValueError(f"wkvb: expected [H, Dn + Dv, {R}], got shape {tuple(wkvb.shape)}")
    if not 0 < Dn < Dnv or Rw % 256 or (Dnv - Dn) % 32:
        raise ValueError(f"wkvb: expected [H, Dn + Dv, R] with Dn={Dn} < Dn + Dv, Dv a multiple of 32 and R "
                         f"of 256, got shape {tuple(wkvb.shape)}")
    return H, Dnv - Dn, Rw


def q_absorb(qb: torch.Tensor, wkvb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, Dn: int,
             interleave: bool) -> torch.Tensor:
    """qb bf16 [M, H, Dn + P] (q_b_proj's output); wkvb bf16 [H, Dn + Dv, R]; cos / sin bf16 [M, P/2].
    Returns qk bf16 [M, H, R + P]."""
    _need("qb", qb, _BF16, ndim=3)
    M, H, Dq = qb.shape
    Hw, Dv, R = _wkvb(wkvb, Dn)
    P = Dq - Dn
    if M == 0 or Hw != H or P <= 0 or P % 2:
        raise ValueError(f"qb: expected [M, {Hw}, {Dn} + P] with M > 0 and P even, got shape "
                         f"{tuple(qb.shape)}")
    _cos_sin(cos, sin, M, P)
    _on_one_gpu(qb=qb, wkvb=wkvb, cos=cos, sin=sin)
    _aligned(wkvb=wkvb)
    qk = _empty(M, H, R + P, dtype=torch.bfloat16, device=qb.device)
    smem = (QA_ROWS * Dn + 8 * QA_ROWS * 256) * 4
    _launch("decode_fused", "q_absorb", (R // 256, H, -(-M // QA_ROWS)), (256,),
            (_p(qb), _p(wkvb), _p(cos), _p(sin), _i(M), _i(H), _i(Dn), _i(Dv), _i(R), _i(P),
             _i(int(bool(interleave))), _p(qk)), smem=smem)
    return qk


def uv_absorb(o_lat: torch.Tensor, wkvb: torch.Tensor, Dn: int) -> torch.Tensor:
    """o_lat bf16 [M, H, R] (verify_attn's output rows); wkvb bf16 [H, Dn + Dv, R]. Returns bf16
    [M, H * Dv]."""
    _need("o_lat", o_lat, _BF16, ndim=3)
    M, H, R = o_lat.shape
    Hw, Dv, _ = _wkvb(wkvb, Dn, R)
    if M == 0 or Hw != H:
        raise ValueError(f"o_lat: expected [M, {Hw}, {R}] with M > 0, got shape {tuple(o_lat.shape)}")
    _on_one_gpu(o_lat=o_lat, wkvb=wkvb)
    _aligned(wkvb=wkvb)
    out = _empty(M, H * Dv, dtype=torch.bfloat16, device=o_lat.device)
    _launch("decode_fused", "uv_absorb", (Dv // 32, H, -(-M // UV_ROWS)), (256,),
            (_p(o_lat), _p(wkvb), _i(M), _i(H), _i(Dn), _i(Dv), _i(R), _p(out)), smem=UV_ROWS * R * 4)
    return out


def router_scores(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x bf16 [M, D] (D % 8 == 0), w bf16 [E, D]. Returns sigmoid(x w^T) fp32 [M, E]."""
    M, D = _rows("x", x)
    if D % 8:
        raise ValueError(f"x: expected a row width that is a multiple of 8, got {D}")
    _need("w", w, _BF16, ndim=2)
    E = w.shape[0]
    if E == 0 or w.shape[1] != D:
        raise ValueError(f"w: expected [E, {D}] with E > 0, got shape {tuple(w.shape)}")
    _on_one_gpu(x=x, w=w)
    _aligned(x=x, w=w)
    scores = _empty(M, E, dtype=torch.float32, device=x.device)
    _launch("decode_fused", "router_scores", (E, -(-M // RS_ROWS)), (128,),
            (_p(x), _p(w), _i(M), _i(D), _i(E), _p(scores)))
    return scores


def router_select(scores: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, k: int, norm: bool,
                  scale: float):
    """scores fp32 [M, E] (E <= SEL_MAX_E), bias fp32 or bf16 [E] (the correction bias, added in fp32);
    k <= min(E, SEL_MAX_K); n_group divides E, at most 32, topk_group in [1, n_group]. Returns (weights fp32
    [M, k], ids int32 [M, k])."""
    _need("scores", scores, (torch.float32,), ndim=2)
    M, E = scores.shape
    if M == 0 or not 0 < E <= SEL_MAX_E:
        raise ValueError(f"scores: expected [M, E] with M > 0 and 0 < E <= {SEL_MAX_E}, got "
                         f"{tuple(scores.shape)}")
    _need("bias", bias, (torch.float32, torch.bfloat16), shape=(E,))
    for name, v, lo, hi in (("k", k, 1, min(E, SEL_MAX_K)), ("n_group", n_group, 1, 32),
                            ("topk_group", topk_group, 1, n_group if isinstance(n_group, int) else 1)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name}={v!r}: expected an int in [{lo}, {hi}]")
    if E % n_group:
        raise ValueError(f"n_group={n_group}: expected a divisor of the {E} experts")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale={scale!r}: expected a finite float")
    _on_one_gpu(scores=scores, bias=bias)
    w = _empty(M, k, dtype=torch.float32, device=scores.device)
    ids = _empty(M, k, dtype=torch.int32, device=scores.device)
    J = next(j for j in SEL_JS if E <= 32 * j)
    _launch("decode_fused", f"router_select_j{J}", (-(-M // 4),), (128,),
            (_p(scores), _p(bias), _i(int(bias.dtype == torch.bfloat16)), _i(M), _i(E), _i(n_group),
             _i(topk_group), _i(k), _i(int(bool(norm))), _f(scale), _p(w), _p(ids)))
    return w, ids


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g, u bf16 [M, I] (I % 8 == 0) with unit column stride and one row stride (ld, a multiple of 8), e.g.
    the halves gu[:, :I] and gu[:, I:] of a fused gate+up output, or two contiguous outputs. Returns bf16
    [M, I]."""
    for name, t in (("g", g), ("u", u)):
        _need(name, t, _BF16, ndim=2, contiguous=False)
    M, I = g.shape
    ld = g.stride(0)
    if M == 0 or I == 0 or I % 8 or u.shape != g.shape:
        raise ValueError(f"g, u: expected two [M, I] tensors with I a multiple of 8, got {tuple(g.shape)} "
                         f"and {tuple(u.shape)}")
    if g.stride(1) != 1 or u.stride(1) != 1 or u.stride(0) != ld or ld % 8 or ld < I:
        raise ValueError(f"g, u: expected unit column strides and one row stride, a multiple of 8, got "
                         f"{g.stride()} and {u.stride()}")
    _on_one_gpu(g=g, u=u)
    _aligned(g=g, u=u)
    out = _empty(M, I, dtype=torch.bfloat16, device=g.device)
    _launch("decode_fused", "silu_mul", (-(-M * I // 2048),), (256,),
            (_p(g), _p(u), _i(M), _i(I), _i(ld), _p(out)))
    return out
