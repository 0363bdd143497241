"""Two K2.6 sweeps side by side: the before / after table of a decode-path change.

    python -m kdtree.bench.k26_compare BEFORE AFTER [--labels torch fused] [--out DIR]

BEFORE and AFTER are records of `python -m kdtree.bench.k26` (an e2e_k26.json) or notebook 02's e2e.json
(its "k26" section). Rows are matched by (context, batch, chain tau, mode, budget, layers built); a row
missing or failed on either side is listed under "unmatched". Per matched row: the round's GPU span
(median), its byte floor (`kdtree.bench.floors`, each record's own: bytes over its run's copy rate) and the
fraction of the floor each side reaches, tok/s, the speed-up (before span / after span) and the kernels a
round of the profiled stages where a side profiled them. Per (context, batch, chain tau): DDTree's best
fixed budget / AR, auto / AR and auto / best fixed on each side. Both records should come from one run on
one card (the table says which cards); two named cards that differ are refused unless --mixed.

Writes DIR/k26_compare.json, DIR/k26_compare.md and DIR/k26_compare.png (round time against the floor, a
panel per cell); nothing is written before both records have been read and matched.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

STAGE_KEYS = ("draft", "build", "verify", "walk", "commit")


def load(path) -> dict:
    """A K2.6 sweep's record: an e2e_k26.json, or the "k26" section of notebook 02's e2e.json."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"record {str(path)!r}: expected an e2e_k26.json or e2e.json file")
    try:
        rec = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"record {str(path)!r}: not JSON ({e})") from None
    if isinstance(rec, dict) and "cells" not in rec and isinstance(rec.get("k26"), dict):
        rec = {**rec["k26"], "device": rec["k26"].get("device", rec.get("device"))}
    if not isinstance(rec, dict) or not isinstance(rec.get("cells"), list):
        raise ValueError(f"record {str(path)!r}: expected a K2.6 sweep (a 'cells' list, or a 'k26' section)")
    return rec


def _key(c: dict) -> tuple:
    return (c["context"], c["batch"], c.get("tau_chain"), c["mode"], str(c.get("budget")), c.get("layers"))


def _span(c: dict):
    """The row's round time: the median GPU span of its rounds with every slot live (the span its byte floor
    is a fraction of), else of all its rounds."""
    return c.get("full_round_gpu_span_median_s") or c.get("round_gpu_span_median_s")


def _ok(c: dict) -> bool:
    return not c.get("error") and bool(c.get("tok_per_s")) and bool(_span(c))


def _kernels(c: dict):
    st = c.get("stages")
    if not isinstance(st, dict) or not st:
        return None
    return round(sum((st.get(k) or {}).get("kernels", 0) for k in STAGE_KEYS))


def _budget_order(b: str) -> float:
    try:
        return float(b)
    except ValueError:   # "auto", "None"
        return math.inf


def _floor(c: dict, key: str = "floor"):
    f = c.get(key) or {}
    return f.get("s"), f.get("fraction")


def row(before: dict, after: dict) -> dict:
    """One matched row: both sides' round span, floor and fraction, tok/s, kernels; the speed-up."""
    out = {k: after.get(k) for k in ("context", "batch", "tau_chain", "mode", "layers")}
    out["budget"] = after.get("budget")
    for side, c in (("before", before), ("after", after)):
        floor_s, frac = _floor(c)
        out[side] = {"round_s": _span(c), "tok_per_s": c["tok_per_s"], "floor_s": floor_s,
                     "floor_fraction": frac, "kernels": _kernels(c), "tau": c.get("tau")}
        d_s, d_frac = _floor(c, "drafter_floor")
        if d_frac is not None:
            out[side]["drafter_floor_fraction"] = d_frac
    out["speedup"] = _span(before) / _span(after)
    return out


