"""Serving drivers of the engine benchmarks: every prompt through an engine at once (`run_engine`), the same
with overlap off (`serial`), and writing a record (`write_record`)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..engine import Engine
from . import goals


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(engine: Engine, prompts, max_new: int, temperature: float = 0.0, seed0: int = 0,
               steps: list | None = None, **add) -> dict:
    """Every prompt through the engine at once (the engine batches up to max_batch); wall time of the whole
    run and of each round (median), GPU span per round (median; `full_round_gpu_span_median_s`: of the rounds
    with every slot of max_batch live), tokens, tau, outputs; prefill_s (the engine's
    prefill wall time in the run), prefill_forwards / prefill_replays (of them, graph replays: a chunk shape
    seen before) and decode_tok_per_s (tokens after each request's first, over the wall time outside prefill);
    request_rounds: each request's target forwards (its rounds). Rounds overlap (`Engine.step(overlap=True)`,
    run()'s schedule) when the engine's overlap is on: a round's wall time is then the interval between two
    rounds landing; budget="auto": `round_wall_by_plan` {plan: [median wall s, rounds]}. Request i's seed is
    seed0 + i. add: more add_request keywords (e.g. synthetic_context: the fill of those rows, `synthetic_s`
    with a simulated profile's texts, is left out of the wall time and prefill_s).
    full_tok_per_s: the tokens of the steps that began with a request waiting behind active ones or whose
    landed round had every slot of max_batch live (their admissions included) over those steps' wall time,
    `full_rounds` of them; with more prompts than max_batch the engine admits waiting requests as slots
    free (a queue), and this is its steady state (with grouped admission, the rounds whose freed slots wait
    for company count; `admissions`: the prefills of the run, `admitted` their [requests, prompt rows,
    seconds, captured a prefill graph], `admit_cost` the grouped engine's fit at the end, None without
    one). steps: a list that takes each step's {"s": wall less its prefill and fill, "prefill_s", "plan"
    (of the round it landed; None: none landed, or not budget="auto"), "catchup" (the drafter's deferred
    context caught up in the round it launched)} (`bench.steps`)."""
    rounds, spans, full_spans, by_plan = [], [], [], {}
    full_tok, full_s, n_full = 0, 0.0, 0
    ids = [engine.add_request(p, max_new, temperature, seed=seed0 + i, **add) for i, p in enumerate(prompts)]
    _sync()
    p0, f0, r0, s0 = engine.prefill_s, engine.prefill_forwards, engine.prefill_replays, engine.synthetic_s
    a0, admits = engine.admissions, []
    t0 = time.perf_counter()
    while engine.waiting or engine.active or engine.in_flight:
        before, syn, pre, pend = (engine.rounds, engine.synthetic_s, engine.prefill_s,
                                   getattr(engine.policy, "pending", 0))
        queued, na = bool(engine.waiting and engine.active), engine.admissions
        ts = time.perf_counter()
        got = engine.step(overlap=True)
        dt = time.perf_counter() - ts - (engine.synthetic_s - syn)
        if engine.admissions > na:
            admits.append(list(engine.last_admission))
        if steps is not None:
            landed = engine.last_round if engine.rounds > before else {}
            steps.append({"s": dt - (engine.prefill_s - pre), "prefill_s": engine.prefill_s - pre,
                          "plan": landed.get("plan"), "catchup": getattr(engine.policy, "pending", 0) < pend})
        if engine.rounds > before:
            lr = engine.last_round
            if queued or lr["batch"] == engine.max_batch:
                full_tok += sum(len(v) for v in got.values())
                full_s, n_full = full_s + dt, n_full + 1
            rounds.append(lr["round"])
            if "plan" in lr:
                by_plan.setdefault(lr["plan"], []).append(lr["round"])
            if "gpu_span" in lr:
                spans.append(lr["gpu_span"])
                if lr["batch"] == engine.max_batch:
                    full_spans.append(lr["gpu_span"])
    _sync()
    synthetic = engine.synthetic_s - s0
    wall = time.perf_counter() - t0 - synthetic
    res = engine.finished
    outs = [res[i] for i in ids]
    toks = sum(len(r.tokens) for r in outs)
    acc = [a for r in outs for a in r.accept_lengths]
    prefill, fit = engine.prefill_s - p0, engine.admit_cost()
    return {"wall_s": wall, "tokens": toks, "tok_per_s": toks / wall,
            "per_user_tok_per_s": toks / wall / len(prompts) if engine.max_batch >= len(prompts) else None,
            "prefill_s": prefill, "synthetic_s": synthetic,
            "prefill_forwards": engine.prefill_forwards - f0, "prefill_replays": engine.prefill_replays - r0,
            "admissions": engine.admissions - a0, "admitted": admits,
            "admit_cost": None if fit is None else list(fit),
            "decode_tok_per_s": (toks - len(outs)) / (wall - prefill) if wall > prefill else None,
            "full_tok_per_s": full_tok / full_s if full_s > 0 else None, "full_rounds": n_full,
            "rounds": len(rounds), "round_wall_median_s": statistics.median(rounds) if rounds else None,
            "round_gpu_span_median_s": statistics.median(spans) if spans else None,
            "full_round_gpu_span_median_s": statistics.median(full_spans) if full_spans else None,
            "tau": float(np.mean(acc)) if acc else None, "overlap": engine.overlap,
            "request_rounds": [r.target_forwards for r in outs],
            **({"round_wall_by_plan": {k: [statistics.median(v), len(v)] for k, v in by_plan.items()}}
               if by_plan else {}),
            "outputs": [r.tokens for r in outs]}


def serial(engine: Engine, prompts, max_new: int, outputs) -> dict:
    """The same engine with each round landing before the next launches (overlap off), same run: the
    baseline of the overlapped schedule. Its tok/s and round medians, and whether its outputs equal
    `outputs`."""
    was, engine.overlap = engine.overlap, False
    try:
        r = run_engine(engine, prompts, max_new)
    finally:
        engine.overlap = was
    keep = ("tok_per_s", "decode_tok_per_s", "round_wall_median_s", "round_gpu_span_median_s")
    return {**{k: r[k] for k in keep}, "equal_outputs": r["outputs"] == outputs}


def write_record(path: Path, rec: dict) -> None:
    """The record as JSON at `path`, then its targets and the path printed, a line each."""
    path.write_text(json.dumps(rec, indent=1) + "\n")
    for t in rec.get("targets", []):
        print(goals.line(t))
    print(path)
