"""budget="auto"'s own arguments (`AutoConfig`), checked once by `EngineConfig.resolve`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import checks, golden


@dataclass(frozen=True)
class AutoConfig:
    """max_budget: the largest tree a round builds (default 256); budgets: the candidate tree sizes (default
    powers of two from 4 to max_budget); decide: "previous" | "sync"; calibration: a Calibration, False (the
    drafter's raw probabilities) or None (the drafter's stored table); makespan: plan for the batch's end
    while it is in view (`Engine`'s docstring)."""
    max_budget: int | None = None
    budgets: tuple | list | None = None
    decide: str = "previous"
    calibration: object = None
    makespan: bool = True

    def is_default(self) -> bool:
        return (self.max_budget is None and self.budgets is None and self.decide == "previous"
                and self.calibration is None and self.makespan is True)

    def resolve(self, backend: str) -> "AutoConfig":
        """Checked for `backend`; budgets the candidate tree sizes (ascending), max_budget their largest."""
        from ..calibration import Calibration
        from . import DECIDE, default_budgets
        max_budget, budgets = self.max_budget, self.budgets
        top = 1024 if backend == "kernel" else golden.MAX_BUDGET
        if max_budget is not None:
            max_budget = checks.int_in("max_budget", max_budget, 1, top,
                                       f" (the {backend} backend's ceiling)")
        if budgets is None:
            cand = default_budgets(256 if max_budget is None else max_budget)
        else:
            ok = isinstance(budgets, (list, tuple)) and len(budgets) > 0 and all(
                checks.is_int(x) and 1 <= x <= (top if max_budget is None else max_budget) for x in budgets)
            if not ok:
                raise ValueError(f"budgets={budgets!r}: expected a non-empty list of tree sizes (ints) in "
                                 f"[1, {top if max_budget is None else max_budget}]")
            cand = tuple(sorted({int(x) for x in budgets}))
            if max_budget is not None and max(cand) != max_budget:
                raise ValueError(f"budgets={budgets!r}: the largest must be max_budget={max_budget} (the "
                                 "largest tree a round builds), or leave max_budget out")
        checks.one_of("decide", self.decide, DECIDE)
        cal = self.calibration
        if not (cal is None or cal is False or isinstance(cal, Calibration)):
            raise ValueError(f"calibration={cal!r}: expected a kdtree.calibration.Calibration, False "
                             "(the drafter's raw probabilities) or None (the drafter's stored table)")
        return dataclasses.replace(self, budgets=tuple(cand), max_budget=max(cand))
