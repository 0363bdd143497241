"""budget="auto"'s estimates: each request's expected tokens per plan, as the policy reads them.

A drafted round copies every plan's expected tokens for its requests back with its output (`take`); the
policy decides a later round from them, aged toward each request's long-run rate (`Persistence`), capped at
the tokens left, and, while the batch's end is in view (makespan), through `drain` of the long-run rates.
The per-request record (`Request.est`, `est_sum`, `est_n`, `est_at`) is this module's.
"""
from __future__ import annotations

import numpy as np

from .. import budget as auto_budget


class Estimates:
    """The active requests' estimates for `Policy.before` / `after` (engine: for its requests, queue and
    round counters; makespan, longest: `AutoConfig.makespan`, `longest_accepts`)."""

    def __init__(self, engine, n_plans: int, makespan: bool, longest: np.ndarray):
        self.e = engine
        self.makespan, self.longest = makespan, longest
        self.prior = None   # the mean estimates of the requests so far (for a request not yet drafted)
        self.spread = auto_budget.Spread(n_plans)   # drafted rounds' accept lengths about estimates
        self.persist = auto_budget.Persistence()    # ... and how long an estimate holds

    def end_in_view(self) -> bool:
        """Whether the active requests' end is the batch's end the policy plans for (makespan on, and no
        request waiting for a slot it would take as soon as it frees: `Scheduler.grouping`)."""
        return self.makespan and not (self.e.waiting and not self.e.scheduler.grouping())

    def estimates(self, ahead: bool = False) -> np.ndarray | None:
        """[n, P] expected tokens of the active requests in the round being launched (ahead: the one after
        it) from their last draft rounds, aged by the rounds since toward each request's long-run rate
        (`budget.Persistence`; a request not drafted yet: the mean of the requests so far), as the policy
        reads them (`expected`); None before any request drafted."""
        rows = [self.prior if r.est is None else r.est for r in self.e.active]
        if any(x is None for x in rows):
            return None
        if self.end_in_view() and len(self.e.active) > 1:   # `drain` reads the long-run rates alone
            return self.expected(self.e.active, np.stack(rows))
        m, at = self.long_run(self.e.active, np.stack(rows)), self.e.runner.launched + int(ahead)
        rows = [row if r.est is None else self.persist.age(row, m[k], at - r.est_at)
                for k, (r, row) in enumerate(zip(self.e.active, rows))]
        return self.expected(self.e.active, np.stack(rows))

    def expected(self, reqs: list, est: np.ndarray) -> np.ndarray:
        """The policy's input from estimates est [n, P] of reqs: capped at the tokens left (`capped`), and
        with makespan on, while no request waits for a slot or freed slots wait for company
        (`Scheduler.grouping`),
        the batch's end in view (`budget.drain` of each request's long-run rate, `long_run`, its tokens
        beyond the root scaled per plan by how far the estimates held in the rounds so far, `Spread.realized`,
        and the accept lengths' measured spread, `spread`). The batch ends on its slowest requests: there a
        few per cent between plans turn the choice, and the drafter's calibration, which holds on average on
        held-out text, may miss this run's gain from a larger tree."""
        if not self.end_in_view() or len(reqs) < 2:
            return self.capped(reqs, est)
        m = 1.0 + (self.long_run(reqs, est) - 1.0) * self.spread.realized()[None, :]   # [n, P]
        return auto_budget.drain(self.capped(reqs, m), Estimates.left(reqs),
                                 self.longest, self.spread.ratios())

    def long_run(self, reqs: list, est: np.ndarray) -> np.ndarray:
        """[n, P] each request's expected tokens a round over the rest of its output, for `budget.drain`: the
        mean of its draft rounds' estimates, shrunk toward the requests' mean (`prior`; else est's mean) with
        the weight of auto_budget.SHRINK rounds. One round's estimate (est [n, P]) speaks of the text just
        ahead: the lowest of a batch's, read as a request's rate to its end, would make every drafting plan's
        end look as late as that one round's."""
        prior = est.mean(0) if self.prior is None else self.prior
        k, zero = auto_budget.SHRINK, np.zeros_like(prior, np.float64)
        sums = np.stack([zero if r.est_sum is None else r.est_sum for r in reqs])             # [n, P]
        n = np.array([r.est_n for r in reqs], np.float64)[:, None]
        return np.where(n > 0, (sums + k * prior) / (n + k), prior)   # no draft round yet: the prior

    @staticmethod
    def left(reqs: list) -> np.ndarray:
        """[n] each request's tokens left: max_new less those emitted as of the last landed round, at
        least 1."""
        return np.array([max(r.max_new - len(r.result.tokens), 1) for r in reqs], np.float64)

    @staticmethod
    def capped(reqs: list, est: np.ndarray) -> np.ndarray:
        """est [n, P] with request i's row capped at its tokens left (`left`): tokens past a request's end
        are not emitted, so near its end a smaller plan (or AR) loses nothing of what it counts."""
        return np.minimum(est, Estimates.left(reqs)[:, None])

    def take(self, reqs: list, rows: np.ndarray, at: int) -> None:
        """rows [n, P]: the estimates of reqs (a round's requests in its slot order at launch) drafted by the
        round of launch index `at`; a request that left since is skipped."""
        rows = np.array(rows, np.float64)   # a copy: each request keeps a row of its own
        for r, row in zip(reqs, rows):
            if r.slot >= 0:
                r.est, r.est_at = row, at
                r.est_sum = row if r.est_sum is None else r.est_sum + row
                r.est_n += 1
        m = rows.mean(0)
        self.prior = m if self.prior is None else (1 - auto_budget.EMA) * self.prior + auto_budget.EMA * m

    def lag(self, reqs: list, at: int) -> list:
        """Before drafted round `at` hands its estimates over: (request, x [P], m [P]) for each of reqs whose
        estimates come from the round before it (at - 1), m its long-run rates, x its estimates less m
        (`budget.Persistence`: the round's plan picks the column, its accept length gives the pair's y)."""
        got = [r for r in reqs if r.slot >= 0 and r.est is not None and r.est_at == at - 1]
        if not got:
            return []
        m = self.long_run(got, np.stack([r.est for r in got]))
        return [(r, r.est - mk, mk) for r, mk in zip(got, m)]

    def rounds_left(self, ahead: bool = False) -> int | None:
        """AR rounds until the batch's last active request ends, for the round being launched (ahead: the
        one after it): its tokens left as of the last landed round, less one a round for the rounds launched
        and not landed (each emits at least one token), at least 1; None while requests wait for a slot that
        they take as soon as it frees (not `Scheduler.grouping`) or with makespan off (the batch's end is not
        in view).
        Where freed slots wait for company, the requests admitted together end as a static batch does."""
        if not self.end_in_view() or not self.e.active:
            return None
        unlanded = self.e.runner.launched - self.e.rounds + int(ahead)
        return max(int(self.left(self.e.active).max()) - unlanded, 1)

