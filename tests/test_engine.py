"""The engine on the CPU (golden tree steps): continuous batching against the oracle loop, pages, admission,
bad requests, per-request sampling streams, a short soak."""
import numpy as np
import pytest
import torch

from kdtree import weights
from kdtree.drafter import OracleDrafter, build_drafter
from kdtree.engine import Engine
from kdtree.engine.prefill import Prefill
from kdtree.engine.scheduler import Scheduler
from kdtree.round_ops import gumbel
from kdtree.oracle import oracle_ar
from kdtree.validate import random_prompts


class MultiOracle:
    """Test oracle for many requests at once: each session picks the OracleDrafter of its prompt's
    reference."""

    def __init__(self, refs: dict, vocab_size: int, block_size: int = 8, seed: int = 0):
        self.refs, self.vocab_size, self.block_size, self.seed = refs, vocab_size, block_size, seed
        self.target_layer_ids = ()

    def session(self, max_len):
        outer = self

        class _S:
            def start(self, prompt, features=None):
                ref = outer.refs[tuple(prompt)]
                self.o = OracleDrafter(list(prompt) + ref, outer.vocab_size, outer.block_size,
                                       seed=outer.seed)

            def propose(self, committed):
                return self.o.propose(committed)

            def accept(self, features=None):
                pass
        return _S()


def _serve(engine, prompts, lens, join_every=3, **kw):
    """Requests join every `join_every` rounds (continuous batching); outputs in prompt order."""
    ids = []
    for i, (p, n) in enumerate(zip(prompts, lens)):
        ids.append(engine.add_request(p, n, **kw))
        if i % join_every == join_every - 1:
            engine.step()
    res = engine.run()
    return [res[i].tokens for i in ids], [res[i] for i in ids]


@pytest.fixture(scope="module")
def pair():
    t = weights.load("data/trained/target").eval()
    return t, weights.load_drafter("data/trained/drafter", t)


