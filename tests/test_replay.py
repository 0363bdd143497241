"""kdtree.bench.replay: a record's cost table frozen on an auto engine, every round billed from it, plans
held, the trained pair's and a K2.6 cell's replays on the CPU, and bad records refused."""
import json

import numpy as np
import pytest

from kdtree import weights
from kdtree.bench import replay
from kdtree.bench.serve import run_engine
from kdtree.engine import Engine

BUDGETS = (4, 16)
PLANS = ("AR", "chain", "B=4", "B=16")


@pytest.fixture(scope="module")
def pair():
    t = weights.load("data/trained/target").eval()
    return t, weights.load_drafter("data/trained/drafter", t)


def _prompts(rng, model, n, length=12):
    return rng.integers(0, model.args.vocab_size, (n, length)).tolist()


def _engine(pair, batch=2):
    t, d = pair
    return Engine(t, d, mode="ddtree", budget="auto", budgets=BUDGETS, max_batch=batch, buckets=(batch,),
                  max_len=96, graph_sampling=False)


def _table(rng, back=None, front=None, host=0.125, ctxs=(0, 4096), batch=2) -> dict:
    """A record's cost table with fresh random seconds (or the given ones per plan / tree size)."""
    back = back or {p: float(rng.uniform(1e-3, 1.0)) for p in PLANS}
    front = front or {B: float(rng.uniform(1e-3, 1.0)) for B in BUDGETS}
    return {"front": {f"{batch},{B},{c}": front[B] * (1 + c / 8192) for B in BUDGETS for c in ctxs},
            "back": {f"{batch},{p},{c}": back[p] * (1 + c / 8192) for p in PLANS for c in ctxs}
            | {f"{batch}/1,{p},{c}": back[p] / 2 * (1 + c / 8192) for p in PLANS for c in ctxs},
            "host": host, "samples": 7}


def test_a_record_cost_table_loads_as_it_was_written(pair):
    """load_costs then CostTable.as_dict gives the record's table back: keys (batch field, live count, plan
    or tree size, context) land where they were, the context buckets become the record's."""
    rng = np.random.default_rng()
    e = _engine(pair)
    want = _table(rng)
    replay.load_costs(e, want)
    got = e.costs.as_dict(e.plans)
    assert e.costs.ctx_buckets == (0, 4096)
    for part in ("front", "back"):
        assert got[part].keys() == want[part].keys()
        assert all(got[part][k] == want[part][k] for k in want[part]), part
    assert got["host"] == want["host"]


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.pop("host"), "costs: expected a cost table"),
    (lambda c: c["back"].update({"2,B=64,0": 1.0}), "plan 'B=64' is not one of"),
    (lambda c: c["front"].update({"2,64,0": 1.0}), "a tree of 64 nodes"),
    (lambda c: c["back"].update({"8,AR,0": 1.0}), "batch bucket 8"),
    (lambda c: c["back"].update({"2,AR": 1.0}), "expected 'batch,plan,context'"),
    (lambda c: c["back"].update({"2,AR,0": -1.0}), "seconds >= 0"),
    (lambda c: c["front"].update({"x,4,0": 1.0}), "costs['front']['x,4,0']"),
])
def test_a_bad_cost_table_is_refused_before_the_engine_changes(pair, edit, needle):
    rng = np.random.default_rng()
    e = _engine(pair)
    before = json.dumps(e.costs.as_dict(e.plans), sort_keys=True)
    bad = _table(rng)
    edit(bad)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        replay.load_costs(e, bad)
    assert json.dumps(e.costs.as_dict(e.plans), sort_keys=True) == before
    t, d = pair
    with pytest.raises(ValueError, match="budget='auto'"):
        replay.load_costs(Engine(t, d, mode="ddtree", budget=4, max_batch=2, max_len=96), _table(rng))
    with pytest.raises(ValueError, match="plan='B=5'"):
        replay.hold(e, "B=5")