def _ratios(rows: list[dict]) -> dict:
    """DDTree's best fixed budget / AR, auto / AR, auto / best fixed (tok/s) among one side's measured rows
    of one cell (each side's own rows: a budget that failed on the other side still counts here)."""
    def tps(r):
        return r["tok_per_s"]
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    fixed = [r for r in rows if r["mode"] == "ddtree" and str(r.get("budget")) != "auto"]
    auto = next((r for r in rows if r["mode"] == "ddtree" and str(r.get("budget")) == "auto"), None)
    best = max(fixed, key=tps) if fixed else None
    out = {}
    if best and ar:
        out["best_fixed_over_ar"] = tps(best) / tps(ar)
        out["best_fixed_budget"] = best["budget"]
    if auto and ar:
        out["auto_over_ar"] = tps(auto) / tps(ar)
    if auto and best:
        out["auto_over_best_fixed"] = tps(auto) / tps(best)
    return out


def compare(before: dict, after: dict, labels=("before", "after"), mixed: bool = False) -> dict:
    """The side-by-side record of two sweeps (see the module's docstring). ValueError where the two come from
    different cards (unless mixed) or share no row."""
    if not (isinstance(labels, (list, tuple)) and len(labels) == 2
            and all(isinstance(s, str) for s in labels)):
        raise ValueError(f"labels={labels!r}: expected two strings")
    devs = (before.get("device"), after.get("device"))
    if None not in devs and devs[0] != devs[1] and not mixed:
        raise ValueError(f"records from different cards ({devs[0]!r}, {devs[1]!r}): a before / after ratio "
                         "compares one run on one card (mixed=True to show them anyway)")
    routes = (before.get("routing", "model"), after.get("routing", "model"))
    if routes[0] != routes[1]:
        raise ValueError(f"records of different routings ({routes[0]!r}, {routes[1]!r}): compare sweeps of "
                         "one router")
    b = {_key(c): c for c in before["cells"] if _ok(c)}
    a = {_key(c): c for c in after["cells"] if _ok(c)}
    both = [k for k in a if k in b]
    if not both:
        raise ValueError("the two records share no measured row (context, batch, chain tau, mode, budget, "
                         "layers)")
    order = {"ar": 0, "dflash": 1, "ddtree": 2}
    both.sort(key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2], order.get(k[3], 9),
                             _budget_order(k[4]), k[4], str(k[5])))
    rows = [row(b[k], a[k]) for k in both]
    cells = []
    for ctx, bat, tau in dict.fromkeys((r["context"], r["batch"], r["tau_chain"]) for r in rows):
        def own(side: dict) -> list:
            return [c for k, c in side.items() if (k[0], k[1], k[2]) == (ctx, bat, tau)]
        cells.append({"context": ctx, "batch": bat, "tau_chain": tau,
                      "before": _ratios(own(b)), "after": _ratios(own(a))})
    unmatched = sorted({str(k) for k in set(a) ^ set(b)})
    return {"bench": "k26_compare", "labels": list(labels), "devices": list(devs),
            "layers": [before.get("layers"), after.get("layers")],
            "decode_paths": [before.get("decode_path"), after.get("decode_path")],
            "rows": rows, "cells": cells, "unmatched": unmatched}


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown(cmp: dict) -> str:
    """The comparison as two markdown tables: rows, then each cell's ratios."""
    lb, la = cmp["labels"]
    devs = cmp["devices"]
    dev = devs[1] if devs[0] == devs[1] else " / ".join(map(str, devs))
    layers = sorted({str(r["layers"]) for r in cmp["rows"]})
    lines = [f"K2.6 shape ({', '.join(layers)} MoE layers), {lb} -> {la}, {dev}; rows matched by context, "
             "batch, chain tau, mode, budget, layers; round times are median GPU spans of the rounds with "
             "every slot live.", "",
             f"| context | batch | tau | mode | B | floor ms | {lb} ms | {la} ms | speed-up | {lb} % floor | "
             f"{la} % floor | {lb} tok/s | {la} tok/s | kernels {lb} -> {la} |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in cmp["rows"]:
        bb, aa = r["before"], r["after"]
        fl = aa["floor_s"] if aa["floor_s"] is not None else bb["floor_s"]
        kern = ("—" if bb["kernels"] is None and aa["kernels"] is None
                else f"{bb['kernels']} -> {aa['kernels']}")
        lines.append(
            f"| {r['context']} | {r['batch']} | {_f(r['tau_chain'], 'g')} | {r['mode']} | "
            f"{'' if r['budget'] is None else r['budget']} | {_f(fl and fl * 1e3, '.2f')} | "
            f"{bb['round_s'] * 1e3:.2f} | {aa['round_s'] * 1e3:.2f} | {r['speedup']:.2f}x | "
            f"{_f(bb['floor_fraction'] and bb['floor_fraction'] * 100, '.0f')} | "
            f"{_f(aa['floor_fraction'] and aa['floor_fraction'] * 100, '.0f')} | "
            f"{bb['tok_per_s']:.1f} | {aa['tok_per_s']:.1f} | {kern} |")
    lines += ["", f"| context | batch | tau | best fixed / AR {lb} | {la} | auto / AR {lb} | {la} | "
              f"auto / best fixed {lb} | {la} |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cmp["cells"]:
        bb, aa = c["before"], c["after"]
        vals = [_f(d.get(k), ".2f") for k in ("best_fixed_over_ar", "auto_over_ar", "auto_over_best_fixed")
                for d in (bb, aa)]
        head = f"| {c['context']} | {c['batch']} | {_f(c['tau_chain'], 'g')} | "
        lines.append(head + " | ".join(vals) + " |")
    if cmp["unmatched"]:
        lines += ["", f"Unmatched rows (on one side only, or failed): {len(cmp['unmatched'])}."]
    return "\n".join(lines) + "\n"


def plot(cmp: dict, path=None):
    """Round GPU span before / after per row, the floor as a tick, a panel per (context, batch, tau); saved
    at `path` when given; returns the figure (open: plt.show() draws it in a notebook)."""
    import matplotlib.pyplot as plt
    cells = cmp["cells"]
    n = len(cells)
    cols = min(n, 3)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), squeeze=False)
    lb, la = cmp["labels"]
    for ax, c in zip(axes.flat, cells):
        rows = [r for r in cmp["rows"] if (r["context"], r["batch"], r["tau_chain"])
                == (c["context"], c["batch"], c["tau_chain"])]
        names = [r["mode"] if r["budget"] is None else f"B={r['budget']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["before"]["round_s"] * 1e3 for r in rows], 0.4, label=lb,
               color="0.65")
        ax.bar([i + 0.2 for i in x], [r["after"]["round_s"] * 1e3 for r in rows], 0.4, label=la, color="C0")
        fl = [r["after"]["floor_s"] for r in rows]
        if any(f is not None for f in fl):
            ax.scatter([i for i, f in zip(x, fl) if f is not None], [f * 1e3 for f in fl if f is not None],
                       marker="_", s=400, color="C3", label="byte floor", zorder=3)
        ax.set_xticks(list(x), names, rotation=30, fontsize=8)
        ax.set_ylabel("round GPU span (ms)")
        ax.set_title(f"ctx {c['context']}, batch {c['batch']}, tau {_f(c['tau_chain'], 'g')}", fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"K2.6 round time, {lb} vs {la} ({cmp['devices'][1]})", fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.k26_compare",
                                 description="two K2.6 sweeps side by side (k26_compare.json / .md / .png)")
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--labels", nargs=2, default=("before", "after"), metavar=("BEFORE", "AFTER"))
    ap.add_argument("--out", default=None, help="folder for the three files (default: AFTER's folder)")
    ap.add_argument("--mixed", action="store_true", help="allow records of two different cards")
    a = ap.parse_args(argv)
    try:
        cmp = compare(load(a.before), load(a.after), tuple(a.labels), a.mixed)
    except ValueError as e:
        raise SystemExit(f"k26_compare: {e}") from None
    out = Path(a.out) if a.out else Path(a.after).parent
    if out.exists() and not out.is_dir():
        raise SystemExit(f"k26_compare: --out {str(out)!r}: expected a folder, found a file")
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(cmp)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.close(plot(cmp, out / "k26_compare.png"))
    (out / "k26_compare.json").write_text(json.dumps(cmp, indent=1) + "\n")
    (out / "k26_compare.md").write_text(md)
    print(md)
    return cmp


if __name__ == "__main__":
    main()
