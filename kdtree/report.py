"""The results page from the lab's JSON records: `python -m kdtree report [--records DIR] [--out FILE]`.

docs/results.md is this module's output over outputs/ (a test keeps the two equal), so its numbers cannot
drift from the records. The page opens with the answer (`headline`): does DDTree pay, at which batch and
budget, against which AR, on which card: the K2.6-shape rows (SIMULATED acceptance) and the trained pair's
(real acceptance, a tiny model), each speculative row over the engine's own AR of the same record, run and
cell. Then each GPU record folder, outputs/<gpu>/ (for example outputs/h200/), is a section: every goal of
its records in one table, then each known record's main tables; a record the folder lacks is named with the
command that writes it, an unknown one by its name only. outputs/ itself holds the CPU's smoke records: they
are named, not tabulated; outputs/cpu/ (a CPU lab run's git-ignored folder) is no GPU section. `python -m
kdtree lab` rewrites the page after a run that wrote into a GPU folder. Every number on the page is written
in positional notation (thousands separators, fixed decimals), never in exponent form.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from .bench import goals

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "outputs"
PAGE = ROOT / "docs" / "results.md"

# the records a GPU folder is expected to hold, in page order, with the command that writes each
GPU_RECORDS = {
    "golden_validation.json": "python -m kdtree lab 00",
    "bench_kernels.json": "python -m kdtree bench",
    "microbench_k26.json": "python -m kdtree lab 01",
    "bench_drafter.json": "python -m kdtree.bench.drafter --out outputs/<gpu>",
    "engine.json": "python -m kdtree.bench.engine --out outputs/<gpu>",
    "engine_mid.json": "python -m kdtree.bench.engine --mid-only --out outputs/<gpu>",
    "e2e.json": "python -m kdtree lab 02 (stages pair, auto, k26)",
    "trained_pair.json": "python -m kdtree lab 03 -p stage measure",
    "bridge.json": "python -m kdtree bench --bridge",
    "bench_decode.json": "python -m kdtree.bench.decode --out outputs/<gpu>/bench_decode.json",
}


def _num(x, digits: int = 3) -> str:
    """A number for a table: None as a dash, integers with separators, floats to `digits` significant digits
    in positional notation (999.6 -> "1,000", 0.000012 -> "0.000012"; never "1e+03")."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "nan" if x != x else ("inf" if x > 0 else "-inf")
        if x == 0:
            return "0"
        dec = digits - 1 - math.floor(math.log10(abs(x)))
        if dec <= 0:
            return f"{x:,.0f}"
        text = f"{x:,.{dec}f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    return str(x)


def _x(r) -> str:
    """A ratio as "1.29x" (two decimals)."""
    return "-" if r is None else f"{r:.2f}x"


def _ms(s) -> str:
    return "-" if s is None else f"{1e3 * s:.3f}"


def _us(s) -> str:
    return "-" if s is None else f"{1e6 * s:.1f}"


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(c if isinstance(c, str) else _num(c) for c in r) + " |" for r in rows]
    return out + [""]


def _targets(targets: list[dict], where: str, seen: set | None = None) -> list[list]:
    """Table rows of a record's targets ({name, measured, goal, met}; bridge.json's older {what, batch,
    budget, value, goal, met}), judged against kdtree/bench/goals.json where the target's goal is known there
    (the record's own goal and met otherwise); the keys found are added to `seen`."""
    rows = []
    for t in targets:
        key = goals.key_of(t)
        g = goals.goals().get(key) if key else None
        name = goals.shown_name(t)
        measured = t.get("measured", t.get("value"))
        if g is not None:
            if seen is not None:
                seen.add(key)
            info = g.get("info", False) or "(info)" in name
            met = goals.met(key, measured)
            goal = g["goal"]
        else:
            info, met, goal = "(info)" in name, t.get("met"), t.get("goal")
        status = "info" if info else "met" if met else "**missed**"
        rows.append([where, name, _num(measured), _num(goal), status])
    return rows


