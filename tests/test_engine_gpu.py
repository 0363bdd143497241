"""The engine on the GPU: CUDA-graphed rounds against the oracle loop, graphs on == off, batching."""
import gc

import pytest
import torch

from kdtree import weights
from kdtree.drafter import OracleDrafter
from kdtree.engine import Engine
from kdtree.engine import graphs as gkeys
from kdtree.oracle import oracle_ar
from kdtree.validate import kernel_model, random_prompts

pytestmark = pytest.mark.gpu
# a K2.5-DFlash-shaped drafter at the mid config's width (fewer layers): the K2.6 sweep's tests
MID_DRAFTER = dict(num_hidden_layers=2, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                   intermediate_size=4096)


@pytest.fixture(scope="module")
def pair():
    t = weights.load("data/trained/target", device="cuda").eval()
    return t, weights.load_drafter("data/trained/drafter", t)


def _serve(engine, prompts, lens, join_every=3):
    """Requests join every `join_every` rounds; returns outputs in prompt order."""
    ids = []
    for i, (p, n) in enumerate(zip(prompts, lens)):
        ids.append(engine.add_request(p, n))
        if i % join_every == join_every - 1:
            engine.step()
    res = engine.run()
    return [res[i].tokens for i in ids]


@pytest.mark.parametrize("mode,budget", [("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", 128)])
def test_graphed_engine_equals_the_oracle_on_the_trained_pair(pair, mode, budget):
    t, d = pair
    prompts = random_prompts(t.args, 10, seed=5, min_len=8, max_len=70)
    lens = [12 + 7 * i for i in range(10)]
    ref = [oracle_ar(t, p, n).tokens for p, n in zip(prompts, lens)]
    kw = dict(drafter=None if mode == "ar" else d, mode=mode, budget=budget, max_batch=4, max_len=512)
    g = Engine(t, **kw)
    assert g.graph_reason is None and g.graphs
    assert _serve(g, prompts, lens) == ref
    assert g.free_pages == g.pages.capacity and g.pages.reserved == 0
    e = Engine(t, graphs=False, **kw)
    assert _serve(e, prompts, lens) == ref


@pytest.mark.parametrize("mode,budget", [("ar", None), ("ddtree", 64)])
def test_same_length_prompts_share_the_prefill_forwards(pair, mode, budget):
    """Eight held-out prompts of one length admitted together: one prefill forward per chunk for all of them
    (kernel attention over eight page tables), every output equal to the oracle's."""
    from kdtree.data import heldout_prompts
    t, d = pair
    prompts = heldout_prompts(8, 64, seed=3)
    ref = [oracle_ar(t, p, 24).tokens for p in prompts]
    e = Engine(t, None if mode == "ar" else d, mode=mode, budget=budget, max_batch=8, max_len=512,
               prefill_chunk=32)
    assert [r.tokens for r in e.generate(prompts, 24)] == ref
    assert e.prefill_forwards == 2  # 64 rows in chunks of 32


@pytest.mark.parametrize("decide", ["previous", "sync"])
def test_auto_budget_graphed_equals_the_oracle(pair, decide):
    """budget="auto" with CUDA graphs (a front graph per bucket, a graph per plan): every output equals the
    oracle loop's; the start-up cost table holds every (bucket, plan, context) cell;
    graphs on == off."""
    t, d = pair
    prompts = random_prompts(t.args, 8, seed=6, min_len=8, max_len=70)
    lens = [16 + 9 * i for i in range(8)]
    ref = [oracle_ar(t, p, n).tokens for p, n in zip(prompts, lens)]
    kw = dict(mode="ddtree", budget="auto", max_budget=64, max_batch=4, max_len=2048, decide=decide)
    g = Engine(t, d, **kw)
    assert g.graph_reason is None and (4, False, len(g.plans) - 1) in g.graphs
    assert all(gkeys.front(4, B) in g.graphs for B in g.policy.tree_ops)   # a front graph per tree size
    ctxs = g.costs.ctx_buckets
    assert ctxs == (0, 1024)
    assert len(g.costs.back) == len(g.buckets) * len(g.plans) * len(ctxs)
    assert all(0 < v < 1 for v in list(g.costs.back.values()) + list(g.costs.front.values()))
    drafting = [i for i in range(len(g.plans)) if g.auto.build(4, i) is not None]
    if decide == "previous":   # each drafting plan's round also as one graph, front and block together
        assert g.whole_graphs is True and all(gkeys.whole(4, False, i) in g.graphs for i in drafting)
    else:
        assert g.whole_graphs == "decide=sync" and not any(k[0] == "whole" for k in g.graphs)
    assert _serve(g, prompts, lens) == ref
    assert g.costs.samples == g.rounds and len({h[2] for h in g.auto.history}) >= 1
    from kdtree.budget import AR_PROBE   # an AR probe drafts, then runs AR's block: two graphs, not one
    drafted = sum(h[2] not in ("AR", AR_PROBE) for h in g.auto.history)
    assert g.whole_replays == (drafted if decide == "previous" else 0)
    e = Engine(t, d, graphs=False, **kw)
    assert _serve(e, prompts, lens) == ref


