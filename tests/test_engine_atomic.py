"""The engine's public calls are atomic: a refused call queues nothing, generate() hands back only its own
requests, every request argument is checked to what the round can compute, and a request whose admission
fails leaves whole (CPU, tiny models)."""
import pytest
import torch

from kdtree.drafter import OracleDrafter
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


def test_add_request_takes_stop_tokens_as_a_prompt_is_taken(tiny):
    import numpy as np
    _, args, model = tiny
    p = random_prompts(args, 1, seed=4)[0]
    ref = oracle_ar(model, p, 8).tokens
    e = _engine(model)
    ids = [e.add_request(p, 8, stop_tokens=s) for s in (torch.tensor([ref[2]]), np.array([ref[2]]),
                                                        torch.tensor([[ref[2]]]), (ref[2],))]
    res = e.run()
    assert [res[i].tokens for i in ids] == [ref[:ref.index(ref[2]) + 1]] * 4
    with pytest.raises(ValueError, match=r"stop_tokens=tensor\(\[3\.\]\): expected token ids"):
        e.add_request(p, 8, stop_tokens=torch.tensor([3.0]))
    assert not e.waiting


@pytest.mark.parametrize("call,needle", [
    (lambda e: e.step(overlap="no"), "overlap='no': expected True or False"),
    (lambda e: e.run(progress="no"), "progress='no': expected True or False"),
    (lambda e: e.bucket(5), r"n=5: expected an int in \[1, 4\]"),
    (lambda e: e.bucket("2"), r"n='2': expected an int in \[1, 4\]")])
def test_step_run_and_bucket_check_their_arguments_before_any_work(tiny, call, needle):
    _, _, model = tiny
    e = _engine(model)
    rid = e.add_request([1, 2, 3], 4)
    with pytest.raises(ValueError, match=needle):
        call(e)
    assert [r.rid for r in e.waiting] == [rid] and not e.active   # nothing admitted or run


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


# ----------------------------------------------------------------------------- a failed admission
def _prompts(args):
    """Three prompts of distinct lengths (each its own prefill chunk group)."""
    ps = random_prompts(args, 3, seed=9, min_len=6, max_len=20)
    return [p[:n] for p, n in zip(ps, (5, 8, 11))]


def _fail_once(monkeypatch, obj, name, bad: int, pick):
    """obj.name raises RuntimeError("boom ...") once, on the call where pick(*args) names request `bad`."""
    orig, left = getattr(obj, name), [1]

    def patched(*a, **kw):
        if left[0] and pick(*a) == bad:
            left[0] = 0
            raise RuntimeError(f"boom in {name}")
        return orig(*a, **kw)
    monkeypatch.setattr(obj, name, patched)


def _pool_consistent(e):
    """Every page is free or held by an active request; the reservation is the active requests' rest."""
    held = sum(len(r.pages) for r in e.active)
    assert e.free_pages + held == e.pages.capacity
    assert e.pages.reserved == sum(r.reserve - len(r.pages) for r in e.active)


class _Oracles:
    """A host drafter (sessions): each session drafts its prompt's reference continuation (OracleDrafter);
    the session of prompt `fail` raises at its start, once."""

    def __init__(self, refs: dict, vocab_size: int, fail=None):
        self.refs, self.vocab_size, self.block_size, self.fail = refs, vocab_size, 4, fail

    def session(self, max_len):
        outer = self

        class _Session:
            def start(self, prompt, features=None):
                if list(prompt) == outer.fail:
                    outer.fail = None
                    raise RuntimeError("boom in session")
                self.o = OracleDrafter(list(prompt) + outer.refs[tuple(prompt)], outer.vocab_size, 4)

            def propose(self, committed):
                return self.o.propose(committed)

            def accept(self, features=None):
                pass
        return _Session()


