"""Numpy golden twin of kdtree.ops.tree (cuda/tree_build.cu): top-K + log-softmax, the best-first tree build,
the verify block it compiles to, and a brute-force oracle of the tree order (tests). Its argument checks
(_ids, _check_parents) serve walk_golden and sglang_golden too.

Trees
-----
A draft tree of n <= budget nodes hangs below a root (the last committed token, depth 0). Node i has a
token, a depth in 1..L, a parent (-1 = the root; otherwise an index < i) and a score: the float32 sum of
its path's log-probabilities, accumulated root-down: score(child) = float32(score(parent) + logprob).

Order and tie-break. All prefixes are totally ordered by the key
    (-score, depth, parent's emission index, rank)
where rank is the position of the prefix's last token in its depth's top-K list (ranks order tokens by
logit descending, then token id ascending; see below) and the root's children share one parent (index
-1). The tree is the first `budget` prefixes (of tokens with finite log-probabilities) in this order,
emitted in this order. Because a log-probability is <= 0, a parent never sorts after its child (equal score ->
smaller depth first), so the set is prefix-closed and parents precede children; the parent index in a
key therefore always refers to an earlier, already ordered prefix, which makes the order well defined.
Best-first search reproduces it exactly: pop the smallest key, emit it, push its next sibling (same
parent, rank + 1) and its first child (depth + 1, rank 0): each pushed key sorts after the popped one.
Ordering equal scores by the parent's place (rather than by the whole rank path) keeps the order
monotone across a depth: if parent i precedes or is parent j and rank r <= rank s, then child (i, r)
precedes child (j, s) unless they are the same. The GPU search packs the whole key into one 64-bit integer.

Log-probabilities. Each depth's top-K list is sorted by the float32 logit descending, ties by token id
ascending; logprob = float32(float64(x) - logsumexp64(row)), where x is the float32 logit
(bf16 logits are widened exactly). -inf logits are allowed (such tokens are never in a tree); NaN, +inf
and all -inf rows are rejected.

Verify block (compile). N = n + 1 rows: the root first, then node i at row i + 1. Position ids are
start_pos + depth; parents are shifted by one (root -1); mask[i, j] = row j is row i or an ancestor of it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .. import checks


# ----------------------------------------------------------------------------- argument checks
def _as_logits(logits, name="logits") -> np.ndarray:
    x = np.asarray(logits)
    if x.dtype.kind != "f":
        raise ValueError(f"{name}: expected a float array [L, V], got dtype {x.dtype}")
    x = x.astype(np.float32)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name}: expected a non-empty float array [L, V], got shape {x.shape}")
    if np.isnan(x).any():
        r = int(np.argwhere(np.isnan(x))[0, 0])
        raise ValueError(f"{name}: NaN at depth row {r}; expected finite values or -inf")
    if np.isposinf(x).any():
        raise ValueError(f"{name}: +inf present; expected finite values or -inf")
    dead = np.isneginf(x).all(axis=1)
    if dead.any():
        raise ValueError(f"{name}: row {int(np.argmax(dead))} is all -inf; "
                         "expected at least one finite logit per depth")
    return x


MAX_BUDGET = 4096  # the golden path's ceiling: its [B + 1, B + 1] masks and Python heap stay small


def _check_budget(budget) -> int:
    return checks.int_in("budget", budget, 1, MAX_BUDGET,
                         " (number of draft nodes; the golden path's ceiling)")


def _ids(name: str, a) -> np.ndarray:
    """An integer array of token ids (>= 0), or a ValueError naming it (floats are never truncated)."""
    return checks.id_array(name, a)


def _check_parents(name: str, parents, n: int) -> np.ndarray:
    """parents [n] integers with -1 <= parents[i] < i."""
    p = np.asarray(parents)
    if p.shape != (n,) or (p.size and (not np.issubdtype(p.dtype, np.integer) or p.dtype == np.bool_)):
        raise ValueError(f"{name}: expected {n} integer parent indices, got {p.dtype} {p.shape}")
    bad = np.flatnonzero((p < -1) | (p >= np.arange(n)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}: expected -1 <= parents[i] < i, got parents[{i}] = {int(p[i])}")
    return p


# ----------------------------------------------------------------------------- top-K + log-softmax
def log_softmax(logits) -> np.ndarray:
    """[L, V] -> float32 log-probabilities (float64 normaliser, one rounding at the end)."""
    x = _as_logits(logits)
    x64 = x.astype(np.float64)
    m = x64.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(x64 - m).sum(axis=1, keepdims=True))
    return (x64 - lse).astype(np.float32)


def topk_logprobs(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per depth, the k best tokens: (tokens [L, k] int64, logprobs [L, k] float32), sorted by the float32
    logit descending (so by log-probability, which is monotone in it), ties by token id ascending.
    k is clipped to V. Ordering by the logit, not by the rounded log-probability, keeps two logits that
    round to one log-probability in logit order."""
    k = checks.positive_int("k", k)
    lp = log_softmax(logits)
    x = _as_logits(logits) + np.float32(0.0)  # -0.0 -> +0.0
    L, V = lp.shape
    k = min(int(k), V)
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]  # stable: equal logits keep token order
    return order.astype(np.int64), np.take_along_axis(lp, order, axis=1)


