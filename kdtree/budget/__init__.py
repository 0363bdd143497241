"""The cost-aware tree budget (`Engine(mode="ddtree", budget="auto")`): which block each round verifies.

A round's candidates (`Plan`): plain AR (the root alone, no draft), the DFlash chain (argmax per depth) and
the best-first tree truncated to B nodes for each B in the engine's `budgets` (every truncation of a
best-first tree is the B-node tree). A plan's round builds its own tree (`builds`; the chain's round the
smallest), or a larger one where the measured front phase costs at most FRONT_SLACK more (`wider_builds`:
at K2.6's vocabulary the drafter dominates the front and a 128-node build costs ~2 % over a 4-node one);
the estimates of trees beyond the built one are extrapolated (`expected`), so the choice can grow a size a
round and shrink at once. For a batch bucket b and the requests i of the round, the policy
picks

    argmax over plans p of   sum_i E_i(p) / (front(b, build(p), context) + back(b, p, context) + host)

E_i(p): request i's expected emitted tokens under p (`expected`: 1 + the calibrated acceptance of the plan's
nodes, from the draft's prefix probabilities; AR: 1; a plan beyond the last tree built: extrapolated), at most
the tokens the request has left. front / back: the GPU seconds of drafting + building and of verifying the
plan's block, from `CostTable`, measured when the engine starts (graph replays per batch bucket and context
bucket) and refreshed from every round's CUDA-event times (per live count within a bucket); host: the round's
host time outside them (the median of the last rounds'). Within one round every request verifies the plan's
whole block: the bucket's rows are verified whether a request fills them or not, and E_i never decreases with
B, so a request's own best truncation within the bucket is the bucket itself.

Decisions (`Policy`): "previous" decides before the round from the estimates the previous draft rounds copied
back with their output (no extra host sync), aged by the rounds since toward each request's long-run rate
(`Persistence`: with rounds overlapped the newest landed draft is two or three rounds old, and a low estimate
speaks of a round or two of hard text); "sync" decides from the previous rounds which tree to build (or
AR), then drafts and builds, copies the fresh estimates to the host (one more sync per round) and picks the
block within that tree from them. AR is a candidate only before drafting: when AR wins, the engine serves AR
rounds for a hold that doubles each time AR wins again, then drafts once (the probe) to refresh
the estimates: its best drafting plan, or AR's block after the draft (`ar_probe`: the estimates come from the
draft alone) where that costs less beyond AR's rounds for its tokens, as where a tree's verify is dear and a
probe would cost several AR rounds, and always while a static batch's end is in view for several requests
(the batch ends on its slowest request, so a drafted block's uneven tokens shorten nothing). Holds stop
doubling at MAX_HOLD, or, where a probe costs more than that many AR rounds can hide, at the hold over which
the probe's seconds beyond AR's for its tokens stay within PROBE_SHARE of the hold's (at most LONG_HOLD). A
probe whose estimates would serve fewer rounds than the hold it ends (the batch ends first: `rounds_left`) is
not run: AR serves on to the batch's end. A hold lasts at least the rounds over which its probe's excess is
FIRST_SHARE of their seconds, longer by AR's lead over the best drafting plan (a lead of LEAD doubles it: a
close call is worth probing often, a far lead seldom turns), at most MAX_HOLD (1 where the probe costs nothing
beyond AR), so that in a cell where AR wins throughout no probe costs more than that share of the hold before
it (unless the cap binds: a probe dearer than MAX_HOLD x FIRST_SHARE AR rounds), and the doubling makes the
probes' share fall from there to the hold limit's; a drafted round halves the next hold (a lone drafted round
between holds does not start the doubling over); a hold ends early, with its probe, once the aged estimates
favour a drafting plan. Where drafting wins, a plan scored within EXPLORE_GAP of the best whose cost entry no
round has refreshed lately verifies a round now and then (`Policy.explore`: the online refresh corrects only
the plans that run). The policy restarts (no hold, the next the shortest) when
the engine falls idle.

Modules: `candidates` (the plans and the trees their rounds build), `acceptance` (the expected tokens, on
the device), `costs` (the cost table), `spread` (accept lengths about their estimates: `Spread`,
`Persistence`); a batch's end (`drain`) and `Policy` are here, with every name of the others re-exported. A
knob is read from the module that defines it, so patch it there: `drain`, `Policy` and `Estimates` read
this module's (EXPLORE_AGE and EMA too, as bound here; `drain` its `ndtr`), `CostTable` those of `costs`,
`Spread` and `Persistence` those of `spread`, `wider_builds` FRONT_SLACK of `candidates`.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .acceptance import Acceptance, columns, expected
from .costs import CTX_BUCKETS, EMA, EXPLORE_AGE, HOST_WINDOW, CostTable
from .candidates import FRONT_SLACK, Plan, builds, default_budgets, larger_trees, plans, wider_builds
from .spread import PERSIST_PRIOR, REALIZED_PRIOR, REALIZED_SE, SPREAD_PRIOR, Persistence, Spread

__all__ = [
    # candidates
    "FRONT_SLACK", "Plan", "builds", "default_budgets", "larger_trees", "plans", "wider_builds",
    # acceptance
    "Acceptance", "columns", "expected",
    # costs
    "CTX_BUCKETS", "EMA", "EXPLORE_AGE", "HOST_WINDOW", "CostTable",
    # spread
    "PERSIST_PRIOR", "REALIZED_PRIOR", "REALIZED_SE", "SPREAD_PRIOR", "Persistence", "Spread",
    # a batch's end and the policy (here)
    "DRAIN_POINTS", "drain", "longest_accepts", "ndtr",
    "AR_PROBE", "DECIDE", "EXPLORE_EVERY", "EXPLORE_GAP", "FIRST_SHARE", "LEAD", "LONG_HOLD", "MAX_HOLD",
    "PROBE_SHARE", "SHRINK", "Policy",
]

DECIDE = ("previous", "sync")
MAX_HOLD = 32          # AR holds double up to this (and the drafter's deferred context holds this many rows)
LONG_HOLD = 256        # ... or up to this where a probe is dear (PROBE_SHARE)
PROBE_SHARE = 0.01     # a probe's excess over AR may cost at most this share of the hold before it
FIRST_SHARE = 0.01     # ... and at most this share of the shortest hold (`hold_floor`, up to MAX_HOLD)
SHRINK = 4             # rounds of weight of the requests' mean estimate in a request's rate to its end
EXPLORE_GAP = 0.2      # a drafting plan scored within this of the best ...
# ... whose cost no round refreshed in EXPLORE_AGE rounds (`costs`) verifies one round (`explore`)
EXPLORE_EVERY = 32     # ... at most one such round in this many
LEAD = 0.25            # AR's lead over the best drafting plan that doubles the shortest hold (`hold_floor`)
AR_PROBE = "AR+draft"  # the history's name of an AR probe's round (`Policy.ar_probe`)
DRAIN_POINTS = 64      # `drain` sums a batch's end over at most this many points per plan


# ----------------------------------------------------------------------------- a batch's end
@functools.cache
def _geometric(longest: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of an accept length L in [1, longest] whose steps each pass with one probability a
    (P(L >= k) = a^(k-1)), on a grid of a from 0 to 1: both ascend with a for longest > 1."""
    a = np.linspace(0.0, 1.0, 1025)[:, None]
    k = np.arange(longest)[None, :]
    p = a ** k                                     # [grid, longest]  P(L >= k + 1)
    m = p.sum(1)
    return m, (p * (2 * k + 1)).sum(1) - m * m


