"""The engine: requests in, tokens out; `step` is schedule -> run -> postprocess.

    engine = Engine(model, drafter, mode="ddtree", budget=64, max_batch=8)
    rid = engine.add_request(prompt, max_new_tokens=128)
    results = engine.run()                       # {request id: GenerationResult}

Its parts: `Scheduler` (queues, slots, pages, admission), `Prefill` (prompts into the cache), `Runner` (one
round: draft -> build -> verify -> walk -> commit, its launch and landing), `GraphCache` (the rounds' CUDA
graphs), and the budget policy (`FixedBudget`, or `kdtree.budget.auto.AutoBudget` for budget="auto"). The
engine holds the static device state they share: the latent page pool and, per slot, page table, length,
root (the last committed token), temperature, seed, live flag, and the round's output row. Invariant: the
target cache and the drafter's context hold every committed token but the last, which is the next round's
root.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .. import checks
from ..model import Transformer
from ..round_ops import GoldenOps, KernelOps
from ..simulate import Simulation
from .config import EngineConfig, check_engine_memory
from .graphs import GraphCache, graph_blocker, sync
from .policy import FixedBudget
from .prefill import Prefill
from .requests import GenerationResult, check_seed
from .runner import Runner
from .scheduler import Scheduler

AUTO_KEYS = ("max_budget", "budgets", "decide", "calibration", "makespan")


@dataclasses.dataclass
class EngineStats:
    """What the engine has done so far (read and written as the engine's attributes of the same names)."""
    rounds: int = 0                  # rounds landed
    prefill_forwards: int = 0        # target forwards spent on prompts (same-length chunks share one)
    prefill_s: float = 0.0           # wall seconds in prefill (admission to first tokens, host read included)
    synthetic_s: float = 0.0         # wall seconds of synthetic rows' fill, simulated texts (not prefill_s)
    prefill_replays: int = 0         # prefill forwards that replayed a graph
    prefill_phases: dict | None = None   # {phase: seconds} when set to a dict (`Prefill.mark`; benchmarks)
    admissions: int = 0              # admissions (prefills of one or more requests)
    last_admission: tuple | None = None  # the last one's (requests, prompt rows, seconds, captured a graph)
    last_round: dict = dataclasses.field(default_factory=dict)  # stage seconds, batch, bucket, graph
    warmup_s: float = 0.0            # graph captures and the budget policy's start-up measurements


def _config(name: str, doc: str | None = None) -> property:
    return property(lambda self: getattr(self.config, name), doc=doc)


def _stat(name: str) -> property:
    return property(lambda self: getattr(self.stats, name), lambda self, v: setattr(self.stats, name, v))


class Engine:
    """Continuous-batching decode engine over one shared paged latent cache (module docstring).

    model: a Transformer; drafter: a DFlashDrafter (batched on the device) or any drafter with sessions
    (`session(max_len)` -> start / propose / accept on the host, e.g. the test oracle). config: an
    `EngineConfig`, or its fields as keywords (with budget="auto", `kdtree.budget.AutoConfig`'s too):

    mode "ar" | "dflash" | "ddtree"; budget: DDTree's draft nodes per round (1..1024 on the kernel backend),
    or "auto" (`kdtree.budget`: each round verifies AR, the chain or a tree truncated to one of `budgets`,
    whichever maximizes its expected tokens per second, from the draft's calibrated prefix probabilities and
    a cost table measured at start-up and refreshed every round; decide "previous" | "sync"; makespan: plan
    for the batch's end while it is in view). max_batch: requests per round; max_len: the longest context
    one request may reach (prompt + max_new_tokens + the block's rows; default max_position_embeddings);
    max_tokens: the pool's rows (default max_batch * max_len); page_size 64 (the attention kernel's);
    graphs: capture each batch bucket's round in a CUDA graph (the kernel backend on a GPU; elsewhere the
    round runs eagerly and `graph_reason` says why); backend "golden" (numpy tree steps) | "kernel" (CUDA;
    the default on a GPU); prefill_chunk: prompt rows per prefill forward; debug: `check_state` after every
    round; buckets: the batch sizes rounds pad to (default 1, 2, 4, ... max_batch); graph_sampling: capture
    sampling rounds too; compile: the round's regions through torch.compile (`Runner`); deterministic:
    every round at max_batch rows (one bucket), so a request's tokens and logits are bitwise the same alone
    or in a full batch (refused for INT4 experts); moe: the MLP experts' path ("dense" | "grouped" | "loop";
    default `config.moe_path`); admission "eager" | "grouped" (a freed slot waits for company while the
    idle slots' lost seconds stay below an admission's fixed cost: `Scheduler.due`); overlap: run() launches
    each round before the previous round's bookkeeping (off under debug, a host drafter or tensor
    parallelism; step() always lands its own round); simulate: a `kdtree.simulate.Profile` (simulated
    acceptance at real shapes: every mode emits the profile's tokens; `simulated` names it); prefix_attn
    "off" | "flashinfer" (the verify attention over each request's committed pages through FlashInfer's MLA,
    the rest through verify_attn, merged; AR rounds wholly through FlashInfer: `engine.prefix`; FlashInfer
    installed, one GPU).

    Sampling: each request's randomness is a counter-based stream keyed by (seed, the root's position, the
    row), drawn on the device as Gumbel noise, so its samples do not depend on its batch mates, the bucket or
    graph replay."""

    def __init__(self, model: Transformer, drafter=None, config: EngineConfig | None = None, **kw):
        auto_kw = {k: kw.pop(k) for k in AUTO_KEYS if k in kw}
        if config is None:
            from ..budget.config import AutoConfig
            config = EngineConfig(**kw, auto=AutoConfig(**auto_kw) if auto_kw else None)
        elif not isinstance(config, EngineConfig):
            raise ValueError(f"config: expected a kdtree.engine.EngineConfig, got {type(config).__name__}")
        elif kw or auto_kw:
            raise ValueError(f"config and keywords {sorted(kw) + sorted(auto_kw)}: pass one or the other")
        cfg = self.config = config.resolve(model, drafter)
        self.model, self.drafter, self.device = model, drafter, model.device
        check_engine_memory(cfg, model, drafter)
        self.scheduler = Scheduler(self, cfg.n_pages, cfg.admission)
        model.prepare_paged(cfg.moe)   # fused projections, stacked experts: from the weights as they are now
        self._state()
        self.ops = (KernelOps if cfg.backend == "kernel" else GoldenOps)(cfg.mode, cfg.budget, cfg.page_size)
        if cfg.compile:   # a compiled graph per shape and engine; past dynamo's default limit: eager
            import torch._dynamo.config as dc
            name = "recompile_limit" if hasattr(dc, "recompile_limit") else "cache_size_limit"
            setattr(dc, name, max(getattr(dc, name), 256))
        self.stats = EngineStats()
        # the last round's verify logits [n, N, V], until the next (None when a graphed round landed behind
        # another in flight: its static output is being rewritten)
        self.last_logits: torch.Tensor | None = None
        self.cache = GraphCache(self.device)
        self.graph_reason = graph_blocker(self) if cfg.graphs else "graphs=False"
        self.overlap = (cfg.overlap and not cfg.debug and (cfg.mode == "ar" or self.batched_drafter)
                        and getattr(model, "tp", None) is None)
        self._flight = None   # the launched round whose bookkeeping waits (overlap)
        self.runner, self.prefill = Runner(self, cfg.compile), Prefill(self)
        self.policy = FixedBudget(self)
        if cfg.is_auto:
            from ..budget.auto import AutoBudget
            self.policy = AutoBudget(self, cfg.auto)
        self.prefix = None
        if cfg.prefix_attn == "flashinfer":
            from .prefix import PrefixSplit
            self.prefix = PrefixSplit(self, self.policy.verify_rows())
        if self.graph_reason is None:
            self._capture()
            self.prefill.buffers()
        self.policy.start()

    # the resolved config's values, read-only (`deterministic` re-resolves)
    mode, backend, moe = _config("mode"), _config("backend"), _config("moe")
    max_budget = _config("budget", "DDTree's largest tree (budget='auto': its largest candidate)")
    max_batch, page_size, buckets = _config("max_batch"), _config("page_size"), _config("buckets")
    prefill_chunk, debug, compiled = _config("prefill_chunk"), _config("debug"), _config("compile")
    rows = _config("rows", "N: verify rows per request")
    max_accept, max_len, kv_cap = _config("max_accept"), _config("max_len"), _config("kv_cap")
    pages_per_req, graph_sampling = _config("pages_per_req"), _config("graph_sampling")
    budget = property(lambda self: "auto" if self.config.is_auto else self.config.budget,
                      doc="DDTree's draft nodes per round, or 'auto'")
    lookahead = property(lambda self: 0 if self.mode == "ar" else self.rows)
    batched_drafter = property(lambda self: self.mode != "ar" and hasattr(self.drafter, "new_context"))
    layers = property(lambda self: tuple(getattr(self.drafter, "target_layer_ids", ()))
                      if self.mode != "ar" else (), doc="the target layers whose features the drafter reads")
    simulated = property(lambda self: None if self.config.simulate is None else self.config.simulate.name)

    @property
    def deterministic(self) -> bool:
        return self.config.deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self.config = dataclasses.replace(self.config, deterministic=checks.flag("deterministic", value))

    # the statistics (`EngineStats`), read and written through the engine
    rounds, prefill_forwards, prefill_s = _stat("rounds"), _stat("prefill_forwards"), _stat("prefill_s")
    synthetic_s, prefill_replays = _stat("synthetic_s"), _stat("prefill_replays")
    prefill_phases, admissions, warmup_s = _stat("prefill_phases"), _stat("admissions"), _stat("warmup_s")
    last_admission, last_round = _stat("last_admission"), _stat("last_round")

    def _state(self) -> None:
        """The static device state (module docstring), every slot zeroed (padding)."""
        cfg, dev, a, B = self.config, self.device, self.model.args, self.config.max_batch
        self.pool = torch.zeros(a.num_hidden_layers, cfg.n_pages * cfg.page_size,
                                a.kv_lora_rank + a.qk_rope_head_dim, dtype=self.model.cache_dtype, device=dev)
        self.ctx = self.drafter.new_context(B, cfg.kv_cap) if self.batched_drafter else None
        self.page_table = torch.zeros(B, cfg.pages_per_req, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.root = torch.zeros(B, dtype=torch.int64, device=dev)
        self.temp = torch.zeros(B, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(B, dtype=torch.int64, device=dev)
        self.live = torch.zeros(B, dtype=torch.int64, device=dev)   # 1 in active slots: padding stays put
        # one copy to the host per round: [acc_len, logits finite, emitted tokens x max_accept]
        self.out = torch.zeros(B, 2 + cfg.max_accept, dtype=torch.int64, device=dev)
        # two host buffers: a launched round copies into one while the previous round's is read
        self.out_host = torch.zeros(2, *self.out.shape, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.sim = None if cfg.simulate is None else Simulation(
            cfg.simulate, a.vocab_size, 0 if self.drafter is None else self.drafter.block_size - 1, B, dev,
            length=cfg.kv_cap + cfg.max_accept + 1)

    # ------------------------------------------------------------- public API
    def add_request(self, prompt, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                    stop_tokens=(), synthetic_context: int = 0) -> int:
        """Queue a request; returns its id. Every argument is checked here (nothing changes on a ValueError).
        synthetic_context: for benchmarks at long contexts, that many random rows (latent cache rows
        N(0, 0.5), the drafter's context keys/values N(0, 1)) are inserted before the root once the prompt is
        prefilled, instead of prefilling them: the request's tokens then mean nothing. Their fill is a
        benchmark device, not a cost of serving: it runs between two device synchronizations and its time
        goes to `synthetic_s`, not to `prefill_s` or the request's prefill stage time."""
        s = self.scheduler
        return s.queue(s.request(prompt, max_new_tokens, temperature, seed, stop_tokens, synthetic_context))

    def step(self, overlap: bool = False) -> dict[int, list[int]]:
        """Admit what fits, then one round for every active request. Returns {request id: tokens emitted}.
        A request whose logits turn non-finite (or whose admission fails) leaves alone, its pages freed, never
        a result; step() then raises one ValueError naming every such request, after the other requests'
        bookkeeping, and the next call goes on.
        overlap=True (run()'s schedule; honoured when the engine's `overlap` is on): launch this round, then
        land the round launched by the previous call while the GPU runs it, so the tokens returned are that
        round's; a round in flight lands first when a request can join. A plain step() lands any round in
        flight, then its own."""
        emitted: dict[int, list[int]] = {}
        s, overlap = self.scheduler, checks.flag("overlap", overlap) and self.overlap
        if self.in_flight and (not overlap or s.admissible() or not s.can_overlap()):
            self._drain(emitted)
        if s.due():
            s.admit(emitted)                                             # schedule
        busy = bool(self.active)
        if busy:
            prev, self._flight = self._flight, self.runner.launch()      # run
            if prev is not None:
                self.runner.land(prev, emitted)                          # postprocess
        if not (busy and overlap):
            self._drain(emitted)
        s.raise_errors()
        return emitted

    def run(self, progress: bool = False) -> dict[int, GenerationResult]:
        """Step until every request has finished (overlapped rounds when `overlap` is on); returns {request
        id: result} of every request finished since the last run() (also those that finished in step() calls
        before it), each handed out once."""
        bar = None
        if checks.flag("progress", progress):
            from ..progress import tqdm
            bar = tqdm(total=len(self.waiting) + len(self.active), desc=f"engine {self.mode}")
        while self.waiting or self.active or self.in_flight:
            n = len(self.finished)
            self.step(overlap=True)
            if bar is not None:
                bar.update(len(self.finished) - n)
        if bar is not None:
            bar.close()
        out, self.scheduler.finished = self.finished, {}
        return out

    def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 stop_tokens=()) -> list[GenerationResult]:
        """One request per prompt (request i seeded seed + i), run to the end; results in prompt order. Every
        prompt and seed is checked before any request is queued (a ValueError queues nothing). Requests queued
        earlier with add_request run alongside; their results stay for the next run(). Where the run raises
        (a request of this call failed admission, say), every request of this call leaves whole (waiting,
        active or finished: pages back, never a result of a later run()) before the error reaches the caller;
        the earlier requests go on."""
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts: expected a list of prompts (each a sequence of token ids), got "
                             f"{type(prompts).__name__}")
        seed = check_seed(seed)
        if prompts:
            check_seed(seed + len(prompts) - 1)   # request i's seed is seed + i
        s = self.scheduler
        reqs = [s.request(p, max_new_tokens, temperature, seed + i, stop_tokens, 0, what=f"prompts[{i}]")
                for i, p in enumerate(prompts)]
        ids = [s.queue(r) for r in reqs]
        try:
            res = self.run()
        except BaseException:
            self._withdraw(set(ids))
            raise
        own = [res.pop(i) for i in ids]
        s.finished.update(res)   # others' results: handed out by the next run()
        return own

    def _withdraw(self, rids: set) -> None:
        """Requests `rids` leave whole: a round in flight lands, then they leave waiting, active, finished."""
        s = self.scheduler
        if self.in_flight:
            self._drain({})
        s.waiting[:] = [r for r in s.waiting if r.rid not in rids]
        for r in sorted((r for r in s.active if r.rid in rids), key=lambda r: -r.slot):
            s.release(r)
        for rid in rids:
            s.finished.pop(rid, None)
            s.errors.pop(rid, None)

    # the scheduler's queues and pool, the graph cache, the budget policy's tables
    waiting = property(lambda self: self.scheduler.waiting)
    active = property(lambda self: self.scheduler.active)
    finished = property(lambda self: self.scheduler.finished)
    pages = property(lambda self: self.scheduler.pages)
    graphs = property(lambda self: self.cache.graphs)
    capture_retries = property(lambda self: self.cache.retries)
    auto = property(lambda self: self.policy.auto, doc="budget='auto': its kdtree.budget.Policy (else None)")
    plans = property(lambda self: self.policy.plans)
    costs = property(lambda self: self.policy.costs)
    calibration = property(lambda self: self.policy.calibration)
    whole_graphs = property(lambda self: getattr(self.policy, "whole_graphs", False))
    whole_replays = property(lambda self: getattr(self.policy, "whole_replays", 0))

    @property
    def admission(self) -> str:
        return self.scheduler.admission

    def admit_cost(self) -> tuple[float, float] | None:
        """Grouped admission: (fixed seconds, seconds per prompt row) of an admission
        (`Scheduler.admit_cost`)."""
        return self.scheduler.admit_cost()

    @property
    def free_pages(self) -> int:
        return len(self.pages.free)

    @property
    def in_flight(self) -> bool:
        """A round launched by step(overlap=True) waits to land (the next step, or run(), lands it)."""
        return self._flight is not None

    def bucket(self, n: int) -> int:
        """The batch bucket a round of n requests (1..max_batch) pads to; ValueError past max_batch."""
        try:   # checked only when no bucket is found: the rounds call it
            return next(b for b in self.buckets if b >= n)
        except (StopIteration, TypeError):
            raise ValueError(f"n={n!r}: expected an int in [1, {self.max_batch}] (requests in a round, up to "
                             "max_batch)") from None

    def sync(self) -> None:
        sync(self.device)

    def _drain(self, emitted) -> None:
        f, self._flight = self._flight, None
        if f is not None:
            self.runner.land(f, emitted)
        self.runner.landed_at = None

    # ------------------------------------------------------------- slots and graphs
    def move_slot(self, src: int, dst: int) -> None:
        """Slot src's state into slot dst (a leaving request's slot taken by the last one)."""
        for t in (self.page_table, self.lens, self.root, self.temp, self.seed, self.live):
            t[dst] = t[src]
        if self.ctx is not None:
            self.ctx.move(src, dst)
        if self.sim is not None:
            self.sim.move(src, dst)
        self.policy.move_slot(src, dst)

    def clear_slot(self, s: int) -> None:
        """Slot s back to padding (page table, length, root, temperature and live flag zeroed; what else it
        holds is never read): fill kernels, no host synchronization (as in `Scheduler.grow`)."""
        for t in (self.page_table, self.lens, self.root, self.temp, self.live):
            t[s].fill_(0)
        self.policy.clear_slot(s)

    def _capture(self) -> None:
        """Warm up and capture the policy's graphs (the largest bucket first, one memory pool); the state is
        reset afterwards (warm-up rounds run on padding slots only, before any request)."""
        t0 = time.perf_counter()
        with self.cache.on_side():
            self.policy.capture(self.cache.capture)
        for t in (self.lens, self.root, self.temp, self.seed, self.live, self.out):
            t.zero_()
        self.policy.reset()
        torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t0

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
