"""Numpy golden references: each function is the contract of a CUDA kernel in cuda/.

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

from . import checks


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
        raise ValueError(f"{name}: row {int(np.argmax(dead))} is all -inf; expected at least one finite logit per depth")
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
        raise ValueError(f"top_tokens/top_logprobs: expected equal non-empty shapes [L, K], got {tt.shape} and {lp.shape}")
    if np.isnan(lp).any() or np.isposinf(lp).any() or (lp > 0).any():
        raise ValueError("top_logprobs: expected log-probabilities (<= 0, no NaN)")
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
        tokens.append(int(tt[d - 1, r])); depths.append(d); parents.append(par)
        scores.append(score); ranks.append(r)
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
        raise ValueError(f"tree: tokens, parents and depths of one length expected, got {n}, {len(tree.parents)}, "
                         f"{len(tree.depths)}")
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


# ----------------------------------------------------------------------------- walk
def walk(tokens, parents, target_choice) -> tuple[np.ndarray, int]:
    """Follow the target down the verify block.

    tokens [N], parents [N] (row 0 the root), target_choice [N]: the target's next token at every row
    (argmax for greedy, a sample for T > 0). From the root, move to the child whose token equals the
    target's choice while one exists. Returns (accepted rows [k] int64, starting with 0; bonus token =
    target_choice at the last accepted row)."""
    tokens = np.asarray(tokens); parents = np.asarray(parents); choice = np.asarray(target_choice)
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(f"walk: expected tokens [N] with N >= 1 (row 0 the root), got shape {tokens.shape}")
    for name, a in (("tokens", tokens), ("parents", parents), ("target_choice", choice)):
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"walk: {name} must hold integers, got {a.dtype}")
    N = tokens.shape[0]
    if parents.shape != (N,) or choice.shape != (N,):
        raise ValueError(f"walk: expected tokens, parents, target_choice all of shape [{N}], got "
                         f"{tokens.shape}, {parents.shape}, {choice.shape}")
    _ids("walk: tokens", tokens)
    _ids("walk: target_choice", choice)
    _check_parents("walk: parents", parents, N)
    if N and parents[0] != -1:
        raise ValueError(f"walk: row 0 is the root: expected parents[0] = -1, got {int(parents[0])}")
    children: dict[tuple[int, int], int] = {}
    for i in range(1, N):
        children.setdefault((int(parents[i]), int(tokens[i])), i)
    path = [0]
    while (nxt := children.get((path[-1], int(choice[path[-1]])))) is not None:
        path.append(nxt)
    return np.array(path, np.int64), int(choice[path[-1]])


def greedy_walk(tokens, parents, target_logits) -> tuple[np.ndarray, int]:
    """walk() with the target's argmax (lowest token id on ties) at every row; target_logits [N, V]."""
    x = np.asarray(target_logits)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"target_logits: expected a float array [N, V], got {x.dtype} {x.shape}")
    if np.isnan(x).any():
        raise ValueError(f"target_logits: NaN at row {int(np.flatnonzero(np.isnan(x).any(-1))[0])}")
    return walk(tokens, parents, x.argmax(axis=-1))


def sampled_walk(tokens, parents, target_samples) -> tuple[np.ndarray, int]:
    """walk() with one target sample per row (drawn from the target's distribution at T > 0)."""
    return walk(tokens, parents, target_samples)


# ----------------------------------------------------------------------------- SGLang's EAGLE tree format
# The arrays sgl-kernel's build_tree_kernel_efficient writes and verify_tree_greedy reads
# (sgl-project/sglang, sgl-kernel/csrc/speculative/eagle_utils.cu at commit 29bd4e85). Per request b of a
# batch, the N = draft_token_num rows are our verify block's rows (row 0 the root, the verified token at
# position seq_len[b]); a request's flat row index is b * N + row.
SGLANG_MODES = ("full", "qlen_only", "qlen_only_bitpacking")  # sgl-kernel's TreeMaskMode 0, 1, 2
SGLANG_BITPACK_MAX_N = 32


