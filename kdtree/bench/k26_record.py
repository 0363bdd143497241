"""The K2.6 section of notebook 02's record from its measured rows.

- `merge(old, new)`: a sweep's rows over an earlier record's (a cell's profile keeps its newest rows), its
  targets formed again per cell (`cell_targets`); `draft_times(cells)`: speculative rows' drafter times
  from their run's DFlash row. `python -m kdtree.bench.k26` writes its record through them.
- `finish(k26, microbench)`: the projection check (notebook 01's layers against the measured rounds), the
  61-layer projection from the same parts (PROJECTED) and the projection target, into the section.
- `plot(k26, check, path)`: the section's figure (tok/s against budget, a panel per measured (context, batch)
  cell; round cost against rows per context; legends outside the panels).
- `combine(sections)`: several sweeps' sections (each device command writes its own e2e.json) as one: every
  (context, batch, profile) keeps the rows of its newest run (`merge`, folded in run order).

`python -m kdtree.bench.k26_record --into outputs/h200/e2e.json DIR/e2e.json ...` combines the `k26`
sections of the records named (and of `--into`'s own) into `--into`, finishes the section, draws its
figure beside it and forms the record's targets again. It writes nothing before every input has been read
and combined; each row keeps its `run`, and the section lists its runs (`runs`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import project
from .goals import target as _goal
from .k26_cells import PROFILES
from .k26_figure import cost_panel, figure_legend, round_cost, throughput_panel

PARTS = ("pair", "auto", "k26", "k26_uniform", "engine")   # notebook 02's sections that carry targets


def record_targets(record: dict) -> list[dict]:
    """Notebook 02's record's `targets`: its sections' (PARTS) in that order."""
    return [t for part in PARTS for t in record.get(part, {}).get("targets", [])]


# ----------------------------------------------------------------------------- a sweep's rows as a record
def draft_times(cells: list) -> list:
    """cells, each speculative row's missing `draft_s` / `commit_s` (the drafter's draft and its context
    update) given from its DFlash row's measured stages (the row of the same run, context, batch and chain
    tau that carries `stages`), in place: the projection's drafter is the measured one, also in a sweep cut
    off after its DFlash row."""
    for c in cells:
        if c["mode"] == "ar" or (c.get("draft_s") is not None and c.get("commit_s") is not None):
            continue
        src = next((x for x in cells if x["mode"] == "dflash" and x.get("stages")
                    and all(x.get(k) == c.get(k) for k in ("run", "context", "batch", "tau_chain"))), None)
        if src is not None:
            for key, stage in (("draft_s", "draft"), ("commit_s", "commit")):
                if c.get(key) is None:
                    c[key] = src["stages"][stage]["gpu_s"]
    return cells


def _targets(cells, context: int, batch: int, n: int) -> list:
    out = []
    ok = [c for c in cells if not c.get("error")]
    for tau in sorted({c["tau_chain"] for c in ok if c["tau_chain"] is not None}):
        mine = [c for c in ok if c["tau_chain"] == tau]
        ar = next((c for c in mine if c["mode"] == "ar"), None) or next(   # a record from before AR read
            (c for c in ok if c["mode"] == "ar" and c["tau_chain"] is None        # the profile's text
             and c.get("run") == mine[0].get("run")), None)
        fixed = [c for c in mine if c["mode"] == "ddtree" and c["budget"] != "auto"]
        auto = next((c for c in mine if c["budget"] == "auto"), None)
        dfl = next((c for c in mine if c["mode"] == "dflash"), None)
        where = {"tau": f"{tau:g}", "layers": n, "batch": batch, "context": context}
        if auto and fixed:
            best = max(fixed, key=lambda c: c["tok_per_s"])
            out.append(_goal("k26_auto_over_best_fixed", auto["tok_per_s"] / best["tok_per_s"],
                             budget=best["budget"], **where))
        if auto and ar and dfl:
            out.append(_goal("k26_auto_over_ar_dflash",
                             auto["tok_per_s"] / max(ar["tok_per_s"], dfl["tok_per_s"]), **where))
        if auto and ar and tau == 5.0 and batch == 1 and context == 4096:
            out.append(_goal("k26_auto_over_ar", auto["tok_per_s"] / ar["tok_per_s"], **where))
        out += _floor_targets(ar, fixed, dfl, where)
        q = _queued
        qfixed = [c for c in fixed if q(c)]
        if auto and q(auto) and qfixed:
            best = max(qfixed, key=q)
            out.append(_goal("k26_queued_auto_over_best_fixed", q(auto) / q(best), budget=best["budget"],
                             requests=auto["queued"]["requests"], **where))
        if auto and q(auto) and ar and q(ar) and dfl and q(dfl):
            out.append(_goal("k26_queued_auto_over_ar_dflash", q(auto) / max(q(ar), q(dfl)),
                             requests=auto["queued"]["requests"], **where))
    if len(ok) < len(cells):
        out.append(_goal("k26_cells_ran", len(ok) / len(cells), batch=batch, context=context))
    return out


