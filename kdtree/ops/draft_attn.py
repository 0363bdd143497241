"""The drafter's GQA attention over the engine's preallocated context (cuda/draft_attn.cu); golden twin:
draft_attn_golden.

Contract of draft_attn(q, kbuf, vbuf, ctx_len, C, scale, ...):
  q bf16 [b, Hk, R, 128]: KV head h's query rows (its G query heads x the T block rows), 1 <= R <= MAX_ROWS;
  kbuf, vbuf bf16 [b, Hk, C + T, 128], contiguous, T >= 1: request i's visible columns are [0, ctx_len[i])
  (its context) and [C, C + T) (the block); every other column is never read (its values do not matter);
  ctx_len int32 [b] with 0 <= ctx_len <= C, read on the device; scale a positive finite float.
  Returns out bf16 [b, Hk, R, 128]: softmax(scale q k^T over the visible columns) v
  (draft_attn_golden.draft_attention).
  Two launches, no host reads unless check_values (graph-capturable with check_values=False, the grid fixed by
  the shapes): draft_attn_partial over (n_splits, Hk, b) blocks of 128 threads, each reading one split of the
  request's ctx_len + T live columns (splits past them write an empty partial), into fp32 workspaces; then
  draft_attn_combine over (ceil(R / 4), Hk, b). n_splits <= MAX_SPLITS (default_splits when None).
Constants shared with draft_attn.cu: HEAD_DIM, MAX_ROWS, KEYS, MAX_SPLITS (its DRAFT_MAX_SPLITS), DRAFT_SMEM.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .. import checks
from .loader import _empty, _i, _launch, _need, _on_one_gpu, _p, _sm_count

HEAD_DIM = 128     # the kernel's head dim
MAX_ROWS = 64      # query rows a KV head (G * T): one block's 4 warps x 16
KEYS = 64          # keys a tile
MAX_SPLITS = 128   # context splits per (request, KV head): draft_attn.cu's DRAFT_MAX_SPLITS
DRAFT_SMEM = 64 * 136 * 2 + 4 * 64 * 136 * 2  # draft_attn_partial's dynamic shared memory: Q, 2 x (K, V)
SPLIT_BLOCKS_PER_SM = 2  # default_splits' target of partial blocks a multiprocessor


@functools.lru_cache(maxsize=1024)
def default_splits(batch: int, kv_heads: int, columns: int, sms: int = 132) -> int:
    """Context splits per (request, KV head) when draft_attn's n_splits is None: enough partial blocks
    (batch x kv_heads x splits) for SPLIT_BLOCKS_PER_SM a multiprocessor, ceil(SPLIT_BLOCKS_PER_SM x sms /
    (batch x kv_heads)), but no more than the KEYS-key tiles of the columns a request holds (C + T, its
    capacity: the shapes alone fix the grid) nor MAX_SPLITS, and at least 1. The splits divide each request's
    live columns on the device, so a short context runs in fewer of them."""
    want = math.ceil(SPLIT_BLOCKS_PER_SM * sms / max(1, batch * kv_heads))
    return max(1, min(want, math.ceil(columns / KEYS), MAX_SPLITS))


def draft_attn(q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, ctx_len: torch.Tensor, C: int,
               scale: float, n_splits: int | None = None, check_values: bool = True) -> torch.Tensor:
    """GQA attention of q [b, Hk, R, 128] over kbuf/vbuf [b, Hk, C + T, 128] (bf16), request i seeing columns
    [0, ctx_len[i]) and [C, C + T) (draft_attn_golden.draft_attention). ctx_len int32 [b] in [0, C]; scale:
    the softmax scale. check_values: read ctx_len on the host to check its range (False under CUDA-graph
    capture). n_splits: context splits per (request, KV head), default_splits when None. Returns out bf16
    [b, Hk, R, 128]."""
    if n_splits is not None:
        n_splits = checks.int_in("n_splits", n_splits, 1, MAX_SPLITS, " (or None)")
    _need("q", q, (torch.bfloat16,), ndim=4)
    b, Hk, R, hd = q.shape
    if hd != HEAD_DIM:
        raise ValueError(f"q: expected head dim {HEAD_DIM}, got {hd}")
    if not 1 <= R <= MAX_ROWS:
        raise ValueError(f"q: expected 1 to {MAX_ROWS} query rows per KV head (G * T), got {R}")
    if min(b, Hk) == 0:
        raise ValueError(f"q: expected a non-empty [b, Hk, R, {HEAD_DIM}] tensor, got shape {tuple(q.shape)}")
    _need("kbuf", kbuf, (torch.bfloat16,), shape=(b, Hk, None, HEAD_DIM))
    S = kbuf.shape[2]
    _need("vbuf", vbuf, (torch.bfloat16,), shape=(b, Hk, S, HEAD_DIM))
    _need("ctx_len", ctx_len, (torch.int32,), shape=(b,))
    if S < 1:
        raise ValueError(f"kbuf: expected C + T columns with T >= 1, got shape {tuple(kbuf.shape)}")
    C = checks.int_in("C", C, 0, S - 1, f" (kbuf holds C + T = {S} columns, T >= 1)")
    if not (checks.is_number(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: expected a positive finite float")
    _on_one_gpu(q=q, kbuf=kbuf, vbuf=vbuf, ctx_len=ctx_len)
    if check_values:
        lo, hi = int(ctx_len.min()), int(ctx_len.max())
        if lo < 0 or hi > C:
            raise ValueError(f"ctx_len: expected values in [0, C={C}], got [{lo}, {hi}]")
    T = S - C
    if n_splits is None:
        n_splits = default_splits(b, Hk, S, _sm_count(q.device))
    dev = q.device
    ws_o = _empty(n_splits, b, Hk, R, HEAD_DIM, dtype=torch.float32, device=dev)
    ws_ml = _empty(n_splits, b, Hk, R, 2, dtype=torch.float32, device=dev)
    out = _empty(b, Hk, R, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    _launch("draft_attn", "draft_attn_partial", (n_splits, Hk, b), (128,),
            (_p(q), _p(kbuf), _p(vbuf), _p(ctx_len), _i(C), _i(T), _i(R),
             np.float32(scale * math.log2(math.e)), _p(ws_o), _p(ws_ml)), smem=DRAFT_SMEM)
    _launch("draft_attn", "draft_attn_combine", (math.ceil(R / 4), Hk, b), (128,),
            (_p(ws_o), _p(ws_ml), _i(n_splits), _i(R), _p(out)))
    return out
