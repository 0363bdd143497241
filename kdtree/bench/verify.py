"""Verify-attention benchmarks: verify_attn (the default kernel and the others on the same inputs) against
naive torch attention (bench.baselines.naive_verify) over context x tree nodes x batch, the kernels with parts
of their work compiled out (VERIFY_ABLATIONS), and a shared-memory traffic model of one tile."""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import golden, kernels
from .baselines import naive_verify
from .timer import input_sets, measure

ATTN_QUEUE_CYCLES = 2_000_000  # GPU spin (~1 ms) before a timed call: longer than the call's host side


def _attn_inputs(ctx: int, N: int, b: int, H: int):
    """verify_attn inputs of a context ctx plus N appended DDTree nodes per request: cache sets rotated past
    L2, an identity page table (page size 64), queries, seq_len, the tree's mask (bool and packed)."""
    S = ctx + N
    pages = math.ceil(S / 64)
    cache_bytes = b * pages * 64 * 576 * 2
    n_sets = input_sets(cache_bytes, hi=8)
    caches = [
        (torch.randn(b * pages * 64, 576, device="cuda") * 0.5).to(torch.bfloat16) for _ in range(n_sets)
    ]
    pt = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
    q = (torch.randn(b, N, H, 576, device="cuda") * 0.5).to(torch.bfloat16)
    seq = torch.full((b,), S, device="cuda", dtype=torch.int32)
    rng = np.random.default_rng(N)
    if N > 1:
        t = golden.ddtree(rng.standard_normal((15, 64)).astype(np.float32) * 2, N - 1)
        m = golden.compile_tree(t, 0, 0).mask
    else:
        m = np.ones((1, 1), bool)
    mask = torch.from_numpy(m).cuda()[None].expand(b, N, N).contiguous()
    return caches, pt, q, seq, mask, kernels.pack_mask(mask)


