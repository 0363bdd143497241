"""Where a run's wall time goes, step by step: budget="auto" against the AR engine at K2.6 shape.

`trace(engine, prompts, max_new, **add)`: the prompts through the engine as `run_engine` serves them
(overlapped steps), each step's wall time (less its prefill and synthetic fill), the plan of the round it
landed and whether the drafter's deferred context caught up in the round it launched. `summary(run)`: the
run's wall, prefill and decode seconds, the median step, the seconds of the steps that landed each plan,
of the catch-up steps and of the last step (which waits for the last round with nothing to overlap it),
and the admissions (the steps that prefilled a request, and their prefill seconds).

`compare(...)` (`python -m kdtree.bench.steps --out DIR`): at one (context, batch) cell and simulated
profile, the AR engine, budget="auto" and the AR engine again (the same engine twice brackets any drift of
the GPU), each a warm-up run then `repeats` runs with the same request seeds across engines; writes
DIR/steps_k26.json with every run's summary and `overhead`: auto's decode seconds beyond the mean of the
two AR engines' in the same repeat, split into its probe rounds (drafted rounds beyond the AR median step),
catch-up steps, last step and the rest (per round), and its prefill seconds beyond theirs. queue: queue x
batch requests through the engine's waiting queue (1: a static batch), as `bench.k26`'s queue serves them,
where requests that end apart are admitted apart. SIMULATED acceptance (`kdtree.simulate`), random weights,
the long context synthetic, as `bench.k26`.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

import torch

from .. import checks, k26
from ..engine import Engine
from ..simulate import Profile
from .serve import _sync, run_engine
from .k26 import PROMPT, _with_block, cell_engine, cell_prompts, max_new as k26_max_new


def trace(engine: Engine, prompts, max_new: int, seed0: int = 0, **add) -> dict:
    """One run (`run_engine`: every prompt at once, request i seeded seed0 + i): {"wall_s", "prefill_s",
    "steps": its `steps` list}."""
    steps: list = []
    r = run_engine(engine, prompts, max_new, seed0=seed0, steps=steps, **add)
    return {"wall_s": r["wall_s"], "prefill_s": r["prefill_s"], "steps": steps}


def summary(run: dict) -> dict:
    """A traced run in numbers (module docstring): decode_s is the steps' wall less prefill; by_plan
    {plan: [steps, seconds]}; catchup_s the steps with a catch-up; last_s the last step."""
    st = run["steps"]
    adm = [x["prefill_s"] for x in st if x["prefill_s"] > 0]
    by_plan: dict = {}
    for x in st:
        if x["plan"] is not None:
            n, s = by_plan.get(x["plan"], (0, 0.0))
            by_plan[x["plan"]] = [n + 1, s + x["s"]]
    return {"wall_s": run["wall_s"], "prefill_s": run["prefill_s"], "decode_s": sum(x["s"] for x in st),
            "steps": len(st), "step_median_s": statistics.median(x["s"] for x in st) if st else None,
            "by_plan": by_plan, "catchups": sum(x["catchup"] for x in st),
            "catchup_s": sum(x["s"] for x in st if x["catchup"]), "last_s": st[-1]["s"] if st else 0.0,
            "admissions": len(adm), "admission_s": sum(adm)}


def overhead(auto: dict, ar: float, ar_median: float, ar_prefill: float | None = None) -> dict:
    """auto's summary against the AR engines' decode seconds `ar` and median step `ar_median` of the same
    repeat: {"total_s", "probes_s", "catchup_s", "last_s", "rest_s"} (rest: the per-round remainder; the
    five are decode seconds), and with the AR engines' prefill seconds `ar_prefill` "prefill_s", auto's
    prefill beyond it."""
    drafted = [v for k, v in auto["by_plan"].items() if k != "AR"]
    probes = sum(s - n * ar_median for n, s in drafted)
    catch = auto["catchup_s"] - auto["catchups"] * ar_median
    last = auto["last_s"] - ar_median
    total = auto["decode_s"] - ar
    out = {"total_s": total, "probes_s": probes, "catchup_s": catch, "last_s": last,
           "rest_s": total - probes - catch - last}
    if ar_prefill is not None:
        out["prefill_s"] = auto["prefill_s"] - ar_prefill
    return out


def prefill_profile(engine: Engine, prompts, repeats: int = 3, top: int = 20, **add) -> dict:
    """Where one admission's prefill goes: the prompts admitted together `repeats` times (each then served to
    its end, one new token a request), the engine's prefill seconds of each (synthetic fill left out); then
    `repeats` times with the engine's `prefill_phases` on (a device sync at each phase's end: "phases", each
    phase's median seconds); then once more under torch.profiler: the costliest CUDA kernels ("kernels",
    "device_s" their sum) and host ops of that admission (its synthetic fill included, under its own kernel
    names). The engine must be idle, with room for every prompt at once (ValueError otherwise)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from .profiling import profile
    checks.positive_int("repeats", repeats)
    if engine.waiting or engine.active or engine.in_flight:
        raise ValueError("prefill_profile: the engine is not idle (requests waiting, active or in flight)")
    if not 0 < len(prompts) <= engine.max_batch:
        raise ValueError(f"prompts: {len(prompts)} of them, expected 1 to max_batch={engine.max_batch}")
    secs, phases = [], []
    for k in range(2 * repeats + 1):
        for i, p in enumerate(prompts):
            engine.add_request(p, 2, seed=77 + i, **add)
        p0 = engine.prefill_s
        if k < repeats:
            engine.scheduler.admit({})
            secs.append(engine.prefill_s - p0)
        elif k < 2 * repeats:
            engine.prefill_phases = {}
            try:
                engine.scheduler.admit({})
                phases.append(engine.prefill_phases)
            finally:
                engine.prefill_phases = None
        else:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                engine.scheduler.admit({})
                _sync()
        if engine.waiting:   # all at once, or the timings are not one admission's
            raise ValueError(f"prefill_profile: {len(engine.waiting)} of {len(prompts)} prompts found no "
                             "room (the engine's pages)")
        engine.run()
    ev = prof.key_averages()
    dev = (lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)))
    kernels = [e for e in ev if e.device_type == DeviceType.CUDA]   # not the ops that launched them
    kern = sorted(kernels, key=dev, reverse=True)[:top]
    host = sorted((e for e in ev if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total,
                  reverse=True)[:top]
    names = sorted({n for ph in phases for n in ph})
    return {"prefill_s": secs, "profiled_prefill_s": engine.prefill_s - p0,
            "phases": {n: statistics.median(ph.get(n, 0.0) for ph in phases) for n in names},
            "kernels": [[e.key[:90], e.count, dev(e) * 1e-6] for e in kern],
            "host_ops": [[e.key[:90], e.count, e.self_cpu_time_total * 1e-6] for e in host],
            "device_s": sum(dev(e) for e in kernels) * 1e-6}


def _pair(layers: int, device, args, dargs):
    """The K2.6-shape target of `layers` MoE layers and its drafter (args / dargs: smaller shapes, tests)."""
    t = k26.build_target(layers, device=device, args=args, kernel_only=torch.device(device).type == "cuda")
    return t, k26.build_drafter(t, args=None if dargs is None else k26.drafter_args(t.args, **dargs))


def check_cell(context, batch, layers, repeats, queue=1) -> None:
    """compare's arguments, each named in its ValueError."""
    checks.int_in("context", context, PROMPT + 1, note=f" (the prompt's {PROMPT} rows come first)")
    checks.positive_int("batch", batch)
    checks.int_in("layers", layers, 1, k26.FULL_LAYERS - 1)
    checks.positive_int("repeats", repeats)
    checks.positive_int("queue", queue)


def compare(context: int = 4096, batch: int = 32, layers: int = 10, profiles=((3.0, 8),), repeats: int = 3,
            budgets=(4, 8, 16, 32, 64, 128), device="cuda", args=None, dargs=None, new: int | None = None,
            progress: bool = True, on_profile=None, queue: int = 1) -> dict:
    """The cell's AR / auto / AR engines per profile ((chain tau, block) or a `Profile`), traced (module
    docstring). args / dargs: smaller dimensions (a CPU test); on_profile(record so far): after each
    profile."""
    check_cell(context, batch, layers, repeats, queue)
    t, d = _pair(layers, device, args, dargs)
    prompts = cell_prompts(queue * batch, batch)
    new = new or k26_max_new(batch)
    rows = max(budgets) + 1
    rec = {"label": "K2.6 shape, random weights, SIMULATED acceptance: auto's overhead against AR, per step",
           "context": context, "batch": batch, "layers": layers, "max_new": new, "repeats": repeats,
           "queue": queue, "requests": len(prompts), "profiles": []}
    add = dict(synthetic_context=context - PROMPT)
    for spec in profiles:
        prof = spec if isinstance(spec, Profile) else Profile(spec[0], depth=spec[1] - 1, K=2 * max(budgets))
        engines = {}
        for name in ("ar", "auto", "ar_again"):
            kw = dict(cell_engine(context, batch, new, rows), simulate=prof)
            if name == "auto":
                kw.update(mode="ddtree", budget="auto", budgets=tuple(budgets))
            e = Engine(t, _with_block(d, prof.depth + 1) if name == "auto" else None, **kw)
            trace(e, prompts[:batch], max(new // 4, 2), **add)   # warm-up
            engines[name] = [summary(trace(e, prompts, new, seed0=1000 * (k + 1), **add))
                             for k in range(repeats)]
            del e
            gc.collect()   # the engine's graphs and pools go before the next one's
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        over = []
        for k in range(repeats):
            a, b = engines["ar"][k], engines["ar_again"][k]
            over.append(overhead(engines["auto"][k], (a["decode_s"] + b["decode_s"]) / 2,
                                 (a["step_median_s"] + b["step_median_s"]) / 2,
                                 (a["prefill_s"] + b["prefill_s"]) / 2))
        ar_wall = [(a["wall_s"] + b["wall_s"]) / 2 for a, b in zip(engines["ar"], engines["ar_again"])]
        row = {"profile": prof.name, "engines": engines, "overhead": over,
               "auto_over_ar_wall": [x["wall_s"] / w for x, w in zip(engines["auto"], ar_wall)]}
        rec["profiles"].append(row)
        if on_profile is not None:   # a sweep cut off keeps the profiles it measured
            on_profile(rec)
        if progress:
            for k, o in enumerate(over):
                print(f"{prof.name}  repeat {k}: auto / AR wall {row['auto_over_ar_wall'][k]:.3f}; decode "
                      + "  ".join(f"{key[:-2]} {v * 1e3:+.1f} ms" for key, v in o.items()), flush=True)
    return rec


def compare_prefill(context: int = 4096, batch: int = 32, layers: int = 10, profile=(3.0, 8),
                    repeats: int = 3, device="cuda", args=None, dargs=None) -> dict:
    """`prefill_profile` of one admission of the cell's batch for the AR engine and DDTree at B = 4 (the
    drafter's context prefill beside the target's), SIMULATED acceptance as `compare` (profile: (chain tau,
    block) or a `Profile`)."""
    check_cell(context, batch, layers, repeats)
    t, d = _pair(layers, device, args, dargs)
    prof = profile if isinstance(profile, Profile) else Profile(profile[0], depth=profile[1] - 1, K=256)
    new = k26_max_new(batch)
    rec = {"label": "K2.6 shape, random weights: one admission's prefill, AR against DDTree (B = 4)",
           "context": context, "batch": batch, "layers": layers, "engines": {}}
    add = dict(synthetic_context=context - PROMPT)
    for name in ("ar", "ddtree"):
        kw = dict(cell_engine(context, batch, new, 5), simulate=prof, mode=name)
        if name == "ddtree":
            kw["budget"] = 4
        e = Engine(t, _with_block(d, prof.depth + 1) if name == "ddtree" else None, **kw)
        trace(e, cell_prompts(batch, batch), 4, **add)   # warm-up: the prefill shape's graph
        rec["engines"][name] = prefill_profile(e, cell_prompts(batch, batch), repeats, **add)
        del e
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rec


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.steps", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder of steps_k26.json (made if missing)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=10, help="MoE layers (bench.k26's count at the cell)")
    ap.add_argument("--profiles", nargs="+", default=["3:8"],
                    help="chain tau:block[:ratio] (`Profile`), e.g. 3:8 2.72:16:0.9")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--queue", type=int, default=1,
                    help="QUEUE x batch requests through the waiting queue (1: a static batch)")
    ap.add_argument("--prefill", action="store_true",
                    help="profile one admission's prefill instead (AR and B = 4: DIR/prefill_k26.json)")
    a = ap.parse_args(argv)
    if a.out.exists() and not a.out.is_dir():
        raise SystemExit(f"--out {a.out}: not a folder")
    try:
        check_cell(a.context, a.batch, a.layers, a.repeats, a.queue)
    except ValueError as e:
        raise SystemExit(f"kdtree.bench.steps: {e}") from None
    try:
        parts = [p.split(":") for p in a.profiles]
        profs = [Profile(float(x[0]), depth=int(x[1]) - 1, ratio=float(x[2]) if len(x) > 2 else 0.5, K=256)
                 for x in parts if len(x) in (2, 3)]
        if len(profs) != len(parts):
            raise ValueError("tau:block[:ratio]")
    except ValueError as e:
        raise SystemExit(f"--profiles {a.profiles}: expected chain tau:block[:ratio] items, e.g. 3:8 ({e})") \
            from None
    if a.prefill and (len(profs) != 1 or a.queue != 1):
        raise SystemExit(f"--prefill: expected one profile and no --queue (it profiles one admission of the "
                         f"batch), got {len(profs)} profiles and --queue {a.queue}")
    if not torch.cuda.is_available():
        raise SystemExit("kdtree.bench.steps: needs a CUDA device (K2.6 shape)")
    a.out.mkdir(parents=True, exist_ok=True)   # made once every argument is checked
    if a.prefill:
        rec = compare_prefill(a.context, a.batch, a.layers, profs[0], a.repeats)
        (a.out / "prefill_k26.json").write_text(json.dumps(rec, indent=1) + "\n")
        for name, r in rec["engines"].items():
            print(name, "prefill s", [round(x, 4) for x in r["prefill_s"]], "device s",
                  round(r["device_s"], 4), "phases ms",
                  {k: round(v * 1e3, 2) for k, v in r["phases"].items()})
            for row in r["kernels"][:12] + [["--- host", 0, 0]] + r["host_ops"][:12]:
                print(f"  {row[0][:70]:70s} {row[1]:6d} {row[2] * 1e3:9.3f} ms")
        return
    out = a.out / "steps_k26.json"
    compare(a.context, a.batch, a.layers, profs, a.repeats, queue=a.queue,
            on_profile=lambda rec: out.write_text(json.dumps(rec, indent=1) + "\n"))
    print(f"wrote {a.out / 'steps_k26.json'}")


if __name__ == "__main__":
    main()
