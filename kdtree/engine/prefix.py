"""The verify attention split at each request's committed pages (prefix_attn="flashinfer"): FlashInfer's
paged MLA over the prefix, verify_attn over the rest with the block's mask, merged by log-sum-exp
(ops.attn_split, ops.attn_merge, layers.kernel_attention).

    split = PrefixSplit(engine, nodes)   # one FlashInferPrefix per (batch bucket, verify rows a request)
    split.plan(b, N)                     # host, before each round's verify: the rows cut at, planned, copied
    meta = split.meta(meta, b)           # inside the round (captured or eager): the metadata with the split

`nodes` are the verify rows a request that the engine's rounds can have: the fixed budget's block alone, or
each plan of budget="auto" (AR's 1, the chain's, each tree's); the policy plans the pass of the round it
launches (`FixedBudget.launch`, `AutoBudget.launch_round` once the round's plan is final).

AR (mode "ar": every round one row, whose keys the host knows even with a round in flight: that round adds
exactly one) takes FlashInfer's pass over the whole attention instead (`AttnMeta.with_whole`): each request's
host length, plus one for a round in flight, plus its own row; no rest, no merge.

Invariants: the rows cut at are each active request's host length (`Request.length`, the rows cached before
its next block: with a round in flight the device length is at least that) rounded down to whole pages, 0 for
padding slots, so every cut is within [0, seq_len - N] (AR: the rows planned are seq_len itself). The plan of
bucket b and the device copy of its rows are always written together (`_plan`), so a captured round replays
the split it was planned for. Rounds run one at a time on one stream, which is what lets the passes share
FlashInfer's float workspace. Rounds that run without a plan (the warm-up and capture rounds, budget="auto"'s
start-up timing) run before any request, on padding slots, with the empty prefixes every pass is planned with
at construction.
"""
from __future__ import annotations

import torch


class PrefixSplit:
    """The prefix pass of every (batch bucket, verify rows) and the device rows it was planned for (module
    docstring)."""

    def __init__(self, engine, nodes):
        from ..ops.flashinfer_prefix import WORKSPACE_BYTES, FlashInferPrefix
        e, a = engine, engine.model.args
        self.e = e
        self.nodes = tuple(sorted(set(int(n) for n in nodes)))
        self.whole = e.mode == "ar"   # one-row rounds whose keys the host knows: FlashInfer takes them whole
        self.rows = torch.zeros(e.max_batch, dtype=torch.int32, device=e.device)   # cut at (AR: planned)
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=e.device)
        graph = e.graph_reason is None
        self.passes = {(b, N): FlashInferPrefix(a.num_attention_heads, a.softmax_scale, b, e.pages_per_req,
                                                e.page_size, e.device, graph=graph, workspace=ws)
                       for b in e.buckets for N in self.nodes}
        for b, N in self.passes:   # warm-up, capture and start-up rounds run on padding slots: no prefix
            self._plan(b, N, [0] * b)

    def plan(self, b: int, N: int) -> None:
        """Before a round of bucket b verifying N rows a request: cut each active request at its committed
        whole pages (whole: plan its every key)."""
        e, ps = self.e, self.e.page_size
        rows = [0] * b
        for r in e.active:   # whole: the rows cached (one more while an AR round is in flight) + its own
            rows[r.slot] = r.length + int(e.in_flight) + 1 if self.whole else r.length // ps * ps
        self._plan(b, N, rows)

    def _plan(self, b: int, N: int, rows: list) -> None:
        self.passes[b, N].plan(rows, N, self.e.page_table[:b], whole=self.whole)
        self.rows[:b].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)

    def meta(self, meta, b: int):
        """The round's attention metadata (b requests, N = its block's rows) with the split
        (AttnMeta.with_prefix), or the whole pass (AttnMeta.with_whole)."""
        p = self.passes[b, meta.positions.shape[1]]
        return meta.with_whole(p) if self.whole else meta.with_prefix(p, self.rows[:b])
