"""A round's candidates (`Plan`) and the tree each one's round builds.

`plans`: AR (the root alone, no draft), the DFlash chain (argmax per depth) and the best-first tree
truncated to B nodes for each B in the engine's `budgets` (every truncation of a best-first tree is the
B-node tree), in that order. `builds`: the tree each plan's round builds before any cost is measured (its
own; the chain's round the smallest); `wider_builds`: a larger one where the measured front phase costs at
most FRONT_SLACK more. `larger_trees` ties each tree plan to the larger ones (`CostTable.larger`);
`default_budgets` is `AutoConfig`'s default list of tree sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .costs import CostTable

FRONT_SLACK = 0.03     # a round builds a larger tree than its plan's when its front costs at most this more


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
