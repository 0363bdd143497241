"""Small modules of the MLA + MoE model: RMSNorm, the rotary embedding (YaRN-scaled), and two helpers the
layers share (`_launch`: a kernel call outside torch.compile's graphs; `_refresh`: a derived weight kept
across calls)."""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelArgs, yarn_mscale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] and the cos/sin magnitude factor (YaRN's attention factor)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if args.rope_scaling is None:
        return 1.0 / pos_freqs, 1.0
    rs = args.rope_scaling
    factor = float(rs["factor"])
    orig = rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(n_rot: float) -> float:
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp  # 1 -> keep the original frequency, 0 -> interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all:
        attn_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    else:
        attn_factor = yarn_mscale(factor)
    return inv_freq, float(attn_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [..., P] by angles given as cos/sin [..., P/2] (broadcast over heads by the caller).

    Interleaved (DeepSeek's storage): pairs (x[2i], x[2i+1]); the output is de-interleaved
    [x_even*c - x_odd*s, x_odd*c + x_even*s], the same layout for queries and keys, so dot products
    are those of the interleaved rotation.
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.compiler.disable
def _launch(fn, *args, **kw):
    """A kdtree.kernels call (CuPy launches on torch's stream) run outside torch.compile's graphs: dynamo must
    not trace the launch plumbing; the compiled code around it stays compiled."""
    return fn(*args, **kw)


def kernel_attention(qk: torch.Tensor, pool: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """MLA attention of attn_impl "kernel" over one layer's paged cache: qk bf16 [B, T, H, 576] (absorbed
    latent + rope), pool bf16 [rows, 576] -> o bf16 [B, T, H, 512]. verify_attn over meta's pages; with
    meta.prefix (AttnMeta.with_prefix) the prefix pass over each request's first rows and verify_attn over
    the rest, merged by log-sum-exp in one launch (ops.attn_merge; both lse in natural log); with
    meta.prefix_whole (AttnMeta.with_whole) the pass alone."""
    from . import kernels
    if meta.prefix is None:
        o, _ = _launch(kernels.verify_attn, qk, pool, meta.page_table, meta.seq_len, meta.mask_words, scale,
                       page_size=meta.page_size, check_values=False, max_seq_len=meta.kv_cap)
        return o
    if meta.prefix_whole:   # AttnMeta.with_whole: the pass sees every key
        return _launch(meta.prefix.run, qk, pool, lse=False)[0]
    from .ops.attn_merge import merge_states
    o_pre, lse_pre = _launch(meta.prefix.run, qk, pool)                          # [B, T, H, 512], [B, T, H]
    o_rest, lse_rest = _launch(kernels.verify_attn, qk, pool, meta.rest_page_table, meta.rest_seq_len,
                               meta.mask_words, scale, page_size=meta.page_size, check_values=False,
                               max_seq_len=meta.kv_cap)
    return _launch(merge_states, o_pre, lse_pre, o_rest, lse_rest)[0]


def _refresh(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """A derived weight kept across calls: `new` copied into `old` when it can hold it (same shape, dtype and
    device: memory a captured CUDA graph may read stays valid), else `new` itself. Returns the kept tensor."""
    new = new.detach()
    if old is not None and old.shape == new.shape and old.dtype == new.dtype and old.device == new.device:
        return old.copy_(new)
    return new.contiguous()
