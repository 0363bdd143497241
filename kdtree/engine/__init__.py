"""The decode engine: batched requests over one paged latent cache, one round code for AR, DFlash and DDTree.

    engine = Engine(model, drafter, mode="ddtree", budget=64, max_batch=8)
    rid = engine.add_request(prompt, max_new_tokens=128)
    results = engine.run()                       # {request id: GenerationResult}

One round (`Runner.round`), for every active request at once:
    draft    the drafter's logits [b, L, V] below each request's root (its last committed token)
    build    the verify block of N rows per request (AR: the root alone; DFlash: the argmax chain; DDTree: the
             best-first tree of `budget` nodes, padded to budget + 1 rows)
    verify   one target forward over the blocks, each request's cached rows visible, the block under its mask
    walk     follow the target's choices (argmax at T = 0, a sample per row at T > 0) down each tree
    commit   keep the accepted rows in the cache (compaction), hand their features to the drafter's context,
             advance lengths and roots; the emitted tokens and counts go to the host in one copy

Files: `config` (EngineConfig), `requests` (Request, GenerationResult, PagePool, argument checks),
`scheduler` (queues, slots, pages, admission), `prefill`, `runner` (the round, its launch and landing),
`graphs` (GraphCache, BLAS choice, stream marks), `policy` (the budget policy's hooks; FixedBudget),
`engine` (Engine: add_request / step / run / generate), `cached` (engine_for: the generate_* wrappers'
engines). The tree steps and the sampling live in
`kdtree/round_ops.py`; budget="auto" in `kdtree/budget/`. docs/engine.md is the design page.
"""
from .cached import engine_for
from .config import ADMISSIONS, BACKENDS, MODES, EngineConfig, moe_path
from .engine import Engine
from .graphs import blas_for, preferred_blas
from .requests import (STAGES, GenerationResult, Request, check_drafter, check_max_new, check_prompt,
                       check_seed, check_stop, check_temperature, finish)

__all__ = ["ADMISSIONS", "BACKENDS", "MODES", "STAGES", "Engine", "EngineConfig", "GenerationResult",
           "Request", "blas_for", "check_drafter", "check_max_new", "check_prompt", "check_seed",
           "check_stop", "check_temperature", "engine_for", "finish", "moe_path", "preferred_blas"]
