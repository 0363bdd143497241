"""The cost-aware budget's expected tokens per request and plan (cuda/plan_estimates.cu); golden twin:
plan_estimates_golden; torch twin (CPU engines): kdtree.budget.expected.

Contract:
  * plan_estimates(scores, depths, chain_lp, inner, table, idx, kexp, extrapolate, out=None): scores float32
    [b, N], depths int32 [b, N] (a best-first verify block, row 0 the root, 1 <= N - 1 <= MAX_NODES nodes),
    chain_lp float32 [b, L] (any strides; L <= MAX_CHAIN), inner float32 [E], table float32 [D2, E + 1]
    (D2 >= 2, row 0 zeros), idx int32 [T] (values in [0, N - 2]), kexp float32 [T] (>= 0), extrapolate:
    whether any kexp > 0 (a host bool, so the launch reads nothing) -> float32 [b, T + 2] (into `out`, a
    [b, T + 2] tensor with unit column stride, when given): plan_estimates_golden's values to fp32 rounding.
    One launch, no host read unless check_values.
"""
from __future__ import annotations

import numpy as np
import torch

from .loader import _empty, _i, _launch, _need, _on_one_gpu, _p

MAX_NODES = 1024    # PE_MAX_NODES
MAX_CHAIN = 64      # PE_MAX_CHAIN
THREADS = 256       # PE_THREADS


def plan_estimates(scores: torch.Tensor, depths: torch.Tensor, chain_lp: torch.Tensor, inner: torch.Tensor,
                   table: torch.Tensor, idx: torch.Tensor, kexp: torch.Tensor, extrapolate: bool,
                   out: torch.Tensor | None = None, check_values: bool = True) -> torch.Tensor:
    """Expected emitted tokens float32 [b, T + 2] (AR, the chain, then the T tree plans): see the module's
    contract and cuda/plan_estimates.cu."""
    _need("scores", scores, (torch.float32,), ndim=2)
    b, N = scores.shape
    if b == 0 or not 2 <= N <= MAX_NODES + 1:
        raise ValueError(f"scores: expected [b >= 1, N] with 2 <= N <= {MAX_NODES + 1} (root + nodes), got "
                         f"{tuple(scores.shape)}")
    _need("depths", depths, (torch.int32,), shape=(b, N))
    _need("chain_lp", chain_lp, (torch.float32,), ndim=2, contiguous=False)
    if chain_lp.shape[0] != b or not 1 <= chain_lp.shape[1] <= MAX_CHAIN:
        raise ValueError(f"chain_lp: expected [{b}, L] with 1 <= L <= {MAX_CHAIN}, got "
                         f"{tuple(chain_lp.shape)}")
    if min(chain_lp.stride()) < 0:
        raise ValueError("chain_lp: expected non-negative strides")
    _need("inner", inner, (torch.float32,), ndim=1)
    E = inner.shape[0]
    _need("table", table, (torch.float32,), ndim=2)
    if table.shape[0] < 2 or table.shape[1] != E + 1:
        raise ValueError(f"table: expected [D2 >= 2, {E + 1}] (one column per bin of inner), got "
                         f"{tuple(table.shape)}")
    _need("idx", idx, (torch.int32,), ndim=1)
    T = idx.shape[0]
    if not 1 <= T <= THREADS:
        raise ValueError(f"idx: expected 1 to {THREADS} tree plans, got {T}")
    _need("kexp", kexp, (torch.float32,), shape=(T,))
    if not isinstance(extrapolate, (bool, np.bool_)):
        raise ValueError(f"extrapolate: expected a bool, got {type(extrapolate).__name__}")
    if out is not None:
        _need("out", out, (torch.float32,), shape=(b, T + 2), contiguous=False)
        if out.stride(1) != 1 or out.stride(0) < T + 2:
            raise ValueError(f"out: expected rows of unit column stride, got strides {out.stride()}")
    tensors = dict(scores=scores, depths=depths, chain_lp=chain_lp, inner=inner, table=table, idx=idx,
                   kexp=kexp)
    _on_one_gpu(**tensors, **({} if out is None else {"out": out}))
    if check_values:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi > N - 2:
            raise ValueError(f"idx: expected values in [0, {N - 2}], got [{lo}, {hi}]")
        if bool((kexp < 0).any()) or not bool(torch.isfinite(kexp).all()):
            raise ValueError("kexp: expected finite values >= 0")
        if bool(extrapolate) != bool((kexp > 0).any()):
            raise ValueError(f"extrapolate={extrapolate} disagrees with kexp (any > 0: {not extrapolate})")
    if out is None:
        out = _empty(b, T + 2, dtype=torch.float32, device=scores.device)
    _launch("plan_estimates", "plan_estimates", (b,), (THREADS,),
            (_p(scores), _p(depths), _i(N), _p(chain_lp), _i(chain_lp.stride(0)), _i(chain_lp.stride(1)),
             _i(chain_lp.shape[1]), _p(inner), _i(E), _p(table), _i(table.shape[0]), _p(idx), _p(kexp), _i(T),
             _i(int(bool(extrapolate))), _p(out), _i(out.stride(0))))
    return out
