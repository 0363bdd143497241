"""Generation of one request: autoregressive, the DFlash chain, and DDTree, each a thin wrapper over the
engine.

Every call runs `kdtree.engine.Engine`'s round (the lab's only decode loop) at batch 1; the engine is made
once per (model, drafter, mode, budget, backend, context bucket) and kept (`engine.engine_for`), so repeated
calls replay its captured graphs. Greedy (temperature 0) speculative output equals greedy autoregressive
output token for token. At temperature > 0 every row of the verify block gets one target sample from the
request's own random stream (keyed by seed) and the walk follows the samples, so each emitted token is
distributed exactly as the target's. The eager single-request loops these replaced live on as the tests'
oracle (`kdtree.oracle`).
"""
from __future__ import annotations

import time

from . import golden
from .engine import BACKENDS, STAGES, GenerationResult, check_drafter, check_max_new, check_prompt, engine_for
from .model import Transformer

__all__ = ["BACKENDS", "STAGES", "GenerationResult", "generate_ar", "generate_dflash", "generate_ddtree"]


def _check_backend(backend, model: Transformer) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "kernel" and model.device.type != "cuda":
        raise ValueError("backend='kernel' needs the model on a CUDA device")
    return backend


def _run(model, drafter, mode, budget, prompt, max_new_tokens, stop_tokens, temperature, seed, backend,
         lookahead, graphs: bool = True) -> GenerationResult:
    p = check_prompt(prompt, model.args.vocab_size)
    n = check_max_new(max_new_tokens)
    t0 = time.perf_counter()
    e = engine_for(model, drafter, mode, budget, len(p) + n + lookahead, backend, graphs)
    rid = e.add_request(p, n, temperature, seed, stop_tokens)
    res = e.run()[rid]
    res.wall_time = time.perf_counter() - t0
    return res


def generate_ar(model: Transformer, prompt, max_new_tokens: int, stop_tokens=(), temperature: float = 0.0,
                seed: int = 0, backend: str | None = None) -> GenerationResult:
    """Plain autoregressive decoding: one target forward per token."""
    if backend is not None:
        _check_backend(backend, model)
    return _run(model, None, "ar", None, prompt, max_new_tokens, stop_tokens, temperature, seed, backend, 0)


def generate_dflash(model: Transformer, drafter, prompt, max_new_tokens: int, stop_tokens=(),
                    temperature: float = 0.0, seed: int = 0, backend: str = "golden") -> GenerationResult:
    """DFlash: verify the drafter's argmax chain (L = block_size - 1 tokens) each round.
    backend "golden": tree steps in numpy; "kernel": walk and compaction on the GPU (kdtree.kernels)."""
    check_drafter(model, drafter)
    _check_backend(backend, model)
    return _run(model, drafter, "dflash", None, prompt, max_new_tokens, stop_tokens, temperature, seed,
                backend, drafter.block_size)


def generate_ddtree(model: Transformer, drafter, prompt, max_new_tokens: int, budget: int, stop_tokens=(),
                    temperature: float = 0.0, seed: int = 0, backend: str = "golden") -> GenerationResult:
    """DDTree: verify the best-first tree of `budget` draft nodes each round.
    backend "golden": build and walk in numpy (golden.py); "kernel": the whole round on the GPU
    (kernels.tree_build, the model's verify forward, kernels.tree_walk, kernels.kv_compact), captured in a
    CUDA graph; the verify block always has budget + 1 rows (padding rows see only themselves and are never
    accepted)."""
    check_drafter(model, drafter)
    budget = golden._check_budget(budget)
    _check_backend(backend, model)
    if backend == "kernel" and budget > 1024:
        raise ValueError(f"budget={budget}: the kernel backend supports at most 1024")
    return _run(model, drafter, "ddtree", budget, prompt, max_new_tokens, stop_tokens, temperature, seed,
                backend, budget + 1)