def bench_attn(
    contexts=(4096, 32768), nodes=(1, 16, 64, 256), batches=(1, 8), H=64, repeats=30, progress=True
) -> list[dict]:
    rows = []
    it = [(c, n, b) for c in contexts for n in nodes for b in batches]
    if progress:
        from ..progress import tqdm

        it = tqdm(it, desc="verify_attn")
    for ctx, N, b in it:
        S = ctx + N
        pages = math.ceil(S / 64)
        caches, pt, q, seq, mask, words = _attn_inputs(ctx, N, b, H)
        scale = 0.1447

        def run(impl):  # one call per cache set, the sets rotated
            return [
                lambda c=c: kernels.verify_attn(q, c, pt, seq, words, scale, check_values=False, impl=impl)
                for c in caches
            ]

        impl = kernels.default_verify_impl()
        t_k = measure(run(impl), repeats, queued=True, queue_cycles=ATTN_QUEUE_CYCLES).median
        flops = 2.0 * b * N * H * S * (576 + 512)
        bytes_ = b * S * 576 * 2 + q.numel() * 2 + b * N * H * 512 * 2
        row = {
            "context": ctx,
            "nodes": N,
            "batch": b,
            "heads": H,
            "impl": impl,
            "kernel_s": t_k,
            "flops": flops,
            "bytes": bytes_,
            "n_splits": kernels.default_splits(
                b, N * H, pages * 64, kernels._sm_count(q.device), kernels._VERIFY_KERNELS[impl][2]
            ),
        }
        for other in kernels.available_verify_impls():  # the other kernels, same inputs, same run
            if other != impl:
                row[f"{other}_s"] = measure(
                    run(other), repeats, queued=True, queue_cycles=ATTN_QUEUE_CYCLES
                ).median
                row[f"speedup_vs_{other}"] = row[f"{other}_s"] / t_k
        naive_bytes = b * N * H * S * (2 + 4 + 4 + 2)
        if naive_bytes < 40e9:
            kvs = [c.view(b, pages * 64, 576)[:, :S] for c in caches]
            full = torch.ones(b, N, S, dtype=torch.bool, device="cuda")
            full[:, :, ctx:] = mask
            full = full[:, :, None, :].expand(b, N, H, S).reshape(b, N * H, S)
            qq = q.view(b, N * H, 576)
            row["naive_s"] = measure(
                [lambda kv=kv: naive_verify(qq, kv, full, scale) for kv in kvs],
                max(5, repeats // 3),
                queued=True,
                queue_cycles=ATTN_QUEUE_CYCLES,
            ).median
            row["speedup_vs_naive"] = row["naive_s"] / t_k
            del full
        rows.append(row)
        caches = None  # free the sets before the next cell allocates its own
        torch.cuda.empty_cache()
    return rows


# verify_attn.cu's KDTREE_ABLATE_* switches (timing only; kernels.compile_defines), each removing one part
# of a tile's work from the wgmma kernels (verify_attn_wg, verify_attn_ws): where the time goes. Outputs are
# wrong.
VERIFY_ABLATIONS = {
    "full": {},
    "S: 4 of 36 k-steps": {"KDTREE_ABLATE_S_STEPS": 4},
    "no P V": {"KDTREE_ABLATE_NO_PV": 1},
    "no exp2 (P = s - m)": {"KDTREE_ABLATE_NO_EXP": 1},
    "no cp.async (K/V, Q)": {"KDTREE_ABLATE_NO_LOADS": 1},
    "no S, no P V": {"KDTREE_ABLATE_S_STEPS": 0, "KDTREE_ABLATE_NO_PV": 1},
    "no S, P V, cp.async": {
        "KDTREE_ABLATE_S_STEPS": 0,
        "KDTREE_ABLATE_NO_PV": 1,
        "KDTREE_ABLATE_NO_LOADS": 1,
    },
}


def bench_verify_ablation(
    shapes=((32768, 64, 1), (32768, 1, 8)), impls=("wgmma", "ws"), H=64, repeats=20, progress=True
) -> list[dict]:
    """verify_attn's wgmma kernels with parts of their work removed (VERIFY_ABLATIONS, compiled through
    kernels.compile_defines): one row per (ablation, impl, shape) with the GPU time of the call (partial +
    combine). Hopper only. The difference to 'full' is what that part costs on the critical path."""
    if not kernels._sm90():
        raise RuntimeError("bench_verify_ablation: the wgmma kernels need a compute capability 9.0 GPU")
    inputs = {sh: _attn_inputs(*sh, H) for sh in shapes}
    rows = []
    it = [(name, defines, impl) for name, defines in VERIFY_ABLATIONS.items() for impl in impls]
    if progress:
        from ..progress import tqdm

        it = tqdm(it, desc="verify ablation")
    for name, defines, impl in it:
        with kernels.compile_defines("verify_attn", defines):
            for (ctx, N, b), (caches, pt, q, seq, _, words) in inputs.items():
                calls = [
                    lambda c=c: kernels.verify_attn(
                        q, c, pt, seq, words, 0.1447, check_values=False, impl=impl
                    )
                    for c in caches
                ]
                t = measure(calls, repeats, queued=True, queue_cycles=ATTN_QUEUE_CYCLES).median
                S = ctx + N
                rows.append(
                    {
                        "ablation": name,
                        "impl": impl,
                        "context": ctx,
                        "nodes": N,
                        "batch": b,
                        "heads": H,
                        "kernel_s": t,
                        "flops": 2.0 * b * N * H * S * (576 + 512),
                        "bytes": b * S * 576 * 2 + q.numel() * 2 + b * N * H * 512 * 2,
                    }
                )
    del inputs
    torch.cuda.empty_cache()
    return rows


def verify_smem_model() -> dict:
    """Shared-memory traffic of one 64-key tile of verify_attn_wg against its tensor work (64 query rows, head
    dims 576 / 512, bf16): S = Q K^T on m64n32k16 re-reads the [64 x 576] Q tile for each warpgroup's 32
    keys."""
    q_tile, kv_tile = 64 * 576 * 2, 64 * 576 * 2
    s_reads = 2 * 36 * (64 * 16 * 2 + 32 * 16 * 2)  # 2 warpgroups x 36 k-steps x (A + B) per wgmma
    pv_reads = 2 * 4 * (64 * 16 * 2 + 16 * 256 * 2)  # 2 warpgroups x 4 k-steps x (P + V half)
    writes = kv_tile + 64 * 64 * 2  # cp.async of K/V, P's stores
    total = s_reads + pv_reads + writes
    macs = 64 * 64 * (576 + 512)
    return {
        "q_tile_bytes": q_tile,
        "s_read_bytes": s_reads,
        "pv_read_bytes": pv_reads,
        "write_bytes": writes,
        "total_bytes": total,
        "smem_clocks_at_128B": total / 128,
        "macs": macs,
        "tensor_clocks_at_2048_mac": macs / 2048,
    }