def _floor_targets(ar, fixed, dfl, where: dict) -> list:
    """The AR round's, the fastest fixed DDTree round's and the drafter's byte-floor fractions (`floors`),
    where the rows carry them (a GPU run)."""
    def frac(c, key="floor"):
        return ((c or {}).get(key) or {}).get("fraction")
    out = []
    if frac(ar) is not None:
        out.append(_goal("k26_ar_floor_fraction", frac(ar), **where))
    measured = [c for c in fixed if frac(c) is not None]
    if measured:
        best = max(measured, key=lambda c: c["tok_per_s"])
        out.append(_goal("k26_ddtree_floor_fraction", frac(best), budget=best["budget"], **where))
    if frac(dfl, "drafter_floor") is not None:
        out.append(_goal("k26_drafter_floor_fraction", frac(dfl, "drafter_floor"), **where))
    return out


def _queued(c: dict):
    """Row c's full-batch tok/s in its serving queue (None without one)."""
    return (c.get("queued") or {}).get("full_tok_per_s")


def _fitted(c: dict) -> bool:
    """Whether row c is of a fitted profile (`--trained`): so marked, or (older rows) a chain tau that no
    listed profile has."""
    return bool(c.get("fitted")) or (c.get("tau_chain") is not None
                                     and c["tau_chain"] not in {p[0] for p in PROFILES})


def merge(old: dict | None, new: dict, targets: bool = True) -> dict:
    """A sweep's record `new` over an earlier one (staged sweeps build one record): a profile's rows of a
    (context, batch) cell replace that profile's earlier rows there (its AR row too), an AR row of no
    profile (records from before AR read the profile's text) is kept while rows of its run remain, a cell's
    fitted profile (`_fitted`) keeps only its newest run's rows, and every cell's targets are formed again
    from its rows (each ratio within one run; targets=False: left to the caller, for a fold whose later
    records replace a cell's rows of another layer count). ValueError for another routing, decode path or
    prefix_attn, or (targets) for a cell whose layer count would mix."""
    if not old:
        return new if targets else {**new, "targets": []}
    if old.get("routing", "model") != new.get("routing", "model"):
        raise ValueError(f"merge: a routing {new.get('routing')!r} sweep into a routing "
                         f"{old.get('routing', 'model')!r} record (each routing has its own record)")
    for name, default in (("prefix_attn", "off"), ("decode_path", None)):
        a, b = old.get(name, default), new.get(name, default)
        if a is not None and b is not None and a != b:
            raise ValueError(f"merge: a {name} {b!r} sweep into a {name} {a!r} record (write it to "
                             f"another --out)")
    key = (lambda c: (c["context"], c["batch"], c.get("tau_chain")) if c.get("tau_chain") is not None else
           (c["context"], c["batch"], None, c.get("run")))
    fresh = {key(c) for c in new["cells"]}
    cells = [c for c in old.get("cells", []) if key(c) not in fresh] + new["cells"]
    newest = {}   # a cell's fitted profile (its tau moves with each fit): only the newest run's rows stay
    for c in cells:
        if _fitted(c):
            k = (c["context"], c["batch"])
            newest[k] = max(newest.get(k, ""), c.get("run") or "")
    cells = [c for c in cells if not _fitted(c) or (c.get("run") or "") == newest[(c["context"], c["batch"])]]
    runs = {(c["context"], c["batch"], c.get("run")) for c in cells if c["mode"] != "ar"}
    cells = [c for c in cells
             if c.get("tau_chain") is not None or (c["context"], c["batch"], c.get("run")) in runs]
    layers = {**old.get("layers", {}), **new["layers"]}
    return {**old, **new, "cells": cells, "targets": cell_targets(cells) if targets else [], "layers": layers}


