"""The decode engine: batched requests over one paged latent cache, one round code for AR, DFlash and DDTree.

    engine = Engine(model, drafter, mode="ddtree", budget=64, max_batch=8)
    rid = engine.add_request(prompt, max_new_tokens=128)
    results = engine.run()                       # {request id: GenerationResult}

One round (`step`), for every active request at once:
    draft    the drafter's logits [b, L, V] below each request's root (its last committed token)
    build    the verify block of N rows per request (AR: the root alone; DFlash: the argmax chain; DDTree: the
             best-first tree of `budget` nodes, padded to budget + 1 rows)
    verify   one target forward over the blocks, each request's cached rows visible, the block under its mask
    walk     follow the target's choices (argmax at T = 0, a sample per row at T > 0) down each tree
    commit   keep the accepted rows in the cache (compaction), hand their features to the drafter's context,
             advance lengths and roots; the emitted tokens and counts go to the host in one copy
The round reads no device value on the host until that copy; on a GPU with the kernel backend it is one CUDA
graph per batch bucket, replayed. Invariant: the target cache and the drafter's context hold every committed
token but the last, which is the next round's root.

Requests sit in slots 0..n-1 of the static state (a finishing request's slot takes the last one's); padding
slots up to the batch bucket have length 0 and page table 0 (the pool's scratch page) and never advance
(`live`), so they write only there and nothing reads them. Pages: a request reserves at admission the pages
its longest context can need (prompt + max_new_tokens + the block's rows) and takes them as it grows; one that
cannot reserve waits (no preemption); one that could never fit is refused by `add_request`.

The tree steps (`round_ops.GoldenOps` / `round_ops.KernelOps`) and the sampling (`round_ops.choose`) live in
`kdtree/round_ops.py`.

Sampling: each request's randomness is a counter-based stream keyed by (seed, the root's position, the row),
drawn on the device as Gumbel noise (`gumbel`), so a request's samples do not depend on its batch mates, on
the batch bucket or on graph replay. Seeded results at T > 0 therefore differ from the earlier per-call
torch.Generator loop (same distribution).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from . import budget as auto_budget
from . import checks, golden
from .model import MOE_PATHS, Int4Experts, PagedMeta, Transformer, check_memory
from .round_ops import GoldenOps, KernelOps, _chain, all_finite, choose, truncate, truncated_accepts
from .simulate import Simulation

MODES = ("ar", "dflash", "ddtree")
BACKENDS = ("golden", "kernel")
ADMISSIONS = ("eager", "grouped")
ADMIT_FIT = 32   # grouped admission: the recent admissions whose times fit `Engine.admit_cost`
# an eager round's stages; a graph replay is one "round"
STAGES = ("draft", "build", "verify", "walk", "commit")
# The BLAS library torch is asked to prefer for the engine's GEMMs on a GPU, by their rows (batch x block
# rows of a region: draft, verify, commit, a prefill chunk): at most SMALL_GEMM_ROWS rows -> SMALL_GEMM_BLAS,
# more -> LARGE_GEMM_BLAS (None: torch's own choice). Set around each region (so also while a graph captures
# it) and restored after it. cuBLAS's own heuristic picks a slow kernel for float32 GEMMs of 8..16 rows on
# the H200 (outputs/h200/engine_quick_lt.json against engine_quick.json); cuBLAS for the larger GEMMs
# measured faster at batch 1 (engine_quick_split_blas.json), but in that run the capture of a batch-8 round
# with 520-row verify GEMMs under cuBLAS was invalidated, so both stay on cuBLASLt.
# A capture that fails is tried again, in a fresh memory pool (seen now and then on the H200: cuBLASLt's
# batched GEMM fails inside a capture that succeeds on the next try); each retry is listed in
# Engine.capture_retries.
CAPTURE_TRIES = 3
WHOLE_GRAPH_BYTES = 1 << 30   # budget="auto": the most logits memory its whole-round graphs may hold
# Prefill chunks: a CUDA graph per exact (requests, rows) shape, captured the first time the shape is seen
# (that chunk runs eagerly) and replayed after it; the same kernels at the same shapes, so the tokens are
# the eager prefill's bit for bit. At most PREFILL_GRAPHS shapes, each of at most PREFILL_GRAPH_ROWS rows
# (their static buffers are allocated with the decode graphs); other chunks run eagerly.
PREFILL_GRAPHS = 16
PREFILL_GRAPH_ROWS = 512
COST_REPS = 5  # budget="auto": graph replays per cost-table cell at start-up (their median)
SMALL_GEMM_ROWS = 16
SMALL_GEMM_BLAS: str | None = "cublaslt"
LARGE_GEMM_BLAS: str | None = "cublaslt"


@contextlib.contextmanager
def preferred_blas(lib: str | None):
    """torch's preferred BLAS library set to `lib` ("cublas" | "cublaslt"; None: left as it is) inside."""
    if lib is None:
        yield
        return
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(lib)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


def _blas(device: torch.device, rows: int):
    """The BLAS library of a region of `rows` GEMM rows (SMALL_GEMM_BLAS / LARGE_GEMM_BLAS) on a GPU."""
    lib = SMALL_GEMM_BLAS if rows <= SMALL_GEMM_ROWS else LARGE_GEMM_BLAS
    return preferred_blas(lib if device.type == "cuda" else None)


@dataclass
class GenerationResult:
    tokens: list[int]                      # generated tokens (prompt excluded)
    mode: str
    target_forwards: int = 0               # prefill chunks included (its rounds added as it leaves)
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify round (>= 1)
    tree_sizes: list[int] = field(default_factory=list)      # verify rows per round (root included)
    # seconds per stage of the rounds it was in (added as it leaves: `Engine._release`)
    stage_times: dict[str, float] = field(
        default_factory=lambda: {s: 0.0 for s in ("prefill",) + STAGES + ("round",)})
    wall_time: float = 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / max(len(self.tokens), 1)

    @property
    def mean_accept_length(self) -> float:
        """tau: mean tokens emitted per verify round (accepted drafts + the bonus token)."""
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else float("nan")

    def summary(self) -> dict:
        return {"mode": self.mode, "new_tokens": len(self.tokens), "target_forwards": self.target_forwards,
                "forwards_per_token": self.forwards_per_token, "tau": self.mean_accept_length,
                "rounds": len(self.accept_lengths), "wall_s": self.wall_time,
                "stage_s": dict(self.stage_times)}


# ----------------------------------------------------------------------------- argument checks
def check_prompt(prompt, vocab_size: int) -> list[int]:
    return checks.token_list("prompt", prompt, vocab_size)


def check_max_new(max_new_tokens) -> int:
    return checks.positive_int("max_new_tokens", max_new_tokens)


TEMPERATURE_MAX = float(np.finfo(np.float32).max)   # the rounds hold temperatures in float32


def check_temperature(temperature) -> float:
    return checks.finite_float("temperature", temperature, lo=0.0, hi=TEMPERATURE_MAX,
                               note=" (0: greedy; the rounds compute in float32)")


def check_seed(seed) -> int:
    seed = checks.int_in("seed", seed, 0, note=" (below 2**63)")
    if seed >= 2**63:
        raise ValueError(f"seed={seed!r}: expected an int >= 0 (below 2**63)")
    return seed


def check_stop(stop_tokens, vocab_size: int | None = None) -> set[int]:
    """stop_tokens: token ids as a prompt takes them (checks.token_list: list, tuple, set of ints, 1-D
    integer tensor or array; empty allowed), in [0, vocab_size) when given; None: none."""
    if stop_tokens is None:
        return set()
    if isinstance(stop_tokens, (set, frozenset)):   # order does not matter for a stop set
        stop_tokens = list(stop_tokens)
    try:
        return set(checks.token_list("stop_tokens", stop_tokens, vocab_size, allow_empty=True))
    except ValueError as e:
        detail = str(e).removeprefix("stop_tokens: ")
        raise ValueError(f"stop_tokens={stop_tokens!r}: expected token ids (ints) in a list, tuple, set or "
                         f"1-D integer tensor ({detail})") from None


def check_drafter(model: Transformer, drafter) -> None:
    if not (hasattr(drafter, "session") and hasattr(drafter, "block_size")):
        raise ValueError(f"drafter: expected a drafter (block_size, session()), got {type(drafter).__name__}")
    dv = getattr(getattr(drafter, "args", None), "vocab_size", getattr(drafter, "vocab_size", None))
    if dv is not None and dv != model.args.vocab_size:
        raise ValueError(f"drafter: vocabulary {dv} differs from the target's {model.args.vocab_size}")
    attached = getattr(drafter, "_target", None)   # a DFlashDrafter drafts through its target's embedding
    if attached is not None and attached[0] is not model:
        raise ValueError("drafter: attached to " + ("no target" if attached[0] is None else "another target")
                         + ": it drafts through its target's embedding, lm_head and hidden states "
                         "(drafter.attach(model) checks the shapes and attaches it to this one)")


def finish(out: list[int], new: list[int], max_new: int, stop: set[int]) -> bool:
    """Append `new` to `out` up to max_new and the first stop token; True when generation is over."""
    for t in new:
        out.append(t)
        if t in stop or len(out) >= max_new:
            return True
    return False


class _Clock:
    """Stage marks of one eager round: CUDA events on the stream (read after the round's one sync) or host
    times on the CPU. times() -> {stage: seconds since the previous mark}; the "end" mark closes the round."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = [("start", self._now())]

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def __call__(self, stage: str) -> None:
        self.marks.append((stage, self._now()))

    def times(self) -> dict[str, float]:
        out = {}
        for (_, a), (stage, b) in zip(self.marks, self.marks[1:]):
            if stage != "end":
                out[stage] = a.elapsed_time(b) * 1e-3 if self.cuda else b - a
        if self.cuda:  # the round's GPU span: from before its first launch to after its last
            out["gpu_span"] = self.marks[0][1].elapsed_time(self.marks[-1][1]) * 1e-3
        return out


# ----------------------------------------------------------------------------- pages and requests
class PagePool:
    """Free list of the pool's pages 1..n-1 (page 0 is the scratch page padding rows write to) and the count
    reserved by admitted requests."""

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.free = list(range(n_pages - 1, 0, -1))
        self.reserved = 0  # reserved by requests, not yet taken

    @property
    def capacity(self) -> int:
        return self.n_pages - 1

    def can_reserve(self, n: int) -> bool:
        return len(self.free) - self.reserved >= n

    def take(self) -> int:
        self.reserved -= 1
        return self.free.pop()

    def give_back(self, pages: list[int], unused_reservation: int) -> None:
        self.free.extend(reversed(pages))
        self.reserved -= unused_reservation


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    temperature: float
    seed: int
    stop: set[int]
    result: GenerationResult
    reserve: int                      # pages this request may take in all
    pages: list[int] = field(default_factory=list)
    # prompt + every accepted token (host drafters read it)
    committed: list[int] = field(default_factory=list)
    length: int = 0                   # cached rows (host mirror of the device length)
    slot: int = -1
    session: object = None            # a host drafter's session
    t0: float = 0.0
    syn0: float = 0.0                 # synthetic_s at t0 (fills, simulated texts: not in wall_time)
    est: np.ndarray | None = None     # budget="auto": expected tokens per plan from its last draft round
    est_sum: np.ndarray | None = None  # ... summed over its draft rounds (`Engine._long_run`)
    est_n: int = 0                     # ... their count
    est_at: int = -1                   # ... the launch index of the round that drafted est
    stage0: dict | None = None        # the engine's stage sums and landed rounds as it joined (`_release`)
    rounds0: int = 0
    synthetic: int = 0                # random context rows inserted before the root after prefill


def _moe_path(model: Transformer, moe, deterministic: bool) -> str:
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


@contextlib.contextmanager
def _capturing(g: "torch.cuda.CUDAGraph", pool, stream: "torch.cuda.Stream"):
    """`torch.cuda.graph(g, pool=pool, stream=stream)` without what its entry adds: a device synchronization
    and the emptying of the device and pinned-host caching allocators. A capture in the middle of serving (a
    prefill shape's first admission) then neither waits for the eager prefill just issued nor makes every
    later allocation pay cudaMalloc / cudaHostAlloc again. The work the capture reads must be ordered before
    it on `stream` by the caller (stream.wait_stream)."""
    with torch.cuda.stream(stream):
        g.capture_begin(pool=pool)
        try:
            yield
        finally:
            g.capture_end()


def _end_pool(device: torch.device, pool) -> None:
    """After a failed capture: stop routing the stream's allocations to the graph's memory pool (a failed
    capture can leave the allocator recording to it, and the next capture into it would be refused)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)
    except RuntimeError:
        pass