def test_an_invalidated_capture_is_tried_again(pair, monkeypatch):
    """The first capture the driver 'invalidates' (simulated: torch.cuda.graph's exit raises once) is captured
    again: the engine serves the oracle's tokens and lists the retry; a capture failing every time raises."""
    t, d = pair
    real = torch.cuda.graph

    def flaky(times):
        left = [times]

        def graph(*a, **k):
            ctx = real(*a, **k)

            class Ctx:
                def __enter__(self):
                    return ctx.__enter__()

                def __exit__(self, *exc):
                    out = ctx.__exit__(*exc)
                    if left[0] > 0:
                        left[0] -= 1
                        raise RuntimeError("CUDA error: operation failed due to a previous error during "
                                           "capture")
                    return out
            return Ctx()
        return graph

    prompts = random_prompts(t.args, 2, seed=7, min_len=8, max_len=30)
    ref = [oracle_ar(t, p, 20).tokens for p in prompts]
    monkeypatch.setattr(torch.cuda, "graph", flaky(1))
    e = Engine(t, d, mode="ddtree", budget=16, max_batch=2, max_len=256)
    assert len(e.capture_retries) == 1 and "capture" in e.capture_retries[0]
    assert [r.tokens for r in e.generate(prompts, 20)] == ref
    monkeypatch.setattr(torch.cuda, "graph", flaky(100))
    with pytest.raises(RuntimeError, match="capture"):
        Engine(t, d, mode="ddtree", budget=16, max_batch=2, max_len=256)


def test_host_drafter_and_golden_backend_on_the_gpu(pair):
    t, _ = pair
    prompts = random_prompts(t.args, 4, seed=9, min_len=8, max_len=40)
    for p in prompts:
        ref = oracle_ar(t, p, 40).tokens
        o = OracleDrafter(p + ref, t.args.vocab_size, block_size=16)
        for backend in ("golden", "kernel"):
            e = Engine(t, o, mode="ddtree", budget=64, max_batch=1, max_len=256, backend=backend)
            assert e.graph_reason is not None  # a host drafter: eager rounds
            assert e.generate([p], 40)[0].tokens == ref


def test_kernel_attention_engine_graphs_on_equals_off():
    """bf16 latent cache, verify_attn, kernel tree steps: the graph replays the eager round bit for bit."""
    m = kernel_model(seed=3)
    prompts = random_prompts(m.args, 6, seed=2, min_len=8, max_len=60)
    outs = []
    for graphs in (True, False):
        e = Engine(m, mode="ar", max_batch=4, max_len=256, graphs=graphs)
        outs.append(_serve(e, prompts, [24] * 6))
    assert outs[0] == outs[1]


def test_sampling_is_per_request_and_reproducible_under_batching(pair):
    t, d = pair
    prompts = random_prompts(t.args, 8, seed=4, min_len=8, max_len=40)
    e1 = Engine(t, d, mode="ddtree", budget=32, max_batch=1, max_len=256)
    alone = [e1.generate([p], 24, temperature=0.8, seed=100 + i)[0].tokens for i, p in enumerate(prompts)]
    e8 = Engine(t, d, mode="ddtree", budget=32, max_batch=8, max_len=256)
    ids = [e8.add_request(p, 24, temperature=0.8, seed=100 + i) for i, p in enumerate(prompts)]
    res = e8.run()
    assert [res[i].tokens for i in ids] == alone
    assert len({tuple(a) for a in alone}) > 1


