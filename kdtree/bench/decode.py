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
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from . import goals
from ..ops.gemv import GEMV_MAX_ROWS, gemv
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
PAGE_SIZE = 64
KERNEL_NAME_CHARS = 160          # kernel names in the per-name table are cut to this length
LAYER_WARM_S = 0.2               # untimed replays before each layer timing


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


def _blas_name() -> str:
    return str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()


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
                    row["blas"] = _blas_name()
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


# ----------------------------------------------------------------------------- layer steps
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def expert_bytes(experts) -> int:
    """Bytes of one routed expert as the step reads it: an Int4Experts' share of `kernel_weights()`
    (moe_int4's layout: w13, s13, w2, s2 of E experts, over E), or one MLP expert's parameters (a ModuleList
    of MLP experts, as before `quantize_experts`)."""
    from ..model import MLP, Int4Experts
    if isinstance(experts, Int4Experts):
        mw = experts.kernel_weights()
        return sum(_nbytes(t) for t in (mw.w13, mw.s13, mw.w2, mw.s2)) // mw.E
    mlp = next((m for m in experts if isinstance(m, MLP)), None)
    if mlp is None:
        raise ValueError("expert_bytes: no routed expert is held here")
    return sum(_nbytes(p) for p in mlp.parameters())


def layer_floor_parts(layer, experts_touched: int, context: int, batch: int = 1,
                      kv_itemsize: int = 2) -> dict:
    """The bytes one decode step of Block `layer` must read, by part: {"weights": every parameter and buffer
    of the block but its routed experts (attention, norms, router, shared expert or dense MLP), "experts":
    experts_touched x `expert_bytes` (0 for a dense layer), "kv": batch x context cached latent rows of
    kv_lora_rank + qk_rope_head_dim elements of kv_itemsize bytes (the bf16 page pool: 2)}. Works on any
    device (a CPU model's float32 weights count 4 bytes each); no tensor is read."""
    from ..model import MoE
    for what, v, lo in (("experts_touched", experts_touched, 0), ("context", context, 0), ("batch", batch, 1),
                        ("kv_itemsize", kv_itemsize, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{what}={v!r}: expected an int >= {lo}")
    moe = isinstance(layer.mlp, MoE)
    if not moe and experts_touched:
        raise ValueError(f"experts_touched={experts_touched}: layer has a dense MLP (no routed experts)")
    if moe and experts_touched > layer.mlp.args.n_routed_experts:
        raise ValueError(f"experts_touched={experts_touched}: the layer has "
                         f"{layer.mlp.args.n_routed_experts} routed experts")
    routed = "mlp.experts."
    weights = sum(_nbytes(t) for n, t in list(layer.named_parameters()) + list(layer.named_buffers())
                  if not (moe and n.startswith(routed)))
    a = layer.self_attn.args
    return {"weights": weights,
            "experts": experts_touched * expert_bytes(layer.mlp.experts) if moe and experts_touched else 0,
            "kv": batch * context * (a.kv_lora_rank + a.qk_rope_head_dim) * kv_itemsize}


def layer_floor_bytes(layer, experts_touched: int, context: int, batch: int = 1, kv_itemsize: int = 2) -> int:
    """The byte floor's numerator of one decode step of Block `layer`: the sum of `layer_floor_parts`."""
    return sum(layer_floor_parts(layer, experts_touched, context, batch, kv_itemsize).values())


def kernel_table(step) -> tuple[int, list[dict]]:
    """The CUDA kernels one eager call of step() launches (after one untimed call), read from torch.profiler
    as bench.layer's routed_kernel_s reads them (every device event, CuPy launches included): (count,
    [{name, count, device_us}] by total device time, largest first; names cut to KERNEL_NAME_CHARS)."""
    from torch.profiler import ProfilerActivity

    from .profiling import profile
    with torch.no_grad():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    agg = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:KERNEL_NAME_CHARS]]
            a[0] += 1
            a[1] += e.device_time
    table = [{"name": n, "count": c, "device_us": round(us, 3)} for n, (c, us) in agg.items()]
    table.sort(key=lambda r: -r["device_us"])
    return sum(r["count"] for r in table), table


def count_routed(layer, step) -> int:
    """Distinct routed experts one call of step() selects in MoE Block `layer` (a forward hook on its gate,
    bench.layer.count_experts); 0 for a dense layer. ValueError when the gate was not called."""
    from ..model import MoE
    from .layer import experts_touched
    return experts_touched(layer.mlp, step) if isinstance(layer.mlp, MoE) else 0


