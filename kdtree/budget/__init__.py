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
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import numpy as np
import torch

DECIDE = ("previous", "sync")
FRONT_SLACK = 0.03     # a round builds a larger tree than its plan's when its front costs at most this more
MAX_HOLD = 32          # AR holds double up to this (and the drafter's deferred context holds this many rows)
LONG_HOLD = 256        # ... or up to this where a probe is dear (PROBE_SHARE)
PROBE_SHARE = 0.01     # a probe's excess over AR may cost at most this share of the hold before it
FIRST_SHARE = 0.01     # ... and at most this share of the shortest hold (`hold_floor`, up to MAX_HOLD)
DRAIN_POINTS = 64      # `drain` sums a batch's end over at most this many points per plan
SHRINK = 4             # rounds of weight of the requests' mean estimate in a request's rate to its end
REALIZED_PRIOR = 16.0  # `Spread.realized`: tokens of (estimate - 1) at the pooled ratio (the pooled: 1)
REALIZED_SE = 1.0      # ... a ratio's departure from its prior counts beyond this many standard errors
SPREAD_PRIOR = 16.0    # `Spread`: tokens of (estimate - 1) at the pooled ratio (the pooled: at 1)
PERSIST_PRIOR = 4.0    # `Persistence`: a prior of this much x^2 (tokens^2) at slope 1
EXPLORE_GAP = 0.2      # a drafting plan scored within this of the best ...
EXPLORE_AGE = 64       # ... whose cost no round refreshed in this many rounds verifies one round (`explore`)
EXPLORE_EVERY = 32     # ... at most one such round in this many
LEAD = 0.25            # AR's lead over the best drafting plan that doubles the shortest hold (`hold_floor`)
AR_PROBE = "AR+draft"  # the history's name of an AR probe's round (`Policy.ar_probe`)
EMA = 0.25             # weight of a new sample in the cost table
HOST_WINDOW = 32       # rounds whose host times' median is the table's `host` (robust to a stray slow round)
CTX_BUCKETS = (0, 1024, 4096, 16384, 65536)  # context (mean cached rows of the round's requests) buckets


@dataclass(frozen=True)
class Plan:
    kind: str    # "ar" | "chain" | "tree"
    nodes: int   # draft nodes verified: 0 (AR), L (chain) or B (tree)

    @property
    def rows(self) -> int:
        return self.nodes + 1

    @property
    def name(self) -> str:
        return {"ar": "AR", "chain": "chain"}.get(self.kind, f"B={self.nodes}")


def plans(depth: int, budgets) -> tuple[Plan, ...]:
    """The candidates: AR, the chain of `depth` nodes, then a tree per budget (ascending)."""
    return (Plan("ar", 0), Plan("chain", depth)) + tuple(Plan("tree", int(B)) for B in sorted(set(budgets)))


def builds(plan_list) -> tuple:
    """The tree each plan's round builds (None for AR): the plan's own, the smallest for the chain (its
    estimates of the trees), before any cost is measured. Larger trees' estimates are extrapolated
    (`expected`); a round builds more than it verifies only where the measured front says it costs little
    (`wider_builds`: the trained pair's tree stage grows with its nodes, one size up measured slower)."""
    sizes = [p.nodes for p in plan_list if p.kind == "tree"]
    return tuple(None if p.kind == "ar" else sizes[0] if p.kind == "chain" else p.nodes for p in plan_list)


def wider_builds(plan_list, costs: "CostTable", b: int, slack: float = None) -> tuple:
    """The tree each plan's round builds at batch bucket b once the start-up costs are measured: the largest
    tree size whose front phase (draft + build + estimates) costs at most (1 + slack) x that of the plan's
    own build (`builds`) in every measured context bucket; `builds` itself where no larger one is that cheap
    or a front cost is missing. A wider build gives measured estimates of the trees up to it where `builds`
    extrapolates them, for a front cost within `slack` (default FRONT_SLACK)."""
    slack = FRONT_SLACK if slack is None else slack
    own = builds(plan_list)
    sizes = sorted(p.nodes for p in plan_list if p.kind == "tree")
    ctxs = sorted({c for (bb, _, c) in costs.front if bb == b})
    if not ctxs:
        return own

    def front(B):
        got = [costs.front.get((b, B, c)) for c in ctxs]
        return None if any(x is None for x in got) else got
    out = []
    for B in own:
        base = None if B is None else front(B)
        if base is None:
            out.append(B)
            continue
        ok = [S for S in sizes if S >= B and front(S) is not None
              and all(f <= (1 + slack) * f0 for f, f0 in zip(front(S), base))]
        out.append(max(ok))
    return tuple(out)


