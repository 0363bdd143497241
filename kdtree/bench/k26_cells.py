"""The cells of the K2.6-shape sweep (`kdtree.bench.k26`), and what every engine of a cell shares.

The sweep's defaults (PROFILES, BUDGETS, CELLS, DECODE_PATHS); a cell's prompts (`cell_prompts`), new
tokens per request (`max_new`) and Engine keywords (`cell_engine`); the memory one engine of a cell takes
beyond the weights (`cell_bytes`) and the MoE layers that fit beside it (`fit_layers`); the model on its
first layers (`_first_layers`) and the drafter at a profile's block (`_with_block`), the same weights; the
sweep's arguments checked before anything is built (`check_sweep`). The replay (`kdtree.bench.replay`) and
the step profile (`kdtree.bench.steps`) build their cells' engines from the same.
"""
from __future__ import annotations

import copy
import dataclasses

from .. import checks, k26
from ..simulate import Profile

PROFILES = ((3.0, 8), (5.0, 8), (8.0, 16))   # (chain tau, drafter block)
BUDGETS = (4, 8, 16, 32, 64, 128)
CELLS = ((4096, 1), (4096, 8), (4096, 32), (32768, 1), (32768, 8), (32768, 32))
PROMPT, MAX_NEW = 16, 256
DECODE_PATHS = ("default", "fused", "torch")   # the target's layers: as built, kdtree.fused's, Block.forward


def max_new(batch: int) -> int:
    """New tokens per request: enough rounds per cell for a stable tau (about 2,000 tokens a run from batch 8
    on, 256 per request at batch 1)."""
    return MAX_NEW if batch == 1 else 128 if batch <= 8 else 64
MIN_LAYERS = 12   # asked for at batch 1 and 8, context 4K


def cell_prompts(n: int, batch: int) -> list[list[int]]:
    """n prompts of PROMPT tokens for a cell of `batch`: request i's prompt is request i % batch's (a queue
    of n > batch requests serves the batch's prompts again)."""
    return [[(7 * (i % batch) + j) % 1000 + 10 for j in range(PROMPT)] for i in range(n)]


def cell_engine(context: int, batch: int, new: int, rows: int) -> dict:
    """The Engine keywords every engine of a cell shares: one batch bucket, sampling outside the graphs, room
    for the context, the prompt, `new` tokens and a round of `rows` verified rows; grouped admission (a
    queue's freed slots wait for company while that costs less than the MoE prefill's fixed time:
    `Scheduler.due`; a static batch is admitted at once either way)."""
    return dict(max_batch=batch, buckets=(batch,), graph_sampling=False,
                max_len=context + PROMPT + new + rows + 64, admission="grouped")


def cell_bytes(args, dargs, batch: int, context: int, rows: int, n_moe: int) -> int:
    """Memory of one engine beyond the weights: the page pool, the drafter's context, the verify logits of
    its graphs (24 bytes an element: the float32 logits, their bf16 source, copies and scratch), and a
    margin for activations. Each GPU row records its engine's measured peak beside this (`peak_bytes`,
    `estimate_bytes`)."""
    max_len = context + PROMPT + MAX_NEW + rows + 64
    pool = (1 + n_moe) * batch * max_len * (args.kv_lora_rank + args.qk_rope_head_dim) * 2
    ctx = (2 * dargs.num_hidden_layers * batch * dargs.num_key_value_heads * (max_len + 16) * dargs.head_dim
           * 2)
    logits = batch * (rows + 16) * args.vocab_size * 24
    return pool + ctx + logits + (8 << 30)


