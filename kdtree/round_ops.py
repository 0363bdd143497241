"""The round's steps that do not depend on the engine's bookkeeping: per-request sampling streams and the
two implementations of the tree steps' build / walk / compact interface (`GoldenOps`: numpy, request by
request on the host; `KernelOps`: the CUDA kernels, no host reads). `kdtree.engine` chooses one at
construction and runs it every round."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import golden


# ----------------------------------------------------------------------------- sampling
_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for int64 h in [0, 2**32), without int64 overflow (16-bit halves of c)."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (murmur3's finalizer) on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def gumbel(seed: torch.Tensor, step: torch.Tensor, N: int, V: int) -> torch.Tensor:
    """Gumbel noise float32 [b, N, V], a pure function of (seed [b], step [b], row, vocabulary index): the
    request's own stream, the same on every device and batch. Uniforms have 24 bits."""
    dev = seed.device
    s = seed.long()
    h = _fmix((s & _M32) ^ 0x9E3779B9)
    h = _fmix(h ^ ((s >> 32) & _M32))
    h = _fmix(h ^ (step.long() & _M32))                                              # [b]
    h = _fmix(h[:, None] ^ torch.arange(N, device=dev)[None])                          # [b, N]
    v = _mul32(torch.arange(V, device=dev), 0x9E3779B1)
    u = _fmix(_fmix(h[..., None] ^ v))                                                 # [b, N, V]
    u = ((u >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def uniforms(seed: torch.Tensor, step: torch.Tensor, n: int, salt: int = 0) -> torch.Tensor:
    """Uniforms float32 [b, n] in (0, 1), a pure function of (seed [b], step [b], index, salt): a request's
    own stream (24 bits), independent of `gumbel`'s for salt != 0."""
    dev = seed.device
    s = seed.long()
    h = _fmix((s & _M32) ^ (0x9E3779B9 ^ (salt & _M32)))
    h = _fmix(h ^ ((s >> 32) & _M32))
    h = _fmix(h ^ (step.long() & _M32))                                              # [b]
    u = _fmix(_fmix(h[:, None] ^ _mul32(torch.arange(n, device=dev), 0x9E3779B1)))    # [b, n]
    return ((u >> 8).float() + 0.5) * (1.0 / (1 << 24))


def choose(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
           sampling: bool) -> torch.Tensor:
    """logits [b, N, V] -> int64 [b, N]: argmax where temperature[b] == 0 (first maximum on ties), else one
    sample of softmax(logits / T) per row (Gumbel-max with the request's stream keyed by step[b])."""
    greedy = logits.argmax(-1)
    if not sampling:
        return greedy
    b, N, V = logits.shape
    t = temperature.float().clamp_min(1e-6)[:, None, None]
    sample = (logits / t + gumbel(seed, step, N, V)).argmax(-1)
    return torch.where(temperature[:, None] > 0, sample, greedy)


def all_finite(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> bool [...]: every logit of the row finite. One reduction over V (aminmax carries a
    NaN to both extremes, an infinity to one of them), not an elementwise mask of the logits' size."""
    lo, hi = torch.aminmax(logits, dim=-1)
    return torch.isfinite(lo) & torch.isfinite(hi)


# ----------------------------------------------------------------------------- tree steps
@dataclass
class VerifyBatch:
    """Verify blocks of N rows per request (root first; padding rows see only themselves, never accepted)."""
    tokens: torch.Tensor      # int32 [b, N]
    positions: torch.Tensor   # int64 [b, N]
    parents: torch.Tensor     # int32 [b, N]
    mask: torch.Tensor | None         # bool [b, N, N]
    mask_words: torch.Tensor | None = None  # int32 [b, N, ceil(N/32)] when the builder packs it
    depths: torch.Tensor | None = None      # int32 [b, N] of a tree block: 0 for the root and padding rows
    scores: torch.Tensor | None = None      # float32 [b, N] of a tree block: log prefix probabilities
    chain: torch.Tensor | None = None       # int32 [b, L]: the top-1 token per depth, when the build has it
    chain_lp: torch.Tensor | None = None    # float32 [b, L]: its log-probability


def truncate(blk: VerifyBatch, N: int) -> VerifyBatch:
    """The first N rows of a best-first tree block: the block of the (N - 1)-node tree (a node's parent row
    comes before it, so the rows keep their ancestors). Torch ops (capturable)."""
    cut = (lambda t: None if t is None else t[:, :N].contiguous())
    return VerifyBatch(cut(blk.tokens), cut(blk.positions), cut(blk.parents),
                       None if blk.mask is None else blk.mask[:, :N, :N].contiguous(),
                       None if blk.mask_words is None else blk.mask_words[:, :N, :-(-N // 32)].contiguous(),
                       cut(blk.depths), cut(blk.scores))


def truncated_accepts(acc: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The accept length the walk would have given on each truncation of the block it walked: acc [b, A]
    (the walked path's row indices from the root, -1 past its end), rows [P] (each truncation's rows) ->
    [b, P], the path's rows below each count. On the first R rows of a best-first block (the smaller tree)
    the walk takes the same path up to its first row at or past R, where it stops (a row's verify output
    depends on its ancestors alone; siblings carry distinct tokens); a child's row comes after its
    parent's, so the path's rows ascend and those below R are that leading part. Torch ops (capturable)."""
    return ((acc[:, :, None] >= 0) & (acc[:, :, None] < rows[None, None, :])).sum(1)          # [b, P]


def _chain(draft: torch.Tensor | None, root: torch.Tensor, start: torch.Tensor,
           chain: torch.Tensor | None = None) -> VerifyBatch:
    """AR (draft and chain None: the root alone) or the DFlash chain (argmax per depth of draft [b, L, V], or
    the chain's tokens [b, L] as given), in torch ops (capturable)."""
    b = root.shape[0]
    dev = root.device
    toks = root.to(torch.int32)[:, None]
    if draft is not None:
        chain = draft.argmax(-1)
    if chain is not None:
        toks = torch.cat([toks, chain.to(torch.int32)], 1)
    N = toks.shape[1]
    ar = torch.arange(N, device=dev)
    return VerifyBatch(toks, start.long()[:, None] + ar,
                       (ar - 1).to(torch.int32)[None].expand(b, N).contiguous(),
                       torch.ones(N, N, dtype=torch.bool, device=dev).tril()[None].expand(b, N, N))


def _compact_torch(pool, page_table, start, accepted, acc_len, page_size: int) -> None:
    """pool [layers, rows, D]: per request, cache row start + j <- row start + accepted[j] for j < acc_len
    (golden.compact_kv); rows j >= acc_len write to the scratch page. Torch ops (capturable)."""
    b, A = accepted.shape
    dev = pool.device
    j = torch.arange(A, device=dev)[None]
    valid = j < acc_len[:, None]

    def slot(r):
        return page_table.long().gather(1, r // page_size) * page_size + r % page_size
    src = slot(start.long()[:, None] + accepted.long().clamp_min(0))
    dst = torch.where(valid, slot(start.long()[:, None] + j), j % page_size)
    pool.index_copy_(1, dst.reshape(-1), pool[:, src.reshape(-1)])


class TreeOps:
    """The tree steps' interface: build(draft [b, L, V] | None, root [b], start [b]) -> VerifyBatch;
    walk(tokens, parents, choice, max_accept) -> (accepted int32 [b, A], acc_len int32 [b], bonus int64 [b]);
    compact(pool, page_table, start, accepted, acc_len). AR and the DFlash chain build in torch ops for
    both."""
    capturable = False

    def __init__(self, mode: str, budget: int | None, page_size: int):
        self.mode, self.budget, self.page_size = mode, budget, page_size

    def build(self, draft, root, start) -> VerifyBatch:
        return _chain(draft, root, start) if self.mode != "ddtree" else self._tree(draft, root, start)

    def _tree(self, draft, root, start) -> VerifyBatch:
        raise NotImplementedError

    def estimates(self, acc, blk: VerifyBatch, draft, plan_list, out) -> torch.Tensor:
        """budget="auto": the chain's tokens int [b, L] (argmax per depth of draft [b, L, V]), and each
        request's expected tokens per plan (`budget.expected`) written into out float32 [b, P]. Torch ops
        (capturable)."""
        from . import budget
        top_lp, chain = draft.float().log_softmax(-1).max(-1)                         # [b, L]
        out.copy_(budget.expected(acc, blk.scores, blk.depths, top_lp, plan_list))
        return chain


class GoldenOps(TreeOps):
    """The reference implementation: the DDTree build and every walk in numpy (golden.py), request by request
    on the host; the AR / chain blocks and the compaction in torch ops (golden.compact_kv's contract)."""

    def trees(self, logits: np.ndarray, roots: list, starts: list) -> list:
        """Each request's (golden.Tree, golden.VerifyBlock) from its draft logits [L, V], root and start."""
        out = []
        for lg, r, s in zip(logits, roots, starts):
            t = golden.ddtree(lg, self.budget)
            out.append((t, golden.compile_tree(t, r, s)))
        return out

    def _tree(self, draft, root, start) -> VerifyBatch:
        N = self.budget + 1
        roots, starts = root.tolist(), start.tolist()
        b = len(roots)
        toks = np.tile(np.array(roots, np.int64)[:, None], (1, N))
        pos = np.tile(np.array(starts, np.int64)[:, None], (1, N))
        par = np.full((b, N), -1, np.int32)
        dep, sc = np.zeros((b, N), np.int32), np.zeros((b, N), np.float32)
        mask = np.tile(np.eye(N, dtype=bool)[None], (b, 1, 1))
        for i, (t, vb) in enumerate(self.trees(draft.float().cpu().numpy(), roots, starts)):
            toks[i, :vb.n], pos[i, :vb.n], par[i, :vb.n], mask[i, :vb.n, :vb.n] = vb.tokens, vb.positions, \
                vb.parents, vb.mask
            dep[i, 1:vb.n], sc[i, 1:vb.n] = t.depths, t.scores
        dev = root.device
        return VerifyBatch(torch.from_numpy(toks).to(dev, torch.int32), torch.from_numpy(pos).to(dev),
                           torch.from_numpy(par).to(dev), torch.from_numpy(mask).to(dev), None,
                           torch.from_numpy(dep).to(dev), torch.from_numpy(sc).to(dev))

    def walk(self, tokens, parents, choice, max_accept: int):
        t, p, c = tokens.cpu().numpy(), parents.cpu().numpy(), choice.cpu().numpy()
        b = t.shape[0]
        acc = np.full((b, max_accept), -1, np.int32)
        n, bonus = np.zeros(b, np.int32), np.zeros(b, np.int64)
        for i in range(b):
            path, bonus[i] = golden.walk(t[i], p[i], c[i])
            n[i] = len(path)
            acc[i, :n[i]] = path
        dev = tokens.device
        return torch.from_numpy(acc).to(dev), torch.from_numpy(n).to(dev), torch.from_numpy(bonus).to(dev)

    def compact(self, pool, page_table, start, accepted, acc_len) -> None:
        _compact_torch(pool, page_table, start, accepted, acc_len, self.page_size)


class KernelOps(TreeOps):
    """Tree steps in the CUDA kernels (kernels.tree_build / tree_walk / kv_compact): no host reads."""
    capturable = True

    def _tree(self, draft, root, start) -> VerifyBatch:
        from . import kernels
        tb = kernels.tree_build(draft.contiguous(), self.budget, root, start, check_values=False)
        return VerifyBatch(tb.tokens, tb.positions.long(), tb.parents, None, tb.mask, tb.depths, tb.scores,
                           tb.top_tokens, tb.top_logprobs)

    def estimates(self, acc, blk: VerifyBatch, draft, plan_list, out) -> torch.Tensor:
        """As TreeOps.estimates in one launch (kernels.plan_estimates), the chain and its log-probabilities
        taken from the tree build's top-K lists (no pass over the vocabulary)."""
        from . import budget, kernels
        idx, k, extrapolate, _ = budget.columns(acc, plan_list, blk.scores.shape[1] - 1,
                                                blk.chain_lp.shape[1], out.device)
        kernels.plan_estimates(blk.scores, blk.depths, blk.chain_lp, acc.inner, acc.table, idx, k,
                               extrapolate, out=out, check_values=False)
        return blk.chain

    def walk(self, tokens, parents, choice, max_accept: int):
        from . import kernels
        acc, n, bonus = kernels.tree_walk(tokens, parents, choice, max_accept=max_accept)
        return acc, n, bonus.long()

    def compact(self, pool, page_table, start, accepted, acc_len) -> None:
        from . import kernels
        kernels.kv_compact(pool, page_table, start.to(torch.int32), accepted, acc_len,
                           page_size=self.page_size, check_values=False)
