"""One decoder layer's verify cost against the tree's size at a config's real dimensions: a two-layer model
(dense layer 0, MoE layer 1 with random INT4 experts) built by the model's own code, its layers timed on N
tree nodes after a context of cached latent rows."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .. import golden
from ..config import load_config
from ..model import AttnMeta, Int4Experts, MoE, Transformer
from .timer import measure, mode_for


def layer_args(config: str = "kimi-k2.6"):
    """The config's dimensions with two layers (dense, then MoE) and a 1,024-token vocabulary (no special
    token ids: the real ones lie past it)."""
    return dataclasses.replace(load_config(config), num_hidden_layers=2, first_k_dense_replace=1,
                               vocab_size=1024, eos_token_id=None)


def layer_model(config: str = "kimi-k2.6", device: str = "cuda", seed: int = 0):
    """A two-layer model at the config's dimensions with random weights (layer 0 dense, layer 1 MoE with
    random INT4 experts), a small vocabulary; built on the meta device first so that no bf16 expert is ever
    materialised. attn_impl 'kernel' on a GPU, 'absorb' on a CPU; bf16 on a GPU, float32 on a CPU."""
    args = layer_args(config)
    gpu = str(device).startswith("cuda")
    E, D, I = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
    with torch.device("meta"):
        m = Transformer(args, attn_impl="kernel" if gpu else "absorb")
        m.model.layers[1].mlp.experts = Int4Experts(
            torch.empty(E, 2 * I, D // 8, dtype=torch.int32),
            torch.empty(E, 2 * I, D // 32, dtype=torch.bfloat16),
            torch.empty(E, D, I // 8, dtype=torch.int32),
            torch.empty(E, D, I // 32, dtype=torch.bfloat16),
        )
    m = m.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]), generator=g)
        layer = m.model.layers[1].mlp
        assert isinstance(layer, MoE)
        layer.gate.e_score_correction_bias.normal_(0, 0.01, generator=g)
        rnd = Int4Experts.random(E, D, I, device=device, seed=seed)
        for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            getattr(layer.experts, n).copy_(getattr(rnd, n))
        del rnd
    m = m.to(torch.bfloat16 if gpu else torch.float32)
    return m.eval()


def count_experts(moes, seen: list):
    """Forward hooks on the gates of `moes` (MoE modules) that append each call's distinct routed experts to
    `seen`; returns the hook handles (remove them when done)."""
    return [m.gate.register_forward_hook(lambda m, i, o: seen.append(o[1].unique().numel())) for m in moes]


def routed_kernel_s(prof) -> float:
    """Seconds of the routed experts' kernels (moe_*) in a torch.profiler run."""
    return sum(e.device_time for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("moe_")) * 1e-6


def experts_touched(moe: MoE, step) -> int:
    """Distinct routed experts one call of step() selects in `moe` (a forward hook on its gate);
    ValueError when step never called the gate."""
    seen: list = []
    hooks = count_experts([moe], seen)
    try:
        with torch.no_grad():
            step()
    finally:
        for h in hooks:
            h.remove()
    if not seen:
        raise ValueError("experts_touched: the step never called the layer's gate")
    return int(seen[0])


def routed(moe: MoE, step, device, calls: int = 3) -> dict:
    """The routed experts of one MoE layer's step: {"experts_touched": distinct experts its rows route to}
    and, on a GPU, {"moe_kernel_s": the routed experts' kernels (moe_*) seconds per step, torch.profiler's
    kernel times over `calls` eager steps}: the share of the layer's time that depends on the routing, which
    `project.routing_correction` replaces by an engine round's own."""
    from torch.profiler import ProfilerActivity

    from .profiling import profile
    out = {"experts_touched": experts_touched(moe, step)}
    if torch.device(device).type != "cuda":
        return out
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize(device)
    kern = routed_kernel_s(prof)
    return out | ({"moe_kernel_s": kern / calls} if kern > 0 else {})


LAYER_PATHS = ("torch", "fused")


def _tree_mask(rng, N: int) -> np.ndarray:
    """A DDTree's ancestor mask over N nodes (root first; [[True]] for one node)."""
    if N == 1:
        return np.ones((1, 1), bool)
    return golden.compile_tree(golden.ddtree(rng.standard_normal((15, 64)).astype(np.float32) * 2, N - 1),
                               0, 0).mask


