"""Expected emitted tokens per request and plan, on the device, from a drafted round's tree and chain.

`Acceptance`: the calibrated acceptance of a node from its depth and prefix probability, as a device table.
`expected`: each request's expected tokens under every plan (`plans`' order: AR, the chain, the trees;
trees beyond the built block extrapolated), from the block's log prefix probabilities and depths and the
chain's top-1 log-probabilities; `columns`: the plans' columns it reads, made once per block shape. Torch
ops only: capturable into the front phase's graph.
"""
from __future__ import annotations

import math

import numpy as np
import torch


class Acceptance:
    """The calibrated acceptance of a node from its depth and prefix probability, as a device table:
    `kdtree.calibration.Calibration.correct` (the prediction times its (depth, bin)'s realized / predicted,
    at most 1; the prediction itself beyond the table's depths or with no calibration at all)."""

    def __init__(self, calibration, depth: int, device):
        if calibration is None:
            edges, ratio = [0.0, 1.0], np.ones((1, 1))
        else:
            edges, ratio = calibration.edges, calibration.ratios()                      # [D + 1, bins]
        self.depths, self.bins = ratio.shape[0] - 1, ratio.shape[1]
        # the bins' inner edges: bucketize gives the bin 0 .. bins - 1 directly (outside: the end bins)
        self.inner = torch.tensor(edges[1:-1], dtype=torch.float32, device=device)
        # row 0 zeros (depth 0: not a node), row d the ratios of depth d (the last row beyond the table)
        table = np.zeros((ratio.shape[0] + 1, self.bins), np.float32)
        table[1:] = ratio
        self.table = torch.from_numpy(table).to(device)                                # [D + 2, bins]
        self.columns: dict = {}  # expected()'s plan columns, per (tree sizes, nodes)

    def __call__(self, scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """scores float [..., n] (log prefix probabilities), depths int [..., n] (0: not a node) -> float32
        [..., n] acceptance, 0 where depth is 0 (the table's zero row). Torch ops only (capturable)."""
        p = scores.float().exp()
        j = torch.bucketize(p, self.inner, right=True)
        q = p * self.table[depths.long().clamp(max=self.depths + 1), j]
        return q.clamp_(max=1.0)


def columns(acc: Acceptance, plan_list, n: int, L: int, device) -> tuple:
    """The tree plans' columns for a block of n nodes and a chain of L, made once per (plans, n, L) and kept
    on `acc` (outside any capture: the first call is a warm-up round): idx int32 [T] (min(m, n) - 1 per tree
    plan of m nodes), k float32 [T] (log2(m / n) clamped at 0), extrapolate (any k > 0), the chain's depths
    int32 [L] (1 .. L)."""
    assert [p.kind for p in plan_list[:2]] == ["ar", "chain"] and all(p.kind == "tree" for p in plan_list[2:])
    key = (tuple(p.nodes for p in plan_list[2:]), n, L)
    if key not in acc.columns:
        k = [max(0.0, math.log2(m / n)) for m in key[0]]
        acc.columns[key] = (torch.tensor([min(m, n) - 1 for m in key[0]], dtype=torch.int32, device=device),
                            torch.tensor(k, dtype=torch.float32, device=device), max(k) > 0,
                            torch.arange(1, L + 1, dtype=torch.int32, device=device))
    return acc.columns[key]


def expected(acc: Acceptance, tree_scores, tree_depths, chain_lp, plan_list) -> torch.Tensor:
    """Expected emitted tokens per request and plan, float32 [b, len(plan_list)]: tree_scores / tree_depths
    [b, N] of a best-first verify block (row 0 the root), chain_lp [b, L] the chain's top-1 log-probabilities
    per depth. plan_list as `plans` orders it (AR, the chain, then the trees).

    A tree of m > n nodes (beyond the block's n): the block's gain over its first n/2 nodes, d, repeated for
    each doubling past n with the ratio rho = d / (the gain of nodes n/4 .. n/2), clamped to [0, 1]:
    E(m) = E(n) + d (rho + rho^2 + ... + rho^k), k = log2(m / n) (a best-first tree's later nodes are each
    no likelier than the ones before, so its gains per doubling shrink). A block of n < 4 nodes has no two
    doublings: its last gain (cum(n) - cum(n / 2), the single node's for n = 1) repeats, rho = 1, so a round
    that built a tiny tree can still grow."""
    b, L = chain_lp.shape
    n = tree_scores.shape[1] - 1
    idx, k, extrapolate, depth = columns(acc, plan_list, n, L, chain_lp.device)
    q = acc(torch.cat([tree_scores[:, 1:], chain_lp.float().cumsum(1)], 1),
            torch.cat([tree_depths[:, 1:], depth.expand(b, L).to(tree_depths.dtype)], 1))   # [b, n + L]
    cum = q[:, :n].cumsum(1)                                                           # [b, n]
    trees = cum.index_select(1, idx)                                                   # [b, T]
    if extrapolate:
        a = cum[:, n - 1]                                                              # [b]
        d = a - cum[:, n // 2 - 1] if n >= 2 else a
        # rho + ... + rho^k = rho (1 - rho^k) / (1 - rho), as expm1s of k log rho (no cancellation near
        # rho = 1, where it tends to k); rho kept inside [1e-12, 1 - 1e-6] so that k = 0 gives 0
        if n >= 4:
            rho = d / (cum[:, n // 2 - 1] - cum[:, n // 4 - 1]).clamp_min(1e-30)
        else:
            rho = torch.ones_like(d)
        rho = rho.clamp_(1e-12, 1.0 - 1e-6)[:, None]                                   # [b, 1]
        lr = rho.log()
        trees.add_(d[:, None] * rho * torch.expm1(k * lr) / torch.expm1(lr))
    chain = q[:, n:].sum(1, keepdim=True)                                              # [b, 1]
    return torch.cat([torch.zeros_like(chain), chain, trees], 1).add_(1.0)             # AR, chain, trees
