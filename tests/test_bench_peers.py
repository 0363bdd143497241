"""kdtree.bench.peers on a CPU: the runner with the peers absent, SGLang's kernel files loaded by path under
stubs (its package __init__ never runs), the targets' arithmetic. The timed cells run on a GPU only.
The sections (bench.peers_sections, bench.peers_moe): their flags, their peers absent, SGLang's MoE files
loaded by path, the INT4 layout adapter exact (its checker shown failing on planted corruptions), the MoE
row's config sweep and checks with fakes on a CPU, the top-k agreement, the record written row by row."""
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from kdtree.bench import peers, peers_common, peers_moe, peers_sections, peers_sides
from kdtree.bench.timer import measure


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


def test_the_engines_split_is_a_target_against_the_best_peer_not_a_peer():
    rows = [{"heads": 64, "context": 32768, "nodes": 16, "batch": 1, "kind": "chain",
             "best_peer": "flashinfer_fa3", "ours_over_best_peer": 0.63, "split_over_best_peer": 0.95}]
    t = peers.build_targets(rows)
    assert [(x["key"], x["measured"], x["met"]) for x in t] == [
        ("peers_attention_vs_best", 0.63, False), ("peers_split_vs_best", 0.95, False)]
    assert "prefix split" in t[1]["name"] and "flashinfer_fa3" in t[1]["name"]
    assert {"ours", "cascade", "split"} <= set(peers_sides.OURS_SIDES)   # never counted as the best peer


def test_cells_parse_and_bad_ones_are_refused_naming_them(capsys):
    assert peers.parse_cell("64:32768:16:1:chain") == (64, 32768, 16, 1, "chain")
    for bad, why in (("64:32768:16:1", "heads:context:nodes:batch:kind"),
                     ("64:100:1:1:decode", "multiple of 64"), ("64:4096:x:1:tree", "must be ints"),
                     ("64:4096:16:1:cascade", "kind 'cascade'"),
                     ("64:4096:4:1:decode", "a decode cell has 1 node"), ("64:4096:1:1:tree", "at least 2")):
        with pytest.raises(ValueError, match=why):
            peers.parse_cell(bad)
    with pytest.raises(SystemExit):
        peers.main(["--cells", "8:4096:1:1:decode", "64:0:1:1:decode"])
    assert "--cells '64:0:1:1:decode'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peers.main(["--cells", "8:4096:1:1:decode", "--quick"])
    assert "without --quick" in capsys.readouterr().err


def test_bad_repeats_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        peers.main(["--repeats", "0"])
    assert "--repeats 0" in capsys.readouterr().err


def test_the_ar_target_is_the_engine_over_transformers_compiled():
    t = peers.build_targets([], {"engine_over_hf_compiled": 3.4})
    assert [(x["key"], x["measured"], x["met"]) for x in t] == [("peers_ar_vs_hf_compiled", 3.4, True)]
    assert peers.build_targets([], {"skipped": "transformers is not installed"}) == []


def test_flashinfer_in_engine_weighs_the_kernels_gain_against_plan_and_lost_overlap():
    def row(kind, ours, fa3, fa2=None, plan=20e-6, N=1):
        t = {"ours": ours, "flashinfer_fa3": fa3, **({"flashinfer_fa2": fa2} if fa2 else {})}
        return {"heads": 64, "context": 4096, "nodes": N, "batch": 1, "kind": kind, "time_s": t,
                "plan_s": {k: plan for k in t if k != "ours"}}
    rows = [row("decode", 23e-6, 21e-6), row("decode", 20e-6, 25e-6, 30e-6), row("tree", 50e-6, 1e-6, N=64),
            row("chain", 45e-6, 36e-6, 35e-6, plan=30e-6, N=16)]
    rows[2]["time_s"]["split"] = 40e-6
    got = peers.flashinfer_in_engine(rows, {"overlap_gain_s": 40e-6})
    assert len(got) == 4
    # decode: the engine's AR keeps its overlap with the whole pass, so only plan() is charged
    assert got[0]["backend"] == "flashinfer_fa3" and got[0]["layers_to_pay"] == 10     # 20 us / 2 us
    assert got[0]["overlap_lost_s"] == 0.0 and got[3]["overlap_lost_s"] == 40e-6
    assert got[1]["gain_per_layer_s"] < 0 and got[1]["layers_to_pay"] is None          # FlashInfer slower
    assert got[3]["backend"] == "flashinfer_fa2" and got[3]["layers_to_pay"] == 7      # 70 us / 10 us
    assert "not faster" in got[1]["why"]
    # a tree: no whole pass (no tree mask), the split's gain where it was timed
    assert got[2]["gain_per_layer_s"] is None and "split only" in got[2]["why"]
    assert got[2]["split_gain_per_layer_s"] == pytest.approx(10e-6)
    text = peers.format_in_engine(got)
    assert "pays from 10 layers" in text and "split +10.0 us a layer" in text and "never" not in text
    # without the AR section, only plan() is charged; a record without plan_s says so
    assert peers.flashinfer_in_engine(rows[3:])[0]["layers_to_pay"] == 3               # 30 us / 10 us
    old = [{k: v for k, v in rows[0].items() if k != "plan_s"}]
    assert "not timed" in peers.flashinfer_in_engine(old)[0]["why"]


