"""A K2.6 decode step against its byte floor, on one GPU:
`python -m kdtree.bench.decode [--out PATH] [--quick]` writes one JSON record (layout in `main`; by default
outputs/<gpu>/bench_decode.json).

Two parts:
  gemm    cuBLAS (torch.nn.functional.linear, bf16) on the K2.6 layer's matrices [out, in] at a few rows:
          each cell's weights rotated past L2 (`timer.input_sets` copies), timed as CUDA-graph replays.
  layers  one decode step of each layer of `bench.layer.layer_model` (layer 0 dense, layer 1 MoE with INT4
          routed experts) through the paged path the engine runs (`AttnMeta.build` over a page pool), for
          each path the model offers: "torch" (Block.forward, model.fused False), "fused" (where the model
          has a `fused` attribute: the layer through kdtree.fused, model.fused True) and "torch.compile"
          (torch.compile of the torch path); timed as CUDA-graph replays, with the kernels one eager step
          launches (torch.profiler).

The byte floor: the bytes a cell must move at least, over the copy rate measured in the same run
(`ceilings.copy_bandwidth`: bytes read + written per second of a device-to-device copy); fraction = floor /
time. A GEMM moves its weight, input and output. A layer step reads every parameter and buffer of its
attention, norms, router, shared expert or dense MLP, the routed experts its routing selects (distinct
experts x the bytes of one expert in moe_int4's layout) and the latent KV rows it attends
(`layer_floor_bytes`).

The layers part lives in bench.decode_layers; its public names are importable from here too.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from . import goals
from ..ops.gemv import GEMV_MAX_ROWS, gemv
from .decode_layers import (KERNEL_NAME_CHARS, LAYER_WARM_S, PAGE_SIZE, blas_name,  # noqa: F401
                            count_routed, expert_bytes, fused_layer_step, kernel_table, layer_floor_bytes,
                            layer_floor_parts, layer_paths, layer_steps, paged_inputs)
from .timer import input_sets, measure

# (name, out, in) of the K2.6 layer's bf16 matrices, as F.linear's weight [out, in]
K26_GEMMS = (
    ("qkv_a", 1536 + 512 + 64, 7168),        # q_a_proj and kv_a_proj_with_mqa fused (prepare_paged)
    ("q_b", 64 * 192, 1536),
    ("o_proj", 7168, 64 * 128),
    ("shared_gate_up", 2 * 2048, 7168),
    ("shared_down", 7168, 2048),
    ("dense_gate_up", 2 * 18432, 7168),
    ("dense_down", 7168, 18432),
    ("router", 384, 7168),
    ("lm_head_slice", 16384, 7168),
)
GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64)
QUICK_ROWS = (1, 8, 64)
GEMM_TARGET_MB = (3.0, 40.0)     # the GEMM target's weight sizes (MB = 1e6 bytes) ...
GEMM_TARGET_ROWS = 64            # ... at this many rows or fewer


def _ctx_label(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 and context else str(context)


def build_targets(gemm_rows, layer_rows, context: int, batch: int) -> list[dict]:
    """The record's targets (bench.goals) from its rows (`gemm_table`'s and `layer_steps`'s dicts; rows with
    an "error" or a None fraction are left out):
      decode_gemm_floor_fraction: the smallest fraction over matrices of GEMM_TARGET_MB weight bytes at rows
        <= GEMM_TARGET_ROWS;
      decode_{moe,dense}_layer_floor_fraction: the best fraction over the layer's graph-timed paths at
        (context, batch);
      decode_kernels_per_moe_layer: the kernel count of the path the MoE target took.
    A target whose rows are missing has measured None and is not met."""
    lo, hi = (m * 1e6 for m in GEMM_TARGET_MB)
    g = [r for r in gemm_rows if r.get("fraction") is not None and not r.get("error")
         and lo <= r["weight_bytes"] <= hi and r["rows"] <= GEMM_TARGET_ROWS]
    worst = min(g, key=lambda r: r["fraction"]) if g else None
    out = [goals.target("decode_gemm_floor_fraction", worst and worst["fraction"],
                        **({"matrix": worst["name"], "rows": worst["rows"]} if worst else {}))]
    where = f"b{batch}, {_ctx_label(context)}"
    best = {}
    for kind in ("moe", "dense"):
        mine = [r for r in layer_rows if r.get("kind") == kind and r.get("context") == context
                and r.get("batch") == batch and r.get("timing") == "graph" and not r.get("error")
                and r.get("fraction") is not None]
        best[kind] = max(mine, key=lambda r: r["fraction"]) if mine else None

    def path(b):
        return {"path": b["path"]} if b else {}
    m, d = best["moe"], best["dense"]
    out.append(goals.target("decode_moe_layer_floor_fraction", m and m["fraction"], where=where, **path(m)))
    out.append(goals.target("decode_dense_layer_floor_fraction", d and d["fraction"], where=where, **path(d)))
    out.append(goals.target("decode_kernels_per_moe_layer", m and m.get("kernels"), where=where, **path(m)))
    return out


# ----------------------------------------------------------------------------- GEMMs
def _prefer_blas(lib: str | None):
    """torch's preferred BLAS library set to `lib` ("cublas" | "cublaslt"; None: left as it is) inside."""
    from ..engine import preferred_blas
    return preferred_blas(lib)


