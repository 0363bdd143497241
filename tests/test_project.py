"""kdtree.project: the round-time model that turns single-GPU layer measurements and a measured tau into
per-user tok/s at a real model's scale (synthetic records with known power laws, so every number is
checkable)."""
import math

import numpy as np
import pytest

from kdtree import project as P

CEIL = {"copy_bandwidth_Bps": 4e12, "bf16_matmul_flops": 8e14}


def _rec():
    nodes = [1, 2, 4, 8, 16, 32, 64]
    layer = [{"kind": k, "context": 4096, "batch": 1, "nodes": n, "time_s": a * n ** p}
             for k, a, p in (("dense", 1e-4, 0.5), ("moe", 3e-4, 0.75)) for n in nodes]
    tree = [{"batch": 1, "budget": B, "gpu_graph_s": 2e-6 * B} for B in (16, 64)]
    walk = [{"batch": 1, "budget": B, "time_s": 1e-6 * B} for B in (16, 64)]
    return {"ceilings": CEIL, "layer_verify": layer, "tree_round": tree, "walk_compact": walk}


def test_loglog_is_exact_on_power_laws_and_says_when_it_extrapolates():
    pts = [(x, 3.0 * x ** 1.7) for x in (2, 8, 32)]
    for x in (2, 3, 8, 20, 32):
        y, ext = P.loglog(pts, x)
        assert math.isclose(y, 3.0 * x ** 1.7, rel_tol=1e-12) and ext is False
    y, ext = P.loglog(pts, 60)  # along the last segment, up to 2x the largest measured x
    assert math.isclose(y, 3.0 * 60 ** 1.7, rel_tol=1e-12) and ext is True
    assert P.loglog(pts, 65) == (None, False) and P.loglog(pts, 1) == (None, False) \
        and P.loglog([], 4) == (None, False)


def test_round_parts_add_up_as_documented():
    rec = _rec()
    kw = dict(block_size=8, drafter_layers=3, n_layers=10, n_dense=2, vocab=1000, hidden=64)
    head = lambda rows: max(2 * 1000 * 64 / 4e12, 2 * rows * 1000 * 64 / 8e14)
    ar = P.round_parts(rec, "ar", 1, 4096, **kw)
    assert math.isclose(ar["verify"], 2 * 1e-4 + 8 * 3e-4 + head(1)) and ar["draft"] == ar["build"] == 0
    B = 32  # 33 rows: between the measured 32 and 64
    dd = P.round_parts(rec, "ddtree", 1, 4096, budget=B, **kw)
    want_verify = 2 * 1e-4 * 33 ** 0.5 + 8 * 3e-4 * 33 ** 0.75 + head(33)
    assert math.isclose(dd["verify"], want_verify, rel_tol=1e-9)
    assert math.isclose(dd["draft"], 3 * 1e-4 * 8 ** 0.5 + head(7), rel_tol=1e-9)
    assert math.isclose(dd["build"], 2e-6 * B, rel_tol=1e-9) \
        and math.isclose(dd["walk"], 1e-6 * B, rel_tol=1e-9)
    assert dd["extrapolated"] is False
    small = P.round_parts(rec, "ddtree", 1, 4096, budget=4, **kw)
    # below the smallest measured budget (16): the tree round and walk at budget 16's (an upper bound)
    assert math.isclose(small["build"], 2e-6 * 16) and math.isclose(small["walk"], 1e-6 * 16)
    assert P.round_parts(rec, "ddtree", 1, 4096, budget=100, **kw)["extrapolated"] is True  # 101 rows > 64
    # past twice the largest measurement
    assert P.round_parts(rec, "ddtree", 1, 4096, budget=200, **kw) is None
    assert P.round_parts(rec, "ar", 8, 4096, **kw) is None  # batch 8 not measured


