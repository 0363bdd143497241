"""The budget policy replayed on a CPU against a GPU record's measured costs, in VIRTUAL time:
`python -m kdtree.bench.replay RECORD --batch 8` replays a trained-pair cell of RECORD's "auto" section
(notebook 02's e2e.json); `... RECORD --k26 RUN:BATCH:CONTEXT:TAU` a K2.6 cell of its "k26" section, the
cell's simulated profile on a small model (the profile, not the weights, decides every accept length and
every estimate the policy reads).

A replay serves an auto engine's real rounds with its cost table frozen at the GPU cell's (the record's
`costs`: the table as the cell's run left it) and bills each round the table's seconds for what it ran
(`CostTable.cost`: the batch bucket and its live requests, the plan verified, the tree built, none for
AR, the context bucket, plus the table's host share). A run's virtual tok/s is its tokens over its bill.
Each plan asked for replays on its own engine over the same prompts and seeds; a fixed plan is the auto
engine held to that plan every round (`hold`), so every row is billed from one table and the ratios
between rows isolate the policy's choices from the GPU's timing. Left out of a bill: prefill, the gaps
between rounds, the drafter's deferred-context catch-up (the GPU's host share holds it), the spread of the
GPU's round times and the table's drift over the run (its entries are the run's last averages). The
records' measured tok/s stay the lab's numbers; a replay says whether a policy change is worth a device
run, and why a cell chose what it chose.

The trained pair replays the record's own prompts when its section keeps them ("prompts"), else
`--prompts FILE` (a JSON list of token lists, or a record), else this machine's held-out windows, which
are other texts than the GPU's where Python or torch differ (the row says which).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import re
import sys
from collections import Counter
from pathlib import Path

import torch

from .. import budget as auto_budget
from .. import checks
from ..engine import Engine
from .e2e import pair_engine, section_prompts
from ..data import heldout_prompts
from .serve import run_engine, write_record

LABEL = "VIRTUAL time: a CPU replay billed from a GPU record's cost table (kdtree.bench.replay)"


def _field(b: str):
    """A cost key's batch field: "8" -> 8, "8/3" -> (8, 3) (3 requests live in bucket 8)."""
    if "/" in b:
        x, n = b.split("/")
        return int(x), int(n)
    return int(b)


def load_costs(engine: Engine, costs) -> None:
    """Put a record's cost table (`CostTable.as_dict`: {"front": {"b,B,ctx": s}, "back": {"b,plan,ctx": s},
    "host": s}) into an auto engine's table, in place (the policy holds it), its context buckets the
    record's; the builds each plan's round makes are chosen again from it (`Policy.widen`). Checked before
    anything changes: a ValueError names `costs` and the entry."""
    if engine.auto is None:
        raise ValueError("engine: expected an Engine with budget='auto'")
    if not (isinstance(costs, dict) and isinstance(costs.get("front"), dict)
            and isinstance(costs.get("back"), dict) and isinstance(costs.get("host"), (int, float))):
        raise ValueError("costs: expected a cost table as a record keeps it ({'front': {...}, 'back': {...}, "
                         f"'host': seconds}}), got {type(costs).__name__}")
    names = [p.name for p in engine.plans]
    parsed = {"front": [], "back": []}
    for part in ("front", "back"):
        for key, sec in costs[part].items():
            bits = str(key).split(",")
            try:
                b, what, ctx = _field(bits[0]), bits[1], int(bits[2])
                sec = float(sec)
                assert len(bits) == 3 and sec >= 0
            except (ValueError, IndexError, AssertionError):
                what = "nodes" if part == "front" else "plan"
                raise ValueError(f"costs[{part!r}][{key!r}] = {sec!r}: expected 'batch,{what},context' -> "
                                 "seconds >= 0") from None
            full = b[0] if isinstance(b, tuple) else b
            if full not in engine.buckets:
                raise ValueError(f"costs[{part!r}][{key!r}]: batch bucket {full} is not one of the engine's "
                                 f"{engine.buckets}")
            if part == "front":
                if not what.isdigit() or int(what) not in engine.policy.tree_ops:
                    raise ValueError(f"costs['front'][{key!r}]: a tree of {what} nodes, the engine builds "
                                     f"{sorted(engine.policy.tree_ops)}")
                what = int(what)
            elif what not in names:
                raise ValueError(f"costs['back'][{key!r}]: plan {what!r} is not one of the engine's {names}")
            else:
                what = names.index(what)
            parsed[part].append((b, what, ctx, sec))
    if not parsed["back"]:
        raise ValueError("costs['back']: expected at least one entry")
    ctxs = tuple(sorted({c for part in parsed.values() for (_, _, c, _) in part}))
    t = engine.costs
    t.ctx_buckets, t.samples, t.host, t._host = ctxs, 0, float(costs["host"]), [float(costs["host"])]
    t.front.clear(), t.back.clear(), t.seen.clear(), t._nearest.clear()
    for part, table in (("front", t.front), ("back", t.back)):
        for b, what, ctx, sec in parsed[part]:
            table[(b, what, ctxs.index(ctx))] = sec
    engine.auto.widen(engine.buckets)


