"""kdtree.bench.decode on the CPU: the byte floor of a layer step, the record's targets, the command line."""
import pytest
import torch

from kdtree.bench import decode
from kdtree.config import TINY_B
from kdtree.model import MLP, MoE, build_model


@pytest.fixture(scope="module")
def tiny_b_int4():
    """tiny-b (layers 0, 1 dense; 2, 3 MoE) in float32 with its routed experts in INT4."""
    return build_model(TINY_B, seed=3).quantize_experts()


def test_layer_floor_bytes_counts_a_tiny_layer_by_hand(tiny_b_int4):
    """tiny-b's dims: D 192, q_lora 96, R 64, P 16, 4 heads of nope 32 / rope 16 / v 32, dense inter 384,
    16 experts of I 64, one shared expert of 64; float32 weights (4 bytes), a bf16 pool (2 bytes)."""
    a = TINY_B
    assert (a.hidden_size, a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim, a.num_attention_heads,
            a.qk_nope_head_dim, a.v_head_dim, a.intermediate_size, a.moe_intermediate_size,
            a.n_routed_experts, a.n_shared_experts) == (192, 96, 64, 16, 4, 32, 32, 384, 64, 16, 1)
    attn = (96 * 192 + 96            # q_a_proj, q_a_layernorm
            + 4 * 48 * 96            # q_b_proj: heads x (nope + rope) rows
            + 80 * 192 + 64          # kv_a_proj_with_mqa (R + P rows), kv_a_layernorm
            + 4 * 64 * 64            # kv_b_proj: heads x (nope + v) rows of R
            + 192 * 4 * 32)          # o_proj
    norms = 2 * 192
    dense = attn + norms + 3 * 384 * 192
    router = 16 * 192 + 16           # weight + e_score_correction_bias (float32)
    shared = 3 * 64 * 192
    # one INT4 expert: 3 I D weights at half a byte + one bf16 scale per 32 weights
    expert = 3 * 64 * 192 // 2 + 3 * 64 * 192 // 32 * 2
    kv_row = (64 + 16) * 2
    m = tiny_b_int4
    dense_layer, moe_layer = m.model.layers[0], m.model.layers[2]
    assert isinstance(dense_layer.mlp, MLP) and isinstance(moe_layer.mlp, MoE)
    assert decode.expert_bytes(moe_layer.mlp.experts) == expert
    assert decode.layer_floor_bytes(dense_layer, 0, 1000) == 4 * dense + 1000 * kv_row
    assert decode.layer_floor_parts(moe_layer, 5, 1000, batch=3) == {
        "weights": 4 * (attn + norms + router + shared), "experts": 5 * expert, "kv": 3 * 1000 * kv_row}
    assert decode.layer_floor_bytes(moe_layer, 0, 0, kv_itemsize=4) == 4 * (attn + norms + router + shared)


def test_layer_floor_bytes_counts_mlp_experts_and_refuses_bad_counts(tiny_b_int4):
    plain = build_model(TINY_B, seed=3)                       # MLP experts: float32 gate, up, down
    assert decode.expert_bytes(plain.model.layers[2].mlp.experts) == 4 * 3 * 64 * 192
    moe_layer, dense_layer = tiny_b_int4.model.layers[2], tiny_b_int4.model.layers[0]
    with pytest.raises(ValueError, match="dense MLP"):
        decode.layer_floor_bytes(dense_layer, 1, 10)
    with pytest.raises(ValueError, match="16 routed experts"):
        decode.layer_floor_bytes(moe_layer, 17, 10)
    for bad in ({"experts_touched": -1}, {"context": -5}, {"batch": 0}, {"context": 1.5}):
        kw = {"experts_touched": 1, "context": 10, **bad}
        with pytest.raises(ValueError):
            decode.layer_floor_bytes(moe_layer, **kw)


def test_paged_inputs_drive_every_layer_and_the_routing_count(tiny_b_int4):
    """The paged step the benchmark times runs on a CPU model (torch attention), and count_routed sees the
    distinct experts of its batch x nodes rows."""
    m = tiny_b_int4
    m.prepare_paged("loop")
    pool, x, cos, sin, meta = decode.paged_inputs(m, context=100, batch=2, nodes=3, moe="loop")
    assert pool.shape == (4, 2 * 2 * 64, 80) and x.shape == (2, 3, 192) and meta.kv_cap == 128
    for i, layer in enumerate(m.model.layers):
        def step(layer=layer, lat=pool[i]):
            return layer(x, cos, sin, lat, meta)
        with torch.no_grad():
            assert step().shape == x.shape
        n = decode.count_routed(layer, step)
        assert n == 0 if i < 2 else 4 <= n <= 16


