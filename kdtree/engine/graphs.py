"""CUDA graphs of the engine's rounds, and the BLAS library its GEMMs prefer; stream time marks.

`GraphCache` holds every captured graph under its key, with its static output, in one memory pool on one
side stream. The keys are typed tuples: `Round(b, sampling)` a fixed budget's round at batch bucket b;
`PlanRound(b, sampling, plan)` budget="auto"'s round verifying plan i; `front(b, B)` its draft + build of a
B-node tree; `catchup(b)` its drafter catch-up; `whole(b, sampling, i)` a drafting plan's front and round in
one graph. Prefill graphs (`prefill.py`, `PrefillKey(requests, rows)`) keep a pool of their own: their
outputs are copied to static buffers, so their pool holds temporaries only and is never shared with the
rounds' static outputs.

A capture the GPU refuses is tried again in a fresh pool (seen now and then on the H200: cuBLASLt's batched
GEMM fails inside a capture that succeeds on the next try); each retry is listed in `retries`.
"""
from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import torch

CAPTURE_TRIES = 3
# The BLAS library torch is asked to prefer for the engine's GEMMs on a GPU, by their rows (batch x block
# rows of a region: draft, verify, commit, a prefill chunk): at most SMALL_GEMM_ROWS rows -> SMALL_GEMM_BLAS,
# more -> LARGE_GEMM_BLAS (None: torch's own choice). Set around each region (so also while a graph captures
# it) and restored after it. cuBLAS's own heuristic picks a slow kernel for float32 GEMMs of 8..16 rows on
# the H200; a batch-8 round's capture with 520-row verify GEMMs under cuBLAS was seen invalidated, so both
# stay on cuBLASLt.
SMALL_GEMM_ROWS = 16
SMALL_GEMM_BLAS: str | None = "cublaslt"
LARGE_GEMM_BLAS: str | None = "cublaslt"


class Round(NamedTuple):
    """A fixed budget's round at batch bucket b."""
    b: int
    sampling: bool


class PlanRound(NamedTuple):
    """budget="auto": the round verifying plan `plan` (its block from the front's static buffers)."""
    b: int
    sampling: bool
    plan: int


class Phase(NamedTuple):
    """budget="auto": a phase outside the plans' rounds: kind "front" (draft + build of `nodes`),
    "catchup" (the drafter's deferred context), "whole" (a drafting plan's front and round)."""
    kind: str
    b: int
    sampling: bool = False
    plan: int = -1
    nodes: int = 0


class PrefillKey(NamedTuple):
    """A prefill chunk's shape: requests x rows each."""
    requests: int
    rows: int


def front(b: int, nodes: int) -> Phase:
    return Phase("front", b, nodes=nodes)


def catchup(b: int) -> Phase:
    return Phase("catchup", b)


def whole(b: int, sampling: bool, plan: int) -> Phase:
    return Phase("whole", b, sampling, plan)


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


def blas_for(device: torch.device, rows: int):
    """The BLAS library of a region of `rows` GEMM rows (SMALL_GEMM_BLAS / LARGE_GEMM_BLAS) on a GPU."""
    lib = SMALL_GEMM_BLAS if rows <= SMALL_GEMM_ROWS else LARGE_GEMM_BLAS
    return preferred_blas(lib if device.type == "cuda" else None)


@contextlib.contextmanager
def capturing(g: "torch.cuda.CUDAGraph", pool, stream: "torch.cuda.Stream"):
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


def end_pool(device: torch.device, pool) -> None:
    """After a failed capture: stop routing the stream's allocations to the graph's memory pool (a failed
    capture can leave the allocator recording to it, and the next capture into it would be refused)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)
    except RuntimeError:
        pass


class GraphCache:
    """The rounds' graphs by key (module docstring) and their static outputs, one pool, one side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.retries: list[str] = []
        self.pool = None
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def get(self, key):
        return self.graphs.get(key)

    def replay(self, key):
        """Replay graph `key`; returns its static output (rewritten by every replay)."""
        self.graphs[key].replay()
        return self.outputs.get(key)

    @contextlib.contextmanager
    def on_side(self):
        """Captures inside run on the side stream, ordered after the current stream's work and before its
        next."""
        cur = torch.cuda.current_stream(self.device)
        self.side.wait_stream(cur)
        with torch.cuda.stream(self.side):
            yield
        cur.wait_stream(self.side)

    def capture(self, key, fn):
        """Warm fn up twice, then capture it as graph `key` on the side stream into the shared pool (a
        refused capture is tried again in a fresh pool, which the graphs after it share, up to CAPTURE_TRIES
        times). Returns fn's output: the graph's static output."""
        for _ in range(2):
            fn()
        for attempt in range(CAPTURE_TRIES):
            g = torch.cuda.CUDAGraph()
            if self.pool is None:   # the id known before the capture, so a failed one can end its pool
                self.pool = torch.cuda.graph_pool_handle()
            try:
                with torch.cuda.graph(g, pool=self.pool, stream=self.side):
                    out = fn()
                break
            except RuntimeError as e:  # torch.AcceleratorError is one
                if attempt == CAPTURE_TRIES - 1:
                    raise
                torch.cuda.synchronize(self.device)
                end_pool(self.device, self.pool)
                self.pool = None  # the retry, and the graphs after it, in a fresh pool
                self.retries.append(f"{key}: {str(e).splitlines()[0][:120]}")
        self.graphs[key] = g
        self.outputs[key] = out
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Stamps:
    """Time marks on the stream: CUDA events (twelve reused ones, three rounds' worth: a round's marks are
    read after two more rounds may have recorded theirs, under overlap) or the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(12)] if self.cuda else []

    def __call__(self, slot: int | None = None):
        """A mark now (slot: one of the reused events; None: a fresh one)."""
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True) if slot is None else self.events[slot]
        e.record()
        return e

    def secs(self, a, z) -> float:
        return a.elapsed_time(z) * 1e-3 if self.cuda else z - a


class Clock:
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


def graph_blocker(e) -> str | None:
    """Why engine e's rounds cannot run as CUDA graphs, or None where they can."""
    from torch import nn

    from ..model import Int4Experts
    if e.device.type != "cuda":
        return "graphs need a CUDA device"
    if not e.ops.capturable:
        return "the golden backend's tree steps run on the host"
    if e.mode != "ar" and not e.batched_drafter:
        return "a host drafter (sessions) drafts on the host"
    for layer in e.model.model.layers:
        ex = getattr(layer.mlp, "experts", None)
        if isinstance(ex, Int4Experts) and e.model.dtype != torch.bfloat16:
            return "INT4 experts outside bf16 take the host-driven reference path"
    if getattr(e.model, "tp", None) is not None:
        return "tensor-parallel ranks run eagerly"
    if e.moe == "loop" and any(isinstance(getattr(layer.mlp, "experts", None), nn.ModuleList)
                               for layer in e.model.model.layers):
        return "moe='loop' reads the routing on the host"
    return None
