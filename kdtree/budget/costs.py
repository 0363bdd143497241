"""The GPU seconds of a round's two phases, per batch bucket, plan and context bucket (`CostTable`).

Measured when the engine starts (graph replays per batch bucket and context bucket) and refreshed from every
round's CUDA-event times (`update`, per live count within a bucket); `cost` prices a round of a plan after
its build, `host` adds the round's host time outside them.
"""
from __future__ import annotations

import math
import statistics

EMA = 0.25             # weight of a new sample in the cost table
HOST_WINDOW = 32       # rounds whose host times' median is the table's `host` (robust to a stray slow round)
EXPLORE_AGE = 64       # an entry no round refreshed in this many rounds is stale (`update`, `Policy.explore`)
CTX_BUCKETS = (0, 1024, 4096, 16384, 65536)  # context (mean cached rows of the round's requests) buckets


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