def test_layer_paths_follow_the_fused_attribute():
    from types import SimpleNamespace
    assert decode.layer_paths(SimpleNamespace()) == ["torch", "torch.compile"]
    assert decode.layer_paths(SimpleNamespace(), compile=False) == ["torch"]
    want = ["torch", "fused", "fused+gemv", "torch.compile"]
    assert decode.layer_paths(SimpleNamespace(fused=False)) == want


def _rows(gemm_fracs, moe_fracs, dense_fracs, kernels=12):
    gemm = [{"name": n, "rows": r, "weight_bytes": wb, "fraction": f} for n, r, wb, f in gemm_fracs]
    layers = [{"kind": "moe", "path": p, "context": 4096, "batch": 1, "timing": "graph", "fraction": f,
               "kernels": kernels if p == "fused" else 90} for p, f in moe_fracs]
    layers += [{"kind": "dense", "path": p, "context": 4096, "batch": 1, "timing": "graph", "fraction": f,
                "kernels": 30} for p, f in dense_fracs]
    return gemm, layers


def test_targets_mark_met_and_missed():
    gemm, layers = _rows(
        [("qkv_a", 8, 30.3e6, 0.85), ("q_b", 64, 37.7e6, 0.81),
         ("o_proj", 1, 117e6, 0.2),          # over 40 MB: not in the GEMM target
         ("router", 128, 5.5e6, 0.1)],       # over 64 rows: not in the GEMM target
        [("torch", 0.3), ("fused", 0.8)], [("torch", 0.5)])
    t = {x["key"]: x for x in decode.build_targets(gemm, layers, 4096, 1)}
    assert all("floor" in x["name"] for k, x in t.items() if "kernels" not in k)
    g = t["decode_gemm_floor_fraction"]
    assert (g["measured"], g["goal"], g["met"], g["matrix"]) == (0.81, 0.8, True, "q_b")
    moe = t["decode_moe_layer_floor_fraction"]
    assert (moe["measured"], moe["met"], moe["path"]) == (0.8, True, "fused")
    assert moe["name"] == "K2.6 MoE decode layer (b1, 4K, graphed): fraction of its byte floor"
    dense = t["decode_dense_layer_floor_fraction"]
    assert (dense["measured"], dense["goal"], dense["met"]) == (0.5, 0.75, False)
    k = t["decode_kernels_per_moe_layer"]
    assert (k["measured"], k["goal"], k["met"], k["path"]) == (12, 20, True, "fused")
    assert k["name"] == "K2.6 MoE decode layer (b1, 4K): kernels per step"

    gemm, layers = _rows([("qkv_a", 8, 30.3e6, 0.5)], [("torch", 0.3)], [], kernels=12)
    t = {x["key"]: x for x in decode.build_targets(gemm, layers, 4096, 1)}
    assert not t["decode_gemm_floor_fraction"]["met"]
    k = t["decode_kernels_per_moe_layer"]
    assert k["measured"] == 90 and not k["met"]


def test_targets_fail_on_missing_values():
    """No rows, an errored path, an eager-timed path, a None fraction, another context: measured None,
    missed."""
    gemm = [{"name": "qkv_a", "rows": 8, "weight_bytes": 30.3e6, "fraction": None, "error": "capture"}]
    layers = [{"kind": "moe", "path": "torch", "context": 4096, "batch": 1, "timing": "events",
               "fraction": 0.9, "kernels": 5},
              {"kind": "moe", "path": "fused", "context": 4096, "batch": 1, "timing": None, "fraction": None,
               "kernels": None, "error": "RuntimeError: boom"},
              {"kind": "dense", "path": "torch", "context": 32768, "batch": 1, "timing": "graph",
               "fraction": 0.9, "kernels": 5}]
    for g, lay in ((gemm, layers), ([], [])):
        ts = decode.build_targets(g, lay, 4096, 1)
        assert len(ts) == 4
        for t in ts:
            assert t["measured"] is None and t["met"] is False, t