def test_project_rows_tokens_per_second_and_break_even_tau():
    rec = _rec()
    kw = dict(block_size=8, drafter_layers=3, n_layers=10, n_dense=2, vocab=1000, hidden=64)
    rows = P.project(rec, {"dflash": 2.0, "ddtree": {16: 3.0, 64: 4.0, 4: 9.0, 256: 9.0}}, 1, 4096, **kw)
    assert [(r["mode"], r["budget"]) for r in rows] == [("ar", None), ("dflash", None), ("ddtree", 4),
                                                        ("ddtree", 16), ("ddtree", 64)]   # 257 rows: too far
    ar = rows[0]
    for r in rows:
        assert math.isclose(r["round_s"], sum(r["parts"].values()))
        assert math.isclose(r["tok_per_s"], r["tau"] / r["round_s"])
        assert math.isclose(r["speedup_vs_ar"], r["tok_per_s"] / ar["tok_per_s"])
        assert math.isclose(r["tau_to_match_ar"], r["round_s"] / ar["round_s"])
    assert ar["speedup_vs_ar"] == 1.0 and ar["tau_to_match_ar"] == 1.0


def test_project_rejects_bad_input():
    rec = _rec()
    with pytest.raises(ValueError, match="tau of ddtree 16"):
        P.project(rec, {"ddtree": {16: 0.5}}, 1, 4096)
    with pytest.raises(ValueError, match="mode='tree'"):
        P.round_parts(rec, "tree", 1, 4096)
    with pytest.raises(ValueError, match="budget=None"):
        P.round_parts(rec, "ddtree", 1, 4096)
    with pytest.raises(ValueError, match="ceilings"):
        P.round_parts({**rec, "ceilings": None}, "ar", 1, 4096)


def test_chain_top1_inverts_the_chain_tau():
    for depth, tau in ((15, 1.47), (15, 5.0), (7, 3.0), (1, 1.5)):
        p = P.chain_top1(tau, depth)
        assert math.isclose(sum(p ** d for d in range(depth + 1)), tau, rel_tol=1e-9)
    with pytest.raises(ValueError, match="tau_chain"):
        P.chain_top1(16.0, 15)
    with pytest.raises(ValueError, match="depth"):
        P.chain_top1(2.0, 0)


def test_profile_taus_equal_brute_force_top_prefixes():
    """1 + the summed probability of the B most probable prefixes, by enumeration (depth 3, ranks < B)."""
    import itertools
    for tau_chain, ratio in ((2.0, 0.5), (3.2, 0.3)):
        got = P.profile_taus(tau_chain, [1, 2, 5, 9], depth=3, ratio=ratio)
        p = P.chain_top1(tau_chain, 3)
        for B, tau in got.items():
            q = P.profile_rank_probs(p, ratio, B)
            probs = [float(np.prod(q[list(path)])) for n in (1, 2, 3)
                     for path in itertools.product(range(B), repeat=n)]
            want = 1 + sum(sorted(probs, reverse=True)[:B])
            assert math.isclose(tau, want, rel_tol=1e-5), (tau_chain, B, tau, want)
    taus = P.profile_taus(5.0, [16, 64, 256])
    assert 5.0 < taus[16] < taus[64] < taus[256] < 16  # a tree beats its chain and grows with the budget
    with pytest.raises(ValueError, match="p_top"):
        P.profile_rank_probs(1.0, 0.5, 4)


def test_loglog_merges_repeated_x_and_rejects_bad_points():
    from kdtree.project import loglog
    y, ext = loglog([(1, 1.0), (4, 2.0), (4, 8.0), (16, 16.0)], 4)
    assert abs(y - 4.0) < 1e-12 and not ext  # geometric mean of the two measurements at x = 4
    y2, _ = loglog([(1, 1.0), (4, 4.0), (16, 16.0)], 2)
    assert abs(y2 - 2.0) < 1e-12
    for bad in ([(0, 1.0), (2, 2.0)], [(1, -1.0), (2, 2.0)], [(1, float("nan")), (2, 2.0)]):
        with pytest.raises(ValueError, match="loglog: expected points with finite x > 0 and y > 0"):
            loglog(bad, 1.5)