def cell_targets(cells) -> list:
    """The targets of rows `cells`, formed per (context, batch) cell; ValueError for a cell whose rows mix
    layer counts."""
    by_cell: dict = {}
    for c in cells:
        by_cell.setdefault((c["context"], c["batch"]), []).append(c)
    targets = []
    for (C, b), rows in sorted(by_cell.items()):
        if len({c["layers"] for c in rows}) > 1:
            raise ValueError(f"merge: cell {C}:{b} would mix {sorted({c['layers'] for c in rows})} MoE "
                             "layers (run the whole cell again, or combine runs that measure every "
                             "profile of it at one count: python -m kdtree.bench.k26_record)")
        targets += _targets(rows, C, b, rows[0]["layers"])
    return targets


# ----------------------------------------------------------------------------- notebook 02's section
def finish(k26: dict, microbench: dict | None, drafter_layers: int = 6, n_layers: int = 61,
           **kw) -> list[dict]:
    """Sets k26's projection_check, projection_full and the projection target from notebook 01's record
    `microbench` (none: the section keeps no projection), its rows' missing draft and commit times first
    given from their runs' DFlash rows (`draft_times`); returns the check's rows. kw: more
    `project.check_engine` keywords (vocab, hidden)."""
    if not microbench:   # no projection: none of another set of rows either
        k26.pop("projection_check", None)
        k26.pop("projection_full", None)
        return []
    draft_times(k26["cells"])
    chk = project.check_engine(microbench, k26["cells"], drafter_layers=drafter_layers, full_layers=n_layers,
                               **kw)
    k26["projection_check"] = chk
    share = sum(r["within"] for r in chk) / len(chk) if chk else 0.0
    k26["targets"] = [t for t in k26.get("targets", []) if not t["name"].startswith("K2.6 projection")] + [
        _goal("k26_projection_within", share)]
    rows = []
    for C, b in sorted({(r["context"], r["batch"]) for r in chk}):
        here = [r for r in chk if (r["context"], r["batch"]) == (C, b)]
        ars = [r for r in here if r["mode"] == "ar"]
        for tc in sorted({r["tau_chain"] for r in here if r["tau_chain"]}):
            ar = next((r for r in ars if r["tau_chain"] == tc), next(iter(ars), None))
            dd = [r for r in here if r["tau_chain"] == tc and r["mode"] == "ddtree" and r["full_tok_per_s"]]
            if ar and ar["full_tok_per_s"] and dd:
                best = max(dd, key=lambda r: r["full_tok_per_s"])
                rows.append({"context": C, "batch": b, "tau_chain": tc, "best_budget": best["budget"],
                             "ddtree_tok_per_s": best["full_tok_per_s"], "ar_tok_per_s": ar["full_tok_per_s"],
                             "speedup": best["full_tok_per_s"] / ar["full_tok_per_s"]})
    k26["projection_full"] = {"label": f"PROJECTED, {n_layers} layers on one GPU's clock", "rows": rows}
    return chk


