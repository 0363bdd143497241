"""K2.6 on several GPUs: the scale-up plan's figures, from the model's own code and the lab's records.

    python -m kdtree.scaleup [--world 8] [--out docs/scale_up_k2.6.md]

writes docs/scale_up_k2.6.md; tests/test_scaleup.py checks that the committed page equals what this module
computes from the committed records (so every figure there is the records' and the code's). Sizes come from
the model built on the meta device (no memory), under kdtree.tp's layout: attention heads, the dense MLP and
the shared expert split over the ranks, routed experts in contiguous blocks (expert parallelism), the latent
projections, norms, router, embeddings, lm_head and the drafter replicated, two all-reduces a layer.
"""
from __future__ import annotations

import argparse
import functools
import json
import textwrap
from pathlib import Path

import torch
from torch import nn

from . import k26, project
from .config import load_config
from .drafter import DFlashDrafter
from .model import MoE, Transformer

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "outputs" / "h200"
INT4_BYTES_PER_WEIGHT = 0.5 + 2 / 32   # packed nibbles + one bf16 scale per 32 inputs
CONTEXTS = (4096, 32768, 131072)
TREES = (0, 16, 64, 256, 1024)       # draft nodes per request (0: AR)
BATCHES = (1, 8, 32)

_SPLIT = ("q_b_proj", "q_proj", "kv_b_proj", "o_proj")  # MLA weights split by heads (tp._shard_mla)


@functools.cache
def weights(config: str = "kimi-k2.6", world: int = 8) -> dict:
    """Bytes of each kind of weight, in all and on one rank of `world`."""
    a = load_config(config)
    with torch.device("meta"):
        m = Transformer(a, attn_impl="absorb")
        d = DFlashDrafter(k26.drafter_args(a))
    moe = [i for i, layer in enumerate(m.model.layers) if isinstance(layer.mlp, MoE)]
    for i in moe:
        m.model.layers[i].mlp.experts = nn.Module()   # counted analytically below (INT4)
    kinds = {"attention, split by heads": 0, "attention latents and norms": 0, "dense MLP (layer 0)": 0,
             "shared experts": 0, "routers": 0, "embeddings and lm_head": 0}
    split = {"attention, split by heads", "dense MLP (layer 0)", "shared experts"}
    for name, p in m.named_parameters():
        n = p.numel() * 2  # bf16
        if ".self_attn." in name:
            kinds["attention, split by heads" if any(f".{s}." in name for s in _SPLIT)
                  else "attention latents and norms"] += n
        elif ".mlp.shared_experts." in name:
            kinds["shared experts"] += n
        elif ".mlp.gate." in name:
            kinds["routers"] += n
        elif ".mlp." in name:
            kinds["dense MLP (layer 0)"] += n
        elif "norm" in name:
            kinds["attention latents and norms"] += n
        else:
            kinds["embeddings and lm_head"] += n
    E, D, I = a.n_routed_experts, a.hidden_size, a.moe_intermediate_size
    routed = len(moe) * E * 3 * D * I * INT4_BYTES_PER_WEIGHT
    rows = [{"kind": k, "bytes": v, "per_rank": v / world if k in split else v, "split": k in split}
            for k, v in kinds.items()]
    rows.append({"kind": f"routed experts, INT4 ({len(moe)} layers x {E})", "bytes": routed,
                 "per_rank": routed / world, "split": True})
    drafter = sum(p.numel() * 2 for p in d.parameters())
    rows.append({"kind": "drafter (Kimi-K2.5-DFlash shape, bf16)", "bytes": drafter, "per_rank": drafter,
                 "split": False})
    return {"world": world, "rows": rows, "total": sum(r["bytes"] for r in rows),
            "per_rank": sum(r["per_rank"] for r in rows)}


