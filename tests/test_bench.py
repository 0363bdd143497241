"""kdtree.bench's reading of the GPU's clock state (nvidia-smi) and the wait for a power or thermal cap to lift."""
import shutil

import pytest
import torch

from kdtree import bench


def test_parse_gpu_state_reads_clocks_and_names_the_reasons():
    st = bench.parse_gpu_state("1530, 1980, 3201, 52, 682.50, 0x0000000000000004\n")
    assert st["sm_clock_mhz"] == 1530 and st["max_sm_clock_mhz"] == 1980 and st["mem_clock_mhz"] == 3201
    assert st["temperature_c"] == 52 and st["power_w"] == 682.5
    assert st["reasons_mask"] == 4 and st["reasons"] == ["sw_power_cap"]
    idle = bench.parse_gpu_state("345, 1980, 3201, 29, 117.4, 0x0000000000000001")
    assert idle["reasons"] == ["idle"] and not idle["reasons_mask"] & bench.CAP_REASONS
    both = bench.parse_gpu_state("1200, 1980, 3201, 88, 700, 0x0000000000000044")
    assert both["reasons"] == ["sw_power_cap", "hw_thermal"]


def test_parse_gpu_state_unsupported_fields_and_bad_lines():
    st = bench.parse_gpu_state("1980, 1980, 3201, [N/A], [Not Supported], [N/A]")
    assert st["temperature_c"] is None and st["power_w"] is None
    assert st["reasons_mask"] is None and st["reasons"] is None
    with pytest.raises(ValueError, match="line: expected 6 comma-separated nvidia-smi fields"):
        bench.parse_gpu_state("1980, 1980, 3201")


def test_no_gpu_state_on_a_cpu_device_and_no_wait():
    assert bench.gpu_state("cpu") is None
    assert bench.settle_gpu("cpu", max_wait_s=5.0) < 1.0
    with pytest.raises(ValueError, match="max_wait_s=-1"):
        bench.settle_gpu("cpu", max_wait_s=-1)
    with pytest.raises(ValueError, match="poll_s=0"):
        bench.settle_gpu("cpu", poll_s=0)


def test_settle_waits_while_a_cap_holds_the_clock(monkeypatch):
    capped = bench.parse_gpu_state("1530, 1980, 3201, 52, 600, 0x0000000000000004")
    free = bench.parse_gpu_state("1980, 1980, 3201, 45, 300, 0x0000000000000000")
    seq = iter([capped, capped, capped, free])
    calls = []

    def fake(device="cuda"):
        calls.append(device)
        return next(seq)
    monkeypatch.setattr(bench, "gpu_state", fake)
    waited = bench.settle_gpu("cuda", max_wait_s=30.0, poll_s=0.01)
    assert len(calls) == 4 and 0.02 <= waited < 30.0
    monkeypatch.setattr(bench, "gpu_state", lambda device="cuda": capped)  # a cap that never lifts: bounded
    assert 0.05 <= bench.settle_gpu("cuda", max_wait_s=0.05, poll_s=0.01) < 1.0


@pytest.mark.gpu
def test_gpu_state_on_the_gpu():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not on PATH")
    st = bench.gpu_state(torch.device("cuda", torch.cuda.current_device()))
    assert st is not None, "nvidia-smi did not answer for this GPU"
    assert st["sm_clock_mhz"] > 0 and st["max_sm_clock_mhz"] >= 500 and st["mem_clock_mhz"] > 0
    assert st["reasons_mask"] is not None and isinstance(st["reasons"], list)
