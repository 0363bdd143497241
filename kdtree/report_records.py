"""Each known record's main tables on the results page (kdtree.report): `RENDER` maps a GPU folder's record
name to the function that turns the record (its parsed JSON) into markdown lines.
"""
from __future__ import annotations

from .report_format import _ms, _num, _table, _us


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
