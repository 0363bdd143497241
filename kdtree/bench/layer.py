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


def routed(moe: MoE, step, device, calls: int = 3, count_step=None) -> dict:
    """The routed experts of one MoE layer's step: {"experts_touched": distinct experts its rows route to}
    and, on a GPU, {"moe_kernel_s": the routed experts' kernels (moe_*) seconds per step, torch.profiler's
    kernel times over `calls` eager steps}: the share of the layer's time that depends on the routing, which
    `project.routing_correction` replaces by an engine round's own. count_step: a step over the same rows
    that calls the layer's gate module, where `step` does not (the fused path's router kernels)."""
    from torch.profiler import ProfilerActivity

    from .profiling import profile
    out = {"experts_touched": experts_touched(moe, count_step or step)}
    if torch.device(device).type != "cuda":
        return out
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize(device)
    kern = routed_kernel_s(prof)
    return out | ({"moe_kernel_s": kern / calls} if kern > 0 else {})


def time_step(step, repeats: int, device) -> tuple[float, str]:
    """(seconds, timing) of step(): the median of CUDA-graph replays on a GPU ("graph"; events around eager
    calls, "events", where capture fails), of wall-clock calls elsewhere ("wall")."""
    if mode_for(device) == "wall":
        return measure(step, repeats, "wall").median, "wall"
    try:
        return measure(step, repeats, "graph").median, "graph"
    except RuntimeError:
        return measure(step, repeats).median, "events"


def grid(contexts, batches, nodes, progress: bool, desc: str):
    """The (context, batch, nodes) cells of a layer sweep in order, under a progress bar when progress."""
    it = [(c, b, n) for c in contexts for b in batches for n in nodes]
    if progress:
        from ..progress import tqdm

        it = tqdm(it, desc=desc)
    return it


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
) -> list[dict]:
    """Verify cost of each decoder layer of `model` (layer_model): N tree nodes (a DDTree-shaped mask) after a
    context of C cached tokens (random latent rows), per (layer, context, N, batch), each layer's
    Block.forward over a per-request cache (path "torch"; decode_layers.bench_layer_fused times the fused
    path the engine runs). On a GPU each step is timed as CUDA-graph replays (`timing` "graph"), or with
    events around eager calls where capture fails. MoE rows also carry `routed`'s experts_touched and (GPU)
    moe_kernel_s: the routed kernels' share of time_s on these rows' random routing (its profiler pass
    follows the row's timing; the rows after the first are timed with the profiler's CUDA tracing set up but
    idle)."""
    dev = model.device
    args = model.args
    rng = np.random.default_rng(seed)
    rows = []
    for C, B, N in grid(contexts, batches, nodes, progress, "layer verify"):
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

            with torch.no_grad():   # GPU time without the host's launch overhead
                t, how = time_step(step, repeats, dev)
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