@pytest.mark.parametrize("plan", ["AR", "B=4", "chain"])
def test_every_round_of_a_held_plan_is_billed_its_table_seconds(pair, plan):
    """A held plan's rounds all verify it; each is billed front (its build) + back + host of the frozen
    table, as measured (no larger tree's bound), a bucket with one live request its (b, 1) entry (the third
    request runs alone); the table never moves (no online refresh)."""
    rng = np.random.default_rng()
    e = _engine(pair)
    costs = _table(rng, ctxs=(0,))
    bill = replay.Bill(e, costs)
    replay.hold(e, plan)
    frozen = json.dumps(e.costs.as_dict(e.plans)["back"], sort_keys=True)
    prompts = _prompts(rng, e.model, 3)
    run_engine(e, prompts, 10)
    hist = e.auto.history
    assert hist and {h[2] for h in hist} == {plan}
    i = [p.name for p in e.plans].index(plan)
    build = e.auto.build(2, i)
    want = 0.0
    for _, n, _ in hist:
        k = "2" if n == 2 else f"2/{n}"
        # a (2, 1) front entry is not in the table: the full bucket's stands in
        want += costs["back"][f"{k},{plan},0"] + costs["host"] + (
            0.0 if build is None else costs["front"][f"2,{build},0"])
    assert bill.rounds == len(hist) and {n for _, n, _ in hist} == {1, 2}
    assert bill.seconds == pytest.approx(want, rel=1e-12)
    assert json.dumps(e.costs.as_dict(e.plans)["back"], sort_keys=True) == frozen


@pytest.mark.parametrize("shift", [0, 4096])
def test_a_shift_decides_and_bills_a_short_context_as_a_long_one(pair, shift):
    """Bill(shift=S): every context length the table reads is S rows longer, so requests of a few rows are
    billed the 4096-row bucket's entries (which _table makes dearer) with shift 4096 and the 0 bucket's
    without."""
    rng = np.random.default_rng()
    e = _engine(pair)
    costs = _table(rng, ctxs=(0, 4096))
    bill = replay.Bill(e, costs, shift=shift)
    replay.hold(e, "B=4")
    run_engine(e, _prompts(rng, e.model, 2), 10)
    hist, c = e.auto.history, shift
    build = e.auto.build(2, [p.name for p in e.plans].index("B=4"))
    want = sum(costs["back"][f"{'2' if n == 2 else f'2/{n}'},B=4,{c}"] + costs["front"][f"2,{build},{c}"]
               + costs["host"] for _, n, _ in hist)
    assert hist and bill.seconds == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="shift"):
        replay.Bill(_engine(pair), costs, shift=-1)


def test_the_policy_reads_the_frozen_table(pair):
    """The same prompts under two tables: where drafting's rounds cost 50x AR's the policy serves AR
    rounds (its holds, with a probe now and then); where every plan costs the same it drafts."""
    rng = np.random.default_rng()
    prompts = _prompts(rng, pair[0], 2)
    made = []

    def make():
        made.append(_engine(pair))
        return made[-1]
    dear = _table(rng, back={"AR": 1e-3, "chain": 5e-2, "B=4": 5e-2, "B=16": 5e-2},
                  front={4: 5e-2, 16: 5e-2}, host=0.0, ctxs=(0,))
    flat = _table(rng, back={p: 1e-3 for p in PLANS}, front={4: 1e-9, 16: 1e-9}, host=0.0, ctxs=(0,))
    a = replay.runs(make, dear, "auto", prompts, 40, repeats=1)
    b = replay.runs(make, flat, "auto", prompts, 40, repeats=1)
    assert a["plan_counts"].get("AR", 0) > 0.7 * a["rounds"], a["plan_counts"]
    assert b["plan_counts"].get("AR", 0) < 0.2 * b["rounds"], b["plan_counts"]
    assert b["tau"] > 1.5 and a["tau"] < b["tau"]


def _pair_record(rng, prompts) -> dict:
    cells = [{"batch": 2, "name": "auto (previous)", "mode": "ddtree", "budget": "auto", "tok_per_s": 90.0,
              "costs": _table(rng, ctxs=(0,)), "plan_counts": {"B=4": 3}},
             {"batch": 2, "name": "B=4", "mode": "ddtree", "budget": 4, "tok_per_s": 80.0},
             {"batch": 2, "name": "B=16", "mode": "ddtree", "budget": 16, "tok_per_s": 100.0},
             {"batch": 2, "name": "AR", "mode": "ar", "budget": None, "tok_per_s": 50.0}]
    return {"auto": {"cells": cells, "budgets": list(BUDGETS), "prompt_len": 12, "max_new_tokens": 10,
                     "prompts": prompts}}


