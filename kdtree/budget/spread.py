"""What drafted rounds' accept lengths say about their estimates: how they spread about them (`Spread`) and
how far an estimate speaks of the rounds after its own (`Persistence`).

`Spread.ratios` gives `drain` its variance per plan and `Spread.realized` how far the calibrated estimates
held (`Estimates.expected`); `Persistence.age` ages an estimate by the rounds since its draft. Host maths in
numpy only (a torch CPU op may wake its thread pool).
"""
from __future__ import annotations

import numpy as np

REALIZED_PRIOR = 16.0  # `Spread.realized`: tokens of (estimate - 1) at the pooled ratio (the pooled: 1)
REALIZED_SE = 1.0      # ... a ratio's departure from its prior counts beyond this many standard errors
SPREAD_PRIOR = 16.0    # `Spread`: tokens of (estimate - 1) at the pooled ratio (the pooled: at 1)
PERSIST_PRIOR = 4.0    # `Persistence`: a prior of this much x^2 (tokens^2) at slope 1


class Spread:
    """The drafted rounds' accept lengths L about their estimates E, per plan: ratios()[i] = sum (L - E)^2 /
    sum (E - 1) over plan i's requests' rounds (`drain`'s variance: the ratio times the mean less one), with
    SPREAD_PRIOR tokens of E - 1 at the pooled ratio of every plan's rounds (itself from SPREAD_PRIOR at 1).
    The residual holds the estimates' own error too: the spread a batch's end sees. The engine adds the
    rounds of decide="previous" (whose estimates it copies back with the round's output): a tree round adds
    one round to the plan it verified and to every smaller tree plan, whose accept length on the truncated
    tree the same walk gives (`round_ops.truncated_accepts`); a chain round, to the chain alone. `realized`:
    the same rounds' accept lengths against their estimates, per plan."""

    def __init__(self, n_plans: int):
        self.res, self.base, self.got = np.zeros(n_plans), np.zeros(n_plans), np.zeros(n_plans)

    def add(self, i: int, lengths: np.ndarray, expected: np.ndarray) -> None:
        """One round of plan i: its requests' accept lengths and estimates [n]."""
        L, e = np.asarray(lengths, np.float64), np.asarray(expected, np.float64)
        self.res[i] += float(((L - e) ** 2).sum())
        self.base[i] += float(np.maximum(e - 1.0, 0.0).sum())
        self.got[i] += float((L - 1.0).sum())

    def realized(self) -> np.ndarray:
        """[P] per plan, sum (L - 1) / sum (E - 1) over its requests' rounds, with REALIZED_PRIOR tokens of
        E - 1 at the pooled ratio of every plan's rounds (itself from REALIZED_PRIOR at 1): how far the
        calibrated estimates held in this engine's rounds (`Estimates.expected` scales the rates that `drain`
        reads by it). The pooled prior keeps a plan not run level with those run: at a prior of 1 the plan
        served first, its ratio above 1 where the calibration runs low for every plan, would keep the rest
        out for good. A ratio departs from its prior (the pooled ratio from 1, a plan's from the pooled)
        only by what exceeds REALIZED_SE standard errors, sqrt(sum (L - E)^2) / sum (E - 1) (soft
        thresholding): where the estimates hold (a simulated profile's are exact), the accept lengths' own
        spread moves a ratio by some 5 % over a few hundred rounds, and a start that happens to run low
        would hold AR to a static batch's end, as AR rounds (and an AR probe's) add no accept lengths."""
        k = REALIZED_PRIOR

        def shrink(ratio, prior, res, base):
            cut = REALIZED_SE * np.sqrt(res + k) / (base + k)
            return prior + np.sign(ratio - prior) * np.maximum(np.abs(ratio - prior) - cut, 0.0)
        pooled = shrink((self.got.sum() + k) / (self.base.sum() + k), 1.0, self.res.sum(), self.base.sum())
        return shrink((self.got + k * pooled) / (self.base + k), pooled, self.res, self.base)

    def ratios(self) -> np.ndarray:
        pooled = (self.res.sum() + SPREAD_PRIOR) / (self.base.sum() + SPREAD_PRIOR)
        return (self.res + SPREAD_PRIOR * pooled) / (self.base + SPREAD_PRIOR)


class Persistence:
    """How far a request's estimate speaks of the rounds after its own. A draft round's estimate E [P]
    differs from the request's long-run rate m [P] (`Estimates.long_run`); the next round's accept length L
    under plan j is m_j + s (E_j - m_j) on average, s the slope measured here: sum x y / sum x^2 over pairs
    of a request's consecutive draft rounds (x = E_j - m_j of the first round, j the second's plan; y = the
    second's L - m_j), kept apart for x < 0 and x > 0 (a hard stretch of text passes within a round or two;
    an easy one, a passage the drafter knows, lasts), with PERSIST_PRIOR of x^2 at slope 1, clamped to
    [0, 1]. An estimate a rounds old reads m + s^a (E - m) (`age`): the policy decides a round a >= 1 after
    the draft that made its estimates (2 or 3 where rounds overlap; 1 under "sync"), and an AR hold ages
    them further. The engine adds the pairs of both decide modes (`Estimates.lag`)."""

    def __init__(self):
        self.xy, self.xx = np.zeros(2), np.zeros(2)   # [below, above]

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """Pairs x [n] (E - m of a round, at the next round's plan), y [n] (the next round's L - m)."""
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        for side, sel in enumerate((x < 0, x > 0)):
            self.xy[side] += float((x[sel] * y[sel]).sum())
            self.xx[side] += float((x[sel] ** 2).sum())

    def slopes(self) -> np.ndarray:
        """[2] the slopes below and above the long-run rate."""
        return np.clip((self.xy + PERSIST_PRIOR) / (self.xx + PERSIST_PRIOR), 0.0, 1.0)

    def age(self, est: np.ndarray, m: np.ndarray, a: int) -> np.ndarray:
        """est [..., P] estimates a >= 0 rounds old about long-run rates m [..., P] -> m + s^a (est - m)."""
        s = self.slopes() ** max(int(a), 0)
        d = np.asarray(est, np.float64) - m
        return m + np.where(d < 0, s[0], s[1]) * d
