"""The routed experts at a config's shape, with the bytes floor: the moe_int4 kernel against the
dequantize-then-grouped-matmul baseline and against experts held in bf16 (`bench_moe`, notebook 01), its pass
sizes under both routings (`bench_moe_tiles`), and the bf16 experts' moe_bf16 against the torch path's grouped
GEMMs (`bench_moe_bf16`). `python -m kdtree.bench.moe [--tiles] [--bf16] [--out DIR]` writes the last two to
DIR/bench_moe.json (GPU only)."""
from __future__ import annotations

import argparse
import json
import math

import torch

from ..config import load_config
from ..model import Gate, Int4Experts
from ..moe import grouped_experts
from .baselines import dequant_bf16, moe_bf16_baseline
from .clocks import gpu_state, settle_gpu
from .timer import measure, mode_for

ROUTINGS = ("uniform", "concentrated")
CONCENTRATED_NOISE = 0.1   # "concentrated": rows c + 0.1 n share c's direction, so the router picks alike

# Seconds of untimed replays before each kernel timing: the first timing right after the process freed
# memory, or right after a burst of back-to-back replays capped the clock, reads high.
MOE_WARM_S = 0.5


def bench_moe(
    config: str = "kimi-k2.6",
    tokens=(1, 8, 16, 64, 128, 256, 512, 1024),
    device: str = "cuda",
    repeats: int = 20,
    bandwidth: float | None = None,
    progress: bool = True,
    seed: int = 0,
) -> list[dict]:
    """Routed INT4 experts at the config's shape (hidden, moe_intermediate, experts, top-k), routing from a
    random router (the model's Gate): the moe_int4 kernel on a GPU, pair grouping included, timed as
    CUDA-graph replays (the dequantizing reference path on a CPU) vs moe_bf16_baseline (eager: it syncs) both
    as the lab's goal defines it (dequantize, then grouped matmul) and with the experts already held in bf16,
    and the floor (bytes of the distinct experts touched over `bandwidth`). On a GPU each kernel timing
    follows MOE_WARM_S of untimed replays, and it and both baselines start once any power or thermal cap has
    lifted (settle_gpu; the row keeps the seconds waited, settle_s, and gpu_state read right after the
    kernel's timing)."""
    args = load_config(config)
    D, I, E = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
    dt = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    sets, bf16 = _expert_sets(E, D, I, device, seed)
    gate, g = _random_gate(args, device, seed)
    mode = mode_for(device)
    expert_bytes = 3 * I * D // 2 + 3 * I * D // 32 * 2  # packed words + bf16 scales of one expert
    rows = []
    it = tokens
    if progress:
        from ..progress import tqdm

        it = tqdm(tokens, desc="moe_int4")
    for T in it:
        x = torch.randn(T, D, device=device, generator=g).to(dt)   # [T, D]
        with torch.no_grad():
            w, ids = gate(x.float())                                  # [T, top_k] each
        ids = ids.to(torch.int32)
        touched = int(torch.unique(ids).numel())
        t_k, t_b, t_bf, state, settled = _time_tokens(x, w, ids, sets, bf16, device, repeats, mode)
        row = {
            "tokens": T,
            "experts_touched": touched,
            "kernel_s": t_k,
            "baseline_s": t_b,
            "speedup_vs_baseline": t_b / t_k,
            "bf16_experts_s": t_bf,
            "speedup_vs_bf16_experts": t_bf / t_k,
            "bytes": touched * expert_bytes,
            "device": str(device),
            "gpu_state": state,
            "settle_s": settled,
        }
        if bandwidth:
            row["floor_s"] = row["bytes"] / bandwidth
            row["frac_bandwidth"] = row["floor_s"] / t_k
        rows.append(row)
    return rows