def test_the_trained_pair_replays_losslessly_with_the_records_prompts(pair):
    """pair(): the record's prompts, its best fixed budget among the default plans, every plan's output
    equal to AR's, ratios from the rows, the record's measured tok/s beside them."""
    rng = np.random.default_rng()
    prompts = _prompts(rng, pair[0], 8)
    rec = replay.pair(_pair_record(rng, prompts), 2, repeats=1, progress=False, target=pair[0],
                      drafter=pair[1])
    assert [r["plan"] for r in rec["rows"]] == ["auto", "AR", "chain", "B=16"]
    assert rec["prompts"] == "the record's" and rec["label"].startswith("VIRTUAL")
    assert all(r["equals_ar"] for r in rec["rows"])
    assert all(r["tokens"] == 8 * 10 for r in rec["rows"])
    by = {r["plan"]: r["tok_per_s"] for r in rec["rows"]}
    assert rec["ratios"]["auto_over_best_fixed"] == pytest.approx(by["auto"] / by["B=16"])
    assert rec["measured"]["B=16"] == 100.0 and rec["measured"]["auto"] == 90.0
    assert "| B=16 |" in replay.table(rec)


def test_bad_replay_arguments_are_refused_with_the_argument_named(pair, tmp_path, capsys):
    rng = np.random.default_rng()
    rec = _pair_record(rng, [[5] * 12] * 8)
    with pytest.raises(ValueError, match=r"batch=8: .* at batch \[2\]"):
        replay.pair(rec, 8, target=pair[0], drafter=pair[1], progress=False)
    with pytest.raises(ValueError, match="plans: 'B=7'"):
        replay.pair(rec, 2, plans=["B=7"], target=pair[0], drafter=pair[1], progress=False)
    with pytest.raises(ValueError, match="prompts: 3 given"):
        replay.pair(rec, 2, prompts=[[5] * 12] * 3, target=pair[0], drafter=pair[1], progress=False)
    for bad_rec in ({"k26": {}}, [1, 2]):
        with pytest.raises(ValueError, match="an 'auto' section"):
            replay.pair(bad_rec, 2, target=pair[0], drafter=pair[1], progress=False)
    with pytest.raises(ValueError, match="k26 cell r:2:96:4: not in the record"):
        replay.k26_cell({"k26": {"cells": [{"run": "r", "batch": 1}]}}, "r", 2, 96, 4.0, progress=False)
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec))
    for argv, needle in [([str(path)], "exactly one of --batch"),
                         ([str(path), "--k26", "a:b"], "RUN:BATCH:CONTEXT:TAU"),
                         ([str(path), "--k26", "a:b:c:d"], "integer batch"),
                         ([str(path), "--batch", "2", "--out", str(tmp_path / "no" / "r.json")],
                          "its folder does not exist"),
                         ([str(tmp_path / "none.json"), "--batch", "2"], "no such file"),
                         ([str(path), "--batch", "2", "--prompts", str(path) + "x"], "no such file")]:
        with pytest.raises(SystemExit):
            replay.main(argv)
        assert needle in capsys.readouterr().err, argv
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="a JSON list of token lists"):
        replay.read_prompts(bad)
    assert replay.read_prompts(path) == [[5] * 12] * 8


def test_a_k26_cell_replays_its_profile_at_small_dimensions():
    """k26_cell(): the cell's profile (parsed from its name), seeds and token counts at small dimensions;
    a held chain's tau is near the profile's chain tau and a tree's above it."""
    rng = np.random.default_rng()
    back = {"AR": 1e-3, "chain": 2e-3, "B=4": 2e-3, "B=16": 3e-3}
    costs = _table(rng, back=back, front={4: 1e-3, 16: 1e-3}, host=1e-4, ctxs=(0,))
    prof = "simulated: chain tau 4 (ratio 0.5, depth 7)"
    cells = [{"run": "r", "batch": 2, "context": 96, "tau_chain": 4.0, "mode": "ddtree", "budget": "auto",
              "costs": costs, "profile": prof, "tok_per_s": 1.0},
             {"run": "r", "batch": 2, "context": 96, "tau_chain": 4.0, "mode": "ddtree", "budget": 4,
              "profile": prof, "tok_per_s": 2.0},
             {"run": "r", "batch": 2, "context": 96, "tau_chain": 4.0, "mode": "ddtree", "budget": 16,
              "profile": prof, "tok_per_s": 3.0}]
    rec = replay.k26_cell({"k26": {"cells": cells}}, "r", 2, 96, 4.0, plans=["chain", "B=16", "auto"],
                          repeats=1, progress=False)
    by = {r["plan"]: r for r in rec["rows"]}
    assert rec["profile"] == "simulated: chain tau 4 (ratio 0.5, depth 7)"
    assert all(r["tokens"] == 2 * 128 for r in rec["rows"])
    assert 3.0 < by["chain"]["tau"] < 5.0 and by["B=16"]["tau"] > by["chain"]["tau"]
    assert rec["measured"] == {"auto": 1.0, "B=4": 2.0, "B=16": 3.0}
