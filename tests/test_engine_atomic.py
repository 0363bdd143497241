"""The engine's public calls are atomic: a refused call queues nothing, generate() hands back only its own
requests, and every request argument is checked to what the round can compute (CPU, tiny models)."""
import pytest
import torch

from kdtree.engine import Engine
from kdtree.oracle import oracle_ar
from kdtree.validate import random_prompts


def _engine(model, **kw):
    return Engine(model, mode="ar", max_batch=4, max_len=128, **kw)


@pytest.mark.parametrize("prompt", [{1: 0, 2: 0, 3: 0}, {3, 1, 2}, (t for t in [1, 2, 3]), "123", 12])
def test_unordered_or_one_pass_prompts_are_refused(tiny, prompt):
    _, _, model = tiny
    e = _engine(model)
    with pytest.raises(ValueError, match="prompt: expected an ordered sequence of integer token ids"):
        e.add_request(prompt, 4)
    assert not e.waiting


def test_generate_returns_its_own_requests_and_leaves_the_others_for_run(tiny):
    _, args, model = tiny
    p0, p1 = random_prompts(args, 2, seed=3)
    e = _engine(model)
    rid = e.add_request(p0, 6)
    out = e.generate([p1], 5)
    assert [r.tokens for r in out] == [oracle_ar(model, p1, 5).tokens]
    res = e.run()
    assert list(res) == [rid] and res[rid].tokens == oracle_ar(model, p0, 6).tokens
    rid = e.add_request(p0, 3)
    assert e.generate([], 4) == [] and e.run()[rid].tokens == oracle_ar(model, p0, 3).tokens


@pytest.mark.parametrize("bad,needle", [([1, 2, 10**9], r"prompts\[1\]: expected token ids in"),
                                        ([], r"prompts\[1\]: expected at least one token"),
                                        (None, r"prompts\[1\]: expected an ordered sequence")])
def test_generate_checks_every_prompt_before_queuing_any(tiny, bad, needle):
    _, args, model = tiny
    e = _engine(model)
    with pytest.raises(ValueError, match=needle):
        e.generate([[1, 2, 3], bad], 4)
    assert not e.waiting and not e.active and e.run() == {}


def test_generate_refuses_a_seed_that_overflows_on_a_later_request(tiny):
    _, _, model = tiny
    e = _engine(model)
    with pytest.raises(ValueError, match="seed="):
        e.generate([[1, 2], [3, 4]], 4, seed=2**63 - 1)
    assert not e.waiting
    with pytest.raises(ValueError, match="prompts: expected a list of prompts"):
        e.generate(None, 4)


@pytest.mark.parametrize("kw,needle", [(dict(temperature=1e39), r"temperature=1e\+39: expected a finite"),
                                       (dict(stop_tokens=[5000]), r"stop_tokens=\[5000\]"),
                                       (dict(stop_tokens={1: 2}), "stop_tokens=")])
def test_request_arguments_are_checked_to_what_the_round_computes(tiny, kw, needle):
    _, _, model = tiny
    e = _engine(model)
    with pytest.raises(ValueError, match=needle):
        e.add_request([1, 2, 3], 4, **kw)
    assert not e.waiting


def test_stop_tokens_take_tensors_and_sets(tiny):
    _, args, model = tiny
    p = random_prompts(args, 1, seed=4)[0]
    ref = oracle_ar(model, p, 8).tokens
    e = _engine(model)
    a = e.generate([p], 8, stop_tokens=torch.tensor([ref[2]]))[0].tokens
    b = e.generate([p], 8, stop_tokens={ref[2]})[0].tokens
    assert a == b == ref[:ref.index(ref[2]) + 1]


def test_max_len_bounds_a_request_not_its_page_rounding(tiny):
    _, _, model = tiny
    e = Engine(model, mode="ar", max_batch=2, max_len=16)
    with pytest.raises(ValueError, match=r"= 30 > the engine's max_len \(16\)"):
        e.add_request([1] * 10, 20)
    e.add_request([1] * 10, 6)
    assert len(e.waiting) == 1


def test_a_drafter_must_be_attached_to_the_target_it_serves():
    from kdtree.config import TINY_A
    from kdtree.drafter import build_drafter
    from kdtree.model import build_model
    a, b = build_model(TINY_A, seed=1), build_model(TINY_A, seed=2)   # the same shapes, other weights
    d = build_drafter(a, block_size=4)
    with pytest.raises(ValueError, match="drafter: attached to another target"):
        Engine(b, d, mode="dflash", max_batch=1, max_len=64)
    Engine(a, d, mode="dflash", max_batch=1, max_len=64)


@pytest.mark.parametrize("kw,needle", [(dict(block_size=0), "block_size=0: expected an int >= 2"),
                                       (dict(block_size=1), "block_size=1"),
                                       (dict(k=-1), "k=-1"), (dict(miss=1.5), "miss=1.5"),
                                       (dict(vocab_size=0), "vocab_size=0"),
                                       (dict(reference={1, 2}), "reference: expected an ordered sequence")])
def test_the_oracle_drafter_checks_its_arguments(kw, needle):
    from kdtree.drafter import OracleDrafter
    args = dict(reference=[1, 2, 3], vocab_size=100) | kw
    with pytest.raises(ValueError, match=needle):
        OracleDrafter(**args)