def sglang_mask_bytes(N: int) -> int:
    """Bytes per row of the bit-packed mask: 1 up to 8 rows, 2 up to 16, 4 up to 32 (more cannot be packed)."""
    if not 1 <= N <= SGLANG_BITPACK_MAX_N:
        raise ValueError(f"qlen_only_bitpacking holds at most {SGLANG_BITPACK_MAX_N} rows a request, got N={N}")
    return 1 if N <= 8 else 2 if N <= 16 else 4


@dataclass
class SglangTree:
    """One batch in SGLang's format (shapes with b requests of N rows each):
    draft_tokens int64 [b, N] (verify_tree_greedy's `candidates`), positions int64 [b * N] = seq_len + depth,
    tree_mask: "full" bool [sum(seq_len) * N + b * N * N], request b's [N, seq_len[b] + N] block at offset
    sum(seq_len[:b]) * N + b * N * N (prefix columns true); "qlen_only" bool [b * N * N] ([N, N] per request);
    "qlen_only_bitpacking" uint8 [b * N, nbytes] (bit c % 8 of byte c // 8 = column c, little endian);
    column c of the tree part is row c (0 the root, true on every row).
    retrive_index int64 [b, N] = b * N + row; retrive_next_token int64 [b, N] = the row's first child (its
    smallest child row), -1 none; retrive_next_sibling int64 [b, N] = the next larger row with the same
    parent, -1 none. Padding rows (parent -1 below row 0) are on no list, see the prefix, the root and
    themselves, and sit at position seq_len."""
    draft_tokens: np.ndarray
    positions: np.ndarray
    tree_mask: np.ndarray
    retrive_index: np.ndarray
    retrive_next_token: np.ndarray
    retrive_next_sibling: np.ndarray
    mode: str


def sglang_tree(tokens, parents, seq_lens, mode: str = "qlen_only") -> SglangTree:
    """Verify blocks (tokens [b, N], parents [b, N]: row 0 the root, parents[i] < i or -1) and each request's
    committed length seq_lens [b] (the root's position) -> SglangTree (contract above)."""
    mode = checks.one_of("mode", mode, SGLANG_MODES)
    tok = _ids("tokens", tokens)
    par = np.asarray(parents)
    if tok.ndim != 2 or tok.shape[1] == 0 or par.shape != tok.shape:
        raise ValueError(f"tokens/parents: expected equal shapes [b, N] with N >= 1, got {tok.shape} and "
                         f"{par.shape}")
    b, N = tok.shape
    sl = np.asarray(seq_lens)
    if sl.shape != (b,) or (sl.size and (not np.issubdtype(sl.dtype, np.integer) or sl.min() < 0)):
        raise ValueError(f"seq_lens: expected {b} integers >= 0, got {sl.dtype} {sl.shape}")
    for i in range(b):
        _check_parents(f"parents[{i}]", par[i], N)
        if par[i, 0] != -1:
            raise ValueError(f"parents[{i}]: row 0 is the root: expected parents[{i}, 0] = -1, got {par[i, 0]}")
    if mode == "qlen_only_bitpacking":
        nbytes = sglang_mask_bytes(N)
    nxt = np.full((b, N), -1, np.int64)
    sib = np.full((b, N), -1, np.int64)
    pos = np.zeros((b, N), np.int64)
    vis = np.zeros((b, N, N), bool)
    for i in range(b):
        for r in range(N - 1, 0, -1):  # head insertion from the back: each list ascends
            p = par[i, r]
            if p >= 0:
                sib[i, r], nxt[i, p] = nxt[i, p], r
        vis[i] = ancestor_mask(par[i])
        vis[i, :, 0] = True
        depth = np.zeros(N, np.int64)
        for r in range(1, N):
            depth[r] = depth[par[i, r]] + 1 if par[i, r] >= 0 else 0
        pos[i] = int(sl[i]) + depth
    if mode == "full":
        mask = np.concatenate([np.concatenate([np.ones((N, int(sl[i])), bool), vis[i]], axis=1).ravel()
                               for i in range(b)]) if b else np.zeros(0, bool)
    elif mode == "qlen_only":
        mask = vis.reshape(-1)
    else:
        bits = np.zeros((b * N, nbytes * 8), bool)
        bits[:, :N] = vis.reshape(b * N, N)
        mask = np.packbits(bits.reshape(b * N, nbytes, 8), axis=-1, bitorder="little")[..., 0]
    ridx = np.arange(b * N, dtype=np.int64).reshape(b, N)
    return SglangTree(tok.astype(np.int64), pos.reshape(-1), mask, ridx, nxt, sib, mode)


