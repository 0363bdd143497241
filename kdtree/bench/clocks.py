"""The GPU's clock state: what nvidia-smi says of the SM clock, temperature, power and active clock caps, and
a wait while a power or thermal cap holds the clock down. Latency-bound kernels run at the SM clock, so
records carry the state beside such times (bench.moe's rows, the suite's start and end)."""
from __future__ import annotations

import time

import torch

SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "power.draw")
CLOCK_REASONS = {0x1: "idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clocks"}
CAP_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # caps that lower the clock under load


def parse_gpu_state(line: str) -> dict:
    """One nvidia-smi CSV line (SMI_FIELDS, then the active clock-event reasons as hex; noheader, nounits) ->
    {sm_clock_mhz, max_sm_clock_mhz, mem_clock_mhz, temperature_c, power_w, reasons (names), reasons_mask}.
    A field nvidia-smi reports as unsupported ("[N/A]", "[Not Supported]") becomes None."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != len(SMI_FIELDS) + 1:
        raise ValueError(
            f"line: expected {len(SMI_FIELDS) + 1} comma-separated nvidia-smi fields, got {line!r}"
        )

    def num(v):
        try:
            return float(v)
        except ValueError:
            return None

    sm, sm_max, mem, temp, power = (num(v) for v in parts[:-1])
    try:
        mask = int(parts[-1], 16)
    except ValueError:
        mask = None
    return {
        "sm_clock_mhz": sm,
        "max_sm_clock_mhz": sm_max,
        "mem_clock_mhz": mem,
        "temperature_c": temp,
        "power_w": power,
        "reasons_mask": mask,
        "reasons": None if mask is None else [n for b, n in CLOCK_REASONS.items() if mask & b],
    }


_SMI_REASON_FIELD = []  # the clock-reason field name this driver answered to, once known


def gpu_state(device="cuda") -> dict | None:
    """The GPU's clocks, temperature, power draw and active clock-event reasons now (parse_gpu_state), from
    nvidia-smi, addressed by the device's UUID; None on a CPU device, without a CUDA device, without a working
    nvidia-smi, or where the GPU cannot be told apart (no UUID and several GPUs listed; a MIG slice's UUID,
    which nvidia-smi's GPU queries do not take)."""
    import shutil
    import subprocess

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    cmd = ["nvidia-smi", "--format=csv,noheader,nounits"]
    uuid = str(getattr(torch.cuda.get_device_properties(idx), "uuid", "") or "")
    if uuid:  # the same GPU whatever CUDA_VISIBLE_DEVICES does to indices (nvidia-smi ignores it)
        cmd.append("--id=" + (uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid))
    fields = _SMI_REASON_FIELD or [
        "clocks_event_reasons.active",
        "clocks_throttle_reasons.active",
    ]  # newer, older
    for reasons in fields:
        try:
            r = subprocess.run(
                cmd + ["--query-gpu=" + ",".join(SMI_FIELDS + (reasons,))],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        lines = r.stdout.strip().splitlines() if r.returncode == 0 else []
        if len(lines) != 1:  # an error, or several GPUs listed (no UUID to pick one by)
            continue
        try:
            st = parse_gpu_state(lines[0])
        except ValueError:
            continue
        _SMI_REASON_FIELD[:] = [reasons]
        return st
    return None


def _capped(st: dict | None) -> bool:
    """A power or thermal cap is active and the SM clock is below its maximum (when both are reported)."""
    if st is None or st["reasons_mask"] is None or not st["reasons_mask"] & CAP_REASONS:
        return False
    sm, top = st["sm_clock_mhz"], st["max_sm_clock_mhz"]
    return sm is None or top is None or sm < 0.98 * top


def settle_gpu(device="cuda", max_wait_s: float = 10.0, poll_s: float = 0.25) -> float:
    """Wait (idle) while a power or thermal cap holds the GPU's SM clock below its maximum, at most
    max_wait_s; returns the seconds waited (0.0 when no cap holds it, or without a GPU state to read)."""
    if max_wait_s < 0 or poll_s <= 0:
        raise ValueError(
            f"max_wait_s={max_wait_s!r}, poll_s={poll_s!r}: expected max_wait_s >= 0, poll_s > 0"
        )
    if not _capped(gpu_state(device)):
        return 0.0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        time.sleep(poll_s)
        if not _capped(gpu_state(device)):
            break
    return time.perf_counter() - t0
