"""The kernel suite (GPU): `python -m kdtree bench [--out DIR] [--quick]` runs the tree round, verify
attention (with its ablations on Hopper) and the two ceilings, and writes DIR/bench_kernels.json with a
top-level `targets` list (bench.goals). The MoE and layer benchmarks run from notebook 01."""
from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from .. import kernels
from .ceilings import measure_ceilings
from . import goals
from .goals import target
from .clocks import gpu_state
from .tree import bench_tree
from .verify import bench_attn, bench_verify_ablation, verify_smem_model


def run(out_dir: str | Path, quick: bool = False, progress: bool = True) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state0 = gpu_state()
    ceil = measure_ceilings()
    if quick:
        tree = bench_tree(budgets=(64, 1024), batches=(1, 32), repeats=20, ref_repeats=3, progress=progress)
        attn = bench_attn(contexts=(32768,), nodes=(1, 64), batches=(1, 8), repeats=10, progress=progress)
    else:
        tree = bench_tree(progress=progress)
        attn = bench_attn(progress=progress)
    ablation = bench_verify_ablation(progress=progress) if kernels._sm90() and not quick else []
    bw, peak = ceil["copy_bandwidth_Bps"], ceil["bf16_matmul_flops"]
    for r in ablation:
        r["frac_matmul_rate"] = r["flops"] / r["kernel_s"] / peak
        r["frac_bandwidth"] = r["bytes"] / r["kernel_s"] / bw
    for r in tree:
        r["floor_s"] = r["logit_bytes"] / bw
    for r in attn:
        r["tflops"] = r["flops"] / r["kernel_s"] / 1e12
        r["GBps"] = r["bytes"] / r["kernel_s"] / 1e9
        r["frac_matmul_rate"] = r["flops"] / r["kernel_s"] / peak
        r["frac_bandwidth"] = r["bytes"] / r["kernel_s"] / bw
        r["floor_s"] = max(r["flops"] / peak, r["bytes"] / bw)

    def pick(rows, **kw):
        return next((r for r in rows if all(r[k] == v for k, v in kw.items())), None)
    targets = []
    r = pick(tree, batch=1, budget=64)
    if r:
        targets.append(target("tree_round_b1_us", r["gpu_graph_s"] * 1e6))
    r = pick(tree, batch=32, budget=1024)
    if r:
        targets.append(target("tree_round_b32_x_reference", r["speedup_vs_reference"]))
    r = pick(attn, context=32768, nodes=64, batch=1)
    if r:
        targets.append(target("verify_attn_matmul_fraction", r["frac_matmul_rate"]))
    r = pick(attn, context=32768, nodes=1, batch=8)
    if r:
        targets.append(target("verify_attn_bandwidth_fraction", r["frac_bandwidth"]))
    import cupy
    rec = {
        "device": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "python": platform.python_version(),
        "quick": quick,
        "ceilings": ceil,
        "gpu_state": {"start": state0, "end": gpu_state()},
        "tree_round": tree,
        "verify_attn": attn,
        "verify_ablation": ablation,
        "verify_smem_model": verify_smem_model(),
        "targets": targets,
    }
    (out_dir / "bench_kernels.json").write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def summary(rec: dict) -> str:
    c = rec["ceilings"]
    lines = [
        f"{rec['device']}: copy {c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s",
        "tree round (V=163840, L=15):  batch budget   gpu_us (topk  tree)  eager_us  torch_topk+lse_us    "
        "ref_us  x_ref  floor_us",
    ]
    for r in rec["tree_round"]:
        lines.append(
            f"  {r['batch']:5d} {r['budget']:6d} {r['gpu_graph_s'] * 1e6:8.1f} "
            f"({r['gpu_topk_stage_s'] * 1e6:6.1f} "
            f"{r['gpu_tree_stage_s'] * 1e6:6.1f}) {r['gpu_eager_wall_s'] * 1e6:9.1f} "
            f"{r['torch_topk_lse_s'] * 1e6:12.1f} {r['reference_s'] * 1e6:9.0f} "
            f"{r['speedup_vs_reference']:6.0f} "
            f"{r['floor_s'] * 1e6:8.1f}"
        )
    lines.append(
        "verify_attn (H=64):  ctx  nodes batch impl     us    TFLOP/s  GB/s  %mm  %bw  naive_us  x_naive  "
        "mma_us  x_mma   ws_us   x_ws"
    )
    nan = float("nan")
    for r in rec["verify_attn"]:
        lines.append(
            f"  {r['context']:6d} {r['nodes']:5d} {r['batch']:4d} {r.get('impl', 'mma'):5s} "
            f"{r['kernel_s'] * 1e6:8.1f} {r['tflops']:7.1f} "
            f"{r['GBps']:6.0f} {100 * r['frac_matmul_rate']:4.0f} {100 * r['frac_bandwidth']:4.0f} "
            f"{r.get('naive_s', nan) * 1e6:9.1f} {r.get('speedup_vs_naive', nan):7.2f} "
            f"{r.get('mma_s', nan) * 1e6:8.1f} {r.get('speedup_vs_mma', nan):5.2f} "
            f"{r.get('ws_s', nan) * 1e6:8.1f} {r.get('speedup_vs_ws', nan):5.2f}"
        )
    if rec.get("verify_ablation"):
        lines.append(
            "verify_attn ablations (timing-only -D switches):  impl  ctx  nodes batch      us   %mm   %bw"
        )
        for r in rec["verify_ablation"]:
            lines.append(
                f"  {r['ablation']:22s} {r['impl']:5s} {r['context']:6d} {r['nodes']:5d} {r['batch']:4d} "
                f"{r['kernel_s'] * 1e6:8.1f} {100 * r['frac_matmul_rate']:4.0f} "
                f"{100 * r['frac_bandwidth']:4.0f}"
            )
    if "verify_smem_model" in rec:
        m = rec["verify_smem_model"]
        lines.append(
            f"verify_attn_wg, one 64-key tile: {m['total_bytes'] / 1024:.0f} KB of shared-memory traffic "
            f"({m['smem_clocks_at_128B']:.0f} clocks at 128 B/clock) vs {m['tensor_clocks_at_2048_mac']:.0f} "
            f"clocks of tensor work at 2048 MAC/clock"
        )
    lines += [goals.line(t) for t in rec["targets"]]
    return "\n".join(lines)