def kv_bytes(config: str = "kimi-k2.6") -> dict:
    """Latent KV bytes per token (every layer's 512 + 64 bf16 latent, replicated on every rank) and the
    drafter's K/V cache per context token, per request at CONTEXTS."""
    a = load_config(config)
    da = k26.drafter_args(a)
    target = a.num_hidden_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * 2
    drafter = da.num_hidden_layers * 2 * da.num_key_value_heads * da.head_dim * 2
    return {"target_per_token": target, "drafter_per_token": drafter,
            "per_request": [{"context": c, "target": c * target, "drafter": c * drafter} for c in CONTEXTS]}


def allreduce(config: str = "kimi-k2.6") -> list[dict]:
    """All-reduces of one target forward (two a layer) and their bytes, per batch and tree size."""
    a = load_config(config)
    count = 2 * a.num_hidden_layers
    out = []
    for b in BATCHES:
        for B in TREES:
            rows = b * (B + 1)
            each = rows * a.hidden_size * 2
            out.append({"batch": b, "nodes": B, "rows": rows, "count": count, "bytes_each": each,
                        "bytes_round": count * each})
    return out


def verify_ep(micro: dict, world: int = 8, experts: int = 384, top_k: int = 8) -> list[dict]:
    """One MoE layer's verify at batch 1 per tree size, from notebook 01's measured curve: the layer on one
    GPU, its MoE kernel (`project.routed_kernel`: the experts those rows touched under random routing), the
    busiest rank's share of those experts, and the layer on one rank of `world` (attention and the rest split
    by heads, the MoE kernel on the busiest rank) before its two all-reduces (not measured here)."""
    out = []
    for ctx in (4096, 32768):
        for N in (1, 16, 64, 256):
            layer, ext = project.layer_time(micro["layer_verify"], "moe", ctx, 1, N)
            kern, touched, _ = project.routed_kernel(micro, ctx, 1, N)
            touched = min(experts, max(top_k, round(touched)))
            busiest = project.busiest_rank_experts(touched, experts, world)
            rank = max(layer - kern, 0.0) / world + kern * busiest / touched
            out.append({"context": ctx, "rows": N, "layer_s": layer, "moe_kernel_s": kern, "touched": touched,
                        "busiest_rank_experts": busiest, "rank_layer_s": rank, "extrapolated": ext})
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _us(s: float) -> str:
    return f"{s * 1e6:,.0f} us"


def _para(text: str) -> str:
    """A paragraph (newlines and runs of spaces are one space) wrapped at 110 columns."""
    return textwrap.fill(" ".join(text.split()), width=110, break_on_hyphens=False) + "\n"


def _intro(world: int) -> list[str]:
    """The page's title for `world` ranks and its sources and layout."""
    return [f"# K2.6 on {world} GPUs: the scale-up plan\n",
            _para("""Generated by `python -m kdtree.scaleup` from the model's own code (built on the meta
        device) and the lab's H200 records (`outputs/h200/microbench_k26.json`, `outputs/h200/bridge.json`);
        `tests/test_scaleup.py` checks this page against them. Layout as `kdtree.tp` shards a model:
        attention heads, the dense MLP and the shared expert split over the ranks, the routed experts in
        contiguous blocks (expert parallelism), the latent projections, norms, routers, embeddings,
        lm_head and the drafter replicated; two all-reduces of the layer's activations per layer.""")]


def _weights_section(w: dict, world: int) -> list[str]:
    """The weights table of `weights(world=world)`'s rows: in all and per rank."""
    L = [f"## Weights per rank ({world} ranks)\n", "| weights | in all | per rank |", "|---|---|---|"]
    for r in w["rows"]:
        rep = "" if r["split"] else " (replicated)"
        L.append(f"| {r['kind']} | {_gb(r['bytes'])} | {_gb(r['per_rank'])}{rep} |")
    L.append(f"| **total** | **{_gb(w['total'])}** | **{_gb(w['per_rank'])}** |\n")
    L.append(_para("""INT4 experts count 0.5 byte a weight plus one bf16 scale per 32 inputs, in one copy (the
        kernels' order); everything else is bf16. An H200 holds 141 GB: what is left per rank holds the KV
        caches below."""))
    return L