def _expert_sets(E: int, D: int, I: int, device, seed: int):
    """(sets, bf16): random Int4Experts of E experts [D -> I -> D] (seeds seed, seed + 1, ...; two sets on
    a GPU, rotated past L2 (a set is E * 3 * I * D / 2 bytes), one on a CPU) and the first set's weights
    dequantized to bf16 (w13, w2): the stronger baseline, the same experts held at 2 bytes a weight, not
    0.5."""
    n_sets = 2 if str(device).startswith("cuda") else 1
    sets = [Int4Experts.random(E, D, I, device=device, seed=seed + i) for i in range(n_sets)]
    with torch.no_grad():
        bf16 = (
            dequant_bf16(sets[0].w13_packed, sets[0].w13_scale),
            dequant_bf16(sets[0].w2_packed, sets[0].w2_scale),
        )
    return sets, bf16


def _random_gate(args, device, seed: int):
    """(gate, g): the model's Gate for `args` on `device` with random weights (std 1/sqrt(hidden)) and
    score correction bias (std 0.01), drawn from g, a generator seeded with `seed` that the caller draws on
    after."""
    gate = Gate(args).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        gate.weight.normal_(0, 1 / math.sqrt(args.hidden_size), generator=g)
        gate.e_score_correction_bias.normal_(0, 0.01, generator=g)
    return gate, g


