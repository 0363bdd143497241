"""The drafter's calibration: predicted against realized acceptance of draft-tree nodes.

A DDTree node's predicted acceptance is its prefix probability under the drafter, exp(score) (the summed
log-probability of its path, `golden.Tree.scores`). Under greedy verification a node is accepted when every
token on its path is the target's choice below its parent; the round emits 1 + (accepted nodes) tokens.
`kdtree.bench.calibrate.measure` runs DDTree rounds through the engine on held-out prompts and records, per
depth and per bin of predicted probability, how many nodes there were, their summed prediction and how many
were accepted; `Calibration.correct` scales a prediction by its bin's realized / predicted (per depth; a
sparse bin takes the bin's ratio over all depths); `expected_tokens` gives a best-first tree's expected
emitted tokens for every truncation B. The table is stored beside the drafter as `calibration.json`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import checks, golden

FILE = "calibration.json"
EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.0)  # bins of predicted probability
MIN_COUNT = 20  # a (depth, bin) with fewer nodes takes the bin's ratio over all depths


@dataclass
class Calibration:
    """Per depth d (row d - 1) and bin j (EDGES[j] <= p < EDGES[j + 1], p = 1 in the last): counts, summed
    predictions and accepted nodes; budget and prompts of the measurement."""
    edges: list
    count: list      # [L][bins] int
    predicted: list  # [L][bins] float: summed predictions
    accepted: list   # [L][bins] int
    budget: int = 0
    prompts: int = 0

    def __post_init__(self):
        """The table's contract, checked however it arrives (built, loaded, handed to an Engine): edges at
        least two finite probabilities in [0, 1], strictly ascending; count / predicted / accepted [depths >=
        1][bins] with counts ints >= 0, predictions finite >= 0, 0 <= accepted <= count; budget and prompts
        ints >= 0. ValueError naming the first field that breaks it."""
        e = self.edges
        if (not isinstance(e, (list, tuple)) or len(e) < 2 or not all(checks.is_number(x) for x in e)
                or not all(np.isfinite(float(x)) and 0.0 <= float(x) <= 1.0 for x in e)
                or any(float(b) <= float(a) for a, b in zip(e, e[1:]))):
            raise ValueError(f"calibration edges={e!r}: expected at least two finite probabilities in "
                             "[0, 1], strictly ascending")
        nb = len(e) - 1
        tables = {"count": self.count, "predicted": self.predicted, "accepted": self.accepted}
        for name, t in tables.items():
            if not (isinstance(t, (list, tuple)) and len(t) >= 1
                    and all(isinstance(r, (list, tuple)) and len(r) == nb for r in t)):
                raise ValueError(f"calibration {name}: expected [depths >= 1][{nb} bins] (a bin between each "
                                 "two edges)")
        if not len(self.count) == len(self.predicted) == len(self.accepted):
            raise ValueError("calibration count, predicted, accepted: expected one row per depth in each")
        for rc, rp, ra in zip(self.count, self.predicted, self.accepted):
            for c, p, a in zip(rc, rp, ra):
                if not (checks.is_int(c) and c >= 0 and checks.is_int(a) and 0 <= a <= c
                        and checks.is_number(p) and np.isfinite(float(p)) and p >= 0):
                    raise ValueError(f"calibration: a bin holds count={c!r}, predicted={p!r}, "
                                     f"accepted={a!r}: expected ints 0 <= accepted <= count and a finite "
                                     "predicted >= 0")
        checks.int_in("calibration budget", self.budget, 0)
        checks.int_in("calibration prompts", self.prompts, 0)

    @classmethod
    def empty(cls, depths: int, edges=EDGES) -> "Calibration":
        nb = len(edges) - 1
        return cls(list(edges), [[0] * nb for _ in range(depths)], [[0.0] * nb for _ in range(depths)],
                   [[0] * nb for _ in range(depths)])

    @property
    def depths(self) -> int:
        return len(self.count)

    def _bins(self, p: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(np.asarray(self.edges), p, side="right") - 1, 0, len(self.edges) - 2)

    def add(self, scores, depths, accepted) -> None:
        """Record nodes: scores [n] log-probabilities, depths [n] in 1..L, accepted [n] bool."""
        p = np.exp(np.asarray(scores, np.float64))
        d = np.asarray(depths) - 1
        j = self._bins(p)
        for di, ji, pi, ai in zip(d, j, p, np.asarray(accepted, bool)):
            self.count[di][ji] += 1
            self.predicted[di][ji] += float(pi)
            self.accepted[di][ji] += int(ai)

    def rates(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean prediction, realized rate) [L, bins]; NaN where a bin is empty."""
        c = np.asarray(self.count, np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(self.predicted) / c, np.asarray(self.accepted) / c

    def ratios(self) -> np.ndarray:
        """float64 [L + 1, bins] multipliers of a prediction: realized / predicted of the (depth, bin) where
        it holds at least MIN_COUNT nodes, else of the bin over all depths where that holds at least
        MIN_COUNT, else 1; row L (a depth beyond the table) is 1."""
        c, a, pr = (np.asarray(t, np.float64) for t in (self.count, self.accepted, self.predicted))
        with np.errstate(invalid="ignore", divide="ignore"):
            per = np.where((c >= MIN_COUNT) & (pr > 0), a / pr, np.nan)
            cs, ps = c.sum(0), pr.sum(0)
            pooled = np.where((cs >= MIN_COUNT) & (ps > 0), a.sum(0) / ps, 1.0)
        out = np.where(np.isfinite(per), per, pooled[None])
        return np.concatenate([out, np.ones((1, out.shape[1]))])

    def correct(self, scores, depths) -> np.ndarray:
        """Calibrated acceptance of nodes: scores [n] log-probabilities, depths [n] -> [n] in [0, 1]: the
        prediction times its bin's realized / predicted (`ratios`), at most 1. Scaling within a bin keeps the
        order of the bin's predictions: a best-first tree's later nodes sit low in their bins, and one rate
        for a whole bin over-credits them (the large truncations come out too good against the small)."""
        p = np.exp(np.asarray(scores, np.float64))
        d = np.asarray(depths, np.int64) - 1
        d = np.where((d >= 0) & (d < self.depths), d, self.depths)
        return np.minimum(1.0, p * self.ratios()[d, self._bins(p)])

    def expected_tokens(self, tree: golden.Tree) -> np.ndarray:
        """Expected emitted tokens of the tree's first B nodes for B = 0..n: 1 + the calibrated acceptances
        summed in best-first order (a prefix of a best-first tree is the B-node tree). float64 [n + 1]."""
        q = self.correct(tree.scores, tree.depths) if tree.n else np.zeros(0)
        return 1.0 + np.concatenate([[0.0], np.cumsum(q)])

    # ------------------------------------------------------------- storage
    def save(self, folder) -> Path:
        path = Path(folder) / FILE
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, folder) -> "Calibration | None":
        """The calibration stored in `folder` (a drafter checkpoint), None when there is none."""
        path = Path(folder) / FILE
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a calibration table ({e})") from None
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"{path}: not a calibration table ({e})") from None
        except ValueError as e:
            raise ValueError(f"{path}: inconsistent calibration table: {e}") from None