def larger_trees(plan_list) -> dict:
    """{tree plan index: the indices of the larger tree plans} (`CostTable.larger`)."""
    trees = [(p.nodes, i) for i, p in enumerate(plan_list) if p.kind == "tree"]
    return {i: tuple(j for m, j in trees if m > n) for n, i in trees}


def default_budgets(max_budget: int) -> tuple[int, ...]:
    """Powers of two from 4 below max_budget, and max_budget itself."""
    out, B = [], 4
    while B < max_budget:
        out.append(B)
        B *= 2
    return tuple(out) + (max_budget,)


# ----------------------------------------------------------------------------- expected tokens, on the device
class Acceptance:
    """The calibrated acceptance of a node from its depth and prefix probability, as a device table:
    `kdtree.calibration.Calibration.correct` (the prediction times its (depth, bin)'s realized / predicted,
    at most 1; the prediction itself beyond the table's depths or with no calibration at all)."""

    def __init__(self, calibration, depth: int, device):
        if calibration is None:
            edges, ratio = [0.0, 1.0], np.ones((1, 1))
        else:
            edges, ratio = calibration.edges, calibration.ratios()                      # [D + 1, bins]
        self.depths, self.bins = ratio.shape[0] - 1, ratio.shape[1]
        # the bins' inner edges: bucketize gives the bin 0 .. bins - 1 directly (outside: the end bins)
        self.inner = torch.tensor(edges[1:-1], dtype=torch.float32, device=device)
        # row 0 zeros (depth 0: not a node), row d the ratios of depth d (the last row beyond the table)
        table = np.zeros((ratio.shape[0] + 1, self.bins), np.float32)
        table[1:] = ratio
        self.table = torch.from_numpy(table).to(device)                                # [D + 2, bins]
        self.columns: dict = {}  # expected()'s plan columns, per (tree sizes, nodes)

    def __call__(self, scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """scores float [..., n] (log prefix probabilities), depths int [..., n] (0: not a node) -> float32
        [..., n] acceptance, 0 where depth is 0 (the table's zero row). Torch ops only (capturable)."""
        p = scores.float().exp()
        j = torch.bucketize(p, self.inner, right=True)
        q = p * self.table[depths.long().clamp(max=self.depths + 1), j]
        return q.clamp_(max=1.0)


def columns(acc: Acceptance, plan_list, n: int, L: int, device) -> tuple:
    """The tree plans' columns for a block of n nodes and a chain of L, made once per (plans, n, L) and kept
    on `acc` (outside any capture: the first call is a warm-up round): idx int32 [T] (min(m, n) - 1 per tree
    plan of m nodes), k float32 [T] (log2(m / n) clamped at 0), extrapolate (any k > 0), the chain's depths
    int32 [L] (1 .. L)."""
    assert [p.kind for p in plan_list[:2]] == ["ar", "chain"] and all(p.kind == "tree" for p in plan_list[2:])
    key = (tuple(p.nodes for p in plan_list[2:]), n, L)
    if key not in acc.columns:
        k = [max(0.0, math.log2(m / n)) for m in key[0]]
        acc.columns[key] = (torch.tensor([min(m, n) - 1 for m in key[0]], dtype=torch.int32, device=device),
                            torch.tensor(k, dtype=torch.float32, device=device), max(k) > 0,
                            torch.arange(1, L + 1, dtype=torch.int32, device=device))
    return acc.columns[key]


def expected(acc: Acceptance, tree_scores, tree_depths, chain_lp, plan_list) -> torch.Tensor:
    """Expected emitted tokens per request and plan, float32 [b, len(plan_list)]: tree_scores / tree_depths
    [b, N] of a best-first verify block (row 0 the root), chain_lp [b, L] the chain's top-1 log-probabilities
    per depth. plan_list as `plans` orders it (AR, the chain, then the trees).

    A tree of m > n nodes (beyond the block's n): the block's gain over its first n/2 nodes, d, repeated for
    each doubling past n with the ratio rho = d / (the gain of nodes n/4 .. n/2), clamped to [0, 1]:
    E(m) = E(n) + d (rho + rho^2 + ... + rho^k), k = log2(m / n) (a best-first tree's later nodes are each
    no likelier than the ones before, so its gains per doubling shrink). A block of n < 4 nodes has no two
    doublings: its last gain (cum(n) - cum(n / 2), the single node's for n = 1) repeats, rho = 1, so a round
    that built a tiny tree can still grow."""
    b, L = chain_lp.shape
    n = tree_scores.shape[1] - 1
    idx, k, extrapolate, depth = columns(acc, plan_list, n, L, chain_lp.device)
    q = acc(torch.cat([tree_scores[:, 1:], chain_lp.float().cumsum(1)], 1),
            torch.cat([tree_depths[:, 1:], depth.expand(b, L).to(tree_depths.dtype)], 1))   # [b, n + L]
    cum = q[:, :n].cumsum(1)                                                           # [b, n]
    trees = cum.index_select(1, idx)                                                   # [b, T]
    if extrapolate:
        a = cum[:, n - 1]                                                              # [b]
        d = a - cum[:, n // 2 - 1] if n >= 2 else a
        # rho + ... + rho^k = rho (1 - rho^k) / (1 - rho), as expm1s of k log rho (no cancellation near
        # rho = 1, where it tends to k); rho kept inside [1e-12, 1 - 1e-6] so that k = 0 gives 0
        if n >= 4:
            rho = d / (cum[:, n // 2 - 1] - cum[:, n // 4 - 1]).clamp_min(1e-30)
        else:
            rho = torch.ones_like(d)
        rho = rho.clamp_(1e-12, 1.0 - 1e-6)[:, None]                                   # [b, 1]
        lr = rho.log()
        trees.add_(d[:, None] * rho * torch.expm1(k * lr) / torch.expm1(lr))
    chain = q[:, n:].sum(1, keepdim=True)                                              # [b, 1]
    return torch.cat([torch.zeros_like(chain), chain, trees], 1).add_(1.0)             # AR, chain, trees


# ----------------------------------------------------------------------------- the cost table
class CostTable:
    """GPU seconds of a round's two phases: `front[(b, build, ctx)]` (draft + the tree build of `build` nodes
    + estimates) and `back[(b, plan index, ctx)]` (verify + walk + compaction + commit of the plan's block),
    per batch bucket b (or (b, n): n requests in bucket b, refreshed online) and context bucket ctx (an index
    into `ctx_buckets`), plus `host`, the round's seconds outside its GPU span (the median of the last
    HOST_WINDOW rounds, `add_host`). A cell never measured borrows the nearest measured context bucket of the
    same key. larger: {tree plan index: the indices of the larger trees} (`larger_trees`): a tree's back
    phase reads at most any larger tree's entry of the same batch field and context (`cost`), whose block
    holds its rows and more. `update` folds a round into an entry by EMA; a tree plan's back entry of a full
    bucket that no round refreshed in more than EXPLORE_AGE rounds takes the round whole."""

    def __init__(self, ctx_buckets=(0,), larger: dict | None = None):
        self.ctx_buckets = tuple(ctx_buckets)
        self.larger = dict(larger or {})
        self.front: dict = {}
        self.back: dict = {}
        self.host = 0.0
        self._host: list[float] = []
        self.samples = 0   # online refreshes so far
        self.seen: dict = {}   # back entry key -> `samples` at its last online refresh (`update`)
        self._nearest: dict = {}   # `_near`'s scans: (table, key) -> (the table's size, the key it found)

    def ctx(self, length: float) -> int:
        """The context bucket of a mean cached length: the last bucket at or below it."""
        return max(i for i, c in enumerate(self.ctx_buckets) if c <= max(length, 0))

    def _near_key(self, table: dict, key: tuple, ctx: int):
        """The full key of key's entry at context ctx, else at the nearest measured context (None: none)."""
        full = key + (ctx,)
        if full in table:
            return full
        # the nearest measured context of key: a scan of the table, kept until an entry is added
        memo = self._nearest.get((id(table), full))
        if memo is None or memo[0] != len(table) or (memo[1] is not None and memo[1] not in table):
            have = [c for (*k, c) in table if tuple(k) == key]
            memo = len(table), key + (min(have, key=lambda c: (abs(c - ctx), -c)),) if have else None
            self._nearest[(id(table), full)] = memo
        return memo[1]

    def _near(self, table: dict, key: tuple, ctx: int):
        got = self._near_key(table, key, ctx)
        return None if got is None else table[got]

    @staticmethod
    def key(b: int, n: int):
        """The batch field of a round's entries: b for a full bucket, (b, n) for n requests in a bucket of b
        (its padding slots' rows cost less than requests' rows)."""
        return b if n >= b else (b, n)

    def _found(self, table: dict, b, rest: tuple, ctx: int):
        """The full key of `entry`'s entry (None: none)."""
        got = self._near_key(table, (b,) + rest, ctx)
        return self._near_key(table, (b[0],) + rest, ctx) if got is None and isinstance(b, tuple) else got

    def entry(self, table: dict, b, rest: tuple, ctx: int):
        """table's entry for batch field b (`key`) and the rest of the key, nearest context; a (b, n) field
        never measured falls back to the full bucket b's entry."""
        got = self._found(table, b, rest, ctx)
        return None if got is None else table[got]

    def cost(self, b: int, i: int, build: int | None, ctx: int, n: int | None = None,
             bound: bool = True) -> float:
        """A round's seconds verifying plan i after building a tree of `build` nodes (None: no draft), for n
        requests in batch bucket b (None: a full bucket). bound: a tree's back entry at most a larger tree's
        of the same batch field and context (`larger`; False: the entry as measured, as a replay bills)."""
        k = b if n is None else self.key(b, n)
        found = self._found(self.back, k, (i,), ctx)
        if found is None:
            return math.inf
        back = self.back[found]
        if bound:
            # a one-off slow measurement of a smaller tree, which no round of its plan would then refresh,
            # would keep the plan out for good
            for j in self.larger.get(i, ()):
                back = min(back, self.back.get((found[0], j, found[2]), back))
        front = 0.0 if build is None else self.entry(self.front, k, (build,), ctx)
        return back + (math.inf if front is None else front) + self.host

    def add_host(self, seconds: float) -> None:
        self._host = (self._host + [seconds])[-HOST_WINDOW:]
        self.host = float(statistics.median(self._host))

    def update(self, table: dict, key: tuple, seconds: float) -> None:
        """A round's seconds into table's entry: EMA, or the round's own where the entry is new or a tree
        plan's back entry of a full bucket that no round refreshed in more than EXPLORE_AGE rounds (a
        start-up measurement, or a plan left that long: `Policy.explore`'s round re-measures it, and a slow
        one-off round taken whole is re-measured likewise, its score bounded by the larger trees', `cost`).
        A partial bucket's entries, refreshed at batch ends far apart, and AR's and the chain's keep EMA."""
        old = table.get(key)
        if table is self.back:
            stale = self.samples - self.seen.get(key, -math.inf) > EXPLORE_AGE
            if stale and not isinstance(key[0], tuple) and key[1] in self.larger:
                old = None
            self.seen[key] = self.samples
        table[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def as_dict(self, plan_list) -> dict:
        """JSON-ready: {"front": {"b,ctx": s}, "back": {"b,plan,ctx": s}, "host": s}, ctx as rows."""
        cb = self.ctx_buckets
        name = (lambda b: f"{b[0]}/{b[1]}" if isinstance(b, tuple) else str(b))   # "8/3": 3 requests in 8
        order = (lambda kv: (name(kv[0][0]),) + kv[0][1:])
        return {"front": {f"{name(b)},{B},{cb[c]}": s
                          for (b, B, c), s in sorted(self.front.items(), key=order)},
                "back": {f"{name(b)},{plan_list[i].name},{cb[c]}": s
                         for (b, i, c), s in sorted(self.back.items(), key=order)},
                "host": self.host, "samples": self.samples}


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