def _kv_section(kv: dict) -> list[str]:
    """The latent KV bytes of `kv_bytes()`: per token, then per request at each context."""
    L = ["## Latent KV per token and per request\n",
         _para(f"""The target caches one latent of 512 + 64 bf16 a layer: {kv['target_per_token']:,} bytes a
        token, on every rank (one latent serves every head, so heads split, the cache does not). The drafter
        caches K and V of its 8 KV heads in 6 layers: {kv['drafter_per_token']:,} bytes a context token."""),
         "| context | target latent per request | drafter K/V per request |", "|---|---|---|"]
    for r in kv["per_request"]:
        L.append(f"| {r['context']:,} | {_gb(r['target'])} | {_gb(r['drafter'])} |")
    return L + [""]


def _allreduce_section(ar: list[dict]) -> list[str]:
    """The all-reduces of `allreduce()`: count and bytes per batch and tree size."""
    L = ["## All-reduces per round\n",
         _para(f"""Each target forward all-reduces twice a layer: {ar[0]['count']} all-reduces of rows x 7,168
        bf16 each; the drafter runs replicated and all-reduces nothing. Rows = batch x (nodes + 1)."""),
         "| batch | draft nodes | rows | bytes each | bytes a round |", "|---|---|---|---|---|"]
    for r in ar:
        L.append(f"| {r['batch']} | {r['nodes'] or 'AR'} | {r['rows']:,} | {r['bytes_each'] / 1e6:,.3f} MB | "
                 f"{r['bytes_round'] / 1e6:,.1f} MB |")
    return L + [""]


def _verify_section(ep: list[dict], world: int) -> list[str]:
    """The verify cost per tree size of `verify_ep(micro, world)`: one GPU beside one rank of `world`."""
    L = ["## Verify cost per tree size under expert parallelism\n",
         _para(f"""One MoE layer at batch 1, from notebook 01's measured layer and MoE-kernel curves (H200;
        random weights, random routing, so the rows touch more distinct experts than a real tree's siblings
        would). On a rank, the layer's non-MoE work divides by the ranks (heads split; a bound, since the
        latent projections are replicated) and the MoE kernel runs the busiest rank's share of the touched
        experts (the expected largest block of a uniform draw of that many experts among {world} blocks of
        {384 // world}). Before the layer's two all-reduces, which were not measured here."""),
         "| context | rows | layer, 1 GPU | MoE kernel, 1 GPU | experts touched | busiest rank's experts | "
         "layer per rank |",
         "|---|---|---|---|---|---|---|"]
    for r in ep:
        ext = " (extrapolated)" if r["extrapolated"] else ""
        L.append(f"| {r['context']:,} | {r['rows']} | {_us(r['layer_s'])} | {_us(r['moe_kernel_s'])} | "
                 f"{r['touched']} | {r['busiest_rank_experts']:.1f} | {_us(r['rank_layer_s'])}{ext} |")
    L.append("")
    L.append(_para("""Expert parallelism divides a small tree's MoE cost less than its expert count
        suggests: a one-row round touches 8 experts, and the busiest of 8 ranks holds several of them; from
        64 rows on, nearly every rank is busy and the division approaches 8."""))
    return L