def gemm_table(rows=GEMM_ROWS, shapes=K26_GEMMS, repeats: int = 30, copy_rate: float | None = None,
               blas: str | None = None, bar=None, seed: int = 0, device="cuda") -> list[dict]:
    """y = F.linear(x, w) in bf16 for each (name, out, in) of `shapes` and each row count: w [out, in],
    x [rows, in] random, `timer.input_sets` copies of (w, x) rotated so a replay reads its weights from
    DRAM; each copy's call captured in a CUDA graph, median of `repeats` replays. copy_rate: bytes/s for the
    floor (default: measured here). blas: torch's preferred BLAS library during the cells (None: torch's
    own). bar: a progress bar (update(1) per cell) or None. device: a CUDA device (graph replays need one).
    One row per cell: {name, rows, out, in, weight_bytes, bytes (weight + input + output), time_s, floor_s,
    fraction = bytes / time_s / copy_rate, sets, blas}; up to ops.gemv.GEMV_MAX_ROWS rows also the same cell
    through ops.gemv's kernel, {gemv_time_s, gemv_fraction} (or gemv_error)."""
    if copy_rate is None:
        from .ceilings import copy_bandwidth
        copy_rate = copy_bandwidth()["bytes_per_s"]
    g = torch.Generator(device=device).manual_seed(seed)
    out_rows = []
    for name, n_out, n_in in shapes:
        wb = n_out * n_in * 2
        n_sets = input_sets(wb + (max(rows) * (n_in + n_out)) * 2, hi=64)
        ws = [torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16, generator=g) / math.sqrt(n_in)
              for _ in range(n_sets)]
        for r in rows:
            xs = [torch.randn(r, n_in, device=device, dtype=torch.bfloat16, generator=g) for _ in ws]
            fns = [lambda w=w, x=x: F.linear(x, w) for w, x in zip(ws, xs)]
            nbytes = wb + r * (n_in + n_out) * 2
            row = {"name": name, "rows": r, "out": n_out, "in": n_in, "weight_bytes": wb, "bytes": nbytes,
                   "sets": n_sets}
            try:
                with torch.no_grad(), _prefer_blas(blas):
                    row["blas"] = blas_name()
                    t = measure(fns, repeats, "graph").median
                row.update(time_s=t, floor_s=nbytes / copy_rate, fraction=nbytes / t / copy_rate)
            except RuntimeError as e:
                row.update(time_s=None, floor_s=nbytes / copy_rate, fraction=None, error=str(e)[:500])
            if r <= GEMV_MAX_ROWS and torch.device(device).type == "cuda":
                try:
                    gfns = [lambda w=w, x=x: gemv(x, w) for w, x in zip(ws, xs)]
                    with torch.no_grad():
                        t = measure(gfns, repeats, "graph").median
                    row.update(gemv_time_s=t, gemv_fraction=nbytes / t / copy_rate)
                except Exception as e:  # noqa: BLE001 - the cuBLAS row stands; the reason is kept
                    row["gemv_error"] = f"{type(e).__name__}: {e}"[:500]
            out_rows.append(row)
            del fns, xs
            if bar is not None:
                bar.update(1)
        del ws
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return out_rows


# ----------------------------------------------------------------------------- the command
def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive integer")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.decode",
                                 description="K2.6 GEMMs and decode layer steps against the byte floor "
                                             "(one JSON record)")
    ap.add_argument("--out", default=None,
                    help="the JSON record's path (default: outputs/<gpu>/bench_decode.json, the lab's folder "
                    "for this GPU)")
    ap.add_argument("--quick", action="store_true",
                    help=f"GEMM rows {QUICK_ROWS} and fewer repeats (a smoke run)")
    ap.add_argument("--context", type=_positive_int, default=4096, help="cached tokens per request")
    ap.add_argument("--batch", type=_positive_int, default=1, help="requests")
    ap.add_argument("--nodes", type=_positive_int, default=1, help="block rows per request (1: AR decode)")
    ap.add_argument("--repeats", type=_positive_int, default=None,
                    help="timed replays per cell (default 30, quick 10)")
    ap.add_argument("--parts", nargs="+", choices=("gemm", "layers"), default=["gemm", "layers"])
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="torch's preferred BLAS library for the GEMM table (the layers take the engine's)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile path")
    return ap.parse_args(argv)