def sglang_verify_greedy(tree: SglangTree, target_predict, num_spec_steps: int):
    """verify_tree_greedy's contract: per request, from row 0 follow retrive_next_token, then the sibling list,
    to the row whose draft token equals the target's choice at the last accepted row; at most
    num_spec_steps - 1 draft rows. target_predict [b, N] (the target's token at every row).
    Returns predicts int32 [b * N] (the target's token at each accepted row, -1 at the others),
    accept_index int32 [b, num_spec_steps] (flat rows, root first, -1 padded), accept_token_num int32 [b]
    (draft rows accepted, the root not counted)."""
    S = checks.positive_int("num_spec_steps", num_spec_steps)
    b, N = tree.draft_tokens.shape
    tp = _ids("target_predict", target_predict)
    if tp.shape != (b, N):
        raise ValueError(f"target_predict: expected shape ({b}, {N}), got {tp.shape}")
    flat = tp.reshape(-1)
    predicts = np.full(b * N, -1, np.int32)
    accept = np.full((b, S), -1, np.int32)
    n_acc = np.zeros(b, np.int32)
    for i in range(b):
        last = int(tree.retrive_index[i, 0])
        accept[i, 0] = last
        cur = 0
        for _ in range(1, S):
            cur = int(tree.retrive_next_token[i, cur])
            while cur != -1 and tree.draft_tokens[i, cur] != flat[last]:
                cur = int(tree.retrive_next_sibling[i, cur])
            if cur == -1:
                break
            predicts[last] = flat[last]
            n_acc[i] += 1
            last = int(tree.retrive_index[i, cur])
            accept[i, n_acc[i]] = last
        predicts[last] = flat[last]
    return predicts, accept, n_acc