def _phase_kernels(cells) -> list[str]:
    """Auto's round (its most chosen tree plan) stage by stage beside the fixed round of that tree, from the
    cells' `stage_kernels` (eager profiles: kernels launched and their GPU time per stage), where recorded."""
    stages = ("draft", "build", "verify", "walk", "commit")
    rows = []
    for c in cells:
        sk = c.get("stage_kernels") or {}
        if c.get("budget") != "auto" or "plan" not in sk:
            continue
        fixed = next((f.get("stage_kernels") for f in cells if f.get("batch") == c.get("batch")
                      and f.get("name") == sk["plan"]), None) or {}
        for who, k in ((c["name"], sk), (sk["plan"], fixed)):
            if "total" in k:
                rows.append([c["batch"], who, *(f"{k[st]['kernels']:.0f} / {1e6 * k[st]['gpu_s']:.0f}"
                                                for st in (*stages, "total"))])
    if not rows:
        return []
    return ["Auto's round beside the fixed round of the tree it chose most, kernels / GPU µs per stage "
            "(eager profile; auto's build stage holds the plans' expected tokens and the block's copies):",
            "",
            *_table(["batch", "round", *stages, "total"], rows)]


def all_targets(rec_name: str, rec) -> list[dict]:
    """Every {name, measured, goal, met} of a record: its top-level `targets`, else its sections' (a record
    whose top level repeats its sections' targets is counted once)."""
    if not isinstance(rec, dict):
        return []
    if rec.get("targets"):
        return list(rec["targets"])
    out = []
    for v in rec.values():
        if isinstance(v, dict) and v.get("targets"):
            out += v["targets"]
    return out


# ------------------------------------------------------------------------------------------ the answer
def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _k26_sections(folder: Path) -> list[tuple[str, dict]]:
    """(record name, K2.6 section) of a GPU folder: its e2e.json's `k26` (notebook 02's sweep), then every
    finished `python -m kdtree.bench.k26` record in its subfolders (`<sub>/.../e2e_k26*.json`, not
    `.partial`)."""
    out = []
    rec = _read(folder / "e2e.json")
    if isinstance(rec, dict) and isinstance(rec.get("k26"), dict) and rec["k26"].get("cells"):
        out.append(("e2e.json", {"device": rec.get("device"), **rec["k26"]}))
    for path in sorted(folder.rglob("e2e_k26*.json")):
        sec = _read(path)
        if path.parent == folder or path.name.endswith(".partial.json") or not isinstance(sec, dict):
            continue
        sec = sec.get("k26", sec)
        if isinstance(sec, dict) and sec.get("cells") and not sec.get("partial"):
            out.append((path.relative_to(folder).as_posix(), sec))
    return out


def _k26_cell(rows: list[dict]) -> dict:
    """One (context, batch) cell of a K2.6 section: per simulated profile (chain tau) the best fixed budget
    and auto over the AR row of the same run and profile (an AR row without a profile where the record has
    only one)."""
    out = {}
    for tc in sorted({c.get("tau_chain") for c in rows if c.get("tau_chain")}):
        rs = [c for c in rows if c.get("tau_chain") == tc]
        ar = next((c for c in rs if c["mode"] == "ar"), None) or next(
            (c for c in rows if c["mode"] == "ar" and not c.get("tau_chain")), None)
        fixed = [c for c in rs if c["mode"] == "ddtree" and c.get("budget") != "auto" and c.get("tok_per_s")]
        if not ar or not ar.get("tok_per_s") or not fixed:
            continue
        best = max(fixed, key=lambda c: c["tok_per_s"])
        auto = next((c for c in rs if c.get("budget") == "auto" and c.get("tok_per_s")), None)
        out[tc] = {"ar": ar["tok_per_s"], "budget": best["budget"], "x": best["tok_per_s"] / ar["tok_per_s"],
                   "auto": auto and auto["tok_per_s"] / ar["tok_per_s"],
                   "fitted": any(c.get("fitted") for c in rs)}
    return out


def _tau_head(tc: float, fitted: bool) -> str:
    return f"τc {tc:g}" + (" (fitted to the trained pair)" if fitted else "")


