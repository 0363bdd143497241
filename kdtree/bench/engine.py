"""End-to-end engine benchmark: `python -m kdtree.bench.engine --out DIR` writes DIR/engine.json.

Same run, same checkpoint (the lab's trained pair), same held-out prompts:
  * AR at batch 1 through the engine (CUDA graphs) in float32 and bf16, against transformers' `generate` on
    the same checkpoint in the same dtype (greedy, the same number of new tokens), and the engine with
    graphs off;
  * per round: wall time (replay + the round's host work), the GPU span (CUDA events before the replay and
    after it), kernels launched (torch.profiler over one eager round of the same ops), an eager round's
    stage breakdown;
  * AR, the DFlash chain and DDTree per budget at batch 1 (tau, tok/s, lossless against the oracle loop), and
    at batch 8 and 32 (per-user and aggregate tok/s);
  * warm-up (compile + capture) time per engine, and a top-level `targets` list {name, measured, goal, met}.
Numbers are wall-clock over whole requests (prefill included) unless a field says otherwise.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from .. import weights
from ..data import heldout_prompts
from ..engine import STAGES, Engine
from .baselines import hf_generate
from .ceilings import copy_bandwidth, launch_floor
from . import engine_sections as sections
from . import goals
from .goals import target as _goal
from .serve import run_engine
from .stages import stage_kernels
from .timer import measure


def verify_rows(ckpt_dir="data/trained", rows=(1, 8, 15, 16, 17, 24, 32, 64, 129),
                repeats: int = 30) -> list[dict]:
    """The target's verify forward alone (float32, batch 1, 100 cached rows, CUDA-graph replays, median of
    `repeats` after warm-up) against the block's rows: where the per-round cost jumps with the matmul
    shapes."""
    from ..model import PagedMeta
    t = weights.load(Path(ckpt_dir) / "target", device="cuda").eval()
    a = t.args
    pool = torch.zeros(a.num_hidden_layers, 9 * 64, a.kv_lora_rank + a.qk_rope_head_dim, device="cuda")
    pt = torch.arange(1, 9, dtype=torch.int32, device="cuda")[None]
    out = []
    for T in rows:
        tok = torch.randint(0, a.vocab_size, (1, T), device="cuda")
        cl = torch.tensor([100], device="cuda")
        pos = cl[:, None] + torch.arange(T, device="cuda")
        mask = torch.ones(1, T, T, dtype=torch.bool, device="cuda").tril()

        def f():
            meta = PagedMeta.build(pt, cl, pos, mask, 64, t.attn_impl, "dense")
            return t.forward_paged(tok, pool, meta, (0,))
        t_ = measure(f, repeats, "graph", warmup=5, queued=False)
        out.append({"rows": T, "median_s": t_.median, "min_s": t_.min})
    return out


def decode_weight_bytes(args, itemsize: int = 2, experts_touched: int | None = None) -> int:
    """Weight bytes one decode step must read at batch 1: every layer's attention and norms, the dense MLPs,
    the shared experts, `experts_touched` routed experts per MoE layer (default num_experts_per_tok) with the
    router, one embedding row, the final norm and the lm_head; `itemsize` bytes per weight. Divided by the
    copy bandwidth, the floor of an AR step's time (the cache's rows come on top)."""
    h, a = args.hidden_size, args
    k = a.num_experts_per_tok if experts_touched is None else experts_touched
    if not 0 <= k <= a.n_routed_experts:
        raise ValueError(f"experts_touched={experts_touched!r}: expected 0..{a.n_routed_experts}")
    attn = (h * a.num_attention_heads * a.qk_head_dim if a.q_lora_rank is None else
            h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.num_attention_heads * a.qk_head_dim)
    attn += h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    attn += a.kv_lora_rank * a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
    attn += a.num_attention_heads * a.v_head_dim * h
    moe = 3 * h * a.moe_intermediate_size * (k + a.n_shared_experts) + a.n_routed_experts * (h + 1)
    n = (a.num_hidden_layers * (attn + 2 * h) + a.first_k_dense_replace * 3 * h * a.intermediate_size
         + a.n_moe_layers * moe + h + a.vocab_size * h + h)
    return n * itemsize


def mid_model(config="data/configs/mid.json", n_prompts: int = 4, prompt_len: int = 64, max_new: int = 64,
              hf: bool = True, compile: bool = True, paths=("grouped", "dense"), log=print,
              decode_path: str = "default") -> dict:
    """AR at batch 1 on the mid-size config (random bf16 weights, seed 0; the kernel attention path) through
    the engine per MoE path (the first also compiled), against its weight-bytes floor (decode_weight_bytes
    over the copy bandwidth measured here) and transformers' generate on the very same weights (a checkpoint
    written to a temporary folder). decode_path: the layers as the model does by default (Transformer.fused),
    through kdtree.fused's kernels ("fused", where they apply) or the torch path ("torch")."""
    import tempfile

    if decode_path not in ("default", "fused", "torch"):
        raise ValueError(f"decode_path={decode_path!r}: expected 'default', 'fused' or 'torch'")

    from ..config import load_config
    from ..model import build_model
    from ..validate import random_prompts
    args = load_config(config)
    t0 = time.perf_counter()
    model = build_model(args, seed=0, dtype=torch.bfloat16, device="cuda")
    model.attn_impl = "kernel"
    if decode_path != "default":
        model.fused = decode_path == "fused"
    rec = {"config": str(config), "params": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16",
           "attn_impl": "kernel", "decode_path": "fused" if model.fused else "torch", "prompts": n_prompts,
           "prompt_len": prompt_len, "max_new_tokens": max_new,
           "build_s": time.perf_counter() - t0, "compile": compile}
    bw = copy_bandwidth()
    wb = decode_weight_bytes(args, 2)
    rec.update(copy_bandwidth=bw, weight_bytes=wb, floor_s=wb / bw["bytes_per_s"])
    prompts = random_prompts(args, n_prompts, seed=7, min_len=prompt_len, max_len=prompt_len)
    max_len = 1 << int(np.ceil(np.log2(prompt_len + max_new + 2)))
    outs = {}
    for path in paths:
        for comp in ((False, True) if compile and path == paths[0] else (False,)):
            t0 = time.perf_counter()
            e = Engine(model, mode="ar", max_batch=1, max_len=max_len, graph_sampling=False, moe=path,
                       compile=comp)
            warm = time.perf_counter() - t0
            run_engine(e, prompts[:1], 8)
            r = run_engine(e, prompts, max_new)
            outs[(path, comp)] = r.pop("outputs")
            r.update(moe=path, compiled=comp, warmup_s=warm, ms_per_token=1e3 * r["round_wall_median_s"],
                     floor_fraction=rec["floor_s"] / r["round_wall_median_s"],
                     round_wall_over_gpu_span=r["round_wall_median_s"] / r["round_gpu_span_median_s"])
            if path == paths[0] and comp == compile:
                r["stage_kernels"] = stage_kernels(e, prompts[0])
            rec.setdefault("engine", []).append(r)
            log(f"mid AR moe={path} compiled={comp}: {r['ms_per_token']:.3f} ms/token, "
                f"{100 * r['floor_fraction']:.0f} % of the floor {1e3 * rec['floor_s']:.3f} ms")
            del e
            torch.cuda.empty_cache()
    first = next(iter(outs.values()))
    rec["paths_agree"] = {f"{p}{' compiled' if c else ''}": o == first for (p, c), o in outs.items()}
    if hf:
        with tempfile.TemporaryDirectory() as d:
            weights.save(model, d, dtype=torch.bfloat16)
            del model
            torch.cuda.empty_cache()
            rec["hf"] = hf_generate(Path(d), torch.bfloat16, prompts, max_new)
        rec["hf_equals_engine"] = rec["hf"].pop("outputs") == first
    best = min(rec["engine"], key=lambda r: r["round_wall_median_s"])
    rec["best"] = {k: best[k] for k in ("moe", "compiled", "ms_per_token", "floor_fraction", "tok_per_s")}
    rec["launch_bound"] = launch_bound(rec, next(r for r in rec["engine"] if "stage_kernels" in r))
    return rec


