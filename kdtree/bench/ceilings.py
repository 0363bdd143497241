"""The device's ceilings, measured in the run that uses them: copy bandwidth (bytes read + written by a
device-to-device copy), the bf16 matmul rate, and the launch floor (seconds a kernel of a graph replay takes
when it does next to nothing). Floors are bytes over the first, FLOPs over the second, kernels times the
third."""
from __future__ import annotations

import torch

from .timer import measure


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> dict:
    """A buffer of nbytes copied `repeats` times after a warm-up, CUDA events: {"bytes_per_s" (median),
    "max_bytes_per_s", "bytes"} with bytes moved = read + written."""
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes={nbytes!r}, repeats={repeats!r}: expected both >= 1")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), repeats)
    src = dst = None  # free both before the caller's next allocation
    torch.cuda.empty_cache()
    return {"bytes_per_s": 2 * nbytes / t.median, "max_bytes_per_s": 2 * nbytes / t.min, "bytes": 2 * nbytes}


def matmul_rate(m: int = 8192, repeats: int = 20) -> float:
    """FLOP/s of an [m, m] x [m, m] bf16 matmul on random data (median of CUDA-event repeats)."""
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    return 2 * m**3 / measure(lambda: x @ y, repeats).median


def launch_floor(kernels: int = 256, repeats: int = 30) -> dict:
    """Seconds per kernel of a CUDA graph of `kernels` dependent one-element kernels (in-place adds on one
    float), median of graph replays: what each launch of a replayed round costs however little it does.
    {"s_per_kernel", "min_s_per_kernel", "kernels"}."""
    if kernels < 1 or repeats < 1:
        raise ValueError(f"kernels={kernels!r}, repeats={repeats!r}: expected both >= 1")
    x = torch.zeros(1, device="cuda")

    def chain():
        for _ in range(kernels):
            x.add_(1.0)
    t = measure(chain, repeats, "graph", warm_s=0.05)
    return {"s_per_kernel": t.median / kernels, "min_s_per_kernel": t.min / kernels, "kernels": kernels}


def measure_ceilings() -> dict:
    """Both ceilings, as the records keep them: {"copy_bandwidth_Bps", "bf16_matmul_flops", "copy_bytes",
    "matmul_shape"}."""
    bw = copy_bandwidth(2 << 30)
    return {"copy_bandwidth_Bps": bw["bytes_per_s"], "bf16_matmul_flops": matmul_rate(8192),
            "copy_bytes": bw["bytes"], "matmul_shape": [8192, 8192, 8192]}
