"""kdtree.bench.peers on a CPU: the runner with the peers absent, SGLang's kernel files loaded by path under
stubs (its package __init__ never runs), the targets' arithmetic. The timed cells run on a GPU only."""
import importlib.util
import json
import sys
import types

import pytest
import torch

from kdtree.bench import peers


@pytest.fixture
def no_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the runner times cells there")


def test_runner_with_every_peer_absent_records_why(tmp_path, no_gpu, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real(n, *a))
    monkeypatch.setitem(sys.modules, "flashinfer", None)          # import flashinfer -> ImportError
    rec = peers.run(tmp_path, quick=True)
    on_disk = json.loads((tmp_path / "peers.json").read_text())
    assert on_disk == rec
    fi = rec["peers"]["flashinfer"]
    assert fi["available"] is False and "flashinfer" in fi["reason"]
    assert rec["peers"]["sglang"]["available"] is False
    assert "sglang is not installed" in rec["peers"]["sglang"]["reason"]
    assert "no CUDA GPU" in rec["skipped"] and rec["attention"] == [] and rec["targets"] == []


def test_sglang_files_load_by_path_under_stubs(tmp_path, monkeypatch):
    root = tmp_path / "sglang"
    att = root / "kernels" / "ops" / "attention"
    att.mkdir(parents=True)
    for init in (root, root / "kernels", root / "kernels" / "ops", att):
        (init / "__init__.py").write_text("raise RuntimeError('a package __init__ ran')\n")
    (att / "verify_mla.py").write_text(
        "from sglang.srt.utils import is_hip\n"
        "def verify_shared_kv_fwd(*a, **k):\n    return not is_hip()\n")
    (att / "extend_attention.py").write_text(
        "from sglang.srt.environ import envs\nfrom sglang.srt.utils import is_cuda, get_device_core_count\n"
        "FLAG = envs.SGLANG_TRITON_FP8_PREFILL_ATTN.get()\n"
        "def extend_attention_fwd(*a, **k):\n    return FLAG\n")
    spec = types.SimpleNamespace(submodule_search_locations=[str(root)])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: spec if n == "sglang" else real(n, *a))
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delenv("SGLANG_TRITON_FP8_PREFILL_ATTN", raising=False)
    found = peers.find_peers()["sglang"]
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)                     # leave no fake sglang behind
    assert found["available"], found.get("reason")
    assert found["api"]["verify"]() is True and found["api"]["extend"]() is False


def test_a_broken_peer_is_skipped_with_its_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real(n, *a))
    boom = types.ModuleType("flashinfer")

    def __getattr__(name):
        raise OSError("libcudart.so.13: cannot open shared object file")
    boom.__getattr__ = __getattr__
    monkeypatch.setitem(sys.modules, "flashinfer", boom)
    fi = peers.find_peers()["flashinfer"]
    assert fi["available"] is False and "libcudart" in fi["reason"]


def test_targets_compare_ours_with_the_best_peer_and_the_cascade():
    rows = [{"heads": 64, "context": 4096, "nodes": 1, "batch": 8, "kind": "decode", "best_peer": "sglang",
             "ours_over_best_peer": 0.8},
            {"heads": 64, "context": 4096, "nodes": 64, "batch": 1, "kind": "tree", "best_peer": "sglang",
             "ours_over_best_peer": 1.5, "ours_over_cascade": 1.1}]
    t = peers.build_targets(rows)
    assert [(x["key"], x["measured"], x["met"]) for x in t] == [
        ("peers_attention_vs_best", 0.8, False), ("peers_attention_vs_best", 1.5, True),
        ("peers_tree_vs_cascade", 1.1, False)]
    assert "sglang" in t[0]["name"] and "N=64" in t[2]["name"]


def test_bad_repeats_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        peers.main(["--repeats", "0"])
    assert "--repeats 0" in capsys.readouterr().err


def test_the_ar_target_is_the_engine_over_transformers_compiled():
    t = peers.build_targets([], {"engine_over_hf_compiled": 3.4})
    assert [(x["key"], x["measured"], x["met"]) for x in t] == [("peers_ar_vs_hf_compiled", 3.4, True)]
    assert peers.build_targets([], {"skipped": "transformers is not installed"}) == []
