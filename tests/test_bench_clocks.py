"""kdtree.bench.clocks: the reading of the GPU's clock state (nvidia-smi) and the wait for a power or
thermal cap to lift."""
import shutil

import pytest
import torch

from kdtree.bench import clocks as bench


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


def test_settle_waits_while_a_cap_holds_the_clock_down(monkeypatch):
    capped = bench.parse_gpu_state("1530, 1980, 3201, 52, 600, 0x0000000000000004")
    free = bench.parse_gpu_state("1980, 1980, 3201, 45, 300, 0x0000000000000000")
    at_max = bench.parse_gpu_state(
        "1980, 1980, 3201, 38, 128, 0x0000000000000004"
    )  # flag set, clock not lowered
    calls = []

    def fake_from(states):
        it = iter(states)

        def fake(device="cuda"):
            calls.append(device)
            if len(calls) > 1000:
                raise AssertionError("settle_gpu kept polling past its bound")
            return next(it)

        return fake

    monkeypatch.setattr(bench, "gpu_state", fake_from([free]))
    assert bench.settle_gpu("cuda") == 0.0 and len(calls) == 1
    calls.clear()
    monkeypatch.setattr(bench, "gpu_state", fake_from([at_max]))
    assert bench.settle_gpu("cuda") == 0.0 and len(calls) == 1
    calls.clear()
    monkeypatch.setattr(bench, "gpu_state", fake_from([capped, capped, capped, free]))
    waited = bench.settle_gpu("cuda", max_wait_s=30.0, poll_s=0.01)
    assert len(calls) == 4 and 0.03 <= waited < 30.0
    calls.clear()
    monkeypatch.setattr(bench, "gpu_state", fake_from([capped] * 2000))  # a cap that never lifts: bounded
    assert 0.05 <= bench.settle_gpu("cuda", max_wait_s=0.05, poll_s=0.01) < 1.0


class _Props:
    def __init__(self, uuid):
        self.uuid = uuid


def _fake_smi(monkeypatch, answers, uuid="0f1e2d3c-aaaa-bbbb-cccc-111122223333"):
    """gpu_state against a scripted nvidia-smi: answers[i] = (returncode, stdout) of the i-th call."""
    import shutil
    import subprocess

    calls = []
    it = iter(answers)

    def run(cmd, **kw):
        calls.append(cmd)
        rc, out = next(it)
        return subprocess.CompletedProcess(cmd, rc, stdout=out, stderr="")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(uuid))
    monkeypatch.setattr(bench, "_SMI_REASON_FIELD", [])
    return calls


def test_gpu_state_asks_nvidia_smi_for_this_gpu_by_uuid(monkeypatch):
    calls = _fake_smi(monkeypatch, [(0, "1980, 1980, 3201, 40, 300.5, 0x0000000000000000\n")])
    st = bench.gpu_state("cuda")
    assert st["sm_clock_mhz"] == 1980 and st["reasons"] == []
    assert "--id=GPU-0f1e2d3c-aaaa-bbbb-cccc-111122223333" in calls[0]
    assert any(a.startswith("--query-gpu=") and a.endswith("clocks_event_reasons.active") for a in calls[0])


def test_gpu_state_falls_back_to_the_older_field_and_keeps_it(monkeypatch):
    calls = _fake_smi(
        monkeypatch,
        [
            (2, 'Field "clocks_event_reasons.active" is not a valid field\n'),
            (0, "1410, 1410, 1593, 33, 60, 0x0000000000000001\n"),
            (0, "1410, 1410, 1593, 33, 61, 0x0000000000000001\n"),
        ],
    )
    assert bench.gpu_state("cuda")["reasons"] == ["idle"]
    assert calls[1][-1].endswith("clocks_throttle_reasons.active")
    assert (
        bench.gpu_state("cuda")["power_w"] == 61 and len(calls) == 3
    )  # one call: the answering field is kept


def test_gpu_state_is_none_when_nvidia_smi_answers_nothing_usable(monkeypatch):
    _fake_smi(monkeypatch, [(0, "[Unknown Error]\n"), (0, "No devices were found\n")])
    assert bench.gpu_state("cuda") is None
    two = "1980, 1980, 3201, 40, 300, 0x0\n1980, 1980, 3201, 41, 310, 0x0\n"  # no UUID: which GPU is ours?
    calls = _fake_smi(monkeypatch, [(0, two), (0, two)], uuid="")
    assert bench.gpu_state("cuda") is None and not any(a.startswith("--id=") for a in calls[0])
    _fake_smi(monkeypatch, [(0, "1980, 1980, 3201, 40, 300, 0x0\n")], uuid="")  # one GPU listed: it is ours
    assert bench.gpu_state("cuda")["sm_clock_mhz"] == 1980


@pytest.mark.gpu
def test_gpu_state_on_the_gpu():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not on PATH")
    st = bench.gpu_state(torch.device("cuda", torch.cuda.current_device()))
    assert st is not None, "nvidia-smi did not answer for this GPU"
    assert st["sm_clock_mhz"] > 0 and st["max_sm_clock_mhz"] >= 500 and st["mem_clock_mhz"] > 0
    assert st["reasons_mask"] is not None and isinstance(st["reasons"], list)