@pytest.mark.parametrize("argv", [["--context", "0"], ["--batch", "x"], ["--nodes", "-2"], ["--parts", "all"],
                                  ["--blas", "mkl"], ["--bogus"], ["--repeats", "0"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        decode.main(argv)
    assert e.value.code == 2
    assert "usage: python -m kdtree.bench.decode" in capsys.readouterr().err


def test_arguments_parse():
    a = decode.parse_args(["--out", "x/y.json", "--quick", "--context", "32768", "--batch", "8",
                           "--parts", "layers", "--no-compile"])
    assert (a.out, a.quick, a.context, a.batch, a.nodes, a.parts, a.no_compile) == \
        ("x/y.json", True, 32768, 8, 1, ["layers"], True)


def test_main_without_cuda_exits_with_a_message(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "sub" / "rec.json"
    with pytest.raises(SystemExit) as e:
        decode.main(["--out", str(out), "--quick"])
    assert isinstance(e.value.code, str) and "needs a CUDA GPU" in e.value.code
    assert not out.exists()


def _wall(monkeypatch):
    """decode's GPU-only pieces (in bench.decode and bench.decode_layers) swapped for CPU ones: host-clock
    timing, no profiler."""
    from kdtree.bench import decode_layers
    from kdtree.bench.timer import measure

    def kernel_table(fn):
        fn()
        return 7, [{"name": "k", "count": 7, "device_us": 1.0}]
    for mod in (decode, decode_layers):
        monkeypatch.setattr(mod, "measure", lambda fn, repeats, mode, **kw: measure(fn, repeats, "wall"))
        monkeypatch.setattr(mod, "kernel_table", kernel_table)


def test_gemm_rows_and_the_table(monkeypatch):
    _wall(monkeypatch)
    rows = decode.gemm_table(rows=(1, 4), shapes=(("a", 64, 32), ("b", 32, 96)), repeats=2, copy_rate=1e9,
                             device="cpu")
    assert [(r["name"], r["rows"]) for r in rows] == [("a", 1), ("a", 4), ("b", 1), ("b", 4)]
    r = rows[1]
    assert r["weight_bytes"] == 64 * 32 * 2 and r["bytes"] == r["weight_bytes"] + 4 * (32 + 64) * 2
    assert r["fraction"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9) and r["sets"] >= 1
    rec = {"gemm": rows, "layers": [], "targets": decode.build_targets(rows, [], 1, 1)}
    assert "gemm" in decode.format_table(rec) and "MISSED" in decode.format_table(rec)


def test_layer_rows_time_each_path(monkeypatch, tiny_b_int4):
    """Every (layer, path) row carries the floor of the layer's routing; on a CPU the fused path does not
    apply (its row says why) and model.fused is restored."""
    _wall(monkeypatch)
    m = tiny_b_int4
    had, before = hasattr(m, "fused"), getattr(m, "fused", None)
    m.fused = "unset"
    try:
        rows = decode.layer_steps(m, context=100, batch=1, nodes=2, repeats=2, copy_rate=1e9, compile=False)
        assert m.fused == "unset"
    finally:
        if had:
            m.fused = before
        else:
            del m.fused
    paths = ("torch", "fused", "fused+gemv")
    assert [(r["layer"], r["path"]) for r in rows] == [(i, p) for i in range(4) for p in paths]
    for r in rows:
        touched = r["experts_touched"]
        assert (touched == 0) if r["kind"] == "dense" else 4 <= touched <= 8
        layer = m.model.layers[r["layer"]]
        assert r["kind"] == ("dense" if r["layer"] < 2 else "moe")
        assert r["floor_bytes"] == decode.layer_floor_bytes(layer, touched, 100, 1, 4)   # float32 pool
        if r["path"].startswith("fused"):
            assert "fused" in r["error"] and r["time_s"] is None and r["fraction"] is None
        else:
            assert not r.get("error") and r["kernels"] == 7
            assert r["fraction"] == pytest.approx(r["floor_bytes"] / 1e9 / r["time_s"])
    assert "fused" in decode.format_table({"gemm": [], "layers": rows, "targets": []})


def test_the_fused_path_runs_one_layer_with_model_fused_set(monkeypatch, tiny_b_int4):
    """The fused row times kdtree.fused.forward_layers over a one-layer view (the layer's pool slice),
    with model.fused True during it and False for the torch path."""
    import sys
    from types import ModuleType

    import kdtree
    _wall(monkeypatch)
    m = tiny_b_int4
    calls = []

    def forward_layers(view, h, cos, sin, pool, meta, hidden_layers=()):
        calls.append((view.model.layers, view.model.norm, pool.shape[0], m.fused))
        return h, {}
    fake = ModuleType("kdtree.fused")
    fake.forward_layers = forward_layers
    fake.unsupported, fake.prepare = (lambda model, meta: None), (lambda model: None)
    fake.GEMV_ROWS = 0
    monkeypatch.setitem(sys.modules, "kdtree.fused", fake)
    monkeypatch.setattr(kdtree, "fused", fake, raising=False)
    flags = []
    hook = m.model.layers[2].register_forward_pre_hook(lambda mod, args: flags.append(m.fused))
    had, before = hasattr(m, "fused"), getattr(m, "fused", None)
    m.fused = True
    try:
        rows = decode.layer_steps(m, context=64, batch=2, nodes=1, repeats=2, copy_rate=1e9, compile=False)
    finally:
        hook.remove()
        if had:
            m.fused = before
        else:
            del m.fused
    assert all(not r.get("error") for r in rows), rows
    assert set(flags) == {False}
    assert calls and all(len(ls) == 1 and norm is m.model.norm and n == 1 and f is True
                         for ls, norm, n, f in calls)
    assert {id(ls[0]) for ls, *_ in calls} == {id(layer) for layer in m.model.layers}