def _k26_headline(gpus: list[Path]) -> list[str]:
    sources = sorted(((g, name, sec) for g in gpus for name, sec in _k26_sections(g)),
                     key=lambda t: (t[1] != "e2e.json", t[0].name, t[1]))   # the lab's sweeps first
    rows, verdicts, notes, taus, fitted = [], [], [], set(), set()
    for g, name, sec in sources:
        cells = [c for c in sec["cells"] if not c.get("error") and c.get("tok_per_s")]
        card = sec.get("device") or "-"
        where = f"`{g.name}/{name}`" + (f" ({sec['decode_path']} decode)" if sec.get("decode_path") else "")
        by_batch: dict = {}
        for C, b in sorted({(c["context"], c["batch"]) for c in cells}, key=lambda k: (k[1], k[0])):
            cell = _k26_cell([c for c in cells if (c["context"], c["batch"]) == (C, b)])
            if not cell:
                continue
            layers = next(c.get("layers") for c in cells if (c["context"], c["batch"]) == (C, b))
            taus |= set(cell)
            fitted |= {tc for tc, v in cell.items() if v["fitted"]}
            rows.append((where, card, b, C, layers, cell))
            by_batch.setdefault(b, []).extend((C, tc, v) for tc, v in cell.items())
        if name == "e2e.json":   # the lab's sweep: one verdict a batch size
            for b, got in by_batch.items():
                pays = [(v["x"], tc, C, v["budget"]) for C, tc, v in got if v["x"] > 1]
                autos = [v["auto"] for _, _, v in got if v["auto"] is not None]
                text = (f"- **batch {b}** ({card}): the best fixed budget beats AR in {len(pays)} of "
                        f"{len(got)} (context, profile) cells")
                if pays:
                    x, tc, C, B = max(pays)
                    text += f", by up to {_x(x)} (τc {tc:g}, context {C:,}, B = {B})"
                    text += f"; budgets that pay: {', '.join(str(v) for v in sorted({p[3] for p in pays}))}"
                else:
                    text += ": DDTree does not pay here"
                if autos:
                    text += f"; `budget=\"auto\"` gives {_x(min(autos))} to {_x(max(autos))} of AR"
                verdicts.append(text + ".")
            pf = sec.get("projection_full") or {}
            for b in sorted({r["batch"] for r in pf.get("rows", [])}):
                sp = [r["speedup"] for r in pf["rows"] if r["batch"] == b and r.get("speedup")]
                if sp:
                    verdicts.append(f"- {pf.get('label', 'PROJECTED')} (not measured: notebook 01's layer "
                                    f"times, the engine's routing): batch {b}, the best budget "
                                    f"{_x(min(sp))} to {_x(max(sp))} of AR over the same profiles.")
            one = next((r for r in sorted(pf.get("rows", []), key=lambda r: (r["batch"], r["context"]))
                        if r.get("ar_tok_per_s")), None)
            first = next((r for r in rows if r[0] == where), None)
            if one and first:
                notes.append(f"The engine AR column is the AR of each cell's partial model (for example "
                             f"{_num(first[5][next(iter(first[5]))]['ar'])} tok/s at batch {first[2]}, "
                             f"context {first[3]:,}, {first[4]} MoE layers on the {card}), all requests "
                             "together: neither the trained pair's AR below (a model of a few million "
                             "parameters) nor a whole K2.6, whose AR is PROJECTED at "
                             f"{_num(one['ar_tok_per_s'])} tok/s per user at batch {one['batch']}, context "
                             f"{one['context']:,}.")
    if not rows:
        return []
    taus = sorted(taus)
    table = [[where, card, b, C, layers, cell[taus[0]]["ar"] if taus[0] in cell else
              next(iter(cell.values()))["ar"],
              *[(f"**{_x(cell[tc]['x'])}** at B = {cell[tc]['budget']}" if cell[tc]["x"] > 1 else
                 f"{_x(cell[tc]['x'])} at B = {cell[tc]['budget']}")
                + (f" (auto {_x(cell[tc]['auto'])})" if cell[tc]["auto"] is not None else "")
                if tc in cell else "-" for tc in taus]]
             for where, card, b, C, layers, cell in rows]
    return ["### Kimi-class (K2.6 shape), SIMULATED acceptance", "",
            "The real K2.6 dimensions with random weights (INT4 routed experts, a Kimi-K2.5-DFlash-shaped "
            "drafter), as many of the 61 layers as fit one GPU (MoE layers column); accept lengths drawn "
            "from simulated drafter profiles of chain τ (τc), not from a trained Kimi drafter. "
            "Each ratio is the best fixed budget's tok/s (all requests) over the AR row of the same record, "
            "run, cell and profile: the engine's own AR on the same card (CUDA graphs, same layers); "
            "bold where DDTree pays (above 1); auto is `budget=\"auto\"` in the same run.", "",
            *verdicts, "",
            *_table(["record", "card", "batch", "context", "MoE layers", "engine AR, tok/s",
                     *[_tau_head(tc, tc in fitted) for tc in taus]], table),
            *([" ".join(notes), ""] if notes else [])]