def ddtree_bound(ar: dict, dflash: dict, best: dict) -> dict:
    """What bounds DDTree over AR at batch 1, from the same run's rows: tau (tokens a round) times AR's round
    over DDTree's, and the ratio DDTree would reach if its verify of budget + 1 rows cost what AR's one-row
    verify costs (the stage profiles' verify GPU seconds; every other part of the round as measured)."""
    st, sa = best["stage_kernels"], ar["stage_kernels"]
    extra = st["verify"]["gpu_s"] - sa["verify"]["gpu_s"]
    wall = best["round_wall_median_s"]
    return {"budget": best["budget"], "tau": best["tau"], "round_s": wall,
            "ar_round_s": ar["round_wall_median_s"],
            "ar_rounds_per_round": wall / ar["round_wall_median_s"],
            "stage_gpu_s": {k: st[k]["gpu_s"] for k in STAGES}, "ar_verify_gpu_s": sa["verify"]["gpu_s"],
            "x_ar_if_verify_cost_ar": best["tau"] * ar["round_wall_median_s"] / max(wall - extra, 1e-9),
            "round_s_for_goal": best["tau"] * ar["round_wall_median_s"] / 1.8,
            "dflash_tau": dflash["tau"]}


def launch_bound(rec: dict, row: dict) -> dict:
    """What the kernel count allows: the profiled round's kernels times the launch floor measured now
    (ceilings.launch_floor) is a time no replay of them beats; the weight-bytes floor over it is the largest
    floor fraction reachable without fewer kernels."""
    lf = launch_floor()
    k = row["stage_kernels"]["total"]["kernels"]
    t = k * lf["s_per_kernel"]
    return {"kernels": k, "s_per_kernel": lf["s_per_kernel"], "launch_floor_s": t,
            "max_floor_fraction": rec["floor_s"] / max(t, rec["floor_s"]),
            "gpu_kernel_s": row["stage_kernels"]["total"]["gpu_s"], "moe": row["moe"],
            "compiled": row["compiled"]}


