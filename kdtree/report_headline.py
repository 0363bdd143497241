"""The results page's opening section (kdtree.report.headline): does DDTree pay, at which batch and budget,
against which AR, on which card. `_k26_headline` tabulates the K2.6-shape rows (SIMULATED acceptance) of the
GPU folders' e2e.json and `python -m kdtree.bench.k26` records (with a before / after line where one folder
holds a cell on both decode paths, `_decode_path_verdicts`); `_pair_headline` the trained pair's (real
acceptance, a tiny model) of their e2e.json and engine.json. Each takes the GPU folders and returns markdown
lines, [] where no folder holds a row; each speculative row is over the engine's own AR of the same record,
run and cell.
"""
from __future__ import annotations

import json
from pathlib import Path

from .report_format import _num, _table, _x


def _read(path: Path):
    """The parsed JSON at `path`; None where it is missing or not JSON."""
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
    paths: dict = {}   # (folder, subfolder, card, batch, context, layers, tau) -> {decode path: cell entry}
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
            if sec.get("decode_path") in ("torch", "fused"):
                for tc, v in cell.items():
                    key = (g.name, Path(name).parent.as_posix(), card, b, C, layers, tc)
                    paths.setdefault(key, {}).setdefault(sec["decode_path"], v)   # a folder's first record
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
    verdicts += _decode_path_verdicts(paths)
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


def _decode_path_verdicts(paths: dict) -> list[str]:
    """A line per (card, cell, profile) that one folder holds on both decode paths (two bench.k26 records,
    --decode-path torch and fused, of one folder: one lease by the folder's README): the engine's AR and
    what DDTree buys over it on each."""
    out = []
    for key, by in sorted(paths.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]), kv[0][3],
                                                         kv[0][4], str(kv[0][5]), kv[0][6])):
        gpu, sub, card, b, C, layers, tc = key
        if "torch" not in by or "fused" not in by:
            continue
        t, f = by["torch"], by["fused"]
        both = t["auto"] is not None and f["auto"] is not None
        auto = f"; auto {_x(t['auto'])} -> {_x(f['auto'])}" if both else ""
        less = ": a faster AR leaves DDTree less to win" if f["ar"] > t["ar"] and f["x"] < t["x"] else ""
        out.append(f"- The fused decode layers against the torch path (`{gpu}/{sub}/`, {card}, batch {b}, "
                   f"context {C:,}, {layers} MoE layers, τc {tc:g}): AR {_num(t['ar'])} -> {_num(f['ar'])} "
                   f"tok/s, the best fixed budget over AR {_x(t['x'])} -> {_x(f['x'])}{auto}{less}.")
    return out


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