def test_check_engine_projects_partial_depth_rounds_and_flags_misses():
    """A measured round equal to the projection at its layer count is within; one 20 % slower is not; auto
    cells, failed cells and unprojectable ones are left out; a measured draft time replaces the model's."""
    rec = _rec()
    kw = dict(vocab=1000, hidden=64, drafter_layers=3)
    want = P.round_parts(rec, "ddtree", 1, 4096, 16, block_size=8, n_layers=5, n_dense=1, **kw)
    want.pop("extrapolated")
    t = sum(want.values())
    cell = dict(mode="ddtree", budget=16, batch=1, context=4096, layers=4, block=8)
    cells = [dict(cell, round_gpu_span_median_s=t), dict(cell, round_gpu_span_median_s=1.2 * t),
             dict(cell, budget="auto", round_gpu_span_median_s=t),
             dict(mode="ar", budget=None, batch=8, context=4096, layers=4, round_gpu_span_median_s=t),
             dict(error="x", mode="ar", budget=None, batch=1, context=4096, layers=4)]
    rows = P.check_engine(rec, cells, **kw)
    assert len(rows) == 2 and rows[0]["within"] and math.isclose(rows[0]["ratio"], 1.0)
    assert not rows[1]["within"] and math.isclose(rows[1]["ratio"], 1 / 1.2)
    cells[0]["draft_s"] = 1.0
    r = P.check_engine(rec, cells[:1], **kw)[0]
    assert r["parts"]["draft"] == 1.0 and not r["within"]


def test_routing_correction_charges_the_kernel_time_of_the_rounds_own_routing():
    """The routed experts' kernel measured on the round's routing replaces the record's random-routing kernel
    time per MoE layer, in the partial-depth check and the full-depth rows (can fail: a check that ignores
    `moe_kernel_s` sees the round over-projected)."""
    rec = _rec_moe()   # tokens 1, 4, 16, 64 -> kernel 1e-4 sqrt(tokens)
    assert abs(P.routing_correction(rec, 2e-4, 4096, 1, 4)) < 1e-15
    assert math.isclose(P.routing_correction(rec, 1e-4, 4096, 1, 16), 1e-4 - 4e-4, rel_tol=1e-9)
    assert math.isclose(P.routing_correction(rec, 1e-4, 4096, 1, 256), 1e-4 - 8e-4, rel_tol=1e-9)  # to 64
    kw = dict(vocab=1000, hidden=64, drafter_layers=3)
    base = P.round_parts(rec, "ddtree", 1, 4096, 15, block_size=8, n_layers=5, n_dense=1, **kw)
    less = P.round_parts(rec, "ddtree", 1, 4096, 15, block_size=8, n_layers=5, n_dense=1, moe_kernel_s=1e-4,
                         **kw)
    assert math.isclose(base["verify"] - less["verify"], 4 * (4e-4 - 1e-4), rel_tol=1e-9)   # 4 MoE layers
    t = sum(v for k, v in less.items() if k != "extrapolated")
    cell = dict(mode="ddtree", budget=15, batch=1, context=4096, layers=4, block=8, tau=3.0,
                round_gpu_span_median_s=t, moe_kernel_s=1e-4)
    row = P.check_engine(rec, [cell], **kw)[0]
    assert row["within"] and math.isclose(row["ratio"], 1.0)
    full = P.round_parts(rec, "ddtree", 1, 4096, 15, block_size=8, n_layers=61, n_dense=1, moe_kernel_s=1e-4,
                         **kw)
    full_s = sum(v for k, v in full.items() if k != "extrapolated")
    assert math.isclose(row["full_s"], full_s) and math.isclose(row["full_tok_per_s"], 3.0 / full_s)
    blind = P.check_engine(rec, [cell], routing=False, **kw)[0]
    assert not blind["within"] and blind["ratio"] > 1.1
    with pytest.raises(ValueError, match="moe_int4"):
        P.routing_correction(_rec(), 1e-4, 4096, 1, 4)