def fit_layers(free: int, batch: int, context: int, rows: int, n_max: int) -> int:
    """The most MoE layers (<= n_max) whose weights and one engine of the cell fit in `free` bytes."""
    a = k26.target_args(1)
    E, D, I = a.n_routed_experts, a.hidden_size, a.moe_intermediate_size
    expert = E * 3 * D * I // 2 + E * 3 * D * I // 32 * 2                       # INT4 words + bf16 scales
    H = a.num_attention_heads
    attn = 2 * (D * (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim)
                + a.q_lora_rank * H * (a.qk_nope_head_dim + a.qk_rope_head_dim)
                + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim) + H * a.v_head_dim * D)
    layer = expert + attn + 2 * 3 * D * I                                          # + the shared expert
    base = 2 * 2 * a.vocab_size * D + 2 * 3 * D * a.intermediate_size + attn       # embed, head, layer 0
    dargs = k26.drafter_args(a)
    qkv = D * (dargs.num_attention_heads + 2 * dargs.num_key_value_heads) * dargs.head_dim
    o = dargs.num_attention_heads * dargs.head_dim * D
    drafter = 2 * (dargs.num_hidden_layers * (qkv + o + 3 * D * dargs.intermediate_size)
                   + len(dargs.target_layer_ids) * D * D)                          # + fc
    for n in range(n_max, 0, -1):
        if base + drafter + n * layer + cell_bytes(a, dargs, batch, context, rows, n) <= free:
            return n
    return 0


def fit_cell(free: int, args, dargs, batch: int, context: int, rows: int, n_max: int) -> int:
    """The most MoE layers (<= n_max) of a model already built whose engine for the cell fits in `free` bytes
    (what its weights leave free): 0 if none."""
    for n in range(n_max, 0, -1):
        if cell_bytes(args, dargs, batch, context, rows, n) <= free:
            return n
    return 0


def _first_layers(target, drafter, n_moe: int):
    """The model on its first 1 + n_moe layers (the same modules) and a drafter reading layers mapped onto
    them (the same weights)."""
    def shallow(m):  # a new module object whose submodule table is its own (the submodules are shared)
        c = copy.copy(m)
        c._modules = dict(m._modules)
        return c
    t = shallow(target)
    t.model = shallow(target.model)
    t.model.layers = target.model.layers[:1 + n_moe]
    t.args = dataclasses.replace(target.args, num_hidden_layers=1 + n_moe)
    d = shallow(drafter)
    d.args = dataclasses.replace(drafter.args, target_layer_ids=k26.drafter_layer_ids(1 + n_moe))
    return t, d.attach(t)



def _with_block(drafter, block: int):
    d = copy.copy(drafter)   # the same weights drafting `block` positions (block_size is the args')
    d.args = dataclasses.replace(drafter.args, block_size=block)
    return d


def check_sweep(cells, profiles, budgets, repeats: int, queue: int) -> list:
    """The sweep's arguments checked before anything is built (ValueError naming the argument); returns the
    profiles as `Profile`s (a (tau, block) pair: the chain profile of that tau over block - 1 positions)."""
    cells, budgets = list(cells), list(budgets)
    if not cells:
        raise ValueError("cells: expected at least one (context, batch)")
    for c in cells:
        if not (isinstance(c, (tuple, list)) and len(c) == 2):
            raise ValueError(f"cells: {c!r}: expected a (context, batch) pair")
        checks.int_in("a cell's context", c[0], PROMPT, note=" (the prompt's rows are part of it)")
        checks.positive_int("a cell's batch", c[1])
    if not budgets:
        raise ValueError("budgets: expected at least one fixed budget")
    for B in budgets:
        checks.int_in("budgets", B, 1, 1024, note=" (the kernel backend's ceiling)")
    checks.positive_int("repeats", repeats)
    checks.int_in("queue", queue, 0)
    if not list(profiles):
        raise ValueError("profiles: expected at least one")
    out = []
    for spec in profiles:
        if isinstance(spec, Profile):
            out.append(spec)
            continue
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
            raise ValueError(f"profiles: {spec!r}: expected a Profile or a (tau, block) pair")
        checks.int_in("a profile's block", spec[1], 2, 64)
        out.append(Profile(spec[0], depth=spec[1] - 1, K=max(budgets) * 2))
    return out