def test_memory_is_flat_over_many_rounds(pair):
    t, d = pair
    e = Engine(t, d, mode="ddtree", budget=32, max_batch=8, max_len=512)
    prompts = random_prompts(t.args, 64, seed=6, min_len=8, max_len=60)
    for p in prompts[:8]:
        e.add_request(p, 40)
    e.run()
    gc.collect()  # earlier tests' engines (reference cycles) freed now, not in the middle of the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for i, p in enumerate(prompts[8:]):
        e.add_request(p, 20 + i % 30)
        if i % 2:
            e.step()
    e.run()
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base
    assert e.free_pages == e.pages.capacity


def _trace(engine, reqs, watch=0):
    """Serve (prompt, max_new) requests at once; their tokens and request `watch`'s logits per round."""
    ids = [engine.add_request(p, n) for p, n in reqs]
    rows = []
    while engine.waiting or engine.active:
        before = engine.rounds
        engine.step()
        if engine.rounds > before and ids[watch] in engine.last_round["ids"]:
            rows.append(engine.last_logits[engine.last_round["ids"].index(ids[watch])].clone())
    res = engine.run()
    return [res[i].tokens for i in ids], rows


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_twenty_runs_are_bitwise_equal(pair):
    """The same batch of requests, 20 times through one graphed engine: tokens and every round's logits of a
    request bitwise equal; the checker flags a one-ulp change."""
    t, d = pair
    prompts = random_prompts(t.args, 8, seed=31, min_len=8, max_len=60)
    reqs = [(p, 16 + 4 * i) for i, p in enumerate(prompts)]
    e = Engine(t, d, mode="ddtree", budget=32, max_batch=8, max_len=256)
    toks0, rows0 = _trace(e, reqs, watch=3)
    for _ in range(19):
        toks, rows = _trace(e, reqs, watch=3)
        assert toks == toks0 and _same(rows, rows0)
    bumped = [rows0[0].clone()] + rows0[1:]
    bumped[0][0, 0] = torch.nextafter(bumped[0][0, 0], torch.tensor(float("inf"), device="cuda"))
    assert not _same(bumped, rows)


def test_a_request_alone_and_in_a_batch_of_32_is_bitwise_the_same(pair):
    """deterministic=True at max_batch 32: a request's tokens and logits alone == beside 31 others."""
    t, d = pair
    prompts = random_prompts(t.args, 32, seed=32, min_len=8, max_len=60)
    e = Engine(t, d, mode="ddtree", budget=16, max_batch=32, max_len=256, deterministic=True)
    alone_t, alone_l = _trace(e, [(prompts[0], 40)])
    crowd_t, crowd_l = _trace(e, [(prompts[0], 40)] + [(p, 10 + i) for i, p in enumerate(prompts[1:])])
    assert alone_t[0] == crowd_t[0] and len(alone_l) > 5 and _same(alone_l, crowd_l)


def _top2_margin(t, seq, pos) -> float:
    """Top-2 logit gap of the target's eager forward at position pos of seq (the oracle's own numbers)."""
    with torch.no_grad():
        lg = t(torch.tensor([seq[:pos + 1]], device="cuda")).logits[0, -1].float()
    top = lg.topk(2).values
    return float(top[0] - top[1])


NEAR_TIE = 1e-3  # float32 logits: a request may part from the oracle only where its top-2 gap is below this


