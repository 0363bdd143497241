"""Tensor-native bridges: a batch of trees as tensors, no host copy and no dicts; on the GPU each call is
capturable in a CUDA graph. CUDA tensors run the kernels (kernels.tree_build, kernels.tree_walk), CPU tensors
the golden twins (golden.py), request by request.

    build_trees(draft_logits [b, L, V], budget, root_tokens [b], start_pos [b]) -> kernels.TreeBatch
    follow_trees(tree, posterior [b, N], max_accept) -> (accepted int32 [b, A], acc_len int32 [b], bonus [b])
    tree_attention_mask(tree, past_length, dtype) -> additive mask [b, 1, N, past_length + N]
"""
from __future__ import annotations

import numpy as np
import torch

from .. import checks, golden, kernels
from ..kernels import TreeBatch

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


def _golden_batch(logits: torch.Tensor, budget: int, root: torch.Tensor, start: torch.Tensor) -> TreeBatch:
    """kernels.tree_build's outputs from the golden twins, request by request (CPU tensors)."""
    b, L, V = logits.shape
    N = budget + 1
    W = (N + 31) // 32
    x = logits.float().numpy()
    roots, starts = root.tolist(), start.tolist()
    toks = np.tile(np.array(roots, np.int32)[:, None], (1, N))
    pos = np.tile(np.array(starts, np.int32)[:, None], (1, N))
    par = np.full((b, N), -1, np.int32)
    dep, sc = np.zeros((b, N), np.int32), np.zeros((b, N), np.float32)
    mask = np.zeros((b, N, W), np.uint32)
    n = np.zeros(b, np.int32)
    for i in range(b):
        t = golden.ddtree(x[i], budget)
        vb = golden.compile_tree(t, roots[i], starts[i])
        k = vb.n
        toks[i, :k], pos[i, :k], par[i, :k] = vb.tokens, vb.positions, vb.parents
        dep[i, 1:k], sc[i, 1:k], n[i] = t.depths, t.scores, t.n
        full = np.eye(N, dtype=bool)
        full[:k, :k] = vb.mask
        mask[i] = golden.pack_mask_bits(full)
    t = torch.from_numpy
    return TreeBatch(t(toks), t(pos), t(par), t(dep), t(sc), t(mask.view(np.int32)), t(n))


def build_trees(draft_logits: torch.Tensor, budget: int, root_tokens: torch.Tensor, start_pos: torch.Tensor,
                check_values: bool = True) -> TreeBatch:
    """Draft logits [b, L, V] -> each request's best-first tree of `budget` nodes as a verify block of
    N = budget + 1 rows (kernels.TreeBatch; root_tokens, start_pos [b] give row 0). check_values=False skips
    the NaN / +inf scan, which reads the device (for graph capture)."""
    checks.tensor("draft_logits", draft_logits, _LOGIT_DTYPES, ndim=3)
    budget = checks.int_in("budget", budget, 1, kernels.MAX_BUDGET)
    b = draft_logits.shape[0]
    checks.tensor("root_tokens", root_tokens, _INT_DTYPES, shape=(b,))
    checks.tensor("start_pos", start_pos, _INT_DTYPES, shape=(b,))
    if draft_logits.is_cuda:
        x = draft_logits if draft_logits.dtype != torch.float16 else draft_logits.float()
        return kernels.tree_build(x.contiguous(), budget, root_tokens, start_pos, check_values=check_values)
    if 0 in draft_logits.shape:
        raise ValueError(f"draft_logits: expected a non-empty [b, L, V], got {tuple(draft_logits.shape)}")
    return _golden_batch(draft_logits, budget, root_tokens, start_pos)


def follow_trees(tree: TreeBatch, posterior: torch.Tensor, max_accept: int | None = None):
    """The walk for a batch: posterior [b, N] is the target's token at every row (argmax or a sample).
    Returns accepted int32 [b, A] (rows, root first, -1 padded; A = max_accept, default the tree's
    deepest possible path), acc_len int32 [b], bonus int32 [b] (the target's token after the path)."""
    b, N = tree.tokens.shape
    checks.tensor("posterior", posterior, _INT_DTYPES, shape=(b, N))
    if max_accept is None:
        A = min(N, kernels.MAX_DEPTH + 1)
    else:
        A = checks.int_in("max_accept", max_accept, 1, 1024)
    if tree.tokens.is_cuda:
        return kernels.tree_walk(tree.tokens, tree.parents, posterior, max_accept=A)
    t, p, c = tree.tokens.numpy(), tree.parents.numpy(), posterior.numpy()
    acc = np.full((b, A), -1, np.int32)
    n, bonus = np.zeros(b, np.int32), np.zeros(b, np.int32)
    for i in range(b):
        path, _ = golden.walk(t[i], p[i], c[i])
        n[i] = min(len(path), A)
        acc[i, :n[i]] = path[:n[i]]
        bonus[i] = c[i][path[n[i] - 1]]
    return torch.from_numpy(acc), torch.from_numpy(n), torch.from_numpy(bonus)


def tree_attention_mask(tree: TreeBatch, past_length: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive mask an eager attention takes: [b, 1, N, past_length + N], 0 where a row may attend (every
    past column, its tree ancestors and itself), dtype's most negative value elsewhere."""
    past_length = checks.int_in("past_length", past_length, 0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    vis = tree.dense_mask()  # [b, N, N]
    b, N, _ = vis.shape
    out = torch.zeros(b, 1, N, past_length + N, dtype=dtype, device=vis.device)
    out[:, 0, :, past_length:].masked_fill_(~vis, torch.finfo(dtype).min)
    return out