@pytest.mark.parametrize("where", ["grow", "chunk", "session"])   # its pages, its forward, its drafter
def test_a_request_whose_admission_fails_leaves_whole(tiny, monkeypatch, where):
    """A request whose admission fails (at its pages, its prompt's forward, its drafter session) is refused
    to the caller, gives its pages back and never comes out of run(); the others' tokens are unchanged."""
    _, args, model = tiny
    ps = _prompts(args)
    refs = [oracle_ar(model, p, 6).tokens for p in ps]
    if where == "session":
        drafter = _Oracles({tuple(p): r for p, r in zip(ps, refs)}, args.vocab_size, fail=ps[1])
        e = Engine(model, drafter, mode="ddtree", budget=4, max_batch=4, max_len=128, debug=True)
    else:
        e = _engine(model, debug=True)
    free0 = e.free_pages
    ids = [e.add_request(p, 6) for p in ps]
    bad = ids[1]
    if where != "session":
        obj, pick = ((e.scheduler, lambda r, rows: r.rid) if where == "grow"
                     else (e.prefill, lambda group, *a: group[0].rid))
        _fail_once(monkeypatch, obj, where, bad, pick)
    with pytest.raises(ValueError, match=rf"^request {bad}: boom in {where}$"):
        e.run()
    assert bad not in [r.rid for r in e.waiting + e.active]
    _pool_consistent(e)
    res = e.run()
    assert sorted(res) == [ids[0], ids[2]]
    assert [res[ids[0]].tokens, res[ids[2]].tokens] == [refs[0], refs[2]]
    assert e.free_pages == free0 and e.pages.reserved == 0
    later = e.add_request(ps[1], 6)
    res = e.run()
    assert list(res) == [later] and res[later].tokens == refs[1]   # the failed one never comes out


def _one_running_two_joining(tiny):
    """An engine with one request admitted and two more waiting to join: (engine, the three requests'
    reference tokens, the first's id, the two later ids)."""
    _, args, model = tiny
    ps = _prompts(args)
    refs = [oracle_ar(model, p, 8).tokens for p in ps]
    e = _engine(model, debug=True)
    first = e.add_request(ps[0], 8)
    e.step()
    return e, refs, first, [e.add_request(p, 8) for p in ps[1:]]


def test_a_failed_first_token_choice_fails_only_the_requests_in_it(tiny, monkeypatch):
    """The first tokens of one admission come from one batched choice: when it fails, every request of that
    admission leaves; a request admitted earlier goes on unchanged."""
    from kdtree.engine import prefill
    e, refs, first, late = _one_running_two_joining(tiny)
    _fail_once(monkeypatch, prefill, "choose", None, lambda *a: None)
    with pytest.raises(ValueError, match=rf"^requests {late[0]}, {late[1]}: boom in choose$"):
        e.step()
    assert [r.rid for r in e.active] == [first] and not e.waiting
    _pool_consistent(e)
    res = e.run()
    assert list(res) == [first] and res[first].tokens == refs[0]
    assert e.free_pages == e.pages.capacity and e.pages.reserved == 0


def test_a_failure_past_the_requests_own_steps_removes_every_joining_request(tiny, monkeypatch):
    """An error the prefill does not attribute to one request (here its last phase mark) leaves no request
    half-admitted: those joining leave with it, those already active go on."""
    e, refs, first, late = _one_running_two_joining(tiny)
    e.prefill_phases = {}
    _fail_once(monkeypatch, e.prefill, "mark", "requests", lambda phase: phase)
    with pytest.raises(ValueError, match=rf"^requests {late[0]}, {late[1]}: boom in mark$"):
        e.step()
    e.prefill_phases = None
    assert [r.rid for r in e.active] == [first] and not e.waiting
    _pool_consistent(e)
    res = e.run()
    assert list(res) == [first] and res[first].tokens == refs[0]
    assert e.free_pages == e.pages.capacity


@pytest.mark.parametrize("where", ["grow", "chunk"])
def test_generate_that_fails_leaves_none_of_its_requests(tiny, monkeypatch, where):
    """generate() whose run raises (one of its requests failed admission) takes every request of its own out
    (the waiting, the active and the finished: none comes out of a later run()); a request queued earlier
    with add_request goes on to its reference tokens."""
    _, args, model = tiny
    ps = _prompts(args)
    refs = [oracle_ar(model, p, 6).tokens for p in ps]
    e = _engine(model, debug=True)
    free0 = e.free_pages
    first = e.add_request(ps[0], 6)
    e.step()
    bad = first + 2                                   # generate's second request
    obj, pick = ((e.scheduler, lambda r, rows: r.rid) if where == "grow"
                 else (e.prefill, lambda group, *a: group[0].rid))
    _fail_once(monkeypatch, obj, where, bad, pick)
    with pytest.raises(ValueError, match=rf"^request {bad}: boom in {where}$"):
        e.generate([ps[1], ps[2]], 6)
    assert [r.rid for r in e.waiting + e.active] in ([first], [])
    _pool_consistent(e)
    res = e.run()
    assert list(res) == [first] and res[first].tokens == refs[0]
    assert e.free_pages == free0 and e.pages.reserved == 0
    assert e.generate([ps[1], ps[2]], 6)[1].tokens == refs[2]   # the engine serves the same call afterwards
