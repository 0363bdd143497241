"""The K2.6-shape builders (kdtree.k26) and INT4 experts kept in one copy, at small dimensions on the CPU."""
import dataclasses
import json

import types

import pytest
import torch

from kdtree import k26, kernels, weights
from kdtree.config import TINY_B
from kdtree.model import Int4Experts, MoE, rope_inv_freq

SMALL = dataclasses.replace(TINY_B, first_k_dense_replace=1, num_hidden_layers=4, n_group=1, topk_group=1)


def _same(mw, want):
    for name in ("w13", "s13", "w2", "s2"):
        a, b = getattr(mw, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_random_kernel_only_equals_repacking_the_same_blocks():
    """Block by block (chunk 4 of 10 experts) the kept copy is bit for bit repack_moe of the release-format
    blocks drawn with the same seeds; a different seed differs (the check can fail)."""
    E, D, I, seed = 10, 64, 32, 5
    ex = Int4Experts.random_kernel_only(E, D, I, seed=seed, chunk=4)
    blocks = [Int4Experts.random(hi - lo, D, I, seed=seed * 100003 + lo)
              for lo, hi in ((0, 4), (4, 8), (8, 10))]
    want = kernels.repack_moe(*(torch.cat([getattr(b, n) for b in blocks]) for n in
                                ("w13_packed", "w13_scale", "w2_packed", "w2_scale")))
    assert ex.released and ex.w13_packed.is_meta and tuple(ex.w13_packed.shape) == (E, 2 * I, D // 8)
    _same(ex.kernel_weights(), want)
    other = Int4Experts.random_kernel_only(E, D, I, seed=seed + 1, chunk=4).kernel_weights()
    assert not torch.equal(other.w13, want.w13)


def test_keep_kernel_only_keeps_one_copy_and_refuses_what_needs_the_other():
    ex = Int4Experts.random(6, 64, 32, seed=2)
    want = kernels.repack_moe(ex.w13_packed, ex.w13_scale, ex.w2_packed, ex.w2_scale)
    assert ex.keep_kernel_only(chunk=4) is ex and ex.released
    _same(ex.kernel_weights(), want)
    assert all(t.is_meta for t in ex.buffers())
    for call, what in ((lambda: ex.expert_weights(0), "expert_weights"), (lambda: ex.select(0, 2), "select"),
                       (lambda: ex(torch.randn(3, 64), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long)),
                        "expert_weights")):
        with pytest.raises(ValueError, match=what):
            call()


def test_build_target_has_distinct_random_layers_in_one_int4_copy(tmp_path):
    m = k26.build_target(3, device="cpu", seed=4, args=SMALL)
    layers = m.model.layers
    assert len(layers) == 4 and not isinstance(layers[0].mlp, MoE)
    assert all(isinstance(layer.mlp.experts, Int4Experts) and layer.mlp.experts.released
               for layer in layers[1:])
    assert torch.equal(m.inv_freq, rope_inv_freq(SMALL)[0])
    qa = [layer.self_attn.kv_a_proj_with_mqa.weight for layer in layers]
    assert all(not torch.equal(qa[0], w) for w in qa[1:])          # no layer shares another's weights
    w13 = [layer.mlp.experts.kernel_weights().w13 for layer in layers[1:]]
    assert not torch.equal(w13[0], w13[1])
    assert all(torch.isfinite(p).all() for p in m.parameters())
    E, D, I = SMALL.n_routed_experts, SMALL.hidden_size, SMALL.moe_intermediate_size
    expert_bytes = 3 * (E * 2 * I * D // 8 * 4 + E * 2 * I * D // 32 * 2) // 2   # w13 + w2 words and scales
    dense = sum(p.numel() * p.element_size() for p in m.parameters())
    assert k26.weight_bytes(m) <= dense + 3 * expert_bytes + 4096             # one copy per layer
    with pytest.raises(ValueError, match="kernel-format copy"):
        weights.save(m, tmp_path / "x")
    assert not any(tmp_path.iterdir())


def test_uniform_routing_spreads_rows_that_the_random_router_concentrates():
    """Rows sharing most of their direction (a random model's hidden states do): the random router as it is
    reads few experts between them, HashedGate about what independent uniform choices read; equal rows
    route alike; a bad routing name is refused."""
    import math
    m = k26.build_target(1, device="cpu", seed=3, args=SMALL)
    u = k26.build_target(1, device="cpu", seed=3, args=SMALL, routing="uniform")
    assert isinstance(u.model.layers[1].mlp.gate, k26.HashedGate)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, SMALL.hidden_size, generator=g)
    x = base + 0.02 * torch.randn(64, SMALL.hidden_size, generator=g)                  # [64, D]
    E, k = SMALL.n_routed_experts, SMALL.num_experts_per_tok
    want = E * (1 - (1 - k / E) ** 8)                  # 8 rows of independent uniform choices
    spread = lambda gate: sum(gate(x[i:i + 8])[1].unique().numel() for i in range(0, 64, 8)) / 8
    got_m, got_u = spread(m.model.layers[1].mlp.gate), spread(u.model.layers[1].mlp.gate)
    assert abs(got_u - want) < 0.2 * want and got_m < 0.8 * got_u, (got_m, got_u, want)
    with torch.no_grad():
        w, idx = u.model.layers[1].mlp.gate(torch.cat([x[:1], x[:1]]))
    assert torch.equal(idx[0], idx[1]) and math.isfinite(float(w.sum()))
    with pytest.raises(ValueError, match="routing='hashed'"):
        k26.build_target(1, device="cpu", args=SMALL, routing="hashed")


def test_drafter_layers_map_onto_the_layers_present():
    assert k26.drafter_layer_ids(61) == k26.K25_LAYER_IDS
    assert k26.drafter_layer_ids(13) == (0, 2, 5, 7, 9, 12)
    assert k26.drafter_layer_ids(2) == (0, 1)
    with pytest.raises(ValueError, match="n_moe"):
        k26.target_args(0)
    a = k26.target_args(12)
    assert a.num_hidden_layers == 13 and a.hidden_size == 7168 and a.vocab_size == 163840


def test_build_drafter_at_small_dimensions_drafts():
    m = k26.build_target(2, device="cpu", seed=1, args=SMALL)
    da = k26.drafter_args(m.args, num_hidden_layers=2, hidden_size=SMALL.hidden_size, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=48, intermediate_size=128)
    d = k26.build_drafter(m, seed=3, args=da)
    assert d.args.target_layer_ids == k26.drafter_layer_ids(3) and d.args.block_size == 8
    assert torch.isfinite(d.inv_freq).all() and float(d.inv_freq[0]) == 1.0
    ctx = d.new_context(1, 64)
    feats = torch.randn(1, 5, len(d.args.target_layer_ids) * SMALL.hidden_size)
    d.extend(ctx, feats, torch.tensor([0]), torch.tensor([5]))
    out = d.draft(ctx, torch.tensor([7]), torch.tensor([5]))
    assert out.shape == (1, 7, SMALL.vocab_size) and torch.isfinite(out).all()


def test_bench_k26_names_a_bad_prefix_attn_before_building():
    from kdtree.bench import k26 as bench_k26
    with pytest.raises(ValueError, match="prefix_attn='fi': expected one of"):
        bench_k26.run(cells=[(96, 2)], profiles=[(4.0, 8)], budgets=(4,), repeats=1, progress=False,
                      device="cpu", args=SMALL, layers=2, prefix_attn="fi")


@pytest.mark.slow   # ~30-40 s on 2 idle cores, minutes beside other CPU load
def test_bench_k26_smoke_on_a_cpu():
    """The K2.6 sweep's code path at small dimensions: every mode of a cell ran, rows labelled simulated,
    targets formed per profile; the simulated tau rises with the budget."""
    from kdtree.bench import k26 as bench_k26
    small = dict(num_hidden_layers=2, hidden_size=SMALL.hidden_size, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=48, intermediate_size=128)
    rec = bench_k26.run(cells=[(96, 2)], profiles=[(4.0, 8)], budgets=(4, 16), repeats=1, progress=False,
                        device="cpu", args=SMALL, dargs=small, layers=2)
    assert rec["label"].startswith("K2.6 shape, random weights, SIMULATED") and rec["layers"] == {"96:2": 2}
    cells = rec["cells"]
    assert [c["mode"] for c in cells] == ["ar", "dflash", "ddtree", "ddtree", "ddtree"]
    assert not any(c.get("error") for c in cells), [c.get("error") for c in cells]
    assert all(c["profile"].startswith("simulated") for c in cells[1:])
    assert all(c["elapsed_s"] > 0 for c in cells)
    assert rec["prefix_attn"] == "off" and {c["prefix_attn"] for c in cells} == {"off"}
    taus = {c["budget"]: c["tau"] for c in cells if c["mode"] == "ddtree"}
    assert taus[16] > taus[4] > 1.5
    names = [t["name"] for t in rec["targets"]]
    assert any("auto / best fixed budget" in n for n in names) and any("better of AR" in n for n in names)
    # every engine also served a queue of 2 x batch requests; its full-batch rounds make their own targets
    assert all(c["queued"]["requests"] == 4 and c["queued"]["tokens"] == 4 * bench_k26.max_new(2)
               for c in cells)
    assert all(0 < c["queued"]["full_rounds"] <= c["queued"]["rounds"] for c in cells)
    assert "plan_counts" in cells[-1]["queued"] and "plan_counts" not in cells[0]["queued"]
    q = cells[-1]["queued"]
    assert sum(r[2] for r in q["plan_runs"]) == q["rounds"] == sum(q["plan_counts"].values())
    assert all(a[:2] != b[:2] for a, b in zip(q["plan_runs"], q["plan_runs"][1:]))
    assert all(c["queued"]["full_tok_per_s_repeats"] == [c["queued"]["full_tok_per_s"]] for c in cells)
    assert sum("queue of 4 (full-batch rounds)" in n for n in names) == 2
    # an AR round's stage profile at the cell's batch, for the AR engine and auto's AR plan
    ar, auto = cells[0], cells[-1]
    assert "plan" not in ar["ar_stages"] and auto["ar_stages"]["plan"] == "AR"
    assert auto["ar_stages"]["draft"]["ops"] == 0 < auto["ar_stages"]["verify"]["ops"]
    assert all("ar_stages" not in c for c in cells[1:-1])


def test_routing_is_measured_on_each_requests_own_simulated_text():
    """bench.k26.measure_routing seeds prompt i's request i, as run_engine seeds the measured runs: under a
    simulated profile each request then reads its own text, so the measured rounds route distinct tokens
    (one seed for all fed every request the same tokens: fewer experts than the runs read)."""
    from kdtree.bench.k26 import measure_routing
    from kdtree.engine import Engine
    from kdtree.simulate import Profile
    m = k26.build_target(2, device="cpu", seed=1, args=SMALL, kernel_only=False)
    e = Engine(m, mode="ar", max_batch=4, max_len=128, simulate=Profile(3.0, 7, K=64))
    seen, run = [], e.run
    e.run = lambda *a, **k: seen.append(run(*a, **k)) or seen[-1]
    prompts = [[11 + i, 12, 13, 14] for i in range(4)]
    got = measure_routing(e, prompts)
    assert got["experts_touched"] > 0 and not e.active and not e.waiting
    texts = {tuple(r.tokens) for r in seen[0].values()}
    assert len(seen[0]) == 4 and len(texts) == 4, texts


def test_staged_sweeps_merge_into_one_record():
    """A later sweep's profile rows replace that profile's rows of the cell, other profiles and cells stay,
    each profile's ratios use the AR row of its own run, and targets are formed again from the rows; mixing
    routings or layer counts is refused."""
    from kdtree.bench.k26 import merge

    def rows(C, b, tau, run, scale, layers=12):
        base = dict(context=C, batch=b, layers=layers, run=run, tau_chain=tau, block=8)
        out = [dict(base, mode="dflash", budget=None, tok_per_s=2.0 * scale),
               dict(base, mode="ddtree", budget=4, tok_per_s=3.0 * scale),
               dict(base, mode="ddtree", budget="auto", tok_per_s=3.0 * scale)]
        return out

    def ar(C, b, run, v, layers=12):
        return dict(context=C, batch=b, layers=layers, run=run, tau_chain=None, mode="ar", budget=None,
                    tok_per_s=v)
    old = {"cells": [ar(4096, 1, "r1", 1.0)] + rows(4096, 1, 3.0, "r1", 1.0) + rows(4096, 1, 5.0, "r1", 1.0)
           + [ar(4096, 8, "r1", 1.0)] + rows(4096, 8, 3.0, "r1", 1.0),
           "targets": [], "layers": {"4096:1": 12, "4096:8": 12}, "label": "x"}
    new = {"cells": [ar(4096, 1, "r2", 2.0)] + rows(4096, 1, 5.0, "r2", 3.0), "targets": [],
           "layers": {"4096:1": 12}}
    m = merge(old, new)
    got = {(c["batch"], c["tau_chain"], c["run"], c["mode"]) for c in m["cells"]}
    assert (1, 3.0, "r1", "dflash") in got and (1, 5.0, "r2", "dflash") in got
    assert (1, 5.0, "r1", "dflash") not in got
    assert (1, None, "r1", "ar") in got and (1, None, "r2", "ar") in got and (8, 3.0, "r1", "ddtree") in got
    t = {x["name"]: x["measured"] for x in m["targets"]}
    five = next(v for k, v in t.items() if "tau_c 5, 12 MoE layers, batch 1" in k and "(auto) / AR" in k)
    assert five == 9.0 / 2.0                        # r2's auto over r2's AR, not r1's
    three = next(v for k, v in t.items() if "tau_c 3, 12 MoE layers, batch 1" in k and "better of AR" in k)
    assert three == 3.0 / 2.0                       # r1's rows with r1's AR
    # AR rows of a profile belong to it; a fitted profile's rows are replaced by a later fit's (another tau)
    fit = [dict(c, fitted=True) for c in rows(4096, 1, 2.72, "r3", 1.0)]
    m2 = merge(m, {"cells": [dict(ar(4096, 1, "r3", 1.0), tau_chain=2.72, fitted=True)] + fit,
                   "targets": [], "layers": {"4096:1": 12}})
    m3 = merge(m2, {"cells": [dict(c, tau_chain=2.9, run="r4") for c in fit], "targets": [],
                    "layers": {"4096:1": 12}})
    taus = {c["tau_chain"] for c in m3["cells"] if c["batch"] == 1}
    assert 2.9 in taus and 2.72 not in taus and {3.0, 5.0} <= taus
    assert 2.72 in {c["tau_chain"] for c in m2["cells"]}   # the check can fail: kept until a newer fit
    assert m["layers"] == {"4096:1": 12, "4096:8": 12} and m["label"] == "x" and merge(None, new) is new
    again = merge(m, {"cells": [ar(4096, 1, "r3", 1.0)] + rows(4096, 1, 3.0, "r3", 1.0), "targets": [],
                      "layers": {"4096:1": 12}})
    assert not any(c["run"] == "r1" and c["batch"] == 1 for c in again["cells"])   # r1's AR left too
    with pytest.raises(ValueError, match="mix"):
        merge(old, {"cells": rows(4096, 1, 5.0, "r2", 1.0, layers=11), "targets": [],
                    "layers": {"4096:1": 11}})
    with pytest.raises(ValueError, match="routing 'uniform' sweep"):
        merge(old, dict(new, routing="uniform"))
    assert merge(dict(old, routing="uniform"), dict(new, routing="uniform"))["routing"] == "uniform"
    with pytest.raises(ValueError, match="a prefix_attn 'flashinfer' sweep into a prefix_attn 'off' record"):
        merge(old, dict(new, prefix_attn="flashinfer"))
    with pytest.raises(ValueError, match="a decode_path 'torch' sweep into a decode_path 'fused' record"):
        merge(dict(old, decode_path="fused"), dict(new, decode_path="torch"))
    assert merge(old, dict(new, decode_path="fused"))["decode_path"] == "fused"   # an older record: no path


def test_fit_layers_keeps_twelve_layers_at_batch_8_and_room_for_the_largest_tree_at_batch_32():
    """On an H200's free memory (139 GiB) the sweep keeps >= 12 MoE layers at batch 1 and 8, context 4K (the
    issue's floor); at batch 32 the estimate leaves the B = 128 engine more than the 27 GiB beyond the
    weights at which it ran out of memory on the H200 with 11 layers; fewer layers fit as context grows."""
    from kdtree import k26 as K
    from kdtree.bench.k26 import cell_bytes, fit_layers
    free = int(139.2 * 2**30)
    assert fit_layers(free, 1, 4096, 129, 16) >= 12 and fit_layers(free, 8, 4096, 129, 16) >= 12
    a = K.target_args(1)
    assert cell_bytes(a, K.drafter_args(a), 32, 4096, 129, 10) > 27 * 2**30
    assert fit_layers(free, 32, 4096, 129, 16) <= 10
    assert fit_layers(free, 8, 32768, 129, 16) <= fit_layers(free, 8, 4096, 129, 16)
    assert fit_layers(2**30, 1, 4096, 129, 16) == 0


def test_fit_cell_counts_only_what_the_built_weights_leave_free():
    """A cell on a model already built: its engine must fit beside every built layer's weights. The H100
    case that ran out of memory (a 6-layer model, about 11 GiB left, batch 32 at 4K with trees of 33 rows)
    gets no layer here, where fit_layers (which counts only the layers the cell runs) had given it 5; a
    cell that fits keeps the built count; fewer free bytes never give more layers. bench_k26 now builds
    min over its cells of fit_layers, so each cell fits by construction."""
    from kdtree import k26 as K
    from kdtree.bench.k26 import cell_bytes, fit_cell, fit_layers
    a = K.target_args(1)
    d = K.drafter_args(a)
    free = int(79.2 * 2**30)  # before the build: the model takes the most demanding cell's count
    assert fit_layers(free, 32, 4096, 33, 16) == 5 < fit_layers(free, 1, 32768, 33, 16) == 6
    assert fit_cell(11 * 2**30, a, d, 32, 4096, 33, 6) == 0
    assert fit_cell(11 * 2**30, a, d, 1, 32768, 33, 6) == 6
    need = cell_bytes(a, d, 8, 4096, 33, 6)
    assert fit_cell(need, a, d, 8, 4096, 33, 6) == 6 and fit_cell(need - 1, a, d, 8, 4096, 33, 6) < 6
    assert fit_cell(0, a, d, 1, 4096, 33, 6) == 0


def test_autos_overhead_splits_into_its_parts():
    """bench.steps.overhead: auto's decode seconds beyond AR's, split into drafted rounds beyond AR's median
    step, catch-up steps, the last step and the per-round rest (which sum to the total)."""
    from kdtree.bench.steps import overhead
    auto = {"by_plan": {"AR": [10, 0.1], "B=4": [2, 0.05], "AR+draft": [1, 0.03]}, "catchups": 1,
            "catchup_s": 0.012, "last_s": 0.02, "decode_s": 0.25}
    o = overhead(auto, ar=0.15, ar_median=0.01)
    want = {"total_s": 0.1, "probes_s": 0.05, "catchup_s": 0.002, "last_s": 0.01, "rest_s": 0.038}
    assert all(abs(o[k] - v) < 1e-12 for k, v in want.items()) and "prefill_s" not in o, o
    o = overhead({**auto, "prefill_s": 0.07}, ar=0.15, ar_median=0.01, ar_prefill=0.05)
    assert abs(o["prefill_s"] - 0.02) < 1e-12 and abs(o["total_s"] - 0.1) < 1e-12   # decode apart


def test_step_trace_on_a_cpu():
    """bench.steps.compare at small dimensions: AR, auto and AR again traced step by step; AR lands no plans
    and no catch-ups, auto's plans cover its rounds, each overhead's parts sum to its total."""
    from kdtree.bench import steps
    small = dict(num_hidden_layers=2, hidden_size=SMALL.hidden_size, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=48, intermediate_size=128)
    rec = steps.compare(context=96, batch=2, layers=2, profiles=[(4.0, 8)], repeats=1, budgets=(4, 16),
                        device="cpu", args=SMALL, dargs=small, new=6, progress=False)
    row = rec["profiles"][0]
    assert rec["label"].startswith("K2.6 shape, random weights, SIMULATED") and set(row["engines"]) == {
        "ar", "auto", "ar_again"}
    for name, (s,) in row["engines"].items():
        assert s["prefill_s"] > 0 and s["decode_s"] > 0 and s["wall_s"] >= s["decode_s"], name
    ar, auto = row["engines"]["ar"][0], row["engines"]["auto"][0]
    assert ar["by_plan"] == {} and ar["catchups"] == 0 and ar["steps"] == 6   # the first token from prefill
    assert 1 <= sum(n for n, _ in auto["by_plan"].values()) <= 5
    (o,) = row["overhead"]
    assert abs(sum(o[k] for k in ("probes_s", "catchup_s", "last_s", "rest_s")) - o["total_s"]) < 1e-12
    assert abs(o["prefill_s"] - (auto["prefill_s"] - (ar["prefill_s"] + row["engines"]["ar_again"][0][
        "prefill_s"]) / 2)) < 1e-12
    assert 0 < row["auto_over_ar_wall"][0] < 100
    assert ar["admissions"] == 1 and rec["queue"] == 1 and rec["requests"] == 2   # one prefill: the batch
    # a queue of 2 x batch: the AR engine's batch ends at once and refills in one more admission
    rec = steps.compare(context=96, batch=2, layers=2, profiles=[(4.0, 8)], repeats=1, budgets=(4, 16),
                        device="cpu", args=SMALL, dargs=small, new=6, progress=False, queue=2)
    ar = rec["profiles"][0]["engines"]["ar"][0]
    assert rec["requests"] == 4 and ar["admissions"] == 2 and ar["admission_s"] > 0
    assert ar["steps"] == 11, ar["steps"]   # the refill's step lands the first batch's last round


def test_prefill_profile_on_a_cpu():
    """bench.steps.compare_prefill at small dimensions: each engine's admissions timed, then profiled, and
    served to their end (the engine idle after)."""
    from kdtree.bench import steps
    small = dict(num_hidden_layers=2, hidden_size=SMALL.hidden_size, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=48, intermediate_size=128)
    rec = steps.compare_prefill(context=96, batch=2, layers=2, repeats=2, device="cpu", args=SMALL,
                                dargs=small)
    assert set(rec["engines"]) == {"ar", "ddtree"} and rec["batch"] == 2
    for name, r in rec["engines"].items():
        assert len(r["prefill_s"]) == 2 and all(x > 0 for x in r["prefill_s"]) and r["profiled_prefill_s"] > 0
        assert r["host_ops"] and all(n > 0 and t >= 0 for _, n, t in r["host_ops"]), name
        assert ("drafter" in r["phases"]) == (name == "ddtree") and r["phases"]["forward"] > 0, r["phases"]


@pytest.mark.parametrize("argv,needle", [
    (["--batch", "0"], "batch=0"), (["--context", "8"], "context=8"), (["--layers", "61"], "layers=61"),
    (["--profiles", "3"], "--profiles"), (["--repeats", "0"], "repeats=0"), (["--queue", "0"], "queue=0"),
    (["--prefill", "--profiles", "3:8", "5:8"], "--prefill"), (["--prefill", "--queue", "2"], "--prefill")])
def test_step_trace_cli_refuses_bad_arguments(tmp_path, argv, needle):
    """bench.steps' command line names the bad argument before building anything (and writes nothing)."""
    from kdtree.bench import steps
    with pytest.raises(SystemExit) as e:
        steps.main(["--out", str(tmp_path)] + argv)
    assert needle in str(e.value) and not any(tmp_path.iterdir())
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="not a folder"):
        steps.main(["--out", str(tmp_path / "file")])
    with pytest.raises(SystemExit, match="repeats=0"):   # a folder to be made is made only once checked
        steps.main(["--out", str(tmp_path / "new"), "--repeats", "0"])
    assert not (tmp_path / "new").exists()


