"""The sections of the engine benchmark's record (`kdtree.bench.engine.run`, whose module docstring names the
fields): each runs its engines on the GPU, fills its part of the record and writes the record so far to
out/engine.json (`save`), so a run cut off keeps every finished section's rows.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .. import weights
from ..engine import Engine
from .baselines import hf_generate
from .goals import target as _goal
from .serve import run_engine, serial
from .stages import launches_per_round, stage_kernels

DTYPES = (("float32", torch.float32), ("bfloat16", torch.bfloat16))   # the AR section's rows, in order


def save(out: Path, rec: dict) -> None:
    """The record as it stands into out/engine.json (the partial record of a run cut off later)."""
    (out / "engine.json").write_text(json.dumps(rec, indent=1))


def ar_section(rec: dict, out: Path, ckpt: Path, p1, max_new: int, max_len: int, hf: bool,
               decode_path: str) -> list[dict]:
    """AR at batch 1 per dtype (DTYPES): the target loaded from ckpt/target (its layers per decode_path),
    its row (`ar_row`) into rec["ar"][dtype] and the record saved after each; returns the rows' targets."""
    targets = []
    for name, dt in DTYPES:
        target = weights.load(ckpt / "target", device="cuda", dtype=dt).eval()
        if decode_path != "default":
            target.fused = decode_path == "fused"
        row = ar_row(target, name, dt, ckpt, p1, max_new, max_len, hf)
        rec["ar"][name] = row
        save(out, rec)  # partial records survive a timeout
        targets.append(_goal("ar_ms_per_token", row["ms_per_token"], dtype=name, engine=row["best"]))
        if "x_hf" in row:
            targets.append(_goal("ar_x_hf", row["x_hf"], dtype=name, engine=row["best"]))
        targets.append(_goal("ar_wall_over_span", row["round_wall_over_gpu_span"], dtype=name))
        del target
        torch.cuda.empty_cache()
    return targets


def ar_row(target, name: str, dt, ckpt: Path, p1, max_new: int, max_len: int, hf: bool) -> dict:
    """One dtype's AR row on `target`: the engine with CUDA graphs, with graphs off (its kernels per round)
    and compiled (`compiled_rows`); float32 against the oracle loop; transformers' generate on ckpt/target
    in dtype dt where hf; the best engine's ms per token, wall over GPU span and (hf) ratio over HF. The
    rows' token outputs are compared here and left out of the row."""
    from ..oracle import oracle_ar
    row = {"dtype": name, "params": sum(p.numel() for p in target.parameters()),
           "decode_path": "fused" if target.fused else "torch"}
    t0 = time.perf_counter()
    e = Engine(target, mode="ar", max_batch=1, max_len=max_len, graph_sampling=False)
    row["warmup_s"] = time.perf_counter() - t0
    run_engine(e, p1[:1], 8)
    row["engine"] = run_engine(e, p1, max_new)
    eg = Engine(target, mode="ar", max_batch=1, max_len=max_len, graphs=False)
    run_engine(eg, p1[:1], 8)
    row["engine_eager"] = run_engine(eg, p1, max_new)
    row["eager_equals_graphs"] = row["engine_eager"]["outputs"] == row["engine"]["outputs"]
    row["launches"] = launches_per_round(eg, p1[0])
    eg.run()
    compiled_rows(row, target, p1, max_new, max_len)
    if name == "float32":
        ref = [oracle_ar(target, p, max_new).tokens for p in p1]
        row["equals_oracle"] = ref == row["engine"]["outputs"]
    if hf:
        row["hf"] = hf_generate(ckpt / "target", dt, p1, max_new)
        row["hf_equals_engine"] = row["hf"]["outputs"] == row["engine"]["outputs"]
        row["x_hf"] = row["engine"]["tok_per_s"] / row["hf"]["tok_per_s"]
    best = row["engine_compiled"] if "tok_per_s" in row["engine_compiled"] else row["engine"]
    row["best"] = "compiled" if best is row["engine_compiled"] else "graphs"
    row["ms_per_token"] = 1e3 * best["round_wall_median_s"]  # one token per AR round
    row["round_wall_over_gpu_span"] = best["round_wall_median_s"] / best["round_gpu_span_median_s"]
    if "x_hf" in row:
        row["x_hf"] = best["tok_per_s"] / row["hf"]["tok_per_s"]
    for k in ("engine", "engine_eager"):
        row[k].pop("outputs")
    if "hf" in row:
        row["hf"].pop("outputs")
    return row


