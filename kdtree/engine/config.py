"""The engine's configuration: `EngineConfig`, validated once against the model and drafter (`resolve`).

    cfg = EngineConfig(mode="ddtree", budget=64, max_batch=8).resolve(model, drafter)
    cfg.rows        # N: verify rows per request (AR 1, DFlash block_size, DDTree budget + 1)

`Engine(model, drafter, config)` takes one; `Engine(model, drafter, mode=..., ...)` builds it from keywords.
A resolved config holds only checked values: every default picked (backend, moe, max_len, max_tokens,
buckets), the budget an int (budget="auto": the policy's `AutoConfig` in `auto`, the budget its largest tree).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import checks, golden
from ..cache import check_memory
from ..model import MOE_PATHS, Int4Experts, Transformer
from .requests import check_drafter

MODES = ("ar", "dflash", "ddtree")
BACKENDS = ("golden", "kernel")
ADMISSIONS = ("eager", "grouped")
PREFIX_ATTNS = ("off", "flashinfer")   # the verify attention's prefix pass (`engine.prefix`)
PAGE_SIZE = 64   # the latent cache's page rows (the attention kernel's)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's arguments (`Engine`'s docstring says what each does); `resolve` checks them."""
    mode: str = "ar"
    budget: int | str | None = None
    max_batch: int = 8
    max_len: int | None = None
    max_tokens: int | None = None
    page_size: int = PAGE_SIZE
    graphs: bool = True
    backend: str | None = None
    prefill_chunk: int = 512
    debug: bool = False
    buckets: tuple | list | None = None
    graph_sampling: bool = True
    compile: bool = False
    deterministic: bool = False
    moe: str | None = None
    simulate: object = None
    overlap: bool = True
    admission: str = "eager"
    auto: object = None          # budget="auto": a kdtree.budget.AutoConfig (None: its defaults)
    prefix_attn: str = "off"     # "flashinfer": committed pages (AR: all) via FlashInfer (`engine.prefix`)
    block_size: int = 0          # the drafter's L + 1 (set by resolve; 0 in mode ar)

    # ------------------------------------------------------------- derived (a resolved config)
    @property
    def rows(self) -> int:
        """N: verify rows per request."""
        return 1 if self.mode == "ar" else self.block_size if self.mode == "dflash" else self.budget + 1

    @property
    def is_auto(self) -> bool:
        return self.auto is not None

    @property
    def max_accept(self) -> int:
        """Tokens a round may emit per request (accepted drafts + the bonus token)."""
        return 1 if self.mode == "ar" else self.block_size

    @property
    def pages_per_req(self) -> int:
        return -(-self.max_len // self.page_size)

    @property
    def kv_cap(self) -> int:
        """A request's cache rows at most (its page table's span)."""
        return self.pages_per_req * self.page_size

    @property
    def n_pages(self) -> int:
        """The pool's pages, the scratch page 0 included."""
        return -(-self.max_tokens // self.page_size) + 1

    # ------------------------------------------------------------- validation
    def resolve(self, model: Transformer, drafter=None) -> "EngineConfig":
        """This config checked against model and drafter, every default picked (ValueError naming the
        argument otherwise)."""
        if not isinstance(model, Transformer):
            raise ValueError(f"model: expected a kdtree Transformer, got {type(model).__name__}")
        checks.one_of("mode", self.mode, MODES)
        checks.one_of("admission", self.admission, ADMISSIONS)
        graphs, debug, graph_sampling, compile = (checks.flag(n, v) for n, v in (
            ("graphs", self.graphs), ("debug", self.debug), ("graph_sampling", self.graph_sampling),
            ("compile", self.compile)))
        if self.admission == "grouped" and getattr(model, "tp", None) is not None:
            raise ValueError("admission='grouped' under tensor parallelism: each rank times its own "
                             "admissions, so their decisions could part; use 'eager'")
        backend, budget, auto = self._budget(model, drafter)
        max_batch, prefill_chunk, max_len, max_tokens, buckets = self._sizes(model, drafter, budget)
        deterministic = self.deterministic
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic={deterministic!r}: expected True or False")
        if deterministic:
            buckets = _deterministic_buckets(model, buckets, max_batch)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap={self.overlap!r}: expected True or False")
        moe = moe_path(model, self.moe, deterministic)
        _check_prefix_attn(self.prefix_attn, model, backend, deterministic)
        buckets = default_buckets(max_batch) if buckets is None else tuple(sorted(set(buckets)))
        return dataclasses.replace(
            self, budget=budget, max_batch=max_batch, max_len=max_len, max_tokens=max_tokens, graphs=graphs,
            backend=backend, prefill_chunk=prefill_chunk, debug=debug, buckets=buckets,
            graph_sampling=graph_sampling, compile=compile, moe=moe, auto=auto,
            block_size=0 if self.mode == "ar" else drafter.block_size)

    def _budget(self, model: Transformer, drafter) -> tuple:
        """(backend, the budget as an int or None, the resolved AutoConfig or None), checked against the mode,
        the drafter and the device."""
        from ..budget.config import AutoConfig
        mode, budget, dev = self.mode, self.budget, model.device
        backend = self.backend
        if backend is None:
            backend = "kernel" if dev.type == "cuda" else "golden"
        checks.one_of("backend", backend, BACKENDS)
        if backend == "kernel" and dev.type != "cuda":
            raise ValueError("backend='kernel' needs the model on a CUDA device")
        if mode == "ar":
            if drafter is not None or budget is not None:
                raise ValueError("mode='ar' takes no drafter and no budget")
        else:
            check_drafter(model, drafter)
        if self.simulate is not None and mode != "ar" and not hasattr(drafter, "new_context"):
            raise ValueError("simulate: needs mode 'ar', or 'dflash' / 'ddtree' with a batched drafter "
                             "(DFlashDrafter)")
        auto = mode == "ddtree" and isinstance(budget, str) and budget == "auto"
        if mode == "ddtree" and isinstance(budget, str) and not auto:
            raise ValueError(f"budget={budget!r}: expected 'auto' or an int in [1, {golden.MAX_BUDGET}] "
                             "(draft nodes)")
        ac = self.auto
        if ac is not None and not isinstance(ac, AutoConfig):
            raise ValueError(f"auto={ac!r}: expected a kdtree.budget.AutoConfig or None")
        if ac is not None and not isinstance(ac.makespan, bool):
            raise ValueError(f"makespan={ac.makespan!r}: expected True or False")
        if not auto and ac is not None and not ac.is_default():
            raise ValueError("max_budget, budgets, decide, calibration and makespan: only budget='auto' "
                             "takes them")
        if auto:
            ac = (ac or AutoConfig()).resolve(backend)
            return backend, max(ac.budgets), ac
        if mode == "ddtree":
            budget = golden._check_budget(budget)
            if backend == "kernel" and budget > 1024:
                raise ValueError(f"budget={budget}: the kernel backend supports at most 1024")
        elif budget is not None:
            raise ValueError(f"budget={budget!r}: only mode='ddtree' takes a budget")
        return backend, budget, None

    def _sizes(self, model: Transformer, drafter, budget) -> tuple:
        """(max_batch, prefill_chunk, max_len, max_tokens, buckets as given or None), checked; a verify
        block must fit one request and the pool."""
        max_batch = checks.positive_int("max_batch", self.max_batch)
        prefill_chunk = checks.positive_int("prefill_chunk", self.prefill_chunk)
        page_size = self.page_size
        if page_size != PAGE_SIZE:
            raise ValueError(f"page_size={page_size!r}: the latent cache's pages are {PAGE_SIZE} rows (the "
                             "attention kernel's)")
        mpe = model.args.max_position_embeddings
        max_len = checks.int_in("max_len", mpe if self.max_len is None else self.max_len, 1, mpe,
                                f" (max_position_embeddings={mpe})")
        max_tokens = max_batch * max_len if self.max_tokens is None else self.max_tokens
        max_tokens = checks.positive_int("max_tokens", max_tokens, note=" (the pool's rows)")
        buckets = self.buckets
        ok = buckets is None or (isinstance(buckets, (list, tuple)) and buckets and all(
            checks.is_int(x) and 1 <= x <= max_batch for x in buckets) and max(buckets) == max_batch)
        if not ok:
            raise ValueError(f"buckets={buckets!r}: expected a list of ints in [1, max_batch={max_batch}] "
                             "including max_batch")
        buckets = None if buckets is None else [int(x) for x in buckets]
        mode = self.mode
        rows = 1 if mode == "ar" else drafter.block_size if mode == "dflash" else budget + 1
        cap = -(-max_len // page_size) * page_size
        if rows + 1 > min(cap, (-(-max_tokens // page_size)) * page_size):
            raise ValueError(f"{'budget' if mode == 'ddtree' else 'block_size'}: a verify block of {rows} "
                             f"rows does not fit a request of max_len={max_len} in a pool of "
                             f"max_tokens={max_tokens}")
        return max_batch, prefill_chunk, max_len, max_tokens, buckets


def prefix_nodes(cfg) -> tuple:
    """The verify rows a request that a resolved config's rounds can have: the block's, or under
    budget="auto" each plan's (AR 1, the chain's L + 1, each candidate tree's B + 1)."""
    if not cfg.is_auto:
        return (cfg.rows,)
    return tuple(sorted({1, cfg.block_size} | {B + 1 for B in cfg.auto.budgets}))


def _check_prefix_attn(prefix_attn, model: Transformer, backend: str, deterministic: bool = False) -> None:
    """prefix_attn "flashinfer" needs the kernel attention on a GPU, one GPU and FlashInfer, and is refused
    with deterministic=True (FlashInfer sizes a request's context chunks from its batch's total length)."""
    checks.one_of("prefix_attn", prefix_attn, PREFIX_ATTNS)
    if prefix_attn == "off":
        return
    if deterministic:
        raise ValueError(f"prefix_attn={prefix_attn!r}: not with deterministic=True (FlashInfer splits a "
                         "request's context by its batch's total length, so its sums depend on batch mates)")
    if backend != "kernel" or model.attn_impl != "kernel" or model.device.type != "cuda":
        raise ValueError(f"prefix_attn={prefix_attn!r}: needs the kernel backend and attention on a GPU "
                         f"(backend {backend!r}, attn_impl {model.attn_impl!r}, device {model.device})")
    if getattr(model, "tp", None) is not None:
        raise ValueError(f"prefix_attn={prefix_attn!r}: not under tensor parallelism")
    from ..ops.flashinfer_prefix import available
    why = available()
    if why is not None:
        raise ValueError(f"prefix_attn={prefix_attn!r}: {why} (pip install the `peers` extra)")


def _deterministic_buckets(model: Transformer, buckets, max_batch: int) -> tuple[int]:
    """deterministic=True: every round at max_batch rows (ValueError where buckets or INT4 experts say
    otherwise)."""
    if buckets is not None and tuple(sorted(set(buckets))) != (max_batch,):
        raise ValueError(f"deterministic=True runs every round at max_batch={max_batch}: "
                         f"buckets={buckets!r} contradicts it (leave buckets out)")
    if any(isinstance(getattr(layer.mlp, "experts", None), Int4Experts) for layer in model.model.layers):
        raise ValueError("deterministic=True: INT4 experts are not supported (their paths group "
                         "tokens by expert; the GPU kernel moe_int4 combines them with fp32 atomics)")
    return (max_batch,)


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes rounds pad to: 1, 2, 4, ... below max_batch, and max_batch."""
    b, out = 1, []
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


def moe_path(model: Transformer, moe, deterministic: bool) -> str:
    """The MoE path of the engine's forward (model.MOE_PATHS), checked; None picks: "dense" (every expert in
    two GEMMs: capturable, batch-invariant) when deterministic, on a GPU outside bf16, under TP or with at
    most 4k routed experts for top-k; "grouped" (torch's grouped GEMM over the chosen experts) on a GPU in
    bf16 beyond that; "loop" (host-driven grouping, fewest FLOPs) on the CPU."""
    a, dev = model.args, model.device
    sharded = getattr(model, "tp", None) is not None
    grouped_ok = (hasattr(torch, "_grouped_mm") and not sharded
                  and (dev.type != "cuda" or model.dtype == torch.bfloat16))
    many = a.n_routed_experts > 4 * a.num_experts_per_tok
    if moe is None:
        if deterministic or (dev.type == "cuda" and not (grouped_ok and many)):
            return "dense"
        return "grouped" if dev.type == "cuda" else "loop"
    if moe not in MOE_PATHS:
        raise ValueError(f"moe={moe!r}: expected one of {MOE_PATHS} or None (the engine picks)")
    if deterministic and moe != "dense":
        raise ValueError(f"moe={moe!r} with deterministic=True: only 'dense' is batch-invariant")
    if moe == "grouped" and not grouped_ok:
        why = ("this torch has no _grouped_mm" if not hasattr(torch, "_grouped_mm") else
               "a tensor-parallel rank holds only some experts" if sharded else
               f"torch's grouped GEMM on a GPU takes bfloat16 (the model is {model.dtype})")
        raise ValueError(f"moe='grouped': {why}")
    return moe


def check_engine_memory(cfg: EngineConfig, model: Transformer, drafter) -> None:
    """MemoryError (`model.check_memory`) where the engine's buffers for the resolved cfg would not fit on
    the model's device: the page pool, a batched drafter's context, the torch attention's visibility bias."""
    a = model.args
    need = (a.num_hidden_layers * cfg.n_pages * cfg.page_size * (a.kv_lora_rank + a.qk_rope_head_dim)
            * torch.empty(0, dtype=model.cache_dtype).element_size())
    if cfg.mode != "ar" and hasattr(drafter, "new_context"):
        da = drafter.args
        need += (2 * len(drafter.layers) * cfg.max_batch * da.num_key_value_heads
                 * (cfg.kv_cap + da.block_size) * da.head_dim * drafter.fc.weight.element_size())
    if model.attn_impl != "kernel":  # the torch attention paths' visibility bias [B, N, kv_cap] float32
        need += cfg.max_batch * cfg.rows * cfg.kv_cap * 4
    if cfg.prefix_attn == "flashinfer":   # one float workspace; each pass's 8 MB int workspace and buffers
        from ..ops.flashinfer_prefix import WORKSPACE_BYTES
        nodes = len(prefix_nodes(cfg))
        need += WORKSPACE_BYTES + nodes * (len(cfg.buckets) * (8 << 20) + 4 * sum(b * cfg.pages_per_req
                                                                                  for b in cfg.buckets))
    check_memory(f"max_batch={cfg.max_batch}, max_len={cfg.max_len}, max_tokens={cfg.max_tokens}, "
                 f"{cfg.rows} verify rows (the page pool, the drafter's context, the verify block's mask"
                 f"{', the prefix pass workspaces' if cfg.prefix_attn != 'off' else ''})", need, model.device)
