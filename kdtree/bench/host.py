"""Where an engine's host time goes: wall-clock timers around the engine's host methods over whole runs
of the trained pair (`python -m kdtree.bench.host --batch 8 32 --plans B=16 B=64 auto`). A diagnostic,
not a record: per landed round, the seconds each method took (nested methods count in their callers
too; `event_sync` is `land`'s wait for its round, the rest of `land` is bookkeeping), beside the run's
tok/s, round wall time and GPU span (`bench.e2e._cell`: a warm-up run, then `repeats` runs, the median's).
Under overlap a round is host-bound when its host work (`launch` and `land` less `event_sync`) exceeds
its GPU span.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from pathlib import Path

import torch

from .. import checks
from ..engine import Engine
from .e2e import BUDGETS, _cell, pair_engine, section_prompts
from ..data import heldout_prompts
from .serve import write_record


def methods() -> dict:
    """{key: (class, method)}: the engine's host methods the timers wrap."""
    from ..budget.auto import AutoBudget
    from ..budget.estimates import Estimates
    from ..engine.runner import Runner
    from ..engine.scheduler import Scheduler
    return {"launch": (Runner, "launch"), "land": (Runner, "land"),
            "auto.launch_round": (AutoBudget, "launch_round"), "auto.estimates": (Estimates, "estimates"),
            "auto.expected": (Estimates, "expected"), "auto.decide": (AutoBudget, "decide"),
            "auto.lag": (Estimates, "lag"), "auto.take": (AutoBudget, "take"),
            "auto.flush": (AutoBudget, "flush"), "release": (Scheduler, "release"),
            "grow": (Scheduler, "grow")}


METHODS = methods()


class HostTimers:
    """Wall-clock seconds and calls of the engine's METHODS (and CUDA event waits as `event_sync`) while
    installed (`with HostTimers() as t:`); the class attributes are restored on exit."""

    def __init__(self):
        self.secs: dict = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self._saved: list = []

    def _wrap(self, owner, name: str, key: str) -> None:
        f = getattr(owner, name)
        self._saved.append((owner, name, f))

        @functools.wraps(f)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.secs[key] += time.perf_counter() - t
                self.calls[key] += 1
        setattr(owner, name, timed)

    def __enter__(self) -> "HostTimers":
        for key, (owner, name) in METHODS.items():
            self._wrap(owner, name, key)
        if torch.cuda.is_available():
            self._wrap(torch.cuda.Event, "synchronize", "event_sync")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, f in reversed(self._saved):
            setattr(owner, name, f)
        self._saved.clear()

    def per_round(self) -> dict:
        """{method: microseconds per landed round}, largest first."""
        rounds = max(self.calls["land"], 1)
        return {k: round(1e6 * v / rounds, 1) for k, v in sorted(self.secs.items(), key=lambda kv: -kv[1])}


def _engine_kw(plan: str, batch: int, max_new: int) -> dict:
    kw = dict(pair_engine(batch, 64, max_new, BUDGETS), mode="ddtree")
    if plan == "auto":
        kw.update(budget="auto", budgets=tuple(BUDGETS))
    else:
        kw["budget"] = int(plan[2:])
    return kw


def run(target, drafter, prompts, batches=(8, 32), plans=("B=16", "auto"), max_new: int = 128,
        repeats: int = 5, progress: bool = True) -> list[dict]:
    """One row per (batch, plan): tok/s, tau, round wall and GPU span (ms, medians), per-plan round walls
    (auto), host microseconds per round by method. plans: "auto" or "B=<budget>" of bench.e2e.BUDGETS;
    prompts: at least max(batches) token lists of 64 tokens."""
    batches = [checks.positive_int("batch", b) for b in batches]
    names = {"auto"} | {f"B={B}" for B in BUDGETS}
    for p in plans:
        if p not in names:
            raise ValueError(f"plans: expected 'auto' or one of {sorted(names - {'auto'})}, got {p!r}")
    checks.positive_int("max_new", max_new)
    checks.positive_int("repeats", repeats)
    if len(prompts) < max(batches):
        raise ValueError(f"prompts: expected at least {max(batches)} (the largest batch), got {len(prompts)}")
    rows = []
    for b in batches:
        for plan in plans:
            kw = _engine_kw(plan, b, max_new)
            with HostTimers() as t:
                cell = _cell(lambda: Engine(target, drafter, **kw), prompts[:b], max_new, repeats)
                host = t.per_round()
            row = {"batch": b, "plan": plan, "tok_per_s": cell["tok_per_s"], "tau": cell["tau"],
                   "round_wall_ms": 1e3 * (cell["round_wall_median_s"] or 0.0),
                   "gpu_span_ms": 1e3 * (cell["round_gpu_span_median_s"] or 0.0),
                   "by_plan_ms": {k: [1e3 * v[0], v[1]]
                                  for k, v in (cell.get("round_wall_by_plan") or {}).items()},
                   "host_us_per_round": host}
            rows.append(row)
            if progress:
                top = ", ".join(f"{k} {v:.0f}" for k, v in list(host.items())[:5])
                print(f"b={b:2d} {plan:6s} {row['tok_per_s']:8.0f} tok/s  wall {row['round_wall_ms']:.2f} "
                      f"ms  span {row['gpu_span_ms']:.2f} ms  host us/round: {top}", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.host", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--plans", nargs="+", default=["B=16", "auto"])
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ckpt", default="data/trained")
    ap.add_argument("--prompts", default="outputs/h200/e2e.json",
                    help="a record whose 'auto' section keeps its prompts (else held-out windows)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="write the rows here (JSON)")
    a = ap.parse_args(argv)
    from .. import weights
    ckpt = Path(a.ckpt)
    target = weights.load(ckpt / "target", device=a.device).eval()
    drafter = weights.load_drafter(ckpt / "drafter", target)
    prompts = None
    if Path(a.prompts).is_file():
        prompts = section_prompts(json.loads(Path(a.prompts).read_text()))
    prompts = prompts or heldout_prompts(max(a.batch), 64, seed=2)
    rows = run(target, drafter, prompts, a.batch, a.plans, a.max_new, a.repeats)
    if a.out:
        label = "diagnostic: host seconds per round (kdtree.bench.host)"
        write_record(Path(a.out), {"label": label, "rows": rows})


if __name__ == "__main__":
    main()
