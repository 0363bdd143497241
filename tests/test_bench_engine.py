"""kdtree.bench.engine's CPU parts: the decode weight-bytes floor, the stage profile of an auto round."""
import pytest
import torch

from kdtree.bench.engine import decode_weight_bytes
from kdtree.config import TINY_A, TINY_B, load_config


@pytest.mark.parametrize("args", [TINY_A, TINY_B, load_config("mid"), load_config("kimi-k2.6")])
def test_all_experts_touched_is_every_parameter_but_the_embedding_table(args):
    full = decode_weight_bytes(args, itemsize=1, experts_touched=args.n_routed_experts)
    assert full == args.param_count() - args.vocab_size * args.hidden_size + args.hidden_size
    top = decode_weight_bytes(args, itemsize=2)
    per_expert = 3 * args.hidden_size * args.moe_intermediate_size * 2
    assert full * 2 - top \
        == args.n_moe_layers * (args.n_routed_experts - args.num_experts_per_tok) * per_expert


def test_mid_config_shape_and_bytes():
    a = load_config("mid")
    assert (a.hidden_size, a.num_hidden_layers, a.n_routed_experts, a.num_experts_per_tok) \
        == (2048, 12, 32, 4)
    assert 1.3e9 < a.param_count() < 1.5e9
    # bf16, top-4 routing: attention 137 M, dense 35 M, touched + shared experts 173 M, lm_head 66 M weights
    assert 0.80e9 < decode_weight_bytes(a) < 0.84e9


def test_experts_touched_is_checked():
    with pytest.raises(ValueError, match="experts_touched=99"):
        decode_weight_bytes(TINY_A, experts_touched=99)


def test_the_benchmark_says_it_needs_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from kdtree.bench import engine as bench_engine
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench_engine.run(tmp_path)
    assert not any(tmp_path.iterdir())


def test_mid_model_names_a_bad_decode_path_before_building(tmp_path):
    from kdtree.bench import engine as bench_engine
    with pytest.raises(ValueError, match="decode_path='kernels'"):
        bench_engine.mid_model(decode_path="kernels")
    with pytest.raises(ValueError, match="decode_path='kernels'"):
        bench_engine.run(tmp_path / "rec", decode_path="kernels")
    assert not (tmp_path / "rec").exists()


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_stage_kernels_profiles_an_auto_round_as_its_two_phases():
    """bench.engine.stage_kernels on a budget='auto' engine (CPU: the stage ranges and the plan, kernels are
    CUDA's): both phases' five stages, the plan asked for, the engine left as it was; a bad plan is refused
    before anything runs."""
    from kdtree import weights
    from kdtree.bench.stages import STAGES, stage_kernels
    from kdtree.data import heldout_prompts
    from kdtree.engine import Engine
    from kdtree.oracle import oracle_ar
    t = weights.load("data/trained/target").eval()
    d = weights.load_drafter("data/trained/drafter", t)
    e = Engine(t, d, mode="ddtree", budget="auto", budgets=(4, 8, 16), max_batch=1, max_len=256)
    p = heldout_prompts(1, 24)[0]
    with pytest.raises(ValueError, match=r"plan='B=32': expected 'AR' or one of the engine's tree plans"):
        stage_kernels(e, p, plan="B=32")
    assert not e.active and not e.waiting and e.rounds == 0
    out = stage_kernels(e, p, rounds=2, plan="B=8")
    i = [pl.name for pl in e.auto.plans].index("B=8")
    # the round builds B=8's own tree or a wider one where the measured front costs little (wider_builds)
    assert (out["plan"], out["build_nodes"]) == ("B=8", e.auto.build(e.bucket(1), i))
    assert out["build_nodes"] >= 8
    assert all(out[st]["ops"] > 0 for st in STAGES), out   # each stage's range ran, in the round's order
    assert out["attributed"] == "ops"   # no CUDA stream: no markers
    assert not e.active and e.free_pages == e.pages.capacity
    rid = e.add_request(p, 20)
    assert e.run()[rid].tokens == oracle_ar(t, p, 20).tokens
    fixed = Engine(t, d, mode="ddtree", budget=8, max_batch=1, max_len=256)
    with pytest.raises(ValueError, match="only a budget='auto' engine takes a plan"):
        stage_kernels(fixed, p, plan="B=8")


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_stage_kernels_profiles_the_ar_plan_at_a_batch():
    """plan "AR" at batch 2: no front (its draft and build stages call no op), the verify, walk and commit
    do; the deferred-context counts, lengths and roots are as before, so the requests served after it match
    the oracle; a batch beyond max_batch is refused before anything runs."""
    from kdtree import weights
    from kdtree.bench.stages import stage_kernels
    from kdtree.data import heldout_prompts
    from kdtree.engine import Engine
    from kdtree.oracle import oracle_ar
    t = weights.load("data/trained/target").eval()
    d = weights.load_drafter("data/trained/drafter", t)
    e = Engine(t, d, mode="ddtree", budget="auto", budgets=(4, 8), max_batch=2, max_len=256)
    p = heldout_prompts(1, 24)[0]
    with pytest.raises(ValueError, match=r"batch=3: expected an int in \[1, 2\]"):
        stage_kernels(e, p, plan="AR", batch=3)
    assert not e.active and not e.waiting and e.rounds == 0
    seen, step, run = [], e.step, e.run
    e.step = lambda *a, **k: (step(*a, **k), seen.append(e.policy.pend_n.clone()))[0]
    e.run = lambda *a, **k: (seen.append(e.policy.pend_n.clone()), run(*a, **k))[1]
    out = stage_kernels(e, p, rounds=2, plan="AR", batch=2)
    del e.step, e.run
    assert len(seen) >= 3 and torch.equal(seen[1], seen[2]), seen   # the profiled AR rounds' rows undone
    assert out["plan"] == "AR" and out["build_nodes"] is None
    assert out["draft"]["ops"] == out["build"]["ops"] == 0, out
    assert all(out[st]["ops"] > 0 for st in ("verify", "walk", "commit")), out
    assert not e.active and e.free_pages == e.pages.capacity and not e.policy.pend_n.any()
    ids = [e.add_request(p, 20), e.add_request(p[:-3], 20)]
    res = e.run()
    assert [res[i].tokens for i in ids] == [oracle_ar(t, p, 20).tokens, oracle_ar(t, p[:-3], 20).tokens]