def ndtr(x: np.ndarray) -> np.ndarray:
    """The standard normal CDF of x, elementwise, in numpy (erfc by Abramowitz & Stegun 7.1.26: absolute
    error below 1e-7). The policy's host math stays in numpy: a torch CPU op may wake its thread pool."""
    x = np.asarray(x, np.float64)
    z = np.abs(x)
    z *= math.sqrt(0.5)
    t = 0.3275911 * z
    t += 1.0
    np.reciprocal(t, out=t)
    y = 1.061405429 * t      # Horner's rule in place: a few passes over large arrays
    for coef in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        y += coef
        y *= t
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    y *= z
    y *= 0.5                                                               # 0.5 * erfc(|x| / sqrt 2)
    return np.where(x >= 0, 1.0 - y, y)


def longest_accepts(plan_list, depth: int) -> np.ndarray:
    """[P] each plan's longest accept length: 1 for AR, 1 + min(nodes, depth) for a chain or tree."""
    return np.array([1 if p.kind == "ar" else 1 + min(p.nodes, depth) for p in plan_list])


def drain(est: np.ndarray, left: np.ndarray, longest: np.ndarray, spread=None) -> np.ndarray:
    """A batch that nothing waits to join (or whose freed slots wait for company) ends with its last
    request. est [n, P] (each plan's expected tokens a round per request, at most its tokens left), left [n]
    (tokens left), longest [P] (`longest_accepts`) -> est' [n, P], est'[r, i] = left_r / M_i, where M_i is
    the expected rounds until every request has ended under plan i: sum over k >= 0 of P(some request needs
    more than k rounds), with P(request r has ended after k rounds) = P(S_k >= left_r), S_k the sum of k
    independent accept lengths of the request's mean taken as normal with a half-token continuity
    correction. The sum of k lengths, not the round count, is what is near normal: its spread grows with k,
    giving the count the long right tail that decides the largest of n (a normal count falls short by about
    half a round at batch 32). A plan's summed est' over its round's cost is then its tokens per second to
    the batch's end: a plan that ties AR per round but spreads its requests' ends loses. At one request M is
    that request's expected rounds, est' its tokens left over them. An accept length's variance: spread
    None, the truncated geometric's of its mean in [1, longest] (`_geometric`: a chain whose steps pass
    alike); else spread [P] (`Spread.ratios`) times (mean - 1), as measured (a best-first tree's lengths
    spread far less than the geometric's of its longest accept, which it seldom reaches)."""
    n, P = est.shape
    left = np.asarray(left, np.float64)[:, None]                                        # [n, 1]
    mu = np.clip(np.asarray(est, np.float64), 1.0, np.asarray(longest, np.float64)[None, :])   # [n, P]
    if spread is None:
        var = np.zeros_like(mu)
        for i, A in enumerate(np.asarray(longest).tolist()):
            if A > 1:
                var[:, i] = np.interp(mu[:, i], *_geometric(int(A)))
    else:
        var = np.asarray(spread, np.float64)[None, :] * (mu - 1.0)
    # per plan, the rounds k in [lo, hi) where the batch's end is in doubt (a count's mean -/+ 6 spreads,
    # ndtr(-6) = 1e-9):
    # before lo some request has surely not ended; from hi, or ceil(max left) rounds (a token a round), all
    m, w = left / mu, 6 * np.sqrt(left * var / mu ** 3) + 2                             # [n, P]
    lo = np.maximum((m - w).max(0).astype(np.int64), 1)                                # [P]
    hi = np.maximum(np.minimum(np.ceil(left.max()), (m + w).max(0) + 1).astype(np.int64), lo)
    # a window wider than DRAIN_POINTS rounds is summed in blocks of s rounds, each at its middle (the end's
    # spread is some 16 count spreads wide: s stays near a quarter of one, where the sum is smooth)
    s = np.maximum(-(-(hi - lo) // DRAIN_POINTS), 1)                                   # [P]
    start = lo[:, None] + s[:, None] * np.arange(int((-(-(hi - lo) // s)).max()))[None, :]   # [P, k]
    c = np.clip(hi[:, None] - start, 0, s[:, None])                                    # rounds per block
    k = start + (c - 1) / 2.0
    # request r has ended after k rounds with probability ndtr((k mu - (left - 0.5)) / sqrt(k var)), written
    # as a sqrt(k) - b / sqrt(k) to keep the [n, P, k] work to two products and a difference
    sv = np.sqrt(var)                                                                   # [n, P]
    flat = sv == 0
    sv[flat] = 1.0
    a, b, sk = mu / sv, (left - 0.5) / sv, np.sqrt(k)                                   # [n, P], [P, k]
    ended = ndtr(a[:, :, None] * sk[None] - b[:, :, None] * (1.0 / sk)[None])          # [n, P, k]
    if flat.any():
        # a request of no spread ends at the first round past (left - 0.5) / mu: the share of a block's
        # rounds at or past it (a step within a block of s rounds, not a step at its middle)
        r, i = np.nonzero(flat)
        first = np.floor((left[r, 0] - 0.5) / mu[r, i])[:, None] + 1                    # [m, 1]
        ended[r, i] = np.clip(start[i] + c[i] - first, 0, c[i]) / np.maximum(c[i], 1)
    M = lo + (c * (1.0 - ended.prod(0))).sum(1)                                        # [P]
    return left / M[None, :]



# ----------------------------------------------------------------------------- the policy
class Policy:
    """Chooses each round's plan (module docstring). `history` keeps (round, batch, plan name) of every
    round."""

    def __init__(self, plan_list, costs: CostTable, decide: str = "previous"):
        self.plans, self.costs, self.decide = tuple(plan_list), costs, decide
        self.builds = builds(self.plans)   # per plan: the tree its round builds (`widen` per batch bucket)
        self._builds: dict = {}
        self._explored = -math.inf   # the table's `samples` at the last `explore` round
        self.restart()
        self.history: list = []

    def restart(self) -> None:
        """No hold, and the next one the shortest (`hold_floor`): at the start, and whenever the engine falls
        idle (a batch that starts then is not bound by the holds that its predecessor's end decided)."""
        self.hold = 0        # AR rounds left before the next draft round
        self.backoff = 1     # the next AR hold's length before `hold_floor` and the hold limit apply
        self.probe = False   # the next round drafts whatever the estimates say
        self.served = 0      # the current (or last) hold's length
        self.ar_probe = False  # the last decision: AR's block after a draft (a probe of less excess)
        self.probed = False    # ... a hold's probe

    def widen(self, buckets) -> None:
        """After the start-up cost table: each batch bucket's builds (`wider_builds`)."""
        self._builds = {b: wider_builds(self.plans, self.costs, b) for b in buckets}

    def build(self, b: int, i: int):
        """The tree plan i's round builds at batch bucket b (None: AR, no draft)."""
        return self._builds.get(b, self.builds)[i]

    def score(self, b: int, est: np.ndarray, ctx: int, allow, built: int | None = None) -> np.ndarray:
        """Expected tokens per second of the round for each plan (-inf where not allowed): est [n, P]; built:
        the tree this round has built already (its cost for every plan), else each plan's own build."""
        tot = np.asarray(est, np.float64).sum(0).tolist()
        cost, n = self.costs.cost, len(est)
        out = []
        for i, p in enumerate(self.plans):   # a few plans: plain Python beats numpy's per-call overhead
            c = cost(b, i, self.build(b, i) if built is None else built, ctx, n)
            out.append(tot[i] / c if allow(p) and 0 < c < math.inf else -math.inf)
        return np.array(out)

    def before(self, b: int, est: np.ndarray, ctx: int, rounds_left: int | None = None) -> int:
        """The plan decided before drafting, from the previous rounds' estimates est [n, P]: 0 (AR) or the
        plan whose tree (`build`) the round builds; "previous" verifies that plan, "sync" picks the block
        again from the fresh estimates (`after`). AR rounds come in holds; a hold's end forces one draft round
        (the probe) whose estimates the next decision reads, unless rounds_left (the rounds, this one
        included, until the batch's last request ends under AR; None: unknown, e.g. requests wait) leaves
        fewer rounds after the probe than the hold served: then the hold goes on a round at a time. A hold
        ends early, with its probe, once est (aged by the engine a round more each AR round, `Persistence`)
        scores a drafting plan above AR. `probed`: whether this decision is a hold's probe."""
        self.ar_probe, self.probed = False, False
        if self.hold > 0 and self.plans[int(np.argmax(self.score(b, est, ctx, lambda p: True)))].kind != "ar":
            # the estimates, aged (`Persistence`), favour a draft: probe now; the hold served fewer rounds
            # than planned, and the next one doubles from those
            done = self.served - self.hold
            self.served, self.backoff = done, min(self.backoff, max(2 * done, 1))
            self.hold, self.probe = 0, True
        if self.hold == 0 and not self.probe:
            s = self.score(b, est, ctx, lambda p: True)
            best = int(np.argmax(s))
            if self.plans[best].kind != "ar" or not np.isfinite(s[best]):
                self.backoff = max(self.backoff // 2, 1)
                return self.explore(b, s, len(est), ctx)
            ar_probe, static = self._ar_probe_score(b, est, ctx), rounds_left is not None
            limit = self.hold_limit(s, est, ar_probe, static)
            self.hold = min(max(self.backoff, self.hold_floor(s, est, ar_probe, static)), limit)
            self.backoff = min(2 * self.hold, limit)
            self.served = self.hold
        if self.hold > 0:
            self.hold -= 1
            if self.hold == 0 and rounds_left is not None and rounds_left - 1 <= self.served:
                self.hold = 1   # the probe's estimates would serve fewer rounds than the hold
            self.probe = self.hold == 0
            return 0
        self.probe, self.probed = False, True
        s = self.score(b, est, ctx, lambda p: True)
        self.ar_probe = self._probe_is_ar(s, est, self._ar_probe_score(b, est, ctx), rounds_left is not None)
        return 0 if self.ar_probe else self._best_draft(s)

    def explore(self, b: int, s: np.ndarray, n: int, ctx: int) -> int:
        """The drafting plan to verify when drafting wins by the scores s: the best, or, in a full bucket
        (n == b), the best of the drafting plans scored within EXPLORE_GAP of it whose back entry no round
        has refreshed in EXPLORE_AGE rounds (the table's online refresh corrects only the plans that run: a
        start-up entry measured dear would keep its plan out for good), at most one round in EXPLORE_EVERY:
        at most EXPLORE_GAP / EXPLORE_EVERY of the tokens per second by the scores. Under "sync" the best:
        `after` picks the block from the fresh estimates, so an explored build would not verify its plan."""
        j = self._best_draft(s)
        seen, now = self.costs.seen, self.costs.samples
        if (self.decide != "previous" or n != b or not np.isfinite(s[j]) or s[j] <= 0
                or now - self._explored < EXPLORE_EVERY):
            return j
        stale = [k for k, p in enumerate(self.plans) if p.kind != "ar" and k != j and np.isfinite(s[k])
                 and s[k] >= (1 - EXPLORE_GAP) * s[j]
                 and now - seen.get((b, k, ctx), -math.inf) > EXPLORE_AGE]
        if not stale:
            return j
        self._explored = now
        return max(stale, key=lambda k: s[k])

    def _probe_is_ar(self, s: np.ndarray, est: np.ndarray, ar_probe: float, static: bool) -> bool:
        """Whether a hold's probe verifies AR's block after its draft (else the best drafting plan): where
        that costs less beyond AR's rounds (`_excess`), and always where a static batch's end is in view
        (static: `rounds_left` known) for several requests. There the batch ends on its slowest request: a
        drafted block's tokens land unevenly across the requests and AR serves on after it, so its tokens
        beyond the slowest request's shorten nothing (the estimates assume the plan serves on, `drain`)."""
        xj, xa = self._excess(s, est, ar_probe)
        return xa < xj or (static and len(est) > 1 and math.isfinite(xa))

    def _excess(self, s: np.ndarray, est: np.ndarray, ar_probe: float) -> tuple[float, float]:
        """(the best drafting plan's, an AR probe's) round seconds beyond AR's for the same tokens, in AR
        rounds, from the scores s (AR's first) and an AR probe's score: a probe's cost while AR serves on
        (inf where a score is missing)."""
        tot = np.asarray(est, np.float64).sum(0)
        if not (self.plans[0].kind == "ar" and np.isfinite(s[0]) and s[0] > 0 and tot[0] > 0):
            return 0.0, math.inf
        j = self._best_draft(s)
        xj = (tot[j] / tot[0]) * (s[0] / s[j] - 1) if np.isfinite(s[j]) and s[j] > 0 else math.inf
        xa = s[0] / ar_probe - 1 if np.isfinite(ar_probe) and ar_probe > 0 else math.inf
        return float(xj), float(xa)

    def probe_build(self, b: int) -> int:
        """The tree an AR probe's round builds at batch bucket b: the cheapest drafting plan's (the chain's),
        whose estimates cover every plan (`expected` extrapolates beyond it)."""
        got = [B for B in self._builds.get(b, self.builds) if B is not None]
        return min(got)

    def round_build(self, b: int, i: int, ar_probe: bool = False):
        """The tree the round of decision (i, ar_probe) builds at batch bucket b (None: no draft)."""
        return self.probe_build(b) if ar_probe else self.build(b, i)

    def _ar_probe_score(self, b: int, est: np.ndarray, ctx: int) -> float:
        """Expected tokens per second of an AR probe's round (the draft of `probe_build`, then AR's block)."""
        if self.plans[0].kind != "ar" or not any(B is not None for B in self.builds):
            return -math.inf
        c = self.costs.cost(b, 0, self.probe_build(b), ctx, len(est))
        tot = float(np.asarray(est, np.float64)[:, 0].sum())
        return tot / c if 0 < c < math.inf else -math.inf

    def hold_limit(self, s: np.ndarray, est: np.ndarray, ar_probe: float = -math.inf,
                   static: bool = False) -> int:
        """The longest AR hold when AR scores best (`s`, tokens per second per plan; est [n, P]; ar_probe:
        an AR probe's score, `_ar_probe_score`; static: a static batch's end in view): MAX_HOLD, or the hold
        whose AR rounds make the probe's excess (`_excess`, of the probe `before` runs: `_probe_is_ar`) at
        most PROBE_SHARE of their seconds, up to LONG_HOLD."""
        need = self._probe_excess(s, est, ar_probe, static) / PROBE_SHARE
        if not math.isfinite(need):
            return MAX_HOLD
        return int(min(LONG_HOLD, max(MAX_HOLD, math.ceil(need))))

    def hold_floor(self, s: np.ndarray, est: np.ndarray, ar_probe: float = -math.inf,
                   static: bool = False) -> int:
        """The shortest AR hold (`hold_limit`'s arguments): the rounds over which the excess of the probe
        that ends it is FIRST_SHARE of their seconds, times 1 + AR's lead over the best drafting plan
        (`lead`) / LEAD (a probe pays where the call is close; where AR leads far, fresh estimates seldom
        overturn it), from 1 (a probe at AR's cost, or no finite excess) to MAX_HOLD."""
        need = self._probe_excess(s, est, ar_probe, static) / FIRST_SHARE * (1 + self.lead(s) / LEAD)
        if not math.isfinite(need):
            return 1
        return int(min(MAX_HOLD, max(1, math.ceil(need - 1e-9))))

    def lead(self, s: np.ndarray) -> float:
        """AR's lead over the best drafting plan by the scores s (AR's first): s_AR / s_best - 1, at least 0
        (0 where a score is missing)."""
        j = self._best_draft(s)
        if not (self.plans[0].kind == "ar" and np.isfinite(s[0]) and np.isfinite(s[j]) and s[j] > 0):
            return 0.0
        return max(float(s[0] / s[j]) - 1.0, 0.0)

    def _probe_excess(self, s: np.ndarray, est: np.ndarray, ar_probe: float, static: bool) -> float:
        """The excess (`_excess`, in AR rounds) of the probe a hold ends with (`_probe_is_ar`)."""
        xj, xa = self._excess(s, est, ar_probe)
        return xa if self._probe_is_ar(s, est, ar_probe, static) else xj

    def after(self, b: int, est: np.ndarray, ctx: int, built: int, ar: bool = False) -> int:
        """"sync": the block, once the round has built a tree of `built` nodes: the best plan other than AR
        (ar, an AR probe's round: AR too) within it for the fresh estimates est [n, P] (the round's front cost
        is the same for all of them)."""
        ok = (lambda p: p.kind == "chain" or (p.kind == "tree" and p.nodes <= built))
        s = self.score(b, est, ctx, lambda p: ok(p) or (ar and p.kind == "ar"), built)
        k = int(np.argmax(s))
        return k if ar and np.isfinite(s[k]) and self.plans[k].kind == "ar" else self._best_draft(s)

    def _best_draft(self, s: np.ndarray) -> int:
        s = np.where([p.kind == "ar" for p in self.plans], -np.inf, s)
        return int(np.argmax(s)) if np.isfinite(s).any() else len(self.plans) - 1