def _pair_headline(gpus: list[Path]) -> list[str]:
    rows, notes = [], []
    for g in gpus:
        rec = _read(g / "e2e.json")
        rec = rec if isinstance(rec, dict) else {}
        card = rec.get("device") or "-"
        pair = rec.get("pair") or {}
        t0 = [r for r in pair.get("rows", []) if not r.get("temperature")]
        ar = next((r for r in t0 if r["mode"] == "ar"), None)
        dd = [r for r in t0 if r["mode"] == "ddtree" and r.get("tok_per_s")]
        if ar and dd:
            best = max(dd, key=lambda r: r["tok_per_s"])
            rows.append([f"`{g.name}/e2e.json` pair", card, "reference loop (`kdtree.decode`, eager, one "
                         "request after another)", 1, ar["tok_per_s"],
                         f"{_num(best['tok_per_s'])} (B = {best['budget']:,})", _x(best["tok_per_s"] /
                                                                                  ar["tok_per_s"]), "-"])
            notes.append(f"{_num(ar['tok_per_s'])} tok/s ({card}) is the reference loop's AR (notebook 02 "
                         "section 1): eager torch, no CUDA graphs, host-bound; its DDTree rows run the same "
                         "loop.")
        auto = rec.get("auto") or {}
        cells = [c for c in auto.get("cells", []) if not c.get("error") and c.get("tok_per_s")]
        for b in sorted({c["batch"] for c in cells}):
            cs = [c for c in cells if c["batch"] == b]
            ar = next((c for c in cs if c["mode"] == "ar" and not c.get("compiled")), None)
            arc = next((c for c in cs if c["mode"] == "ar" and c.get("compiled")), None)
            fixed = [c for c in cs if c["mode"] == "ddtree" and c.get("budget") != "auto"]
            au = next((c for c in cs if c.get("budget") == "auto" and c.get("decide") in (None, "previous")),
                      None)
            if not ar or not fixed:
                continue
            best = max(fixed, key=lambda c: c["tok_per_s"])
            rows.append([f"`{g.name}/e2e.json` auto", card, f"engine, CUDA graphs, {auto.get('dtype', '')}"
                         + (" + torch.compile" if auto.get("compile") else ""), b, ar["tok_per_s"],
                         f"{_num(best['tok_per_s'])} (B = {best['budget']:,})",
                         _x(best["tok_per_s"] / ar["tok_per_s"]),
                         _x(au["tok_per_s"] / ar["tok_per_s"]) if au else "-"])
            if b == 1 and arc:
                notes.append(f"{_num(ar['tok_per_s'])} tok/s ({card}) is the engine's AR with CUDA graphs at "
                             "batch 1 (notebook 02 section 5, the baseline of the goal table's auto rows); "
                             f"{_num(arc['tok_per_s'])} tok/s is the same AR through torch.compile as well "
                             "(\"AR compiled\"), whose DDTree rows are not compiled: the like-for-like "
                             "compiled comparison is `engine.json`'s rows.")
        eng = _read(g / "engine.json")
        eng = eng if isinstance(eng, dict) else {}
        spec = [dict(r, batch=r.get("batch", 1)) for r in eng.get("speculative", [])] + eng.get("batched", [])
        for b in sorted({r["batch"] for r in spec}):
            rs = [r for r in spec if r["batch"] == b and r.get("tok_per_s")]
            ar = next((r for r in rs if r["mode"] == "ar"), None)
            dd = [r for r in rs if r["mode"] == "ddtree"]
            if not ar or not dd:
                continue
            best = max(dd, key=lambda r: r["tok_per_s"])
            comp = eng.get("compile") if b == 1 else eng.get("batched_compile", eng.get("compile"))
            rows.append([f"`{g.name}/engine.json`", eng.get("device") or card,
                         f"engine, CUDA graphs{' + torch.compile' if comp else ''}, float32, every mode",
                         b, ar["tok_per_s"], f"{_num(best['tok_per_s'])} (B = {best['budget']:,})",
                         _x(best["tok_per_s"] / ar["tok_per_s"]), "-"])
    if not rows:
        return []
    tp = next((r for r in (_read(g / "trained_pair.json") for g in gpus) if isinstance(r, dict)), {})
    size = ", ".join(f"{who} {_num(tp[who]['params'] / 1e6)} M parameters" for who in ("target", "drafter")
                     if isinstance(tp.get(who), dict) and tp[who].get("params"))
    return ["### The trained pair, real acceptance (a tiny model)", "",
            "The lab's trained target and drafter (`data/trained/`, notebook 03: a K2.6-style MoE"
            + (f"; {size}" if size else "") + ") on held-out prompts at T = 0 (the goal table holds their "
            "lossless checks). Each ratio is the best fixed budget's tok/s over the AR of the same record "
            "and path; auto is `budget=\"auto\"` (decide \"previous\", the engine's default) in the same "
            "run.", "",
            *_table(["record", "card", "path", "batch", "AR, tok/s", "best DDTree, tok/s", "x AR",
                     "auto x AR"], rows),
            *(["Which AR is which: " + " ".join(notes), ""] if notes else [])]