def test_stage_by_markers_places_every_kernel_between_its_stage_markers():
    """Kernels in GPU order between two markers belong to the stage the first opens (two rounds here, given
    out of order); the gap between a round's end marker and the next round's first is no stage's; copies
    are left out; no marker: None; markers that are not whole rounds: refused."""
    from kdtree.bench.stages import MARK_KERNEL, stage_by_markers
    order = ("a", "b")
    def m(t):
        return (t, 1.0, f"void {MARK_KERNEL}(long)")
    r1 = [m(0), (1, 5.0, "moe_gate_up_bf16"), (2, 3.0, "gemm"), m(3), (4, 7.0, "verify_attn_wg"), m(5)]
    gap = [(6, 9.0, "copy_lens"), (6.5, 2.0, "Memcpy HtoD")]
    r2 = [m(7), (8, 1.0, "x"), m(9), (10, 2.0, "y"), (11, 4.0, "Memset"), m(12)]
    got = stage_by_markers(list(reversed(r1 + gap + r2)), order)
    assert got == [("a", 5.0, "moe_gate_up_bf16"), ("a", 3.0, "gemm"), ("b", 7.0, "verify_attn_wg"),
                   ("a", 1.0, "x"), ("b", 2.0, "y")]
    assert stage_by_markers(gap, order) is None
    with pytest.raises(ValueError, match="5 markers, not whole rounds of 2 stages"):
        stage_by_markers(r1 + r2[:-1], order)


def test_ddtree_bound_arithmetic():
    """The bound's ratio: tau x AR's round over DDTree's round less the verify's extra GPU seconds."""
    from kdtree.bench.engine import ddtree_bound
    st = {k: {"kernels": 1, "gpu_s": 1e-5} for k in ("draft", "build", "verify", "walk", "commit")}
    ar = {"round_wall_median_s": 3e-4, "stage_kernels": {**st, "verify": {"kernels": 1, "gpu_s": 2e-4}}}
    dd = {"budget": 64, "tau": 3.0, "round_wall_median_s": 9e-4,
          "stage_kernels": {**st, "verify": {"kernels": 1, "gpu_s": 5e-4}}}
    b = ddtree_bound(ar, {"tau": 1.8}, dd)
    assert abs(b["x_ar_if_verify_cost_ar"] - 3.0 * 3e-4 / (9e-4 - 3e-4)) < 1e-12
    assert abs(b["ar_rounds_per_round"] - 3.0) < 1e-12 and abs(b["round_s_for_goal"] - 5e-4) < 1e-12