class Bill:
    """An auto engine's table frozen at a record's (`load_costs`) and each of its rounds billed from it, its
    entries as measured (`CostTable.cost(bound=False)`: the policy's bound is not a round's cost):
    `seconds` and `rounds` so far. The online refresh stops (the policy's `flush` bills instead); the
    table's refresh count and per-entry ages advance as the refresh would move them, so the policy's
    exploration (`Policy.explore`, which reads them) runs as it does on the GPU. shift: rows added to every
    context length the table reads (`CostTable.ctx`), so that requests holding a short context are decided
    and billed as the cell's long one (a simulated profile's tokens do not depend on what the rows hold)."""

    def __init__(self, engine: Engine, costs, shift: int = 0):
        checks.int_in("shift", shift, 0)
        load_costs(engine, costs)
        self.engine, self.seconds, self.rounds = engine, 0.0, 0
        engine.policy.flush = self._bill
        t = engine.costs
        t.add_host = lambda seconds: None
        if shift:
            t.ctx = lambda length, ctx=t.ctx: ctx(length + shift)

    def _bill(self) -> None:
        p, t = self.engine.policy, self.engine.costs
        for r, _ in p.timing:
            self.seconds += t.cost(r.b, r.plan, r.build, r.ctx, r.n, bound=False)
            self.rounds += 1
            t.seen[(t.key(r.b, r.n), r.plan, r.ctx)] = t.samples
            t.samples += 1
        p.timing.clear()


def hold(engine: Engine, plan: str) -> None:
    """Every later round of the auto engine verifies `plan` (a name of engine.plans) after its own build."""
    names = [p.name for p in engine.plans]
    if plan not in names:
        raise ValueError(f"plan={plan!r}: expected one of {names}")
    j = names.index(plan)

    def decide(b, est, ahead=False):
        ctx = engine.costs.ctx(sum(r.length for r in engine.active) / len(engine.active))
        return j, ctx, False, False
    engine.policy.decide = decide


def runs(make, costs, plan: str, prompts, max_new: int, repeats: int, reseed: bool = False,
         warm_new: int | None = None, shift: int = 0, **add) -> dict:
    """One plan ("auto" or a plan's name) on its own engine (`make()`, an auto engine) billed from `costs`:
    a warm-up run (warm_new tokens a request, default max_new; the policy's prior and spreads, as a GPU
    cell's), then `repeats` runs (reseed: repeat k's requests seeded 1000 (k + 1) + i, as bench.k26's
    cells). {plan, tok_per_s (virtual, the median run's), tok_per_s_runs, seconds, tokens, rounds, tau,
    plan_counts, outputs (the median run's)}. shift: `Bill`'s."""
    e = make()
    bill = Bill(e, costs, shift)
    if plan != "auto":
        hold(e, plan)
    run_engine(e, prompts, max_new if warm_new is None else warm_new, **add)
    got = []
    for k in range(repeats):
        s0, h0 = bill.seconds, len(e.auto.history)
        r = run_engine(e, prompts, max_new, seed0=1000 * (k + 1) if reseed else 0, **add)
        secs = bill.seconds - s0
        plans = [h[2] for h in e.auto.history[h0:]]
        got.append({"tok_per_s": r["tokens"] / secs, "seconds": secs, "tokens": r["tokens"],
                    "rounds": len(plans), "tau": r["tau"], "plan_counts": dict(Counter(plans)),
                    "outputs": r["outputs"]})
    mid = sorted(got, key=lambda g: g["tok_per_s"])[len(got) // 2]
    return {"plan": plan, **mid, "tok_per_s_runs": [g["tok_per_s"] for g in got]}


def _ratios(rows: list) -> dict:
    by = {r["plan"]: r["tok_per_s"] for r in rows}
    fixed = {p: v for p, v in by.items() if p.startswith("B=")}
    out = {}
    if "auto" in by and fixed:
        best = max(fixed, key=fixed.get)
        out.update(best_fixed=best, auto_over_best_fixed=by["auto"] / fixed[best])
    if "auto" in by and ("AR" in by or "chain" in by):
        out["auto_over_ar_chain"] = by["auto"] / max(by.get("AR", 0.0), by.get("chain", 0.0))
    return out


def _plans(plans, names, default) -> list:
    plans = list(default if plans is None else names if list(plans) == ["all"] else plans)
    for p in plans:
        if p != "auto" and p not in names:
            raise ValueError(f"plans: {p!r}: expected 'auto', 'all' or one of {names}")
    return list(dict.fromkeys(plans))


def _load(record):
    """A record given as a path, or already loaded."""
    if isinstance(record, (dict, list)):
        return record
    p = Path(record)
    if not p.is_file():
        raise ValueError(f"record={str(p)!r}: no such file")
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"record={str(p)!r}: not a JSON record ({e})") from None