@pytest.mark.parametrize("mode,budget", [("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 48)])
def test_engine_equals_the_oracle_with_requests_joining(tiny, mode, budget):
    """9 requests of different prompt lengths and max_new_tokens joining every third round, batch 4: every
    output equals the oracle loop's greedy AR token for token; long accepted paths (the oracle drafter)."""
    _, args, model = tiny
    prompts = random_prompts(args, 9, seed=3, min_len=3, max_len=40)
    lens = [5 + 4 * i for i in range(9)]
    refs = [oracle_ar(model, p, n).tokens for p, n in zip(prompts, lens)]
    drafter = None if mode == "ar" else MultiOracle({tuple(p): r for p, r in zip(prompts, refs)},
                                                    args.vocab_size, 8)
    e = Engine(model, drafter, mode=mode, budget=budget, max_batch=4, max_len=256)
    assert e.graph_reason is not None  # the CPU runs the rounds eagerly
    outs, res = _serve(e, prompts, lens)
    assert outs == refs
    if mode != "ar":  # multi-token paths were accepted, so compaction moved rows
        assert max(a for r in res for a in r.accept_lengths) >= (5 if budget == 48 else 3)
    assert e.free_pages == e.pages.capacity and e.pages.reserved == 0 and not e.active


@pytest.mark.parametrize("moe", ["loop", "dense", "grouped"])
def test_every_moe_path_equals_the_oracle(tiny, moe):
    """The engine's MoE paths (host loop, every expert densely, torch's grouped GEMM over the chosen pairs) on
    8 requests joining in turn, DDTree B=16: each output equals the oracle loop's greedy AR."""
    if moe == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    _, args, model = tiny
    prompts = random_prompts(args, 8, seed=5, min_len=3, max_len=30)
    lens = [4 + 3 * i for i in range(8)]
    refs = [oracle_ar(model, p, n).tokens for p, n in zip(prompts, lens)]
    drafter = MultiOracle({tuple(p): r for p, r in zip(prompts, refs)}, args.vocab_size, 8)
    e = Engine(model, drafter, mode="ddtree", budget=16, max_batch=4, max_len=256, moe=moe)
    assert e.moe == moe
    outs, _ = _serve(e, prompts, lens)
    assert outs == refs


@pytest.mark.parametrize("mode,budget", [("dflash", None), ("ddtree", 32)])
def test_trained_pair_batched_equals_the_oracle(pair, mode, budget):
    """The DFlash drafter's batched, preallocated context (draft / extend) under continuous batching."""
    t, d = pair
    prompts = random_prompts(t.args, 8, seed=4, min_len=10, max_len=60)
    lens = [8 + 5 * i for i in range(8)]
    refs = [oracle_ar(t, p, n).tokens for p, n in zip(prompts, lens)]
    e = Engine(t, d, mode=mode, budget=budget, max_batch=4, max_len=256)
    outs, res = _serve(e, prompts, lens, join_every=2)
    assert outs == refs
    assert np.mean([a for r in res for a in r.accept_lengths]) > 1.3  # drafts were accepted


def test_requests_wait_for_pages_and_all_come_back(tiny):
    """A pool of 4 pages for requests needing 2 each: at most two run at once, the rest wait (no
    preemption)."""
    _, args, model = tiny
    prompts = random_prompts(args, 6, seed=8, min_len=30, max_len=50)
    refs = [oracle_ar(model, p, 40).tokens for p in prompts]
    e = Engine(model, mode="ar", max_batch=4, max_len=128, max_tokens=4 * 64)
    ids = [e.add_request(p, 40) for p in prompts]
    e.step()
    assert len(e.active) == 2 and len(e.waiting) == 4
    res = e.run()
    assert [res[i].tokens for i in ids] == refs
    assert e.free_pages == 4


@pytest.mark.parametrize("kw,needle", [
    (dict(prompt=[]), "prompt: expected at least one token"),
    (dict(prompt=[1, 10**6]), r"prompt: expected token ids in \[0, "),
    (dict(prompt=[1.5]), "prompt: expected integer token ids"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(seed=-1), "seed=-1"),
    (dict(stop_tokens=["x"]), "stop_tokens="),
    (dict(max_new_tokens=5000), "context overflow"),
    (dict(max_new_tokens=200), "max_len"),
])
def test_bad_requests_are_refused_and_the_batch_in_flight_continues(tiny, kw, needle):
    _, args, model = tiny
    prompts = random_prompts(args, 3, seed=5)
    refs = [oracle_ar(model, p, 20).tokens for p in prompts]
    e = Engine(model, mode="ar", max_batch=4, max_len=128)
    ids = [e.add_request(p, 20) for p in prompts]
    e.step()
    e.step()
    state = (len(e.waiting), len(e.active), e.free_pages, e.pages.reserved, e.lens.clone(), e.root.clone())
    call = dict(prompt=[1, 2, 3], max_new_tokens=8)
    call.update(kw)
    with pytest.raises(ValueError, match=needle):
        e.add_request(call.pop("prompt"), call.pop("max_new_tokens"), **call)
    after = (len(e.waiting), len(e.active), e.free_pages, e.pages.reserved, e.lens.clone(), e.root.clone())
    assert state[:4] == after[:4] and torch.equal(state[4], after[4]) and torch.equal(state[5], after[5])
    res = e.run()
    assert [res[i].tokens for i in ids] == refs


def test_a_request_the_pool_can_never_hold_is_refused(tiny):
    _, args, model = tiny
    e = Engine(model, mode="ar", max_batch=2, max_len=512, max_tokens=128)
    with pytest.raises(ValueError, match=r"need 3 pages, the pool has 2"):
        e.add_request([1] * 100, 60)


def test_pages_grow_all_or_none(tiny):
    """_grow: a request's new pages reach the page table in one write (check_state agrees); a growth beyond
    its reservation raises before taking any page, leaving the pool, the request and the table as they
    were."""
    _, args, model = tiny
    e = Engine(model, mode="ar", max_batch=2, max_len=512, debug=True)
    e.add_request([1, 2, 3], 300)
    e.step()
    (r,) = e.active
    assert r.reserve >= 4 and len(r.pages) == 1
    e.scheduler.grow(r, 3 * e.page_size + 1)   # three more pages at once
    assert len(r.pages) == 4 and e.page_table[r.slot, :4].tolist() == r.pages
    e.check_state()
    state = (list(r.pages), list(e.pages.free), e.pages.reserved, e.page_table.clone())
    with pytest.raises(RuntimeError, match=f"needs page {r.reserve + 1} of a reservation of {r.reserve}"):
        e.scheduler.grow(r, (r.reserve + 2) * e.page_size)
    assert (list(r.pages), list(e.pages.free), e.pages.reserved) == state[:3]
    assert torch.equal(e.page_table, state[3])
    e.run()
    assert e.free_pages == e.pages.capacity


def test_check_state_finds_a_device_state_that_drifted(tiny):
    """debug=True's checker can fail: a length changed behind the engine's back is named."""
    _, args, model = tiny
    e = Engine(model, mode="ar", max_batch=2, max_len=128, debug=True)
    e.add_request([1, 2, 3], 10)
    e.step()
    e.check_state()
    e.lens[0] += 1
    with pytest.raises(RuntimeError, match="request 0 in slot 0: device length"):
        e.check_state()


def test_bad_engine_settings_are_refused(tiny):
    _, args, model = tiny
    d = build_drafter(model, block_size=4)
    for kw, needle in ((dict(mode="beam"), "mode="), (dict(mode="ddtree", drafter=d), "budget="),
                       (dict(mode="ddtree", drafter=d, budget=0), "budget="),
                       (dict(mode="ar", budget=4), "budget"),
                       (dict(mode="dflash"), "drafter: expected a drafter"),
                       (dict(max_batch=0), "max_batch="),
                       (dict(max_len=10**7), "max_len="), (dict(page_size=32), "page_size="),
                       (dict(backend="kernel"), "CUDA"), (dict(buckets=(3,), max_batch=4), "buckets="),
                       (dict(buckets="x"), "buckets="), (dict(moe="sparse"), "moe="),
                       (dict(admission="lazy"), "admission="),
                       (dict(moe="grouped", deterministic=True), "only 'dense' is batch-invariant"),
                       (dict(mode="ddtree", drafter=d, budget=300, max_len=256),
                        "budget: a verify block of 301")):
        with pytest.raises(ValueError, match=needle):
            Engine(model, **kw)


def test_sampling_streams_are_per_request(pair):
    """T > 0: a request's tokens depend on its seed only, not on its batch mates (sampling and greedy ones
    mixed) or the batch size."""
    t, d = pair
    prompts = random_prompts(t.args, 5, seed=6, min_len=8, max_len=30)
    temps = [0.9, 0.0, 0.9, 0.0, 1.3]
    alone = [Engine(t, d, mode="ddtree", budget=16, max_batch=1, max_len=128).generate([p], 16, temperature=T,
                                                                                       seed=50 + i)[0].tokens
             for i, (p, T) in enumerate(zip(prompts, temps))]
    e = Engine(t, d, mode="ddtree", budget=16, max_batch=4, max_len=128)
    ids = [e.add_request(p, 16, temperature=T, seed=50 + i) for i, (p, T) in enumerate(zip(prompts, temps))]
    res = e.run()
    assert [res[i].tokens for i in ids] == alone
    assert alone[1] == oracle_ar(t, prompts[1], 16).tokens and alone[3] == oracle_ar(t, prompts[3], 16).tokens
    again = Engine(t, d, mode="ddtree", budget=16, max_batch=1, max_len=128).generate([prompts[0]], 16,
                                                                                    temperature=0.9, seed=51)
    assert again[0].tokens != alone[0]  # another seed, another stream


def test_gumbel_stream_is_a_pure_function_and_uniform():
    seed, step = torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3])
    g = gumbel(seed, step, 5, 1000)
    assert torch.equal(g, gumbel(seed, step, 5, 1000))
    assert torch.equal(g[0], gumbel(seed[:1], step[:1], 5, 1000)[0])       # independent of batch mates
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    u = torch.exp(-torch.exp(-g)).flatten().numpy()                        # back to uniforms
    hist = np.histogram(u, bins=20, range=(0, 1))[0]
    expect = u.size / 20
    assert ((hist - expect) ** 2 / expect).sum() < 45  # chi-square, 19 df: p ~ 1e-3
    # the checker fails on a biased stream
    biased = np.histogram(u ** 1.1, bins=20, range=(0, 1))[0]
    assert ((biased - expect) ** 2 / expect).sum() > 45


def test_short_soak_pages_return_and_outputs_match(pair):
    """~150 rounds at batch 6 with requests arriving and finishing (CI's version of the GPU soak)."""
    t, d = pair
    prompts = random_prompts(t.args, 24, seed=9, min_len=5, max_len=50)
    lens = [6 + (7 * i) % 25 for i in range(24)]
    refs = [oracle_ar(t, p, n).tokens for p, n in zip(prompts, lens)]
    e = Engine(t, d, mode="ddtree", budget=16, max_batch=6, max_len=128, max_tokens=8 * 128, debug=True)
    outs, _ = _serve(e, prompts, lens, join_every=1)
    assert outs == refs
    assert e.rounds > 40
    assert e.free_pages == e.pages.capacity and e.pages.reserved == 0


def test_a_request_with_non_finite_logits_fails_alone(tiny):
    """Token 7's embedding is NaN: a request whose prompt holds it fails with a clear error at its prefill;
    the requests in flight go on and still equal the oracle (run on a clean copy of the model)."""
    import copy
    _, args, model = tiny
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.model.embed_tokens.weight[7] = float("nan")
    prompts = [p for p in random_prompts(args, 12, seed=21) if 7 not in p][:3]
    refs = [oracle_ar(model, p, 12).tokens for p in prompts]
    assert all(7 not in r for r in refs)
    e = Engine(bad, mode="ar", max_batch=4, max_len=128)
    ids = [e.add_request(p, 12) for p in prompts]
    e.step()
    e.add_request([3, 7, 5], 12)
    with pytest.raises(ValueError, match=r"request 3: target logits: NaN or inf"):
        e.step()
    res = e.run()
    assert [res[i].tokens for i in ids] == refs and 3 not in res
    assert e.free_pages == e.pages.capacity


def test_chunked_prefill_stop_tokens_and_one_token_requests(tiny):
    """Prompts prefilled 7 rows at a time equal one-forward prefill; stop tokens are per request; a request of
    one new token finishes at its prefill and gives its pages back."""
    _, args, model = tiny
    prompts = random_prompts(args, 4, seed=13, min_len=20, max_len=40)
    refs = [oracle_ar(model, p, 16).tokens for p in prompts]
    e = Engine(model, mode="ar", max_batch=4, max_len=128, prefill_chunk=7)
    assert [r.tokens for r in e.generate(prompts, 16)] == refs
    stop = refs[1][5]
    ids = [e.add_request(p, 16, stop_tokens=[stop] if i == 1 else ()) for i, p in enumerate(prompts)]
    one = e.add_request(prompts[0], 1)
    res = e.run()
    assert res[ids[1]].tokens == refs[1][:refs[1].index(stop) + 1]
    assert [res[i].tokens for i in (ids[0], ids[2], ids[3])] == [refs[0], refs[2], refs[3]]
    assert res[one].tokens == refs[0][:1] and res[one].target_forwards == -(-len(prompts[0]) // 7)  # chunks
    assert e.free_pages == e.pages.capacity


def test_prompts_of_one_chunk_length_share_each_prefill_forward(tiny):
    """Admitted together, prompts whose chunks have one length are prefilled by one forward per chunk: the
    outputs equal the oracle's, the drafter's context equals a one-request-at-a-time prefill's (deterministic
    engines prefill each request alone), and the forwards are counted."""
    _, args, model = tiny
    g = np.random.default_rng(21)
    lens = [24, 24, 10, 30]
    prompts = [g.integers(0, args.vocab_size, n).tolist() for n in lens]
    refs = [oracle_ar(model, p, 6).tokens for p in prompts]
    d = build_drafter(model, block_size=4)
    batched = None  # the batched (first, det=False) pass's drafter context, compared in the second pass
    for det, forwards in ((False, 7), (True, 4 + 4 + 2 + 5)):  # chunks of 7: see the groups below
        e = Engine(model, d, mode="ddtree", budget=8, max_batch=4, max_len=128, prefill_chunk=7,
                   deterministic=det, moe="dense", backend="golden")
        ids = [e.add_request(p, 6) for p in prompts]
        e.scheduler.admit({})  # admission and every prefill, no round yet
        assert e.prefill_forwards == forwards, det
        ctx = [t[:4].clone() for t in e.ctx.k + e.ctx.v]
        if det:
            for a, b in zip(ctx, batched):
                for slot, n in enumerate(lens):
                    torch.testing.assert_close(a[slot, :, :n], b[slot, :, :n], rtol=1e-4, atol=1e-5)
        batched = ctx
        res = e.run()
        assert [res[i].tokens for i in ids] == refs


def test_int4_experts_through_the_engine(tiny):
    """Routed experts in the INT4 release format (the CPU reference path) batched through the engine."""
    import copy
    _, args, model = tiny
    q = copy.deepcopy(model).quantize_experts()
    prompts = random_prompts(args, 5, seed=17, min_len=5, max_len=30)
    refs = [oracle_ar(q, p, 12).tokens for p in prompts]
    drafter = MultiOracle({tuple(p): r for p, r in zip(prompts, refs)}, args.vocab_size, 6)
    e = Engine(q, drafter, mode="ddtree", budget=16, max_batch=3, max_len=128)
    outs, _ = _serve(e, prompts, [12] * 5, join_every=2)
    assert outs == refs
    with pytest.raises(ValueError, match="deterministic=True: INT4 experts are not supported"):
        Engine(q, drafter, mode="ddtree", budget=16, max_batch=3, max_len=128, deterministic=True)


def test_padding_slots_do_not_advance(tiny):
    """A bucket of 2 serving one request at a time, for more rounds in all than a request's context holds: the
    padding slot stays at length 0 (it once advanced every round and would index past its page table)."""
    _, args, model = tiny
    e = Engine(model, mode="ar", max_batch=2, max_len=128, buckets=(2,))
    for p in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        e.generate([p], 100)
        assert e.lens.tolist() == [0, 0] and e.rounds % 99 == 0
    assert e.rounds == 3 * 99


def test_requests_ending_together_leave_from_the_highest_slot(pair, monkeypatch):
    """A static batch ending in one round: its requests leave from the highest slot down, so no slot's state
    (page table row, drafter context, pend) is copied into a freed slot; the outputs equal the oracle's."""
    t, d = pair
    prompts = random_prompts(t.args, 4, seed=8, min_len=12, max_len=12)
    e = Engine(t, d, mode="ddtree", budget="auto", max_budget=16, max_batch=4, max_len=256, graphs=False)
    moves, real = [], Scheduler.release

    def spy(self, r):
        moves.append(r.slot != len(self.active) - 1)
        real(self, r)
    monkeypatch.setattr(Scheduler, "release", spy)
    out = [r.tokens for r in e.generate(prompts, 1)]   # every request ends with its prefill's token
    assert out == [oracle_ar(t, p, 1).tokens for p in prompts]
    assert len(moves) == 4 and not any(moves)
    moves.clear()
    e = Engine(t, mode="ar", max_batch=4, max_len=256, graphs=False)
    out = [r.tokens for r in e.generate(prompts, 6)]   # AR: all four end in the same round
    assert out == [oracle_ar(t, p, 6).tokens for p in prompts]
    assert len(moves) == 4 and not any(moves)


def _logit_trace(engine, reqs):
    """Run (prompt, max_new) requests; the verify logits of the first request, round by round (copies)."""
    ids = [engine.add_request(p, n) for p, n in reqs]
    rows = []
    while engine.waiting or engine.active:
        before = engine.rounds
        engine.step()
        if engine.rounds > before and ids[0] in engine.last_round["ids"]:
            rows.append(engine.last_logits[engine.last_round["ids"].index(ids[0])].clone())
    return rows


def _bitwise_equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_deterministic_rounds_are_batch_invariant(pair):
    """deterministic=True: a request's logits, round by round, are bitwise the same alone and beside three
    others (slots and batch size differ); the checker flags a one-ulp change."""
    t, d = pair
    prompts = random_prompts(t.args, 4, seed=21, min_len=6, max_len=40)
    e = Engine(t, d, mode="ddtree", budget=8, max_batch=4, max_len=128, deterministic=True)
    assert e.buckets == (4,)
    alone = _logit_trace(e, [(prompts[0], 20)])
    crowd = _logit_trace(e, [(prompts[0], 20)] + [(p, 8 + 5 * i) for i, p in enumerate(prompts[1:])])
    assert len(alone) > 3 and _bitwise_equal(alone, crowd)
    bumped = [alone[0].clone()] + alone[1:]
    bumped[0][0, 0] = torch.nextafter(bumped[0][0, 0], torch.tensor(float("inf")))
    assert not _bitwise_equal(bumped, crowd)
    with pytest.raises(ValueError, match="deterministic=True runs every round at max_batch"):
        Engine(t, d, mode="ddtree", budget=8, max_batch=4, max_len=128, deterministic=True, buckets=(1, 4))
    with pytest.raises(ValueError, match="deterministic="):
        Engine(t, d, mode="ddtree", budget=8, max_batch=4, max_len=128, deterministic=1)


def test_moe_path_defaults_and_refusals(tiny):
    """The engine's MoE path: the host loop on the CPU, dense when deterministic; bad names refused."""
    from kdtree.engine import moe_path as _moe_path
    _, args, model = tiny
    assert _moe_path(model, None, False) == "loop"
    assert _moe_path(model, None, True) == "dense"
    assert Engine(model, max_batch=2, max_len=64, deterministic=True).moe == "dense"
    for moe in ("loop", "dense"):
        assert _moe_path(model, moe, False) == moe
    with pytest.raises(ValueError, match=r"moe='loop' with deterministic=True"):
        _moe_path(model, "loop", True)
    with pytest.raises(ValueError, match=r"moe=3: expected one of"):
        _moe_path(model, 3, False)


def test_synthetic_context_rows_sit_before_the_root(pair):
    """A request with synthetic_context=C: after its prefill the cache holds C random rows before the root
    (lengths, pages and the device state agree), decoding goes on from position P + C, every page comes
    back; the same prompt without them emits different tokens (the rows are attended to)."""
    t, d = pair
    p = random_prompts(t.args, 1, seed=12, min_len=20, max_len=21)[0]
    e = Engine(t, d, mode="ddtree", budget=8, max_batch=2, max_len=512, debug=True)
    rid = e.add_request(p, 12, synthetic_context=200)
    e.step()
    r = e.active[0]
    assert r.length >= len(p) + 200 and int(e.lens[0]) == r.length and len(r.committed) == r.length + 1
    out = e.run()[rid]
    assert len(out.tokens) == 12 and e.free_pages == e.pages.capacity
    plain = Engine(t, d, mode="ddtree", budget=8, max_batch=2, max_len=512).generate([p], 12)[0]
    assert plain.tokens != out.tokens
    with pytest.raises(ValueError, match="synthetic_context"):
        e.add_request(p, 12, synthetic_context=-1)
    with pytest.raises(ValueError, match="context overflow"):
        e.add_request(p, 12, synthetic_context=500)



def test_simulated_texts_are_left_out_of_prefill(pair, monkeypatch):
    """simulate=: an admission tabulates its requests' texts in one call (`Simulation.write`), timed into
    `synthetic_s`, not prefill_s; a slow write shows it (0.3 s an admission)."""
    import time

    from kdtree.bench.serve import run_engine
    from kdtree.simulate import Profile, Simulation
    t, _ = pair
    prompts = random_prompts(t.args, 3, seed=5, min_len=6, max_len=9)
    e = Engine(t, None, mode="ar", max_batch=3, max_len=128, simulate=Profile(2.0, depth=7, K=16))
    run_engine(e, prompts, 3)   # warm
    write, calls = Simulation.write, []
    monkeypatch.setattr(Simulation, "write", lambda self, slot, seed: (
        calls.append(list(slot)), time.sleep(0.3), write(self, slot, seed)))
    t0 = time.perf_counter()
    r = run_engine(e, prompts, 3)
    outside = time.perf_counter() - t0
    assert calls == [[0, 1, 2]] and r["synthetic_s"] >= 0.3 and r["prefill_s"] < 0.3
    assert outside - r["wall_s"] >= 0.3 and len(r["outputs"]) == 3


def test_prefill_phases_split_an_admissions_prefill(pair, monkeypatch):
    """prefill_phases (a dict): an admission's prefill seconds by phase, which sum to its prefill_s (the
    synthetic fill, made slow here, left out of both); the AR engine has no drafter phase; off (None) nothing
    is recorded."""
    import time
    fill = Prefill.synthesize
    monkeypatch.setattr(Prefill, "synthesize", lambda self, r: (time.sleep(0.1), fill(self, r)))
    t, d = pair
    prompts = random_prompts(t.args, 2, seed=3, min_len=10, max_len=14)
    for mode, drafter in (("ddtree", d), ("ar", None)):
        e = Engine(t, drafter, mode=mode, max_batch=2, max_len=256, **({"budget": 4} if drafter else {}))
        e.generate(prompts, 2)   # warm
        e.prefill_phases = {}
        p0 = e.prefill_s
        for p in prompts:
            e.add_request(p, 2, synthetic_context=40)
        e.step()
        ph, spent = e.prefill_phases, e.prefill_s - p0
        want = {"pages", "forward", "first", "requests", "release"} | ({"drafter"} if drafter else set())
        assert set(ph) == want and all(v >= 0 for v in ph.values()), (mode, ph)
        assert sum(ph.values()) == pytest.approx(spent, rel=0.05, abs=2e-3), (mode, ph, spent)
        e.prefill_phases = None
        e.run()
        e.generate(prompts, 2)
        assert e.prefill_phases is None


def test_synthetic_fill_is_left_out_of_prefill_and_the_run_wall(pair, monkeypatch):
    """The synthetic rows' fill (a benchmark device) is timed alone into `synthetic_s`: not in prefill_s,
    the request's prefill stage time, or run_engine's wall; a slow fill shows it (0.3 s a request)."""
    import time

    from kdtree.bench.serve import run_engine
    t, d = pair
    prompts = random_prompts(t.args, 2, seed=13, min_len=12, max_len=13)
    e = Engine(t, d, mode="ddtree", budget=8, max_batch=2, max_len=512)
    run_engine(e, prompts, 4, synthetic_context=100)   # warm
    fill = Prefill.synthesize
    monkeypatch.setattr(Prefill, "synthesize", lambda self, r: (time.sleep(0.3), fill(self, r)))
    p0 = e.prefill_s
    t0 = time.perf_counter()
    r = run_engine(e, prompts, 4, synthetic_context=100)
    outside = time.perf_counter() - t0
    assert r["synthetic_s"] >= 0.6 and e.synthetic_s >= 0.6
    assert outside - r["wall_s"] >= 0.6 and r["prefill_s"] < outside - 0.6
    assert e.prefill_s - p0 == pytest.approx(r["prefill_s"])
    last = list(e.finished.values())[-2:]   # this run's requests
    assert all(x.stage_times["prefill"] < 0.3 and x.wall_time < outside - 0.6 for x in last)

@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_overlapped_serving_equals_the_oracle_with_tight_pages(pair, mode):
    """Requests joining between overlapped steps (step(overlap=True), run()'s schedule) in a pool that makes
    them wait for pages: most steps leave a round in flight, every output equals the oracle, every page
    comes back. The launched round's pages must cover the round in flight's rows too: growing them for one
    round only fails it (AR: the root's row at each page boundary lands in the scratch page)."""
    t, d = pair
    prompts = random_prompts(t.args, 14, seed=17, min_len=5, max_len=40)
    lens = [5 + (11 * i) % 30 if mode == "ddtree" else 60 + (13 * i) % 50 for i in range(14)]
    refs = [oracle_ar(t, p, n).tokens for p, n in zip(prompts, lens)]
    e = Engine(t, None if mode == "ar" else d, mode=mode, budget=16 if mode == "ddtree" else None,
               max_batch=4, max_len=128, max_tokens=4 * 128)
    assert e.overlap
    ids, flying, steps = [], 0, 0
    for i, (p, n) in enumerate(zip(prompts, lens)):
        ids.append(e.add_request(p, n))
        if i % 2:
            e.step(overlap=True)
            flying += e.in_flight
            steps += 1
    while e.waiting or e.active or e.in_flight:
        e.step(overlap=True)
        flying += e.in_flight
        steps += 1
    res = e.run()
    assert [res[i].tokens for i in ids] == refs
    assert flying > steps // 2 and not e.in_flight
    assert e.free_pages == e.pages.capacity and e.pages.reserved == 0


def test_run_engine_full_batch_rounds_of_a_static_batch_and_of_a_queue(pair):
    """AR's static batch has every round full (its requests end together); a queue of twice max_batch keeps
    the batch full while requests wait, then drains: its full rounds are fewer than its rounds; the whole
    run's tokens are every request's; a lone request's rounds are never full, with rounds overlapped or
    not (its admission step begins with it waiting, behind no active request)."""
    from kdtree.bench.serve import run_engine
    t, d = pair
    prompts = random_prompts(t.args, 4, seed=14, min_len=8, max_len=12)
    ar = run_engine(Engine(t, None, mode="ar", max_batch=2, max_len=256), prompts[:2], 6)
    assert ar["full_rounds"] == ar["rounds"] == 5 and ar["full_tok_per_s"] > 0
    e = Engine(t, d, mode="ddtree", budget=8, max_batch=2, max_len=256)
    q = run_engine(e, prompts, 10)
    assert q["tokens"] == 40 and 0 < q["full_rounds"] < q["rounds"]
    for overlap in (True, False):   # the first step's admission: requests wait, none is active yet
        e1 = Engine(t, None, mode="ar", max_batch=2, max_len=256, overlap=overlap)
        one = run_engine(e1, prompts[:1], 6)
        assert one["full_rounds"] == 0 and one["full_tok_per_s"] is None   # one request never fills 2 slots


def test_grouped_admission_waits_while_the_idle_slots_cost_less_than_an_admission(pair):
    """The rule (`Scheduler.due`): "eager" admits whenever a slot is free; "grouped" admits at once with no
    request active, when every waiting request has a slot, before any admission is timed, or in a
    deterministic engine, else once the idle slots' seconds reach the fitted fixed cost of an admission
    (one size timed: its median bounds it; refitted when an admission is added)."""
    t, _ = pair
    e = Engine(t, None, mode="ar", max_batch=4, max_len=128, admission="grouped")
    e.scheduler.active, e.scheduler.waiting = [object()] * 2, [object()] * 5
    assert e.scheduler.due() and e.admit_cost() is None                     # nothing timed yet
    e.scheduler.admits = [(10, 1.0), (10, 1.2), (10, 1.4)]
    # one size: its median bounds it
    assert e.admit_cost() == pytest.approx((1.2, 0.0)) and not e.scheduler.due()
    e.scheduler.rent = 1.2
    assert e.scheduler.due()
    # 0.5 s fixed + 0.05 s a row
    e.scheduler.admits, e.scheduler.fit = [(10, 1.0), (20, 1.5), (40, 2.5)], None
    assert e.admit_cost() == pytest.approx((0.5, 0.05))
    e.scheduler.rent = 0.49
    assert not e.scheduler.due()
    e.scheduler.rent = 0.501
    assert e.scheduler.due()
    e.scheduler.rent, e.scheduler.waiting = 0.0, [object()] * 2   # every waiting request has a slot
    assert e.scheduler.due()
    e.scheduler.bill(1, 0.02)   # 3 of 4 slots idle: 3/4 of the round, not 3 live-row rounds
    e.scheduler.bill(3, 0.02)
    e.scheduler.bill(4, 0.02)
    assert e.scheduler.rent == pytest.approx(0.015 + 0.005)
    # nothing active to wait for
    e.scheduler.rent, e.scheduler.waiting, e.scheduler.active = 0.0, [object()] * 5, []
    assert e.scheduler.due()
    e.scheduler.active, e.deterministic = [object()] * 2, True              # each request prefills alone
    assert e.scheduler.due()
    e.deterministic, e.scheduler.admission = False, "eager"
    assert e.scheduler.due()
    e.scheduler.active, e.scheduler.waiting = [], []


def test_grouped_admission_serves_every_request_as_the_oracle_in_fewer_admissions(pair, monkeypatch):
    """A queue of requests of uneven lengths: with an admission's fixed cost beyond any wait (the fit
    patched), a grouped engine admits only when its batch has emptied or every waiting request has a slot;
    its outputs equal the oracle's, in fewer admissions than the eager engine's; the idle slots' rent
    accrues while requests wait and restarts at each admission. With a fixed cost of a nanosecond it admits
    mid-batch, once a round's idle slots have billed it. Unpatched, each clean admission is timed and fits a
    cost; an admission whose request failed is left out of the fit."""
    from kdtree.bench.serve import run_engine
    t, d = pair
    prompts = random_prompts(t.args, 10, seed=21, min_len=5, max_len=30)
    lens = [6 + (7 * i) % 19 for i in range(10)]
    refs = [oracle_ar(t, p, n).tokens for p, n in zip(prompts, lens)]
    got = {}
    for admission in ("eager", "grouped"):
        e = Engine(t, d, mode="ddtree", budget=8, max_batch=4, max_len=128, admission=admission)
        if admission == "grouped":
            monkeypatch.setattr(e.scheduler, "admit_cost", lambda: (1e9, 0.0))
            seen = []
            admit = e.scheduler.admit

            def spy(emitted, admit=admit, e=e):
                if e.waiting and e.max_batch > len(e.active):
                    seen.append((len(e.active), len(e.waiting), e.scheduler.rent))
                admit(emitted)
                assert e.scheduler.rent == 0.0 or not seen     # an admission restarts the rent
            monkeypatch.setattr(e.scheduler, "admit", spy)
        ids = [e.add_request(p, n) for p, n in zip(prompts, lens)]
        res = e.run()
        assert [res[i].tokens for i in ids] == refs, admission
        got[admission] = e.admissions
    assert got["grouped"] < got["eager"]
    for active, waiting, rent in seen:
        assert active == 0 or 4 - active >= waiting
    assert any(rent > 0 for _, _, rent in seen[1:])                # rounds ran with idle slots, waiting
    e = Engine(t, d, mode="ddtree", budget=8, max_batch=4, max_len=128, admission="grouped")
    monkeypatch.setattr(e.scheduler, "admit_cost", lambda: (1e-9, 0.0))
    mid = []
    admit = e.scheduler.admit

    def spy2(emitted, admit=admit, e=e):
        if e.active and e.waiting and 4 - len(e.active) < len(e.waiting):
            mid.append(e.scheduler.rent)
        admit(emitted)
    monkeypatch.setattr(e.scheduler, "admit", spy2)
    ids = [e.add_request(p, n) for p, n in zip(prompts, lens)]
    res = e.run()
    assert [res[i].tokens for i in ids] == refs
    assert mid and all(r >= 1e-9 for r in mid)                    # admitted mid-batch, the rent billed
    e = Engine(t, d, mode="ddtree", budget=8, max_batch=4, max_len=128, admission="grouped")
    q = run_engine(e, prompts, 12)
    assert q["admissions"] == e.admissions >= 2 and 2 <= len(e.scheduler.admits) <= q["admissions"]
    assert q["admit_cost"] == list(e.admit_cost()) and min(q["admit_cost"]) >= 0
    assert all(len(a) == 4 and a[0] >= 1 and a[3] is False for a in q["admitted"])   # no graphs here
    grow = e.scheduler.grow

    def fail(r, rows):
        if r.prompt == [3, 5, 7]:
            raise RuntimeError("no page")
        grow(r, rows)
    monkeypatch.setattr(e.scheduler, "grow", fail)
    n0 = len(e.scheduler.admits)
    bad = e.add_request([3, 5, 7], 4)
    with pytest.raises(ValueError, match="no page"):
        e.run()
    assert e.admissions == q["admissions"] + 1 and len(e.scheduler.admits) == n0 and bad not in e.finished


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_all_finite_flags_every_row_with_a_nan_or_an_infinity(device):
    """`round_ops.all_finite` (one reduction over the vocabulary) equals isfinite().all(-1) on rows with a
    NaN, +inf or -inf at random places, one or several, among finite rows (can fail: a check of the maximum
    alone misses the -inf rows)."""
    from kdtree.round_ops import all_finite
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 9, 4099, generator=g) * 30
    bad = [float("nan"), float("inf"), float("-inf")]
    for k in range(20):
        i, j, v = (int(torch.randint(n, (1,), generator=g)) for n in (6, 9, 4099))
        x[i, j, v] = bad[k % 3]
    x = x.to(device)
    want = torch.isfinite(x).all(-1)
    assert 0 < int(want.sum()) < want.numel()
    assert torch.equal(all_finite(x), want)
    assert not torch.equal(torch.isfinite(x.amax(-1)), want)   # the maximum alone misses the -inf rows
