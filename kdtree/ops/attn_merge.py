"""Two attention passes over disjoint key sets merged by log-sum-exp in one launch (cuda/attn_merge.cu);
golden twin: attn_merge_golden. The prefix / rest split's merge (layers.kernel_attention);
attn_split.merge_lse is the same function in torch ops (any device, float32 or float64).

Contract of merge_states(o1, lse1, o2, lse2): o1, o2 bf16 [..., D] of one shape (D a positive multiple of 8),
lse1, lse2 float32 [...] = o's leading shape (natural log; -inf: the pass saw no key and its o is ignored, NaN
included), all contiguous on one CUDA device -> (o bf16 [..., D], lse float32 [...]) = attn_merge_golden.
merge_states. One launch of merge_states_bf16 over ceil(R / MERGE_ROWS) blocks, R the rows.
"""
from __future__ import annotations

import torch

from .loader import _aligned, _empty, _launch, _need, _on_one_gpu, _p

MERGE_ROWS = 8   # attn_merge.cu: rows a block (a warp a row)


def merge_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """(o, lse) of the two passes merged (module docstring)."""
    import numpy as np
    _need("o1", o1, (torch.bfloat16,))
    _need("o2", o2, (torch.bfloat16,))
    _need("lse1", lse1, (torch.float32,))
    _need("lse2", lse2, (torch.float32,))
    if o1.dim() < 1 or o1.shape != o2.shape or o1.shape[-1] == 0 or o1.shape[-1] % 8:
        raise ValueError(f"o1, o2: expected bf16 [..., D] of one shape with D a positive multiple of 8, got "
                         f"{tuple(o1.shape)} and {tuple(o2.shape)}")
    lead = tuple(o1.shape[:-1])
    for name, t in (("lse1", lse1), ("lse2", lse2)):
        if tuple(t.shape) != lead:
            raise ValueError(f"{name}: expected float32 {list(lead)} (o's leading shape), got "
                             f"{tuple(t.shape)}")
    _on_one_gpu(o1=o1, lse1=lse1, o2=o2, lse2=lse2)
    _aligned(o1=o1, o2=o2)
    D = o1.shape[-1]
    R = o1.numel() // D
    o = _empty(*o1.shape, dtype=torch.bfloat16, device=o1.device)
    lse = _empty(*lead, dtype=torch.float32, device=o1.device)
    if R:
        _launch("attn_merge", "merge_states_bf16", (-(-R // MERGE_ROWS),), (256,),
                (_p(o1), _p(lse1), _p(o2), _p(lse2), np.int64(R), np.int32(D), _p(o), _p(lse)))
    return o, lse