def read_prompts(path) -> list[list[int]]:
    """A JSON list of token lists, or a record whose "auto" / "trained" section keeps "prompts"."""
    got = _load(path)
    if isinstance(got, dict):
        got = section_prompts(got)
    if not (isinstance(got, list) and got and all(isinstance(p, list) and p for p in got)):
        raise ValueError(f"prompts={str(path)!r}: expected a JSON list of token lists, or a record whose "
                         "'auto' section keeps 'prompts'")
    return got


# ----------------------------------------------------------------------------- the trained pair
def pair(record, batch: int, plans=None, prompts=None, ckpt_dir="data/trained", repeats: int = 2,
         decide: str = "previous", progress: bool = True, target=None, drafter=None) -> dict:
    """Replay the trained pair's cell `auto ({decide})` at `batch` of record's "auto" section (module
    docstring). plans: "auto" and plan names (default auto, AR, chain and the cell's best fixed budget;
    ["all"]: every plan); prompts: token lists (default the section's, else held-out windows); target /
    drafter: the pair already loaded (else from ckpt_dir on the CPU)."""
    rec = _load(record)
    sec = rec.get("auto") if isinstance(rec, dict) else None
    if not isinstance(sec, dict) or not sec.get("cells"):
        raise ValueError("record: expected an 'auto' section with cells (notebook 02's e2e.json)")
    checks.positive_int("batch", batch)
    checks.positive_int("repeats", repeats)
    name = f"auto ({decide})"
    cell = next((c for c in sec["cells"] if c.get("batch") == batch and c.get("name") == name
                 and c.get("costs")), None)
    if cell is None:
        have = sorted({c["batch"] for c in sec["cells"] if c.get("name") == name and c.get("costs")})
        raise ValueError(f"batch={batch!r}: the record's {name!r} cells with a cost table are at batch "
                         f"{have}")
    budgets = tuple(sec.get("budgets") or ())
    fixed = [c for c in sec["cells"] if c.get("batch") == batch and c.get("mode") == "ddtree"
             and c.get("budget") != "auto" and c.get("tok_per_s")]
    best = max(fixed, key=lambda c: c["tok_per_s"])["name"] if fixed else None
    n = max(8, batch)
    plen = int(sec.get("prompt_len") or 64)
    if prompts is not None:
        prompts, source = [list(map(int, p)) for p in prompts][:n], "given"
    elif sec.get("prompts"):
        prompts, source = sec["prompts"][:n], "the record's"
    else:
        prompts = heldout_prompts(n, plen, seed=2)
        source = (f"held-out windows of this machine (Python {platform.python_version()}, torch "
                  f"{torch.__version__}): other texts than the record's where those differ")
    if len(prompts) < n:
        raise ValueError(f"prompts: {len(prompts)} given, batch {batch} replays {n}")
    max_new = int(sec.get("max_new_tokens") or 128)
    if target is None:
        from .. import weights
        target = weights.load(Path(ckpt_dir) / "target", device="cpu").eval()
        drafter = weights.load_drafter(Path(ckpt_dir) / "drafter", target)
    kw = dict(pair_engine(batch, plen, max_new, budgets), mode="ddtree", budget="auto", budgets=budgets,
              decide=decide)
    make = lambda: Engine(target, drafter, **kw)
    names = [p.name for p in auto_budget.plans(drafter.block_size - 1, budgets)]
    plans = _plans(plans, names, ["auto", "AR", "chain"] + ([best] if best else []))
    rows = _sweep(plans, lambda p: runs(make, cell["costs"], p, prompts, max_new, repeats), progress,
                  f"b={batch}")
    ref = next((r["outputs"] for r in rows if r["plan"] == "AR"), None)
    for r in rows:
        out = r.pop("outputs")
        r["equals_ar"] = None if ref is None else out == ref
    as_plan = {name: "auto", "DFlash": "chain"}
    measured = {as_plan.get(c["name"], c["name"]): c["tok_per_s"]
                for c in sec["cells"] if c.get("batch") == batch and not c.get("compiled")}
    return {"label": LABEL, "kind": "trained pair", "batch": batch, "decide": decide, "cell": name,
            "prompts": source, "max_new_tokens": max_new, "repeats": repeats, "rows": rows,
            "ratios": _ratios(rows), "measured": measured, "measured_plans": cell.get("plan_counts")}


