"""Numpy golden twin of kdtree.ops.plan_estimates (cuda/plan_estimates.cu): expected emitted tokens per
request and plan, in float64."""
from __future__ import annotations

import numpy as np


def accept(s, r, inner, table) -> np.ndarray:
    """Acceptance of nodes of log prefix probability s and depth r (0: not a node): p = exp(s), its bin j =
    #{inner edges <= p}, min(p * table[min(r, D2 - 1), j], 1)."""
    p = np.exp(np.asarray(s, np.float64))
    j = np.searchsorted(np.asarray(inner, np.float64), p, side="right")
    t = np.asarray(table, np.float64)
    return np.minimum(p * t[np.minimum(np.asarray(r), t.shape[0] - 1), j], 1.0)


def plan_estimates(scores, depths, chain_lp, inner, table, idx, kexp) -> np.ndarray:
    """scores [b, N], depths [b, N] (row 0 the root), chain_lp [b, L], inner [E], table [D2, E + 1], idx [T],
    kexp [T] -> float64 [b, T + 2]: 1 (AR), 1 + the chain's summed acceptance, 1 + each tree plan's cumulative
    acceptance at idx (+ the geometric extrapolation where kexp > 0; cuda/plan_estimates.cu)."""
    scores, depths = np.asarray(scores, np.float64), np.asarray(depths)
    b, N = scores.shape
    n = N - 1
    q = np.where(depths[:, 1:] > 0, accept(scores[:, 1:], depths[:, 1:], inner, table), 0.0)
    cum = np.cumsum(q, 1)                                                              # [b, n]
    kexp = np.asarray(kexp, np.float64)
    trees = cum[:, np.asarray(idx)]                                                    # [b, T]
    if (kexp > 0).any():
        a = cum[:, n - 1]
        h = cum[:, n // 2 - 1] if n >= 2 else np.zeros(b)
        d = a - h
        rho = d / np.maximum(h - cum[:, n // 4 - 1], 1e-30) if n >= 4 else np.ones(b)
        rho = np.clip(rho, 1e-12, 1.0 - 1e-6)[:, None]
        lr = np.log(rho)
        trees = trees + d[:, None] * rho * np.expm1(kexp * lr) / np.expm1(lr)
    lp = np.cumsum(np.asarray(chain_lp, np.float64), 1)                                # [b, L]
    L = lp.shape[1]
    chain = accept(lp, np.arange(1, L + 1)[None].repeat(b, 0), inner, table).sum(1, keepdims=True)
    return np.concatenate([np.zeros((b, 1)), chain, trees], 1) + 1.0