def test_a_queue_is_measured_after_a_warm_up_as_the_median_of_its_repeats(monkeypatch):
    """measure_queue: one short warm-up run (its own seeds), then `repeats` runs with seeds 9000 + 1000 k; the
    run of median full-batch tok/s (not of whole-run tok/s: here they order the runs apart) is the row's,
    every run's listed; an even count takes the lower median."""
    calls, full = [], iter([500.0, 900.0, 700.0, 300.0, 600.0])

    def fake(e, prompts, new, seed0=0, **add):
        calls.append((len(prompts), new, seed0, add))
        f = 1.0 if seed0 == 8000 else next(full)
        return {"tok_per_s": 1000.0 - f, "full_tok_per_s": f, "full_rounds": 3, "rounds": 4, "tokens": 8,
                "tau": 1.0, "prefill_s": 0.1, "outputs": [[1]]}
    from kdtree.bench import k26 as bench_k26
    monkeypatch.setattr(bench_k26, "run_engine", fake)
    e = types.SimpleNamespace(auto=None)
    q = bench_k26.measure_queue(e, 8, 2, 3, synthetic_context=5)
    new = bench_k26.max_new(8)
    assert calls == [(16, new // 4, 8000, {"synthetic_context": 5})] + [
        (16, new, 9000 + 1000 * k, {"synthetic_context": 5}) for k in range(3)]
    assert q["full_tok_per_s"] == 700.0 and q["tok_per_s"] == 300.0 and q["requests"] == 16
    assert q["full_tok_per_s_repeats"] == [500.0, 900.0, 700.0] and "outputs" not in q
    assert q["median_run"] == 2
    q = bench_k26.measure_queue(e, 8, 2, 2)
    assert q["full_tok_per_s"] == 300.0 and q["median_run"] == 0


def test_the_trained_curve_is_read_from_either_record(tmp_path):
    """bench.k26 --trained: an e2e_auto.json's trained.calibration_check or the lab's e2e.json's
    auto.calibration_check; anything else a SystemExit that names the file and what it lacks."""
    from kdtree.bench import k26 as bench_k26
    cc = {"budgets": [1, 4], "realized": [1.5, 2.4]}
    for key in ("trained", "auto"):
        f = tmp_path / f"{key}.json"
        f.write_text(json.dumps({key: {"calibration_check": cc}}))
        assert bench_k26.trained_curve(f) == cc
    other = {"budgets": [2], "realized": [1.9]}
    f.write_text(json.dumps({"auto": {"calibration_check": other}, "trained": {"calibration_check": cc}}))
    assert bench_k26.trained_curve(f) == cc   # an e2e_auto.json's own section first
    bad = tmp_path / "bad.json"
    for text in ('{"auto": {"calibration_check": {"budgets": []}}}', "[1]", "not json", '{"auto": [1]}',
                 '{"trained": {"calibration_check": {"budgets": [1, 2], "realized": [1.5]}}}'):
        bad.write_text(text)
        with pytest.raises(SystemExit, match="--trained .*bad.json"):
            bench_k26.trained_curve(bad)
    with pytest.raises(SystemExit, match="not a readable"):
        bench_k26.trained_curve(tmp_path / "missing.json")


def test_k26_cli_refuses_an_empty_sweep_before_looking_for_a_gpu(tmp_path):
    """bench_k26's arguments are checked before the GPU is (`check_sweep`, before any model is built): no
    profile at all (an empty --profiles without --trained), a malformed pair, a batch, budget, repeat count
    or chain tau out of range are refused by name, and nothing is written."""
    from kdtree.bench import k26 as bench_k26
    for argv, needle in ((["--profiles"], "--profiles: expected at least one TAU:BLOCK, or --trained"),
                         (["--profiles", "5"], "--profiles '5': expected two numbers"),
                         (["--cells", "4096x8"], "--cells '4096x8': expected two numbers"),
                         (["--cells", "4096:0"], "a cell's batch=0: expected a positive int"),
                         (["--budgets", "4", "2048"], r"budgets=2048: expected an int in \[1, 1024\]"),
                         (["--repeats", "0"], "repeats=0: expected a positive int"),
                         (["--profiles", "9:8"], r"tau_chain=9.0: expected in \[1, depth \+ 1 = 8\)")):
        with pytest.raises(SystemExit, match=needle):
            bench_k26.main(["--out", str(tmp_path / "out")] + argv)
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_to_merge_rows_of_another_card(tmp_path, monkeypatch, capsys):
    """python -m kdtree.bench.k26 merges its rows into --out's record: a record of another card is refused
    before anything runs (rows of two cards in one record would be compared as one run), one of this card
    or of none is taken."""
    from kdtree.bench import k26 as bench_k26
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Card B")
    ran = []
    monkeypatch.setattr(bench_k26, "run",
                        lambda *a, **k: ran.append(1) or {"cells": [], "targets": [], "layers": {}})
    (tmp_path / "e2e_k26.json").write_text(json.dumps({"device": "Card A", "cells": []}))
    with pytest.raises(SystemExit, match="measured on 'Card A', this is 'Card B'"):
        bench_k26.main(["--cells", "4096:1", "--profiles", "5:8", "--out", str(tmp_path)])
    assert not ran and json.loads((tmp_path / "e2e_k26.json").read_text())["device"] == "Card A"
    (tmp_path / "e2e_k26.json").write_text(json.dumps({"device": "Card B", "cells": []}))
    bench_k26.main(["--cells", "4096:1", "--profiles", "5:8", "--out", str(tmp_path)])
    assert ran and json.loads((tmp_path / "e2e_k26.json").read_text())["device"] == "Card B"
