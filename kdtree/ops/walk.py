"""Accept along the target's choices and compact the accepted KV rows (cuda/tree_walk.cu); golden twin:
walk_golden.

Contract:
  * tree_walk(tokens, parents, choice, max_accept): tokens, parents int32 [b, N] (verify-block layout, row 0
    the root), choice int32/int64 [b, N] (the target's token at every row), 1 <= max_accept <= 1024 ->
    (accepted int32 [b, max_accept] rows root first, -1 padded; acc_len int32 [b] root included; bonus int32
    [b] = choice at the last accepted row): walk_golden.walk per request. One launch, one warp a request.
  * kv_compact(cache, page_table, block_start, accepted, acc_len, page_size): in place, per request and layer,
    row block_start + j <- row block_start + accepted[j] for j < acc_len at once (walk_golden.compact_kv).
    cache bf16/fp16/fp32 [layers, rows, D] with rows a whole number of pages and D * itemsize a multiple of
    16; page_table int32 [b, max_pages]; block_start, acc_len int32 [b]; accepted int32 [b, A], strictly
    increasing rows. Dynamic shared memory A * D * itemsize. check_values=True reads the device to check
    page indices, acc_len and accepted (not for graph capture).
"""
from __future__ import annotations

import numpy as np
import torch

from .loader import PAGE_SIZE, _check_pages, _empty, _i, _launch, _need, _need_page_size, _on_one_gpu, _p
from .tree import MAX_DEPTH


def tree_walk(tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor,
              max_accept: int = MAX_DEPTH + 1):
    """Accept down the tree along the target's choices (walk_golden.walk), for a batch of verify blocks.

    tokens, parents int32 [b, N]; choice int32/int64 [b, N] (target argmax or per-row samples).
    Returns accepted int32 [b, max_accept] (rows, root first, -1 padded), acc_len int32 [b], bonus int32
    [b]."""
    _need("tokens", tokens, (torch.int32,), ndim=2)
    b, N = tokens.shape
    _need("parents", parents, (torch.int32,), shape=(b, N))
    _need("choice", choice, (torch.int32, torch.int64), shape=(b, N), contiguous=False)
    _on_one_gpu(tokens=tokens, parents=parents, choice=choice)
    if not 1 <= max_accept <= 1024:
        raise ValueError(f"max_accept={max_accept}: expected in [1, 1024]")
    ch = choice.to(torch.int32).contiguous()
    accepted = _empty(b, max_accept, dtype=torch.int32, device=tokens.device)
    acc_len = _empty(b, dtype=torch.int32, device=tokens.device)
    bonus = _empty(b, dtype=torch.int32, device=tokens.device)
    _launch("tree_walk", "tree_walk", (b,), (32,),
            (_p(tokens), _p(parents), _p(ch), _i(N), _i(max_accept), _p(accepted), _p(acc_len), _p(bonus)))
    return accepted, acc_len, bonus


def kv_compact(cache: torch.Tensor, page_table: torch.Tensor, block_start: torch.Tensor,
               accepted: torch.Tensor, acc_len: torch.Tensor, page_size: int = PAGE_SIZE,
               check_values: bool = True) -> None:
    """In place, per request and layer: row block_start + j <- row block_start + accepted[j], j < acc_len
    (walk_golden.compact_kv). cache [layers, rows, D] (rows = pages * page_size; D * itemsize a multiple of
    16)."""
    _need("cache", cache, (torch.bfloat16, torch.float16, torch.float32), ndim=3)
    _need_page_size(page_size)
    n_layers, rows, D = cache.shape
    row_bytes = D * cache.element_size()
    if row_bytes % 16:
        raise ValueError(f"cache: row of {row_bytes} bytes; expected a multiple of 16")
    if rows % page_size:
        raise ValueError(f"cache: {rows} rows is not a whole number of pages of {page_size}")
    _need("page_table", page_table, (torch.int32,), ndim=2)
    b, max_pages = page_table.shape
    _need("block_start", block_start, (torch.int32,), shape=(b,))
    _need("accepted", accepted, (torch.int32,), ndim=2)
    _need("acc_len", acc_len, (torch.int32,), shape=(b,))
    _on_one_gpu(cache=cache, page_table=page_table, block_start=block_start, accepted=accepted,
                acc_len=acc_len)
    _check_pages(page_table, rows // page_size, check_values)
    if accepted.shape[0] != b:
        raise ValueError(f"accepted: expected {b} rows (batch), got {accepted.shape[0]}")
    A = accepted.shape[1]
    if check_values:
        ln = acc_len.cpu()
        if int(ln.min()) < 0 or int(ln.max()) > A:
            raise ValueError(f"acc_len: expected values in [0, {A}]")
        acc = accepted.cpu()
        for i in range(b):
            a = acc[i, :int(ln[i])]
            if a.numel() and (int(a.min()) < 0 or (a.numel() > 1 and not bool((a[1:] > a[:-1]).all()))):
                raise ValueError(f"accepted[{i}]: expected strictly increasing rows >= 0")
            end = int(block_start[i]) + (int(a.max()) if a.numel() else 0)
            if end >= max_pages * page_size:
                raise ValueError(f"accepted[{i}]: row {end} is past the request's pages "
                                 f"({max_pages * page_size} rows)")
    _launch("tree_walk", "kv_compact", (b, n_layers), (128,),
            (_p(cache), np.int64(rows * row_bytes // 16), _i(row_bytes // 16), _p(page_table), _i(max_pages),
             _i(page_size), _p(block_start), _p(accepted), _i(A), _p(acc_len)), smem=A * row_bytes)
