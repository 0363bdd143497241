"""The device's two ceilings, measured in the run that uses them: copy bandwidth (bytes read + written by a
device-to-device copy) and the bf16 matmul rate. Floors are bytes over the one and FLOPs over the other."""
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


def measure_ceilings() -> dict:
    """Both ceilings, as the records keep them: {"copy_bandwidth_Bps", "bf16_matmul_flops", "copy_bytes",
    "matmul_shape"}."""
    bw = copy_bandwidth(2 << 30)
    return {"copy_bandwidth_Bps": bw["bytes_per_s"], "bf16_matmul_flops": matmul_rate(8192),
            "copy_bytes": bw["bytes"], "matmul_shape": [8192, 8192, 8192]}
