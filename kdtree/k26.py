"""Kimi-K2.6 shape with random weights, for end-to-end runs on one GPU (no real weights exist here).

    target = k26.build_target(n_moe=12)            # layer 0 dense + 12 MoE layers, real vocabulary, bf16
    drafter = k26.build_drafter(target)            # Kimi-K2.5-DFlash's shape, random
    engine = Engine(target, drafter, mode="ddtree", budget="auto", simulate=Profile(5.0, depth=7))

`build_target`: the real dimensions of `data/configs/kimi-k2.6.json` (hidden 7168, MLA with q_lora 1536 /
kv_lora 512, 64 heads, 384 routed experts of intermediate 2048 + 1 shared, top-8, vocabulary 163,840), the
dense layer 0 and `n_moe` MoE layers, each layer with its own random weights (nothing shared); the routed
experts are random INT4 words in the release format, repacked block by block into moe_int4's layout and
kept in that one copy (`Int4Experts.random_kernel_only`: 9.5 GB a layer). Built on the meta device first,
so no bf16 expert ever exists. `build_drafter`: 6 layers, hidden 7168, 64 query / 8 KV heads of 128,
intermediate 18432, block 8, its target_layer_ids [1, 12, 24, 35, 47, 58] of 61 layers mapped onto the
layers present (`drafter_layer_ids`). Tokens mean nothing with random weights: measure acceptance with
`kdtree.simulate` profiles.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .config import ModelArgs, load_config
from .drafter import DFlashDrafter, DrafterArgs, draft_inv_freq
from .model import Gate, Int4Experts, MoE, Transformer, rope_inv_freq

K25_DFLASH = dict(num_hidden_layers=6, hidden_size=7168, num_attention_heads=64, num_key_value_heads=8,
                  head_dim=128, intermediate_size=18432, block_size=8)
K25_LAYER_IDS = (1, 12, 24, 35, 47, 58)  # of the full model's 61 layers
FULL_LAYERS = 61


def target_args(n_moe: int, config: str = "kimi-k2.6", **overrides) -> ModelArgs:
    """The config with 1 + n_moe layers (layer 0 dense, as the config's first_k_dense_replace = 1)."""
    n_moe = checks.int_in("n_moe", n_moe, 1, FULL_LAYERS - 1)
    return dataclasses.replace(load_config(config), num_hidden_layers=1 + n_moe, first_k_dense_replace=1,
                               **overrides)


def _fill(module: nn.Module, g: torch.Generator) -> None:
    """Random weights in place: norms 1, linear / embedding weights N(0, 1 / fan_in), the router's
    correction bias N(0, 0.01)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0, 1.0, generator=g)
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]), generator=g)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.01, generator=g)


class HashedGate(Gate):
    """A random-weight model's router with a trained router's spread: the scores are a pseudo-random
    function of the row (sin-hash of its router logits), so rows that differ at all pick their experts
    independently and uniformly (as notebook 01's random rows do), and equal rows pick alike. Random
    weights' own router concentrates: their hidden states share most of their direction, so a batch's
    tokens read a few experts between them."""

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x.float(), self.weight.float())                                   # [N, E]
        return torch.frac(torch.sin(h * 12345.678) * 43758.5453).abs()                 # [N, E] in [0, 1)


ROUTINGS = ("model", "uniform")


def build_target(n_moe: int, device="cuda", seed: int = 0, config: str = "kimi-k2.6",
                 args: ModelArgs | None = None, chunk: int = 32, kernel_only: bool = True,
                 routing: str = "model") -> Transformer:
    """The K2.6-shape target (module docstring): bf16 with the kernel attention on a GPU. args: other
    dimensions (tests; their layer count becomes 1 + n_moe), else target_args(n_moe, config). kernel_only
    False: the experts stay in the release format (the CPU's reference path reads it). routing "model": the
    random router as it is (concentrated); "uniform": `HashedGate` (every row its own experts)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: expected one of {ROUTINGS}")
    args = target_args(n_moe, config) if args is None else dataclasses.replace(
        args, num_hidden_layers=1 + checks.int_in("n_moe", n_moe, 1, FULL_LAYERS - 1),
        first_k_dense_replace=1)
    dev = torch.device(device)
    with torch.device("meta"):
        m = Transformer(args, attn_impl="kernel" if dev.type == "cuda" else "absorb")
    moe = [i for i, layer in enumerate(m.model.layers) if isinstance(layer.mlp, MoE)]
    for i in moe:  # no expert weights before their INT4 copy exists
        m.model.layers[i].mlp.experts = nn.Module()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    m = m.to(dtype).to_empty(device=dev)   # the dtype on meta: no float32 copy of the weights ever exists
    m.inv_freq.copy_(rope_inv_freq(args)[0])   # to_empty leaves buffers unset
    g = torch.Generator(device=dev).manual_seed(seed)
    _fill(m, g)
    E, D, I = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
    for i in moe:
        make = Int4Experts.random_kernel_only if kernel_only else Int4Experts.random
        kw = dict(chunk=chunk) if kernel_only else {}
        m.model.layers[i].mlp.experts = make(E, D, I, device=dev, seed=seed * 1000 + i, **kw)
        if routing == "uniform":
            m.model.layers[i].mlp.gate.__class__ = HashedGate   # the same parameters, hashed scores
    return m.to(dtype).eval()


def drafter_layer_ids(n_layers: int) -> tuple[int, ...]:
    """Kimi-K2.5-DFlash's target layers (of 61) mapped proportionally onto a model of n_layers, distinct."""
    ids = sorted({min(n_layers - 1, round(i * (n_layers - 1) / (FULL_LAYERS - 1))) for i in K25_LAYER_IDS})
    return tuple(ids)


def drafter_args(a: ModelArgs, **overrides) -> DrafterArgs:
    """Kimi-K2.5-DFlash's shape for a target of ModelArgs `a` (overrides: other fields)."""
    base = dict(K25_DFLASH, mask_token_id=a.vocab_size - 2,
                target_layer_ids=drafter_layer_ids(a.num_hidden_layers),
                target_hidden_size=a.hidden_size, vocab_size=a.vocab_size, rms_norm_eps=a.rms_norm_eps,
                max_position_embeddings=a.max_position_embeddings)
    base.update(overrides)
    return DrafterArgs(**base)


def build_drafter(target: Transformer, seed: int = 1, args: DrafterArgs | None = None) -> DFlashDrafter:
    """A random drafter of Kimi-K2.5-DFlash's shape (or `args`) attached to `target`, on its device and dtype,
    initialised there (meta first)."""
    args = drafter_args(target.args) if args is None else args
    with torch.device("meta"):
        d = DFlashDrafter(args).to(target.dtype)
    d = d.to_empty(device=target.device)
    d.inv_freq.copy_(draft_inv_freq(args))   # to_empty leaves buffers unset
    _fill(d, torch.Generator(device=target.device).manual_seed(seed))
    return d.to(target.dtype).eval().attach(target)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights on its device, the INT4 experts' kernel copy included (meta tensors
    excluded)."""
    ts = list(model.parameters()) + list(model.buffers())
    n = sum(t.numel() * t.element_size() for t in ts if not t.is_meta)
    for mod in model.modules():
        mw = getattr(mod, "_kernel_weights", None)
        if mw is not None:
            n += sum(t.numel() * t.element_size() for t in (mw.w13, mw.s13, mw.w2, mw.s2))
    return n
