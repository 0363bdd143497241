"""One round over the active slots: draft -> build -> verify -> walk -> commit; its launch and its landing.

    logits = runner.round(b, sampling)          # on the device, no host reads (kernel backend)
    flight = runner.launch()                    # a graph replay where captured, its one copy to the host
    runner.land(flight, emitted)                # tokens, stop checks, releases

The round reads no device value on the host until its one copy ([acc_len, logits finite, emitted tokens] per
slot); on a GPU with the kernel backend it is one CUDA graph per batch bucket (`GraphCache`). Padding slots
up to the bucket have length 0 and page table 0 (the pool's scratch page) and never advance (`live`), so they
write only there and nothing reads them. What a round verifies is the budget policy's (`engine.policy`):
`round(plan=None)` drafts and builds the engine's own block; a plan's round verifies the block the policy
built for it (`policy.block`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..model import PagedMeta
from ..round_ops import all_finite, choose
from .graphs import Clock, blas_for
from .requests import finish


@dataclass
class Flight:
    """A launched round whose bookkeeping waits (`Runner.land`): the requests in its slot order at launch,
    its bucket, logits, whether a graph replayed it, its clock, host start, the host buffer its one copy lands
    in (`buf`), the event closing it, and the policy's ticket (what it planned)."""
    reqs: list
    b: int
    logits: torch.Tensor
    graph: bool
    clock: object
    t0: float
    buf: int
    done: object
    ticket: object = None