def node_acceptance(block: golden.VerifyBlock, choice) -> np.ndarray:
    """Greedy acceptance of every tree node of a verify block: choice [N] the target's token after each row.
    Row 0 is the root (accepted); row i is accepted when its parent row is and it is the parent's choice.
    Returns bool [N - 1] for the nodes (rows 1..N-1)."""
    ok = np.zeros(block.n, bool)
    ok[0] = True
    for i in range(1, block.n):
        p = block.parents[i]
        ok[i] = ok[p] and block.tokens[i] == choice[p]
    return ok[1:]


def truncations(rounds, budgets, calibrations: dict) -> dict:
    """Realized against expected tokens per round for each truncation B of the recorded best-first trees
    (`kdtree.bench.calibrate.measure(..., rounds=)`): the first B nodes of a tree are the B-node tree and the
    target's choices do
    not depend on the tree, so a round's tokens at B are 1 + its accepted nodes among the first B.
    calibrations: {name: Calibration or None (the drafter's raw probabilities)}. Returns {"budgets": [...],
    "realized": [...], name: [...]} (means over the rounds)."""
    out = {"budgets": [int(B) for B in budgets], "realized": []}
    for B in budgets:
        out["realized"].append(1.0 + float(np.mean([ok[:B].sum() for _, _, ok in rounds])))
    for name, cal in calibrations.items():
        q = [np.exp(np.asarray(s, np.float64)) if cal is None else cal.correct(s, d) for s, d, _ in rounds]
        out[name] = [1.0 + float(np.mean([x[:B].sum() for x in q])) for B in budgets]
    return out
