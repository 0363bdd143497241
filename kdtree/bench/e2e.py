"""End-to-end DDTree benchmark with the cost-aware budget: `python -m kdtree.bench.e2e --out DIR` writes
DIR/e2e_auto.json.

Trained pair (`data/trained`), held-out prompts (seed 2 windows: not the calibration's seed 1 ones; windows of
the installed Python's and torch's sources, so the section records them, and `--prompts-from RECORD` runs
another record's), one run:
per batch size b (default 1, 8, 32; b requests at once, max_batch b, one batch bucket), the engine's AR, the
DFlash chain, DDTree at every fixed budget and budget="auto" (decide "previous" and "sync"), each `repeats`
times after one warm-up run; per cell the median aggregate tok/s (whole requests, prefill included) and its
spread, the decode tok/s (prefill's wall time left out) and the prefill's wall time, per-user tok/s, tau,
whether the outputs equal the same run's AR outputs token for token, and for auto the plan each round chose.
`calibration_check`: expected tokens per truncation B (raw and calibrated) against the realized ones on the
same recorded rounds (8 prompts x 64 tokens at B_max). The cell "AR compiled": the AR engine through
torch.compile as well (the lab's best AR), so ratios against it sit beside the same-setting ones. A top-level
`targets` list {name, measured, goal, met}: auto's targets hold the engine's decision mode (`DECIDE`); the
other ("sync": a host sync more a round, reported as the issue of choosing the rows bucket asks) is given
against it and against the same baselines as info.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from .. import weights
from ..budget.config import AutoConfig
from ..engine import Engine
from ..model import ModelArgs
from ..data import heldout_prompts
from .serve import run_engine, write_record
from .stages import stage_kernels
from .goals import target as _goal

BUDGETS = (4, 8, 16, 32, 64, 128, 256)
# the engine's decision mode (Engine's default): the targets hold it; another mode is reported against it
DECIDE = AutoConfig.decide   # the engine's default


def _cell(make, prompts, max_new: int, repeats: int, add: dict | None = None, after=None,
          warm_new: int | None = None, reseed: bool = False) -> dict:
    """One engine: built (timed: compile + capture + cost table), one warm-up run (of warm_new tokens a
    request, default max_new), `repeats` timed runs. reseed: repeat r's requests take seeds 1000 (r + 1) + i
    (the same in every cell: simulated acceptance draws from them, so repeats are independent draws and
    cells share theirs). add: more add_request keywords; after(engine) -> dict: more fields, measured on the
    idle engine last."""
    add = add or {}
    t0 = time.perf_counter()
    e = make()
    build_s = time.perf_counter() - t0
    run_engine(e, prompts, max_new if warm_new is None else warm_new, **add)
    runs = []
    for k in range(repeats):
        h0 = len(e.auto.history) if e.auto is not None else 0
        r = run_engine(e, prompts, max_new, seed0=1000 * (k + 1) if reseed else 0, **add)
        if e.auto is not None:
            r["plans"] = [h[2] for h in e.auto.history[h0:]]
        runs.append(r)
    tps = [r["tok_per_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["tok_per_s"])[len(runs) // 2]
    dec = [r["decode_tok_per_s"] for r in runs if r.get("decode_tok_per_s")]
    out = {"tok_per_s": statistics.median(tps), "tok_per_s_min": min(tps), "tok_per_s_max": max(tps),
           "decode_tok_per_s": statistics.median(dec) if dec else None,
           "prefill_s": statistics.median(r["prefill_s"] for r in runs),
           "synthetic_s": statistics.median(r.get("synthetic_s", 0.0) for r in runs),
           "per_user_tok_per_s": statistics.median(tps) / len(prompts), "tau": mid["tau"],
           "tau_repeats": [r["tau"] for r in runs],
           "rounds": mid["rounds"], "round_wall_median_s": mid["round_wall_median_s"],
           "round_gpu_span_median_s": mid["round_gpu_span_median_s"],
           "full_round_gpu_span_median_s": mid.get("full_round_gpu_span_median_s"), "build_s": build_s,
           "warmup_s": e.warmup_s, "graphs": len(e.graphs), "capture_retries": e.capture_retries,
           "outputs": mid["outputs"]}
    if "round_wall_by_plan" in mid:
        out["round_wall_by_plan"] = mid["round_wall_by_plan"]
    # which requests end a batch, and their texts (a digest each: another device's run compares to it)
    out["request_rounds"], out["admitted"] = mid.get("request_rounds"), mid.get("admitted")
    out["output_digests"] = [hashlib.sha1(str(o).encode()).hexdigest()[:10] for o in mid["outputs"]]
    if e.auto is not None:
        out["plans"] = mid["plans"]
        out["plan_counts"] = dict(Counter(mid["plans"]))
        out["costs"] = e.costs.as_dict(e.plans)
        # the policy's measured inputs at the end (plans in e.plans' order)
        ests = e.policy.ests
        out["spread"] = [round(float(x), 4) for x in ests.spread.ratios()]
        out["realized"] = [round(float(x), 4) for x in ests.spread.realized()]
        out["persistence"] = [round(float(x), 4) for x in ests.persist.slopes()]
        out["prior"] = None if ests.prior is None else [round(float(x), 3) for x in ests.prior]
    if after is not None:
        out.update(after(e))
    return out


def check_prompts(prompts, n: int, length: int, vocab: int) -> list[list[int]]:
    """prompts (token id lists, e.g. another run's record's "prompts"), checked: at least n of them, each of
    `length` ids in [0, vocab) -> the first n as lists of ints."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) < n:
        got = len(prompts) if isinstance(prompts, (list, tuple)) else type(prompts).__name__
        raise ValueError(f"prompts: expected a list of at least {n} token id lists, got {got}")
    out = []
    for i, p in enumerate(prompts[:n]):
        ok = isinstance(p, (list, tuple)) and len(p) == length
        if not ok or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in p):
            raise ValueError(f"prompts[{i}]: expected {length} int token ids in [0, {vocab})")
        out.append([int(t) for t in p])
    return out