def test_soak_ten_thousand_rounds_at_batch_32(pair):
    """10,000 graphed rounds at batch 32 on run()'s overlapped schedule (each round launched before the last
    one lands), requests arriving and finishing: memory flat after warm-up, every page back, outputs == the
    oracle except at near-ties (counted, each checked to be one)."""
    t, d = pair
    prompts = random_prompts(t.args, 16, seed=33, min_len=8, max_len=60)
    longest = 240
    refs = [oracle_ar(t, p, longest).tokens for p in prompts]
    e = Engine(t, d, mode="ddtree", budget=16, max_batch=32, max_len=512)
    ids, k, samples, overlapped = {}, 0, [], 0
    while e.rounds < 10_000:
        while len(e.waiting) + len(e.active) < 40:
            n = 8 + (37 * k) % (longest - 7)
            ids[e.add_request(prompts[k % 16], n)] = (k % 16, n)
            k += 1
        before = e.rounds
        e.step(overlap=True)
        overlapped += e.in_flight
        if e.rounds > before and e.rounds % 500 == 0:
            torch.cuda.synchronize()
            samples.append(torch.cuda.memory_allocated())
    done = e.run()
    torch.cuda.synchronize()
    # flat: after the first 500 rounds no sample (nor the end) rises by 4 MiB (1 KiB a request would)
    base = samples[0]
    assert max(samples + [torch.cuda.memory_allocated()]) - base < 4 << 20, (base, samples)
    assert e.free_pages == e.pages.capacity and e.pages.reserved == 0 and not e.active and not e.waiting
    assert len(done) == len(ids) > 2_000
    assert overlapped > 5_000   # most steps left a round in flight
    parted = 0
    for rid, (j, n) in ids.items():
        got, want = done[rid].tokens, refs[j][:n]
        if got != want:
            parted += 1
            at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            assert _top2_margin(t, prompts[j] + want, len(prompts[j]) + at - 1) < NEAR_TIE, (rid, at)
    assert parted <= len(ids) // 100


def test_simulated_rounds_on_a_kernel_only_int4_model():
    """The K2.6 sweep's path at the mid config's dimensions: INT4 experts in one kernel-format copy
    (moe_int4), the kernel attention over 1,500 synthetic context rows, a K2.5-DFlash-shaped drafter (fewer
    layers), simulated acceptance, budget="auto" graphed: every request finishes, accept lengths near the
    profile's (fixed B = 16), an AR engine on the same profile emits the same tokens, every plan's graph
    captured, pages all back."""
    from kdtree import k26, project
    from kdtree.simulate import Profile
    t = k26.build_target(2, device="cuda", config="mid")
    assert all(layer.mlp.experts.released for layer in t.model.layers[1:])
    d = k26.build_drafter(t, args=k26.drafter_args(t.args, **MID_DRAFTER))
    prof = Profile(4.0, depth=7, K=64)
    prompts = [[11 + i, 12, 13, 14] for i in range(8)]
    e = Engine(t, d, mode="ddtree", budget=16, max_batch=8, max_len=2048, simulate=prof)
    ids = [e.add_request(p, 96, seed=i, synthetic_context=1500) for i, p in enumerate(prompts)]
    out = e.run()
    acc = [a for i in ids for a in out[i].accept_lengths]
    want = project.profile_taus(4.0, [16], 7)[16]
    assert all(len(out[i].tokens) == 96 for i in ids) and abs(sum(acc) / len(acc) - want) < 0.35, (acc, want)
    # the per-stage profile places the CuPy kernels (INT4 experts, tree attention) by the stream's markers
    from kdtree.bench.stages import stage_kernels
    st = stage_kernels(e, prompts[0], rounds=2, top_kernels=500)
    verify = [k["kernel"] for k in st["top_kernels"] if k["stage"] == "verify"]
    assert st["attributed"] == "markers" and any(k.startswith("moe_") for k in verify), st["top_kernels"]
    assert any(k.startswith("verify_attn") for k in verify) and st["verify"]["gpu_s"] > 0
    assert not any(k["kernel"].startswith("stage:") for k in st["top_kernels"])   # the ranges' GPU spans
    # AR reads the same simulated text: the same tokens (a rank beyond the list aside: the model's argmax)
    ar = Engine(t, mode="ar", max_batch=8, max_len=2048, simulate=prof)
    ar_ids = [ar.add_request(p, 96, seed=i, synthetic_context=1500) for i, p in enumerate(prompts)]
    got = ar.run()
    same = [x == y for i, j in zip(ids, ar_ids) for x, y in zip(out[i].tokens, got[j].tokens)]
    assert sum(same) / len(same) > 0.98, sum(same) / len(same)
    a = Engine(t, d, mode="ddtree", budget="auto", budgets=(4, 16, 64), max_batch=8, max_len=2048,
               simulate=prof)
    assert a.graph_reason is None and all((8, True, i) in a.graphs for i in range(len(a.plans)))
    ids = [a.add_request(p, 64, seed=i, synthetic_context=1500) for i, p in enumerate(prompts)]
    out = a.run()
    assert all(len(out[i].tokens) == 64 for i in ids) and a.free_pages == a.pages.capacity