def headline(records: Path | str = RECORDS) -> list[str]:
    """The page's opening section: the K2.6-shape table (SIMULATED acceptance) and the trained pair's (real
    acceptance), from every GPU folder of `records`; [] where no record holds either."""
    gpus = _gpu_folders(Path(records), depth=2)
    body = _k26_headline(gpus) + _pair_headline(gpus)
    if not body:
        return []
    return ["## The answer: does DDTree pay?", "", *body]


def _gpu_folders(root: Path, depth: int = 1) -> list[Path]:
    """outputs/<gpu>/: the folders of `root` holding JSON records (at their top; depth 2: or in a subfolder
    at any depth), outputs/cpu/ (a CPU lab run's) excepted."""
    from .lab_params import CPU_DIR
    pats = ("*.json", "*/**/*.json")[:depth]
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name != CPU_DIR and any(any(p.glob(pat)) for pat in pats))


# ------------------------------------------------------------------------------------------ per record
def _golden(rec) -> list[str]:
    g = rec.get("golden", {})
    cases, fails = g.get("cases"), g.get("failures")
    lines = [f"Golden twins: {_num(cases)} cases, {_num(fails)} failures "
             f"({rec.get('device_name') or rec.get('device')}, torch {rec.get('torch')}, "
             f"{_num(rec.get('wall_s'))} s)."]
    k = rec.get("kernels")
    if isinstance(k, dict):
        lines += ["", *_table(["kernel check", "value"], [[name, v] for name, v in k.items()
                                                          if isinstance(v, (bool, int, float))])]
    return lines + [""]


