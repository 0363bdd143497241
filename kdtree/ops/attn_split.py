"""Verify attention split at a page boundary, merged by log-sum-exp: the pieces of a prefix / rest cascade.

A request's keys are its `seq_len` cached rows, the N block rows last. Cut them at `prefix` rows (a whole
number of pages, at most seq_len - N): every block row sees all of the prefix, so the prefix half is one
non-causal pass (a library's paged attention planned on the host, for instance); the rest, the block
included, is verify_attn's usual problem over a page table shifted by prefix / page_size pages. Their
(out, lse) pairs merge into the whole's exactly (up to rounding):

    prefix = split_rows(committed, page_size)                       # host: rows known cached, page-aligned
    pt_rest, seq_rest = shift_pages(page_table, seq_len, prefix_rows, page_size)   # device, capturable
    o_rest, lse_rest = verify_attn(q, cache, pt_rest, seq_rest, mask, scale)
    o, lse = merge_lse(o_prefix, lse_prefix, o_rest, lse_rest)       # natural-log lse on both sides

Golden: verify_attn_golden.prefix_attention and mla_tree_attention over the two halves, merged, equal
mla_tree_attention over the whole (tests/test_attn_split.py).
"""
from __future__ import annotations

import math

import torch

from .. import checks

LN2 = math.log(2.0)


def split_rows(committed, page_size: int) -> list[int]:
    """Per request, the rows before the cut: its committed rows (known cached when the round launches,
    host ints >= 0) rounded down to whole pages of page_size."""
    page_size = checks.int_in("page_size", page_size, 1, 1 << 20)
    if not isinstance(committed, (list, tuple)):
        raise ValueError(f"committed: expected a list of ints (rows per request), got "
                         f"{type(committed).__name__}")
    out = []
    for i, n in enumerate(committed):
        n = checks.int_in(f"committed[{i}]", n, 0, 1 << 40)
        out.append(n // page_size * page_size)
    return out


def shift_pages(page_table: torch.Tensor, seq_len: torch.Tensor, prefix: torch.Tensor, page_size: int,
                check_values: bool = False):
    """The rest's page table and lengths: page_table int32 [b, P], seq_len int32 [b], prefix int [b] on the
    same device (whole pages, prefix <= seq_len - N: the caller's contract, not read back here) ->
    (int32 [b, P] whose page j is page_table's page j + prefix / page_size, the tail past P repeating its
    last page (never read: seq_rest ends before it), seq_rest int32 [b] = seq_len - prefix). No host reads
    (capturable in a CUDA graph) unless check_values, which reads prefix to check it is whole pages within
    [0, seq_len]."""
    page_size = checks.int_in("page_size", page_size, 1, 1 << 20)
    if page_table.dim() != 2 or page_table.dtype != torch.int32:
        raise ValueError(f"page_table: expected int32 [b, P], got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    b, P = page_table.shape
    for name, t in (("seq_len", seq_len), ("prefix", prefix)):
        if t.shape != (b,) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor [{b}], got {t.dtype} {tuple(t.shape)}")
        if t.device != page_table.device:
            raise ValueError(f"{name}: on {t.device}, page_table on {page_table.device}")
    if check_values:
        pre, seq = prefix.long().cpu(), seq_len.long().cpu()
        if bool((pre % page_size).any()) or bool((pre < 0).any()) or bool((pre > seq).any()):
            raise ValueError(f"prefix: expected whole pages of {page_size} within [0, seq_len], got "
                             f"{pre.tolist()} (seq_len {seq.tolist()})")
    first = prefix.long() // page_size                                                   # [b]
    idx = (first[:, None] + torch.arange(P, device=page_table.device)).clamp_max(P - 1)  # [b, P]
    return page_table.gather(1, idx), (seq_len.long() - prefix.long()).to(torch.int32)


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Attention over two disjoint key sets merged: o [..., D] normalised over its set, lse [...] its
    natural-log log-sum-exp (-inf for an empty set, whose o is ignored, even where it is NaN). Computed in
    float32 (float64 for float64 inputs). Returns (o [..., D] in o2's dtype, lse [...] in the computing
    dtype). Base-2 lse (FlashInfer's default) must be multiplied by ln 2 first (`lse2_to_ln`)."""
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(f"merge_lse: expected o1, o2 [..., D] and lse1, lse2 [...] of one shape, got "
                         f"{tuple(o1.shape)}, {tuple(o2.shape)}, {tuple(lse1.shape)}, {tuple(lse2.shape)}")
    dt = torch.float32
    for t in (o1, lse1, o2, lse2):
        dt = torch.promote_types(dt, t.dtype)
    l1, l2 = lse1.to(dt), lse2.to(dt)
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)        # both empty: weights 0, not NaN
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)                  # exp(-inf) = 0 for an empty set
    den = w1 + w2
    zero = torch.zeros((), dtype=dt, device=o1.device)   # an empty set's o may hold anything, NaN included
    o = (torch.where(w1[..., None] > 0, o1.to(dt) * w1[..., None], zero)
         + torch.where(w2[..., None] > 0, o2.to(dt) * w2[..., None], zero)) / den.clamp_min(1e-30)[..., None]
    return o.to(o2.dtype), m + torch.log(den)


def lse2_to_ln(lse: torch.Tensor) -> torch.Tensor:
    """A base-2 log-sum-exp (FlashInfer's return_lse) in natural log."""
    return lse.float() * LN2