def test_k26_sweep_profiles_the_drafter_at_the_cells_shape():
    """bench.k26 at the mid config's dimensions on a GPU: the DFlash row's stage profile ran at the cell's
    batch and context (`stages_at`), its draft and commit stages measured, and every speculative row of the
    cell carries those times as `draft_s` / `commit_s` (the projection's drafter is the measured one)."""
    from kdtree import k26
    from kdtree.bench import k26 as bench_k26
    rec = bench_k26.run(cells=[(96, 2)], profiles=[(4.0, 8)], budgets=(4, 16), repeats=1, progress=False,
                        device="cuda", args=k26.target_args(2, config="mid"), dargs=MID_DRAFTER, layers=2,
                        queue=0)
    cells = rec["cells"]
    assert [c["mode"] for c in cells] == ["ar", "dflash", "ddtree", "ddtree", "ddtree"]
    assert not any(c.get("error") for c in cells), [c.get("error") for c in cells]
    (df,) = [c for c in cells if c["mode"] == "dflash"]
    assert df["stages_at"] == {"batch": 2, "context": 96}
    draft, commit = df["stages"]["draft"]["gpu_s"], df["stages"]["commit"]["gpu_s"]
    assert draft > 0 and commit > 0, (draft, commit)
    assert all(c["draft_s"] == draft and c["commit_s"] == commit for c in cells if c["mode"] != "ar")
    assert "draft_s" not in cells[0] and "commit_s" not in cells[0]


@pytest.mark.parametrize("mode,budget", [("ar", None), ("ddtree", 32)])
def test_prefill_graphs_replay_the_eager_prefill(pair, mode, budget):
    """Prompts of one length served one after another: the first chunk of that shape runs eagerly (and is
    captured), the others replay its graph; tokens equal the oracle's and every round's accept length equals
    the eager engine's (so the drafter's context features are the same); memory stays as it was once the
    shape has been seen."""
    t, d = pair
    prompts = random_prompts(t.args, 6, seed=41, min_len=40, max_len=40)
    ref = [oracle_ar(t, p, 24).tokens for p in prompts]
    kw = dict(drafter=None if mode == "ar" else d, mode=mode, budget=budget, max_batch=2, max_len=256)
    runs = {}
    for graphs in (True, False):
        e = Engine(t, graphs=graphs, **kw)
        res = e.generate(prompts[:1], 24)   # the shape seen (graphs: captured)
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        res += [e.generate([p], 24)[0] for p in prompts[1:]]
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == base
        assert [r.tokens for r in res] == ref
        runs[graphs] = ([r.accept_lengths for r in res], e.prefill_replays, e.capture_retries)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1:] == (5, []) and runs[False][1] == 0


def test_a_prefill_capture_mid_serving_keeps_the_allocators_cache(pair):
    """A prefill shape's first admission captures its graph while requests are served: the capture keeps
    the caching allocator's free blocks (torch.cuda.graph's own entry empties the cache, so every later
    allocation would pay cudaMalloc again; shown below, so the check can fail), and the new shape's
    tokens still equal the oracle's."""
    t, _ = pair
    prompts = random_prompts(t.args, 2, seed=43, min_len=30, max_len=30) + \
        random_prompts(t.args, 1, seed=44, min_len=21, max_len=21)
    e = Engine(t, mode="ar", max_batch=2, max_len=256)
    e.generate(prompts[:1], 8)
    a = e.add_request(prompts[1], 40)
    e.step()                                                   # a request active around the capture
    torch.cuda.synchronize()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x                                                      # a free 64 MiB block in the cache
    reserved, shapes = torch.cuda.memory_reserved(), sum(1 for v in e.prefill.graphs.values() if v)
    b = e.add_request(prompts[2], 8)                           # a new shape: captured at its admission
    res = e.run()
    assert sum(1 for v in e.prefill.graphs.values() if v) == shapes + 1 and e.last_admission[3] is True
    assert torch.cuda.memory_reserved() >= reserved
    assert res[a].tokens == oracle_ar(t, prompts[1], 40).tokens
    assert res[b].tokens == oracle_ar(t, prompts[2], 8).tokens
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x
    reserved, g, y = torch.cuda.memory_reserved(), torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    with torch.cuda.graph(g):
        y.add_(1)
    assert torch.cuda.memory_reserved() < reserved             # torch's context: the cache emptied
