"""budget="auto"'s start-up: the cost table's first entries and the whole-round graphs, before any request.

Each phase runs on padding slots whose lengths are set to each context bucket and whose page tables are
spread over the free pool (`spread_pages`), timed as the median of COST_REPS graph replays (eager rounds: one
after a warm-up); the state is zeroed after it (`reset_state`).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..engine import graphs

WHOLE_GRAPH_BYTES = 1 << 30   # the most logits memory the whole-round graphs may hold
COST_REPS = 5                 # graph replays per cost-table cell (their median)


def capture_whole(a) -> None:
    """budget="auto", decide="previous", graphs on: each drafting plan's whole round (the front phase of
    the tree `Policy.build` gives it, then its block) as one more graph per (batch bucket, sampling), so
    that such a round replays once, as a fixed budget's does, not two graphs with the host between them.
    Only while those graphs' logits outputs stay within WHOLE_GRAPH_BYTES; `whole_graphs` says True or
    why not (at K2.6's vocabulary they would take GBs, and the host gap is a sliver of its rounds)."""
    if a.e.graph_reason is not None or a.policy.decide != "previous":
        a.whole_graphs = ("graphs off" if a.e.graph_reason is not None else
                             f"decide={a.policy.decide}")
        return
    samp = (False, True) if a.e.graph_sampling else (False,)
    keys = [(b, s, i) for b in reversed(a.e.buckets) for s in samp for i in range(len(a.plans))
            if a.policy.build(b, i) is not None]
    need = sum(b * a.plans[i].rows * a.e.model.args.vocab_size * 4 for b, _, i in keys)
    if need > WHOLE_GRAPH_BYTES:
        a.whole_graphs = f"their logits would take {need / 2**30:.1f} GiB (> WHOLE_GRAPH_BYTES)"
        return
    t0 = time.perf_counter()
    with a.e.cache.on_side():
        for b, sampling, i in keys:
            def fn(b=b, sampling=sampling, i=i):
                a.front(b, a.policy.build(b, i))
                return a.e.runner.round(b, sampling, plan=a.plans[i])
            a.e.cache.capture(graphs.whole(b, sampling, i), fn)
    for t in (a.e.lens, a.e.root, a.e.out, a.est, a.pend_n):
        t.zero_()
    torch.cuda.synchronize(a.e.device)
    measure_whole(a)
    a.whole_graphs = True
    a.e.warmup_s += time.perf_counter() - t0

def measure_costs(a) -> None:
    """The cost table's start-up entries: every phase on padding slots (their lengths set to each context
    bucket, their page tables spread over the free pool for the measurement and zeroed after it), per
    batch bucket; the median of COST_REPS graph replays (eager rounds: one after a warm-up)."""
    t0 = time.perf_counter()
    reps, warm = (COST_REPS, 0) if a.e.cache.graphs else (1, 1)
    spread_pages(a)
    for b in a.e.buckets:
        for c, ctx in enumerate(a.costs.ctx_buckets):
            a.e.lens[:b] = ctx
            # every tree size's front, the largest last (its blocks feed the plans' rounds), each plan
            for i, B in [(None, B) for B in a.tree_ops] + [(i, None) for i in range(len(a.plans))]:
                sec = median_time(a, lambda: a.phase(b, False, i, B), reps, warm)
                if i is None:
                    a.costs.front[(b, B, c)] = sec
                else:
                    a.costs.back[(b, i, c)] = sec
    reset_state(a)
    a.e.warmup_s += time.perf_counter() - t0

def spread_pages(a) -> None:
    """Start-up measurements: the padding slots read distinct pool pages, as requests' contexts do, not
    the one scratch page that every read would then hit (no request holds a page yet); fewer pages than
    slots x pages wrap around. Their roots (and simulated texts) differ too, as requests' do: alike rows
    route to the same experts, and a MoE round on them costs less than on requests' rows. `reset_state`
    zeroes pages and roots again."""
    P, B = a.e.pages_per_req, a.e.max_batch
    spread = torch.arange(B * P, dtype=torch.int32, device=a.e.device)
    a.e.page_table.copy_((spread % (a.e.pages.n_pages - 1) + 1).view(B, P))
    V = a.e.model.args.vocab_size
    a.spread_roots = (torch.arange(B, device=a.e.device) * 7919 + 11) % V   # set by median_time
    if a.e.sim is not None and not a.spread_texts:   # once: no request yet
        a.e.sim.write(list(range(B)), [1_000_003 + s for s in range(B)])
        a.spread_texts = True

def reset_state(a) -> None:
    for t in (a.e.lens, a.e.root, a.e.out, a.est, a.pend_n, a.e.page_table):
        t.zero_()
    a.e.sync()

def median_time(a, fn, reps: int, warm: int) -> float:
    """The median seconds of reps calls of fn after warm untimed ones (stream marks, one sync), each from
    the padding slots' distinct roots (`spread_pages`; a round leaves a padding slot's root 0)."""
    marks = []
    for _ in range(warm + reps):
        a.e.root.copy_(a.spread_roots)
        t0 = a.stamps()
        fn()
        marks.append((t0, a.stamps()))
    a.e.sync()
    return float(np.median([a.stamps.secs(t0, t1) for t0, t1 in marks[warm:]]))

def measure_whole(a) -> None:
    """Each whole-round graph's replay per context bucket: its plan's back entry becomes the round less
    its front's entry, as `flush` refreshes it online, so that every plan is costed the same way
    (else the plans whose whole rounds have run look cheaper, by the host gap they save, than the ones
    still costed as two graphs, and the policy keeps the first it ran)."""
    spread_pages(a)
    for b in a.e.buckets:
        for c, ctx in enumerate(a.costs.ctx_buckets):
            a.e.lens[:b] = ctx
            for i in range(len(a.plans)):
                g, build = a.e.cache.graphs.get(graphs.whole(b, False, i)), a.policy.build(b, i)
                if g is not None:
                    front = a.costs._near(a.costs.front, (b, build), c) or 0.0
                    a.costs.back[(b, i, c)] = max(median_time(a, g.replay, COST_REPS, 0) - front,
                                                     0.0)
    reset_state(a)