def test_routing_correction_takes_the_layer_rows_own_routed_kernel_time():
    """Where the layer rows carry the routed kernels' share of their own time (`bench.layer.routed`), the
    correction replaces exactly that share at their (context, batch), over the layer rows' reach, not the
    separate moe_int4 bench's time at the same token count (can fail: a correction from moe_int4 is off by
    the two benches' difference, here 2x; one that ignored the batch would read batch 8's rows)."""
    rec = _rec_moe()   # moe_int4: 1e-4 sqrt(tokens); layer rows at batch 1, nodes 1 ... 64
    for r in rec["layer_verify"]:
        if r["kind"] == "moe":
            r["moe_kernel_s"] = 0.5e-4 * r["nodes"] ** 0.5   # half of moe_int4's at the same rows
            r["experts_touched"] = min(64, 8 * r["nodes"])
    rec["layer_verify"] += [dict(r, batch=8, moe_kernel_s=3 * r["moe_kernel_s"]) for r in rec["layer_verify"]
                            if r["kind"] == "moe"]
    for nodes in (16, 33, 128):   # 128: extrapolated along the last segment, as layer_time reaches it
        k, u, src = P.routed_kernel(rec, 4096, 1, nodes)
        assert src == "layer" and math.isclose(k, 0.5e-4 * nodes ** 0.5, rel_tol=1e-9)
        assert math.isclose(P.routing_correction(rec, 1e-4, 4096, 1, nodes), 1e-4 - k, rel_tol=1e-9)
    assert math.isclose(P.routed_kernel(rec, 4096, 8, 16)[0], 1.5e-4 * 4, rel_tol=1e-9)   # batch 8's own
    # beyond the rows' reach, or another context without them: moe_int4's, as before
    assert P.routed_kernel(rec, 4096, 1, 129)[2] == "moe_int4"
    assert math.isclose(P.routing_correction(rec, 1e-4, 32768, 1, 16), 1e-4 - 4e-4, rel_tol=1e-9)
    kw = dict(vocab=1000, hidden=64, drafter_layers=3, block_size=8, n_layers=5, n_dense=1)
    base = P.round_parts(rec, "ddtree", 1, 4096, 15, **kw)
    less = P.round_parts(rec, "ddtree", 1, 4096, 15, moe_kernel_s=1e-4, **kw)
    own = 0.5e-4 * 16 ** 0.5   # 16 rows
    assert math.isclose(base["verify"] - less["verify"], 4 * (own - 1e-4), rel_tol=1e-9)
    t = sum(v for k, v in less.items() if k != "extrapolated")
    cell = dict(mode="ddtree", budget=15, batch=1, context=4096, layers=4, block=8, tau=3.0,
                round_gpu_span_median_s=t, moe_kernel_s=1e-4)
    row = P.check_engine(rec, [cell], **{k: kw[k] for k in ("vocab", "hidden", "drafter_layers")})[0]
    assert row["within"] and row["routing_reference"] == "layer"


def _rec_moe():
    rec = _rec()
    rec["moe_int4"] = [{"tokens": t, "kernel_s": 1e-4 * t ** 0.5, "experts_touched": min(64, 8 * t)}
                       for t in (1, 4, 16, 64)]
    return rec


def test_busiest_rank_share_of_the_touched_experts():
    assert P.busiest_rank_experts(64, 64, 1) == 64 and P.busiest_rank_experts(64, 64, 8) == 8
    b = P.busiest_rank_experts(16, 64, 8)
    assert 2 < b < 6            # 16 experts over 8 ranks: more than the mean of 2 on the busiest
    with pytest.raises(ValueError, match="world"):
        P.busiest_rank_experts(8, 64, 7)


