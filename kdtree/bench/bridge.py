"""The bridges' benchmark (GPU): the public reference's tree path against kdtree.bridge, in one run.

    run(out_dir, cells=((1, 64), (8, 256), (32, 1024)), V=163840, L=15) -> record, written to bridge.json

Per (batch, budget) cell, draft logits [b, L, V] bf16 in input sets rotated past L2:
  reference_s       bench.baselines.reference_tree_round eager (torch.topk + logsumexp, copy to the host,
  Python heap,
                    numpy visibility, request by request), wall time: its best repeat is the baseline (the
                    host's noise never inflates a ratio), its median is reported beside it
  native_graph_s    bridge.build_trees captured in a CUDA graph, replays timed by events
  native_eager_s    bridge.build_trees eager with its value checks, wall time
  typed_s           bridge.build_ddtree_tree (the reference-typed drop-in: one graph replay with its value
                    scan, the one copy to the host and the child maps built there), wall time; batch 1 only,
                    as the reference calls it; typed_eager_s the same with eager launches (graph=False)
  sglang_graph_s    bridge.build_trees + to_sglang (qlen_only) + sglang_verify_greedy in one graph
Every ratio is to reference_s of the same cell; the targets are checked in `targets`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import bridge, capi, kernels
from .baselines import reference_tree_round
from .clocks import gpu_state
from . import goals
from .goals import target
from .timer import input_sets, measure

# (row key, goal key) of the cells' speedups
TARGETS = (
    ("native_graph", "bridge_native_b1"),
    ("native_graph", "bridge_native_b32"),
    ("typed", "bridge_typed_b1"),
)


def bench_cell(
    b: int, B: int, V: int = 163840, L: int = 15, repeats: int = 50, ref_repeats: int = 7, seed: int = 0
) -> dict:
    set_bytes = b * L * V * 2
    n_sets = input_sets(set_bytes, lo=2)
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + b * 131 + B)
    xs = [(torch.randn(b, L, V, device="cuda", generator=g) * 3).to(torch.bfloat16) for _ in range(n_sets)]
    root = torch.randint(0, V, (b,), device="cuda", dtype=torch.int32, generator=g)
    start = torch.full((b,), 1000, device="cuda", dtype=torch.int32)
    choice = torch.randint(0, V, (b, B + 1), device="cuda", generator=g)

    def each(fn):  # one call per input set, the sets rotated
        return [lambda x=x: fn(x) for x in xs]

    rr, ss = root.cpu().numpy(), start.cpu().numpy()
    ref = measure(each(lambda x: reference_tree_round(x, B, rr, ss)), ref_repeats, "wall")
    row = {
        "batch": b,
        "budget": B,
        "V": V,
        "L": L,
        "logit_bytes": set_bytes,
        "input_sets": n_sets,
        "reference_s": ref.min,
        "reference_median_s": ref.median,
    }
    row["native_graph_s"] = measure(
        each(lambda x: bridge.build_trees(x, B, root, start, check_values=False)), repeats, "graph"
    ).median
    row["native_eager_s"] = measure(
        each(lambda x: bridge.build_trees(x, B, root, start)), max(5, repeats // 5), "wall"
    ).median
    if b == 1:
        row["typed_s"] = measure(each(lambda x: bridge.build_ddtree_tree(x[0], B)), repeats, "wall").median
        row["typed_eager_s"] = measure(
            each(lambda x: bridge.build_ddtree_tree(x[0], B, graph=False)), repeats, "wall"
        ).median

    def sglang_round(x):
        sg = bridge.to_sglang(bridge.build_trees(x, B, root, start, check_values=False))
        bridge.sglang_verify_greedy(sg, choice, L + 1)

    row["sglang_graph_s"] = measure(each(sglang_round), repeats, "graph").median
    for key in ("native_graph", "native_eager", "typed", "typed_eager", "sglang_graph"):
        if f"{key}_s" in row:
            row[f"{key}_speedup"] = row["reference_s"] / row[f"{key}_s"]
    xs.clear()
    torch.cuda.empty_cache()
    return row


def host_cost(calls: int = 400, repeats: int = 7, N: int = 65) -> dict:
    """Host seconds per tree_walk call (batch 1, N rows), calls enqueued behind a ~25 ms GPU spin so that the
    GPU never holds the host back: the CuPy path (kernels.tree_walk) and the C ABI through ctypes (capi), each
    with its Python checks and output allocations; the C ABI's own cost from C is tests/capi/smoke.c's."""
    dev = "cuda"
    tok = torch.randint(0, 1000, (1, N), device=dev, dtype=torch.int32)
    par = torch.arange(-1, N - 1, device=dev, dtype=torch.int32).view(1, N)
    ch = tok.roll(-1, 1).contiguous()

    def per_call(fn) -> float:
        return measure(fn, repeats, "host", calls=calls).median

    out = {
        "calls": calls,
        "repeats": repeats,
        "N": N,
        "cupy_tree_walk_s": per_call(lambda: kernels.tree_walk(tok, par, ch, 64)),
    }
    try:
        capi.library()
    except RuntimeError as e:
        out["capi"] = str(e)
        return out
    out["capi_tree_walk_s"] = per_call(lambda: capi.tree_walk(tok, par, ch, 64))
    return out


def targets(rows: list[dict], rec: dict | None = None) -> list[dict]:
    out = []
    for row_key, key in TARGETS:
        g = goals.goal(key)
        r = next(
            (
                r
                for r in rows
                if r["batch"] == g["batch"] and r["budget"] == g["budget"] and f"{row_key}_speedup" in r
            ),
            None,
        )
        out.append(target(key, None if r is None else r[f"{row_key}_speedup"]))
    rec = rec or {}
    smoke, hc = rec.get("capi_smoke"), rec.get("host_cost", {})
    if smoke:
        out.append(target("capi_host_us", smoke["tree_walk_beyond_launch_s"] * 1e6))
    if "capi_tree_walk_s" in hc:
        out.append(target("capi_over_cupy", hc["capi_tree_walk_s"] / hc["cupy_tree_walk_s"]))
    return out


def run(
    out_dir,
    cells=((1, 64), (8, 256), (32, 1024)),
    V: int = 163840,
    L: int = 15,
    repeats: int = 50,
    progress: bool = True,
) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("the bridge benchmark needs a CUDA GPU")
    it = list(cells)
    if progress:
        from ..progress import tqdm

        it = tqdm(it, desc="bridge cells")
    st = gpu_state()
    rows = [bench_cell(b, B, V, L, repeats) for b, B in it]
    rec = {"device": torch.cuda.get_device_name(), "gpu_state": st, "rows": rows, "host_cost": host_cost()}
    smoke = Path(out_dir) / "capi_smoke.json"  # tests/capi/smoke.c's timings, where a run left them
    if smoke.is_file():
        rec["capi_smoke"] = json.loads(smoke.read_text())
    rec["targets"] = targets(rows, rec)
    path = Path(out_dir) / "bridge.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    return rec


def summary(rec: dict) -> str:
    lines = [f"bridges on {rec['device']} (ms; ratios to the reference path's best repeat)"]
    for r in rec["rows"]:
        typed = f"  typed {r['typed_s'] * 1e3:.3f} ({r['typed_speedup']:.1f}x)" if "typed_s" in r else ""
        lines.append(
            f"b {r['batch']:>3} B {r['budget']:>5}: reference {r['reference_s'] * 1e3:.3f} "
            f"(median {r['reference_median_s'] * 1e3:.3f})  "
            f"native graph {r['native_graph_s'] * 1e3:.3f} "
            f"({r['native_graph_speedup']:.1f}x)  eager {r['native_eager_s'] * 1e3:.3f}{typed}  "
            f"sglang round {r['sglang_graph_s'] * 1e3:.3f}"
        )
    hc = rec.get("host_cost", {})
    if hc:
        lines.append(
            "host per tree_walk call: CuPy path "
            + f"{hc['cupy_tree_walk_s'] * 1e6:.1f} us"
            + (
                f", C ABI via ctypes {hc['capi_tree_walk_s'] * 1e6:.1f} us"
                if "capi_tree_walk_s" in hc
                else ""
            )
        )
    lines += [goals.line(t) for t in rec["targets"]]
    return "\n".join(lines)