def _sglang_section(micro: dict, bridge: dict) -> list[str]:
    """The SGLang DDTree worker's round stage by stage beside the lab's kernels, timed by the records
    `micro` (microbench_k26.json) and `bridge` (bridge.json; its `capi_smoke`, where present)."""
    b1 = next(r for r in bridge["rows"] if r["batch"] == 1 and r["budget"] == 64)
    b32 = next(r for r in bridge["rows"] if r["batch"] == 32)
    moe1 = next(r for r in micro["moe_int4"] if r["tokens"] == 1)
    va = next(r for r in micro["verify_attn"]
              if r["context"] == 32768 and r["nodes"] == 64 and r["batch"] == 1)
    L = ["## Where the lab's kernels sit in an SGLang DDTree worker's round\n",
         _para("""SGLang's DDTree port builds the tree with a host heap, converts it to EAGLE's linked lists,
        verifies them with `verify_tree_greedy`, and needs page size 1 with overlap scheduling off. Measured
        on our side (H200, V = 163,840, L = 15):"""),
         "| stage of the round | SGLang port | the lab's replacement | measured here |",
         "|---|---|---|---|",
         "| tree build + conversion | torch top-K, host heap, numpy mask, conversion | "
         "`bridge.build_trees` + "
         f"`bridge.to_sglang` (graph) | b1 B64: {b1['reference_s'] * 1e3:.2f} ms reference path vs "
         f"{b1['native_graph_s'] * 1e3:.3f} ms; b32 B{b32['budget']}: {b32['reference_s'] * 1e3:.0f} ms vs "
         f"{b32['native_graph_s'] * 1e3:.2f} ms |",
         "| greedy accept | `verify_tree_greedy` | `bridge.sglang_verify_greedy` (same arrays) or "
         "`tree_walk` | "
         f"build + conversion + accept in one graph: b1 B64 {b1['sglang_graph_s'] * 1e3:.3f} ms |",
         "| tree-verify attention | the backend's dense tree mask | `verify_attn` (MLA absorbed, packed "
         "mask) | "
         f"32K x 64 nodes, batch 1: {va['kernel_s'] * 1e6:.0f} us vs {va['naive_s'] * 1e6:.0f} us naive "
         "torch |",
         "| routed experts | fused MoE | `moe_int4` (release-format INT4, one launch at one token) | "
         "one token: "
         f"{moe1['kernel_s'] * 1e6:.1f} us, {moe1['speedup_vs_bf16_experts']:.1f}x bf16 experts |",
         "| KV compaction | page size 1: index moves | `kv_compact` (paged, one launch for the batch) | - |",
         ""]
    if "capi_smoke" in bridge:
        us = bridge["capi_smoke"]["tree_walk_beyond_launch_s"] * 1e6
        L.append(_para(f"""Through the C ABI (`libkdtree.so`) a worker calls the same kernels without Python:
            {us:.2f} us of host time beyond the launch per call, measured from C."""))
    return L


_NOT_MEASURED = [
    "## Not measured here\n",
    "- all-reduce and all-to-all times on 8 H200s (`tp.allreduce_cost(8)` on the 8-GPU machine fills",
    "  them in);",
    "- real routing (these are random weights: touched experts and the busiest rank's share are",
    "  random-routing figures), real acceptance on K2.6 (the lab's acceptance comes from its trained",
    "  pair);",
    "- SGLang itself: sgl-kernel cannot be installed here, so the arrays follow its source",
    "  (docs/bridges.md);",
    "- 128K contexts (the KV figures above are arithmetic), and the 61-layer round end to end on one",
    "  rank.",
]


def report(world: int = 8, micro_path: Path | None = None, bridge_path: Path | None = None) -> str:
    """The scale-up page (markdown) for `world` ranks, from the model's code and the records at `micro_path`
    and `bridge_path` (default: RECORDS' microbench_k26.json and bridge.json)."""
    micro = json.loads((micro_path or RECORDS / "microbench_k26.json").read_text())
    bridge = json.loads((bridge_path or RECORDS / "bridge.json").read_text())
    L = [*_intro(world), *_weights_section(weights(world=world), world), *_kv_section(kv_bytes()),
         *_allreduce_section(allreduce()), *_verify_section(verify_ep(micro, world), world),
         *_sglang_section(micro, bridge), *_NOT_MEASURED]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree.scaleup", description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "docs" / "scale_up_k2.6.md"))
    a = ap.parse_args(argv)
    Path(a.out).write_text(report(a.world))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
