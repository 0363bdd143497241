"""kdtree.project: the round-time model that turns single-GPU layer measurements and a measured tau into
per-user tok/s at a real model's scale (synthetic records with known power laws, so every number is checkable)."""
import math

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
    assert P.loglog(pts, 65) == (None, False) and P.loglog(pts, 1) == (None, False) and P.loglog([], 4) == (None, False)


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
    assert math.isclose(dd["build"], 2e-6 * B, rel_tol=1e-9) and math.isclose(dd["walk"], 1e-6 * B, rel_tol=1e-9)
    assert dd["extrapolated"] is False
    small = P.round_parts(rec, "ddtree", 1, 4096, budget=4, **kw)
    assert small is None  # the tree round was measured from budget 16 on: no extrapolation below
    assert P.round_parts(rec, "ddtree", 1, 4096, budget=100, **kw)["extrapolated"] is True  # 101 rows > 64
    assert P.round_parts(rec, "ddtree", 1, 4096, budget=200, **kw) is None  # past twice the largest measurement
    assert P.round_parts(rec, "ar", 8, 4096, **kw) is None  # batch 8 not measured


def test_project_rows_tokens_per_second_and_break_even_tau():
    rec = _rec()
    kw = dict(block_size=8, drafter_layers=3, n_layers=10, n_dense=2, vocab=1000, hidden=64)
    rows = P.project(rec, {"dflash": 2.0, "ddtree": {16: 3.0, 64: 4.0, 4: 9.0}}, 1, 4096, **kw)
    assert [(r["mode"], r["budget"]) for r in rows] == [("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", 64)]
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