# ----------------------------------------------------------------------------- tree build
@dataclass
class Tree:
    tokens: np.ndarray   # [n] int64
    depths: np.ndarray   # [n] int32, 1..L
    parents: np.ndarray  # [n] int32, -1 = root
    scores: np.ndarray   # [n] float32, summed log-probability of the path
    ranks: np.ndarray    # [n] int32, rank of the token in its depth's top-K list

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


def build_tree(top_tokens, top_logprobs, budget: int) -> Tree:
    """Best-first DDTree build over per-depth top-K lists ([L, K] each, sorted as `topk_logprobs` sorts).

    Returns the first `budget` finite-score prefixes in (-score, depth, parent index, rank) order
    (module docstring)."""
    budget = _check_budget(budget)
    tt = _ids("top_tokens", top_tokens)
    lp = np.asarray(top_logprobs, dtype=np.float32)
    if tt.ndim != 2 or lp.shape != tt.shape or tt.shape[0] == 0 or tt.shape[1] == 0:
        raise ValueError(f"top_tokens/top_logprobs: expected equal non-empty shapes [L, K], got {tt.shape} "
                         f"and {lp.shape}")
    if np.isnan(lp).any() or np.isposinf(lp).any() or (lp > 0).any():
        raise ValueError("top_logprobs: expected log-probabilities (<= 0, no NaN)")
    if (np.diff(lp, axis=1) > 0).any():   # the best-first walk takes rank r + 1 only after rank r
        d, r = (int(v) for v in np.argwhere(np.diff(lp, axis=1) > 0)[0])
        raise ValueError(f"top_logprobs: expected each depth's list sorted largest first (as topk_logprobs "
                         f"sorts), got depth {d}: rank {r + 1} ({lp[d, r + 1]:.4g}) > rank {r} "
                         f"({lp[d, r]:.4g})")
    L, K = lp.shape
    tokens, depths, parents, scores, ranks = [], [], [], [], []
    # heap entries: (-score, depth, parent_index, rank, parent_score); the first four are the order key
    heap = []
    if np.isfinite(lp[0, 0]):
        heap.append((-float(lp[0, 0]), 1, -1, 0, np.float32(0.0)))
    while heap and len(tokens) < budget:
        neg, d, par, r, par_score = heapq.heappop(heap)
        idx = len(tokens)
        score = np.float32(-neg)
        tokens.append(int(tt[d - 1, r]))
        depths.append(d)
        parents.append(par)
        scores.append(score)
        ranks.append(r)
        # next sibling: same parent, rank + 1
        if r + 1 < K and np.isfinite(lp[d - 1, r + 1]):
            s = np.float32(par_score + lp[d - 1, r + 1]) if par >= 0 else np.float32(lp[d - 1, r + 1])
            heapq.heappush(heap, (-float(s), d, par, r + 1, par_score))
        # first child: depth + 1, rank 0
        if d < L and np.isfinite(lp[d, 0]):
            s = np.float32(score + lp[d, 0])
            heapq.heappush(heap, (-float(s), d + 1, idx, 0, score))
    return Tree(np.array(tokens, np.int64), np.array(depths, np.int32), np.array(parents, np.int32),
                np.array(scores, np.float32), np.array(ranks, np.int32))


def ddtree(logits, budget: int) -> Tree:
    """Draft logits [L, V] -> tree (top-K with K = min(budget, V), then the best-first build)."""
    budget = _check_budget(budget)
    tt, lp = topk_logprobs(logits, budget)
    return build_tree(tt, lp, budget)


def chain_tree(logits) -> Tree:
    """The DFlash chain: the argmax token of every depth, each the child of the previous."""
    tt, lp = topk_logprobs(logits, 1)
    L = tt.shape[0]
    return Tree(tt[:, 0].copy(), np.arange(1, L + 1, dtype=np.int32), np.arange(-1, L - 1, dtype=np.int32),
                np.cumsum(lp[:, 0], dtype=np.float32), np.zeros(L, np.int32))


