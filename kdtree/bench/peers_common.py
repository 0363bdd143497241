"""What every section of `python -m kdtree.bench.peers` shares: the agreement tolerance, finding an
installed distribution's version, the stub modules SGLang's kernel files are loaded under (its package
__init__ files and server never run), the relative difference of two outputs, and the timing of one side
(`time_calls`) and of a row's sides (`run_sides`: each side's output checked before its time counts; a side
that fails or disagrees is skipped with its reason), and what FlashInfer's attention would gain and cost the
engine (`flashinfer_in_engine`)."""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import math
import os
import sys
import types
from pathlib import Path

import torch

from .timer import measure

AGREE = 1e-2               # a peer's output agrees with ours within this (bf16 outputs)
QUEUE_CYCLES = 2_000_000   # GPU spin before each timed eager call (longer than any side's host work)
SGLANG_FILES = "kernels/ops/attention"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def bare_package(name: str, path: Path | None) -> types.ModuleType:
    """sys.modules[name], made where absent: a package module whose submodules are found in `path` (None:
    none) and whose __init__ never runs; its spec says so (importlib.util.find_spec answers it)."""
    if name not in sys.modules:
        m = types.ModuleType(name)
        m.__path__ = [str(path)] if path is not None else []
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        m.__spec__.submodule_search_locations = m.__path__
        sys.modules[name] = m
    return sys.modules[name]