def _time_tokens(x, w, ids, sets, bf16, device, repeats: int, mode: str):
    """One token count's timings of `bench_moe`: (kernel_s, baseline_s, bf16_experts_s, gpu_state, settle_s).
    x [T, D], w / ids [T, top_k] the routing. The kernel over `sets` in turn (graph replays after MOE_WARM_S
    when mode is "events", gpu_state read right after; `mode` otherwise), then moe_bf16_baseline over the sets
    and over the bf16 experts (eager, max(3, repeats // 4) calls each), each part once settle_gpu returns;
    settle_s sums its waits."""
    kern = [lambda s=s: s(x, w, ids) for s in sets]
    base = [lambda s=s: moe_bf16_baseline(x.to(torch.bfloat16), ids, w, s) for s in sets]
    state, settled = None, 0.0
    with torch.no_grad():
        if mode == "events":  # GPU time of the whole call: graph replays
            waits = []
            t_k = measure(
                kern, repeats, "graph", warm_s=MOE_WARM_S, before=lambda: waits.append(settle_gpu(device))
            ).median
            settled = waits[0]
            state = gpu_state(device)  # read right after the timing (the clock, any cap then active)
        else:
            t_k = measure(kern, repeats, mode).median
        settled += settle_gpu(device)  # the baselines start from the same state (no-op on a CPU)
        t_b = measure(base, max(3, repeats // 4), mode).median  # torch.unique syncs: eager
        settled += settle_gpu(device)
        t_bf = measure(
            lambda: moe_bf16_baseline(x.to(torch.bfloat16), ids, w, sets[0], bf16),
            max(3, repeats // 4),
            mode,
        ).median
    return t_k, t_b, t_bf, state, settled


def bench_moe_bf16(config: str = "data/configs/mid.json", tokens=(1, 4, 16, 64), repeats: int = 30,
                   bandwidth: float | None = None, seed: int = 0) -> list[dict]:
    """Routed bf16 experts at the config's shape, routing from a random router (the model's Gate):
    ops.moe_bf16 (pair grouping included) against the torch path's grouped GEMMs (`moe.grouped_experts`),
    both as CUDA-graph replays over weight sets rotated past L2, outputs compared first. Per token count
    {tokens, pairs, experts_touched, moe_bf16_s, grouped_s, speedup, floor_s (the touched experts' bytes over
    `bandwidth`, default the copy rate measured here), moe_bf16_floor_fraction, rel_diff}. Token counts past
    ops.moe_bf16.MAX_PAIRS pairs are left out. GPU only."""
    from ..ops import moe_bf16 as mbf
    from .ceilings import copy_bandwidth
    from .timer import input_sets
    if not torch.cuda.is_available():
        raise RuntimeError("bench_moe_bf16 needs a CUDA GPU")
    args = load_config(config)
    D, I, E, k = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, args.num_experts_per_tok
    bw = bandwidth or copy_bandwidth()["bytes_per_s"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_set = E * 3 * I * D * 2
    sets = [((torch.randn(E, 2 * I, D, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16),
             (torch.randn(E, D, I, device="cuda", generator=g) / I ** 0.5).to(torch.bfloat16))
            for _ in range(input_sets(per_set, hi=4))]
    gate, gg = _random_gate(args, "cuda", seed + 1)
    rows = []
    for T in tokens:
        if T * k > mbf.MAX_PAIRS:
            continue
        x = torch.randn(T, D, device="cuda", generator=gg).to(torch.bfloat16)
        with torch.no_grad():
            w, ids = gate(x.float())
        w = w.float().contiguous()
        ours = [lambda s=s: mbf.moe_bf16(x, ids, w, *s, check_values=False) for s in sets]
        base = [lambda s=s: grouped_experts(x, w, ids, *s) for s in sets]
        ref = base[0]().float()
        rel = float((ours[0]() - ref).norm() / ref.norm())
        t_o = measure(ours, repeats, "graph", warm_s=MOE_WARM_S).median
        t_b = measure(base, repeats, "graph", warm_s=MOE_WARM_S).median
        touched = int(ids.unique().numel())
        floor = touched * 3 * I * D * 2 / bw
        rows.append({"tokens": T, "pairs": T * k, "experts_touched": touched, "moe_bf16_s": t_o,
                     "grouped_s": t_b, "speedup": t_b / t_o, "floor_s": floor,
                     "moe_bf16_floor_fraction": floor / t_o, "rel_diff": rel})
    return rows


def moe_routing(args, T: int, routing: str, device="cuda", seed: int = 0):
    """(x bf16 [T, D], w fp32 [T, k], ids int32 [T, k]): random rows and their routing by the model's router
    with random weights (bench.moe._random_gate): "uniform" through kdtree.k26.HashedGate (every row its own
    experts), "concentrated" over rows c + CONCENTRATED_NOISE n sharing one random direction c (the router
    picks nearly the same experts for all)."""
    from ..k26 import HashedGate
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: expected one of {ROUTINGS}")
    gate, g = _random_gate(args, device, seed)
    x = torch.randn(T, args.hidden_size, device=device, generator=g)
    if routing == "uniform":
        gate.__class__ = HashedGate   # the same parameters, hashed scores
    else:
        x = torch.randn(1, args.hidden_size, device=device, generator=g) + CONCENTRATED_NOISE * x
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        w, ids = gate(x.float())
    return x, w.float().contiguous(), ids.to(torch.int32).contiguous()


def bench_moe_tiles(config: str = "kimi-k2.6", tokens=(1, 9, 17, 33, 65, 129), routings=ROUTINGS,
                    tiles=(8, 16, 32), repeats: int = 30, bandwidth: float | None = None,
                    matmul: float | None = None, seed: int = 0) -> list[dict]:
    """moe_int4's grouped path per pass size (`tile_tokens`) at the config's shape, both routings
    (`moe_routing`), as CUDA-graph replays over two expert sets (rotated past L2), each output checked against
    tile 8's first: per (tokens, routing) {tokens, routing, experts_touched, max_pairs (the most pairs one
    expert holds), tile_s {tile: s} (one pass a work item: the default), serial_s {tile: s} (each expert's
    passes in order in one block: item_pairs = T k), best_tile, floor_s (the touched experts' bytes over
    `bandwidth`, default the copy rate measured here), fraction {tile: floor_s / s}, mma_floor_s (the pairs'
    3 I D multiply-adds at `matmul` FLOP/s, default torch.matmul's bf16 rate measured here), rel_diff
    {tile}}. GPU only."""
    from .ceilings import copy_bandwidth, matmul_rate
    if not torch.cuda.is_available():
        raise RuntimeError("bench_moe_tiles needs a CUDA GPU")
    args = load_config(config)
    D, I, E = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
    bw = bandwidth or copy_bandwidth()["bytes_per_s"]
    mm = matmul or matmul_rate()
    from .. import kernels
    sets = [Int4Experts.random_kernel_only(E, D, I, device="cuda", seed=seed + i).kernel_weights()
            for i in range(2)]
    per_expert = 3 * I * D // 2 + 3 * I * D // 32 * 2            # int4 words and bf16 scales
    rows = []
    for routing in routings:
        for T in tokens:
            x, w, ids = moe_routing(args, T, routing, "cuda", seed + T)
            counts = torch.bincount(ids.flatten().long(), minlength=E)
            row = {"tokens": T, "routing": routing, "experts_touched": int((counts > 0).sum()),
                   "max_pairs": int(counts.max()), "tile_s": {}, "serial_s": {}, "fraction": {},
                   "rel_diff": {}}
            row["floor_s"] = row["experts_touched"] * per_expert / bw
            row["mma_floor_s"] = 2 * 3 * I * D * ids.numel() / mm
            ref = None
            for tile in tiles:
                for key, item in (("tile_s", None), ("serial_s", ids.numel())):
                    calls = [lambda s=s, t=tile, n=item: kernels.moe_int4(
                        x, ids, w, s, check_values=False, tile_tokens=t, fused=False, item_pairs=n)
                        for s in sets]
                    out = calls[0]()
                    ref = out if ref is None else ref
                    diff = float((out - ref).norm() / ref.norm())
                    row["rel_diff"][tile] = max(row["rel_diff"].get(tile, 0.0), diff)
                    row[key][tile] = measure(calls, repeats, "graph", warm_s=MOE_WARM_S).median
                row["fraction"][tile] = row["floor_s"] / row["tile_s"][tile]
            row["best_tile"] = min(row["tile_s"], key=row["tile_s"].get)
            rows.append(row)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.moe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="record folder (default: outputs/<gpu>/)")
    ap.add_argument("--tiles", action="store_true", help="moe_int4 per pass size (bench_moe_tiles)")
    ap.add_argument("--bf16", action="store_true", help="moe_bf16 against the grouped GEMMs (bench_moe_bf16)")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    if not (a.tiles or a.bf16):
        ap.error("nothing to run: pass --tiles, --bf16 or both")
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: expected a positive int")
    if not torch.cuda.is_available():
        raise SystemExit("python -m kdtree.bench.moe needs a CUDA GPU: none is visible on this machine")
    from ..lab import output_dir, record_dir_or_exit
    out = record_dir_or_exit(a.out, "cuda", "python -m kdtree.bench.moe") if a.out else output_dir("cuda")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_moe.json"
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if a.tiles:
        rec["tiles"] = bench_moe_tiles(repeats=a.repeats)
        path.write_text(json.dumps(rec, indent=1) + "\n")
        for r in rec["tiles"]:
            print(f"{r['routing']:12s} T={r['tokens']:4d} max pairs {r['max_pairs']:4d}: " + "  ".join(
                f"t{t} {s * 1e6:7.1f} us ({r['fraction'][t]:.2f}; serial {r['serial_s'][t] * 1e6:7.1f})"
                for t, s in r["tile_s"].items()) + f"  floor {r['floor_s'] * 1e6:.1f} / mma "
                f"{r['mma_floor_s'] * 1e6:.1f} us")
    if a.bf16:
        rec["bf16"] = bench_moe_bf16(repeats=a.repeats)
        path.write_text(json.dumps(rec, indent=1) + "\n")
        for r in rec["bf16"]:
            print(f"bf16 T={r['tokens']:3d}: moe_bf16 {r['moe_bf16_s'] * 1e6:7.1f} us, grouped "
                  f"{r['grouped_s'] * 1e6:7.1f} us ({r['speedup']:.2f}x), floor fraction "
                  f"{r['moe_bf16_floor_fraction']:.2f}, rel diff {r['rel_diff']:.1e}")
    print(path)
    return rec


if __name__ == "__main__":
    main()