# ----------------------------------------------------------------------------- compile
@dataclass
class VerifyBlock:
    tokens: np.ndarray     # [N] int64, root first
    positions: np.ndarray  # [N] int64, start_pos + depth
    parents: np.ndarray    # [N] int32, -1 for the root
    mask: np.ndarray       # [N, N] bool, ancestor-or-self

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


def ancestor_mask(parents) -> np.ndarray:
    """parents [N] (-1 = none, parents[i] < i) -> [N, N] bool, mask[i, j] = j is i or an ancestor of i."""
    p = np.asarray(parents)
    if p.ndim != 1:
        raise ValueError(f"parents: expected a 1-D array, got shape {p.shape}")
    N = p.shape[0]
    _check_parents("parents", p, N)
    m = np.eye(N, dtype=bool)
    for i in range(N):
        if p[i] >= 0:
            m[i] |= m[p[i]]
    return m


def pack_mask_bits(mask) -> np.ndarray:
    """[N, N] bool -> [N, ceil(N/32)] uint32; bit (j % 32) of word j // 32 is mask[i, j]."""
    m = np.asarray(mask, dtype=bool)
    N = m.shape[1]
    W = (N + 31) // 32
    padded = np.zeros((m.shape[0], W * 32), dtype=np.uint64)
    padded[:, :N] = m
    weights = (np.uint64(1) << np.arange(32, dtype=np.uint64))
    return (padded.reshape(m.shape[0], W, 32) * weights).sum(axis=2).astype(np.uint32)


def compile_tree(tree: Tree, root_token: int, start_pos: int) -> VerifyBlock:
    """Tree + root -> the verify block: tokens, position ids (start_pos + depth), parents, ancestor mask."""
    start_pos = checks.int_in("start_pos", start_pos, 0, note=" (the root's position)")
    root_token = checks.int_in("root_token", root_token, 0, note=" (a token id)")
    n = len(tree.tokens)
    if len(tree.parents) != n or len(tree.depths) != n:
        raise ValueError(f"tree: tokens, parents and depths of one length expected, got {n}, "
                         f"{len(tree.parents)}, {len(tree.depths)}")
    _ids("tree.tokens", tree.tokens)
    par = _check_parents("tree.parents", tree.parents, n)
    dep = np.asarray(tree.depths)
    want = np.ones(n, np.int64)
    for i in range(n):
        if par[i] >= 0:
            want[i] = want[par[i]] + 1
    if n and (not np.issubdtype(dep.dtype, np.integer) or (dep != want).any()):
        i = int(np.flatnonzero(dep != want)[0]) if np.issubdtype(dep.dtype, np.integer) else 0
        raise ValueError("tree.depths: expected each node one deeper than its parent (the root's children "
                         f"at 1), got depths[{i}] = {dep[i].item()!r}, expected {int(want[i])}")
    tokens = np.concatenate([[root_token], tree.tokens]).astype(np.int64)
    positions = start_pos + np.concatenate([[0], tree.depths]).astype(np.int64)
    parents = np.concatenate([[-1], tree.parents + 1]).astype(np.int32)
    return VerifyBlock(tokens, positions, parents, ancestor_mask(parents))



# ----------------------------------------------------------------------------- brute-force oracle (tests)
def all_prefixes_ranked(top_tokens, top_logprobs):
    """Every finite prefix as (key, tokens) sorted by the tree order; exponential: tests only.

    Independent of the search: the prefixes of each depth are ordered by (-score, parent's place among
    the previous depth's prefixes, rank), depth by depth; comparing two parents' places within their
    depth is comparing their emission indices, so the global key is (-score, depth, parent place, rank)."""
    lp = np.asarray(top_logprobs, np.float32)
    L, K = lp.shape
    out = []
    level = [((), np.float32(0.0), -1)]  # (rank path, score, place of the prefix within its depth)
    for d in range(L):
        nxt = []
        for path, score, place in level:
            for r in range(K):
                if not np.isfinite(lp[d, r]):
                    continue
                s = np.float32(score + lp[d, r]) if d else np.float32(lp[d, r])
                nxt.append(((-float(s), d + 1, place, r), path + (r,), s))
        nxt.sort(key=lambda e: e[0])
        for key, path, s in nxt:
            out.append((key, tuple(int(top_tokens[j][path[j]]) for j in range(d + 1))))
        level = [(path, s, i) for i, (key, path, s) in enumerate(nxt)]
    out.sort(key=lambda e: e[0])
    return out

