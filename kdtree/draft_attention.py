"""The DFlash drafter's attention: DraftAttention (one drafter layer's non-causal attention of a block over
[context ; block]) and the choice among its implementations over the engine's preallocated context.

    DraftAttention(args).kv(x, cos, sin) -> k, v [B, Hk, T, hd]          context keys/values of states x
    DraftAttention(args)(x, cos, sin, ctx_k, ctx_v, mask=None)          the session's and training's pass
    DraftAttention(args).forward_buffered(x, cos, sin, kbuf, vbuf, ctx_len, C, impl)   the engine's pass
    draft_attn_auto(device, dtype, batch, kv_heads, rows, head_dim) -> one of "kernel", "math", "sdpa"

impl is one of DRAFT_ATTN_IMPLS. "auto" decides by `draft_attn_auto` at every call, which reads this
module's flags then: KERNEL_AUTO (take the split-KV kernel where it fits), SDPA_MIN_BLOCKS (the smallest grid
of torch's fused attention worth taking over the batched-GEMM form) and _HAVE_CUPY (the kernel's launcher is
installed). kdtree.drafter hands these names on: setting or reading `kdtree.drafter.KERNEL_AUTO` (and the
other two) sets or reads them here.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from .drafter_args import DrafterArgs
from .layers import RMSNorm, apply_rope
from .ops.draft_attn import HEAD_DIM as DRAFT_HEAD_DIM
from .ops.draft_attn import MAX_ROWS as DRAFT_MAX_ROWS
from .ops.draft_attn import draft_attn as _draft_attn_op

DRAFT_ATTN_IMPLS = ("auto", "kernel", "math", "sdpa")
SDPA_MIN_BLOCKS = 16   # "auto": below this many blocks of torch's fused attention, the batched-GEMM form
_HAVE_CUPY = importlib.util.find_spec("cupy") is not None  # the kernels' launcher is installed
KERNEL_AUTO = True    # impl "auto" takes "kernel" (where it fits) only when set; by name it always runs


class DraftAttention(nn.Module):
    def __init__(self, a: DrafterArgs):
        super().__init__()
        self.a = a
        D, H, Hk, hd = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.k_proj = nn.Linear(D, Hk * hd, bias=False)
        self.v_proj = nn.Linear(D, Hk * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, a.rms_norm_eps)
        self.k_norm = RMSNorm(hd, a.rms_norm_eps)

    def kv(self, x, cos, sin):
        """x [B, T, D] -> k, v [B, Hk, T, hd] (k normed and rotated)."""
        B, T, _ = x.shape
        a = self.a
        k = self.k_norm(self.k_proj(x).view(B, T, a.num_key_value_heads, a.head_dim))
        k = apply_rope(k, cos[:, :, None], sin[:, :, None], interleave=False)
        v = self.v_proj(x).view(B, T, a.num_key_value_heads, a.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        """x [B, T, D] block states; ctx_k/ctx_v [B, Hk, C, hd] cached context. Non-causal; mask (optional,
        bool [B or 1, 1, T, C + T]: query row sees key column) for several blocks in one pass (training)."""
        a = self.a
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, a.num_attention_heads, a.head_dim))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None], interleave=False).transpose(1, 2)  # [B, H, T, hd]
        k, v = self.kv(x, cos, sin)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        rep = a.num_attention_heads // a.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)  # [B, H, T, hd]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def forward_buffered(self, x, cos, sin, kbuf, vbuf, ctx_len, C: int, impl: str = "auto"):
        """The drafting pass over a preallocated context (the engine's, graph-capturable): x [B, T, D] block
        states; kbuf/vbuf [B, Hk, C + T, hd], columns [0, ctx_len[b]) request b's context, columns [C, C + T)
        this pass's block (written here); ctx_len int [B]. Same result as forward(x, cos, sin, ctx_k, ctx_v)
        (query head h reads KV head h // (H / Hk)); with DFlashDrafter.prepare_buffered's fused weight, q, k
        and v come from one GEMM. impl: "kernel" (kdtree.ops.draft_attn: a split-KV kernel that reads only
        each request's ctx_len + T live columns, ctx_len on the device; bf16 on a CUDA device, head_dim 128,
        G * T <= 64), "math" (scores as one batched GEMM over every column, masked softmax, a second GEMM:
        parallel over the columns, so a few query rows over a long context keep the GPU busy) or "sdpa"
        (torch's fused attention: its grid is B x Hk x row tiles of 64, a handful of blocks at batch 1, each
        streaming the whole context), or "auto" (`draft_attn_auto`: kernel where it fits and KERNEL_AUTO is
        set, else math while sdpa's grid would be under SDPA_MIN_BLOCKS blocks, and always in float32:
        torch's fused float32 kernel runs without tensor cores; python -m kdtree.bench.drafter measures
        them)."""
        a = self.a
        B, T, _ = x.shape
        H, Hk, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        if getattr(self, "qkv", None) is not None:
            q, k, v = F.linear(x, self.qkv).split([H * hd, Hk * hd, Hk * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(B, T, H, hd))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None], interleave=False).transpose(1, 2)  # [B, H, T, hd]
        k = apply_rope(self.k_norm(k.view(B, T, Hk, hd)), cos[:, :, None], sin[:, :, None], interleave=False)
        kbuf[:, :, C:C + T] = k.transpose(1, 2)
        vbuf[:, :, C:C + T] = v.view(B, T, Hk, hd).transpose(1, 2)
        # the G = H / Hk query heads of a KV head as G * T query rows of it: K/V are never repeated
        G = H // Hk
        q = q.reshape(B, Hk, G * T, hd)
        if impl == "auto":
            impl = draft_attn_auto(kbuf.device, kbuf.dtype, B, Hk, G * T, hd)
        if impl == "kernel":
            o = _draft_attn_kernel(q.contiguous(), kbuf, vbuf, ctx_len.to(torch.int32), C, hd ** -0.5)
            return self.o_proj(o.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, -1))
        col = torch.arange(C + T, device=x.device)
        seen = (col[None] < ctx_len[:, None]) | (col[None] >= C)                               # [B, C + T]
        if impl == "math":
            s = (q @ kbuf.transpose(-1, -2)).float() * hd ** -0.5                        # [B, Hk, G*T, C+T]
            p = s.masked_fill(~seen[:, None, None, :], float("-inf")).softmax(-1)
            o = p.to(vbuf.dtype) @ vbuf                                                 # [B, Hk, G*T, hd]
        elif impl == "sdpa":
            o = F.scaled_dot_product_attention(q, kbuf, vbuf, attn_mask=seen[:, None, None, :])
        else:
            raise ValueError(f"impl={impl!r}: expected one of {DRAFT_ATTN_IMPLS}")
        return self.o_proj(o.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, -1))


@torch.compiler.disable
def _draft_attn_kernel(q, kbuf, vbuf, ctx_len, C: int, scale: float) -> torch.Tensor:
    """kdtree.ops.draft_attn.draft_attn with no host reads (check_values=False: graph-capturable), run outside
    torch.compile's graphs (dynamo must not trace the launch plumbing)."""
    return _draft_attn_op(q, kbuf, vbuf, ctx_len, C, scale, check_values=False)


def draft_attn_kernel_fits(device: torch.device, dtype: torch.dtype, head_dim: int, rows: int,
                           have_cupy: bool | None = None) -> bool:
    """impl "auto"'s first choice: the split-KV kernel (kdtree.ops.draft_attn) for bfloat16 buffers on a CUDA
    device, head_dim 128 and at most 64 query rows per KV head (G * T), where CuPy is installed (have_cupy:
    that condition given, e.g. for a GPU record read on another machine)."""
    cupy_ok = _HAVE_CUPY if have_cupy is None else have_cupy
    return (torch.device(device).type == "cuda" and dtype == torch.bfloat16 and head_dim == DRAFT_HEAD_DIM
            and rows <= DRAFT_MAX_ROWS and cupy_ok)


def draft_attn_auto(device, dtype: torch.dtype, batch: int, kv_heads: int, rows: int, head_dim: int,
                    have_cupy: bool | None = None) -> str:
    """The impl "auto" takes: "kernel" where KERNEL_AUTO is set and `draft_attn_kernel_fits`, else "math"
    where `draft_attn_math`, else "sdpa"."""
    if KERNEL_AUTO and draft_attn_kernel_fits(device, dtype, head_dim, rows, have_cupy):
        return "kernel"
    return "math" if draft_attn_math(batch, kv_heads, rows, dtype) else "sdpa"


def draft_attn_math(batch: int, kv_heads: int, rows: int, dtype: torch.dtype) -> bool:
    """impl "auto"'s choice where the kernel does not fit: the batched-GEMM form ("math") for float32, or
    while torch's fused attention would run fewer than SDPA_MIN_BLOCKS blocks (batch x KV heads x tiles of 64
    query rows)."""
    return dtype == torch.float32 or batch * kv_heads * -(-rows // 64) < SDPA_MIN_BLOCKS