def test_e2e_prompts_are_checked_before_anything_runs(tmp_path):
    """trained_pair(prompts=...) and record_prompts: a wrong count, length, id or record is a ValueError
    naming the argument, raised before a model loads (ckpt_dir's config alone gives the vocabulary)."""
    import json
    from kdtree.bench import e2e
    good = [[5] * 8, [6] * 8]
    assert e2e.check_prompts(good + [[1]], 2, 8, 4096) == good
    one = r"prompts\[1\]: expected 8 int"
    for bad, what in (([[5] * 8], "prompts: expected a list of at least 2"), ("abc", "got str"),
                      ([[5] * 8, [6] * 7], one), ([[5] * 8, [6] * 7 + [4096]], one),
                      ([[5] * 8, [6] * 7 + [True]], one)):
        with pytest.raises(ValueError, match=what):
            e2e.check_prompts(bad, 2, 8, 4096)
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected 64 int token ids in \[0, "):
        e2e.trained_pair("data/trained", batches=(1,), n_prompts=1, prompts=[[10 ** 6] * 64])
    (tmp_path / "r.json").write_text(json.dumps({"auto": {"prompts": good}}))
    (tmp_path / "old.json").write_text(json.dumps({"auto": {"cells": []}}))
    (tmp_path / "bad.json").write_text("{")
    assert e2e.record_prompts(tmp_path / "r.json") == good
    for name, what in (("old.json", "records from before"), ("bad.json", "readable e2e record"),
                       ("none.json", "readable e2e record")):
        with pytest.raises(ValueError, match=f"prompts_from=.*{what}"):
            e2e.record_prompts(tmp_path / name)


def test_e2e_runs_and_records_the_prompts_it_is_given():
    """trained_pair on the CPU with given prompts: the section records them and their source, and its AR
    cell's outputs are the oracle's greedy continuations of them (by digest), and every cell equals AR."""
    from kdtree import weights
    from kdtree.bench import e2e
    import hashlib
    from kdtree.oracle import oracle_ar
    t = weights.load("data/trained/target").eval()
    d = weights.load_drafter("data/trained/drafter", t)
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(2, t.args.vocab_size, (2, 16), generator=g).tolist()
    rec = e2e.trained_pair(batches=(2,), budgets=(4,), n_prompts=2, prompt_len=16, max_new=6, repeats=1,
                           decides=(), progress=False, target=t, drafter=d, check=(1, 4), prompts=prompts)
    assert rec["prompts"] == prompts and rec["prompt_source"] == "given"
    ar = next(c for c in rec["cells"] if c["mode"] == "ar")
    want = [hashlib.sha1(str(oracle_ar(t, p, 6).tokens).encode()).hexdigest()[:10] for p in prompts]
    assert ar["output_digests"] == want
    assert all(c["equals_ar"] for c in rec["cells"])


def test_e2e_targets_hold_the_engines_decision_mode_and_report_the_other():
    """_targets: auto with the engine's decision mode ("previous") carries the targets; "sync" is given
    against it and against the same baselines as info; without a "previous" cell, "sync" carries them."""
    from kdtree.bench import e2e

    def cell(mode, budget=None, decide=None, tok=100.0):
        return dict(mode=mode, budget=budget, decide=decide, compiled=False, tok_per_s=tok, equals_ar=True,
                    name=e2e._name(mode, budget, decide, False))
    base = [cell("ar", tok=90.0), cell("dflash", tok=80.0), cell("ddtree", 8, tok=120.0),
            cell("ddtree", 16, tok=100.0)]
    prev, sync = cell("ddtree", "auto", "previous", 118.0), cell("ddtree", "auto", "sync", 96.0)
    got = {(t["key"], t["cell"]): t for t in e2e._targets(base + [prev, sync], 8, False) if "cell" in t}
    p = got[("e2e_auto_over_best_fixed", "auto (previous)")]
    assert p["met"] and not p.get("info") and p["measured"] == pytest.approx(118 / 120) and p["budget"] == 8
    assert not got[("e2e_auto_over_ar_dflash", "auto (previous)")].get("info")
    s = got[("e2e_decide_over_default", "auto (sync)")]
    assert s["info"] and not s["met"] and s["measured"] == pytest.approx(96 / 118)
    for k in ("e2e_decide_over_best_fixed", "e2e_decide_over_ar_dflash"):
        assert got[(k, "auto (sync)")]["info"]
    assert not any(k.startswith("e2e_auto_over") and c == "auto (sync)" for k, c in got)
    alone = [t for t in e2e._targets(base + [sync], 8, False) if t.get("cell") == "auto (sync)"]
    assert {t["key"] for t in alone} == {"e2e_auto_over_best_fixed", "e2e_auto_over_ar_dflash"}
    assert not any(t.get("info") for t in alone)