def run(out_dir, ckpt_dir="data/trained", n_prompts: int = 8, prompt_len: int = 64, max_new: int = 128,
        budgets=(16, 32, 64, 128, 256), batches=(8, 32), hf: bool = True, quick: bool = False,
        compile: bool = True, batched_compile: bool | None = None, mid: bool = True,
        decode_path: str = "default") -> dict:
    """The engine's record (module docstring) into out_dir/engine.json, written after each section (AR,
    speculative, deterministic cost and batched: kdtree.bench.engine_sections). compile: the batch-1
    engines through torch.compile; batched_compile: the batched ones (default: as compile); mid: the
    mid-size model's section (mid_model) last. decode_path: the targets' layers as built
    (Transformer.fused), through kdtree.fused ("fused", where it applies: the bf16 rows) or the torch path."""
    if decode_path not in ("default", "fused", "torch"):
        raise ValueError(f"decode_path={decode_path!r}: expected 'default', 'fused' or 'torch'")
    if not torch.cuda.is_available():
        raise RuntimeError("bench_engine.run needs a CUDA GPU (CUDA graphs, the kernels, transformers on the "
                           "GPU)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(ckpt_dir)
    if quick:
        n_prompts, max_new, budgets, batches = 2, 32, (16, 64), (8,)
    batched_compile = compile if batched_compile is None else batched_compile
    prompts = heldout_prompts(max(n_prompts, max(batches)), prompt_len)
    p1 = prompts[:n_prompts]
    rec = {"device": torch.cuda.get_device_name(), "compile": compile, "torch": torch.__version__,
           "python": platform.python_version(),
           "checkpoint": str(ckpt), "prompts": n_prompts, "prompt_len": prompt_len, "max_new_tokens": max_new,
           "batched_compile": batched_compile, "ar": {}, "speculative": [], "batched": [],
           # the held-out windows come from this machine's Python and torch sources: another's differ
           "prompt_ids": prompts}
    try:
        import transformers
        rec["transformers"] = transformers.__version__
    except ImportError:
        hf = False
    max_len = 1 << int(np.ceil(np.log2(prompt_len + max_new + max(budgets) + 2)))
    targets = sections.ar_section(rec, out, ckpt, p1, max_new, max_len, hf, decode_path)
    # speculative, batch 1, float32 (lossless against the oracle loop), then batches
    target = weights.load(ckpt / "target", device="cuda", dtype=torch.float32).eval()
    drafter = weights.load_drafter(ckpt / "drafter", target, dtype=torch.float32)
    cases = [("ar", None), ("dflash", None)] + [("ddtree", B) for B in budgets]
    sections.speculative_section(rec, out, target, drafter, p1, max_new, max_len, cases, compile)
    targets += speculative_targets(rec)
    # deterministic=True pads every round to max_batch: its price for a lone request, same run
    rec["deterministic_cost"] = sections.deterministic_cost(target, drafter, p1, max_new, max_len, budgets[0],
                                                            max(batches))
    sections.save(out, rec)
    sections.batched_section(rec, out, targets, target, drafter, prompts, max_new, max_len, cases, batches,
                             batched_compile)
    if mid:
        rec["mid"] = m = mid_model(hf=hf, n_prompts=2 if quick else 4, max_new=32 if quick else 64,
                                   decode_path=decode_path)
        targets += mid_targets(m)
    elif (out / "engine_mid.json").exists():  # the mid-size section run apart (--mid-only), its own floor
        rec["mid"] = m = json.loads((out / "engine_mid.json").read_text())
        rec["mid"]["from"] = "engine_mid.json"
        targets += mid_targets(m)
    rec["targets"] = targets
    sections.save(out, rec)
    return rec


def speculative_targets(rec: dict) -> list[dict]:
    """From rec's batch-1 speculative rows: rec["ddtree_bound"] (`ddtree_bound` of the AR row, the DFlash
    row and the fastest DDTree budget) and the returned targets (DDTree over AR and over DFlash, its wall
    over GPU span, every row lossless)."""
    sp = rec["speculative"]
    ar1 = next(r for r in sp if r["mode"] == "ar")
    df1 = next(r for r in sp if r["mode"] == "dflash")
    best = max((r for r in sp if r["mode"] == "ddtree"), key=lambda r: r["tok_per_s"])
    rec["ddtree_bound"] = ddtree_bound(ar1, df1, best)
    return [
        _goal("ddtree_x_ar", best["tok_per_s"] / ar1["tok_per_s"], budget=best["budget"]),
        _goal("ddtree_x_dflash", best["tok_per_s"] / df1["tok_per_s"], budget=best["budget"]),
        _goal("ddtree_wall_over_span", best["round_wall_over_gpu_span"], budget=best["budget"]),
        _goal("engine_lossless", float(all(r["lossless"] for r in sp)))]


def mid_targets(m: dict) -> list[dict]:
    best = m["best"]
    out = [_goal("mid_floor_fraction", best["floor_fraction"], moe=best["moe"], compiled=best["compiled"])]
    if "hf" in m:
        out.append(_goal("mid_x_hf", best["tok_per_s"] / m["hf"]["tok_per_s"]))
    return out


def summary(rec: dict) -> str:
    lines = [f"{rec['device']} | torch {rec['torch']} | {rec['prompts']} prompts x {rec['max_new_tokens']} "
             "new tokens"]
    for name, r in rec["ar"].items():
        hf = r.get("hf", {}).get("tok_per_s")
        g = r["engine"]
        lines.append(f"AR {name}: engine {g['tok_per_s']:.0f} tok/s ({r['ms_per_token']:.3f} ms/token, round "
                     f"{1e3 * g['round_wall_median_s']:.3f} ms wall / "
                     f"{1e3 * g['round_gpu_span_median_s']:.3f} ms GPU), "
                     f"eager {r['engine_eager']['tok_per_s']:.0f}, HF {hf and round(hf)} tok/s, "
                     f"{r['launches']['kernels']} kernels/round, warm-up {r['warmup_s']:.1f} s")
        c = r.get("engine_compiled", {})
        if "tok_per_s" in c:
            lines.append(f"  compiled: {c['tok_per_s']:.0f} tok/s, "
                         f"round {1e3 * c['round_wall_median_s']:.3f} ms "
                         f"wall / {1e3 * c['round_gpu_span_median_s']:.3f} ms GPU, "
                         f"{r['launches_compiled']['kernels']} kernels, "
                         f"warm-up {c['warmup_s']:.1f} s, same tokens {r['compiled_equals_engine']}")
        elif c:
            lines.append(f"  compiled: {c['error']}")
    for r in rec["speculative"]:
        st = r.get("stage_kernels")
        if st:
            lines.append(f"stages {r['mode']} B={r['budget']}: " + ", ".join(
                f"{k} {v['kernels']:.0f} kernels {1e6 * v['gpu_s']:.0f} us" for k, v in st.items()
                if k != "top_kernels"))
    dc = rec.get("deterministic_cost")
    if dc:
        lines.append(f"deterministic=True, one request, max_batch {dc['max_batch']}: "
                     f"round x{dc['round_ratio']:.2f}")
    for r in rec["speculative"] + rec["batched"]:
        wall, span = r["round_wall_median_s"] or 0, r["round_gpu_span_median_s"] or 0
        lines.append(f"b={r['batch']:3d} {r['mode']:7s} B={r['budget']} tau {r['tau'] or 0:.2f} "
                     f"{r['tok_per_s']:.0f} tok/s round {1e3 * wall:.3f} ms / GPU {1e3 * span:.3f}"
                     + (f" lossless={r['lossless']}" if "lossless" in r else ""))
    db = rec.get("ddtree_bound")
    if db:
        lines.append(f"DDTree bound (B={db['budget']}): tau {db['tau']:.2f}, round "
                     f"{1e3 * db['round_s']:.3f} ms = {db['ar_rounds_per_round']:.2f} AR rounds; 1.8x needs "
                     f"<= {1e3 * db['round_s_for_goal']:.3f} ms; with a verify at AR's cost "
                     f"{db['x_ar_if_verify_cost_ar']:.2f}x")
    lb = (rec.get("mid") or {}).get("launch_bound")
    if lb:
        lines.append(f"mid launch bound: {lb['kernels']:.0f} kernels x {1e6 * lb['s_per_kernel']:.2f} us = "
                     f"{1e3 * lb['launch_floor_s']:.3f} ms -> at most {100 * lb['max_floor_fraction']:.0f} % "
                     "of the weight-bytes floor")
    for t in rec["targets"]:
        lines.append(goals.line(t))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs")
    ap.add_argument("--ckpt", default="data/trained")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--rows-probe", action="store_true", help="only the verify forward against block rows")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--batched-eager", action="store_true", help="batched engines without torch.compile")
    ap.add_argument("--no-mid", action="store_true", help="leave out the mid-size model's section")
    ap.add_argument("--mid-only", action="store_true", help="only the mid-size model (DIR/engine_mid.json)")
    ap.add_argument("--decode-path", choices=("default", "fused", "torch"), default="default",
                    help="the targets' layers as built (Transformer.fused), through kdtree.fused or the "
                    "torch path (the torch path matches the engine before the fused layer)")
    ap.add_argument("--no-compile", action="store_true", help="--mid-only: leave out the torch.compile row")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m kdtree.bench.engine needs a CUDA GPU: none is visible on this machine")
    from ..lab import record_dir_or_exit
    record_dir_or_exit(a.out, "cuda", "python -m kdtree.bench.engine")
    if a.rows_probe:
        rows = verify_rows(a.ckpt)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "engine_rows.json").write_text(json.dumps(rows, indent=1))
        for r in rows:
            print(f"rows {r['rows']:4d}: verify forward {r['median_s'] * 1e6:8.1f} us "
                  f"(min {r['min_s'] * 1e6:.1f})")
        return
    if a.mid_only:
        m = mid_model(hf=not a.no_hf, n_prompts=2 if a.quick else 4, max_new=32 if a.quick else 64,
                      compile=not a.no_compile, decode_path=a.decode_path)
        m["targets"] = mid_targets(m)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "engine_mid.json").write_text(json.dumps(m, indent=1))
        for t in m["targets"]:
            print(goals.line(t))
        return
    rec = run(a.out, a.ckpt, hf=not a.no_hf, quick=a.quick, budgets=tuple(a.budgets),
              batches=tuple(a.batches), batched_compile=False if a.batched_eager else None, mid=not a.no_mid,
              decode_path=a.decode_path)
    print(summary(rec))


if __name__ == "__main__":
    main()