def _engine_bits(model):
    """(the engine's MoE path for `model`, a context manager factory setting the engine's BLAS library for a
    region of `rows` GEMM rows), from kdtree.engine; (None -> "grouped", a no-op) if it does not import."""
    try:
        from ..engine import blas_for, moe_path
        return moe_path(model, None, False), blas_for
    except Exception:  # the engine's private helpers moved: the layer still runs, with torch's defaults
        return "grouped", lambda device, rows: contextlib.nullcontext()


def paged_inputs(model, context: int, batch: int = 1, nodes: int = 1, moe: str = "grouped", seed: int = 0):
    """The inputs of one paged decode step of `model`'s layers: (pool bf16 [layers, pages * PAGE_SIZE, R + P]
    random, x [batch, nodes, D] random in the model's dtype, cos, sin [batch, nodes, P/2], meta) with each
    request's context + nodes rows on pages of a shuffled page table, a causal block mask over the nodes."""
    a, dev = model.args, model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    P = -(-(context + nodes) // PAGE_SIZE)
    layers = len(model.model.layers)
    pool = torch.empty(layers, batch * P * PAGE_SIZE, a.kv_lora_rank + a.qk_rope_head_dim,
                       dtype=model.cache_dtype, device=dev)
    pool.normal_(0, 0.5, generator=g)
    page_table = torch.randperm(batch * P, device=dev, generator=g).to(torch.int32).view(batch, P)
    cache_len = torch.full((batch,), context, dtype=torch.int64, device=dev)
    positions = (context + torch.arange(nodes, device=dev))[None].expand(batch, nodes).contiguous()
    mask = torch.ones(nodes, nodes, dtype=torch.bool, device=dev).tril()[None].expand(batch, nodes, nodes)
    meta = _build_meta(page_table, cache_len, positions, mask.contiguous(), model.attn_impl, moe)
    x = torch.randn(batch, nodes, a.hidden_size, device=dev, generator=g).to(model.dtype)
    cos, sin = model.rope(positions, x.dtype)
    return pool, x, cos, sin, meta


def _build_meta(page_table, cache_len, positions, mask, attn_impl: str, moe: str):
    from ..model import AttnMeta
    return AttnMeta.build(page_table, cache_len, positions, mask, PAGE_SIZE, attn_impl, moe)


def layer_paths(model, compile: bool = True) -> list[str]:
    """The paths `layer_steps` times on `model`: "torch", then "fused" and "fused+gemv" (the fused path with
    its projections through ops.gemv, fused.GEMV_ROWS raised to the step's rows) where the model has a `fused`
    attribute, then "torch.compile" when compile."""
    fused = ["fused", "fused+gemv"] if hasattr(model, "fused") else []
    return ["torch"] + fused + (["torch.compile"] if compile else [])


def fused_layer_step(model, i: int, x, cos, sin, pool, meta):
    """A callable running decoder layer i of `model` alone through the fused decode path: kdtree.fused's
    forward_layers (which Transformer.forward_paged takes where model.fused is set) over a view of the model
    holding only that layer, on pool[i]: the layer's input add_rmsnorm, attention, post-attention
    add_rmsnorm, feed-forward, and the final norm's add_rmsnorm, which folds the layer's output residual (as
    the next layer's input add_rmsnorm does in the stack). ValueError with the reason where the fused path
    does not apply (`fused.unsupported`) or kdtree.fused has no forward_layers."""
    from types import SimpleNamespace

    try:
        from .. import fused
        forward_layers, unsupported = fused.forward_layers, fused.unsupported
    except (ImportError, AttributeError) as e:
        raise ValueError(f"no fused decode path to time ({type(e).__name__}: {e})") from None
    why = unsupported(model, meta)
    if why is not None:
        raise ValueError(f"the fused path does not apply here: {why}")
    view = SimpleNamespace(model=SimpleNamespace(layers=[model.model.layers[i]], norm=model.model.norm))
    part = pool[i:i + 1]
    return lambda: forward_layers(view, x, cos, sin, part, meta)


def layer_steps(model, context: int = 4096, batch: int = 1, nodes: int = 1, repeats: int = 30,
                copy_rate: float | None = None, compile: bool = True, bar=None, seed: int = 0) -> list[dict]:
    """One decode step of each layer of `model` (`bench.layer.layer_model`, on a GPU): `paged_inputs` at
    (context, batch, nodes), model.prepare_paged and the BLAS library of the engine's paths, then for each
    path of `layer_paths` the layer's step timed as CUDA-graph replays (median of `repeats`; "events" around
    eager calls where capture fails) and its kernels (`kernel_table`). The paths: "torch", the reference
    `layer(x, cos, sin, pool[i], meta)` (Block.forward) with model.fused False; "fused", `fused_layer_step`
    with model.fused True; "torch.compile", torch.compile of the torch step (model.fused False). model.fused
    is restored after. The floor takes the routing's distinct experts from one torch step (`count_routed`:
    every path routes the same rows). copy_rate: bytes/s for the floor (default: measured here); bar: a
    progress bar (update(1) per (layer, path)).
    One row per (layer, path): {layer, kind, path, context, batch, nodes, moe, experts_touched, floor_bytes,
    floor_parts, floor_s, time_s, timing ("graph" | "events"), fraction = floor_s / time_s, kernels,
    kernel_table, blas}, with "error" (a string; the time fields None) where the path failed or does not
    apply, "graph_error" where capture failed, "floor_error" where the floor could not be formed."""
    from ..model import MoE
    from .clocks import settle_gpu
    if copy_rate is None:
        from .ceilings import copy_bandwidth
        copy_rate = copy_bandwidth()["bytes_per_s"]
    dev = model.device
    moe, blas = _engine_bits(model)
    model.prepare_paged(moe)
    pool, x, cos, sin, meta = paged_inputs(model, context, batch, nodes, moe, seed)
    has_fused = hasattr(model, "fused")
    fused0 = getattr(model, "fused", None)
    if has_fused:
        from .. import fused
        gemv_rows0 = fused.GEMV_ROWS
    paths = layer_paths(model, compile)
    n_rows = batch * nodes
    rows = []

    def set_path(path):
        if has_fused:
            from .. import fused
            model.fused = path.startswith("fused")
            fused.GEMV_ROWS = n_rows if path == "fused+gemv" else gemv_rows0

    try:
        for i, layer in enumerate(model.model.layers):

            def step(layer=layer, lat=pool[i]):
                return layer(x, cos, sin, lat, meta)

            kind = "moe" if isinstance(layer.mlp, MoE) else "dense"
            base = {"layer": i, "kind": kind, "context": context, "batch": batch, "nodes": nodes, "moe": moe}
            try:
                set_path("torch")
                with blas(dev, n_rows):
                    touched = count_routed(layer, step)
                parts = layer_floor_parts(layer, touched, context, batch, pool.element_size())
                floor = sum(parts.values())
            except Exception as e:  # noqa: BLE001 - the record keeps the reason; the other layers still run
                touched, parts, floor = None, None, None
                base["floor_error"] = f"{type(e).__name__}: {e}"[:500]
            base.update(experts_touched=touched, floor_bytes=floor, floor_parts=parts,
                        floor_s=None if floor is None else floor / copy_rate)
            makers = {"torch": lambda step=step: step,
                      "fused": lambda i=i: fused_layer_step(model, i, x, cos, sin, pool, meta),
                      "fused+gemv": lambda i=i: fused_layer_step(model, i, x, cos, sin, pool, meta),
                      "torch.compile": lambda step=step: _compiled(step, blas, dev, n_rows)}
            for path in paths:
                set_path(path)
                try:
                    rows.append(_one_path(makers[path], path, blas, dev, n_rows, repeats, base, settle_gpu))
                finally:
                    set_path("torch")
                if bar is not None:
                    bar.update(1)
    finally:
        if has_fused:
            model.fused = fused0
    return rows


def _compiled(step, blas, dev, n_rows):
    """torch.compile(step), compiled by one call here (under the region's BLAS library)."""
    fn = torch.compile(step, dynamic=False)
    with torch.no_grad(), blas(dev, n_rows):
        fn()
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()
    return fn


def _one_path(make, path, blas, dev, n_rows, repeats, base, settle_gpu) -> dict:
    """One (layer, path) row of `layer_steps`: make() gives the step to time (an exception there or after is
    the row's "error")."""
    row = {**base, "path": path, "time_s": None, "timing": None, "fraction": None, "kernels": None,
           "kernel_table": None}
    try:
        fn = make()
        with torch.no_grad(), blas(dev, n_rows):
            row["blas"] = _blas_name()
            try:
                t, how = measure(fn, repeats, "graph", warm_s=LAYER_WARM_S,
                                 before=lambda: settle_gpu(dev)).median, "graph"
            except RuntimeError as e:  # capture failed: GPU time of eager calls, the reason kept
                row["graph_error"] = f"{type(e).__name__}: {e}"[:500]
                t, how = measure(fn, repeats, "events", queued=True).median, "events"
            row.update(time_s=t, timing=how)
            if base["floor_s"] is not None:
                row["fraction"] = base["floor_s"] / t
            row["kernels"], row["kernel_table"] = kernel_table(fn)
    except Exception as e:  # noqa: BLE001 - a failing path (e.g. a kernel in progress) is recorded
        row["error"] = f"{'compile: ' if path == 'torch.compile' else ''}{type(e).__name__}: {e}"[:1000]
    return row


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
        out = Path(a.out)
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
