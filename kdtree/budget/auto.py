"""budget="auto" on the engine: each round verifies AR, the chain or a truncated tree, as `Policy` picks.

`AutoBudget` is the engine's budget policy (`kdtree/engine/policy.py` lists the hooks). A drafting round runs
in two phases: the front (`front`: draft, the tree of the size `Policy` builds, the chain, every plan's
expected tokens, into static buffers) and the plan's round (`Runner.round(plan=...)`, whose block
`block` cuts from those buffers); AR rounds draft nothing and keep their features in `pend` until the next
drafting round's catch-up (`catchup`). Graphs: a front per (bucket, tree size), a round per (bucket,
sampling, plan), a catch-up per bucket, and where their logits fit, a whole round per drafting plan
(`startup.capture_whole`). Costs: measured at start-up (`startup`) and refreshed from every round's stream
marks (`flush`). Estimates: `Estimates`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import budget as auto_budget
from ..engine import graphs
from ..engine.graphs import PlanRound, Stamps, blas_for
from ..round_ops import GoldenOps, KernelOps, _chain, truncate, truncated_accepts
from . import startup
from .estimates import Estimates


@dataclass
class Front:
    """What a drafting round's first phase leaves for its second: the tree block (views of the static
    buffers [b, B_max + 1, ...], rows beyond the built tree stale) and the chain's tokens [b, L]."""
    blk: object
    chain: torch.Tensor


@dataclass
class Ticket:
    """A launched round's plan and its stream marks: plan index, batch bucket, requests, context bucket, the
    tree its front built (None: no draft), whether it drafted, its launch index; marks f0 / f1 around the
    front, b0 / b1 around the plan's round (a whole-round replay: f0 and b1 only); lag: `Estimates.lag`'s
    pairs of a "sync" round."""
    plan: int
    b: int
    n: int
    ctx: int
    build: int | None
    drafted: bool
    at: int
    lag: list | None = None
    f0: object = None
    f1: object = None
    b0: object = None
    b1: object = None