def sglang_stubs() -> Path:
    """Bare package modules for sglang's folders (`bare_package`: their __init__ files never run) and stubs
    for the runtime utilities its attention kernels import (device predicates, environment flags); returns
    the installed package's folder. Calling it again keeps what is there."""
    spec = importlib.util.find_spec("sglang")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, sub in (("sglang", ""), ("sglang.kernels", "kernels"), ("sglang.kernels.ops", "kernels/ops"),
                      ("sglang.kernels.ops.attention", SGLANG_FILES)):
        bare_package(name, root / sub)
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_cuda = lambda: torch.cuda.is_available() and torch.version.hip is None
    utils.is_hip = lambda: False
    utils.is_gfx95_supported = utils.is_gfx1250_supported = lambda: False
    utils.get_device_core_count = lambda i=0: torch.cuda.get_device_properties(i).multi_processor_count

    class _Flag:
        def __init__(self, name):
            self.name = name

        def get(self):
            v = os.environ.get(self.name)
            return False if v is None else v.lower() in ("1", "true", "yes")

    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = type("Envs", (), {"__getattr__": lambda self, name: _Flag(name)})()
    bare_package("sglang.srt", None)
    for m in (utils, environ):
        sys.modules.setdefault(m.__name__, m)
    return root


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| in float32 (ref all zero: over 1e-30)."""
    a, ref = a.float(), ref.float()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def clear_cuda_error() -> None:
    """A launch refused by the runtime (an invalid block, say) leaves the thread's last CUDA error set, and
    the next side's launch check would report it as its own: read it off (cudaGetLastError, the runtime
    torch loaded)."""
    import ctypes
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def time_calls(calls, repeats: int) -> tuple[float, str]:
    """(median seconds, how): `calls` (one callable per input set, rotated) as CUDA-graph replays timed by
    CUDA events behind a GPU spin (timer.measure "graph", how "graph"); where capture fails, as eager calls
    timed by CUDA events behind a spin of QUEUE_CYCLES (how "events")."""
    try:
        return measure(calls, repeats, "graph").median, "graph"
    except Exception:  # noqa: BLE001 - a side that cannot be captured is timed eagerly
        clear_cuda_error()
        torch.cuda.synchronize()
        return measure(calls, repeats, queued=True, queue_cycles=QUEUE_CYCLES).median, "events"


def run_sides(row: dict, sides: dict, check, repeats: int, timer=time_calls) -> dict:
    """Each side of `sides` ({name: make}, make() -> callables, one per input set) into `row`: its first
    call's output goes to check(name, out) -> (agreement, why), agreement kept in row["agree"][name]; a
    side with a reason `why` (its output disagrees) or whose make / call / timing raises lands in
    row["skipped"][name] with the reason, else timer(calls, repeats) -> (seconds, how) in row["time_s"] and
    row["timing"]. Returns row."""
    for name, make in sides.items():
        try:
            calls = make()
            value, why = check(name, calls[0]())
            row["agree"][name] = value
            if why:
                row["skipped"][name] = why
                continue
            row["time_s"][name], row["timing"][name] = timer(calls, repeats)
        except Exception as e:  # noqa: BLE001 - a peer that cannot take the shape: the row says why
            row["skipped"][name] = f"{type(e).__name__}: {e}"[:300]
            if torch.cuda.is_available():
                clear_cuda_error()
    return row


def best_peer(row: dict, exclude=("ours",)) -> dict:
    """row["best_peer"] (the fastest timed side not in `exclude`) and row["ours_over_best_peer"] (its time /
    ours: above 1 ours is faster), where both were timed. Returns row."""
    peer_t = {k: v for k, v in row["time_s"].items() if k not in exclude}
    if peer_t and row["time_s"].get("ours"):
        best = min(peer_t, key=peer_t.get)
        row["best_peer"], row["ours_over_best_peer"] = best, peer_t[best] / row["time_s"]["ours"]
    return row


def flashinfer_in_engine(rows: list[dict], ar: dict | None = None) -> list[dict]:
    """Whether the engine would gain by taking FlashInfer's MLA, per cell where FlashInfer ran. Whole (decode
    and chains): the kernel's gain a layer (ours - FlashInfer's best side, the pool read in place included),
    its plan() host seconds (one a round, with the round's kv lengths given on the host) and the overlap the
    engine gives up for it: none at decode (the engine's AR takes the whole pass with prefix_attn="flashinfer"
    and knows its lengths with a round in flight), else ar's overlap_gain_s, where measured (on the AR
    section's engine, the trained target at batch 1, charged to every chain alike); "layers_to_pay": the
    layers a round needs before the gain covers both costs, None with "why" where FlashInfer is not faster or
    its plan() was not timed (an older record). The split (prefix_attn="flashinfer" on blocks, every kind,
    trees included, where the record timed it): "split_gain_per_layer_s" = ours - the split; it keeps the
    overlap (its plan covers the rows committed at launch), so its plan() is host work done while the round
    before runs."""
    lost = (ar or {}).get("overlap_gain_s")
    out = []
    for r in rows:
        t = r["time_s"]
        fi = {k: v for k, v in t.items() if k.startswith("flashinfer_")}
        if not fi and "split" not in t:
            continue
        row = {"heads": r["heads"], "context": r["context"], "nodes": r["nodes"], "batch": r["batch"],
               "kind": r["kind"], "backend": None, "gain_per_layer_s": None, "plan_s": None,
               "overlap_lost_s": lost, "layers_to_pay": None}
        if "split" in t:
            row["split_gain_per_layer_s"] = t["ours"] - t["split"]
        if r["kind"] == "tree" or not fi:   # FlashInfer has no tree mask: only the split can serve a tree
            row["why"] = "no whole FlashInfer pass for this kind (the split only)"
            out.append(row)
            continue
        best = min(fi, key=fi.get)
        gain = t["ours"] - fi[best]
        plan = r.get("plan_s", {}).get(best)
        lost_here = 0.0 if r["kind"] == "decode" else lost
        cost = None if plan is None else plan + max(lost_here or 0.0, 0.0)
        row.update(backend=best, gain_per_layer_s=gain, plan_s=plan, overlap_lost_s=lost_here)
        if gain <= 0:
            row["why"] = "FlashInfer is not faster than ours here"
        elif cost is None:
            row["why"] = "plan() was not timed (a record from before plan_s)"
        else:
            row["layers_to_pay"] = math.ceil(cost / gain - 1e-9)
        out.append(row)
    return out


def format_in_engine(rows: list[dict]) -> str:
    """flashinfer_in_engine's rows, a line each: the whole pass's gain a layer and its costs a round, and
    the split's gain a layer where timed."""
    lines = []
    for r in rows:
        head = f"FlashInfer in the engine, {r['heads']} heads, ctx {r['context']}, {r.get('kind', '')} " \
               f"N={r['nodes']}, b {r['batch']}: "
        parts = []
        if r["gain_per_layer_s"] is not None:
            pay = r["layers_to_pay"]
            plan, lost = 1e6 * (r["plan_s"] or 0), 1e6 * (r["overlap_lost_s"] or 0)
            parts.append(f"whole {1e6 * r['gain_per_layer_s']:+.1f} us a layer, plan() {plan:.1f} us and "
                         f"{lost:.1f} us of overlap a round: "
                         + (f"pays from {pay} layers" if pay else r.get("why", "never pays")))
        if r.get("split_gain_per_layer_s") is not None:
            parts.append(f"split {1e6 * r['split_gain_per_layer_s']:+.1f} us a layer (overlap kept)")
        lines.append(head + ("; ".join(parts) or r.get("why", "")))
    return "\n".join(lines)
