"""One decode step of each layer of a model against its byte floor: the "layers" part of the record that
`python -m kdtree.bench.decode` writes (bench.decode re-exports the public names).

The floor of a step is the bytes it must read at least (`layer_floor_parts`): every parameter and buffer of
the layer's attention, norms, router, shared expert or dense MLP, the routed experts its routing selects
(distinct experts x `expert_bytes`) and the latent KV rows it attends; over a copy rate (bytes/s) it gives
floor_s. `layer_steps` runs each layer through the paged path the engine runs (`paged_inputs`:
`AttnMeta.build` over a page pool) on each path of `layer_paths`, timed as CUDA-graph replays, with the
kernels one eager step launches (`kernel_table`).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import numpy as np
import torch

from .timer import measure

PAGE_SIZE = 64
KERNEL_NAME_CHARS = 160          # kernel names in the per-name table are cut to this length
LAYER_WARM_S = 0.2               # untimed replays before each layer timing


def blas_name() -> str:
    """torch's preferred BLAS library now, lowercased ("cublas", "cublaslt", ...): a row's "blas"."""
    return str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def expert_bytes(experts) -> int:
    """Bytes of one routed expert as the step reads it: an Int4Experts' share of moe_int4's layout (int32
    words and bf16 scales of E experts, as many as the checkpoint layout's: `repack_moe` only reorders them;
    read from the shapes, so meta or float32 scales count as the kernel reads them), or one MLP expert's
    parameters (a ModuleList of MLP experts, as before `quantize_experts`)."""
    from ..model import MLP, Int4Experts
    if isinstance(experts, Int4Experts):
        words = experts.w13_packed.numel() + experts.w2_packed.numel()
        scales = experts.w13_scale.numel() + experts.w2_scale.numel()
        return (4 * words + 2 * scales) // experts.w13_packed.shape[0]
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


def paged_inputs(model, context: int, batch: int = 1, nodes: int = 1, moe: str = "grouped", seed: int = 0,
                 mask=None):
    """The inputs of one paged decode step of `model`'s layers: (pool bf16 [layers, pages * PAGE_SIZE, R + P]
    random, x [batch, nodes, D] random in the model's dtype, cos, sin [batch, nodes, P/2], meta) with each
    request's context + nodes rows on pages of a shuffled page table; over the nodes a causal block mask, or
    `mask` (bool [nodes, nodes], row i sees row j, diagonal set: a tree's ancestor mask, its rows' positions
    context + depth) for every request."""
    a, dev = model.args, model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    P = -(-(context + nodes) // PAGE_SIZE)
    layers = len(model.model.layers)
    pool = torch.empty(layers, batch * P * PAGE_SIZE, a.kv_lora_rank + a.qk_rope_head_dim,
                       dtype=model.cache_dtype, device=dev)
    pool.normal_(0, 0.5, generator=g)
    page_table = torch.randperm(batch * P, device=dev, generator=g).to(torch.int32).view(batch, P)
    cache_len = torch.full((batch,), context, dtype=torch.int64, device=dev)
    if mask is None:
        mask = torch.ones(nodes, nodes, dtype=torch.bool, device=dev).tril()
    else:
        mask = torch.as_tensor(mask, dtype=torch.bool).to(dev)
        if mask.shape != (nodes, nodes) or not bool(mask.diagonal().all()):
            raise ValueError(f"mask: expected bool [{nodes}, {nodes}] with its diagonal set, got shape "
                             f"{tuple(mask.shape)}")
    depth = mask.sum(-1) - 1                                                              # [nodes]
    positions = (context + depth)[None].expand(batch, nodes).contiguous()
    mask = mask[None].expand(batch, nodes, nodes)
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
            row["blas"] = blas_name()
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


def bench_layer_fused(model, contexts=(4096, 32768), nodes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                      batches=(1, 8), repeats: int = 10, progress: bool = True, seed: int = 0) -> list[dict]:
    """bench_layer's rows for the fused decode path: each layer alone through kdtree.fused
    (`fused_layer_step`, the engine's MoE path and BLAS library) over a paged pool
    (`paged_inputs`) with the same DDTree-shaped masks, timed as CUDA-graph replays (events
    where capture fails). MoE rows carry experts_touched (counted on the layer's torch step: the fused router
    calls no gate module) and, on a GPU, moe_kernel_s (the fused step's moe_* kernels, torch.profiler).
    ValueError where the fused path does not apply to the model (`fused.unsupported`, e.g. on a CPU)."""
    from .. import fused
    from .layer import MoE, _tree_mask, grid, routed, time_step
    dev = model.device
    moe, blas = _engine_bits(model)
    probe = paged_inputs(model, 64, 1, 1, moe, seed)[-1]
    why = fused.unsupported(model, probe)
    if why is not None:   # before the model is prepared or any pool is built
        raise ValueError(f"bench_layer_fused: the fused path does not apply here: {why}")
    model.prepare_paged(moe)
    rng = np.random.default_rng(seed)
    rows = []
    for C, B, N in grid(contexts, batches, nodes, progress, "layer verify (fused)"):
        pool, x, cos, sin, meta = paged_inputs(model, C, B, N, moe, seed, mask=_tree_mask(rng, N))
        for i, layer in enumerate(model.model.layers):
            step = fused_layer_step(model, i, x, cos, sin, pool, meta)
            with torch.no_grad(), blas(dev, B * N):
                t, how = time_step(step, repeats, dev)
                row = {"layer": i, "kind": "moe" if isinstance(layer.mlp, MoE) else "dense", "context": C,
                       "batch": B, "nodes": N, "time_s": t, "timing": how, "device": str(dev),
                       "path": "fused", "moe": moe}
                if isinstance(layer.mlp, MoE):   # the torch step calls the gate the fused router replaces
                    row.update(routed(layer.mlp, step, dev, count_step=lambda layer=layer, lat=pool[i]:
                                      layer(x, cos, sin, lat, meta)))
            rows.append(row)
        del pool, step
    return rows

