"""K2.6 shape end to end on one GPU through the engine, with SIMULATED acceptance (labelled so in every row):
`python -m kdtree.bench.k26 --out DIR [--cells 4096:1 4096:8 ...] [--profiles 5:8 ...]` merges its rows into
DIR/e2e_k26.json per cell and profile (`merge`: a long sweep runs as several commands, a cell's profiles
too; every row names its run, and each ratio pairs rows of one run).

The target: `k26.build_target` (real dimensions, distinct random layers, INT4 experts in one copy) with as
many MoE layers as fit the largest cell asked for (`fit_layers`), and in each (context, batch) cell the same
layer count for every mode (a cell whose engine does not fit beside the built weights, `fit_cell`, runs on
fewer of the same model's layers, or is skipped). The drafter:
Kimi-K2.5-DFlash's shape, random, run every round (its cost is real). Acceptance: `kdtree.simulate` profiles
(chain tau with the drafter's block: 3 and 5 at block 8, 8 at block 16; `--trained FILE`: the trained pair's
realized curve fitted as one more, `Profile.fit`); every kernel of the round runs at its real shape on real
data; every mode of a profile, AR included, reads the profile's simulated text (the same tokens, so the
same routing). Per cell and profile: AR, the DFlash chain, DDTree at each fixed budget and budget="auto"
("previous"), each `repeats` times after a short warm-up run, each repeat with its own request seeds (the
profile's draws: one per request and output position, shared by every plan and cell of a repeat,
independent across repeats): median per-round latency and GPU span, per-user and aggregate tok/s (whole
requests of `max_new(batch)` tokens after their prefill of a short prompt; the long context is synthetic,
`Engine.add_request(synthetic_context=)`, its fill left out of the times), tau (of the median repeat;
`tau_repeats` all); from batch 2 on, `queued`: the same engine serving `queue` x batch requests through its
waiting queue (`measure_queue`: a warm-up run, then the median of `repeats`), whose full-batch rounds are a
serving queue's steady state (a static batch ends on its slowest request). A top-level `targets` list (the
static batch's and the queue's). Rows whose routing was measured carry
`floor` (`kdtree.bench.floors`: the round's byte floor by part, its seconds at the copy rate measured in the
run, its fraction of the median round's GPU span) and the DFlash row `drafter_floor` (the draft stage's).

This module runs the sweep (`run`, `measure_routing`, `measure_queue`) and is its command (`main`); the
cells' defaults, engine keywords, memory fit and argument checks are `kdtree.bench.k26_cells`', a sweep's
rows into a record (`merge`, `cell_targets`, `draft_times`) `kdtree.bench.k26_record`'s, both re-exported.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from collections import Counter
from pathlib import Path

import torch

from .. import k26
from ..engine import Engine
from ..engine.config import PREFIX_ATTNS
from ..simulate import Profile
from .clocks import gpu_state
from .ceilings import copy_bandwidth
from .e2e import _cell
from .floors import draft_stage_parts, round_floor, round_floor_parts
from .k26_cells import (BUDGETS, CELLS, DECODE_PATHS, MAX_NEW, MIN_LAYERS, PROFILES, PROMPT,  # noqa: F401
                        _first_layers, _with_block, cell_bytes, cell_engine, cell_prompts, check_sweep,
                        fit_cell, fit_layers, max_new)
from .k26_record import _queued, _targets, cell_targets, draft_times, merge  # noqa: F401
from .layer import count_experts, routed_kernel_s
from .serve import run_engine, write_record
from .stages import stage_kernels


def measure_routing(engine: Engine, prompts, rounds: int = 3, **add) -> dict:
    """The engine's real routing, from `rounds` eager rounds of every prompt at once (graph replays run no
    hooks): {"experts_touched": distinct routed experts one MoE layer reads per verify forward,
    "moe_kernel_s": the routed experts' kernels (moe_*) seconds per MoE layer and round, torch.profiler's
    kernel times}. Prompt i's request is seeded i, as `run_engine` seeds the measured runs: a simulated
    profile's text is the seed's, so one seed for all would feed every request the same tokens (fewer
    experts read than the runs read). The engine must be idle; the requests are served to the end (a few
    rounds each)."""
    from torch.profiler import ProfilerActivity

    from .profiling import profile
    from ..model import MoE
    moe = [layer.mlp for layer in engine.model.model.layers if isinstance(layer.mlp, MoE)]
    seen = []
    hooks = count_experts(moe, seen)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(p, 3 * engine.max_accept + 2, seed=i, **add)
        engine.step()
        engine.step()
        b = engine.bucket(len(engine.active))
        snapshot = [t.clone() for t in (engine.lens, engine.root)]
        seen.clear()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(rounds):  # the same round from the same state: no request advances
                engine.runner.round(b, False)
                engine.lens.copy_(snapshot[0])
                engine.root.copy_(snapshot[1])
            engine.sync()
        got = list(seen)
    finally:
        for h in hooks:
            h.remove()
    engine.run()
    kern = routed_kernel_s(prof)
    return {"experts_touched": float(sum(got) / len(got)) if got else None,
            "moe_kernel_s": kern / (rounds * len(moe)) if kern > 0 else None}

def run(cells=CELLS, profiles=PROFILES, budgets=BUDGETS, repeats: int = 3, n_max: int = 16,
        progress: bool = True, device="cuda", args=None, dargs=None, layers: int | None = None,
        on_engine=None, routing: str = "model", queue: int = 2, decode_path: str = "default",
        prefix_attn: str = "off") -> dict:
    """The cells (module docstring) -> {"cells": [...], "targets": [...], "layers": {cell: MoE layers}}.
    device / args / dargs / layers: a smaller model and a fixed layer count (tests on a CPU).
    on_engine(record so far): called after every engine (a long sweep keeps what it measured if cut off).
    Each row's elapsed_s: the wall seconds its engine took, build to queue (a command's time to plan by).
    routing: `k26.build_target`'s ("model": the random router's concentrated choice; "uniform": every row
    its own experts, the spread of a trained router across requests). queue: from batch 2 on, each engine
    also serves `queue` x batch requests that wait for a slot (`queued`: whole-run and full-batch tok/s,
    `run_engine`), the steady state of a serving queue where a static batch ends on its slowest request.
    decode_path: the target's layers through kdtree.fused's kernels ("fused", where they apply), the torch
    path ("torch", Transformer.fused False: the path before the fused layer) or the model's default
    ("default"); the path taken is named in the record and rows."""
    profiles = list(profiles)
    fitted = [isinstance(p, Profile) for p in profiles]   # a given Profile: a fitted one (`--trained`)
    profiles = check_sweep(cells, profiles, budgets, repeats, queue)
    if decode_path not in DECODE_PATHS:
        raise ValueError(f"decode_path={decode_path!r}: expected one of {DECODE_PATHS}")
    if prefix_attn not in PREFIX_ATTNS:
        raise ValueError(f"prefix_attn={prefix_attn!r}: expected one of {PREFIX_ATTNS}")
    rows = max(budgets) + 1
    gpu = torch.device(device).type == "cuda"
    free = torch.cuda.mem_get_info()[0] if gpu else None
    # every cell runs on the model built once: as many layers as the most demanding cell leaves room for
    n_model = layers or min(fit_layers(free, b, c, rows, n_max) for c, b in cells)
    if n_model == 0:
        raise ValueError(f"bench_k26: the cells {list(cells)} do not all fit in {free / 2**30:.0f} GiB "
                         f"free with one MoE layer: ask for the larger cells in a command of their own")
    t0 = time.perf_counter()
    target = k26.build_target(n_model, device=device, args=args, kernel_only=gpu, routing=routing)
    if decode_path != "default":
        target.fused = decode_path == "fused"
    decode_path = "fused" if target.fused else "torch"
    drafter = k26.build_drafter(target, args=None if dargs is None else
                                k26.drafter_args(target.args, **dargs))
    run_id = time.strftime("%Y%m%dT%H%M%S")   # each row's sweep: ratios pair rows of one run
    rec = {"label": "K2.6 shape, random weights, SIMULATED acceptance (kdtree.simulate profiles), routing "
                    f"{routing}", "routing": routing, "built_layers": n_model, "decode_path": decode_path,
           "build_s": time.perf_counter() - t0,
           "weight_bytes": k26.weight_bytes(target),
           "cells": [], "targets": [], "layers": {}}
    weights = k26.weight_bytes(target) + k26.weight_bytes(drafter)
    if gpu:   # the byte floors' divisor, measured in this run (`floors`)
        rec["copy_bytes_per_s"] = copy_bandwidth()["bytes_per_s"]
    rec["prefix_attn"] = prefix_attn
    sweep = _Sweep(profiles, fitted, budgets, repeats, queue, rows, gpu, device, weights, run_id, decode_path,
                   rec.get("copy_bytes_per_s"), prefix_attn)
    for context, batch in cells:
        # every built layer stays resident: the cell's engine must fit in what the weights leave free
        if gpu:
            torch.cuda.empty_cache()   # the last cell's engines: their cached blocks count as used
        free_now = torch.cuda.mem_get_info()[0] if gpu else 0
        n = fit_cell(free_now, target.args, drafter.args, batch, context, rows, n_model) if gpu else n_model
        rec["layers"][f"{context}:{batch}"] = n
        if n == 0:
            need = cell_bytes(target.args, drafter.args, batch, context, rows, 1)
            why = (f"its engine (~{need / 2**30:.1f} GiB) does not fit in the {free_now / 2**30:.1f} GiB the "
                   f"{n_model}-layer model leaves free")
            rec.setdefault("skipped", []).append({"cell": f"{context}:{batch}", "reason": why})
            if progress:
                print(f"K2.6 cell {context}:{batch} skipped: {why}")
            continue
        t, d = _first_layers(target, drafter, n)
        rows_cell = _cell_rows(sweep, rec, t, d, context, batch, n, on_engine, progress)
        rec["cells"] += draft_times(rows_cell)
        rec["targets"] += _targets(rows_cell, context, batch, n)
    return rec


@dataclasses.dataclass(frozen=True)
class _Sweep:
    """What every engine of one `run` shares: its checked arguments and what it built."""
    profiles: list        # the checked profiles, in order
    fitted: list          # per profile: a fitted one (a given Profile, `--trained`)
    budgets: tuple | list  # the fixed budgets, as given (auto chooses among them)
    repeats: int
    queue: int
    rows: int             # the largest tree's verified rows: max(budgets) + 1
    gpu: bool
    device: object
    weights: int          # the built target's and drafter's weight bytes
    run_id: str           # each row's `run`
    decode_path: str      # the path taken: "fused" or "torch"
    copy_bytes_per_s: float | None = None   # the copy rate measured in the run (GPU): the floors' divisor
    prefix_attn: str = "off"   # every engine's prefix_attn


def _cell_rows(sweep: _Sweep, rec: dict, t, d, context: int, batch: int, n: int, on_engine,
               progress: bool) -> list[dict]:
    """The rows of one (context, batch) cell on the target t and drafter d of n MoE layers: per profile,
    AR, the DFlash chain, DDTree at each fixed budget and at budget="auto" (`_engine_row` each). After each
    row: on_engine (when given) with rec's rows and this cell's so far, marked "partial"; garbage collected
    and the CUDA cache emptied; (progress) a line printed."""
    prompts = cell_prompts(batch, batch)
    rows_cell = []
    common = cell_engine(context, batch, max_new(batch), sweep.rows)
    specs = []
    for i, prof in enumerate(sweep.profiles):   # AR too reads the profile's text: every mode the same tokens
        specs += [(i, m, B, prof) for m, B in [("ar", None), ("dflash", None)] +
                  [("ddtree", B) for B in sweep.budgets] + [("ddtree", "auto")]]
    for spec_i, mode, budget, prof in specs:
        c = _engine_row(sweep, t, d, context, batch, n, prompts, common, spec_i, mode, budget, prof)
        rows_cell.append(c)
        if on_engine is not None:
            on_engine({**rec, "cells": rec["cells"] + draft_times(rows_cell), "partial": True})
        gc.collect()
        torch.cuda.empty_cache()
        if progress:
            print(_progress_line(c, context, batch, n, mode, budget, prof), flush=True)
    return rows_cell


def _engine_row(sweep: _Sweep, t, d, context: int, batch: int, n: int, prompts, common: dict, spec_i: int,
                mode: str, budget, prof) -> dict:
    """One engine's row: the engine of `mode` and `budget` on the cell's keywords `common`, simulating
    profile prof (index spec_i of sweep.profiles), measured by `_cell` over prompts (each with the cell's
    synthetic context) with `_after`'s fields; an exception is recorded as the row's "error". On a GPU the
    peak bytes beyond the weights against `cell_bytes`' estimate and the clock state at start and end; then
    the row's labels (cell, layers, mode, budget, run, profile, elapsed_s, decode_path)."""
    kw = dict(common, mode=mode)
    if budget is not None:
        kw["budget"] = budget
    if budget == "auto":
        kw.update(budgets=tuple(sweep.budgets))
    if sweep.prefix_attn != "off":
        kw["prefix_attn"] = sweep.prefix_attn
    if prof is not None:
        kw["simulate"] = prof
    dd = None if mode == "ar" else _with_block(d, prof.depth + 1)
    start = time.perf_counter()
    add = dict(synthetic_context=context - PROMPT)
    after = _after(sweep, prompts, context, batch, add, mode, budget, spec_i == 0)
    gpu = sweep.gpu
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    st0 = gpu_state(sweep.device) if gpu else None
    try:
        c = _cell(lambda: Engine(t, dd, **kw), prompts, max_new(batch), sweep.repeats, add=add, after=after,
                  warm_new=max_new(batch) // 4, reseed=True)
    except Exception as e:  # recorded; the sweep goes on
        c = {"error": f"{type(e).__name__}: {e}"[:400], "tok_per_s": None, "tau": None}
    c.pop("outputs", None)
    if gpu:   # what the engine held beyond the weights at its peak, against fit_layers' estimate
        ka = k26.target_args(1)
        c.update(peak_bytes=torch.cuda.max_memory_allocated() - sweep.weights,
                 estimate_bytes=cell_bytes(ka, k26.drafter_args(ka), batch, context, sweep.rows, n))
    if gpu:   # the clock state at the engine's start and end (a power cap would slow later engines)
        c["gpu_state"] = [st0, gpu_state(sweep.device)]
    _floors(c, sweep, t, dd, mode, context, batch)
    c.update(context=context, batch=batch, layers=n, mode=mode, budget=budget, run=sweep.run_id,
             profile=None if prof is None else prof.name,
             tau_chain=None if prof is None else prof.tau_chain,
             block=None if prof is None else prof.depth + 1,
             fitted=sweep.fitted[spec_i], elapsed_s=time.perf_counter() - start,
             decode_path=sweep.decode_path, prefix_attn=sweep.prefix_attn)
    return c


def _floors(c: dict, sweep: _Sweep, t, d, mode: str, context: int, batch: int) -> None:
    """Row c's byte floors (`floors`), where its routing was measured: "floor", the round's at the cell's
    batch (its fraction of the median GPU span of the rounds with every slot live, else of all rounds; the
    cell's context for every request: the rows a request adds while it runs are left out), and in a DFlash
    row whose stages were profiled, "drafter_floor" (`draft_stage_parts`) against its draft stage's GPU
    seconds."""
    if c.get("experts_touched") is None:
        return
    parts = round_floor_parts(t, d, mode, c["experts_touched"], context, batch)
    span = c.get("full_round_gpu_span_median_s") or c.get("round_gpu_span_median_s")
    c["floor"] = round_floor(parts, sweep.copy_bytes_per_s, span)
    draft_s = (c.get("stages") or {}).get("draft", {}).get("gpu_s")
    if mode == "dflash":
        c["drafter_floor"] = round_floor(draft_stage_parts(parts, d), sweep.copy_bytes_per_s, draft_s)


def _after(sweep: _Sweep, prompts, context: int, batch: int, add: dict, mode: str, budget, first: bool):
    """The after(engine) -> dict of an engine's `_cell`, measured on the idle engine: the routing of every
    fixed plan's rounds (`measure_routing`); on a GPU, the DFlash engine's stages (an eager round under the
    profiler, at the cell's batch and context: the drafter's measured cost) and, of the first profile, the
    largest tree's (one request: the kernels whose time grows with the rows); of the first profile from
    batch 2 on, an AR round's stages at the cell's batch and context (the AR engine's, and auto's AR plan);
    from batch 2 on, the serving queue (`measure_queue`, where sweep.queue)."""
    gpu, budgets = sweep.gpu, sweep.budgets

    def after(e):
        out = {} if budget == "auto" else measure_routing(e, prompts, **add)
        if gpu and mode == "dflash":
            out["stages"] = stage_kernels(e, prompts[0], batch=batch, **add)
            out["stages_at"] = {"batch": batch, "context": context}
        elif gpu and first and budget == max(budgets):
            out["stages"] = stage_kernels(e, prompts[0])
        if first and batch > 1 and (mode == "ar" or budget == "auto"):
            # an AR round at the cell's batch and context: the AR engine's against auto's AR plan
            out["ar_stages"] = stage_kernels(e, prompts[0], batch=batch, **add,
                                             plan="AR" if budget == "auto" else None)
        if sweep.queue and batch > 1:
            out["queued"] = measure_queue(e, batch, sweep.queue, sweep.repeats, **add)
        return out
    return after


def _progress_line(c: dict, context: int, batch: int, n: int, mode: str, budget, prof) -> str:
    """Row c's progress line: its cell, layers, mode, budget and profile, tok/s and tau (or its error), the
    queue's full-batch tok/s where measured, and its elapsed seconds."""
    what = c.get("error") or f"{c['tok_per_s']:8.1f} tok/s  tau {c['tau'] or 0:.2f}"
    if _queued(c):
        what += (f"  queue {_queued(c):8.1f} tok/s (full batch, "
                 f"{c['queued'].get('admissions', '?')} admissions)")
    return (f"{context:6d} b={batch:2d} L={n:2d} {mode:6s} {str(budget):5s} "
            f"{'' if prof is None else f'tau_c {prof.tau_chain:g}'}  {what}  "
            f"({c['elapsed_s']:.0f} s)")


def measure_queue(e: Engine, batch: int, queue: int, repeats: int, **add) -> dict:
    """Engine e serving queue x batch requests through its waiting queue (`run_engine`): a warm-up run of
    max(max_new(batch) // 4, 2) tokens a request (requests that end apart are admitted apart, so most prefill
    group sizes are met and their graphs captured there, out of the timed runs), then `repeats` runs, run
    k's request i seeded 9000 + 1000 k + i in every plan of the cell (run k reads the same texts in every
    plan). The run of median full-batch tok/s (the lower median; "median_run": its k, which may differ
    between plans) gives {"tok_per_s", "full_tok_per_s", "full_rounds", "rounds", "tokens", "tau",
    "prefill_s", "admissions", "admitted", "admit_cost", "plan_counts" and "plan_runs" (budget="auto": the
    rounds' plans in order as [plan, live requests, rounds in a row])};
    "full_tok_per_s_repeats" / "tok_per_s_repeats" all runs', "requests"."""
    prompts = cell_prompts(queue * batch, batch)
    run_engine(e, prompts, max(max_new(batch) // 4, 2), seed0=8000, **add)
    runs = []
    for k in range(repeats):
        h0 = len(e.auto.history) if e.auto is not None else 0
        q = run_engine(e, prompts, max_new(batch), seed0=9000 + 1000 * k, **add)
        q.pop("outputs")
        if e.auto is not None:
            q["plan_counts"] = dict(Counter(h[2] for h in e.auto.history[h0:]))
            q["plan_runs"] = _runs((h[2], h[1]) for h in e.auto.history[h0:])
        runs.append(q)
    order = sorted(range(len(runs)), key=lambda k: runs[k]["full_tok_per_s"] or 0.0)
    k = order[(len(runs) - 1) // 2]
    out = {key: runs[k][key] for key in ("tok_per_s", "full_tok_per_s", "full_rounds", "rounds", "tokens",
                                         "tau", "prefill_s", "admissions", "admitted", "admit_cost",
                                         "plan_counts", "plan_runs") if key in runs[k]}
    out.update(median_run=k, full_tok_per_s_repeats=[q["full_tok_per_s"] for q in runs],
               tok_per_s_repeats=[q["tok_per_s"] for q in runs], requests=len(prompts))
    return out


def _runs(seq) -> list:
    """[[plan, live requests, count]] of the (plan, live) pairs of seq, equal neighbours counted together."""
    out = []
    for name, n in seq:
        if out and out[-1][:2] == [name, n]:
            out[-1][2] += 1
        else:
            out.append([name, n, 1])
    return out


def trained_curve(path) -> dict:
    """The trained pair's calibration_check ({"budgets", "realized", ...}) from an e2e_auto.json (its
    "trained" section) or the lab's e2e.json (its "auto" section); SystemExit naming what is missing."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench_k26: --trained {path}: not a readable JSON file ({e})") from None
    for key in ("trained", "auto"):   # an e2e_auto.json's section first
        sec = rec.get(key) if isinstance(rec, dict) else None
        cc = sec.get("calibration_check") if isinstance(sec, dict) else None
        ok = isinstance(cc, dict) and all(isinstance(cc.get(k), list) for k in ("budgets", "realized"))
        if ok and cc["budgets"] and len(cc["budgets"]) == len(cc["realized"]):
            return cc
    raise SystemExit(f"bench_k26: --trained {path}: no trained.calibration_check or auto.calibration_check "
                     "with equal-length lists budgets and realized (notebook 02's stage auto writes it)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.k26",
                                 description="K2.6 shape end to end, simulated acceptance (DIR/e2e_k26.json)")
    ap.add_argument("--out", default="outputs")
    ap.add_argument("--cells", nargs="+", default=[f"{c}:{b}" for c, b in CELLS], help="CONTEXT:BATCH")
    ap.add_argument("--profiles", nargs="*", default=[f"{t:g}:{b}" for t, b in PROFILES],
                    help="TAU:BLOCK (none: only --trained's)")
    ap.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--queue", type=int, default=2,
                    help="from batch 2 on, each engine also serves QUEUE x batch queued requests (0: none)")
    ap.add_argument("--routing", choices=k26.ROUTINGS, default="model",
                    help="the random router as it is, or uniform (DIR/e2e_k26_uniform.json)")
    ap.add_argument("--decode-path", choices=DECODE_PATHS, default="default",
                    help="the target's layers as the model does by default (Transformer.fused), through "
                    "kdtree.fused's kernels, or the torch path (a same-run baseline: write it to another "
                    "--out)")
    ap.add_argument("--prefix-attn", choices=PREFIX_ATTNS, default="off",
                    help="every engine's verify attention over committed pages through FlashInfer (Engine "
                    "prefix_attn): write it to another --out")
    ap.add_argument("--trained", default=None,
                    help="an e2e_auto.json (or the lab's e2e.json) whose calibration_check (the trained "
                    "pair's realized tokens per truncation) becomes one more profile (Profile.fit, block 16)")
    a = ap.parse_args(argv)

    def pair(s, kinds, what):
        try:
            x, y = s.split(":")
            return kinds[0](x), kinds[1](y)
        except ValueError:
            raise SystemExit(f"bench_k26: {what} {s!r}: expected two numbers joined by ':'") from None
    cells = [pair(s, (int, int), "--cells") for s in a.cells]
    profiles = [pair(s, (float, int), "--profiles") for s in a.profiles]
    if a.trained:
        cc = trained_curve(a.trained)
        profiles.append(Profile.fit(cc["budgets"], cc["realized"], depth=15, K=2 * max(a.budgets)))
    if not profiles:
        raise SystemExit("bench_k26: --profiles: expected at least one TAU:BLOCK, or --trained FILE")
    try:
        check_sweep(cells, profiles, a.budgets, a.repeats, a.queue)
    except ValueError as e:
        raise SystemExit(f"bench_k26: {e}") from None
    if not torch.cuda.is_available():
        raise SystemExit("bench_k26: needs a CUDA GPU")
    from ..lab import record_dir_or_exit
    out = record_dir_or_exit(a.out, "cuda", "bench_k26")
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("e2e_k26.json" if a.routing == "model" else f"e2e_k26_{a.routing}.json")
    old = json.loads(path.read_text()) if path.is_file() else None
    card = torch.cuda.get_device_name()
    if old and old.get("device") not in (None, card):
        raise SystemExit(f"bench_k26: {path} holds rows measured on {old['device']!r}, this is {card!r}: "
                         "a record holds one card's rows (give another --out)")

    def save(rec):
        rec = merge(old, rec)
        rec["device"] = card
        if rec.get("partial"):
            path.write_text(json.dumps(rec, indent=1) + "\n")
        else:
            write_record(path, rec)
    save(run(cells, profiles, tuple(a.budgets), a.repeats, on_engine=save, routing=a.routing, queue=a.queue,
             decode_path=a.decode_path, prefix_attn=a.prefix_attn))


if __name__ == "__main__":
    main()