def _engine(rec) -> list[str]:
    lines = [f"{rec.get('device')}, torch {rec.get('torch')}, transformers {rec.get('transformers', '-')}; "
             f"{rec.get('prompts')} prompts of {rec.get('prompt_len')} tokens x {rec.get('max_new_tokens')} "
             "new tokens; tok/s over whole requests (prefill included).", ""]
    rows = []
    for dt, r in rec.get("ar", {}).items():
        hf = r.get("hf", {}).get("tok_per_s")
        rows.append([f"transformers generate, {dt}", hf, "-", "-", "-"])
        for key, label in (("engine_eager", "eager"), ("engine", "CUDA graphs"),
                           ("engine_compiled", "graphs + compile")):
            e = r.get(key) or {}
            if "tok_per_s" not in e:
                continue
            kern = {"engine_eager": r.get("launches", {}).get("kernels"),
                    "engine": r.get("launches", {}).get("kernels"),
                    "engine_compiled": r.get("launches_compiled", {}).get("kernels")}[key]
            rows.append([f"engine AR, {label}, {dt}", e["tok_per_s"], _ms(e.get("round_wall_median_s")),
                         _ms(e.get("round_gpu_span_median_s")), kern])
            if e.get("serial"):  # the same engine, each round landing before the next launches
                se = e["serial"]
                rows.append([f"engine AR, {label}, rounds not overlapped, {dt}", se["tok_per_s"],
                             _ms(se.get("round_wall_median_s")), _ms(se.get("round_gpu_span_median_s")),
                             kern])
    if rows:
        lines += ["AR at batch 1:", "", *_table(["path", "tok/s", "round wall ms", "round GPU ms",
                                                 "kernels a round"], rows)]
    sp = rec.get("speculative", [])
    if sp:
        lines += ["Batch 1, float32 (lossless: every output equals the oracle AR; not overlapped: the same "
                  "engine, each round landing before the next launches):", "",
                  *_table(["mode", "budget", "tau", "tok/s", "round wall ms", "round GPU ms", "lossless",
                           "tok/s not overlapped"],
                          [[r["mode"], r.get("budget"), r.get("tau"), r.get("tok_per_s"),
                            _ms(r.get("round_wall_median_s")), _ms(r.get("round_gpu_span_median_s")),
                            r.get("lossless"), (r.get("serial") or {}).get("tok_per_s")] for r in sp])]
    bt = rec.get("batched", [])
    if bt:
        lines += ["Batched (aggregate and per-user tok/s):", "",
                  *_table(["batch", "mode", "budget", "tau", "tok/s", "per user", "round wall ms"],
                          [[r["batch"], r["mode"], r.get("budget"), r.get("tau"), r.get("tok_per_s"),
                            r.get("per_user_tok_per_s"), _ms(r.get("round_wall_median_s"))] for r in bt])]
    det = rec.get("deterministic_cost")
    if det:
        lines += [f"`deterministic=True`: {_num(det['round_ratio'])}x a round (one request, max_batch "
                  f"{det['max_batch']}).", ""]
    return lines


def _engine_mid(rec) -> list[str]:
    bw = rec.get("copy_bandwidth")
    bw = bw.get("bytes_per_s") if isinstance(bw, dict) else bw
    best = rec.get("best")
    best = best.get("moe", best) if isinstance(best, dict) else best
    return [f"Mid-size model ({rec.get('config')}, {_num(rec.get('params'))} parameters, "
            f"{rec.get('dtype')}): weight-bytes floor {_ms(rec.get('floor_s'))} ms a token "
            f"({_num(rec.get('weight_bytes'))} bytes over {_num(bw and bw / 1e12)} TB/s); "
            f"best path {best}.", ""]


def _cells(cells: list[dict], extra: tuple = ()) -> list[str]:
    head = ["batch", *[h for h, _ in extra], "name", "tau", "tok/s", "decode tok/s", "round wall ms",
            "round GPU ms"]
    rows = [[c.get("batch"), *[f(c) for _, f in extra], c.get("name") or _cell_name(c), c.get("tau"),
             c.get("tok_per_s"), c.get("decode_tok_per_s"), _ms(c.get("round_wall_median_s")),
             _ms(c.get("round_gpu_span_median_s"))] for c in cells]
    return _table(head, rows)


def _cell_name(c: dict) -> str:
    name = c.get("mode", "?") if c.get("budget") is None else f"B={c['budget']}"
    return name + (f" ({c['profile']})" if c.get("profile") else "")


