"""The results page from the lab's JSON records: `python -m kdtree report [--records DIR] [--out FILE]`.

docs/results.md is this module's output over outputs/ (a test keeps the two equal), so its numbers cannot
drift from the records. Each GPU record folder, outputs/<gpu>/ (for example outputs/h200/), is a section:
every goal of its records in one table, then each known record's main tables; a record the folder lacks is
named with the command that writes it, an unknown one by its name only. outputs/ itself holds the CPU's smoke
records, rewritten by every CPU run: they are named, not tabulated. `python -m kdtree lab` rewrites the page
after a run that wrote into a GPU folder.
"""
from __future__ import annotations

import argparse
import json
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
    """A number for a table: None as a dash, integers with separators, floats to `digits` significant."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != x:
            return "nan"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return str(x)


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
    gpus = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.json")))
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