# ----------------------------------------------------------------------------- MLA tree-verify attention
def mla_tree_attention(q_lat, q_pe, kv, pe, mask, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """MLA-absorb attention for one request, in float64.

    q_lat [N, H, R] (q_nope folded through W_uk), q_pe [N, H, P] (rotated), kv [S, R] latent cache,
    pe [S, P] rotated rope keys, S = prefix + N with the appended block last; mask [N, N] bool over the
    block (every prefix row visible). Returns (out [N, H, R] = softmax(scores) @ kv, lse [N, H])."""
    q_lat = np.asarray(q_lat, np.float64); q_pe = np.asarray(q_pe, np.float64)
    kv = np.asarray(kv, np.float64); pe = np.asarray(pe, np.float64); mask = np.asarray(mask, bool)
    N, H, R = q_lat.shape
    S = kv.shape[0]
    if q_pe.shape[:2] != (N, H) or kv.shape != (S, R) or pe.shape != (S, q_pe.shape[2]) or mask.shape != (N, N) or S < N:
        raise ValueError("mla_tree_attention: shapes q_lat [N,H,R], q_pe [N,H,P], kv [S,R], pe [S,P], mask [N,N], S >= N")
    scores = (np.einsum("nhr,sr->nhs", q_lat, kv) + np.einsum("nhp,sp->nhs", q_pe, pe)) * scale
    visible = np.concatenate([np.ones((N, S - N), bool), mask], axis=1)  # [N, S]
    scores = np.where(visible[:, None, :], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - m)
    denom = p.sum(axis=-1, keepdims=True)
    out = np.einsum("nhs,sr->nhr", p / denom, kv)
    return out, (m + np.log(denom))[..., 0]


# ----------------------------------------------------------------------------- KV compaction
def compact_kv(cache, block_start: int, keep) -> tuple[np.ndarray, int]:
    """Gather semantics: out[block_start + j] = cache[block_start + keep[j]] for every j at once; all other
    rows unchanged. keep: strictly increasing indices into the block. Returns (out, new_length)."""
    block_start = checks.int_in("block_start", block_start, 0)
    c = np.array(cache, copy=True)
    k = np.asarray(keep)
    if k.size and (not np.issubdtype(k.dtype, np.integer) or k.dtype == np.bool_):
        raise ValueError(f"compact_kv keep: expected integer row indices, got {k.dtype}")
    keep = k.astype(np.int64)
    if keep.ndim != 1 or (keep.size > 1 and (np.diff(keep) <= 0).any()):
        raise ValueError("compact_kv keep: expected a strictly increasing 1-D index array")
    if keep.size and (keep[0] < 0 or block_start + keep[-1] >= c.shape[0]):
        raise IndexError(f"compact_kv keep: expected values in [0, {c.shape[0] - block_start}), got "
                         f"[{keep[0]}, {keep[-1]}]")
    c[block_start:block_start + keep.size] = np.asarray(cache)[block_start + keep]
    return c, block_start + keep.size


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


# ----------------------------------------------------------------------------- INT4 MoE experts
def unpack_int4(packed) -> np.ndarray:
    """int32 [..., n / 8] (compressed-tensors pack-quantized) -> int8 [..., n] in [-8, 7]."""
    w = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
    u = (w[..., None] >> (4 * np.arange(8))) & 0xF
    return (u - 8).astype(np.int8).reshape(*w.shape[:-1], -1)


def dequant_int4(packed, scale) -> np.ndarray:
    """[..., out, in / 8] int32 + [..., out, in / 32] scales -> float64 [..., out, in] = q * scale."""
    q = unpack_int4(packed).astype(np.float64)
    return q * np.repeat(np.asarray(scale, np.float64), 32, axis=-1)


def group_pairs(topk_ids, topk_weights, n_experts: int):
    """Token-expert pairs grouped by expert (the contract of cuda/moe_int4.cu moe_group_*).

    topk_ids [T, k] expert ids; topk_weights [T, k]. Returns pair_tok int32 [P] (P = T k; pair p of the flat
    ids is token p // k), pair_w float32 [P], expert_off int32 [E + 1] (expert e owns [off[e], off[e + 1])),
    active int32 [min(E, P)]: experts with pairs by id, then empty ones by id. Here pairs keep their flat order
    within an expert (the kernel's order within an expert is unspecified); ids outside [0, E) are dropped."""
    ids = np.asarray(topk_ids).astype(np.int64)
    T, k = ids.shape
    flat, wf = ids.reshape(-1), np.asarray(topk_weights, np.float32).reshape(-1)
    keep = np.nonzero((flat >= 0) & (flat < n_experts))[0]
    order = keep[np.argsort(flat[keep], kind="stable")]
    counts = np.bincount(flat[keep], minlength=n_experts)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    active = np.concatenate([np.nonzero(counts > 0)[0], np.nonzero(counts == 0)[0]])[:min(n_experts, T * k)]
    return (order // k).astype(np.int32), wf[order], off, active.astype(np.int32)


def moe_int4(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale) -> np.ndarray:
    """Routed experts with INT4 weights, float64 (the contract of cuda/moe_int4.cu).

    x [T, D]; topk_ids [T, k] expert ids; topk_weights [T, k]; w13 [E, 2I, D/8] packed (+ [E, 2I, D/32]
    scales; rows [0, I) gate, [I, 2I) up); w2 [E, D, I/8] packed (+ [E, D, I/32] scales).
    Returns [T, D] = sum_j topk_weights[t, j] * down_e (silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j];
    pairs with an id outside [0, E) are dropped (expert parallelism marks another rank's experts -1)."""
    x = np.asarray(x, np.float64)
    ids = np.asarray(topk_ids)
    wts = np.asarray(topk_weights, np.float64)
    T, D = x.shape
    I = np.asarray(w13_packed).shape[1] // 2
    out = np.zeros((T, D))
    E = np.asarray(w13_packed).shape[0]
    for e in np.unique(ids):
        if not 0 <= e < E:
            continue
        w13 = dequant_int4(w13_packed[e], w13_scale[e])
        w2 = dequant_int4(w2_packed[e], w2_scale[e])
        t, j = np.nonzero(ids == e)
        gu = x[t] @ w13.T                                   # [n, 2I]
        g, u = gu[:, :I], gu[:, I:]
        hid = g / (1.0 + np.exp(-g)) * u
        out[t] += wts[t, j][:, None] * (hid @ w2.T)
    return out