def _e2e(rec) -> list[str]:
    lines = []
    pair = rec.get("pair")
    if isinstance(pair, dict) and pair.get("rows"):
        lines += [f"Trained pair ({pair.get('prompts')} held-out prompts x {pair.get('max_new_tokens')} new "
                  "tokens):", "",
                  *_table(["T", "mode", "budget", "tau", "tok/s", "forwards / token", "lossless"],
                          [[r.get("temperature"), r["mode"], r.get("budget"), r.get("tau"),
                            r.get("tok_per_s"), r.get("forwards_per_token"), r.get("lossless")]
                           for r in pair["rows"]])]
    auto = rec.get("auto")
    if isinstance(auto, dict) and auto.get("cells"):
        lines += [f"`budget=\"auto\"` against every fixed budget ({auto.get('dtype', '')}, "
                  f"{auto.get('prompt_len')}-token prompts x {auto.get('max_new_tokens')} new tokens, "
                  f"median of {auto.get('repeats')}):", "", *_cells(auto["cells"])]
        lines += _phase_kernels(auto["cells"])
    k26 = rec.get("k26")
    if isinstance(k26, dict) and k26.get("cells"):
        lines += [f"K2.6 shape ({k26.get('label', '')}):", "",
                  *_cells(k26["cells"], extra=(("context", lambda c: c.get("context")),
                                               ("layers", lambda c: c.get("layers"))))]
    return lines


def _bridge(rec) -> list[str]:
    rows = [[r["batch"], r["budget"], _ms(r.get("reference_s")), _ms(r.get("native_graph_s")),
             _num(r.get("native_graph_speedup")), _ms(r.get("typed_s")), _num(r.get("typed_speedup"))]
            for r in rec.get("rows", [])]
    return ["Tree build through the bridges against the reference path (ms a call):", "",
            *_table(["batch", "B", "reference", "native (graph)", "x", "typed", "x"], rows)]


def _trained(rec) -> list[str]:
    rows = [[r.get("temperature"), r["mode"], r.get("budget"), r.get("tau"), r.get("tok_per_s"),
             r.get("forwards_per_token"), r.get("lossless")] for r in rec.get("measure", [])]
    return ["The trained pair on held-out prompts (notebook 03's measure stage):", "",
            *_table(["T", "mode", "budget", "tau", "tok/s", "forwards / token", "lossless"], rows)]


def _kernels(rec) -> list[str]:
    tr = [[r["batch"], r["budget"], _ms(r.get("gpu_graph_s")), _ms(r.get("reference_s")),
           r.get("speedup_vs_reference")] for r in rec.get("tree_round", [])]
    va = [[r["context"], r["nodes"], r["batch"], r.get("impl"), _ms(r.get("kernel_s")),
           r.get("frac_matmul_rate"), r.get("frac_bandwidth")] for r in rec.get("verify_attn", [])]
    lines = []
    if tr:
        lines += ["Tree round (top-K + tree + verify block; V = 163,840, L = 15), ms:", "",
                  *_table(["batch", "B", "graph", "reference path", "x"], tr)]
    if va:
        lines += ["verify_attn (MLA tree-verify attention), ms:", "",
                  *_table(["context", "nodes", "batch", "kernel", "time", "of matmul rate",
                           "of bandwidth"], va)]
    return lines


def _microbench(rec) -> list[str]:
    lines = _kernels(rec)
    moe = [[r["tokens"], r.get("experts_touched"), _ms(r.get("kernel_s")), r.get("frac_bandwidth"),
            r.get("speedup_vs_bf16_experts")] for r in rec.get("moe_int4", [])]
    if moe:
        lines += ["moe_int4 (one K2.6 MoE layer, INT4 routed experts), ms:", "",
                  *_table(["tokens", "experts touched", "kernel", "of bandwidth", "x bf16 experts"], moe)]
    lv = [[r["kind"], r["context"], r["batch"], r["nodes"], _ms(r.get("time_s"))]
          for r in rec.get("layer_verify", [])]
    if lv:
        lines += ["One K2.6 layer's verify forward, ms:", "",
                  *_table(["layer", "context", "batch", "nodes", "time"], lv)]
    return lines


