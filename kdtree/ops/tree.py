"""Top-K + log-softmax and the best-first tree build (cuda/tree_build.cu); golden twin: tree_golden.

Contract:
  * topk_logprobs(logits, k): logits bf16/fp32 [..., V] (non-empty, V <= MAX_VOCAB), 1 <= k <= MAX_BUDGET ->
    (tokens int32 [R, k'], logprobs fp32 [R, k']), R = rows, k' = min(k, V); sorted by logit descending, then
    token ascending; logprob = float32(float64(x) - logsumexp64(row)). Two launches: topk_partial* over
    (chunk, row) blocks, topk_merge* per row.
  * tree_build(logits, budget, root_tokens, start_pos): logits bf16/fp32 [b, L, V] with L <= MAX_DEPTH,
    1 <= budget <= MAX_BUDGET, root_tokens / start_pos int32/int64 [b] -> TreeBatch of N = budget + 1 rows
    per request (root first): tree_golden.ddtree + compile_tree + pack_mask_bits, request by request, and
    the top-1 token / log-probability per depth [b, L] (top_tokens / top_logprobs: the chain). One
    launch of tree_kernel(budget) per batch after the top-K; the per-depth log-probabilities are staged in
    shared memory while tree_smem_bytes(B, L, K) <= TREE_SMEM_LIMIT.
  * check_values=True rejects NaN, +inf and all -inf rows (reads the device: pass False under graph capture).
Constants shared with tree_build.cu: MAX_CHUNK, MAX_CANDIDATES, TOPK_SMALL_MAX_K, TREE_REG_SLOTS and the
shared memory layout of tree_smem_bytes.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import checks
from .loader import _empty, _i, _launch, _need, _on_one_gpu, _p, _sm_count

MAX_BUDGET = 1024
MAX_VOCAB = 262144         # MAX_CHUNK * MAX_CANDIDATES / MAX_BUDGET
MAX_DEPTH = 63
MAX_CANDIDATES = 16384      # n_chunks * K candidates per row held in topk_merge's registers (1024 x 16)
MAX_CHUNK = 16384           # topk_partial holds a chunk in registers: 512 threads x 32 keys
TOPK_SMALL_MAX_K = 256      # topk_*_small's limit (beyond, one maximum per thread bounds too loosely)
TOPK_SMALL_K = 16           # topk_logprobs takes topk_*_small up to this K (their lists are ranked by
                            # counting, quadratic in their length)


def _check_budget(budget) -> int:
    return checks.int_in("budget", budget, 1, MAX_BUDGET)


def check_logit_values(logits: torch.Tensor, name: str = "logits") -> None:
    """NaN, +inf or an all -inf row -> ValueError (reads the device: not for graph capture)."""
    x = logits.float() if logits.dtype != torch.float32 else logits
    if bool(torch.isnan(x).any()):
        raise ValueError(f"{name}: NaN present; expected finite values or -inf")
    if bool(torch.isposinf(x).any()):
        raise ValueError(f"{name}: +inf present; expected finite values or -inf")
    if bool(torch.isneginf(x).all(dim=-1).any()):
        raise ValueError(f"{name}: a row is all -inf; expected at least one finite logit per depth")


# ----------------------------------------------------------------------------- top-K + log-softmax
# topk_partial's cost model per block (512 threads, one block per SM, fitted on an H200): TOPK_BLOCK_FIXED_S
# fixed (its block-wide selection passes) + TOPK_COLUMN_S a column.
TOPK_BLOCK_FIXED_S, TOPK_COLUMN_S = 12.9e-6, 0.34e-9


@functools.lru_cache(maxsize=256)
def _chunking(R: int, V: int, K: int, sms: int = 132) -> tuple[int, int]:
    """(chunks per row, chunk width) minimising the busiest SM's time: R * n_chunks blocks, one per SM at a
    time, each costing TOPK_BLOCK_FIXED_S + TOPK_COLUMN_S * width (a partial last round costs a whole one);
    at least 256 and at most MAX_CHUNK columns a chunk, a multiple of 8 columns (16-byte loads),
    n_chunks * K <= MAX_CANDIDATES; fewer chunks on a tie (less merging)."""
    lo = math.ceil(V / MAX_CHUNK)
    hi = max(lo, min(MAX_CANDIDATES // K, math.ceil(V / 256)))
    best = None
    for nch in range(lo, hi + 1):
        chunk = -(-math.ceil(V / nch) // 8) * 8
        n = math.ceil(V / chunk)
        cost = math.ceil(R * n / sms) * (TOPK_BLOCK_FIXED_S + TOPK_COLUMN_S * chunk)
        if best is None or cost < best[0]:
            best = (cost, n, chunk)
    return best[1], best[2]


def topk_logprobs(logits: torch.Tensor, k: int, check_values: bool = True):
    """logits [R, V] (or [..., V]) bf16/fp32 -> (tokens int32 [R, k'], logprobs fp32 [R, k']), k' = min(k, V);
    sorted by logit descending (so by log-probability), then token ascending (tree_golden.topk_logprobs)."""
    _need("logits", logits, (torch.float32, torch.bfloat16))
    if logits.dim() < 2 or logits.shape[-1] == 0 or logits.numel() == 0:
        raise ValueError(f"logits: expected a non-empty [..., V] tensor, got shape {tuple(logits.shape)}")
    V = logits.shape[-1]
    if V > MAX_VOCAB:
        raise ValueError(f"logits: vocabulary {V} exceeds the supported maximum {MAX_VOCAB}")
    k = checks.int_in("k", k, 1, MAX_BUDGET)
    _on_one_gpu(logits=logits)
    if check_values:
        check_logit_values(logits)
    x = logits.reshape(-1, V)
    R, K = x.shape[0], min(int(k), V)
    nch, chunk = _chunking(R, V, K, _sm_count(x.device))
    dev = x.device
    cand_key = _empty(R, nch, K, dtype=torch.int32, device=dev)
    cand_tok = _empty(R, nch, K, dtype=torch.int32, device=dev)
    part_max = _empty(R, nch, dtype=torch.float32, device=dev)
    part_sum = _empty(R, nch, dtype=torch.float64, device=dev)
    out_tok = _empty(R, K, dtype=torch.int32, device=dev)
    out_lp = _empty(R, K, dtype=torch.float32, device=dev)
    small = "_small" if K <= TOPK_SMALL_K else ""  # few block barriers, lists ranked by counting
    name = f"topk_partial{small}_" + ("bf16" if x.dtype == torch.bfloat16 else "f32")
    _launch("tree_build", name, (nch, R), (512,),
            (_p(x), _i(V), _i(K), _i(chunk), _p(cand_key), _p(cand_tok), _p(part_max), _p(part_sum)))
    Kp = 1 << max(0, math.ceil(math.log2(K)))
    _launch("tree_build", f"topk_merge{small}", (R,), (1024,),
            (_p(cand_key), _p(cand_tok), _p(part_max), _p(part_sum), _i(nch), _i(K), _i(Kp), _p(out_tok),
             _p(out_lp)))  # both top-K kernels use static shared memory only
    return out_tok, out_lp


# ----------------------------------------------------------------------------- tree build
@dataclass
class TreeBatch:
    """Verify blocks of N = budget + 1 rows per request (root first); see cuda/tree_build.cu."""
    tokens: torch.Tensor     # int32 [b, N]
    positions: torch.Tensor  # int32 [b, N]
    parents: torch.Tensor    # int32 [b, N]
    depths: torch.Tensor     # int32 [b, N]
    scores: torch.Tensor     # float32 [b, N]
    mask: torch.Tensor       # uint32 bits as int32 [b, N, ceil(N / 32)]
    n_nodes: torch.Tensor    # int32 [b]
    # the top-1 token and its log-probability per depth (the DFlash chain), views of the top-K lists
    top_tokens: torch.Tensor | None = None     # int32 [b, L]
    top_logprobs: torch.Tensor | None = None   # float32 [b, L]

    def dense_mask(self) -> torch.Tensor:
        """bool [b, N, N] from the bits."""
        N = self.tokens.shape[1]
        j = torch.arange(N, device=self.mask.device)
        words = self.mask[:, :, j // 32]
        return ((words >> (j % 32)) & 1).bool()


TREE_REG_SLOTS = (1, 2, 4)  # frontier registers per lane of tree_build_c* (tree_build.cu); beyond: _groups


def tree_kernel(B: int) -> str:
    """The tree_build kernel for budget B: tree_build_c{C} while one slot per node plus the root's fits
    C <= 4 registers per lane (B <= 127), else tree_build_groups (frontier in shared memory, 32 slots a
    group)."""
    need = math.ceil((B + 1) / 32)
    return next((f"tree_build_c{c}" for c in TREE_REG_SLOTS if c >= need), "tree_build_groups")


def tree_smem_bytes(B: int, L: int = 0, K: int = 0) -> int:
    """Dynamic shared memory of tree_build: popped keys, frontier keys (32 slots a group), slot scores, parent
    rows, and (L, K > 0) the staged log-probabilities [L, K]."""
    return 8 * B + 256 * math.ceil((B + 1) / 32) + 4 * (B + 1) + 4 * L * K + 2 * (B + 1)


TREE_SMEM_LIMIT = 200 * 1024


def tree_build(logits: torch.Tensor, budget: int, root_tokens: torch.Tensor, start_pos: torch.Tensor,
               check_values: bool = True) -> TreeBatch:
    """Draft logits [b, L, V] (bf16/fp32) -> per request the best-first tree of `budget` nodes, compiled.

    root_tokens, start_pos: int32/int64 [b] (the root's token and position). Same result as
    tree_golden.ddtree + compile_tree + pack_mask_bits, request by request."""
    budget = _check_budget(budget)
    _need("logits", logits, (torch.float32, torch.bfloat16), ndim=3)
    b, L, V = logits.shape
    if b == 0 or L == 0 or V == 0:
        raise ValueError(f"logits: expected a non-empty [batch, L, V], got {tuple(logits.shape)}")
    if L > MAX_DEPTH:
        raise ValueError(f"logits: depth L={L} exceeds the supported maximum {MAX_DEPTH}")
    _need("root_tokens", root_tokens, (torch.int32, torch.int64), shape=(b,), contiguous=False)
    _need("start_pos", start_pos, (torch.int32, torch.int64), shape=(b,), contiguous=False)
    _on_one_gpu(logits=logits, root_tokens=root_tokens, start_pos=start_pos)
    tok, lp = topk_logprobs(logits.reshape(b * L, V), budget, check_values)
    K = tok.shape[1]
    N = budget + 1
    W = (N + 31) // 32
    dev = logits.device
    out = TreeBatch(*(_empty(b, N, dtype=dt, device=dev) for dt in
                      (torch.int32, torch.int32, torch.int32, torch.int32, torch.float32)),
                    mask=_empty(b, N, W, dtype=torch.int32, device=dev),
                    n_nodes=_empty(b, dtype=torch.int32, device=dev),
                    top_tokens=tok.view(b, L, K)[:, :, 0], top_logprobs=lp.view(b, L, K)[:, :, 0])
    root = root_tokens.to(torch.int32).contiguous()
    start = start_pos.to(torch.int32).contiguous()
    stage = tree_smem_bytes(budget, L, K) <= TREE_SMEM_LIMIT
    _launch("tree_build", tree_kernel(budget), (b,), (256,),
            (_p(tok), _p(lp), _i(L), _i(K), _i(budget), _i(int(stage)), _p(root),
             _p(start), _p(out.tokens), _p(out.positions),
             _p(out.parents), _p(out.depths), _p(out.scores), _p(out.mask), _p(out.n_nodes)),
            smem=tree_smem_bytes(budget, L, K) if stage else tree_smem_bytes(budget))
    return out