def bench_layer(
    model,
    contexts=(4096, 32768),
    nodes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    batches=(1, 8),
    repeats: int = 10,
    progress: bool = True,
    seed: int = 0,
    path: str = "torch",
) -> list[dict]:
    """Verify cost of each decoder layer of `model` (layer_model): N tree nodes (a DDTree-shaped mask) after a
    context of C cached tokens (random latent rows), per (layer, context, N, batch). path "torch": the
    layer's Block.forward over a per-request cache; "fused" (a GPU): the layer through kdtree.fused over a
    paged pool, as the engine runs it (`bench_layer_fused`). On a GPU each step is timed as CUDA-graph
    replays (`timing` "graph"), or with events around eager calls where capture fails. MoE rows also carry
    `routed`'s experts_touched and (GPU) moe_kernel_s: the routed kernels' share of time_s on these rows'
    random routing (its profiler pass follows the row's timing; the rows after the first are timed with the
    profiler's CUDA tracing set up but idle). Every row says its "path"."""
    if path not in LAYER_PATHS:
        raise ValueError(f"path={path!r}: expected one of {LAYER_PATHS}")
    if path == "fused":
        return bench_layer_fused(model, contexts, nodes, batches, repeats, progress, seed)
    dev = model.device
    args = model.args
    mode = mode_for(dev)
    rng = np.random.default_rng(seed)
    rows = []
    it = [(c, b, n) for c in contexts for b in batches for n in nodes]
    if progress:
        from ..progress import tqdm

        it = tqdm(it, desc="layer verify")
    for C, B, N in it:
        cache = model.new_cache(C + N, B)
        with torch.no_grad():
            cache.latent.normal_(0, 0.5)
        cache.length = C
        m = torch.from_numpy(_tree_mask(rng, N))
        mask = m.to(dev)[None].expand(B, N, N).contiguous()
        depth = mask.sum(-1) - 1  # [B, N]
        pos = (C + depth).to(torch.int64)
        x = (torch.randn(B, N, args.hidden_size, device=dev) * 0.5).to(model.lm_head.weight.dtype)
        meta = AttnMeta.for_cache(cache, C, pos, mask, model.attn_impl)  # the model's own metadata
        cos, sin = model.rope(pos, x.dtype)
        for i, layer in enumerate(model.model.layers):

            def step(layer=layer, lat=cache.latent[i]):
                layer(x, cos, sin, lat, meta)

            how = "wall" if mode == "wall" else "graph"
            with torch.no_grad():
                if how == "graph":  # GPU time without the host's launch overhead; eager if capture fails
                    try:
                        t = measure(step, repeats, "graph").median
                    except RuntimeError:
                        how, t = "events", measure(step, repeats).median
                else:
                    t = measure(step, repeats, "wall").median
            row = {
                "layer": i,
                "kind": "moe" if isinstance(layer.mlp, MoE) else "dense",
                "context": C,
                "batch": B,
                "nodes": N,
                "time_s": t,
                "timing": how,
                "device": str(dev),
                "path": "torch",
            }
            if isinstance(layer.mlp, MoE):
                row.update(routed(layer.mlp, step, dev))
            rows.append(row)
        del step, cache   # the closure holds a view of the cache
    return rows


def bench_layer_fused(model, contexts=(4096, 32768), nodes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                      batches=(1, 8), repeats: int = 10, progress: bool = True, seed: int = 0) -> list[dict]:
    """bench_layer's rows for the fused decode path: each layer alone through kdtree.fused
    (`decode_layers.fused_layer_step`, the engine's MoE path and BLAS library) over a paged pool
    (`decode_layers.paged_inputs`) with the same DDTree-shaped masks, timed as CUDA-graph replays (events
    where capture fails). MoE rows carry experts_touched (counted on the layer's torch step: the fused router
    calls no gate module) and, on a GPU, moe_kernel_s (the fused step's moe_* kernels, torch.profiler).
    ValueError where the fused path does not apply to the model (`fused.unsupported`, e.g. on a CPU)."""
    from . import decode_layers as dl
    from .. import fused
    dev = model.device
    moe, blas = dl._engine_bits(model)
    probe = dl.paged_inputs(model, 64, 1, 1, moe, seed)[-1]
    why = fused.unsupported(model, probe)
    if why is not None:   # before the model is prepared or any pool is built
        raise ValueError(f"path='fused': the fused path does not apply here: {why}")
    model.prepare_paged(moe)
    rng = np.random.default_rng(seed)
    rows = []
    it = [(c, b, n) for c in contexts for b in batches for n in nodes]
    if progress:
        from ..progress import tqdm

        it = tqdm(it, desc="layer verify (fused)")
    for C, B, N in it:
        pool, x, cos, sin, meta = dl.paged_inputs(model, C, B, N, moe, seed, mask=_tree_mask(rng, N))
        for i, layer in enumerate(model.model.layers):
            step = dl.fused_layer_step(model, i, x, cos, sin, pool, meta)
            how = "wall" if mode_for(dev) == "wall" else "graph"
            with torch.no_grad(), blas(dev, B * N):
                if how == "graph":
                    try:
                        t = measure(step, repeats, "graph").median
                    except RuntimeError:
                        how, t = "events", measure(step, repeats).median
                else:
                    t = measure(step, repeats, "wall").median
                row = {"layer": i, "kind": "moe" if isinstance(layer.mlp, MoE) else "dense", "context": C,
                       "batch": B, "nodes": N, "time_s": t, "timing": how, "device": str(dev),
                       "path": "fused", "moe": moe}
                if isinstance(layer.mlp, MoE):
                    row["experts_touched"] = experts_touched(
                        layer.mlp, lambda layer=layer, lat=pool[i]: layer(x, cos, sin, lat, meta))
                    if torch.device(dev).type == "cuda":
                        row.update(_fused_moe_kernel_s(step, dev))
            rows.append(row)
        del pool, step
    return rows


def _fused_moe_kernel_s(step, device, calls: int = 3) -> dict:
    """{"moe_kernel_s": seconds a step of the routed experts' kernels (moe_*)} over `calls` eager steps
    (torch.profiler), or {} where none ran."""
    from torch.profiler import ProfilerActivity

    from .profiling import profile
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize(device)
    kern = routed_kernel_s(prof)
    return {"moe_kernel_s": kern / calls} if kern > 0 else {}