# ----------------------------------------------------------------------------- the sections: moe, top-k, gemm


def _wall(calls, repeats):
    return measure(calls, repeats, "wall").median, "wall"


def test_every_section_left_out_is_refused_naming_the_flags(capsys):
    with pytest.raises(SystemExit):
        peers.main(["--no-ar", "--no-attention", "--no-moe", "--no-topk", "--no-gemm"])
    err = capsys.readouterr().err
    assert "nothing to run" in err and "--no-moe" in err and "--no-gemm" in err


def test_the_sections_record_their_absent_peers_and_stay_out_when_asked(tmp_path, no_gpu, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real(n, *a))
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", None)
    rec = peers.run(tmp_path, quick=True, ar=False)
    moe, topk = rec["peers"]["sglang_moe"], rec["peers"]["flashinfer_topk"]
    assert moe["available"] is False and "sglang is not installed" in moe["reason"]
    assert topk["available"] is False and "flashinfer" in topk["reason"]
    assert "api" not in moe and rec["moe"] == rec["topk"] == rec["gemm"] == [] and rec["targets"] == []
    rec = peers.run(tmp_path, quick=True, ar=False, moe=False, gemm=False)
    assert "moe" not in rec and "gemm" not in rec and rec["topk"] == []


# the imports of sglang/kernels/ops/moe/fused_moe_triton_kernels.py (sglang 0.5.23), each a stub here
_FUSED_MOE_IMPORTS = """
import triton
import triton.language as tl
from sglang.kernels.jit.utils import is_arch_support_pdl
from sglang.kernels.ops.quantization.fp8_kernel import (
    per_token_group_quant_fp8, scaled_fp8_quant, sglang_per_token_group_quant_fp8)
from sglang.kernels.ops.quantization.int8_kernel import (
    per_token_group_quant_int8, per_token_quant_int8, sglang_per_token_group_quant_int8)
from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled
from sglang.srt.environ import envs
from sglang.srt.layers.moe.utils import get_moe_padding_size
from sglang.srt.utils import cpu_has_amx_support, is_cpu, is_cuda, is_hip, is_sm90_supported
padding_size = get_moe_padding_size(envs.SGLANG_USE_AITER.get() and is_hip())
def invoke_fused_moe_kernel(*a, **k):
    return ("invoke", padding_size, is_arch_support_pdl(), is_cpu())
def act_and_mul_triton(*a, **k):
    return "act"
def moe_sum_reduce_triton(*a, **k):
    return "sum"
"""


def test_sglang_moe_files_load_by_path_under_stubs(tmp_path, monkeypatch):
    root = tmp_path / "sglang"
    moe, tk = root / "kernels" / "ops" / "moe", root / "test" / "kernels"
    for d in (moe, tk):
        d.mkdir(parents=True)
    for init in (root, root / "kernels", root / "kernels" / "ops", moe, root / "test", tk):
        (init / "__init__.py").write_text("raise RuntimeError('a package __init__ ran')\n")
    (moe / "fused_moe_triton_kernels.py").write_text(_FUSED_MOE_IMPORTS)
    (moe / "moe_align_small_numel.py").write_text(
        "from sglang.kernels.jit.utils import is_arch_support_pdl\nSMALL_NUMEL_LIMIT = 64\n"
        "def moe_align_small_numel(*a, **k):\n    return 'small'\n")
    (tk / "moe_align.py").write_text("import triton\n"
                                     "def moe_align_block_size_triton(*a):\n    return 'ref'\n")
    spec = types.SimpleNamespace(submodule_search_locations=[str(root)])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: spec if n == "sglang" else real(n, *a))
    tl = types.ModuleType("triton.language")
    tl.bfloat16, tl.float16 = "bf16", "fp16"
    triton = types.ModuleType("triton")
    triton.language = tl
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.language", tl)
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    found = peers_moe.find_sglang_moe()
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)                     # leave no fake sglang behind
    assert found["available"], found.get("reason")
    api = found["api"]
    assert api["invoke"]() == ("invoke", 0, torch.cuda.is_available()
                               and torch.cuda.get_device_capability()[0] >= 9, False)
    assert (api["act_and_mul"](), api["sum_reduce"](), api["align_small"](), api["align_triton"]()) == (
        "act", "sum", "small", "ref")
    assert api["small_limit"] == 64 and api["bf16"] == "bf16"