def section_prompts(rec):
    """The "prompts" of a loaded e2e record's "auto" (notebook 02's e2e.json) or "trained" (this module's
    e2e_auto.json) section, else None."""
    for key in ("auto", "trained"):
        sec = rec.get(key) if isinstance(rec, dict) else None
        if isinstance(sec, dict) and "prompts" in sec:
            return sec["prompts"]
    return None


def pair_engine(batch: int, prompt_len: int, max_new: int, budgets) -> dict:
    """The Engine keywords every trained-pair engine of a batch shares: one bucket, sampling outside the
    graphs, room for the prompt, the new tokens and the largest tree."""
    return dict(max_batch=batch, max_len=prompt_len + max_new + max(budgets) + 72, buckets=(batch,),
                graph_sampling=False)


def record_prompts(path) -> list[list[int]]:
    """The prompts an e2e record ran (`section_prompts`)."""
    p = Path(path)
    try:
        rec = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"prompts_from={str(p)!r}: expected a readable e2e record (JSON): {e}") from None
    got = section_prompts(rec)
    if got is not None:
        return got
    raise ValueError(f"prompts_from={str(p)!r}: expected an \"auto\" or \"trained\" section with "
                     "\"prompts\" (records from before they were kept have none)")


def trained_pair(ckpt_dir="data/trained", batches=(1, 8, 32), budgets=BUDGETS, n_prompts: int = 8,
                 prompt_len: int = 64, max_new: int = 128, repeats: int = 3, compile: bool = False,
                 decides=("previous", "sync"), progress: bool = True, target=None, drafter=None,
                 check=(8, 64), prompts=None) -> dict:
    """The trained pair's section (module docstring): {"cells": [...], "targets": [...], settings}. target /
    drafter: the pair already loaded (any device; else from ckpt_dir onto the GPU); check: (prompts, tokens)
    of the calibration check. prompts: the token ids to run (`check_prompts`: max(n_prompts, max(batches))
    of prompt_len; batch b runs the first max(n_prompts, b)), e.g. another run's record's "prompts"; None:
    the held-out windows, which come from the installed Python's and torch's sources (`data.corpus_files`),
    so another Python or torch gives other texts. The section records the prompts it ran and their source."""
    ckpt = Path(ckpt_dir)
    n_all = max(n_prompts, max(batches))
    if prompts is not None:   # checked before anything loads or runs
        vocab = (target.args.vocab_size if target is not None
                 else ModelArgs.from_hf_config(weights._config(ckpt / "target")[0]).vocab_size)
        prompts = check_prompts(prompts, n_all, prompt_len, vocab)
    if target is None:
        target = weights.load(ckpt / "target", device="cuda").eval()
        drafter = weights.load_drafter(ckpt / "drafter", target)
    rec = {"checkpoint": str(ckpt), "prompt_len": prompt_len, "max_new_tokens": max_new, "repeats": repeats,
           "compile": compile, "budgets": list(budgets), "dtype": str(target.dtype).replace("torch.", ""),
           "calibration": drafter.calibration is not None, "cells": [], "targets": []}
    source = "given" if prompts is not None else {
        "windows": "held-out", "seed": 2, "python": platform.python_version(), "torch": torch.__version__}
    prompts = prompts if prompts is not None else heldout_prompts(n_all, prompt_len, seed=2)
    rec.update(prompts=prompts, prompt_source=source)
    if drafter.calibration is not None:  # the table against the realized tokens of every truncation
        from ..calibration import truncations
        from .calibrate import measure
        rounds: list = []
        measure(target, drafter, heldout_prompts(check[0], prompt_len, seed=2), check[1], budget=max(budgets),
                rounds=rounds)
        cuts = [B for B in (1, 2, 4, 8, 16, 32, 64, 128, 256) if B <= max(budgets)]
        tables = {"raw": None, "calibrated": drafter.calibration}
        rec["calibration_check"] = dict(truncations(rounds, cuts, tables), rounds=len(rounds))
    for b in batches:
        run = prompts[:max(n_prompts, b)]
        common = pair_engine(b, prompt_len, max_new, budgets)
        gpu = target.device.type == "cuda"
        specs = [("ar", None, None, compile), ("ar", None, None, True) if gpu and not compile else None,
                 ("dflash", None, None, compile)]
        specs += [("ddtree", B, None, compile) for B in budgets]
        specs += [("ddtree", "auto", d, compile) for d in decides]
        cells = []
        for spec in [s for s in specs if s is not None]:
            mode, budget, decide, comp = spec
            kw = dict(common, mode=mode, compile=comp)
            if budget is not None:
                kw["budget"] = budget
            if budget == "auto":
                kw.update(budgets=tuple(budgets), decide=decide)
            t0 = time.perf_counter()
            prof = _profile(run[0]) if mode == "ddtree" and gpu else None
            try:
                cell = _cell(lambda: Engine(target, None if mode == "ar" else drafter, **kw), run,
                             max_new, repeats, after=prof)
            except Exception as e:  # recorded, and the run goes on (e.g. a capture the GPU refused)
                cell = {"error": f"{type(e).__name__}: {e}"[:400], "tok_per_s": None, "tau": None,
                        "outputs": None}
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            cell.update(batch=b, mode=mode, budget=budget, decide=decide, compiled=comp,
                        name=_name(mode, budget, decide, comp))
            cells.append(cell)
            if progress:
                what = cell.get("error") or f"{cell['tok_per_s']:8.0f} tok/s  tau {cell['tau'] or 0:.2f}"
                print(f"b={b:2d} {cell['name']:16s} {what}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        ref = next(c for c in cells if c["mode"] == "ar" and c["compiled"] == compile)["outputs"]
        for c in cells:
            out = c.pop("outputs")
            c["equals_ar"] = out is not None and ref is not None and out == ref
        rec["cells"] += cells
        rec["targets"] += _targets(cells, b, compile)
    return rec


def _profile(prompt):
    """_cell's `after` for a DDTree cell: the stage kernels of its round (an auto engine: of the tree plan it
    chose most often), so that auto's phases can be set beside the fixed round of the same tree."""
    def after(e) -> dict:
        plan = None
        if e.auto is not None:
            trees = [h[2] for h in e.auto.history if h[2].startswith("B=")]
            plan = Counter(trees).most_common(1)[0][0] if trees else None
        try:
            return {"stage_kernels": stage_kernels(e, prompt, plan=plan)}
        except Exception as ex:  # recorded, not fatal: the cell's timings stand
            return {"stage_kernels": {"error": f"{type(ex).__name__}: {ex}"[:400]}}
    return after


def _name(mode, budget, decide, compiled) -> str:
    base = {"ar": "AR", "dflash": "DFlash"}.get(mode) or (
        f"auto ({decide})" if budget == "auto" else f"B={budget}")
    return base + (" compiled" if compiled and mode == "ar" else "")


def _targets(cells, b: int, compile: bool) -> list:
    bad = [c["name"] for c in cells if c.get("error")]
    if bad:
        return [_goal("e2e_cells_ran", 0.0, batch=b, failed=", ".join(bad))]
    same = [c for c in cells if c["compiled"] == compile]
    ar = next(c for c in same if c["mode"] == "ar")["tok_per_s"]
    dfl = next(c for c in same if c["mode"] == "dflash")["tok_per_s"]
    fixed = [c for c in same if c["mode"] == "ddtree" and c["budget"] != "auto"]
    best = max(fixed, key=lambda c: c["tok_per_s"])
    autos = [c for c in same if c["budget"] == "auto"]
    own = next((c for c in autos if c["decide"] == DECIDE), None)
    out = []
    for c in autos:
        r_fixed, r_base = c["tok_per_s"] / best["tok_per_s"], c["tok_per_s"] / max(ar, dfl)
        kw = dict(batch=b, cell=c["name"])
        if own is None or c is own:
            out += [_goal("e2e_auto_over_best_fixed", r_fixed, budget=best["budget"], **kw),
                    _goal("e2e_auto_over_ar_dflash", r_base, **kw)]
        else:   # another decision mode than the engine's: info
            out += [_goal("e2e_decide_over_default", c["tok_per_s"] / own["tok_per_s"], **kw),
                    _goal("e2e_decide_over_best_fixed", r_fixed, budget=best["budget"], **kw),
                    _goal("e2e_decide_over_ar_dflash", r_base, **kw)]
        dec = [x for x in fixed if x.get("decode_tok_per_s")]
        if c.get("decode_tok_per_s") and dec:  # prefill left out: the rounds' choice alone (info)
            bd = max(dec, key=lambda x: x["decode_tok_per_s"])
            out.append(
                _goal(
                    "e2e_auto_decode_over_best_fixed",
                    c["decode_tok_per_s"] / bd["decode_tok_per_s"],
                    batch=b,
                    cell=c["name"],
                    budget=bd["budget"],
                )
            )
        comp = next((x for x in cells if x["mode"] == "ar" and x["compiled"]), None)
        if comp is not None and not compile:
            out.append(
                _goal(
                    "e2e_auto_over_ar_compiled", c["tok_per_s"] / comp["tok_per_s"], batch=b, cell=c["name"]
                )
            )
    out.append(_goal("e2e_lossless", float(all(c["equals_ar"] for c in cells)), batch=b))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.e2e",
                                 description="end-to-end DDTree, the cost-aware budget (DIR/e2e_auto.json)")
    ap.add_argument("--out", default="outputs")
    ap.add_argument("--ckpt", default="data/trained")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--compile", action="store_true", help="every engine through torch.compile")
    ap.add_argument("--prompts-from", default=None, metavar="RECORD",
                    help="run the prompts of this e2e record (its auto / trained section's \"prompts\"): "
                         "another machine's texts; default: the held-out windows of this machine's corpus")
    a = ap.parse_args(argv)
    prompts = None if a.prompts_from is None else record_prompts(a.prompts_from)
    if not torch.cuda.is_available():
        raise SystemExit("bench_e2e: needs a CUDA GPU (the engine's graphs and kernels)")
    from ..lab import record_dir_or_exit
    out = record_dir_or_exit(a.out, "cuda", "bench_e2e")
    out.mkdir(parents=True, exist_ok=True)
    rec = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    rec["trained"] = trained_pair(
        a.ckpt, tuple(a.batches), tuple(a.budgets), max_new=a.max_new, repeats=a.repeats, compile=a.compile,
        prompts=prompts)
    rec["targets"] = rec["trained"].pop("targets")
    write_record(out / "e2e_auto.json", rec)


if __name__ == "__main__":
    main()
