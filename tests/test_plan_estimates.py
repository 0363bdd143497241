"""The auto budget's expected tokens per plan: the numpy golden twin against a brute-force sum and against
torch's `budget.expected` (CPU), the CUDA kernel against the golden (gpu), and the engine's kernel path
against its torch path (gpu)."""
import bisect
import math

import numpy as np
import pytest
import torch

from kdtree import budget as auto_budget
from kdtree import golden


class _Cal:
    """A calibration stand-in: edges [bins + 1] over [0, 1] and ratios [D + 1, bins] (Acceptance's view)."""

    def __init__(self, edges, ratios):
        self.edges, self._r = edges, ratios

    def ratios(self):
        return self._r


def _inputs(rng, b, n, L, bins, depth_rows, pad=0):
    """A batch of blocks: scores non-increasing along the rows (best-first), depths 1..L+2 (some past the
    table), `pad` padding rows (depth 0) at the end; chain log-probabilities; a calibration of `bins` bins."""
    N = n + 1
    scores = np.zeros((b, N), np.float32)
    scores[:, 1:] = -np.sort(rng.exponential(2.0, (b, n)), 1)
    depths = np.zeros((b, N), np.int32)
    depths[:, 1:] = rng.integers(1, L + 3, (b, n))
    if pad:
        depths[:, N - pad:] = 0
        scores[:, N - pad:] = 0.0
    chain_lp = -rng.exponential(0.7, (b, L)).astype(np.float32)
    edges = np.concatenate([[0.0], np.sort(rng.uniform(0.02, 0.98, bins - 1)), [1.0]])
    ratios = rng.uniform(0.3, 1.6, (depth_rows, bins))
    return scores, depths, chain_lp, _Cal(edges, ratios)


def _table(cal):
    """Acceptance's (inner edges, table with its zero row) as numpy."""
    acc = auto_budget.Acceptance(cal, 1, "cpu")
    return acc, acc.inner.numpy(), acc.table.numpy()


