"""Where an engine round's GPU time goes: kernels per round (`launches_per_round`) and per stage
(`stage_kernels`: torch.profiler over rounds repeated from one state, stages split by marker kernels on the
stream, `stage_by_markers`)."""
from __future__ import annotations

import torch

from ..engine import STAGES, Engine
from .serve import _sync


def launches_per_round(engine: Engine, prompt, max_new: int = 8) -> dict:
    """Kernels of one eager round (the graph's nodes are these launches): torch.profiler's CUDA kernel
    events."""
    from torch.profiler import ProfilerActivity

    from .profiling import profile
    rid = engine.add_request(prompt, max_new)
    engine.step()  # prefill + one round
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        _sync()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not n.startswith(("Memcpy", "Memset", "cudaMemcpy"))]
    engine.run()
    del rid
    top: dict[str, int] = {}
    for n in kernels:
        top[n[:60]] = top.get(n[:60], 0) + 1
    return {"kernels": len(kernels), "events": len(names),
            "top": sorted(top.items(), key=lambda kv: -kv[1])[:15]}


def stage_kernels(engine: Engine, prompt, rounds: int = 5, top_kernels: int = 25, plan: str | None = None,
                  batch: int = 1, **add) -> dict:
    """Per stage of one round: kernels launched and their summed GPU time (torch.profiler, the round's own
    code run eagerly, so the same kernels a graph replays; launch gaps excluded). {stage: {"kernels",
    "gpu_s", "ops" (torch ops called from the stage's code)}} plus the totals and "top_kernels" (the
    costliest kernels by name: stage, launches and GPU seconds a round); the engine must be idle (the
    `batch` requests are served and finished here). On a GPU each stage opens with a marker kernel on the
    stream (`MARK_KERNEL`, and one closes the round), so every kernel between two markers in GPU order is the
    stage's, CuPy's too (their launches sit under no torch op); "attributed" says "markers", or "ops"
    (each torch op's own kernels) where no marker was seen. budget="auto": the round of tree plan `plan`
    (a plan name such as "B=16"; default the largest tree), its front phase (draft; build = the tree of
    the plan's build size, the plans' expected tokens and the block's copies) then its back phase (verify,
    walk, commit); "plan" and "build_nodes" say which; plan "AR": the AR plan's round (no front: its draft
    and build stages stay empty), as an AR hold serves it. batch: that many requests of the prompt (seeds
    0 ...; at most the engine's max_batch), each added with `add` (add_request keywords, e.g.
    synthetic_context), so the round runs at that batch bucket."""
    if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= engine.max_batch:
        raise ValueError(f"batch={batch!r}: expected an int in [1, {engine.max_batch}] (max_batch)")
    phases = _plan_phases(engine, plan, batch)
    room = engine.max_len - len(prompt) - engine.lookahead - int(add.get("synthetic_context", 0) or 0)
    for s in range(batch):
        engine.add_request(prompt, max(1, min(3 * engine.max_accept + 2, room)), seed=s, **add)
    engine.step()
    engine.step()
    order = list(STAGES)
    prof = _profile_rounds(engine, phases, order, rounds)
    out = _stage_table(prof, order, rounds, top_kernels)
    if phases is not None:
        out.update(plan=phases[1].name, build_nodes=phases[0])
    engine.run()
    return out


def _plan_phases(engine: Engine, plan: str | None, batch: int):
    """(build nodes of the plan's front phase at `batch`'s bucket (None for the AR plan), the plan) of plan
    name `plan` on a budget="auto" engine (None: its largest tree plan); None on any other engine, which
    takes no plan. ValueError for a plan the engine does not have."""
    if engine.auto is None:
        if plan is not None:
            raise ValueError(f"plan={plan!r}: only a budget='auto' engine takes a plan")
        return None
    names = [p.name for p in engine.plans]
    trees = [p.name for p in engine.plans if p.kind == "tree"]
    name = trees[-1] if plan is None else plan
    if name not in trees and not (name == "AR" and names[0] == "AR"):
        raise ValueError(f"plan={plan!r}: expected 'AR' or one of the engine's tree plans {trees}")
    i = names.index(name)
    return engine.auto.build(engine.bucket(batch), i), engine.plans[i]


class _Marks:
    """The clock `Runner.round` takes while profiling: made, it launches a marker (`mark`) and opens the
    profiler range "stage:<first of order>"; each call(stage) closes the open range, launches a marker and
    opens the next stage's range (none after the last)."""

    def __init__(self, order, mark):
        from torch.profiler import record_function
        self.order, self.mark, self.range = order, mark, record_function
        mark()
        self.i, self.cur = 0, record_function("stage:" + order[0])
        self.cur.__enter__()

    def __call__(self, stage):
        self.cur.__exit__(None, None, None)
        self.mark()
        self.i += 1
        if self.i < len(self.order):
            self.cur = self.range("stage:" + self.order[self.i])
            self.cur.__enter__()