def format_table(rec: dict) -> str:
    """A record's rows and targets as a plain-text table (what `main` prints last)."""
    lines = []
    if rec.get("gemm"):
        lines.append(f"{'gemm':<16}{'rows':>5}{'out':>7}{'in':>7}{'MB':>8}{'us':>9}{'floor us':>10}"
                     f"{'frac':>7}{'gemv us':>9}{'frac':>7}")
        for r in rec["gemm"]:
            t = "-" if r["time_s"] is None else f"{r['time_s'] * 1e6:.1f}"
            f = "-" if r["fraction"] is None else f"{r['fraction']:.2f}"
            gt = f"{r['gemv_time_s'] * 1e6:.1f}" if r.get("gemv_time_s") else "-"
            gf = f"{r['gemv_fraction']:.2f}" if r.get("gemv_fraction") else "-"
            lines.append(f"{r['name']:<16}{r['rows']:>5}{r['out']:>7}{r['in']:>7}"
                         f"{r['weight_bytes'] / 1e6:>8.1f}{t:>9}{r['floor_s'] * 1e6:>10.1f}{f:>7}"
                         f"{gt:>9}{gf:>7}")
    if rec.get("layers"):
        lines.append(f"{'layer':<12}{'path':<15}{'us':>9}{'floor us':>10}{'frac':>7}{'kernels':>9}  experts")
        for r in rec["layers"]:
            t = "-" if r["time_s"] is None else f"{r['time_s'] * 1e6:.1f}"
            fl = "-" if r["floor_s"] is None else f"{r['floor_s'] * 1e6:.1f}"
            f = "-" if r["fraction"] is None else f"{r['fraction']:.2f}"
            k = "-" if r["kernels"] is None else str(r["kernels"])
            err = f"  ERROR {r['error'][:60]}" if r.get("error") else ""
            lines.append(f"{str(r['layer']) + ' ' + r['kind']:<12}{r['path']:<15}{t:>9}{fl:>10}{f:>7}{k:>9}"
                         f"  {r['experts_touched']}{err}")
    for t in rec.get("targets", []):
        v = "-" if t["measured"] is None else f"{t['measured']:.3g}"
        op = ">=" if goals.goal(t["key"]).get("higher", True) else "<="
        lines.append(f"[{'met' if t['met'] else 'MISSED'}] {t['name']}: {v} (goal {op} {t['goal']})")
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Run the parts asked for and write the record to --out (parent folders made; written again after each
    part, with "partial": true until the end): {"bench": "decode", "device", "torch", "cuda", "python",
    "quick", "context", "batch", "nodes", "repeats", "copy_Bps" (the floors' rate), "copy" /
    "copy_end" (copy_bandwidth at the start and end), "gpu_state" / "gpu_state_end", "gemm": [gemm_table
    rows], "layers": [layer_steps rows], "targets": [build_targets]}. Returns the record. SystemExit with a
    message (no traceback) on a machine without CUDA."""
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m kdtree.bench.decode: needs a CUDA GPU (torch.cuda.is_available() is "
                         "False here); run it on the GPU machine")
    from ..progress import tqdm

    from .ceilings import copy_bandwidth
    from .clocks import gpu_state
    from .layer import layer_model
    repeats = a.repeats or (10 if a.quick else 30)
    rows = QUICK_ROWS if a.quick else GEMM_ROWS
    if a.out is None:
        from ..lab import output_dir
        out = output_dir("cuda") / "bench_decode.json"
    else:
        from ..lab import record_dir_or_exit
        out = Path(a.out)
        record_dir_or_exit(out.parent, "cuda", "python -m kdtree.bench.decode")
    out.parent.mkdir(parents=True, exist_ok=True)
    copy = copy_bandwidth()
    rec = {"bench": "decode", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "quick": a.quick,
           "context": a.context, "batch": a.batch, "nodes": a.nodes, "repeats": repeats,
           "copy_Bps": copy["bytes_per_s"], "copy": copy, "gpu_state": gpu_state(), "gemm": [], "layers": [],
           "targets": [], "partial": True}

    def save():
        rec["targets"] = build_targets(rec["gemm"], rec["layers"], a.context, a.batch)
        out.write_text(json.dumps(rec, indent=1) + "\n")

    bar = tqdm(total=len(K26_GEMMS) * len(rows) if "gemm" in a.parts else 0, desc="bench.decode",
               file=sys.stderr)
    try:
        if "gemm" in a.parts:
            rec["gemm"] = gemm_table(rows, K26_GEMMS, repeats, copy["bytes_per_s"],
                                     None if a.blas == "default" else a.blas, bar)
            save()
        if "layers" in a.parts:
            model = layer_model(device="cuda")
            bar.total += len(model.model.layers) * len(layer_paths(model, not a.no_compile))
            bar.refresh()
            rec["layers"] = layer_steps(model, a.context, a.batch, a.nodes, repeats, copy["bytes_per_s"],
                                        compile=not a.no_compile, bar=bar)
            del model
            torch.cuda.empty_cache()
    finally:
        bar.close()
    rec["copy_end"] = copy_bandwidth()
    rec["gpu_state_end"] = gpu_state()
    rec["partial"] = False
    save()
    print(format_table(rec))
    print(out)
    return rec


if __name__ == "__main__":
    main()