def _brute(scores, depths, chain_lp, inner, table, budgets):
    """Expected tokens per plan by loops over each request (an independent reading of the contract)."""
    b, N = scores.shape
    n = N - 1
    D2 = table.shape[0]

    def q(s, r):
        if r == 0:
            return 0.0
        p = math.exp(float(s))
        j = bisect.bisect_right(list(map(float, inner)), p)
        return min(p * float(table[min(r, D2 - 1), j]), 1.0)
    out = np.zeros((b, 2 + len(budgets)))
    for i in range(b):
        qs = [q(scores[i, j], depths[i, j]) for j in range(1, N)]
        cum = lambda m: sum(qs[:m])  # noqa: E731
        pre, chain = 0.0, 0.0
        for d in range(chain_lp.shape[1]):
            pre += float(chain_lp[i, d])
            chain += q(pre, d + 1)
        out[i, :2] = 1.0, 1.0 + chain
        for t, m in enumerate(budgets):
            e = cum(min(m, n))
            if m > n:
                a, h = cum(n), cum(n // 2)
                d = a - h
                rho = d / max(h - cum(n // 4), 1e-30) if n >= 4 else 1.0
                rho = min(max(rho, 1e-12), 1.0 - 1e-6)
                e += sum(d * rho ** k for k in range(1, round(math.log2(m / n)) + 1))
            out[i, 2 + t] = 1.0 + e
    return out


def _rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / np.abs(want)))


def _plans(budgets, L):
    return auto_budget.plans(L, budgets)


CASES = [  # b, n, L, bins, depth rows, padding rows, budgets
    (3, 16, 15, 8, 16, 0, (4, 8, 16, 32, 64)),
    (2, 3, 4, 1, 5, 0, (1, 2, 3, 6, 12)),
    (4, 64, 15, 12, 10, 5, (4, 16, 64, 256)),
    (1, 1, 1, 4, 2, 0, (1, 4)),
    (2, 128, 33, 6, 40, 0, (8, 32, 128, 512, 1024)),
]


@pytest.mark.parametrize("b,n,L,bins,rows,pad,budgets", CASES)
def test_golden_equals_brute_force_and_torch(b, n, L, bins, rows, pad, budgets):
    rng = np.random.default_rng(n * 31 + L)
    scores, depths, chain_lp, cal = _inputs(rng, b, n, L, bins, rows, pad)
    acc, inner, table = _table(cal)
    plist = _plans(budgets, L)
    idx, k, _, _ = auto_budget.columns(acc, plist, n, L, "cpu")
    want = _brute(scores, depths, chain_lp, inner, table, budgets)
    g = golden.plan_estimates(scores, depths, chain_lp, inner, table, idx.numpy(), k.numpy())
    assert _rel(g, want) < 1e-12
    t = auto_budget.expected(acc, torch.from_numpy(scores), torch.from_numpy(depths),
                             torch.from_numpy(chain_lp), plist)
    assert t.dtype == torch.float32 and _rel(t.numpy(), want) < 1e-4


def test_the_comparison_can_fail():
    """The checks see a wrong depth row (each node read with the ratio of the depth above) and one doubling
    too many in the extrapolation: the inputs exercise both."""
    rng = np.random.default_rng(7)
    budgets = (4, 16, 64, 256)
    scores, depths, chain_lp, cal = _inputs(rng, 4, 64, 15, 12, 10)
    acc, inner, table = _table(cal)
    idx, k, _, _ = auto_budget.columns(acc, _plans(budgets, 15), 64, 15, "cpu")
    want = _brute(scores, depths, chain_lp, inner, table, budgets)
    right = golden.plan_estimates(scores, depths, chain_lp, inner, table, idx.numpy(), k.numpy())
    assert _rel(right, want) < 1e-12
    shifted = golden.plan_estimates(scores, np.maximum(depths - 1, 0), chain_lp, inner, table, idx.numpy(),
                                    k.numpy())
    assert _rel(shifted, want) > 1e-2
    extra = golden.plan_estimates(scores, depths, chain_lp, inner, table, idx.numpy(),
                                  np.where(k.numpy() > 0, k.numpy() + 1, 0))
    assert _rel(extra, want) > 1e-3


# ----------------------------------------------------------------------------- the kernel
def _gpu_case(rng, b, n, L, bins, rows, pad, budgets):
    scores, depths, chain_lp, cal = _inputs(rng, b, n, L, bins, rows, pad)
    acc = auto_budget.Acceptance(cal, L, "cuda")
    idx, k, ext, _ = auto_budget.columns(acc, _plans(budgets, L), n, L, "cuda")
    want = golden.plan_estimates(scores, depths, chain_lp, acc.inner.cpu().numpy(), acc.table.cpu().numpy(),
                                 idx.cpu().numpy(), k.cpu().numpy())
    return scores, depths, chain_lp, acc, idx, k, ext, want


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("b,n,L,bins,rows,pad,budgets", CASES + [
    (5, 1024, 64, 16, 70, 3, (4, 64, 1024)), (2, 257, 31, 9, 20, 0, (128, 256, 257, 1024)),
    (33, 255, 15, 1, 3, 0, (4, 8, 16, 32, 64, 128, 255, 510, 1020))])
def test_kernel_matches_golden(b, n, L, bins, rows, pad, budgets):
    from kdtree import kernels
    rng = np.random.default_rng(b * 1000 + n)
    scores, depths, chain_lp, acc, idx, k, ext, want = _gpu_case(rng, b, n, L, bins, rows, pad, budgets)
    # the chain's log-probabilities strided as the tree build's top-K lists hold them: [b * L, K], column 0
    K = 5
    lists = torch.full((b * L, K), float("nan"), device="cuda")
    lists[:, 0] = torch.from_numpy(chain_lp).reshape(-1).cuda()
    lp = lists.view(b, L, K)[:, :, 0]
    got = kernels.plan_estimates(torch.from_numpy(scores).cuda(), torch.from_numpy(depths).cuda(), lp,
                                 acc.inner, acc.table, idx, k, ext)
    assert _rel(got.cpu().numpy(), want) < 1e-4
    # into a slice of a wider buffer: its other columns and rows stay as they were
    buf = torch.full((b + 2, len(budgets) + 5), -3.0, device="cuda")
    kernels.plan_estimates(torch.from_numpy(scores).cuda(), torch.from_numpy(depths).cuda(), lp, acc.inner,
                           acc.table, idx, k, ext, out=buf[1:b + 1, 1:len(budgets) + 3], check_values=False)
    host = buf.cpu().numpy()
    assert _rel(host[1:b + 1, 1:len(budgets) + 3], want) < 1e-4
    host[1:b + 1, 1:len(budgets) + 3] = -3.0
    assert (host == -3.0).all()


@pytest.mark.gpu
def test_kernel_checker_sees_a_wrong_depth_row():
    """The same comparison fails on a result made with each node's depth one too small."""
    from kdtree import kernels
    rng = np.random.default_rng(3)
    scores, depths, chain_lp, acc, idx, k, ext, want = _gpu_case(rng, 4, 64, 15, 12, 10, 0, (4, 16, 64, 256))
    wrong = kernels.plan_estimates(torch.from_numpy(scores).cuda(),
                                   torch.from_numpy(np.maximum(depths - 1, 0)).cuda(),
                                   torch.from_numpy(chain_lp).cuda(), acc.inner, acc.table, idx, k, ext)
    assert _rel(wrong.cpu().numpy(), want) > 1e-2


@pytest.mark.gpu
def test_kernel_ops_estimates_equal_the_torch_path_and_chain_is_the_argmax():
    """KernelOps.estimates (the tree build's top-1 lists + the kernel) against TreeOps.estimates (log-softmax
    over the vocabulary + budget.expected) on the same built tree: the chain's tokens equal, the estimates
    within float32 rounding."""
    from kdtree.round_ops import KernelOps, TreeOps
    from kdtree.validate import random_logits
    rng = np.random.default_rng(11)
    b, L, V, B = 6, 15, 4096, 64
    draft = torch.from_numpy(np.stack([random_logits(rng, L, V) for _ in range(b)])).cuda()
    root = torch.from_numpy(rng.integers(0, V, b)).cuda()
    start = torch.from_numpy(rng.integers(10, 200, b)).cuda()
    ops = KernelOps("ddtree", B, 64)
    blk = ops.build(draft, root, start)
    cal = _Cal(np.linspace(0, 1, 9), rng.uniform(0.5, 1.2, (16, 8)))
    acc = auto_budget.Acceptance(cal, L, "cuda")
    plist = _plans((4, 8, 16, 32, 64, 128, 256), L)
    got, want = (torch.full((b, len(plist)), float("nan"), device="cuda") for _ in range(2))
    chain_k = ops.estimates(acc, blk, draft, plist, got)
    chain_t = TreeOps.estimates(ops, acc, blk, draft, plist, want)
    assert torch.equal(chain_k.long(), chain_t.long())
    assert torch.equal(chain_t, draft.argmax(-1))
    assert _rel(got.cpu().numpy(), want.double().cpu().numpy()) < 1e-4
