"""MLA tree-verify attention and its split combine (cuda/verify_attn.cu); golden twin: verify_attn_golden.

Contract of verify_attn(q, cache, page_table, seq_len, mask, scale, ...):
  q bf16 [b, N, H, D_QK] (512 latent + 64 rope); cache bf16 [rows, D_QK] (one layer, paged, rows a whole
  number of pages of page_size); page_table int32 [b, max_pages]; seq_len int32 [b] with
  N <= seq_len <= pages x page_size (cached rows including the N appended ones); mask bool [b, N, N] (diagonal
  True) or pack_mask's int32 words [b, N, ceil(N / 32)] over the appended block; scale a positive finite
  float.
  Returns out bf16 [b, N, H, D_V] and lse fp32 [b, N, H] (natural log): verify_attn_golden.mla_tree_attention.
  Two launches: the partial kernel of `impl` over (splits, ceil(N H / 64), b) blocks of 256 threads into fp32
  workspaces, then verify_attn_combine over (N H, b). n_splits <= MAX_SPLITS (default_splits when None).
  impl "wgmma" / "ws" need a compute capability 9.0 GPU (the sm_90a build); "mma" runs on sm_80 and later.
Constants shared with verify_attn.cu: D_QK, D_V, MAX_SPLITS and each kernel's dynamic shared memory
(_VERIFY_KERNELS).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .. import checks
from .loader import (PAGE_SIZE, _check_pages, _empty, _i, _launch, _need, _need_page_size, _on_one_gpu, _p,
                     _sm90, _sm_count)

D_QK, D_V = 576, 512


# dynamic shared memory of each partial kernel (verify_attn.cu's layouts)
VERIFY_SMEM = 64 * 584 * 2 + 2 * 32 * 584 * 2 + 64 * 40 * 2 + 4 * 64 * 4
VERIFY_WG_SMEM = 1024 + 3 * 9 * 8192 + 8192 + 3 * 64 * 4  # verify_attn_wg: slack, Q, 2 K/V tiles, P, rows
VERIFY_WS_SMEM = 1024 + 9 * 8192 + 4 * 9 * 4096 + 8192 + 64 * 4 + 16 * 8  # verify_attn_ws: + stages, barriers
# verify_attn_wg (Hopper), verify_attn_ws (Hopper, warp-specialized), verify_attn_partial (mma.sync, sm_80+)
VERIFY_IMPLS = ("wgmma", "ws", "mma")
_VERIFY_KERNELS = {  # impl -> (kernel, dynamic shared memory, keys a tile)
    "wgmma": ("verify_attn_wg", VERIFY_WG_SMEM, 64), "ws": ("verify_attn_ws", VERIFY_WS_SMEM, 32),
    "mma": ("verify_attn_partial", VERIFY_SMEM, 32)}


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [b, N, N] -> int32 bit words [b, N, ceil(N / 32)] (bit j % 32 of word j // 32)."""
    b, N, _ = mask.shape
    W = (N + 31) // 32
    m = torch.zeros(b, N, W * 32, dtype=torch.int64, device=mask.device)
    m[:, :, :N] = mask.to(torch.int64)
    weights = (1 << torch.arange(32, device=mask.device, dtype=torch.int64))
    words = (m.view(b, N, W, 32) * weights).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


MAX_SPLITS = 128  # context splits per (request, 64-row block): verify_attn.cu's MAX_SPLITS (combine's)


@functools.lru_cache(maxsize=1024)  # a Python search over up to MAX_SPLITS candidates
def default_splits(b: int, NH: int, max_keys: int, sms: int = 132, tile: int = 32) -> int:
    """Context splits per (request, 64-row block) minimising the time in units of one tile's load (~72 KB a
    block): rounds of blocks (one per SM at a time; a partial last round costs a whole one) x (tiles per split
    + 1 for the Q load and start), plus the combine's reading of the splits' fp32 partials (2 KB per split and
    query row, spread over the SMs); at least one tile a split; fewer splits on a tie. E.g. 64 row blocks on
    132 SMs: 2 splits (128 blocks, one round), not 3 (192 blocks, two rounds); one row block (a decode step
    of 64 heads) over 64 tiles: 64 splits of one tile. The kernels spread the live keys over the splits, so
    splits sized for a cache's capacity serve a shorter context with one tile or more each."""
    blocks = b * math.ceil(NH / 64)
    tiles = math.ceil(max_keys / tile)
    best = None
    for s in range(1, min(MAX_SPLITS, tiles) + 1):
        cost = math.ceil(blocks * s / sms) * (math.ceil(tiles / s) + 1)
        if s > 1:
            cost += s * b * NH * 2048 / (sms * 73728)
        if best is None or cost < best[0]:
            best = (cost, s)
    return best[1]


def available_verify_impls() -> tuple[str, ...]:
    """The verify_attn kernels this GPU runs: all of VERIFY_IMPLS on compute capability 9.0, else only
    'mma'."""
    return VERIFY_IMPLS if _sm90() else ("mma",)


def default_verify_impl() -> str:
    """verify_attn's kernel when impl is None: the warpgroup-MMA kernel on Hopper, the mma.sync kernel
    elsewhere."""
    return "wgmma" if _sm90() else "mma"