def test_project_multi_reduces_to_one_gpu_and_charges_all_reduces():
    """One rank and a free all-reduce give back the one-GPU projection; 8 ranks are faster; the all-reduce
    latency adds 2 per layer; the rows say they are projected and state the assumptions."""
    rec = _rec_moe()
    kw = dict(block_size=8, drafter_layers=3, n_layers=10, n_dense=2, vocab=1000, hidden=64, experts=64)
    taus = {"dflash": 2.0, "ddtree": {16: 3.0}}
    one = P.project(rec, taus, 1, 4096, **{k: v for k, v in kw.items() if k != "experts"})
    same = P.project_multi(rec, taus, 1, 4096, world=1, allreduce_latency_s=1e-15, allreduce_Bps=1e30, **kw)
    for a, b in zip(one, same):
        assert math.isclose(a["round_s"], b["round_s"], rel_tol=1e-6) and b["projected"] is True
    eight = P.project_multi(rec, taus, 1, 4096, world=8, allreduce_latency_s=1e-15, allreduce_Bps=1e30, **kw)
    assert all(e["round_s"] < s["round_s"] for e, s in zip(eight, same))
    slow = P.project_multi(rec, taus, 1, 4096, world=8, allreduce_latency_s=1e-5, allreduce_Bps=1e30, **kw)
    assert math.isclose(slow[0]["round_s"] - eight[0]["round_s"], 2 * 10 * 1e-5, rel_tol=1e-6)
    assert slow[0]["allreduce_latency_s"] == 1e-5 and slow[0]["world"] == 8
    with pytest.raises(ValueError, match="allreduce_latency_s"):
        P.project_multi(rec, taus, 1, 4096, world=8, allreduce_latency_s=0, allreduce_Bps=1e9, **kw)


def test_a_cell_without_its_kernel_time_takes_the_fitted_one():
    """fit_moe_kernel recovers alpha (per expert read) and beta (per token-expert pair) from cells whose
    kernel times follow them; a cell that counted its experts but lacks a kernel time is projected with
    alpha * touched + beta * pairs (flagged modelled) and lands within, where the record's random-routing
    layer time alone (no count, so no model) over-projects it."""
    rec = _rec_moe()
    alpha, beta = 2e-6, 3e-7
    def cell(budget, touched, kern=None, **kw):
        c = dict(mode="ddtree", budget=budget, batch=1, context=4096, layers=4, block=8, tau=3.0,
                 experts_touched=touched, **kw)
        if kern:
            c["moe_kernel_s"] = alpha * touched + beta * (budget + 1) * 8
        return c
    fitted = [cell(3, 10, True), cell(7, 20, True), cell(15, 25, True)]
    got = P.fit_moe_kernel(fitted)
    assert got is not None and math.isclose(got[0], alpha, rel_tol=1e-6) and math.isclose(got[1], beta,
                                                                                          rel_tol=1e-6)
    assert P.fit_moe_kernel(fitted[:1]) is None
    kw = dict(vocab=1000, hidden=64, drafter_layers=3)
    want_k = alpha * 30 + beta * 16 * 8
    parts = P.round_parts(rec, "ddtree", 1, 4096, 15, block_size=8, n_layers=5, n_dense=1,
                          moe_kernel_s=want_k, **kw)
    t = sum(v for k, v in parts.items() if k != "extrapolated")
    lone = cell(15, 30, round_gpu_span_median_s=t)
    row = P.check_engine(rec, fitted + [lone], **kw)[-1]
    assert row["moe_kernel_modelled"] and math.isclose(row["moe_kernel_s"], want_k, rel_tol=1e-6)
    assert row["within"] and math.isclose(row["ratio"], 1.0, rel_tol=1e-6)
    blind = P.check_engine(rec, fitted + [dict(lone, experts_touched=None)], **kw)[-1]
    assert not blind["moe_kernel_modelled"] and not blind["within"]
    timed = P.check_engine(rec, [dict(c, round_gpu_span_median_s=t) for c in fitted], **kw)
    assert len(timed) == 3 and all(not r["moe_kernel_modelled"] for r in timed)


def test_a_low_tau_profile_ranks_its_tokens_as_its_drafter_would():
    """Below a chain tau of about 2 - ratio the profile's rank 1 outweighs its rank 0; profile_taus sorts
    the ranks (a calibrated drafter ranks by probability) before golden.build_tree, which takes sorted lists
    only."""
    assert P.profile_rank_probs(0.2, 0.5, 4)[1] > P.profile_rank_probs(0.2, 0.5, 4)[0]
    taus = P.profile_taus(1.4, [1, 4, 8], 15, 0.5)
    assert 1.0 < taus[1] < taus[4] < taus[8]