class Runner:
    """The engine's round (`round`) and its compiled regions; `launch` / `land` around it; the round counters
    `stage_sum` (every landed round's stage seconds, summed) and `launched`."""

    def __init__(self, engine, compile: bool):
        e = self.e = engine
        # compiled regions (compile=True): the drafter's forward, the chain build, the verify forward with its
        # metadata and choice, the commit; the tree kernels between them run as they are
        wrap = (lambda f: torch.compile(f, dynamic=False)) if compile else (lambda f: f)
        self.draft_fn = wrap(e.drafter.draft) if e.batched_drafter else None
        self.build = e.ops.build if e.mode == "ddtree" else wrap(e.ops.build)
        self.verify, self.commit = wrap(self.verify_impl), wrap(self.commit_impl)
        self.features = None
        self.stage_sum: dict = {}
        self.launched = 0                     # rounds launched (their event slots and host buffers)
        self.landed_at: float | None = None   # host time the last round landed while the next was in flight

    def round(self, b: int, sampling: bool, clock=None, plan=None) -> torch.Tensor:
        """One round over slots [0, b) on the device (no host reads unless the backend is golden or the
        drafter is a host one). clock(stage) marks the end of a stage when profiling. plan: a budget plan
        whose block the policy built (`policy.block`; draft and build are then the policy's). Returns the
        verify logits [b, N, V] float32 (inside a graph: its static output, rewritten by every replay)."""
        e, mark = self.e, clock or (lambda stage: None)
        dev, A = e.device, e.max_accept
        root, lens = e.root[:b], e.lens[:b]
        if plan is None:
            with blas_for(dev, b * A):
                draft = self.draft(b)
            mark("draft")
            blk = self.build(draft, root, lens)
            mark("build")
        else:
            blk = e.policy.block(b, plan)
        N = blk.tokens.shape[1]
        with blas_for(dev, b * N):
            logits, choice, feats, finite = self.verify(blk.tokens, blk.positions, blk.mask,
                                                        blk.mask_words, b, sampling)
        mark("verify")
        if e.sim is None:
            acc, acc_len, bonus = e.ops.walk(blk.tokens, blk.parents, choice, A)
        else:  # the profile's target: its true tokens decide the walk
            sim = e.sim.choice(e.sim.truth(lens, A), blk.positions, lens)
            acc, acc_len, _ = e.ops.walk(blk.tokens, blk.parents, sim, A)
            bonus = e.sim.bonus(sim, choice, acc, acc_len)
        if plan is not None:
            e.policy.walked(plan, acc, b)
        mark("walk")
        if N > 1:
            e.ops.compact(e.pool, e.page_table[:b], e.lens[:b], acc, acc_len)
        with blas_for(dev, b * A):
            self.features = self.commit(blk.tokens, feats, acc, acc_len, bonus, finite, b,
                                        plan is not None and e.policy.defers(plan))
        mark("commit")
        return logits

    def verify_impl(self, tokens, positions, mask, mask_words, b: int, sampling: bool):
        """The target's forward over the blocks and its choice per row. tokens int32 [b, N] -> logits float32
        [b, N, V], choice int [b, N], the drafter's features [b, N, F] (None in AR), finite bool [b] (every
        logit of the request finite)."""
        e = self.e
        lens = e.lens[:b]
        meta = PagedMeta.build(e.page_table[:b], lens, positions, mask, e.page_size,
                               e.model.attn_impl, e.moe, mask_words)
        if e.prefix is not None:
            meta = e.prefix.meta(meta, b)
        out = e.model.forward_paged(tokens.long(), e.pool, meta, e.layers)
        choice = choose(out.logits, e.temp[:b], e.seed[:b], lens, sampling)
        feats = torch.cat([out.hidden[i] for i in e.layers], -1) if e.layers else None   # [b, N, F]
        return out.logits, choice, feats, all_finite(out.logits).all(-1)

    def commit_impl(self, tokens, feats, acc, acc_len, bonus, finite, b: int, defer: bool = False):
        """The accepted rows' features to the drafter's context (defer: the policy keeps them for later,
        `policy.defer_rows`), the round's output row per request (acc_len, finite, emitted tokens), lengths
        and roots advanced. Returns the accepted features [b, A, F] for a host drafter (else None)."""
        e = self.e
        lens, root = e.lens[:b], e.root[:b]
        if feats is not None and e.batched_drafter and defer:
            e.policy.defer_rows(feats, b)
            feats = None
        if feats is not None:
            rows = acc.long().clamp_min(0)
            feats = feats.gather(1, rows[..., None].expand(-1, -1, feats.shape[-1]))          # [b, A, F]
            if e.batched_drafter:
                e.drafter.extend(e.ctx, feats, lens, acc_len)
                feats = None
        A = e.max_accept
        emit = tokens.long().gather(1, acc.long().clamp_min(0)[:, 1:]) if A > 1 else \
            torch.zeros(b, 0, dtype=torch.long, device=root.device)
        emit = torch.cat([emit, torch.zeros_like(bonus)[:, None]], 1)
        emit.scatter_(1, (acc_len.long() - 1)[:, None], bonus[:, None])
        e.out[:b, 0] = acc_len
        e.out[:b, 1] = finite
        e.out[:b, 2:] = emit
        live = e.live[:b]
        lens += acc_len * live
        root.copy_(bonus * live)  # padding slots keep root 0 and length 0: the same inputs every round
        return feats

    def draft(self, b: int):
        """The drafter's logits [b, L, V] below each slot's root (None in mode ar)."""
        e = self.e
        if e.mode == "ar":
            return None
        if e.batched_drafter:
            d = self.draft_fn(e.ctx, e.root[:b], e.lens[:b])
            # the drafter ran; the profile's draft
            return d if e.sim is None else e.sim.draft(e.lens[:b])
        rows = [r.session.propose(r.committed).to(e.device).float() for r in e.active]
        if not rows:  # a round on padding slots only (budget="auto"'s start-up timing)
            return torch.zeros(b, e.max_accept - 1, e.model.args.vocab_size, device=e.device)
        d = torch.stack(rows)
        if b > len(rows):
            d = torch.cat([d, torch.zeros(b - len(rows), *d.shape[1:], device=e.device)])
        return d

    def launch(self) -> Flight:
        """Grow the active requests' pages, launch their round (the policy's: a graph replay when captured)
        and its copy to the host; nothing read back. With a round in flight, pages cover both rounds' rows."""
        e = self.e
        n = len(e.active)
        ahead = e.in_flight
        for r in e.active:
            e.scheduler.grow(r, r.length + e.rows + (e.max_accept if ahead else 0))
        b = e.bucket(n)
        sampling = any(r.temperature > 0 for r in e.active)
        t0 = time.perf_counter()
        clock = Clock(e.device)
        logits, graph, ticket = e.policy.launch(b, n, sampling, clock)
        clock("end")
        buf = self.launched % 2
        self.launched += 1
        e.out_host[buf, :n].copy_(e.out[:n], non_blocking=True)
        e.policy.copy_out(ticket, buf, n)
        done = None
        if e.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Flight(list(e.active), b, logits, graph, clock, t0, buf, done, ticket)

    def land(self, f: Flight, emitted) -> None:
        """Wait for round f, then its bookkeeping: tokens to the requests still in it (one that left since
        f launched is skipped), stop checks, releases, stage times."""
        e = self.e
        if f.done is not None:
            f.done.synchronize()
        n = len(f.reqs)
        # grouped admission's rent: the rows of requests not ended before f
        live = sum(r.slot >= 0 for r in f.reqs) if e.scheduler.admission == "grouped" else 0
        host = e.out_host[f.buf, :n].tolist()
        stages = f.clock.times()
        now = time.perf_counter()
        # overlapped: the interval since the previous round landed (its launch was hidden behind it)
        stages["round"] = now - (f.t0 if self.landed_at is None else max(f.t0, self.landed_at))
        self.landed_at = now if e.in_flight else None
        # a graph's logits are its static output, which the round in flight (if any) is rewriting
        e.last_logits = f.logits[:n] if not e.in_flight or not f.graph else None
        ids = [r.rid for r in f.reqs]  # the request in each row of last_logits
        e.last_round = dict(stages, batch=n, bucket=f.b, graph=f.graph, ids=ids)
        landing = e.policy.landing(f, stages["round"])
        e.rounds += 1
        for key, v in stages.items():   # each active request's share: the change over its stay (`release`)
            self.stage_sum[key] = self.stage_sum.get(key, 0.0) + v
        leaving, taken, rows = [], {}, e.policy.tree_rows(f)
        for i, (r, row) in enumerate(zip(f.reqs, host)):
            if r.slot < 0:   # finished or failed in the round before f
                continue
            k, ok, new = row[0], row[1], row[2:2 + row[0]]
            res = r.result
            if not ok:
                e.scheduler.errors[r.rid] = ValueError("target logits: NaN or inf in verify row(s) of this "
                                                       "round: the target's weights or inputs are not finite")
                leaving.append(r)
                continue
            if self.features is not None and r.session is not None:
                r.session.accept(self.features[i, :k])
            r.length += k
            r.committed += new
            res.accept_lengths.append(k)
            taken[r.rid] = k
            res.tree_sizes.append(rows)
            before = len(res.tokens)
            done = finish(res.tokens, new, r.max_new, r.stop)
            emitted.setdefault(r.rid, []).extend(res.tokens[before:])   # up to max_new and a stop token
            if done:
                leaving.append(r)
        e.policy.landed(f, landing, taken)
        # the highest slot first: requests ending together (a static batch's end) move no slot's state (the
        # drafter's context, the policy's) into the slot of one that leaves after it
        for r in sorted(leaving, key=lambda r: -r.slot):
            e.scheduler.release(r)
        if e.scheduler.admission == "grouped" and e.waiting:
            e.scheduler.bill(live, stages["round"])
        self.features = None
        if not e.active and not e.in_flight:
            e.policy.idle()
        if e.debug:
            e.check_state()