def _drafter(rec) -> list[str]:
    import torch
    from .drafter import draft_attn_auto

    def auto(c):  # the current rule's choice on the record's GPU (the record's own "auto" is its run's rule)
        G = c["num_attention_heads"] // c["num_key_value_heads"]
        return draft_attn_auto("cuda", getattr(torch, c["dtype"]), c["batch"], c["num_key_value_heads"],
                               G * c["block_size"], c["head_dim"], have_cupy=True)
    rows = [[c["drafter"], c["dtype"], c["batch"], c["context"], auto(c), _us(c["math"]["median_s"]),
             _us(c["sdpa"]["median_s"]), _us((c.get("kernel") or {}).get("median_s")),
             c.get("sdpa_over_math")] for c in rec.get("cells", [])]
    return [f"{rec.get('device')}, torch {rec.get('torch')}: one drafter layer's drafting pass "
            "(`DraftAttention.forward_buffered`) over its preallocated context, per attention impl, graph "
            "replays (median), µs; `auto` as the code decides now:", "",
            *_table(["drafter", "dtype", "batch", "context", "auto", "math", "sdpa", "kernel", "sdpa / math"],
                    rows)]


RENDER = {"golden_validation.json": _golden, "bench_drafter.json": _drafter, "trained_pair.json": _trained,
          "bench_kernels.json": _kernels, "microbench_k26.json": _microbench, "engine.json": _engine,
          "engine_mid.json": _engine_mid, "e2e.json": _e2e, "bridge.json": _bridge}


def _folder(folder: Path, expected) -> list[str]:
    lines, rows, seen = [], [], set()
    have = {p.name: p for p in sorted(folder.glob("*.json"))}
    for name in expected:
        if name not in have:
            how = GPU_RECORDS.get(name, "")
            lines += [f"### {name}", "", f"No record yet: `{how}` writes it.", ""]
            continue
        rec = json.loads(have[name].read_text())
        lines += [f"### {name}", ""]
        if name in RENDER:
            lines += RENDER[name](rec)
        rows += _targets(all_targets(name, rec), name, seen)
    others = [n for n in have if n not in expected]
    if others:
        names = ", ".join(f"`{n}`" for n in others)
        lines += [f"Other records here (probes and earlier runs): {names}.", ""]
    head = []
    if rows:
        met = sum(r[-1] == "met" for r in rows)
        n = sum(r[-1] != "info" for r in rows)
        head = [f"Goals ({goals.PATH.parent.name}/{goals.PATH.name}): {met} of {n} met (rows marked info are "
                "context, not goals).", "", *_table(["record", "what", "measured", "goal", "status"], rows)]
    unmeasured = [k for k, g in goals.goals().items()
                  if k not in seen and not g.get("info") and not g.get("failure_only")]
    if unmeasured:
        head += ["Goals no record here measures yet: " + "; ".join(
            re.sub(r"{(\w+)}", r"<\1>", goals.goal(k)["name"]) + f" ({goals.goal(k)['record']})"
            for k in unmeasured) + ".", ""]
    return head + lines


def report(records: Path | str = RECORDS) -> str:
    """The page (markdown) for the record folder `records` (outputs/ and its GPU subfolders)."""
    root = Path(records)
    if not root.is_dir():
        raise ValueError(f"records: {root} is not a folder (expected the lab's outputs/)")
    lines = ["# Results", "",
             "Generated by `python -m kdtree report` from the JSON records under `outputs/`; do not edit it.",
             "Absolute times are from the GPU named in each section; ratios compare rows of one run.", ""]
    lines += headline(root)
    gpus = _gpu_folders(root)
    if not gpus:
        lines += ["No GPU record yet: run `make lab` on a machine with a CUDA GPU.", ""]
    for g in gpus:
        lines += [f"## {g.name} (`outputs/{g.name}/`)", "", *_folder(g, tuple(GPU_RECORDS))]
    cpu = sorted(p.name for p in root.glob("*.json"))
    if cpu:  # rewritten by every CPU `make lab`: named here, not tabulated
        lines += ["## CPU smoke records (`outputs/`)", "",
                  "`make lab` on a CPU runs the notebooks with tiny defaults and writes "
                  + ", ".join(f"`{n}`" for n in cpu) + ": they show that the notebooks run, not how fast "
                  "anything is, and no goal applies to them.", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree report", description=__doc__.splitlines()[0])
    ap.add_argument("--records", default=str(RECORDS), help="the record folder (default: outputs/)")
    ap.add_argument("--out", default=str(PAGE), help="the page (default: docs/results.md); - prints it")
    a = ap.parse_args(argv)
    try:
        page = report(a.records)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if a.out == "-":
        print(page, end="")
        return 0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