def _profile_rounds(engine: Engine, phases, order, rounds: int):
    """torch.profiler (CPU and CUDA) over `rounds` rounds of the engine's active requests, each run from the
    same state (the engine's lens, root and policy pend_n restored before each round and after the last),
    every stage of `order` in a "stage:<name>" range opened by a MARK_KERNEL on a GPU (`_Marks`). phases:
    `_plan_phases`'s (build nodes, plan), or None for the engine's own round."""
    from torch.profiler import ProfilerActivity

    from .profiling import profile
    gpu = engine.device.type == "cuda"
    mark = (lambda: torch.cuda._sleep(1)) if gpu else (lambda: None)   # MARK_KERNEL on the stream
    b = engine.bucket(len(engine.active))
    state = [t for t in (engine.lens, engine.root, getattr(engine.policy, "pend_n", None)) if t is not None]
    snapshot = [t.clone() for t in state]

    def restore():
        for t, v in zip(state, snapshot):
            t.copy_(v)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):  # the same round repeated from the same state
            restore()
            _one_round(engine, b, phases, _Marks(order, mark))
        _sync()
    restore()
    return prof


def _one_round(engine: Engine, b: int, phases, marks: _Marks) -> None:
    """One round at bucket b with clock `marks`: the engine's own round (phases None), the AR plan's round
    with its draft and build stages empty (no front), or one clock over both phases of a tree plan: draft,
    build in the front; verify, walk, commit after."""
    if phases is None:
        engine.runner.round(b, False, marks)
    elif phases[0] is None:   # the AR plan: no front, its stages empty
        marks("draft")
        marks("build")
        engine.runner.round(b, False, marks, plan=phases[1])
    else:
        engine.policy.front(b, phases[0], marks)
        engine.runner.round(b, False, marks, plan=phases[1])


def _op_kernels(ev) -> list[tuple[float, str]]:
    """[(duration, name)] of the kernels of profiler event `ev` and of its CPU children, recursively."""
    ks = [(k.duration, k.name) for k in ev.kernels]
    for c in ev.cpu_children:
        ks += _op_kernels(c)
    return ks


def _stage_table(prof, order, rounds: int, top_kernels: int) -> dict:
    """`stage_kernels`' record from the profile of `rounds` rounds (`_profile_rounds`), per round: each stage
    of `order`'s {"kernels", "gpu_s", "ops"}, "top_kernels", "total" and "attributed" ("markers" where
    `stage_by_markers` splits the GPU kernels, else "ops": the kernels of the torch ops in each stage's
    range, Memcpy / Memset left out)."""
    out = {s: {"kernels": 0, "gpu_s": 0.0, "ops": 0} for s in order}
    by_name: dict = {}
    cuda = [(e.time_range.start, e.time_range.elapsed_us(), e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA   # kernels, not the ranges' GPU spans
            and not getattr(e, "is_user_annotation", False) and not e.name.startswith("stage:")]
    staged = stage_by_markers(cuda, order)
    attributed = "markers" if staged is not None else "ops"
    staged = staged or []
    for ev in prof.events():
        if ev.name.startswith("stage:") and ev.device_type == torch.autograd.DeviceType.CPU:
            out[ev.name[6:]]["ops"] += len(ev.cpu_children) / rounds   # torch ops the host called in it
            if attributed == "ops":
                staged += [(ev.name[6:], dur, name) for dur, name in _op_kernels(ev)
                           if not name.startswith(("Memcpy", "Memset"))]
    for st, dur, name in staged:
        row = out[st]
        row["kernels"] += 1 / rounds
        row["gpu_s"] += dur * 1e-6 / rounds
        c = by_name.setdefault((st, name[:80]), [0.0, 0.0])
        c[0] += 1 / rounds
        c[1] += dur * 1e-6 / rounds
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top_kernels]
    out["top_kernels"] = [{"stage": st, "kernel": n, "per_round": c, "gpu_s": t} for (st, n), (c, t) in top]
    stages = [out[st] for st in order]
    out["total"] = {"kernels": sum(r["kernels"] for r in stages), "gpu_s": sum(r["gpu_s"] for r in stages)}
    out["attributed"] = attributed
    return out


MARK_KERNEL = "spin_kernel"   # torch.cuda._sleep's kernel: stage_kernels' stage boundaries on the stream


def stage_by_markers(kernels, order) -> list[tuple[str, float, str]] | None:
    """GPU kernels [(start, duration, name)] (any order) -> [(stage, duration, name)]: in start order, each
    MARK_KERNEL opens the next of `order` and the one after the last stage closes the round, over as many
    rounds as were profiled; kernels outside a round and Memcpy / Memset are left out. None when no
    marker was seen; ValueError when the markers do not come as whole rounds."""
    ks = sorted(k for k in kernels if not k[2].startswith(("Memcpy", "Memset")))
    marks = [i for i, k in enumerate(ks) if MARK_KERNEL in k[2]]
    if not marks:
        return None
    if len(marks) % (len(order) + 1):
        raise ValueError(f"stage_by_markers: {len(marks)} markers, not whole rounds of {len(order)} stages "
                         "and an end")
    out = []
    for j, (a, b) in enumerate(zip(marks, marks[1:])):
        k = j % (len(order) + 1)
        if k < len(order):   # the marker after the last stage and the next round's first enclose no stage
            out += [(order[k], d, n) for _, d, n in ks[a + 1:b]]
    return out