def _buckets(max_batch: int) -> tuple[int, ...]:
    b, out = 1, []
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


@dataclass
class _Front:
    """What a drafting round's first phase leaves for its second (budget="auto"): the tree block (views of
    the engine's static buffers [b, B_max + 1, ...], rows beyond the built tree stale) and the chain's tokens
    [b, L]."""
    blk: object
    chain: torch.Tensor


@dataclass
class _Flight:
    """A launched round whose bookkeeping waits (`Engine._land`): the requests in its slot order at launch,
    its bucket, logits, plan, the host buffers its one copy lands in (`buf`), the event closing it."""
    reqs: list
    b: int
    logits: torch.Tensor
    graph: bool
    clock: object
    t0: float
    buf: int
    done: object
    i: int | None = None
    info: dict | None = None


# ----------------------------------------------------------------------------- the engine
class Engine:
    """Continuous-batching decode engine over one shared paged latent cache (module docstring).

    model: a Transformer; drafter: a DFlashDrafter (batched on the device) or any drafter with sessions
    (`session(max_len)` -> start / propose / accept on the host, e.g. the test oracle); mode "ar" | "dflash" |
    "ddtree"; budget: DDTree's draft nodes per round (1..1024 on the kernel backend). max_batch: requests per
    round; max_len: the longest context one request may reach (prompt + max_new_tokens + the block's rows;
    default the model's max_position_embeddings); max_tokens: the pool's capacity in cached rows (default
    max_batch * max_len); page_size 64 (the attention kernel's); graphs: capture each batch bucket's round in
    a CUDA graph (the kernel backend on a GPU; elsewhere the same round runs eagerly, `graph_reason` says
    why); backend "golden" (numpy tree steps) or "kernel" (CUDA), default kernel on a GPU; prefill_chunk:
    prompt rows per prefill forward; debug: check the device state against the host's after every round
    (`check_state`, a device read per round); buckets: the batch
    sizes rounds are padded to (default 1, 2, 4, ... max_batch); graph_sampling: also capture the rounds with
    sampling requests (else those run eagerly); compile: the target's and the drafter's forwards through
    torch.compile (applied from outside the model code; fuses the elementwise work between the matmuls);
    deterministic: every round runs at max_batch rows of requests (one bucket), so a request's arithmetic
    (each GEMM's shape, hence its kernel and summation order) does not depend on how many requests share its
    round: its tokens and logits are bitwise the same alone or in a full batch (the MoE runs densely on the
    CPU too). The default rounds repeat bitwise for the same batch, but a request's rounding may change with
    its batch mates (the bucket's GEMM shapes; on the CPU the MoE's grouping). Refused for INT4 experts.
    moe: the path of MLP experts, "dense" | "grouped" | "loop" (default: chosen by `_moe_path`).

    budget="auto" (DDTree; `kdtree.budget`): each round verifies AR, the chain or the tree truncated to one
    of `budgets` (default powers of two from 4 to max_budget = 256), whichever maximizes the round's
    expected tokens per second: expected tokens from the draft's prefix probabilities through `calibration`
    (default the drafter's stored table, `drafter.calibration`; False: the raw probabilities), cost from a
    table measured at start-up and refreshed every round (`costs`). decide "previous" (from the previous
    rounds' estimates, no extra sync) | "sync" (one more host sync per round, fresh estimates). makespan:
    while no request waits for a slot, or while freed slots wait for company (grouped admission, `_grouping`:
    the requests admitted together hold their slots much as a static batch does), plans are scored by the
    tokens left over the expected time until every active request has ended (`budget.drain`: a batch ends
    with its slowest request) instead of the round's expected tokens, and an AR hold's probe (of several
    requests) verifies AR's block after its draft and is not run where the batch ends before its estimates
    could serve as many rounds as the hold (`budget.Policy.before`, `_rounds_left`); False: the round's
    tokens always (for serving driven by step() where requests keep arriving, an empty queue between
    arrivals is not a batch's end).

    admission "eager" (each waiting request as soon as a slot and its pages are free) | "grouped": a freed
    slot waits for company while the idle slots' lost seconds stay below an admission's fixed cost, fitted
    from the admissions timed so far (`_due`, `admit_cost`): a MoE prefill forward reads every expert its
    rows route to, most of them once a few requests are in it, and speculative rounds end requests apart, so
    eager admission pays that fixed cost over and over. Grouping trades a waiting request's first token for
    throughput; refused under tensor parallelism.

    overlap: run() (and generate) launches each round before the previous round's bookkeeping (its one host
    copy read, stop checks, outputs), so that host work runs while the GPU computes. The launch cannot know
    the previous round's accepted lengths: it grows each request's pages for both rounds' rows, and lands the
    previous round first when a request is that near its reservation, when a waiting request can be
    admitted, or when every request ends with it. A request that finished in the previous round is carried
    by the launched one on rows nobody reads; its output is dropped. Off (each round lands before the next
    launches) under debug, a host drafter or tensor parallelism; step() always lands its own round.

    simulate: a `kdtree.simulate.Profile`: simulated acceptance (random-weight shapes; module simulate): the
    round runs every kernel at its real shape, the tree is built from the profile's drafter and the target's
    choices are drawn from the profile, so the tokens are not the model's (`simulated` names the profile).
    The simulated text is keyed by request seed and position: every mode (AR too) emits the same tokens. An
    admission tabulates its requests' texts in one pass, timed alone into `synthetic_s` (a benchmark
    device, as the synthetic context's fill: not in prefill_s)."""

    def __init__(self, model: Transformer, drafter=None, *, mode: str = "ar", budget: int | None = None,
                 max_batch: int = 8, max_len: int | None = None, max_tokens: int | None = None,
                 page_size: int = 64, graphs: bool = True, backend: str | None = None,
                 prefill_chunk: int = 512, debug: bool = False, buckets=None, graph_sampling: bool = True,
                 compile: bool = False, deterministic: bool = False, moe: str | None = None,
                 max_budget: int | None = None, budgets=None, decide: str = "previous", calibration=None,
                 simulate=None, overlap: bool = True, makespan: bool = True, admission: str = "eager"):
        if not isinstance(model, Transformer):
            raise ValueError(f"model: expected a kdtree Transformer, got {type(model).__name__}")
        checks.one_of("mode", mode, MODES)
        checks.one_of("admission", admission, ADMISSIONS)
        graphs, debug, graph_sampling, compile = (checks.flag(n, v) for n, v in (
            ("graphs", graphs), ("debug", debug), ("graph_sampling", graph_sampling), ("compile", compile)))
        if admission == "grouped" and getattr(model, "tp", None) is not None:
            raise ValueError("admission='grouped' under tensor parallelism: each rank times its own "
                             "admissions, so their decisions could part; use 'eager'")
        dev = model.device
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
        if simulate is not None and mode != "ar" and not hasattr(drafter, "new_context"):
            raise ValueError("simulate: needs mode 'ar', or 'dflash' / 'ddtree' with a batched drafter "
                             "(DFlashDrafter)")
        auto = mode == "ddtree" and isinstance(budget, str) and budget == "auto"
        if mode == "ddtree" and isinstance(budget, str) and not auto:
            raise ValueError(f"budget={budget!r}: expected 'auto' or an int in [1, {golden.MAX_BUDGET}] "
                             "(draft nodes)")
        if not isinstance(makespan, bool):
            raise ValueError(f"makespan={makespan!r}: expected True or False")
        if not auto and (max_budget is not None or budgets is not None or decide != "previous"
                         or calibration is not None or makespan is not True):
            raise ValueError("max_budget, budgets, decide, calibration and makespan: only budget='auto' "
                             "takes them")
        if auto:
            cand = self._check_auto(backend, max_budget, budgets, decide, calibration)
            budget = max(cand)
        elif mode == "ddtree":
            budget = golden._check_budget(budget)
            if backend == "kernel" and budget > 1024:
                raise ValueError(f"budget={budget}: the kernel backend supports at most 1024")
        elif budget is not None:
            raise ValueError(f"budget={budget!r}: only mode='ddtree' takes a budget")
        max_batch = checks.positive_int("max_batch", max_batch)
        prefill_chunk = checks.positive_int("prefill_chunk", prefill_chunk)
        if page_size != 64:
            raise ValueError(f"page_size={page_size!r}: the latent cache's pages are 64 rows (the attention "
                             "kernel's)")
        mpe = model.args.max_position_embeddings
        max_len = checks.int_in("max_len", mpe if max_len is None else max_len, 1, mpe,
                                f" (max_position_embeddings={mpe})")
        max_tokens = max_batch * max_len if max_tokens is None else max_tokens
        max_tokens = checks.positive_int("max_tokens", max_tokens, note=" (the pool's rows)")
        ok = buckets is None or (isinstance(buckets, (list, tuple)) and buckets and all(
            checks.is_int(x) and 1 <= x <= max_batch for x in buckets) and max(buckets) == max_batch)
        if not ok:
            raise ValueError(f"buckets={buckets!r}: expected a list of ints in [1, max_batch={max_batch}] "
                             "including max_batch")
        buckets = None if buckets is None else [int(x) for x in buckets]
        rows = 1 if mode == "ar" else drafter.block_size if mode == "dflash" else budget + 1
        cap = -(-max_len // page_size) * page_size
        if rows + 1 > min(cap, (-(-max_tokens // page_size)) * page_size):
            raise ValueError(f"{'budget' if mode == 'ddtree' else 'block_size'}: a verify block of {rows} "
                             f"rows does not fit a request of max_len={max_len} in a pool of "
                             f"max_tokens={max_tokens}")
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic={deterministic!r}: expected True or False")
        if deterministic:
            if buckets is not None and tuple(sorted(set(buckets))) != (max_batch,):
                raise ValueError(f"deterministic=True runs every round at max_batch={max_batch}: "
                                 f"buckets={buckets!r} contradicts it (leave buckets out)")
            if any(isinstance(getattr(layer.mlp, "experts", None), Int4Experts)
                   for layer in model.model.layers):
                raise ValueError("deterministic=True: INT4 experts are not supported (their paths group "
                                 "tokens by expert; the GPU kernel moe_int4 combines them with fp32 atomics)")
            buckets = (max_batch,)
        self.deterministic = deterministic
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap={overlap!r}: expected True or False")
        moe = _moe_path(model, moe, deterministic)
        self.buckets = _buckets(max_batch) if buckets is None else tuple(sorted(set(buckets)))
        self.model, self.drafter, self.mode, self.backend = model, drafter, mode, backend
        self.budget = "auto" if auto else budget   # the tree's nodes (auto: "auto"; max_budget is B_max)
        self.max_budget = budget
        self.max_batch, self.page_size = max_batch, page_size
        self.prefill_chunk, self.debug = prefill_chunk, debug
        self.device = dev
        self.rows = rows   # N: verify rows per request
        self.max_accept = 1 if mode == "ar" else drafter.block_size
        self.lookahead = 0 if mode == "ar" else self.rows
        self.max_len = max_len
        self.pages_per_req = -(-max_len // page_size)
        self.kv_cap = self.pages_per_req * page_size
        n_pages = -(-max_tokens // page_size) + 1
        a = model.args
        need = (a.num_hidden_layers * n_pages * page_size * (a.kv_lora_rank + a.qk_rope_head_dim)
                * torch.empty(0, dtype=model.cache_dtype).element_size())
        if mode != "ar" and hasattr(drafter, "new_context"):
            da = drafter.args
            need += (2 * len(drafter.layers) * max_batch * da.num_key_value_heads
                     * (self.kv_cap + da.block_size) * da.head_dim * drafter.fc.weight.element_size())
        if model.attn_impl != "kernel":  # the torch attention paths' visibility bias [B, N, kv_cap] float32
            need += max_batch * rows * self.kv_cap * 4
        check_memory(f"max_batch={max_batch}, max_len={max_len}, max_tokens={max_tokens}, {rows} verify rows "
                     "(the page pool, the drafter's context, the verify block's mask)", need, dev)
        self.pages = PagePool(n_pages)
        model.prepare_paged(moe)   # fused projections and stacked experts from the weights as they are now
        self.pool = torch.zeros(a.num_hidden_layers, self.pages.n_pages * page_size,
                                a.kv_lora_rank + a.qk_rope_head_dim, dtype=model.cache_dtype, device=dev)
        self.batched_drafter = mode != "ar" and hasattr(drafter, "new_context")
        self.layers = tuple(getattr(drafter, "target_layer_ids", ())) if mode != "ar" else ()
        self.ctx = drafter.new_context(max_batch, self.kv_cap) if self.batched_drafter else None
        self.ops = (KernelOps if backend == "kernel" else GoldenOps)(mode, self.max_budget, page_size)
        self.moe = moe
        self.compiled = bool(compile)
        # a compiled graph per shape and engine; past dynamo's default limit they would run eagerly
        if compile:
            import torch._dynamo.config as dc
            name = "recompile_limit" if hasattr(dc, "recompile_limit") else "cache_size_limit"
            setattr(dc, name, max(getattr(dc, name), 256))
        # compiled regions (compile=True): the drafter's forward, the chain build, the verify forward with its
        # metadata and choice, the commit; the tree kernels between them run as they are
        wrap = (lambda f: torch.compile(f, dynamic=False)) if compile else (lambda f: f)
        self._draft_fn = wrap(drafter.draft) if self.batched_drafter else None
        self._build = self.ops.build if mode == "ddtree" else wrap(self.ops.build)
        self._verify, self._commit = wrap(self._verify_impl), wrap(self._commit_impl)
        B = max_batch
        self.page_table = torch.zeros(B, self.pages_per_req, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.root = torch.zeros(B, dtype=torch.int64, device=dev)
        self.temp = torch.zeros(B, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(B, dtype=torch.int64, device=dev)
        # 1 in active slots: padding slots never advance
        self.live = torch.zeros(B, dtype=torch.int64, device=dev)
        # one copy to the host per round: [acc_len, logits finite, emitted tokens x max_accept]
        self.out = torch.zeros(B, 2 + self.max_accept, dtype=torch.int64, device=dev)
        # two host buffers: a launched round copies into one while the previous round's is read
        self.out_host = torch.zeros(2, *self.out.shape, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.graph_sampling = graph_sampling
        self.waiting: list[Request] = []
        self.active: list[Request] = []
        self.finished: dict[int, GenerationResult] = {}
        self.errors: dict[int, Exception] = {}
        self.prefill_forwards = 0   # target forwards spent on prompts (same-length chunks share one)
        self.prefill_s = 0.0        # wall seconds in prefill (admission to first tokens, host read included)
        self.synthetic_s = 0.0      # wall seconds of synthetic rows' fill and simulated texts (not prefill_s)
        self.prefill_replays = 0    # prefill forwards that replayed a graph
        self.prefill_phases = None  # {phase: seconds} when set to a dict (`_prefill_mark`; benchmarks)
        self.admission = admission
        self.admissions = 0         # admissions (prefills of one or more requests)
        self.last_admission = None  # the last admission's (requests, prompt rows, seconds, captured a graph)
        self._admits: list = []     # grouped: the last ADMIT_FIT clean admissions' (prompt rows, seconds)
        self._fit = None            # grouped: admit_cost's fit of _admits (None: not fitted since a change)
        self._rent = 0.0            # grouped: idle slots' seconds since admission was first deferred
        self._mark_t = 0.0
        self._pg: dict = {}         # prefill graphs: (requests, rows) -> CUDAGraph, or False (capture failed)
        self._pg_pool = self._side = None
        self._next_id = 0
        self._features = None
        self.rounds = 0
        self._stage_sum: dict = {}  # every landed round's stage seconds, summed (a request's: their change)
        # the last round's stage seconds, batch, bucket, whether a graph replayed it
        self.last_round: dict = {}
        self.graphs: dict = {}
        self._graph_logits: dict = {}
        # last round's verify logits [n, N, V], until the next (None when a graphed round landed behind
        # another in flight: its static output is being rewritten)
        self.last_logits: torch.Tensor | None = None
        self.sim = None if simulate is None else Simulation(
            simulate, model.args.vocab_size, 0 if drafter is None else drafter.block_size - 1, max_batch, dev,
            length=self.kv_cap + self.max_accept + 1)
        self.simulated = None if simulate is None else simulate.name
        self.graph_reason = self._graph_blocker() if graphs else "graphs=False"
        self.overlap = (overlap and not debug and (mode == "ar" or self.batched_drafter)
                        and getattr(model, "tp", None) is None)
        self._flight: _Flight | None = None   # the launched round whose bookkeeping waits (overlap)
        self._launched = 0                    # rounds launched (their event slots and host buffers)
        self._landed_at: float | None = None  # host time the last round landed while the next was in flight
        self.warmup_s = 0.0
        self.capture_retries: list[str] = []
        self.whole_graphs: bool | str = False   # budget="auto": whole-round graphs captured, or why not
        self.whole_replays = 0                  # budget="auto": rounds that replayed one
        self.auto = None
        self._timing: list = []   # budget="auto": rounds whose phase times wait for _auto_flush
        self.pend, self.pend_n = None, torch.zeros(B, dtype=torch.int64, device=dev)
        self._pending = 0   # budget="auto": AR plan rounds since the last catch-up (host count)
        self._ahead = None  # budget="auto": the next round's decision, made while this round's GPU work runs
        if auto:
            L = drafter.block_size - 1
            plans = auto_budget.plans(L, cand)
            cal = (None if simulate is not None or calibration is False else  # a profile is its own truth
                   getattr(drafter, "calibration", None) if calibration is None else calibration)
            ctxs = (0,) if self.graph_reason else tuple(
                c for c in auto_budget.CTX_BUCKETS if c + self.rows <= self.kv_cap)
            costs = auto_budget.CostTable(ctxs, auto_budget.larger_trees(plans))
            self.auto = auto_budget.Policy(plans, costs, decide)
            self.plans, self.costs, self.calibration = plans, costs, cal
            self.makespan, self._longest = makespan, auto_budget.longest_accepts(plans, L)
            self.acceptance = auto_budget.Acceptance(cal, L, dev)
            self.est = torch.zeros(B, len(plans), dtype=torch.float32, device=dev)
            self.est_host = torch.zeros(2, *self.est.shape, dtype=torch.float32,
                                        pin_memory=dev.type == "cuda")
            self._prior = None   # the mean estimates of the requests so far (for a request not yet drafted)
            self.spread = auto_budget.Spread(len(plans))   # drafted rounds' accept lengths about estimates
            # a tree round's walked path (the accepted rows, -1 past its end) [B, A], to the host with its
            # estimates: `_land` reads there the accept length on every truncation of the round's tree
            # (`truncated_accepts`; rows [P], 0 for a plan no tree truncates: AR, the chain)
            rows = [p.rows if p.kind == "tree" else 0 for p in plans]
            self._cut_rows = torch.tensor(rows, dtype=torch.long)
            self._cut_plans = {i: [j for j, r in enumerate(rows) if 0 < r <= p.rows]   # the trees within i's
                               for i, p in enumerate(plans) if p.kind == "tree"}
            self.paths = torch.full((B, self.max_accept), -1, dtype=torch.int32, device=dev)
            self.paths_host = torch.zeros(2, *self.paths.shape, dtype=torch.int32,
                                          pin_memory=dev.type == "cuda")
            self.persist = auto_budget.Persistence()        # ... and how long an estimate holds
            Ops = KernelOps if backend == "kernel" else GoldenOps
            self._tree_ops = {B: Ops("ddtree", B, page_size) for B in cand}
            self._fbuf: _Front | None = None   # the front phase's outputs, static (allocated by the first)
            # AR plan rounds leave the drafter's context behind: their rows' target features wait in `pend`
            # [B, MAX_HOLD, F] (pend_n [B] per slot) until the next drafting round's catch-up extends it
            self.pend = (torch.zeros(B, auto_budget.MAX_HOLD, len(self.layers) * a.hidden_size,
                                     dtype=model.dtype, device=dev) if self.batched_drafter else None)
        if self.graph_reason is None:
            self._capture()
            self._prefill_buffers()
        if auto:
            self._measure_costs()
            self.auto.widen(self.buckets)
            self._capture_whole()

    def _check_auto(self, backend, max_budget, budgets, decide, calibration) -> tuple[int, ...]:
        """budget="auto"'s arguments, checked; returns the candidate tree sizes (ascending)."""
        from .calibration import Calibration
        top = 1024 if backend == "kernel" else golden.MAX_BUDGET
        if max_budget is not None:
            max_budget = checks.int_in("max_budget", max_budget, 1, top,
                                       f" (the {backend} backend's ceiling)")
        if budgets is None:
            cand = auto_budget.default_budgets(256 if max_budget is None else max_budget)
        else:
            ok = isinstance(budgets, (list, tuple)) and len(budgets) > 0 and all(
                checks.is_int(x) and 1 <= x <= (top if max_budget is None else max_budget) for x in budgets)
            if not ok:
                raise ValueError(f"budgets={budgets!r}: expected a non-empty list of tree sizes (ints) in "
                                 f"[1, {top if max_budget is None else max_budget}]")
            cand = tuple(sorted({int(x) for x in budgets}))
            if max_budget is not None and max(cand) != max_budget:
                raise ValueError(f"budgets={budgets!r}: the largest must be max_budget={max_budget} (the "
                                 "largest tree a round builds), or leave max_budget out")
        checks.one_of("decide", decide, auto_budget.DECIDE)
        if not (calibration is None or calibration is False or isinstance(calibration, Calibration)):
            raise ValueError(f"calibration={calibration!r}: expected a kdtree.calibration.Calibration, False "
                             "(the drafter's raw probabilities) or None (the drafter's stored table)")
        return cand

    # ------------------------------------------------------------- public API
    def add_request(self, prompt, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                    stop_tokens=(), synthetic_context: int = 0) -> int:
        """Queue a request; returns its id. Every argument is checked here (nothing changes on a ValueError).
        synthetic_context: for benchmarks at long contexts, that many random rows (latent cache rows
        N(0, 0.5), the drafter's context keys/values N(0, 1)) are inserted before the root once the prompt is
        prefilled, instead of prefilling them: the request's tokens then mean nothing. Their fill is a
        benchmark device, not a cost of serving: it runs between two device synchronizations and its time
        goes to `synthetic_s`, not to `prefill_s` or the request's prefill stage time."""
        return self._queue(self._request(prompt, max_new_tokens, temperature, seed, stop_tokens,
                                         synthetic_context))

    def _request(self, prompt, max_new_tokens, temperature, seed, stop_tokens, synthetic_context,
                 what: str = "prompt") -> Request:
        """add_request's arguments checked into a Request (id -1, not queued); `what` names the prompt."""
        prompt = checks.token_list(what, prompt, self.model.args.vocab_size)
        max_new = check_max_new(max_new_tokens)
        temperature = check_temperature(temperature)
        seed = check_seed(seed)
        stop = check_stop(stop_tokens, self.model.args.vocab_size)
        synthetic = checks.int_in("synthetic_context", synthetic_context, 0)
        if synthetic and self.mode != "ar" and not self.batched_drafter:
            raise ValueError("synthetic_context: a host drafter keeps its own context; use mode 'ar' or the "
                             "batched DFlash drafter")
        need = len(prompt) + synthetic + max_new + self.lookahead
        mpe = self.model.args.max_position_embeddings
        if need > mpe:
            raise ValueError(f"context overflow: {what} ({len(prompt)}) + max_new_tokens ({max_new}) + draft "
                             f"lookahead ({self.lookahead}) = {need} > max_position_embeddings ({mpe})")
        if need > self.max_len:
            raise ValueError(f"context overflow: {what} ({len(prompt)}) + max_new_tokens ({max_new}) + draft "
                             f"lookahead ({self.lookahead}) = {need} > the engine's max_len ({self.max_len})")
        reserve = -(-need // self.page_size)
        if reserve > self.pages.capacity:
            raise ValueError(f"{what} + max_new_tokens: {need} rows need {reserve} pages, the pool has "
                             f"{self.pages.capacity} (max_tokens)")
        return Request(-1, prompt, max_new, temperature, seed, stop, GenerationResult([], self.mode), reserve,
                       synthetic=synthetic)

    def _queue(self, req: Request) -> int:
        """A checked Request into the waiting queue under the next id; returns the id."""
        req.rid = self._next_id
        self._next_id += 1
        self.waiting.append(req)
        return req.rid

    def step(self, overlap: bool = False) -> dict[int, list[int]]:
        """Admit what fits, then one round for every active request. Returns {request id: tokens emitted}.
        A request whose logits turn non-finite (or whose prefill fails) leaves alone, its pages freed; step()
        then raises ValueError naming it, after the other requests' bookkeeping, and the next call goes on.
        overlap=True (run()'s schedule; honoured when the engine's `overlap` is on): launch this round, then
        land the round launched by the previous call while the GPU runs it, so the tokens returned are that
        round's; a round in flight lands first when a request can join. A plain step() lands any round in
        flight, then its own."""
        emitted: dict[int, list[int]] = {}
        overlap = overlap and self.overlap
        if self._flight is not None and (not overlap or self._admissible() or not self._can_overlap()):
            self._drain(emitted)
        if self._due():
            self._admit(emitted)
        if self.active:
            prev, self._flight = self._flight, self._launch()
            if prev is not None:
                self._land(prev, emitted)
            if not overlap:
                self._drain(emitted)
        else:
            self._drain(emitted)
        self._raise_errors()
        return emitted

    def run(self, progress: bool = False) -> dict[int, GenerationResult]:
        """Step until every request has finished (overlapped rounds when `overlap` is on); returns {request
        id: result} of every request finished since the last run() (also those that finished in step() calls
        before it), each handed out once."""
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(self.waiting) + len(self.active), desc=f"engine {self.mode}")
        while self.waiting or self.active or self._flight is not None:
            n = len(self.finished)
            self.step(overlap=True)
            if bar is not None:
                bar.update(len(self.finished) - n)
        if bar is not None:
            bar.close()
        out, self.finished = self.finished, {}
        return out

    def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 stop_tokens=()) -> list[GenerationResult]:
        """One request per prompt (request i seeded seed + i), run to the end; results in prompt order. Every
        prompt and seed is checked before any request is queued (a ValueError queues nothing). Requests queued
        earlier with add_request run alongside; their results stay for the next run()."""
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts: expected a list of prompts (each a sequence of token ids), got "
                             f"{type(prompts).__name__}")
        seed = check_seed(seed)
        if prompts:
            check_seed(seed + len(prompts) - 1)   # request i's seed is seed + i
        reqs = [self._request(p, max_new_tokens, temperature, seed + i, stop_tokens, 0, what=f"prompts[{i}]")
                for i, p in enumerate(prompts)]
        ids = [self._queue(r) for r in reqs]
        res = self.run()
        own = [res.pop(i) for i in ids]
        self.finished.update(res)   # others' results: handed out by the next run()
        return own

    @property
    def free_pages(self) -> int:
        return len(self.pages.free)

    @property
    def in_flight(self) -> bool:
        """A round launched by step(overlap=True) waits to land (the next step, or run(), lands it)."""
        return self._flight is not None

    def _drain(self, emitted) -> None:
        f, self._flight = self._flight, None
        if f is not None:
            self._land(f, emitted)
        self._landed_at = None

    def _admissible(self) -> bool:
        return bool(self.waiting and len(self.active) < self.max_batch
                    and self.pages.can_reserve(self.waiting[0].reserve)) and self._due()

    def _due(self) -> bool:
        """Whether to admit now. "eager": always (each waiting request as soon as a slot and its pages are
        free). "grouped" (ski rental): an admission costs a fixed time (`admit_cost`; a MoE prefill forward
        reads every expert its rows route to, most of them once a few requests are in it) on top of its rows,
        and stalls every slot meanwhile; a free slot left idle loses its share of a round. So a freed slot
        waits for company until the idle slots' seconds (`_rent`, `_bill`: each round's idle slots' share of
        its wall time) reach that fixed time: the rounds lost to waiting never cost more than the admission
        they save. It admits at once while no request is active, where every waiting request has a slot
        already, until an admission has been timed, and in a deterministic engine (each request prefills
        alone: grouping saves no forward). The saving assumes the group's prompts share their chunks'
        forwards (same-length chunks, `_prefill`), as a benchmark's equal prompts do."""
        free = self.max_batch - len(self.active)
        if (self.admission == "eager" or self.deterministic or not self.active
                or free >= len(self.waiting)):
            return True
        fit = self.admit_cost()
        return fit is None or self._rent >= fit[0]

    def _grouping(self) -> bool:
        """Whether freed slots wait for company (`_due`): grouped admission in an engine that is not
        deterministic, once an admission has been timed. The requests admitted together then end much as a
        static batch does (`_expected`, `_rounds_left`)."""
        return self.admission == "grouped" and not self.deterministic and self.admit_cost() is not None

    def _end_in_view(self) -> bool:
        """Whether the active requests' end is the batch's end the policy plans for (makespan on, and no
        request waiting for a slot it would take as soon as it frees: `_grouping`)."""
        return self.makespan and not (self.waiting and not self._grouping())

    def _bill(self, live: int, wall: float) -> None:
        """Grouped admission: add a round's idle slots' share of its wall time to the rent. A round's time
        hardly depends on its rows (it streams the weights once), so an idle slot loses 1 / max_batch of a
        full round's tokens, which a full round makes up in that share of its time."""
        self._rent += (self.max_batch - live) * wall / self.max_batch

    def admit_cost(self) -> tuple[float, float] | None:
        """Grouped admission: (fixed seconds, seconds per prompt row) of an admission, least squares over the
        last ADMIT_FIT admissions that captured no prefill graph and lost no request (both at least 0); while
        they all have the same rows, (their median seconds, 0): the fixed cost's bound; None before the
        first."""
        if not self._admits:
            return None
        if self._fit is None:   # refitted only when an admission was added
            x, y = np.array(self._admits, np.float64).T
            if len(set(x.tolist())) < 2:
                self._fit = float(np.median(y)), 0.0
            else:
                (f, c), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
                self._fit = max(float(f), 0.0), max(float(c), 0.0)
        return self._fit

    def _can_overlap(self) -> bool:
        """Whether the next round may launch before the one in flight lands: every active request's rows of
        both rounds (the flight's accepted rows, unknown on the host, and the next block's) fit its
        reservation, and not every request ends with the flight (each emits at least one token a round), as
        then the launched round would be wasted."""
        room = self.max_accept + self.rows
        return (all(r.length + room <= r.reserve * self.page_size for r in self.active)
                and not all(len(r.result.tokens) + 1 >= r.max_new for r in self.active))

    # ------------------------------------------------------------- admission and prefill
    def _admit(self, emitted) -> None:
        new = []
        while (self.waiting and len(self.active) < self.max_batch
               and self.pages.can_reserve(self.waiting[0].reserve)):
            r = self.waiting.pop(0)
            self.pages.reserved += r.reserve
            r.slot = len(self.active)
            r.stage0, r.rounds0 = dict(self._stage_sum), self.rounds
            self.active.append(r)
            new.append(r)
        if new:
            self._rent = 0.0
            graphs, t0 = len(self._pg), self.prefill_s
            self._prefill(new, emitted)
            rows, secs = sum(len(r.prompt) for r in new), self.prefill_s - t0
            captured = len(self._pg) != graphs
            self.admissions += 1
            self.last_admission = (len(new), rows, secs, captured)
            # a capture's time is not an admission's cost, nor is a failed request's cut-short prefill
            if (self.admission == "grouped" and not captured
                    and not any(r.rid in self.errors for r in new)):
                self._admits, self._fit = (self._admits + [(rows, secs)])[-ADMIT_FIT:], None

    def _grow(self, r: Request, rows: int) -> None:
        """Give request r pages for cache rows [0, rows), all or none (RuntimeError beyond its reservation).
        Their page-table entries go in one copy that does not wait for the device (from pinned memory on a
        GPU): item assignment of a host number copies it from pageable memory and synchronizes the stream,
        which under overlap waits for the round in flight."""
        have = len(r.pages)
        need = -(-rows // self.page_size) - have
        if need <= 0:
            return
        if have + need > r.reserve:
            raise RuntimeError(f"request {r.rid}: needs page {r.reserve + 1} of a reservation of {r.reserve}")
        new = [self.pages.take() for _ in range(need)]
        src = torch.tensor(new, dtype=self.page_table.dtype)
        if self.device.type == "cuda":
            src = src.pin_memory()
        self.page_table[r.slot, have:have + need].copy_(src, non_blocking=True)
        r.pages += new

    def _prefill(self, reqs: list[Request], emitted) -> None:
        """The admitted requests' prompts, chunk by chunk: one forward per chunk for every request whose chunk
        has the same length (so same-length prompts share each forward; deterministic engines prefill each
        request alone, keeping a request's arithmetic independent of its batch mates), then each request's
        first token from one batched choice. A request that fails (its pages, or non-finite logits) leaves
        alone; the others' slots stay put until every prefill forward is done."""
        self._prefill_mark(None)
        t0 = time.perf_counter()
        dev, leave, ok, synth = self.device, [], [], 0.0
        for r in reqs:
            r.t0, r.syn0 = t0, self.synthetic_s
            try:
                self._grow(r, len(r.prompt))
            except Exception as e:
                self.errors[r.rid] = e
                leave.append(r)
                continue
            r.committed = list(r.prompt)
            ok.append(r)
        self._prefill_mark("pages")
        feats = {r.rid: [] for r in ok}
        last = {}
        for c0 in range(0, max((len(r.prompt) for r in ok), default=0), self.prefill_chunk):
            groups: dict = {}
            for r in ok:
                T = min(self.prefill_chunk, len(r.prompt) - c0)
                if T > 0:
                    groups.setdefault(r.rid if self.deterministic else T, []).append(r)
            for group in groups.values():
                try:
                    self._prefill_chunk(group, c0, feats, last)
                except Exception as e:  # these requests fail alone; the batch in flight is untouched
                    for r in group:
                        self.errors[r.rid] = e
                        leave.append(r)
                        ok.remove(r)
        if ok:
            logits = torch.stack([last[r.rid] for r in ok])                                 # [n, V]
            finite = all_finite(logits)
            pos = torch.tensor([len(r.prompt) - 1 for r in ok], device=dev)
            first = choose(logits[:, None], torch.tensor([r.temperature for r in ok], device=dev),
                           torch.tensor([r.seed for r in ok], device=dev), pos,
                           any(r.temperature > 0 for r in ok))[:, -1]
            both = torch.stack([finite.long(), first]).tolist()                             # one host read
            self._prefill_mark("first")
        for i, r in enumerate(ok):
            if not both[0][i]:
                self.errors[r.rid] = ValueError("target logits: NaN or inf in verify row(s) [0] of the "
                                                "prefill: the target's weights or inputs are not finite")
                leave.append(r)
                continue
            tok, s, P = both[1][i], r.slot, len(r.prompt)
            if self.mode != "ar" and not self.batched_drafter:
                r.session = self.drafter.session(self.kv_cap)
                r.session.start(r.prompt, torch.cat(feats[r.rid]) if feats[r.rid] else None)
            for t, v in ((self.root, tok), (self.lens, P), (self.temp, r.temperature), (self.seed, r.seed),
                         (self.live, 1)):
                t[s].fill_(v)   # a fill kernel: item assignment would copy from the host and synchronize
            r.length = P
            r.committed.append(tok)
            if r.synthetic:   # timed alone: the device idle before and after
                self._prefill_mark("requests")
                self._sync()
                ts = time.perf_counter()
                self._synthesize(r)
                self._sync()
                synth += time.perf_counter() - ts
                self._prefill_mark(None)
            r.result.stage_times["prefill"] += time.perf_counter() - t0 - synth
            emitted[r.rid] = [tok]
            if finish(r.result.tokens, [tok], r.max_new, r.stop):
                leave.append(r)
        self._prefill_mark("requests")
        if self.sim is not None and ok:   # the simulated texts, timed alone as the fill is (set-up, not work)
            self._sync()
            ts = time.perf_counter()
            live = [r for r in ok if r.rid not in self.errors]
            self.sim.write([r.slot for r in live], [r.seed for r in live])
            self._sync()
            synth += time.perf_counter() - ts
            self._prefill_mark(None)
        self.synthetic_s += synth   # before any release: a request ending here leaves its fill out too
        for r in sorted(leave, key=lambda r: -r.slot):  # slots move only now, the highest first
            self._release(r)
        self._prefill_mark("release")
        self.prefill_s += time.perf_counter() - t0 - synth

    def _prefill_mark(self, phase: str | None) -> None:
        """With `prefill_phases` a dict: synchronize the device, then add the seconds since the last mark to
        `phase` (None: a start, or the end of an untimed span such as the synthetic fill). The phases:
        pages, forward (the target's prompt forwards), drafter (its context from their features), first
        (the first tokens' choice and host read), requests (the per-request bookkeeping), release. Off (None,
        the default) it does nothing: no synchronization is added."""
        if self.prefill_phases is None:
            return
        self._sync()
        now = time.perf_counter()
        if phase is not None:
            self.prefill_phases[phase] = self.prefill_phases.get(phase, 0.0) + now - self._mark_t
        self._mark_t = now

    def _prefill_chunk(self, group: list[Request], c0: int, feats: dict, last: dict) -> None:
        """Prompt rows [c0, c0 + T) of every request in `group` (all of one chunk length T) in one forward."""
        dev, n = self.device, len(group)
        T = min(self.prefill_chunk, len(group[0].prompt) - c0)
        slots = torch.tensor([r.slot for r in group], device=dev)
        start = torch.full((n,), c0, device=dev)
        tokens = torch.tensor([r.prompt[c0:c0 + T] for r in group], device=dev)              # [n, T]
        logits, f = self._prefill_forward(tokens, self.page_table[slots], start)
        for i, r in enumerate(group):
            r.result.target_forwards += 1
            if c0 + T == len(r.prompt):
                last[r.rid] = logits[i].clone()
        self.prefill_forwards += 1
        self._prefill_mark("forward")
        if f is None:
            return
        count = torch.full((n,), T, device=dev)
        if self.batched_drafter:
            first = group[0].slot
            if [r.slot for r in group] == list(range(first, first + n)):  # admitted together: adjacent slots
                self.drafter.extend(self.ctx, f, start, count, slot=first)
            else:
                for i, r in enumerate(group):
                    self.drafter.extend(self.ctx, f[i:i + 1], start[i:i + 1], count[i:i + 1], slot=r.slot)
        else:
            for i, r in enumerate(group):
                feats[r.rid].append(f[i].clone())
        self._prefill_mark("drafter")

    def _prefill_eager(self, tokens, page_table, start):
        """tokens [n, T] at positions start[b] + j written into the pool through page_table [n, P]; returns
        the last rows' logits [n, V] float32 and the drafter's features [n, T, F] (None in mode ar)."""
        dev, (n, T) = self.device, tokens.shape
        mask = torch.ones(n, T, T, dtype=torch.bool, device=dev).tril()
        meta = PagedMeta.build(page_table, start, start[:, None] + torch.arange(T, device=dev), mask,
                               self.page_size, self.model.attn_impl, self.moe)
        with _blas(dev, n * T):
            out = self.model.forward_paged(tokens, self.pool, meta, self.layers, logits_for=slice(T - 1, T))
        f = torch.cat([out.hidden[i] for i in self.layers], -1) if self.layers else None
        return out.logits[:, -1], f

    def _prefill_forward(self, tokens, page_table, start):
        """_prefill_eager's contract; a replay of the shape's graph once it has one (the outputs are then the
        static buffers' views, rewritten by the next prefill forward)."""
        n, T = tokens.shape
        key = (n, T)
        g = self._pg.get(key)
        if not g:
            out = self._prefill_eager(tokens, page_table, start)
            if (g is None and self.graphs and n * T <= self._pg_tok.numel()
                    and sum(1 for v in self._pg.values() if v) < PREFILL_GRAPHS):
                self._pg[key] = self._capture_prefill(n, T)
            return out
        self._pg_tok[:n * T].view(n, T).copy_(tokens)
        self._pg_pt[:n].copy_(page_table)
        self._pg_start[:n].copy_(start)
        g.replay()
        self.prefill_replays += 1
        f = None if self._pg_feat is None else self._pg_feat[:n * T].view(n, T, -1)
        return self._pg_logits[:n], f

    def _prefill_buffers(self) -> None:
        """The prefill graphs' static inputs and outputs, allocated once (so serving new prompt shapes leaves
        torch.cuda.memory_allocated as it was)."""
        dev, a, B = self.device, self.model.args, self.max_batch
        rows = min(PREFILL_GRAPH_ROWS, B * self.prefill_chunk)
        self._pg_tok = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._pg_pt = torch.zeros_like(self.page_table)
        self._pg_start = torch.zeros(B, dtype=torch.int64, device=dev)
        self._pg_logits = torch.zeros(B, a.vocab_size, dtype=torch.float32, device=dev)
        self._pg_feat = (torch.zeros(rows, len(self.layers) * a.hidden_size, dtype=self.model.dtype,
                                     device=dev)
                         if self.layers else None)

    def _capture_prefill(self, n: int, T: int):
        """A graph of _prefill_eager over the static buffers' first n requests and n x T rows (all prefill
        graphs share one memory pool: their outputs are copied to the static buffers, so the pool holds
        temporaries only); False where the capture fails (that shape then runs eagerly)."""
        tok, pt, st = self._pg_tok[:n * T].view(n, T), self._pg_pt[:n], self._pg_start[:n]
        cur = torch.cuda.current_stream(self.device)
        self._side.wait_stream(cur)
        g = torch.cuda.CUDAGraph()
        if self._pg_pool is None:   # the id known before the capture, so a failed one can end its pool
            self._pg_pool = torch.cuda.graph_pool_handle()
        try:
            with _capturing(g, self._pg_pool, self._side):
                logits, f = self._prefill_eager(tok, pt, st)
                self._pg_logits[:n].copy_(logits)
                if f is not None:
                    self._pg_feat[:n * T].view(n, T, -1).copy_(f)
        except RuntimeError as e:  # torch.AcceleratorError is one
            torch.cuda.synchronize(self.device)
            _end_pool(self.device, self._pg_pool)
            self._pg_pool = None
            self.capture_retries.append(f"prefill {(n, T)}: {str(e).splitlines()[0][:120]}")
            return False
        finally:
            cur.wait_stream(self._side)
        return g

    @torch.no_grad()
    def _synthesize(self, r: Request) -> None:
        """r.synthetic random rows at positions [length, length + C) before the root (add_request)."""
        C, s, L0 = r.synthetic, r.slot, r.length
        self._grow(r, L0 + C)
        g = torch.Generator(device=self.device).manual_seed(r.seed * 7919 + r.rid)
        rows = torch.arange(L0, L0 + C, device=self.device)
        slots = self.page_table[s].long()[rows // self.page_size] * self.page_size + rows % self.page_size
        a = self.model.args
        self.pool[:, slots] = (0.5 * torch.randn(a.num_hidden_layers, C, self.pool.shape[-1], generator=g,
                                                 device=self.device)).to(self.pool.dtype)
        if self.ctx is not None:
            for t in self.ctx.k + self.ctx.v:
                t[s, :, L0:L0 + C] = torch.randn(t.shape[1], C, t.shape[3], generator=g,
                                                 device=self.device).to(t.dtype)
        self.lens[s] += C
        r.length += C
        r.committed[-1:-1] = [0] * C

    def _release(self, r: Request) -> None:
        """r leaves: its pages go back, the last active request takes its slot."""
        self.pages.give_back(r.pages, r.reserve - len(r.pages))
        s, last = r.slot, len(self.active) - 1
        if s != last:
            m = self.active[last]
            for t in (self.page_table, self.lens, self.root, self.temp, self.seed, self.live):
                t[s] = t[last]
            if self.ctx is not None:
                self.ctx.move(last, s)
            if self.sim is not None:
                self.sim.move(last, s)
            if self.auto is not None and self.pend is not None:
                self.pend[s], self.pend_n[s] = self.pend[last], self.pend_n[last]
            m.slot = s
            self.active[s] = m
        self.active.pop()
        for t in (self.page_table, self.lens, self.root, self.temp, self.live):
            t[last].fill_(0)   # fill kernels, no host synchronization (as in `_grow`)
        if self.auto is not None and self.pend is not None:
            self.pend_n[last].fill_(0)
        r.result.wall_time = time.perf_counter() - r.t0 - (self.synthetic_s - r.syn0)
        res, was = r.result, r.stage0 or {}
        res.target_forwards += self.rounds - r.rounds0   # the rounds landed while it was active
        for key, v in self._stage_sum.items():
            res.stage_times[key] = res.stage_times.get(key, 0.0) + v - was.get(key, 0.0)
        r.slot = -1
        if r.rid not in self.errors:
            self.finished[r.rid] = r.result

    def _raise_errors(self) -> None:
        if self.errors:
            rid, e = next(iter(self.errors.items()))
            del self.errors[rid]
            raise ValueError(f"request {rid}: {e}") from e

    # ------------------------------------------------------------- the round
    def _graph_blocker(self) -> str | None:
        if self.device.type != "cuda":
            return "graphs need a CUDA device"
        if not self.ops.capturable:
            return "the golden backend's tree steps run on the host"
        if self.mode != "ar" and not self.batched_drafter:
            return "a host drafter (sessions) drafts on the host"
        for layer in self.model.model.layers:
            ex = getattr(layer.mlp, "experts", None)
            if isinstance(ex, Int4Experts) and self.model.dtype != torch.bfloat16:
                return "INT4 experts outside bf16 take the host-driven reference path"
        if getattr(self.model, "tp", None) is not None:
            return "tensor-parallel ranks run eagerly"
        if self.moe == "loop" and any(isinstance(getattr(layer.mlp, "experts", None), nn.ModuleList)
                                      for layer in self.model.model.layers):
            return "moe='loop' reads the routing on the host"
        return None

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _round(self, b: int, sampling: bool, clock=None, plan=None) -> torch.Tensor:
        """One round over slots [0, b) on the device (no host reads unless the backend is golden or the
        drafter is a host one). clock(stage) marks the end of a stage when profiling. budget="auto": the
        second phase only, verifying `plan`'s block (`_front` drafted and built it into the static buffers;
        AR: the root alone). Returns the verify logits [b, N, V] float32 (inside a graph: its static output,
        rewritten by every replay)."""
        mark = clock or (lambda stage: None)
        dev, A = self.device, self.max_accept
        root, lens = self.root[:b], self.lens[:b]
        if plan is None:
            with _blas(dev, b * A):
                draft = self._draft(b)
            mark("draft")
            blk = self._build(draft, root, lens)
            mark("build")
        elif plan.kind == "ar":
            blk = _chain(None, root, lens)
        else:
            front = self._front_view(b)
            blk = (_chain(None, root, lens, front.chain) if plan.kind == "chain" else
                   truncate(front.blk, plan.rows))
        N = blk.tokens.shape[1]
        with _blas(dev, b * N):
            logits, choice, feats, finite = self._verify(blk.tokens, blk.positions, blk.mask,
                                                         blk.mask_words, b, sampling)
        mark("verify")
        if self.sim is None:
            acc, acc_len, bonus = self.ops.walk(blk.tokens, blk.parents, choice, A)
        else:  # the profile's target: its true tokens decide the walk
            sim = self.sim.choice(self.sim.truth(lens, A), blk.positions, lens)
            acc, acc_len, _ = self.ops.walk(blk.tokens, blk.parents, sim, A)
            bonus = self.sim.bonus(sim, choice, acc, acc_len)
        if plan is not None and plan.kind == "tree" and self.auto.decide == "previous":   # what `_land` reads
            self.paths[:b] = acc
        mark("walk")
        if N > 1:
            self.ops.compact(self.pool, self.page_table[:b], self.lens[:b], acc, acc_len)
        with _blas(dev, b * A):
            self._features = self._commit(blk.tokens, feats, acc, acc_len, bonus, finite, b,
                                          plan is not None and plan.kind == "ar" and self.pend is not None)
        mark("commit")
        return logits

    def _front(self, b: int, build: int, clock=None) -> None:
        """budget="auto", a drafting round's first phase over slots [0, b): draft, the tree of `build` nodes,
        the chain, into the static buffers (`_front_view`), and every plan's expected tokens into `est`
        [b, P] (plans beyond the tree: extrapolated, `budget.expected`). No host reads (the golden backend's
        aside)."""
        mark = clock or (lambda stage: None)
        with _blas(self.device, b * self.max_accept):
            draft = self._draft(b)                                                        # [b, L, V]
        mark("draft")
        ops = self._tree_ops[build]
        blk = ops.build(draft, self.root[:b], self.lens[:b])
        chain = ops.estimates(self.acceptance, blk, draft, self.plans, self.est[:b])      # [b, L]
        if self._fbuf is None:  # the first front phase runs eagerly (a warm-up round or an eager engine)
            def room(t, *shape):
                return None if t is None else torch.zeros(self.max_batch, *shape, dtype=t.dtype,
                                                          device=t.device)
            N, W = self.rows, -(-self.rows // 32)
            cols = [room(getattr(blk, f), N) for f in ("tokens", "positions", "parents")]
            self._fbuf = _Front(type(blk)(*cols, room(blk.mask, N, N), room(blk.mask_words, N, W),
                                          room(blk.depths, N), room(blk.scores, N)),
                                room(chain, chain.shape[1]))
        F, N = self._fbuf.blk, blk.tokens.shape[1]
        for f in ("tokens", "positions", "parents", "depths", "scores"):
            getattr(F, f)[:b, :N].copy_(getattr(blk, f))
        if blk.mask is not None:
            F.mask[:b, :N, :N].copy_(blk.mask)
        if blk.mask_words is not None:
            F.mask_words[:b, :N, :blk.mask_words.shape[2]].copy_(blk.mask_words)
        self._fbuf.chain[:b].copy_(chain)
        mark("build")

    def _catchup(self, b: int) -> None:
        """The AR plan rounds' waiting rows into the drafter's context over slots [0, b): pend_n[s] rows at
        positions lens[s] - pend_n[s] ... lens[s] - 1; the counts zeroed. No host reads."""
        lens, n = self.lens[:b], self.pend_n[:b]
        self.drafter.extend(self.ctx, self.pend[:b], lens - n, n)
        n.zero_()

    def _front_view(self, b: int) -> _Front:
        F = self._fbuf.blk
        cut = (lambda t: None if t is None else t[:b])
        names = ("tokens", "positions", "parents", "mask", "mask_words", "depths", "scores")
        return _Front(type(F)(*(cut(getattr(F, f)) for f in names)), self._fbuf.chain[:b])

    def _verify_impl(self, tokens, positions, mask, mask_words, b: int, sampling: bool):
        """The target's forward over the blocks and its choice per row. tokens int32 [b, N] -> logits float32
        [b, N, V], choice int [b, N], the drafter's features [b, N, F] (None in AR), finite bool [b] (every
        logit of the request finite)."""
        lens = self.lens[:b]
        meta = PagedMeta.build(self.page_table[:b], lens, positions, mask, self.page_size,
                               self.model.attn_impl, self.moe, mask_words)
        out = self.model.forward_paged(tokens.long(), self.pool, meta, self.layers)
        choice = choose(out.logits, self.temp[:b], self.seed[:b], lens, sampling)
        feats = torch.cat([out.hidden[i] for i in self.layers], -1) if self.layers else None   # [b, N, F]
        return out.logits, choice, feats, all_finite(out.logits).all(-1)

    def _commit_impl(self, tokens, feats, acc, acc_len, bonus, finite, b: int, defer: bool = False):
        """The accepted rows' features to the drafter's context (defer, an AR plan's round: to `pend`, for the
        next catch-up), the round's output row per request (acc_len, finite, emitted tokens), lengths and
        roots advanced. Returns the accepted features [b, A, F] for a host drafter (else None)."""
        lens, root = self.lens[:b], self.root[:b]
        if feats is not None and self.batched_drafter and defer:
            # AR's block: its one row (the root, always accepted) a request; padding slots do not count it
            slot = torch.arange(b, device=feats.device)
            self.pend[slot, self.pend_n[:b]] = feats[:, 0].to(self.pend.dtype)
            self.pend_n[:b] += self.live[:b]
            feats = None
        if feats is not None:
            rows = acc.long().clamp_min(0)
            feats = feats.gather(1, rows[..., None].expand(-1, -1, feats.shape[-1]))          # [b, A, F]
            if self.batched_drafter:
                self.drafter.extend(self.ctx, feats, lens, acc_len)
                feats = None
        A = self.max_accept
        emit = tokens.long().gather(1, acc.long().clamp_min(0)[:, 1:]) if A > 1 else \
            torch.zeros(b, 0, dtype=torch.long, device=root.device)
        emit = torch.cat([emit, torch.zeros_like(bonus)[:, None]], 1)
        emit.scatter_(1, (acc_len.long() - 1)[:, None], bonus[:, None])
        self.out[:b, 0] = acc_len
        self.out[:b, 1] = finite
        self.out[:b, 2:] = emit
        live = self.live[:b]
        lens += acc_len * live
        root.copy_(bonus * live)  # padding slots keep root 0 and length 0: the same inputs every round
        return feats

    def _draft(self, b: int):
        if self.mode == "ar":
            return None
        if self.batched_drafter:
            d = self._draft_fn(self.ctx, self.root[:b], self.lens[:b])
            # the drafter ran; the profile's draft
            return d if self.sim is None else self.sim.draft(self.lens[:b])
        rows = [r.session.propose(r.committed).to(self.device).float() for r in self.active]
        if not rows:  # a round on padding slots only (budget="auto"'s start-up timing)
            return torch.zeros(b, self.max_accept - 1, self.model.args.vocab_size, device=self.device)
        d = torch.stack(rows)
        if b > len(rows):
            d = torch.cat([d, torch.zeros(b - len(rows), *d.shape[1:], device=self.device)])
        return d

    def _capture_graph(self, key, fn):
        """Warm fn up twice, then capture it as graph `key` on the side stream into the engine's shared memory
        pool (a capture the GPU refuses is tried again in a fresh pool, which the graphs after it share, up to
        CAPTURE_TRIES times). Returns fn's output: the graph's static output."""
        for _ in range(2):
            fn()
        for attempt in range(CAPTURE_TRIES):
            g = torch.cuda.CUDAGraph()
            if self._gpool is None:   # the id known before the capture, so a failed one can end its pool
                self._gpool = torch.cuda.graph_pool_handle()
            try:
                with torch.cuda.graph(g, pool=self._gpool, stream=self._side):
                    out = fn()
                break
            except RuntimeError as e:  # torch.AcceleratorError is one
                if attempt == CAPTURE_TRIES - 1:
                    raise
                torch.cuda.synchronize(self.device)
                _end_pool(self.device, self._gpool)
                self._gpool = None  # the retry, and the graphs after it, in a fresh pool
                self.capture_retries.append(f"{key}: {str(e).splitlines()[0][:120]}")
        self.graphs[key] = g
        return out

    def _capture(self) -> None:
        """Warm up and capture one graph per (batch bucket, sampling), largest first, sharing one memory pool;
        the state is reset afterwards (warm-up rounds run on padding slots only, before any request)."""
        t0 = time.perf_counter()
        side = self._side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        self._gpool = None
        capture = self._capture_graph
        with torch.cuda.stream(side):
            for b in reversed(self.buckets):
                if self.auto is not None:  # a front graph per tree size, then one per plan (static buffers)
                    for B in self._tree_ops:
                        capture(("front", b, B), lambda: self._front(b, B))
                    if self.pend is not None:
                        capture(("catchup", b), lambda: self._catchup(b))
                    self.graphs[("front", b, self.max_budget)].replay()   # real blocks for the warm-up rounds
                for sampling in (False, True) if self.graph_sampling else (False,):
                    if self.auto is None:
                        self._graph_logits[(b, sampling)] = capture((b, sampling),
                                                                    lambda: self._round(b, sampling))
                        continue
                    for i, plan in enumerate(self.plans):
                        self._graph_logits[(b, sampling, i)] = capture(
                            (b, sampling, i), lambda: self._round(b, sampling, plan=plan))
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t in (self.lens, self.root, self.temp, self.seed, self.live, self.out, self.pend_n):
            t.zero_()
        torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t0

    def _capture_whole(self) -> None:
        """budget="auto", decide="previous", graphs on: each drafting plan's whole round (the front phase of
        the tree `Policy.build` gives it, then its block) as one more graph per (batch bucket, sampling), so
        that such a round replays once, as a fixed budget's does, not two graphs with the host between them.
        Only while those graphs' logits outputs stay within WHOLE_GRAPH_BYTES; `whole_graphs` says True or
        why not (at K2.6's vocabulary they would take GBs, and the host gap is a sliver of its rounds)."""
        if self.graph_reason is not None or self.auto.decide != "previous":
            self.whole_graphs = ("graphs off" if self.graph_reason is not None else
                                 f"decide={self.auto.decide}")
            return
        samp = (False, True) if self.graph_sampling else (False,)
        keys = [(b, s, i) for b in reversed(self.buckets) for s in samp for i in range(len(self.plans))
                if self.auto.build(b, i) is not None]
        need = sum(b * self.plans[i].rows * self.model.args.vocab_size * 4 for b, _, i in keys)
        if need > WHOLE_GRAPH_BYTES:
            self.whole_graphs = f"their logits would take {need / 2**30:.1f} GiB (> WHOLE_GRAPH_BYTES)"
            return
        t0 = time.perf_counter()
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            for b, sampling, i in keys:
                def fn(b=b, sampling=sampling, i=i):
                    self._front(b, self.auto.build(b, i))
                    return self._round(b, sampling, plan=self.plans[i])
                key = ("whole", b, sampling, i)
                self._graph_logits[key] = self._capture_graph(key, fn)
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        for t in (self.lens, self.root, self.out, self.est, self.pend_n):
            t.zero_()
        torch.cuda.synchronize(self.device)
        self._measure_whole()
        self.whole_graphs = True
        self.warmup_s += time.perf_counter() - t0

    def _launch(self) -> _Flight:
        """Grow the active requests' pages, launch their round (a graph replay when captured) and its copy
        to the host; nothing read back. With a round in flight, pages cover both rounds' rows."""
        n = len(self.active)
        ahead = self._flight is not None
        for r in self.active:
            self._grow(r, r.length + self.rows + (self.max_accept if ahead else 0))
        b = self._bucket(n)
        sampling = any(r.temperature > 0 for r in self.active)
        t0 = time.perf_counter()
        clock = _Clock(self.device)
        i, info = None, None
        if self.auto is not None:
            logits, i, info = self._auto_round(b, n, sampling, clock)
            graph = (b, sampling, i) in self.graphs
        else:
            g = self.graphs.get((b, sampling))
            graph = g is not None
            if g is not None:
                g.replay()
                logits = self._graph_logits[(b, sampling)]
            else:
                logits = self._round(b, sampling, clock)
        clock("end")
        buf = self._launched % 2
        self._launched += 1
        self.out_host[buf, :n].copy_(self.out[:n], non_blocking=True)
        if info is not None and info["drafted"] and self.auto.decide == "previous":
            self.est_host[buf, :n].copy_(self.est[:n], non_blocking=True)
            if self.plans[i].kind == "tree":   # `_land` reads a tree round's path alone
                self.paths_host[buf, :n].copy_(self.paths[:n], non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _Flight(list(self.active), b, logits, graph, clock, t0, buf, done, i, info)

    def _land(self, f: _Flight, emitted) -> None:
        """Wait for round f, then its bookkeeping: tokens to the requests still in it (one that left since
        f launched is skipped), stop checks, releases, stage times."""
        if f.done is not None:
            f.done.synchronize()
        n = len(f.reqs)
        # grouped admission's rent: the rows of requests not ended before f
        live = sum(r.slot >= 0 for r in f.reqs) if self.admission == "grouped" else 0
        host = self.out_host[f.buf, :n].tolist()
        stages = f.clock.times()
        now = time.perf_counter()
        # overlapped: the interval since the previous round landed (its launch was hidden behind it)
        stages["round"] = now - (f.t0 if self._landed_at is None else max(f.t0, self._landed_at))
        self._landed_at = now if self._flight is not None else None
        # a graph's logits are its static output, which the round in flight (if any) is rewriting
        self.last_logits = f.logits[:n] if self._flight is None or not f.graph else None
        ids = [r.rid for r in f.reqs]  # the request in each row of last_logits
        self.last_round = dict(stages, batch=n, bucket=f.b, graph=f.graph, ids=ids)
        plan, est_paths, lag, taken = None, None, None, {}
        if f.info is not None:
            plan = self.plans[f.i]
            drafted = f.info["drafted"] and plan.kind != "ar"
            if drafted and self.auto.decide == "previous":
                est_paths = self.est_host[f.buf, :n].numpy(), self.paths_host[f.buf, :n]   # [n, P], [n, A]
                lag = self._lag(f.reqs, f.info["at"])
            elif drafted:   # "sync": taken before the round's fresh estimates replaced the previous ones
                lag = f.info.get("lag")
            self._auto_take(f, stages["round"])
        self.rounds += 1
        for key, v in stages.items():   # each active request's share: the change over its stay (`_release`)
            self._stage_sum[key] = self._stage_sum.get(key, 0.0) + v
        leaving = []
        for i, (r, row) in enumerate(zip(f.reqs, host)):
            if r.slot < 0:   # finished or failed in the round before f
                continue
            k, ok, new = row[0], row[1], row[2:2 + row[0]]
            res = r.result
            if not ok:
                self.errors[r.rid] = ValueError("target logits: NaN or inf in verify row(s) of this round: "
                                                "the target's weights or inputs are not finite")
                leaving.append(r)
                continue
            if self._features is not None and r.session is not None:
                r.session.accept(self._features[i, :k])
            r.length += k
            r.committed += new
            res.accept_lengths.append(k)
            taken[r.rid] = k
            res.tree_sizes.append(self.rows if plan is None else plan.rows)
            before = len(res.tokens)
            done = finish(res.tokens, new, r.max_new, r.stop)
            emitted.setdefault(r.rid, []).extend(res.tokens[before:])   # up to max_new and a stop token
            if done:
                leaving.append(r)
        got = [k for k, r in enumerate(f.reqs) if r.rid in taken]
        if est_paths is not None and got:
            # accept lengths about estimates: a chain round's own; a tree round's on the plan verified and on
            # every smaller tree within its tree
            E = est_paths[0][got]                                                          # [m, P]
            if plan.kind == "chain":
                self.spread.add(f.i, [taken[f.reqs[k].rid] for k in got], E[:, f.i])
            else:
                C = truncated_accepts(est_paths[1][got], self._cut_rows).numpy()           # [m, P]
                for j in self._cut_plans[f.i]:
                    self.spread.add(j, C[:, j], E[:, j])
        lag = [(x[f.i], taken[r.rid] - m[f.i]) for r, x, m in lag or () if r.rid in taken]
        if lag:
            self.persist.add(*np.array(lag, np.float64).T)
        # the highest slot first: requests ending together (a static batch's end) move no slot's state (the
        # drafter's context, pend) into the slot of one that leaves after it
        for r in sorted(leaving, key=lambda r: -r.slot):
            self._release(r)
        if self.admission == "grouped" and self.waiting:
            self._bill(live, stages["round"])
        self._features = None
        if self.auto is not None and not self.active and self._flight is None:
            self._auto_flush()   # idle: the last round's times into the cost table now
            self._ahead = None
            self.auto.restart()  # the next batch's holds start over (its estimates: the requests' mean)
        if self.debug:
            self.check_state()

    # ------------------------------------------------------------- budget="auto"
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _stamp(self, slot: int | None = None):
        """A time mark on the stream: a CUDA event (slot: one of the engine's twelve reused ones, three
        rounds' worth: a round's marks are read after two more rounds may have recorded theirs, under
        overlap) or the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        if slot is None:
            e = torch.cuda.Event(enable_timing=True)
        else:
            if not hasattr(self, "_events"):
                self._events = [torch.cuda.Event(enable_timing=True) for _ in range(12)]
            e = self._events[slot]
        e.record()
        return e

    def _secs(self, a, z) -> float:
        return a.elapsed_time(z) * 1e-3 if self.device.type == "cuda" else z - a

    def _phase(self, b: int, sampling: bool, i: int | None, build: int | None = None, clock=None):
        """budget="auto": the front phase building `build` nodes (i None) or plan i's round (returns the
        logits), replaying its graph when there is one."""
        key = ("front", b, build) if i is None else (b, sampling, i)
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return None if i is None else self._graph_logits[key]
        if i is None:
            return self._front(b, build, clock)
        return self._round(b, sampling, clock, plan=self.plans[i])

    def _measure_costs(self) -> None:
        """The cost table's start-up entries: every phase on padding slots (their lengths set to each context
        bucket, their page tables spread over the free pool for the measurement and zeroed after it), per
        batch bucket; the median of COST_REPS graph replays (eager rounds: one after a warm-up)."""
        t0 = time.perf_counter()
        reps, warm = (COST_REPS, 0) if self.graphs else (1, 1)
        self._spread_pages()
        for b in self.buckets:
            for c, ctx in enumerate(self.costs.ctx_buckets):
                self.lens[:b] = ctx
                # every tree size's front, the largest last (its blocks feed the plans' rounds), each plan
                for i, B in [(None, B) for B in self._tree_ops] + [(i, None) for i in range(len(self.plans))]:
                    sec = self._median_time(lambda: self._phase(b, False, i, B), reps, warm)
                    if i is None:
                        self.costs.front[(b, B, c)] = sec
                    else:
                        self.costs.back[(b, i, c)] = sec
        self._reset_state()
        self.warmup_s += time.perf_counter() - t0

    def _spread_pages(self) -> None:
        """Start-up measurements: the padding slots read distinct pool pages, as requests' contexts do, not
        the one scratch page that every read would then hit (no request holds a page yet); fewer pages than
        slots x pages wrap around. Their roots (and simulated texts) differ too, as requests' do: alike rows
        route to the same experts, and a MoE round on them costs less than on requests' rows. `_reset_state`
        zeroes pages and roots again."""
        P, B = self.pages_per_req, self.max_batch
        spread = torch.arange(B * P, dtype=torch.int32, device=self.device)
        self.page_table.copy_((spread % (self.pages.n_pages - 1) + 1).view(B, P))
        V = self.model.args.vocab_size
        self._spread_roots = (torch.arange(B, device=self.device) * 7919 + 11) % V   # set by _median_time
        if self.sim is not None and not getattr(self, "_spread_texts", False):   # once: no request yet
            self.sim.write(list(range(B)), [1_000_003 + s for s in range(B)])
            self._spread_texts = True

    def _reset_state(self) -> None:
        for t in (self.lens, self.root, self.out, self.est, self.pend_n, self.page_table):
            t.zero_()
        self._sync()

    def _median_time(self, fn, reps: int, warm: int) -> float:
        """The median seconds of reps calls of fn after warm untimed ones (stream marks, one sync), each from
        the padding slots' distinct roots (`_spread_pages`; a round leaves a padding slot's root 0)."""
        marks = []
        for _ in range(warm + reps):
            self.root.copy_(self._spread_roots)
            a = self._stamp()
            fn()
            marks.append((a, self._stamp()))
        self._sync()
        return float(np.median([self._secs(a, z) for a, z in marks[warm:]]))

    def _measure_whole(self) -> None:
        """Each whole-round graph's replay per context bucket: its plan's back entry becomes the round less
        its front's entry, as `_auto_flush` refreshes it online, so that every plan is costed the same way
        (else the plans whose whole rounds have run look cheaper, by the host gap they save, than the ones
        still costed as two graphs, and the policy keeps the first it ran)."""
        self._spread_pages()
        for b in self.buckets:
            for c, ctx in enumerate(self.costs.ctx_buckets):
                self.lens[:b] = ctx
                for i in range(len(self.plans)):
                    g, build = self.graphs.get(("whole", b, False, i)), self.auto.build(b, i)
                    if g is not None:
                        front = self.costs._near(self.costs.front, (b, build), c) or 0.0
                        self.costs.back[(b, i, c)] = max(self._median_time(g.replay, COST_REPS, 0) - front,
                                                         0.0)
        self._reset_state()

    def _estimates(self, ahead: bool = False) -> np.ndarray | None:
        """[n, P] expected tokens of the active requests in the round being launched (ahead: the one after
        it) from their last draft rounds, aged by the rounds since toward each request's long-run rate
        (`budget.Persistence`; a request not drafted yet: the mean of the requests so far), as the policy
        reads them (`_expected`); None before any request drafted."""
        rows = [self._prior if r.est is None else r.est for r in self.active]
        if any(x is None for x in rows):
            return None
        if self._end_in_view() and len(self.active) > 1:   # `drain` reads the long-run rates alone
            return self._expected(self.active, np.stack(rows))
        m, at = self._long_run(self.active, np.stack(rows)), self._launched + int(ahead)
        rows = [row if r.est is None else self.persist.age(row, m[k], at - r.est_at)
                for k, (r, row) in enumerate(zip(self.active, rows))]
        return self._expected(self.active, np.stack(rows))

    def _expected(self, reqs: list, est: np.ndarray) -> np.ndarray:
        """The policy's input from estimates est [n, P] of reqs: capped at the tokens left (`_capped`), and
        with makespan on, while no request waits for a slot or freed slots wait for company (`_grouping`),
        the batch's end in view (`budget.drain` of each request's long-run rate, `_long_run`, its tokens
        beyond the root scaled per plan by how far the estimates held in the rounds so far, `Spread.realized`,
        and the accept lengths' measured spread, `spread`). The batch ends on its slowest requests: there a
        few per cent between plans turn the choice, and the drafter's calibration, which holds on average on
        held-out text, may miss this run's gain from a larger tree."""
        if not self._end_in_view() or len(reqs) < 2:
            return self._capped(reqs, est)
        m = 1.0 + (self._long_run(reqs, est) - 1.0) * self.spread.realized()[None, :]   # [n, P]
        return auto_budget.drain(self._capped(reqs, m), Engine._left(reqs),
                                 self._longest, self.spread.ratios())

    def _long_run(self, reqs: list, est: np.ndarray) -> np.ndarray:
        """[n, P] each request's expected tokens a round over the rest of its output, for `budget.drain`: the
        mean of its draft rounds' estimates, shrunk toward the requests' mean (`_prior`; else est's mean) with
        the weight of auto_budget.SHRINK rounds. One round's estimate (est [n, P]) speaks of the text just
        ahead: the lowest of a batch's, read as a request's rate to its end, would make every drafting plan's
        end look as late as that one round's."""
        prior = est.mean(0) if self._prior is None else self._prior
        k, zero = auto_budget.SHRINK, np.zeros_like(prior, np.float64)
        sums = np.stack([zero if r.est_sum is None else r.est_sum for r in reqs])             # [n, P]
        n = np.array([r.est_n for r in reqs], np.float64)[:, None]
        return np.where(n > 0, (sums + k * prior) / (n + k), prior)   # no draft round yet: the prior

    @staticmethod
    def _left(reqs: list) -> np.ndarray:
        """[n] each request's tokens left: max_new less those emitted as of the last landed round, at
        least 1."""
        return np.array([max(r.max_new - len(r.result.tokens), 1) for r in reqs], np.float64)

    @staticmethod
    def _capped(reqs: list, est: np.ndarray) -> np.ndarray:
        """est [n, P] with request i's row capped at its tokens left (`_left`): tokens past a request's end
        are not emitted, so near its end a smaller plan (or AR) loses nothing of what it counts."""
        return np.minimum(est, Engine._left(reqs)[:, None])

    def _take_estimates(self, reqs: list, rows: np.ndarray, at: int) -> None:
        """rows [n, P]: the estimates of reqs (a round's requests in its slot order at launch) drafted by the
        round of launch index `at`; a request that left since is skipped."""
        rows = np.array(rows, np.float64)   # a copy: each request keeps a row of its own
        for r, row in zip(reqs, rows):
            if r.slot >= 0:
                r.est, r.est_at = row, at
                r.est_sum = row if r.est_sum is None else r.est_sum + row
                r.est_n += 1
        m = rows.mean(0)
        self._prior = m if self._prior is None else (1 - auto_budget.EMA) * self._prior + auto_budget.EMA * m

    def _lag(self, reqs: list, at: int) -> list:
        """Before drafted round `at` hands its estimates over: (request, x [P], m [P]) for each of reqs whose
        estimates come from the round before it (at - 1), m its long-run rates, x its estimates less m
        (`budget.Persistence`: the round's plan picks the column, its accept length gives the pair's y)."""
        got = [r for r in reqs if r.slot >= 0 and r.est is not None and r.est_at == at - 1]
        if not got:
            return []
        m = self._long_run(got, np.stack([r.est for r in got]))
        return [(r, r.est - mk, mk) for r, mk in zip(got, m)]

    def _agree(self, i: int | None, ar_probe: bool = False) -> tuple[int | None, bool]:
        """Under tensor parallelism every rank takes rank 0's decision (plan index, whether an AR probe)."""
        if getattr(self.model, "tp", None) is None:
            return i, ar_probe
        import torch.distributed as dist
        group = getattr(self.model, "tp_group", None)
        t = torch.tensor([-1 if i is None else i, int(ar_probe)], device=self.device)
        dist.broadcast(t, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        v, a = t.tolist()
        return (None if v < 0 else v), bool(a)

    def _decide(self, b: int, est: np.ndarray | None, ahead: bool = False) -> tuple[int, int, bool, bool]:
        """The plan decided before drafting (kdtree.budget's `before`) for the active requests at batch
        bucket b from their estimates est [n, P] (`_estimates`): (plan index, context bucket, whether that
        round is a hold's probe, whether it is an AR probe: AR's block after a draft, `Policy.ar_probe`).
        ahead: decided for the round after the one being launched."""
        pol = self.auto
        ctx = self.costs.ctx(sum(r.length for r in self.active) / len(self.active))
        # nothing drafted yet: build and verify the largest tree ("sync" then re-picks from fresh estimates)
        if est is None:
            i, ar_probe, probe = len(self.plans) - 1, False, pol.probe
        else:
            i = pol.before(b, est, ctx, self._rounds_left(ahead))
            ar_probe, probe = pol.ar_probe, pol.probed
        i, ar_probe = self._agree(i, ar_probe)
        return i, ctx, probe, ar_probe

    def _rounds_left(self, ahead: bool = False) -> int | None:
        """AR rounds until the batch's last active request ends, for the round being launched (ahead: the
        one after it): its tokens left as of the last landed round, less one a round for the rounds launched
        and not landed (each emits at least one token), at least 1; None while requests wait for a slot that
        they take as soon as it frees (not `_grouping`) or with makespan off (the batch's end is not in view).
        Where freed slots wait for company, the requests admitted together end as a static batch does."""
        if not self._end_in_view() or not self.active:
            return None
        unlanded = self._launched - self.rounds + int(ahead)
        return max(int(self._left(self.active).max()) - unlanded, 1)

    def _auto_round(self, b: int, n: int, sampling: bool, clock):
        """Decide (kdtree.budget), then the round's phases. Returns (logits, plan index, info for
        _auto_take). The decision for the next round is made once this round is launched, from the same
        estimates (the previous rounds'), so the host's scoring runs while the GPU works; after a hold's
        probe round, while no request has estimates yet, and under tensor parallelism the next round decides
        at its start."""
        pol, ev = self.auto, 4 * (self._launched % 3)   # this round's event slots
        ahead, self._ahead = self._ahead, None
        i, ctx, probe, ar_probe = ahead if ahead is not None else self._decide(b, self._estimates())
        build = pol.round_build(b, i, ar_probe)   # this round's bucket (a decision ahead may predate it)
        if self._pending and (build is not None or self._pending >= auto_budget.MAX_HOLD):
            # the drafter's context before it drafts (or pend is full); outside both phases' marks, so its
            # time falls to the host share, a median that a rare catch-up round does not move
            g = self.graphs.get(("catchup", b))
            g.replay() if g is not None else self._catchup(b)
            self._pending = 0
        marks, whole, lag = {}, ("whole", b, sampling, i), None
        if build is not None and not ar_probe and whole in self.graphs:   # front and block in one replay
            marks["f0"] = self._stamp(ev)
            self.graphs[whole].replay()
            marks["b1"] = self._stamp(ev + 3)
            self.whole_replays += 1
            logits = self._graph_logits[whole]
        else:
            if build is not None:
                marks["f0"] = self._stamp(ev)
                self._phase(b, sampling, None, build, clock)
                marks["f1"] = self._stamp(ev + 1)
                if pol.decide == "sync":  # the fresh estimates to the host, then the block within the tree
                    self.est_host[0, :n].copy_(self.est[:n], non_blocking=True)
                    self._sync()
                    fresh = self.est_host[0, :n].numpy().copy()
                    lag = self._lag(self.active, self._launched)
                    self._take_estimates(self.active, fresh, self._launched)
                    ar = self.plans[i].kind == "ar"   # an AR probe: AR's block stays a candidate
                    i = self._agree(pol.after(b, self._expected(self.active, fresh), ctx, build, ar))[0]
            same = build is not None and pol.decide == "previous"
            marks["b0"] = marks["f1"] if same else self._stamp(ev + 2)
            logits = self._phase(b, sampling, i, clock=clock)
            marks["b1"] = self._stamp(ev + 3)
        if self.plans[i].kind == "ar" and self.pend is not None:   # its row waits in pend (an AR probe's too)
            self._pending += 1
        self._auto_flush()   # the previous round's times, while the GPU runs this one
        # under TP each rank's policy state is its own (rank 0's choice is broadcast), so whether to decide
        # ahead could differ between ranks and their broadcasts would not pair up: TP decides at round start
        est = None if probe or getattr(self.model, "tp", None) is not None else self._estimates(ahead=True)
        if est is not None:
            self._ahead = self._decide(b, est, ahead=True)
        return logits, i, dict(b=b, n=n, marks=marks, ctx=ctx, build=build, drafted=build is not None,
                               at=self._launched, lag=lag)

    def _auto_take(self, f: _Flight, wall: float) -> None:
        """After round f's sync: its estimates to its requests (rows in its launch order), its plan to the
        history; its phases' times wait in `_timing` for `_auto_flush` (run after the next round is launched,
        off the GPU's idle gap)."""
        n, i, info = len(f.reqs), f.i, f.info
        if info["drafted"] and self.auto.decide == "previous":
            self._take_estimates(f.reqs, self.est_host[f.buf, :n].numpy(), info["at"])
        name = self.plans[i].name
        if info["drafted"] and self.plans[i].kind == "ar":
            name = auto_budget.AR_PROBE
        self.auto.history.append((self.rounds, n, name))
        self.last_round["plan"] = name
        self._timing.append((i, info, wall))

    def _auto_flush(self) -> None:
        """The waiting rounds' phase times into the cost table (CUDA events read after their round's sync).
        A round of n requests in a bucket of b > n refreshes the entries of (b, n) (`CostTable.key`): padding
        slots' rows (root 0 at length 0, alike) read fewer experts than requests' rows, so a batch's last
        rounds, folded into the full bucket's entries, would make every plan look cheaper when the next
        batch starts full."""
        costs = self.costs
        for i, info, wall in self._timing:
            m, c = info["marks"], info["ctx"]
            b = costs.key(info["b"], info.get("n", info["b"]))
            if "b0" not in m:   # a whole-round replay: the plan's share is the round less its front's entry
                front = costs.entry(costs.front, b, (info["build"],), c) or 0.0
                back = max(self._secs(m["f0"], m["b1"]) - front, 0.0)
            else:
                back = self._secs(m["b0"], m["b1"])
                front = self._secs(m["f0"], m["f1"]) if info["drafted"] else 0.0
                if info["drafted"]:
                    costs.update(costs.front, (b, info["build"], c), front)
            costs.update(costs.back, (b, i, c), back)
            costs.add_host(max(0.0, wall - front - back))
            costs.samples += 1
        self._timing.clear()

    def check_state(self) -> None:
        """The device state against the host's bookkeeping (reads the device; debug=True runs it every round):
        lengths, roots, page tables of the active slots, zeroed padding slots, page accounting."""
        n = len(self.active)
        lens, root, pt = self.lens.tolist(), self.root.tolist(), self.page_table.tolist()
        for r in self.active:
            s = r.slot
            want = r.pages + [0] * (self.pages_per_req - len(r.pages))
            if lens[s] != r.length or root[s] != r.committed[-1] or pt[s] != want:
                raise RuntimeError(f"engine state: request {r.rid} in slot {s}: device length {lens[s]}, "
                                   f"root {root[s]}, pages {pt[s][:len(r.pages) + 1]}; host {r.length}, "
                                   f"{r.committed[-1]}, {r.pages}")
        if any(lens[n:]) or any(any(row) for row in pt[n:]):
            raise RuntimeError("engine state: a padding slot holds a length or pages")
        held = sum(len(r.pages) for r in self.active)
        if len(self.pages.free) + held != self.pages.capacity:
            raise RuntimeError(f"engine state: {len(self.pages.free)} free + {held} held != "
                               f"{self.pages.capacity}")


# ----------------------------------------------------------------------------- engines behind generate_*
_ENGINES: "OrderedDict[tuple, Engine]" = OrderedDict()
MAX_CACHED_ENGINES = 4


def engine_for(model: Transformer, drafter, mode: str, budget, need: int, backend: str | None = None,
               graphs: bool = True) -> Engine:
    """A batch-1 engine for the generate_* wrappers, kept per (model, drafter, mode, budget, backend, context
    bucket) so that repeated calls replay the graphs captured once (at most MAX_CACHED_ENGINES kept)."""
    mpe = model.args.max_position_embeddings
    max_len = min(mpe, max(256, 1 << max(0, math.ceil(math.log2(max(need, 1))))))
    key = (id(model), id(drafter), mode, budget, backend, max_len, graphs, model.attn_impl, model.dtype,
           str(model.device))
    e = _ENGINES.get(key)
    if e is None or e.model is not model or e.drafter is not drafter:
        e = Engine(model, drafter, mode=mode, budget=budget, max_batch=1, max_len=max_len, backend=backend,
                   graphs=graphs)
        _ENGINES[key] = e
        while len(_ENGINES) > MAX_CACHED_ENGINES:
            _ENGINES.popitem(last=False)
    _ENGINES.move_to_end(key)
    return e