def _checkpoint_experts(E=3, N=16, K=64, seed=0):
    """Random checkpoint-format words (every nibble value) and bf16 scales of both signs."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (E, N, K // 8), dtype=torch.int32, generator=g)
    scale = (torch.randn(E, N, K // 32, generator=g) * 0.01).to(torch.bfloat16)
    return packed, scale


def test_the_int4_adapter_reads_back_our_matrix_bit_for_bit():
    from kdtree import golden
    from kdtree.quant import Int4Weight
    packed, scale = _checkpoint_experts()
    q, s = peers_moe.sglang_int4_layout(packed, scale)
    assert q.dtype == torch.uint8 and q.shape == (3, 16, 32) and q.data_ptr() == packed.data_ptr()
    assert peers_moe.layout_mismatch(packed, scale, q, s) is None
    theirs = peers_moe.dequant_sglang_int4(q, s)
    ours = Int4Weight(packed[1], scale[1], (16, 64)).dequantize()
    assert torch.equal(theirs[1].view(torch.int32), ours.view(torch.int32))
    twin = golden.dequant_int4(packed.numpy(), scale.float().numpy())          # the numpy twin, float64
    assert (theirs.double().numpy() == twin).all()


def test_the_layout_checker_fails_on_planted_corruptions():
    packed, scale = _checkpoint_experts()
    q, s = peers_moe.sglang_int4_layout(packed, scale)
    bad = q.clone()
    bad[1, 3, 5] ^= 0x10                           # byte 5's high nibble: input 11 of row 3, expert 1
    msg = peers_moe.layout_mismatch(packed, scale, bad, s)
    assert msg is not None and msg.startswith("1 of 3072 weights differ; first at (1, 3, 11)")
    swapped = ((q >> 4) | (q << 4)).to(torch.uint8)   # an adapter with the nibbles the other way round
    assert "weights differ" in peers_moe.layout_mismatch(packed, scale, swapped, s)
    big_endian = q.view(3, 16, 8, 4).flip(-1).reshape(3, 16, 32)   # words' bytes in the other order
    assert "weights differ" in peers_moe.layout_mismatch(packed, scale, big_endian, s)
    s2 = s.clone()
    s2[0, 0, 1] = -s2[0, 0, 1]
    assert "first at (0, 0, 32)" in peers_moe.layout_mismatch(packed, scale, q, s2)
    assert "expected shape" in peers_moe.layout_mismatch(packed, scale, q, s[..., :1])


def test_the_int4_adapter_refuses_what_is_not_our_format():
    packed, scale = _checkpoint_experts()
    with pytest.raises(ValueError, match="packed: expected int32"):
        peers_moe.sglang_int4_layout(packed.float(), scale)
    with pytest.raises(ValueError, match=r"scale: expected a floating-point tensor of shape \(3, 16, 2\)"):
        peers_moe.sglang_int4_layout(packed, scale[..., :1])


def test_concentrated_routing_reads_few_experts_and_uniform_many():
    import dataclasses

    from kdtree.config import load_config
    a = dataclasses.replace(load_config("kimi-k2.6"), hidden_size=64, n_routed_experts=16,
                            num_experts_per_tok=2, moe_intermediate_size=32)
    touched = {}
    for r in peers_moe.ROUTINGS:
        x, w, ids = peers_moe.moe_routing(a, 32, r, "cpu", 0)
        assert x.dtype == torch.bfloat16 and w.dtype == torch.float32 and ids.dtype == torch.int32
        assert ids.shape == w.shape == (32, 2) and ids.is_contiguous() and w.is_contiguous()
        touched[r] = int(torch.unique(ids).numel())
    assert touched["uniform"] == 16 and touched["concentrated"] <= 4
    with pytest.raises(ValueError, match="routing='hot'"):
        peers_moe.moe_routing(a, 4, "hot", "cpu")


def _tiny_moe(T=4):
    from kdtree.moe import Int4Experts
    sets = [Int4Experts.random(4, 64, 32, seed=i) for i in range(2)]
    views = [(*peers_moe.sglang_int4_layout(s.w13_packed, s.w13_scale),
              *peers_moe.sglang_int4_layout(s.w2_packed, s.w2_scale)) for s in sets]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, 2, generator=g)
    return sets, views, x, w, ids


def test_a_moe_row_without_sglang_times_ours_and_says_why(monkeypatch):
    sets, views, x, w, ids = _tiny_moe()
    row = peers_moe.moe_cell({"available": False, "reason": "ImportError: no sglang"}, sets, views, x, w, ids,
                             repeats=2, timer=_wall)
    assert row["tokens"] == 4 and row["pairs"] == 8 and row["reference"] == 0.0
    assert set(row["time_s"]) == {"ours"} and row["timing"] == {"ours": "wall"}
    assert row["skipped"] == {"sglang": "not loaded: ImportError: no sglang"} and "best_peer" not in row


def test_a_moe_row_sweeps_configs_checks_each_and_keeps_the_fastest_agreeing(monkeypatch):
    sets, views, x, w, ids = _tiny_moe()
    ref = sets[0](x.float(), w, ids)
    configs = [{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": n} for n in (32, 64, 128)]

    def fake_call(api, x_, w_, ids_, v, config, align=True):
        assert x_ is x and w_ is w and ids_ is ids and any(v is u for u in views)
        if config["BLOCK_SIZE_N"] == 64:
            return lambda: ref.to(torch.bfloat16) * 1.5                 # disagrees: never timed
        if config["BLOCK_SIZE_N"] == 128:
            raise RuntimeError("out of shared memory")                   # refuses the config
        return lambda: ref.to(torch.bfloat16)
    monkeypatch.setattr(peers_moe, "sglang_moe_call", fake_call)
    api = {"small_limit": 64, "align_small": lambda *a: None}
    row = peers_moe.moe_cell({"available": True, "api": api}, sets, views, x, w, ids, repeats=2,
                             configs=configs, timer=_wall)
    tried = {c["config"]["BLOCK_SIZE_N"]: c for c in row["sglang_configs"]}
    assert "time_s" in tried[32] and tried[32]["agree"] < peers.AGREE
    assert "time_s" not in tried[64] and "differs from ours" in tried[64]["skipped"]
    assert "out of shared memory" in tried[128]["skipped"]
    assert row["sglang_config"] == configs[0] and "small_numel" in row["sglang_align"]
    assert set(row["time_s"]) == {"ours", "sglang", "sglang_no_align"} and "sglang_align_s" in row
    assert row["best_peer"] in ("sglang", "sglang_no_align")
    assert row["ours_over_best_peer"] == row["time_s"][row["best_peer"]] / row["time_s"]["ours"]
    t = peers_sections.build_targets({"moe": [{**row, "routing": "uniform"}]})
    assert [(x["key"], x["tokens"], x["routing"]) for x in t] == [("peers_moe_vs_sglang", 4, "uniform")]


def test_top_k_agreement_lets_ties_go_either_way_and_catches_a_wrong_pick():
    x = torch.tensor([[5.0, 1.0, 3.0, 3.0, 0.0], [2.0, 4.0, -1.0, 4.0, 1.0]]).to(torch.bfloat16)
    tok = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)                 # ours: ties by token
    lp = torch.log_softmax(x.float(), -1).gather(1, tok.long())
    top = torch.topk(x, 2, dim=-1)
    assert peers_sections.topk_agreement(x, tok, lp, "torch_topk", top) == ({"rows_differ": 0}, None)
    other_tie = (top.values, torch.tensor([[0, 3], [3, 1]]))               # the other tied token: agrees
    assert peers_sections.topk_agreement(x, tok, lp, "torch_topk", other_tie)[1] is None
    wrong = (top.values, torch.tensor([[0, 1], [1, 3]]))
    a, why = peers_sections.topk_agreement(x, tok, lp, "torch_topk", wrong)
    assert a["rows_differ"] == 1 and "1 of 2 rows" in why
    a, why = peers_sections.topk_agreement(x, tok, lp, "torch_topk_lse", (lp + 0.01, tok))
    assert a["rows_differ"] == 0 and a["max_lp_diff"] > peers_sections.LP_TOL and "log-probabilities" in why
    inf = float("-inf")
    kept_tie = torch.tensor([[5.0, inf, 3.0, 3.0, inf], [inf, 4.0, inf, 4.0, inf]])   # both tied logits kept
    assert peers_sections.topk_agreement(x, tok, lp, "mask", kept_tie)[1] is None
    lost_top = torch.tensor([[inf, inf, 3.0, 3.0, inf], [inf, 4.0, inf, 4.0, inf]])
    assert peers_sections.topk_agreement(x, tok, lp, "mask", lost_top)[0]["rows_differ"] == 1


def test_run_sides_keeps_each_side_s_agreement_time_or_reason():
    row = {"time_s": {"ours": 2.0}, "timing": {}, "agree": {}, "skipped": {}}

    def broken():
        raise RuntimeError("refused the shape")
    sides = {"fast": lambda: [lambda: 1.0], "wrong": lambda: [lambda: 9.0], "broken": broken}
    peers_common.run_sides(row, sides, lambda n, out: (out, None if out < 5 else "differs"), 2,
                           timer=lambda calls, r: (1.0, "fake"))
    assert row["time_s"] == {"ours": 2.0, "fast": 1.0} and row["agree"] == {"fast": 1.0, "wrong": 9.0}
    assert row["skipped"] == {"wrong": "differs", "broken": "RuntimeError: refused the shape"}
    assert peers_common.best_peer(row)["best_peer"] == "fast" and row["ours_over_best_peer"] == 0.5


def test_the_gemm_target_is_the_worst_agreeing_row_of_each_matrix():
    rows = [{"name": "o_proj", "out": 7168, "in": 8192, "rows": r, "time_s": 1e-5, "gemv_time_s": g,
             "cublas_over_gemv": 1e-5 / g} for r, g in ((1, 5e-6), (8, 8e-6))]
    rows.append({"name": "o_proj", "out": 7168, "in": 8192, "rows": 16, "time_s": 1e-5, "gemv_time_s": 2e-5,
                 "skipped": {"gemv": "output differs from float32"}})          # no ratio: not counted
    rows.append({"name": "router", "out": 384, "in": 7168, "rows": 32, "time_s": 1e-6})   # cuBLAS only
    t = peers_sections.build_targets({"gemm": rows})
    assert [(x["key"], x["matrix"], x["rows"]) for x in t] == [
        ("peers_gemm_vs_cublas", "o_proj", 8), ("peers_gemm_engine_vs_cublas", "o_proj", 1),
        ("peers_gemm_engine_vs_cublas", "router", 32)]
    assert t[0]["measured"] == pytest.approx(1.25) and t[0]["met"] and t[0]["info"]
    assert "7168 x 8192" in t[0]["name"]
    assert t[1]["measured"] == 1.0 and t[1]["path"] == "cuBLAS" and "(cuBLAS)" in t[1]["name"]


def test_the_engine_s_gemm_target_follows_its_projection_path(monkeypatch):
    """Up to fused.GEMV_ROWS rows the engine runs ops.gemv, so its target is ours against cuBLAS there: a
    slow gemv at 1 row fails it."""
    import kdtree.fused
    monkeypatch.setattr(kdtree.fused, "GEMV_ROWS", 1)
    rows = [{"name": "q_b", "out": 12288, "in": 1536, "rows": r, "time_s": 1e-5, "gemv_time_s": g,
             "cublas_over_gemv": 1e-5 / g} for r, g in ((1, 2e-5), (8, 8e-6))]
    t = [x for x in peers_sections.build_targets({"gemm": rows}) if x["key"] == "peers_gemm_engine_vs_cublas"]
    assert [(x["rows"], x["path"], x["measured"], x["met"]) for x in t] == [(1, "ops.gemv", 0.5, False)]


def test_the_sections_are_written_row_by_row_with_their_targets(tmp_path, monkeypatch):
    path = tmp_path / "peers.json"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(peers, "find_peers", lambda: {})
    found = {"sglang_moe": {"available": False, "reason": "x"},
             "flashinfer_topk": {"available": True, "api": {}}}
    monkeypatch.setattr(peers_sections, "find_peers", lambda: found)
    on_disk = []

    def fake_moe(peer, tokens, routings, repeats, configs, progress=True):
        assert tokens == list(peers_moe.QUICK_MOE_TOKENS) and len(configs) == peers_moe.QUICK_CONFIGS
        for i, T in enumerate(tokens):
            on_disk.append(len(json.loads(path.read_text())["moe"]) if path.exists() else 0)
            yield {"tokens": T, "routing": "uniform", "time_s": {"ours": 1.0, "sglang": 2.0}, "skipped": {},
                   "experts_touched": 8, "best_peer": "sglang", "ours_over_best_peer": 2.0}

    def fake_topk(peer, cells, repeats, progress=True):
        assert peer["available"] and cells == peers_sections.QUICK_TOPK_CELLS
        yield {"batch": 1, "k": 64, "vocab": 163840, "positions": 15, "skipped": {},
               "time_s": {"ours": 1.0, "torch_topk": 3.0}, "best_peer": "torch_topk",
               "ours_over_best_peer": 3.0}

    monkeypatch.setattr(peers_moe, "moe_section", fake_moe)
    monkeypatch.setattr(peers_sections, "topk_section", fake_topk)
    monkeypatch.setattr(peers_sections, "gemm_section", lambda rows, repeats, progress=True: [
        {"name": "q_b", "out": 12288, "in": 1536, "rows": 1, "time_s": 2e-6, "gemv_time_s": 1e-6,
         "cublas_over_gemv": 2.0}])
    rec = peers.run(tmp_path, quick=True, ar=False, attention=False, progress=False)
    assert on_disk == [0, 1] and json.loads(path.read_text()) == rec
    assert rec["device"] == "fake GPU" and rec["attention"] == [] and len(rec["moe"]) == 2
    assert rec["moe_setup"]["experts"] == 384 and rec["moe_setup"]["group"] == 32
    assert [t["key"] for t in rec["targets"]] == ["peers_moe_vs_sglang"] * 2 + [
        "peers_topk_vs_best", "peers_gemm_vs_cublas", "peers_gemm_engine_vs_cublas"]
    assert all(t["met"] for t in rec["targets"])
    text = peers_sections.format_sections(rec)
    assert "uniform" in text and "torch_topk 3000000.0" in text and "q_b" in text


@pytest.mark.slow
def test_sglang_s_moe_agrees_with_ours_on_the_adapted_weights_under_triton_s_interpreter(no_gpu, monkeypatch):
    """SGLang's real kernel files (both aligns, the gptq/awq GEMMs on our weights viewed by
    sglang_int4_layout, act_and_mul, the sum) run by Triton's interpreter on a CPU: fp16 activations (the
    interpreter's bf16 is not numpy's to emulate), shapes small enough for it."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("sglang") is None:
        pytest.skip("needs triton and sglang installed (pip install sglang==0.5.23 --no-deps)")
    if os.environ.get("TRITON_INTERPRET") != "1":   # triton.language's own jit functions: set before import
        name = "test_sglang_s_moe_agrees_with_ours_on_the_adapted_weights_under_triton_s_interpreter"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"{__file__}::{name}"], env={**os.environ, "TRITON_INTERPRET": "1"},
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        return
    from kdtree.moe import Int4Experts
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    found = peers_moe.find_sglang_moe()
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    assert found["available"], found.get("reason")
    api, (E, D, I, k) = found["api"], (6, 128, 64, 2)
    s = Int4Experts.random(E, D, I, seed=3, scale=0.05)
    v = (*peers_moe.sglang_int4_layout(s.w13_packed, s.w13_scale),
         *peers_moe.sglang_int4_layout(s.w2_packed, s.w2_scale))
    assert peers_moe.layout_check(s, v) is None
    g = torch.Generator().manual_seed(0)
    for T in (5, 40):                         # 10 pairs: moe_align_small_numel; 80: the Triton reference
        x = torch.randn(T, D, generator=g).to(torch.float16)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
        w = torch.rand(T, k, generator=g)
        ref = s(x.float(), w, ids)
        for cfg in peers_moe.MOE_CONFIGS[:1] + peers_moe.MOE_CONFIGS[4:5]:
            for align in (True, False):
                out = peers_moe.sglang_moe_call(api, x, w, ids, v, cfg, align=align)()
                assert out.shape == (T, D) and peers.rel_diff(out, ref) < 2e-3, (T, cfg, align)