def verify_attn(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_len: torch.Tensor,
                mask: torch.Tensor, scale: float, page_size: int = PAGE_SIZE, n_splits: int | None = None,
                check_values: bool = True, impl: str | None = None, max_seq_len: int | None = None):
    """MLA-absorb tree-verify attention (verify_attn_golden.mla_tree_attention).

    q bf16 [b, N, H, 576]; cache bf16 [rows, 576] (one layer, paged); page_table int32 [b, max_pages];
    seq_len int32 [b] (cached rows including the N appended ones); mask: bool [b, N, N] or packed int32
    words [b, N, ceil(N/32)] over the appended block; scale: softmax scale (YaRN mscale included).
    impl: "wgmma" (Hopper's warpgroup MMA, tiles of 64 keys), "ws" (warpgroup MMA, warp-specialized over a
    4-stage ring of 32-key tiles) or "mma" (mma.sync, tiles of 32); None takes "wgmma" on a compute
    capability 9.0 GPU, else "mma". max_seq_len: a bound on seq_len known on the host (a caller's cache
    length), which sizes the context splits; without it they are sized for seq_len's maximum when
    check_values, else for the page table's capacity (splits past a shorter context cost a little each).
    Returns out bf16 [b, N, H, 512], lse fp32 [b, N, H]."""
    if impl is not None and impl not in VERIFY_IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {VERIFY_IMPLS} or None")
    if n_splits is not None:
        n_splits = checks.int_in("n_splits", n_splits, 1, MAX_SPLITS, " (or None)")
    _need("q", q, (torch.bfloat16,), ndim=4)
    b, N, H, Dq = q.shape
    if Dq != D_QK:
        raise ValueError(f"q: expected head dim {D_QK} (512 latent + 64 rope), got {Dq}")
    if min(b, N, H) == 0:
        raise ValueError(f"q: expected a non-empty [b, N, H, {D_QK}] tensor, got shape {tuple(q.shape)}")
    _need_page_size(page_size)
    _need("cache", cache, (torch.bfloat16,), ndim=2)
    if cache.shape[1] != D_QK:
        raise ValueError(f"cache: expected rows of {D_QK}, got shape {tuple(cache.shape)}")
    if cache.shape[0] % page_size:
        raise ValueError(f"cache: {cache.shape[0]} rows is not a whole number of pages of {page_size}")
    _need("page_table", page_table, (torch.int32,), ndim=2)
    if page_table.shape[0] != b:
        raise ValueError(f"page_table: expected {b} rows (batch), got {page_table.shape[0]}")
    _need("seq_len", seq_len, (torch.int32,), shape=(b,))
    W = (N + 31) // 32
    if mask.dtype == torch.bool:
        _need("mask", mask, (torch.bool,), shape=(b, N, N), contiguous=False)
    else:
        _need("mask", mask, (torch.int32,), shape=(b, N, W))
    max_keys = page_table.shape[1] * page_size
    keys = max_keys  # what the context splits are sized for
    if max_seq_len is not None:
        keys = checks.int_in("max_seq_len", max_seq_len, N, max_keys, f" (N={N} to pages x page_size)")
    _on_one_gpu(q=q, cache=cache, page_table=page_table, seq_len=seq_len, mask=mask)
    _check_pages(page_table, cache.shape[0] // page_size, check_values)
    if mask.dtype == torch.bool:
        if check_values and not bool(mask.diagonal(dim1=1, dim2=2).all()):
            raise ValueError("mask: every appended row must see itself (the diagonal must be True)")
        mask = pack_mask(mask)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: expected a positive finite float")
    if check_values:
        lo, hi = int(seq_len.min()), int(seq_len.max())
        if lo < N or hi > keys:
            what = "max_seq_len" if max_seq_len is not None else "pages x page_size"
            raise ValueError(f"seq_len: expected values in [N={N}, {keys}] ({what}), got [{lo}, {hi}]")
        keys = hi
    NH = N * H
    if impl is None:
        impl = default_verify_impl()
    elif impl != "mma" and not _sm90():
        raise ValueError(f'impl="{impl}": needs a compute capability 9.0 GPU (Hopper); use impl="mma"')
    name, smem, tile = _VERIFY_KERNELS[impl]
    if n_splits is None:
        n_splits = default_splits(b, NH, keys, _sm_count(q.device), tile)
    dev = q.device
    ws_o = _empty(n_splits, b, NH, D_V, dtype=torch.float32, device=dev)
    ws_ml = _empty(n_splits, b, NH, 2, dtype=torch.float32, device=dev)
    out = _empty(b, N, H, D_V, dtype=torch.bfloat16, device=dev)
    lse = _empty(b, N, H, dtype=torch.float32, device=dev)
    _launch("verify_attn", name, (n_splits, math.ceil(NH / 64), b), (256,),
            (_p(q), _p(cache), _p(page_table), _i(page_table.shape[1]), _i(page_size), _p(seq_len), _p(mask),
             _i(N), _i(H), np.float32(scale * math.log2(math.e)), _p(ws_o), _p(ws_ml)), smem=smem)
    _launch("verify_attn", "verify_attn_combine", (NH, b), (128,),
            (_p(ws_o), _p(ws_ml), _i(n_splits), _i(NH), _p(out), _p(lse)))
    return out, lse
