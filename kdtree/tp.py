"""Tensor parallelism over torch.distributed: one model sharded across `world` ranks, the same generate loops
on every rank, every rank ending each forward with the same logits.

    shard(model, rank, world, group=None)     in place, returns the model
    dryrun(world=8, backend="gloo")           spawns `world` local ranks and checks a sharded tiny model

Layout (DeepSeek-V3's MLA and MoE, Megatron-style splits):
  MLA        attention heads split: this rank's rows of q_proj / q_b_proj and kv_b_proj, its columns of
             o_proj; the latent projections (q_a_proj, kv_a_proj_with_mqa) and the latent KV cache stay
             replicated (one latent serves every head); o_proj's partial sums are all-reduced.
  dense MLP  gate/up rows and down columns split; down's partial sums all-reduced.
  MoE        routing replicated (each rank computes the same top-k from the same all-reduced input); rank r
             keeps routed experts [r E / world, (r + 1) E / world) (expert parallel), the others become
             AbsentExpert (INT4 experts: the stacked block, Int4Experts.select; ids routed to another rank's
             experts become -1, which the pair grouping drops); the shared expert's intermediate is split; one
             all-reduce of the layer's partial output (own experts + own shared slice).
  embeddings, norms, lm_head, the drafter: replicated.
Two all-reduces per layer, of [B, T, hidden] activations.

`python -m kdtree tp --world 8` runs the dry-run: gloo on the CPU (NCCL with --backend nccl on a GPU host,
one GPU per rank).
"""
from __future__ import annotations

import dataclasses
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

from .config import TINY_B
from .model import MLA, MLP, AbsentExpert, Int4Experts, MoE, Transformer


def _keep_rows(lin: nn.Linear, idx: torch.Tensor) -> None:
    lin.weight = nn.Parameter(lin.weight.data[idx].clone(), requires_grad=lin.weight.requires_grad)
    lin.out_features = idx.numel()


def _keep_cols(lin: nn.Linear, idx: torch.Tensor) -> None:
    lin.weight = nn.Parameter(lin.weight.data[:, idx].clone(), requires_grad=lin.weight.requires_grad)
    lin.in_features = idx.numel()


def _all_reduce_hook(group):
    def hook(module, inputs, out):
        dist.all_reduce(out, group=group)
        return out
    return hook


def _split(n: int, rank: int, world: int, what: str) -> torch.Tensor:
    if n % world:
        raise ValueError(f"shard: {what} = {n} is not divisible by world = {world}")
    k = n // world
    return torch.arange(rank * k, (rank + 1) * k)


def _shard_mlp(mlp: MLP, rank: int, world: int, what: str) -> None:
    cols = _split(mlp.gate_proj.out_features, rank, world, what)
    _keep_rows(mlp.gate_proj, cols)
    _keep_rows(mlp.up_proj, cols)
    _keep_cols(mlp.down_proj, cols)


def _shard_mla(attn: MLA, rank: int, world: int) -> None:
    a = attn.args
    heads = _split(a.num_attention_heads, rank, world, "num_attention_heads")

    def per_head(width: int) -> torch.Tensor:
        return (heads[:, None] * width + torch.arange(width)).reshape(-1)
    _keep_rows(attn.q_proj if a.q_lora_rank is None else attn.q_b_proj, per_head(a.qk_head_dim))
    _keep_rows(attn.kv_b_proj, per_head(a.qk_nope_head_dim + a.v_head_dim))
    _keep_cols(attn.o_proj, per_head(a.v_head_dim))
    attn.args = dataclasses.replace(a, num_attention_heads=heads.numel())