def plot(k26: dict, check: list[dict], path: Path | None = None, routing: str = "model"):
    """The section's figure: one row per context, one panel per (context, batch) cell the section holds (no
    panel for a cell it lacks): tok/s of all requests against the fixed budget per simulated profile (its
    colour; auto a star at the "auto" slot right of the budgets, the DFlash chain dashed, the cell's AR
    black; a serving queue's full-batch rounds as thin squares and a hollow star where measured); then,
    per context, the measured round (GPU span, the wall time where no GPU span is recorded) against the
    verified rows per request with its projection, where any is recorded. One shared legend under the
    panels, the round-cost legend right of them; base-2 budget and row axes with integer ticks; constrained
    layout (kdtree.plots' contract); the panels and the legend are kdtree.bench.k26_figure's. Saved at
    `path` when given; returns the figure."""
    import matplotlib.pyplot as plt

    cells = [c for c in k26["cells"] if not c.get("error") and c.get("tok_per_s")]
    contexts = sorted({c["context"] for c in cells})
    batches = sorted({c["batch"] for c in cells})
    taus = sorted({c["tau_chain"] for c in cells if c.get("tau_chain")})
    fitted = {c["tau_chain"] for c in cells if c.get("fitted")}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {tc: palette[i % len(palette)] for i, tc in enumerate(taus)}
    others = ["tab:purple", "tab:brown", "tab:gray", "tab:olive", "tab:cyan", "tab:pink"]   # not a profile's
    shade = {b: others[i % len(others)] for i, b in enumerate(batches)}
    has_cost = {C: any(round_cost(c)[0] for c in cells if c["context"] == C and c["budget"] != "auto")
                for C in contexts}
    ncols = len(batches) + any(has_cost.values())
    fig = plt.figure(layout="constrained",
                     figsize=(4.3 * max(1, ncols) + 1.6, 3.5 * max(1, len(contexts)) + 1.1))
    grid = fig.add_gridspec(max(1, len(contexts)), max(1, ncols))
    queued_any = False
    for i, C in enumerate(contexts):
        for j, b in enumerate(batches):
            rs = [c for c in cells if c["context"] == C and c["batch"] == b]
            if not rs:
                continue
            ylabel = j == 0 or not any(c["context"] == C and c["batch"] == batches[j - 1] for c in cells)
            queued_any |= throughput_panel(fig.add_subplot(grid[i, j]), rs, colour, ylabel)
        if has_cost[C]:
            cost_panel(fig.add_subplot(grid[i, ncols - 1]), [c for c in cells if c["context"] == C],
                        check, batches, shade)
    if not fig.axes:   # nothing measured: one line of text, not an empty axes
        fig.text(0.5, 0.5, "no K2.6 row measured", ha="center", va="center")
    figure_legend(fig, taus, fitted, colour, queued_any)
    fig.suptitle(f"K2.6 shape, random weights, SIMULATED acceptance, routing {routing}"
                 + (f", {k26['device']}" if k26.get("device") else ""), fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _row_key(c: dict) -> tuple:
    return (c.get("run"), c["context"], c["batch"], c.get("tau_chain"), c["mode"], str(c.get("budget")))


def combine(sections: list[dict]) -> dict:
    """One section from several (their order does not matter): each distinct row once (of two copies, a
    finished sweep's over a partial one's, then the fuller), folded run by run (oldest first) with
    `merge`, so every (context, batch, profile) keeps its newest run's rows (a cell's layer count
    may change from run to run; only the combined rows must not mix them), and the targets formed again from
    the rows; the other fields from the finished section holding the newest run (a
    partial one where none is finished). A run's profile at a cell without its auto row (a sweep cut off
    before it: auto runs last) is left out, so it replaces no earlier complete run, and listed in the
    section's "incomplete" ({run, context, batch, tau_chain, rows}). ValueError for a section without cells
    or a row without its run, or for sections of different routings."""
    if not sections:
        raise ValueError("combine: no sections given")
    rows: dict = {}
    best: dict = {}
    top, top_rank = None, None
    for i, s in enumerate(sections):
        if not isinstance(s, dict) or not isinstance(s.get("cells"), list):
            raise ValueError(f"combine: section {i} has no 'cells' list (a k26 section of an e2e.json?)")
        done = not s.get("partial")
        for c in s["cells"]:
            if not c.get("run"):
                raise ValueError(f"combine: section {i} has a row without its run: {c.get('mode')} "
                                 f"{c.get('budget')} at {c.get('context')}:{c.get('batch')}")
            k, rank = _row_key(c), (done, len(c))
            if k not in rows or rank > best[k]:
                rows[k], best[k] = c, rank
            if top is None or (done, c["run"]) > top_rank:
                top, top_rank = s, (done, c["run"])
    if len({s.get("routing", "model") for s in sections}) > 1:
        raise ValueError("combine: sections of different routings (each routing has its own record)")
    groups: dict = {}   # (run, context, batch, profile) -> its rows
    for c in rows.values():
        if c.get("tau_chain") is not None:
            groups.setdefault((c["run"], c["context"], c["batch"], c["tau_chain"]), []).append(c)
    cut = {k: len(v) for k, v in groups.items() if not any(c.get("budget") == "auto" for c in v)}
    rows = {k: c for k, c in rows.items()
            if (c["run"], c["context"], c["batch"], c.get("tau_chain")) not in cut}
    if not rows:
        raise ValueError("combine: every profile's rows lack their auto row (sweeps cut off before it)")
    out = None
    for run in sorted({c["run"] for c in rows.values()}):
        cells = [c for c in rows.values() if c["run"] == run]
        layers = {f"{c['context']}:{c['batch']}": c["layers"] for c in cells}
        out = merge(out, {**top, "cells": cells, "layers": layers}, targets=False)
    out = {**out, "targets": cell_targets(out["cells"]),   # layers keyed "context:batch"
           "layers": dict(sorted(out["layers"].items(), key=lambda kv: tuple(map(int, kv[0].split(":"))))),
           "runs": sorted({c["run"] for c in out["cells"]})}
    out.pop("partial", None)
    out.pop("incomplete", None)
    if cut:
        out["incomplete"] = [{"run": r, "context": C, "batch": b, "tau_chain": t, "rows": n}
                             for (r, C, b, t), n in sorted(cut.items())]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.k26_record", description=__doc__.split("\n")[0])
    ap.add_argument("records", nargs="+", type=Path, help="e2e.json files whose k26 sections are combined")
    ap.add_argument("--into", type=Path, required=True, help="the e2e.json that receives the section")
    ap.add_argument("--microbench", type=Path, default=None,
                    help="notebook 01's record for the projection (default: microbench_k26.json beside "
                    "--into)")
    ap.add_argument("--key", default="k26", choices=("k26", "k26_uniform"))
    ap.add_argument("--drafter-layers", type=int, default=6)
    ap.add_argument("--layers", type=int, default=61, help="the projection's full depth")
    a = ap.parse_args(argv)

    def read(p: Path) -> dict:
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"k26_record: {p}: not a readable JSON record ({e})") from None
    into = read(a.into)
    secs = [into[a.key]] if a.key in into else []
    for p in a.records:
        rec = read(p)
        if a.key not in rec:
            raise SystemExit(f"k26_record: {p} has no {a.key!r} section")
        secs.append(rec[a.key])
    mb_path = a.microbench or a.into.parent / "microbench_k26.json"
    mb = read(mb_path) if mb_path.is_file() else None
    try:
        sec = combine(secs)
    except ValueError as e:
        raise SystemExit(f"k26_record: {e}") from None
    check = finish(sec, mb, a.drafter_layers, a.layers)
    into[a.key] = sec
    into["targets"] = record_targets(into)
    fig = plot(sec, check, None, sec.get("routing", "model"))   # drawn before anything is written
    a.into.write_text(json.dumps(into, indent=1) + "\n")
    fig.savefig(a.into.parent / f"e2e_{a.key}.png", dpi=120)
    fig.clf()
    print(f"{a.into}: {a.key} from runs {', '.join(sec['runs'])}")
    for g in sec.get("incomplete", []):
        print(f"left out (no auto row: cut off): run {g['run']} {g['context']}:{g['batch']} tau "
              f"{g['tau_chain']:g} ({g['rows']} rows)")
    for t in sec["targets"]:
        print(f"{'met ' if t['met'] else 'MISS'} {t['name']}: {t['measured']:.3f} (goal {t['goal']})")


if __name__ == "__main__":
    main()