def compiled_rows(row: dict, target, p1, max_new: int, max_len: int) -> None:
    """The compiled AR engine's part of `row`, in place: "engine_compiled" (its run, warm-up seconds and
    serial run), "compiled_equals_engine", "launches_compiled" and "stage_kernels"; a failure is recorded
    as engine_compiled's "error" (the uncompiled rows stand). row["engine"] must hold its outputs."""
    row["engine_compiled"] = {}
    try:
        t0 = time.perf_counter()
        ec = Engine(target, mode="ar", max_batch=1, max_len=max_len, graph_sampling=False, compile=True)
        warm = time.perf_counter() - t0
        run_engine(ec, p1[:1], 8)
        row["engine_compiled"] = run_engine(ec, p1, max_new)
        row["engine_compiled"]["warmup_s"] = warm
        row["engine_compiled"]["serial"] = serial(ec, p1, max_new, row["engine_compiled"]["outputs"])
        row["compiled_equals_engine"] = row["engine_compiled"].pop("outputs") == row["engine"]["outputs"]
        row["launches_compiled"] = launches_per_round(Engine(target, mode="ar", max_batch=1,
                                                             max_len=max_len, graphs=False, compile=True),
                                                      p1[0])
        row["stage_kernels"] = stage_kernels(ec, p1[0])
        del ec
    except Exception as ex:  # recorded, not fatal: the uncompiled rows stand
        row["engine_compiled"] = {"error": f"{type(ex).__name__}: {ex}"[:400]}


def speculative_section(rec: dict, out: Path, target, drafter, p1, max_new: int, max_len: int, cases,
                        compile: bool) -> None:
    """Batch 1, float32: each (mode, budget) of `cases` through the engine (compiled per `compile`), its
    row (run, serial run, lossless against the oracle loop, stage profile, warm-up seconds, wall over GPU
    span) appended to rec["speculative"] and the record saved after each."""
    from ..oracle import oracle_ar
    ref = [oracle_ar(target, p, max_new).tokens for p in p1]
    for mode, B in cases:
        t0 = time.perf_counter()
        e = Engine(target, None if mode == "ar" else drafter, mode=mode, budget=B, max_batch=1,
                   max_len=max_len, graph_sampling=False, compile=compile)
        warm = time.perf_counter() - t0
        run_engine(e, p1[:1], 8)
        r = run_engine(e, p1, max_new)
        r["serial"] = serial(e, p1, max_new, r["outputs"])
        r["lossless"] = r.pop("outputs") == ref
        r["stage_kernels"] = stage_kernels(e, p1[0])
        r.update(mode=mode, budget=B, batch=1, warmup_s=warm,
                 round_wall_over_gpu_span=r["round_wall_median_s"] / r["round_gpu_span_median_s"])
        rec["speculative"].append(r)
        save(out, rec)
        del e
        torch.cuda.empty_cache()


def deterministic_cost(target, drafter, p1, max_new: int, max_len: int, budget: int, max_batch: int) -> dict:
    """What deterministic=True (every round padded to max_batch) costs a lone request: DDTree at `budget`
    serving p1[0] with the flag off and on, {"mode", "budget", "max_batch", "requests", "default",
    "deterministic", "round_ratio": on's median round over off's}."""
    det = {}
    for flag in (False, True):
        e = Engine(target, drafter, mode="ddtree", budget=budget, max_batch=max_batch, max_len=max_len,
                   graph_sampling=False, deterministic=flag)
        run_engine(e, p1[:1], 8)
        det[flag] = run_engine(e, p1[:1], max_new)
        det[flag].pop("outputs")
        del e
    ratio = det[True]["round_wall_median_s"] / det[False]["round_wall_median_s"]
    return {"mode": "ddtree", "budget": budget, "max_batch": max_batch, "requests": 1,
            "default": det[False], "deterministic": det[True], "round_ratio": ratio}


def batched_section(rec: dict, out: Path, targets: list, target, drafter, prompts, max_new: int,
                    max_len: int, cases, batches, compile: bool) -> None:
    """Each batch b of `batches` and (mode, budget) of `cases`: an engine of max_batch b (one bucket,
    compiled per `compile`) serving prompts[:b], its row appended to rec["batched"] and the record saved,
    with `targets` as they stand, after each."""
    for b in batches:
        ps = prompts[:b]
        for mode, B in cases:
            e = Engine(target, None if mode == "ar" else drafter, mode=mode, budget=B, max_batch=b,
                       max_len=max_len, buckets=(b,), graph_sampling=False, compile=compile)
            run_engine(e, ps[:1], 4)
            r = run_engine(e, ps, max_new)
            r.pop("outputs")
            r.update(mode=mode, budget=B, batch=b)
            rec["batched"].append(r)
            save(out, {**rec, "targets": targets})
            del e
            torch.cuda.empty_cache()