# ----------------------------------------------------------------------------- a K2.6 cell
PROFILE_NAME = re.compile(r"chain tau ([0-9.]+) \(ratio ([0-9.]+), depth ([0-9]+)\)")


def small_k26():
    """The small dimensions a K2.6 cell replays at (the profile decides the tokens): (target args, drafter
    args overrides)."""
    import dataclasses
    from ..config import TINY_B
    a = dataclasses.replace(TINY_B, first_k_dense_replace=1, num_hidden_layers=3, n_group=1, topk_group=1,
                            max_position_embeddings=1 << 17)
    return a, dict(num_hidden_layers=2, hidden_size=a.hidden_size, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=48, intermediate_size=128)


def k26_cell(record, run: str, batch: int, context: int, tau: float, plans=None, repeats: int = 2,
             progress: bool = True, rows: int = 64) -> dict:
    """Replay a K2.6 cell of record's "k26" section (run id, batch, context, the profile's chain tau) at
    small dimensions: the cell's profile, request seeds, token counts and engine settings (bench.k26), the
    auto cell's cost table. Each request holds `rows` synthetic context rows (at most the cell's context)
    and is decided and billed as holding the cell's (`Bill`'s shift): the CPU attends over a short context.
    A simulated text is keyed by position, so a short context reads other texts than the GPU run's (the
    same for every plan of the replay); rows = context replays the run's own texts, slowly.
    plans: "auto" and plan names (default auto, AR, chain and the run's best fixed budget; ["all"]: every
    plan)."""
    from .. import k26
    from ..simulate import Profile
    from . import k26 as bench
    rec = _load(record)
    sec = rec.get("k26") if isinstance(rec, dict) else None
    if not isinstance(sec, dict) or not sec.get("cells"):
        raise ValueError("record: expected a 'k26' section with cells (notebook 02's e2e.json)")
    checks.positive_int("repeats", repeats)
    same = [c for c in sec["cells"] if c.get("run") == run and c.get("batch") == batch
            and c.get("context") == context and c.get("tau_chain") == tau and not c.get("error")]
    cell = next((c for c in same if c.get("budget") == "auto" and c.get("costs")), None)
    if cell is None:
        have = sorted({f"{c['run']}:{c['batch']}:{c['context']}:{c['tau_chain']:g}" for c in sec["cells"]
                       if c.get("budget") == "auto" and c.get("costs")})
        raise ValueError(f"k26 cell {run}:{batch}:{context}:{tau:g}: not in the record; its auto cells: "
                         f"{', '.join(have)}")
    m = PROFILE_NAME.search(cell.get("profile") or "")
    if m is None:
        raise ValueError(f"the cell's profile {cell.get('profile')!r}: expected a simulated profile's name")
    budgets = tuple(sorted(c["budget"] for c in same if isinstance(c.get("budget"), int)))
    prof = Profile(float(m.group(1)), int(m.group(3)), float(m.group(2)), K=max(budgets) * 2)
    fixed = [c for c in same if isinstance(c.get("budget"), int) and c.get("tok_per_s")]
    best = f"B={max(fixed, key=lambda c: c['tok_per_s'])['budget']}" if fixed else None
    a, dargs = small_k26()
    t = k26.build_target(a.num_hidden_layers - 1, device="cpu", args=a, kernel_only=False)
    d = bench._with_block(k26.build_drafter(t, args=k26.drafter_args(t.args, **dargs)), prof.depth + 1)
    new = bench.max_new(batch)
    held = min(checks.int_in("rows", rows, bench.PROMPT), context)
    kw = dict(bench.cell_engine(held, batch, new, max(budgets) + 1), mode="ddtree", budget="auto",
              budgets=budgets, simulate=prof)
    make = lambda: Engine(t, d, **kw)
    names = [p.name for p in auto_budget.plans(prof.depth, budgets)]
    plans = _plans(plans, names, ["auto", "AR", "chain"] + ([best] if best else []))
    prompts = bench.cell_prompts(batch, batch)
    add = dict(synthetic_context=held - bench.PROMPT)
    got = _sweep(plans, lambda p: runs(make, cell["costs"], p, prompts, new, repeats, reseed=True,
                                       warm_new=new // 4, shift=context - held, **add),
                 progress, f"{run} b={batch} {context}")
    for r in got:
        r.pop("outputs")
    measured = {("auto" if c["budget"] == "auto" else f"B={c['budget']}" if c["mode"] == "ddtree"
                 else {"ar": "AR", "dflash": "chain"}[c["mode"]]): c["tok_per_s"] for c in same}
    return {"label": LABEL + "; SIMULATED acceptance (the cell's profile) on a small model", "kind": "k26",
            "run": run, "batch": batch, "context": context, "context_held": held, "profile": prof.name,
            "max_new_tokens": new, "repeats": repeats, "rows": got, "ratios": _ratios(got),
            "measured": measured,
            "measured_plans": cell.get("plan_counts")}


def _sweep(plans, one, progress: bool, what: str) -> list:
    from ..progress import tqdm
    rows = []
    for p in tqdm(plans, desc=f"replay {what}", disable=not progress, file=sys.stderr):
        rows.append(one(p))
    return rows


def table(rec: dict) -> str:
    """The replay as a markdown table: each plan's virtual tok/s, rounds, tau and plans, the record's
    measured tok/s beside it."""
    lines = [f"{rec['label']}", "", "| plan | virtual tok/s | rounds | tau | plans | measured tok/s (chain: "
             "the DFlash engine's) |", "|---|---|---|---|---|---|"]
    meas = rec.get("measured", {})
    for r in rec["rows"]:
        m = meas.get(r["plan"])
        lines.append(f"| {r['plan']} | {r['tok_per_s']:,.0f} | {r['rounds']} | {r['tau']:.2f} | "
                     f"{', '.join(f'{k} {v}' for k, v in r['plan_counts'].items())} | "
                     f"{'' if m is None else f'{m:,.0f}'} |")
    lines += ["", ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in rec["ratios"].items())]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.replay",
                                 description="the budget policy on a CPU, billed from a GPU record's costs "
                                             "(virtual time)")
    ap.add_argument("record", help="notebook 02's e2e.json (its 'auto' or 'k26' section)")
    ap.add_argument("--batch", type=int, help="a trained-pair cell's batch")
    ap.add_argument("--k26", metavar="RUN:BATCH:CONTEXT:TAU", help="a K2.6 cell instead")
    ap.add_argument("--plans", nargs="+", help="'auto', plan names (AR, chain, B=16, ...) or 'all'")
    ap.add_argument("--decide", default="previous", choices=("previous", "sync"))
    ap.add_argument("--prompts", help="the trained pair's prompts: a JSON list of token lists or a record")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", type=int, default=64,
                    help="a K2.6 cell's context rows held on the CPU (decided and billed as the cell's)")
    ap.add_argument("--out", help="write the replay's JSON here")
    a = ap.parse_args(argv)
    try:
        if a.out and not Path(a.out).parent.is_dir():
            raise ValueError(f"--out {a.out!r}: its folder does not exist")
        if (a.batch is None) == (a.k26 is None):
            raise ValueError("expected exactly one of --batch (the trained pair) and --k26 (a K2.6 cell)")
        if a.k26 is not None:
            bits = a.k26.split(":")
            if len(bits) != 4:
                raise ValueError(f"--k26 {a.k26!r}: expected RUN:BATCH:CONTEXT:TAU")
            try:
                run, b, c, tau = bits[0], int(bits[1]), int(bits[2]), float(bits[3])
            except ValueError:
                raise ValueError(f"--k26 {a.k26!r}: expected RUN:BATCH:CONTEXT:TAU with integer batch and "
                                 "context and a numeric tau") from None
            rec = k26_cell(a.record, run, b, c, tau, a.plans, a.repeats, rows=a.rows)
        else:
            prompts = None if a.prompts is None else read_prompts(a.prompts)
            rec = pair(a.record, a.batch, a.plans, prompts, repeats=a.repeats, decide=a.decide)
    except ValueError as e:
        ap.error(str(e))
    print(table(rec))
    if a.out:
        write_record(Path(a.out), copy.deepcopy(rec))


if __name__ == "__main__":
    main()
