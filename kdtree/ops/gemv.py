"""Skinny bf16 GEMMs for decode (cuda/gemv.cu); golden twin: gemv_golden.

Contract of gemv(x, w): x bf16 [M, K] (K % 8 == 0), w bf16 [N, K] (nn.Linear's weight), both contiguous with
16-byte aligned starts, on the current CUDA device -> y bf16 [M, N] = x w^T with fp32 products and sums (what
F.linear computes, summed in another order). One launch of gemv_bf16 over (ceil(N / 8), ceil(M / GEMV_ROWS))
blocks: W is read once per GEMV_ROWS rows of x, so it serves decode's few rows (M <= GEMV_MAX_ROWS), where
cuBLAS's kernels are not built to stream small matrices at the copy rate.
"""
from __future__ import annotations

import torch

from .loader import _aligned, _empty, _i, _launch, _need, _on_one_gpu, _p

GEMV_ROWS, GEMV_CHUNK = 8, 2048   # gemv.cu: x rows a block, x columns staged at a time
GEMV_MAX_ROWS = 16                # rows up to which the kernel is meant to be used (two passes over W)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x bf16 [M, K], w bf16 [N, K] -> bf16 [M, N] (module docstring)."""
    _need("x", x, (torch.bfloat16,), ndim=2)
    _need("w", w, (torch.bfloat16,), ndim=2)
    M, K = x.shape
    N = w.shape[0]
    if M == 0 or K == 0 or K % 8:
        raise ValueError(f"x: expected a non-empty [M, K] with K a multiple of 8, got {tuple(x.shape)}")
    if N == 0 or w.shape[1] != K:
        raise ValueError(f"w: expected [N, {K}] with N > 0, got {tuple(w.shape)}")
    _on_one_gpu(x=x, w=w)
    _aligned(x=x, w=w)
    y = _empty(M, N, dtype=torch.bfloat16, device=x.device)
    _launch("gemv", "gemv_bf16", (-(-N // 8), -(-M // GEMV_ROWS)), (256,),
            (_p(x), _p(w), _i(M), _i(N), _i(K), _p(y)), smem=GEMV_ROWS * GEMV_CHUNK * 2)
    return y