def check_shardable(args, world: int) -> None:
    """ValueError naming the first size of `args` (ModelArgs) that `world` ranks cannot split evenly: heads,
    the dense layers' intermediate size, routed experts, the shared experts' intermediate size. Needs no
    process group: the dry-run calls it before spawning."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r}: expected an int >= 1")
    sizes = [("num_attention_heads", args.num_attention_heads)]
    if args.first_k_dense_replace:
        sizes.append(("intermediate_size", args.intermediate_size))
    if args.n_moe_layers:
        sizes.append(("n_routed_experts", args.n_routed_experts))
        if args.n_shared_experts:
            sizes.append(("shared expert intermediate", args.moe_intermediate_size * args.n_shared_experts))
    for what, n in sizes:
        if n % world:
            raise ValueError(f"world={world}: {what} = {n} is not divisible by it")


def shard(model: Transformer, rank: int, world: int, group=None) -> Transformer:
    """Shard `model` (identical on every rank, e.g. built from one seed or loaded from one checkpoint) in
    place for `rank` of `world`; needs an initialised process group for world > 1. Returns the model."""
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"shard: expected 0 <= rank < world, got rank={rank!r}, world={world!r}")
    if getattr(model, "tp", None) is not None:
        raise ValueError(f"shard: the model is already sharded (rank, world) = {model.tp}: shard an "
                         "unsharded copy")
    if world == 1:
        return model
    if not dist.is_initialized():
        raise RuntimeError("shard: torch.distributed is not initialised (dist.init_process_group first)")
    for i, layer in enumerate(model.model.layers):  # check everything before changing anything
        _split(layer.self_attn.args.num_attention_heads, rank, world, "num_attention_heads")
        mlp = layer.mlp
        if isinstance(mlp, MLP):
            _split(mlp.gate_proj.out_features, rank, world, f"layer {i} intermediate_size")
            continue
        n_exp = mlp.experts.w13_packed.shape[0] if isinstance(mlp.experts, Int4Experts) else len(mlp.experts)
        _split(n_exp, rank, world, f"layer {i} n_routed_experts")
        if mlp.shared_experts is not None:
            _split(mlp.shared_experts.gate_proj.out_features, rank, world,
                   f"layer {i} shared expert intermediate")
    g_world, g_rank = dist.get_world_size(group), dist.get_rank(group)
    if (rank, world) != (g_rank, g_world):
        raise ValueError(f"shard: rank={rank}, world={world} but this process is rank {g_rank} of a group of "
                         f"{g_world}")
    reduce = _all_reduce_hook(group)
    for i, layer in enumerate(model.model.layers):
        _shard_mla(layer.self_attn, rank, world)
        layer.self_attn.o_proj.register_forward_hook(reduce)
        mlp = layer.mlp
        if isinstance(mlp, MLP):
            _shard_mlp(mlp, rank, world, f"layer {i} intermediate_size")
            mlp.down_proj.register_forward_hook(reduce)
            continue
        assert isinstance(mlp, MoE)
        if isinstance(mlp.experts, Int4Experts):  # stacked INT4 experts: keep this rank's block of them
            own = _split(mlp.experts.w13_packed.shape[0], rank, world, f"layer {i} n_routed_experts")
            mlp.experts = mlp.experts.select(int(own[0]), int(own[-1]) + 1)
        else:
            own = set(_split(len(mlp.experts), rank, world, f"layer {i} n_routed_experts").tolist())
            for e in range(len(mlp.experts)):
                if e not in own:
                    mlp.experts[e] = AbsentExpert()
        if mlp.shared_experts is not None:
            _shard_mlp(mlp.shared_experts, rank, world, f"layer {i} shared expert intermediate")
        mlp.register_forward_hook(reduce)
    model.tp = (rank, world)
    model.tp_group = group   # the engine's budget="auto" broadcasts its decisions over it
    return model


# ----------------------------------------------------------------------------- dry-run
DRY_ARGS = dataclasses.replace(TINY_B, num_attention_heads=8)  # 8 heads, 16 experts: divisible up to world 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dry_rank(rank: int, world: int, backend: str, port: int, out: str, new_tokens: int, budget: int,
              int4: bool, auto: bool = False) -> None:
    import json

    from .decode import generate_ar, generate_ddtree
    from .drafter import OracleDrafter, build_drafter
    from .model import build_model
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        args = DRY_ARGS
        ref = build_model(args, seed=1, device=dev)
        model = build_model(args, seed=1, device=dev)
        if int4:  # routed experts in the INT4 release format, sharded as stacked blocks
            ref.quantize_experts()
            model.quantize_experts()
        model = shard(model, rank, world)
        prompt = torch.randint(2, args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            a, b = ref(prompt.to(dev)).logits, model(prompt.to(dev)).logits
        rel = float((a - b).norm() / a.norm())
        p = prompt[0].tolist()
        ar = generate_ar(model, p, new_tokens)
        ar_ref = generate_ar(ref, p, new_tokens)
        # DDTree with the test oracle (it knows the sharded target's greedy future: long accepted paths, so
        # the walk and the cache compaction run across shards) and with a random DFlash drafter (its features
        # come from the sharded target's hidden states)
        oracle = OracleDrafter(p + ar.tokens, args.vocab_size, block_size=6, seed=4)
        dd = generate_ddtree(model, oracle, p, new_tokens, budget=budget)
        dfl = generate_ddtree(model, build_drafter(model, seed=2, block_size=6), p, new_tokens, budget=budget)
        # the engine unchanged on every rank: requests of different lengths batched, the DFlash drafter's
        # batched context, against this rank's own oracle loop
        from .engine import Engine
        from .oracle import oracle_ar
        prompts = [torch.randint(2, args.vocab_size, (n,),
                                 generator=torch.Generator().manual_seed(n)).tolist()
                   for n in (5, 17, 9, 30)]
        eng = Engine(model, build_drafter(model, seed=2, block_size=6), mode="ddtree", budget=budget,
                     max_batch=3, max_len=128)
        batch_ok = [r.tokens for r in eng.generate(prompts, new_tokens)] == [
            oracle_ar(model, q, new_tokens).tokens for q in prompts]
        auto_ok, plans = None, None
        if auto:  # budget="auto": each rank measures its own costs; rank 0's decisions are every rank's
            ea = Engine(model, build_drafter(model, seed=2, block_size=6), mode="ddtree", budget="auto",
                        budgets=(4, budget), max_batch=3, max_len=128)
            auto_ok = [r.tokens for r in ea.generate(prompts, new_tokens)] == [
                oracle_ar(model, q, new_tokens).tokens for q in prompts]
            plans = [h[2] for h in ea.auto.history]
        n_params = sum(p.numel() for p in model.parameters())
        res = {"rank": rank, "world": world, "backend": backend, "logits_rel_err": rel,
               "ddtree_equals_ar": dd.tokens == ar.tokens and dfl.tokens == ar.tokens,
               "engine_batch_equals_oracle": batch_ok, "ar_equals_unsharded": ar.tokens == ar_ref.tokens,
               "tau_oracle": dd.mean_accept_length, "params_on_rank": n_params,
               "params_unsharded": sum(p.numel() for p in ref.parameters()), "int4": int4,
               "auto_equals_oracle": auto_ok, "auto_plans": plans}
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def dryrun(world: int = 8, backend: str = "gloo", new_tokens: int = 12, budget: int = 16,
           int4: bool = False, auto: bool = False) -> list[dict]:
    """Spawn `world` local ranks; each shards a tiny-b-shaped model (8 heads, 16 experts) and reports: the
    relative error of its logits against the unsharded model, whether its DDTree outputs (test-oracle drafter,
    random DFlash drafter) equal its AR output, whether a batch of 4 requests through one engine equals the
    oracle loop's outputs, whether its AR output equals the unsharded model's, the
    oracle's tau and its parameter count; int4: the routed experts in the INT4 release format. Returns one
    dict per rank."""
    import json
    import tempfile

    import torch.multiprocessing as mp
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'gloo' (CPU) or 'nccl' (one GPU per rank)")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r}: expected an int >= 1")
    check_shardable(DRY_ARGS, world)
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"backend='nccl' with world={world}: only {torch.cuda.device_count()} GPUs are "
                         "visible")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ranks.json")
        mp.spawn(_dry_rank, args=(world, backend, _free_port(), out, new_tokens, budget, int4, auto),
                 nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


# ----------------------------------------------------------------------------- all-reduce cost
def _allreduce_rank(rank: int, world: int, backend: str, port: int, out: str, sizes, repeats: int) -> None:
    import json

    from .bench.timer import measure
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        dev = f"cuda:{rank}" if cuda else "cpu"
        rows = []
        for n in sizes:  # bf16 elements
            x = torch.ones(max(1, n // 2), dtype=torch.bfloat16, device=dev)
            t = measure(lambda: dist.all_reduce(x), repeats, "events" if cuda else "wall", warmup=5)
            rows.append({"bytes": int(x.numel() * 2), "median_s": t.median, "min_s": t.min})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def allreduce_cost(world: int, backend: str = "nccl", sizes=(2**10, 2**14, 2**17, 2**20, 2**23),
                   repeats: int = 50) -> dict:
    """Measured all-reduce times of bf16 buffers of `sizes` bytes over `world` local ranks (CUDA events on
    NCCL, host clock on gloo; median of `repeats` after 5 warm-up calls), and the model time = latency +
    bytes / bandwidth that `project.project_multi` takes: latency the smallest buffer's time, bandwidth the
    slope between the smallest and the largest. {"rows", "latency_s", "Bps", "world", "backend"}."""
    import json
    import tempfile

    import torch.multiprocessing as mp
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'gloo' (CPU) or 'nccl' (one GPU per rank)")
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world={world!r}: expected an int >= 2")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"backend='nccl' with world={world}: only {torch.cuda.device_count()} GPUs are "
                         "visible")
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 2:
        raise ValueError(f"sizes={sizes!r}: expected byte counts >= 2")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "allreduce.json")
        mp.spawn(_allreduce_rank, args=(world, backend, _free_port(), out, sizes, repeats), nprocs=world,
                 join=True)
        with open(out) as f:
            rows = json.load(f)
    lo, hi = min(rows, key=lambda r: r["bytes"]), max(rows, key=lambda r: r["bytes"])
    dt = hi["median_s"] - lo["median_s"]
    return {"rows": rows, "latency_s": lo["median_s"],
            "Bps": (hi["bytes"] - lo["bytes"]) / dt if dt > 0 else float("inf"), "world": world,
            "backend": backend}
