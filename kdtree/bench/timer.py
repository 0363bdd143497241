"""The one timer of every benchmark in the lab.

    measure(fn, repeats, mode)        -> Times (seconds per repeat: .times, .median, .min)

`fn` is a callable or a list of callables, one per input set: repeats cycle through the list so that
consecutive repeats read different memory (`input_sets` says how many sets of a given size rotate past L2).
Modes:
  graph   each callable captured in a CUDA graph (one warm-up call per set on a side stream first); a
          repeat is one replay timed by CUDA events, queued behind a GPU spin: the GPU's time alone, launch
          latency hidden as in a graph-launched decode loop. warm_s: replay that long first; before: called
          right before the timed replays (e.g. bench.clocks.settle_gpu); queued=False drops the spin.
  events  CUDA events around one eager call; queued=True puts a spin of queue_cycles before the first event
          so that the host's launch cost is hidden behind it.
  wall    host clock around one call, the device synchronized before and after (a host-side path, or a
          call that synchronizes itself).
  host    host seconds per call over `calls` back-to-back calls enqueued behind a long GPU spin, so the GPU
          never holds the host back (the host cost of a launch path; an error if the spin ran out first).
`mode_for(device)`: "events" on a CUDA device, "wall" elsewhere.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

L2_BYTES = 60 * 2**20          # the H200's L2 is 50 MiB: 60 MiB rotates past it
QUEUE_CYCLES = 200_000         # GPU spin before a timed graph replay (~0.1 ms on an H200)
HOST_SPIN_CYCLES = 50_000_000  # GPU spin that host-mode calls are launched behind (~25 ms on an H200)
MODES = ("graph", "events", "wall", "host")


@dataclass
class Times:
    """Seconds per repeat, in the order they ran."""
    times: list[float]
    mode: str

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)


def input_sets(set_bytes: int, lo: int = 1, hi: int = 16, factor: float = 3.0) -> int:
    """How many input sets of `set_bytes` to rotate so that `factor` x L2 bytes lie between two uses of one
    set, clamped to [lo, hi]."""
    if set_bytes <= 0 or lo < 1 or hi < lo:
        raise ValueError(f"set_bytes={set_bytes!r}, lo={lo!r}, hi={hi!r}: expected set_bytes > 0, "
                         "1 <= lo <= hi")
    return max(lo, min(hi, math.ceil(factor * L2_BYTES / set_bytes)))


def mode_for(device) -> str:
    return "events" if torch.device(device).type == "cuda" else "wall"


def _cycle(fns):
    k = [0]

    def call():
        fns[k[0] % len(fns)]()
        k[0] += 1
    return call


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(fn, repeats: int, mode: str = "events", *, warmup: int | None = None, queued: bool | None = None,
            queue_cycles: int = QUEUE_CYCLES, warm_s: float = 0.0, before=None, calls: int = 1) -> Times:
    """Times of `repeats` repeats of fn (module docstring) after `warmup` untimed calls (default: 3 for
    events, one replay per input set for graph, 1 for wall and host); before() runs after the warm-up,
    right before the timed repeats. queued (events and graph; default: graph only) puts a spin of
    queue_cycles before each timed repeat; calls (host mode only): calls per repeat."""
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    if not fns or not all(callable(f) for f in fns):
        raise ValueError("fn: expected a callable or a non-empty list of callables")
    if repeats < 1 or calls < 1 or (warmup is not None and warmup < 0) or warm_s < 0 or queue_cycles < 0:
        raise ValueError(f"repeats={repeats!r}, calls={calls!r}, warmup={warmup!r}, warm_s={warm_s!r}, "
                         f"queue_cycles={queue_cycles!r}: expected repeats >= 1, calls >= 1, warmup >= 0, "
                         "warm_s >= 0, queue_cycles >= 0")
    misplaced = calls != 1 and mode != "host" or queued and mode not in ("events", "graph")
    if misplaced or warm_s and mode != "graph":
        raise ValueError(f"mode={mode!r}: calls is for mode 'host', queued for 'events' and 'graph', warm_s "
                         "for 'graph'")
    if mode in ("graph", "events", "host") and not torch.cuda.is_available():
        raise RuntimeError(f"measure(mode={mode!r}) needs a CUDA device; use mode='wall' on a CPU")
    if mode == "graph":
        return _graph(fns, repeats, warmup, queued is not False, queue_cycles, warm_s, before)
    call = _cycle(fns)
    for _ in range(({"events": 3}.get(mode, 1) if warmup is None else warmup)):
        call()
    _sync()
    if before is not None:
        before()
    times = []
    for _ in range(repeats):
        if mode == "events":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                torch.cuda._sleep(queue_cycles)
            a.record()
            call()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        elif mode == "wall":
            _sync()
            t = time.perf_counter()
            call()
            _sync()
            times.append(time.perf_counter() - t)
        else:  # host: the spin must outlast the calls' launches, or the GPU held the host back
            torch.cuda._sleep(HOST_SPIN_CYCLES)
            t = time.perf_counter()
            for _ in range(calls):
                call()
            times.append((time.perf_counter() - t) / calls)
            done = torch.cuda.Event()
            done.record()
            if done.query():
                raise RuntimeError(f"measure(mode='host'): the GPU finished before {calls} calls were "
                                   "launched (their GPU work outlasts the spin): time fewer calls")
            torch.cuda.synchronize()
    return Times(times, mode)


def _graph(fns, repeats: int, warmup: int | None, queued: bool, queue_cycles: int, warm_s: float,
           before) -> Times:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()  # warm-up: compile, allocate
    torch.cuda.current_stream().wait_stream(s)
    graphs = []
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs.append(g)
    replay = _cycle([g.replay for g in graphs])
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        for _ in range(8):
            replay()
        torch.cuda.synchronize()
    t = measure(replay, repeats, "events", warmup=len(graphs) if warmup is None else warmup, queued=queued,
                queue_cycles=queue_cycles, before=before)
    del graphs
    return Times(t.times, "graph")