class AutoBudget:
    """The cost-aware policy on an engine (module docstring). plans, costs, policy (`kdtree.budget.Policy`),
    ests (`Estimates`), calibration; whole_graphs (True, or why not), whole_replays."""

    def __init__(self, engine, config):
        e = self.e = engine
        cand, dev, B = config.budgets, e.device, e.max_batch
        L = e.drafter.block_size - 1
        self.plans = plans = auto_budget.plans(L, cand)
        cal = config.calibration   # a profile is its own truth
        self.calibration = (None if e.sim is not None or cal is False else
                            getattr(e.drafter, "calibration", None) if cal is None else cal)
        ctxs = (0,) if e.graph_reason else tuple(
            c for c in auto_budget.CTX_BUCKETS if c + e.rows <= e.kv_cap)
        self.costs = auto_budget.CostTable(ctxs, auto_budget.larger_trees(plans))
        self.policy = auto_budget.Policy(plans, self.costs, config.decide)
        self.ests = Estimates(e, len(plans), config.makespan, auto_budget.longest_accepts(plans, L))
        self.acceptance = auto_budget.Acceptance(self.calibration, L, dev)
        self.est = torch.zeros(B, len(plans), dtype=torch.float32, device=dev)
        self.est_host = torch.zeros(2, *self.est.shape, dtype=torch.float32, pin_memory=dev.type == "cuda")
        # a tree round's walked path (the accepted rows, -1 past its end) [B, A], to the host with its
        # estimates: `landing` reads there the accept length on every truncation of the round's tree
        # (`truncated_accepts`; rows [P], 0 for a plan no tree truncates: AR, the chain)
        rows = [p.rows if p.kind == "tree" else 0 for p in plans]
        self.cut_rows = torch.tensor(rows, dtype=torch.long)
        self.cut_plans = {i: [j for j, r in enumerate(rows) if 0 < r <= p.rows]   # the trees within i's
                          for i, p in enumerate(plans) if p.kind == "tree"}
        self.paths = torch.full((B, e.max_accept), -1, dtype=torch.int32, device=dev)
        self.paths_host = torch.zeros(2, *self.paths.shape, dtype=torch.int32, pin_memory=dev.type == "cuda")
        Ops = KernelOps if e.backend == "kernel" else GoldenOps
        self.tree_ops = {n: Ops("ddtree", n, e.page_size) for n in cand}
        self.fbuf: Front | None = None   # the front phase's outputs, static (allocated by the first)
        # AR plan rounds leave the drafter's context behind: their rows' target features wait in `pend`
        # [B, MAX_HOLD, F] (pend_n [B] per slot) until the next drafting round's catch-up extends it
        a = e.model.args
        self.pend = (torch.zeros(B, auto_budget.MAX_HOLD, len(e.layers) * a.hidden_size, dtype=e.model.dtype,
                                 device=dev) if e.batched_drafter else None)
        self.pend_n = torch.zeros(B, dtype=torch.int64, device=dev)
        self.pending = 0      # AR plan rounds since the last catch-up (host count)
        self.ahead = None     # the next round's decision, made while this round's GPU work runs
        self.timing: list = []   # rounds whose phase times wait for `flush`
        self.stamps = Stamps(dev)
        self.whole_graphs: bool | str = False   # whole-round graphs captured, or why not
        self.whole_replays = 0                  # rounds that replayed one
        self.spread_roots, self.spread_texts = None, False

    # ------------------------------------------------------------- the engine's hooks
    @property
    def auto(self):
        return self.policy

    def capture(self, capture) -> None:
        """Per bucket, largest first: a front graph per tree size, the catch-up, then one per plan (their
        blocks from the largest front's static buffers)."""
        e = self.e
        for b in reversed(e.buckets):
            for n in self.tree_ops:
                capture(graphs.front(b, n), lambda: self.front(b, n))
            if self.pend is not None:
                capture(graphs.catchup(b), lambda: self.catchup(b))
            e.cache.replay(graphs.front(b, self.max_budget))   # real blocks for the warm-up rounds
            for sampling in (False, True) if e.graph_sampling else (False,):
                for i, plan in enumerate(self.plans):
                    capture(PlanRound(b, sampling, i), lambda: e.runner.round(b, sampling, plan=plan))

    @property
    def max_budget(self) -> int:
        return max(self.tree_ops)

    def verify_rows(self) -> tuple:
        return tuple(sorted({p.rows for p in self.plans}))

    def start(self) -> None:
        startup.measure_costs(self)
        self.policy.widen(self.e.buckets)
        startup.capture_whole(self)

    def launch(self, b: int, n: int, sampling: bool, clock):
        logits, t = self.launch_round(b, n, sampling, clock)
        return logits, PlanRound(b, sampling, t.plan) in self.e.cache, t

    def copy_out(self, t: Ticket, buf: int, n: int) -> None:
        if t.drafted and self.policy.decide == "previous":
            self.est_host[buf, :n].copy_(self.est[:n], non_blocking=True)
            if self.plans[t.plan].kind == "tree":   # `landing` reads a tree round's path alone
                self.paths_host[buf, :n].copy_(self.paths[:n], non_blocking=True)

    def block(self, b: int, plan):
        """The verify block of `plan`'s round over slots [0, b): AR the root alone, the chain or the tree
        truncated to the plan's rows, from the front's static buffers."""
        root, lens = self.e.root[:b], self.e.lens[:b]
        if plan.kind == "ar":
            return _chain(None, root, lens)
        front = self.front_view(b)
        if plan.kind == "chain":
            return _chain(None, root, lens, front.chain)
        return truncate(front.blk, plan.rows)

    def walked(self, plan, acc, b: int) -> None:
        if plan.kind == "tree" and self.policy.decide == "previous":   # what `landing` reads
            self.paths[:b] = acc

    def defers(self, plan) -> bool:
        return plan.kind == "ar" and self.pend is not None

    def defer_rows(self, feats, b: int) -> None:
        """AR's block: its one row (the root, always accepted) a request into pend; padding slots do not
        count it."""
        slot = torch.arange(b, device=feats.device)
        self.pend[slot, self.pend_n[:b]] = feats[:, 0].to(self.pend.dtype)
        self.pend_n[:b] += self.e.live[:b]

    def landing(self, f, wall: float):
        """Before the landed round's tokens are handed out: its estimates and walked paths as copied, the
        pairs for `Persistence`, and `take`."""
        t, n = f.ticket, len(f.reqs)
        plan, est_paths, lag = self.plans[t.plan], None, None
        drafted = t.drafted and plan.kind != "ar"
        if drafted and self.policy.decide == "previous":
            est_paths = self.est_host[f.buf, :n].numpy(), self.paths_host[f.buf, :n]   # [n, P], [n, A]
            lag = self.ests.lag(f.reqs, t.at)
        elif drafted:   # "sync": taken before the round's fresh estimates replaced the previous ones
            lag = t.lag
        self.take(f, wall)
        return est_paths, lag

    def tree_rows(self, f) -> int:
        return self.plans[f.ticket.plan].rows

    def landed(self, f, landing, taken: dict) -> None:
        """Accept lengths about estimates: a chain round's own; a tree round's on the plan verified and on
        every smaller tree within its tree (`Spread`); the persistence pairs (`Persistence`)."""
        (est_paths, lag), i = landing, f.ticket.plan
        got = [k for k, r in enumerate(f.reqs) if r.rid in taken]
        if est_paths is not None and got:
            E = est_paths[0][got]                                                          # [m, P]
            if self.plans[i].kind == "chain":
                self.ests.spread.add(i, [taken[f.reqs[k].rid] for k in got], E[:, i])
            else:
                C = truncated_accepts(est_paths[1][got], self.cut_rows).numpy()           # [m, P]
                for j in self.cut_plans[i]:
                    self.ests.spread.add(j, C[:, j], E[:, j])
        lag = [(x[i], taken[r.rid] - m[i]) for r, x, m in lag or () if r.rid in taken]
        if lag:
            self.ests.persist.add(*np.array(lag, np.float64).T)

    def move_slot(self, src: int, dst: int) -> None:
        if self.pend is not None:
            self.pend[dst], self.pend_n[dst] = self.pend[src], self.pend_n[src]

    def clear_slot(self, s: int) -> None:
        if self.pend is not None:
            self.pend_n[s].fill_(0)

    def reset(self) -> None:
        self.pend_n.zero_()

    def idle(self) -> None:
        self.flush()   # the last round's times into the cost table now
        self.ahead = None
        self.policy.restart()  # the next batch's holds start over (its estimates: the requests' mean)

    # ------------------------------------------------------------- the round's phases and decisions
    def front(self, b: int, build: int, clock=None) -> None:
        """budget="auto", a drafting round's first phase over slots [0, b): draft, the tree of `build` nodes,
        the chain, into the static buffers (`front_view`), and every plan's expected tokens into `est`
        [b, P] (plans beyond the tree: extrapolated, `budget.expected`). No host reads (the golden backend's
        aside)."""
        mark = clock or (lambda stage: None)
        with blas_for(self.e.device, b * self.e.max_accept):
            draft = self.e.runner.draft(b)                                                        # [b, L, V]
        mark("draft")
        ops = self.tree_ops[build]
        blk = ops.build(draft, self.e.root[:b], self.e.lens[:b])
        chain = ops.estimates(self.acceptance, blk, draft, self.plans, self.est[:b])      # [b, L]
        if self.fbuf is None:  # the first front phase runs eagerly (a warm-up round or an eager engine)
            def room(t, *shape):
                return None if t is None else torch.zeros(self.e.max_batch, *shape, dtype=t.dtype,
                                                          device=t.device)
            N, W = self.e.rows, -(-self.e.rows // 32)
            cols = [room(getattr(blk, f), N) for f in ("tokens", "positions", "parents")]
            self.fbuf = Front(type(blk)(*cols, room(blk.mask, N, N), room(blk.mask_words, N, W),
                                          room(blk.depths, N), room(blk.scores, N)),
                                room(chain, chain.shape[1]))
        F, N = self.fbuf.blk, blk.tokens.shape[1]
        for f in ("tokens", "positions", "parents", "depths", "scores"):
            getattr(F, f)[:b, :N].copy_(getattr(blk, f))
        if blk.mask is not None:
            F.mask[:b, :N, :N].copy_(blk.mask)
        if blk.mask_words is not None:
            F.mask_words[:b, :N, :blk.mask_words.shape[2]].copy_(blk.mask_words)
        self.fbuf.chain[:b].copy_(chain)
        mark("build")

    def catchup(self, b: int) -> None:
        """The AR plan rounds' waiting rows into the drafter's context over slots [0, b): pend_n[s] rows at
        positions lens[s] - pend_n[s] ... lens[s] - 1; the counts zeroed. No host reads."""
        lens, n = self.e.lens[:b], self.pend_n[:b]
        self.e.drafter.extend(self.e.ctx, self.pend[:b], lens - n, n)
        n.zero_()

    def front_view(self, b: int) -> Front:
        F = self.fbuf.blk
        cut = (lambda t: None if t is None else t[:b])
        names = ("tokens", "positions", "parents", "mask", "mask_words", "depths", "scores")
        return Front(type(F)(*(cut(getattr(F, f)) for f in names)), self.fbuf.chain[:b])

    def phase(self, b: int, sampling: bool, i: int | None, build: int | None = None, clock=None):
        """budget="auto": the front phase building `build` nodes (i None) or plan i's round (returns the
        logits), replaying its graph when there is one."""
        key = graphs.front(b, build) if i is None else PlanRound(b, sampling, i)
        g = self.e.cache.graphs.get(key)
        if g is not None:
            g.replay()
            return None if i is None else self.e.cache.outputs[key]
        if i is None:
            return self.front(b, build, clock)
        return self.e.runner.round(b, sampling, clock, plan=self.plans[i])

    def agree(self, i: int | None, ar_probe: bool = False) -> tuple[int | None, bool]:
        """Under tensor parallelism every rank takes rank 0's decision (plan index, whether an AR probe)."""
        if getattr(self.e.model, "tp", None) is None:
            return i, ar_probe
        import torch.distributed as dist
        group = getattr(self.e.model, "tp_group", None)
        t = torch.tensor([-1 if i is None else i, int(ar_probe)], device=self.e.device)
        dist.broadcast(t, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        v, a = t.tolist()
        return (None if v < 0 else v), bool(a)

    def decide(self, b: int, est: np.ndarray | None, ahead: bool = False) -> tuple[int, int, bool, bool]:
        """The plan decided before drafting (kdtree.budget's `before`) for the active requests at batch
        bucket b from their estimates est [n, P] (`Estimates.estimates`): (plan index, context bucket,
        whether that round is a hold's probe, whether it is an AR probe: AR's block after a draft,
        `Policy.ar_probe`).
        ahead: decided for the round after the one being launched."""
        pol = self.policy
        ctx = self.costs.ctx(sum(r.length for r in self.e.active) / len(self.e.active))
        # nothing drafted yet: build and verify the largest tree ("sync" then re-picks from fresh estimates)
        if est is None:
            i, ar_probe, probe = len(self.plans) - 1, False, pol.probe
        else:
            i = pol.before(b, est, ctx, self.ests.rounds_left(ahead))
            ar_probe, probe = pol.ar_probe, pol.probed
        i, ar_probe = self.agree(i, ar_probe)
        return i, ctx, probe, ar_probe

    def launch_round(self, b: int, n: int, sampling: bool, clock):
        """Decide (kdtree.budget), then the round's phases. Returns (logits, the round's Ticket for
        take). The decision for the next round is made once this round is launched, from the same
        estimates (the previous rounds'), so the host's scoring runs while the GPU works; after a hold's
        probe round, while no request has estimates yet, and under tensor parallelism the next round decides
        at its start."""
        pol, ev = self.policy, 4 * (self.e.runner.launched % 3)   # this round's event slots
        ahead, self.ahead = self.ahead, None
        i, ctx, probe, ar_probe = ahead if ahead is not None else self.decide(b, self.ests.estimates())
        build = pol.round_build(b, i, ar_probe)   # this round's bucket (a decision ahead may predate it)
        if self.pending and (build is not None or self.pending >= auto_budget.MAX_HOLD):
            # the drafter's context before it drafts (or pend is full); outside both phases' marks, so its
            # time falls to the host share, a median that a rare catch-up round does not move
            g = self.e.cache.graphs.get(graphs.catchup(b))
            g.replay() if g is not None else self.catchup(b)
            self.pending = 0
        t = Ticket(i, b, n, ctx, build, build is not None, self.e.runner.launched)
        whole = graphs.whole(b, sampling, i)
        prefix = self.e.prefix
        if build is not None and not ar_probe and whole in self.e.cache:   # front and block in one replay
            if prefix is not None:
                prefix.plan(b, self.plans[i].rows)
            t.f0 = self.stamps(ev)
            self.e.cache.graphs[whole].replay()
            t.b1 = self.stamps(ev + 3)
            self.whole_replays += 1
            logits = self.e.cache.outputs[whole]
        else:
            if build is not None:
                t.f0 = self.stamps(ev)
                self.phase(b, sampling, None, build, clock)
                t.f1 = self.stamps(ev + 1)
                if pol.decide == "sync":  # the fresh estimates to the host, then the block within the tree
                    self.est_host[0, :n].copy_(self.est[:n], non_blocking=True)
                    self.e.sync()
                    fresh = self.est_host[0, :n].numpy().copy()
                    t.lag = self.ests.lag(self.e.active, self.e.runner.launched)
                    self.ests.take(self.e.active, fresh, self.e.runner.launched)
                    ar = self.plans[i].kind == "ar"   # an AR probe: AR's block stays a candidate
                    i = t.plan = self.agree(pol.after(b, self.ests.expected(self.e.active, fresh), ctx, build,
                                                      ar))[0]
            if prefix is not None:   # the plan is final now (after "sync"'s re-pick)
                prefix.plan(b, self.plans[i].rows)
            same = build is not None and pol.decide == "previous"
            t.b0 = t.f1 if same else self.stamps(ev + 2)
            logits = self.phase(b, sampling, i, clock=clock)
            t.b1 = self.stamps(ev + 3)
        if self.plans[i].kind == "ar" and self.pend is not None:   # its row waits in pend (an AR probe's too)
            self.pending += 1
        self.flush()   # the previous round's times, while the GPU runs this one
        # under TP each rank's policy state is its own (rank 0's choice is broadcast), so whether to decide
        # ahead could differ between ranks and their broadcasts would not pair up: TP decides at round start
        tp = getattr(self.e.model, "tp", None) is not None
        est = None if probe or tp else self.ests.estimates(ahead=True)
        if est is not None:
            self.ahead = self.decide(b, est, ahead=True)
        return logits, t

    def take(self, f, wall: float) -> None:
        """After round f's sync: its estimates to its requests (rows in its launch order), its plan to the
        history; its phases' times wait in `timing` for `flush` (run after the next round is launched, off the
        GPU's idle gap)."""
        n, t = len(f.reqs), f.ticket
        if t.drafted and self.policy.decide == "previous":
            self.ests.take(f.reqs, self.est_host[f.buf, :n].numpy(), t.at)
        name = self.plans[t.plan].name
        if t.drafted and self.plans[t.plan].kind == "ar":
            name = auto_budget.AR_PROBE
        self.policy.history.append((self.e.rounds, n, name))
        self.e.last_round["plan"] = name
        self.timing.append((t, wall))

    def flush(self) -> None:
        """The waiting rounds' phase times into the cost table (CUDA events read after their round's sync).
        A round of n requests in a bucket of b > n refreshes the entries of (b, n) (`CostTable.key`): padding
        slots' rows (root 0 at length 0, alike) read fewer experts than requests' rows, so a batch's last
        rounds, folded into the full bucket's entries, would make every plan look cheaper when the next
        batch starts full."""
        costs, secs = self.costs, self.stamps.secs
        for t, wall in self.timing:
            b, c = costs.key(t.b, t.n), t.ctx
            if t.b0 is None:   # a whole-round replay: the plan's share is the round less its front's entry
                front = costs.entry(costs.front, b, (t.build,), c) or 0.0
                back = max(secs(t.f0, t.b1) - front, 0.0)
            else:
                back = secs(t.b0, t.b1)
                front = secs(t.f0, t.f1) if t.drafted else 0.0
                if t.drafted:
                    costs.update(costs.front, (b, t.build, c), front)
            costs.update(costs.back, (b, t.plan, c), back)
            costs.add_host(max(0.0, wall - front - back))
            costs.samples += 1
        self.timing.clear()

