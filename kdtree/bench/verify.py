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


SPLIT_SHAPES = ((1024, 1, 1), (4096, 1, 1), (8192, 1, 1), (4096, 8, 1), (4096, 16, 1), (4096, 1, 8),
                (32768, 1, 1))   # (context, nodes, batch): decode and short verify blocks
SPLIT_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def bench_splits(shapes=SPLIT_SHAPES, counts=SPLIT_COUNTS, impls=None, H=64, repeats=30,
                 progress=True) -> list[dict]:
    """verify_attn (partial kernel + combine, as the decode path launches it) timed as CUDA-graph replays over
    n_splits, per impl and (context, nodes, batch): one row per (shape, impl, n_splits) with kernel_s, and
    `default_splits`'s choice for the live context and for a 32K capacity (the engine sizes the splits for
    its cache capacity; the kernel spreads the live keys over them)."""
    impls = tuple(impls or kernels.available_verify_impls())
    rows = []
    it = [(sh, impl) for sh in shapes for impl in impls]
    if progress:
        from ..progress import tqdm

        it = tqdm(it, desc="verify_attn splits")
    last = None
    for (ctx, N, b), impl in it:
        if last != (ctx, N, b):
            inputs = _attn_inputs(ctx, N, b, H)
            last = (ctx, N, b)
        caches, pt, q, seq, _, words = inputs
        S = ctx + N
        tile = kernels._VERIFY_KERNELS[impl][2]
        sms = kernels._sm_count(q.device)
        for s in counts:
            calls = [lambda c=c, s=s: kernels.verify_attn(q, c, pt, seq, words, 0.1447, n_splits=s,
                                                          check_values=False, impl=impl) for c in caches]
            t = measure(calls, repeats, "graph").median
            rows.append({"context": ctx, "nodes": N, "batch": b, "heads": H, "impl": impl, "n_splits": s,
                         "kernel_s": t, "bytes": b * S * 576 * 2,
                         "default_live": kernels.default_splits(b, N * H, S, sms, tile),
                         "default_32k": kernels.default_splits(b, N * H, max(S, 32768), sms, tile)})
    inputs = None
    torch.cuda.empty_cache()
    return rows


def format_splits(rows: list[dict]) -> str:
    """One line per (shape, impl): the best n_splits and its time, the defaults' times, microseconds."""
    head = f"{'ctx':>6}{'N':>4}{'b':>3} {'impl':<6}{'best':>5}{'us':>8}"
    out = [head + f"{'live':>6}{'us':>8}{'32K':>5}{'us':>8}"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["context"], r["nodes"], r["batch"], r["impl"]), []).append(r)
    for (ctx, N, b, impl), rs in groups.items():
        by = {r["n_splits"]: r["kernel_s"] * 1e6 for r in rs}
        best = min(by, key=by.get)
        dl, d32 = rs[0]["default_live"], rs[0]["default_32k"]
        f = lambda s: f"{by[s]:8.1f}" if s in by else f"{'-':>8}"  # noqa: E731
        out.append(f"{ctx:>6}{N:>4}{b:>3} {impl:<6}{best:>5}{by[best]:8.1f}{dl:>6}{f(dl)}{d32:>5}{f(d32)}")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    """python -m kdtree.bench.verify --splits [--out F.json]: the n_splits sweep (bench_splits)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.verify", description=main.__doc__)
    ap.add_argument("--splits", action="store_true", required=True, help="sweep verify_attn's n_splits")
    ap.add_argument("--repeats", type=int, default=30, help="graph replays a cell (median)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: expected a positive int")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = bench_splits(repeats=a.repeats)
    print(format_splits(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
