"""The drafter's attention over the engine's preallocated context, per implementation
(`DraftAttention.forward_buffered`'s impl: "math" | "sdpa" | "kernel"): one layer's drafting pass at a
drafter shape, batch and context capacity C, graph replays; "math" and "sdpa" attend every column up to C
(masked past each request's length), "kernel" (where it applies: bf16, head_dim 128) only the live ones, as
inside the engine's captured round.

    python -m kdtree.bench.drafter --out outputs/h200
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..drafter import DraftAttention, DrafterArgs, draft_attn_auto, draft_attn_kernel_fits
from .timer import input_sets, measure

TRAINED = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, block_size=16)
K25 = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=8, head_dim=128, block_size=8)
# (name, drafter dims, dtype, batches, context capacities)
SHAPES = (
    ("trained pair", TRAINED, torch.float32, (1, 8, 32), (512, 2048)),
    ("trained pair", TRAINED, torch.bfloat16, (1, 8, 32), (512, 2048)),
    ("Kimi-K2.5-DFlash", K25, torch.bfloat16, (1, 8), (4096, 32768)),
)


def cell(dims: dict, batch: int, C: int, dtype=torch.bfloat16, device="cuda", repeats: int = 50,
         seed: int = 0) -> dict:
    """Seconds per pass (graph replay median and min) of one layer's forward_buffered in each impl (kernel
    where it applies), the outputs' relative differences to math (float64 norms: rel_diff sdpa's,
    kernel_rel_diff the kernel's), at batch x block rows over C + block columns; requests' lengths spread
    over [C / 2, C]; which impl "auto" takes there."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = DrafterArgs(**dims)
    at = DraftAttention(a).to(device=device, dtype=dtype)
    T, Hk, hd = a.block_size, a.num_key_value_heads, a.head_dim
    cols = C + T
    kv_bytes = 2 * batch * Hk * cols * hd * torch.empty(0, dtype=dtype).element_size()
    sets = []
    for _ in range(input_sets(kv_bytes, hi=4)):
        x = torch.randn(batch, T, a.hidden_size, generator=g).to(device, dtype)
        k = torch.randn(batch, Hk, cols, hd, generator=g).to(device, dtype)
        v = torch.randn(batch, Hk, cols, hd, generator=g).to(device, dtype)
        n = torch.randint(C // 2, C + 1, (batch,), generator=g).to(device)
        pos = n[:, None] + torch.arange(T, device=device)
        ang = pos[..., None].float() * torch.rand(hd // 2, generator=g).to(device)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)                       # [batch, T, hd / 2]
        sets.append((x, cos, sin, k, v, n))
    G = a.num_attention_heads // Hk
    res = dict(batch=batch, context=C, rows=batch * T, dtype=str(dtype).removeprefix("torch."),
               auto=draft_attn_auto(device, dtype, batch, Hk, G * T, hd))
    impls = ("math", "sdpa") + (("kernel",) if draft_attn_kernel_fits(device, dtype, hd, G * T) else ())
    out = {}
    with torch.no_grad():
        for impl in impls:
            fns = [lambda s=s, impl=impl: at.forward_buffered(*s, C, impl) for s in sets]
            t = measure(fns, repeats, "graph", warm_s=0.3)   # clocks up before the timed replays
            res[impl] = {"median_s": t.median, "min_s": t.min}
            out[impl] = fns[0]().double()
    res["rel_diff"] = float((out["math"] - out["sdpa"]).norm() / out["sdpa"].norm())
    res["sdpa_over_math"] = res["sdpa"]["median_s"] / res["math"]["median_s"]
    if "kernel" in out:
        res["kernel_rel_diff"] = float((out["kernel"] - out["math"]).norm() / out["math"].norm())
        res["kernel_over_math"] = res["kernel"]["median_s"] / res["math"]["median_s"]
    return res


def run(out_dir=None, shapes=SHAPES, repeats: int = 50) -> dict:
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cells": []}
    for name, dims, dtype, batches, ctxs in shapes:
        for b in batches:
            for C in ctxs:
                r = dict(cell(dims, b, C, dtype, repeats=repeats), drafter=name, **dims)
                rec["cells"].append(r)
                print(f"{name:17s} {r['dtype']:9s} b{b:<3d} C{C:<6d} auto -> {r['auto']:4s}  "
                      f"math {1e6 * r['math']['median_s']:8.1f} us  "
                      f"sdpa {1e6 * r['sdpa']['median_s']:8.1f} us  sdpa/math {r['sdpa_over_math']:.2f}  "
                      + (f"kernel {1e6 * r['kernel']['median_s']:8.1f} us  " if "kernel" in r else "")
                      + f"rel diff {r['rel_diff']:.1e}", flush=True)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "bench_drafter.json").write_text(json.dumps(rec, indent=1))
    return rec


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.drafter", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for bench_drafter.json")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m kdtree.bench.drafter: needs a CUDA device (graph replays)")
    if args.out is not None:
        from ..lab import record_dir_or_exit
        record_dir_or_exit(args.out, "cuda", "python -m kdtree.bench.drafter")
    run(args.out, repeats=args.repeats)


if __name__ == "__main__":
    main()
