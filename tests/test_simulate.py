"""Simulated acceptance (kdtree.simulate): accept lengths follow the profile whatever the weights, seeded and
per request; the profile's draft is its own calibration (the engine's expected tokens are the profile's)."""
import numpy as np
import pytest
import torch

from kdtree import project
from kdtree.config import TINY_B
from kdtree.drafter import build_drafter
from kdtree.engine import Engine
from kdtree.model import build_model
from kdtree.round_ops import uniforms
from kdtree.simulate import Profile
from kdtree.validate import random_prompts


@pytest.fixture(scope="module")
def pair():
    t = build_model(TINY_B, seed=3)
    return t, build_drafter(t, seed=4, block_size=8)


def _taus(engine, prompts, n):
    res = engine.generate(prompts, n)
    return np.array([a for r in res for a in r.accept_lengths]), res


@pytest.mark.parametrize("mode,budget,tau_chain", [("dflash", None, 3.0), ("ddtree", 16, 3.0),
                                                   ("ddtree", 48, 5.0)])
def test_accept_lengths_follow_the_profile(pair, mode, budget, tau_chain):
    """Mean accept length over 500-1,500 rounds of random weights within 4 standard errors of the profile's
    expectation (chain: 1 + p + ... + p^L; tree: project.profile_taus); a profile twice as good fails it."""
    t, d = pair
    prof = Profile(tau_chain, depth=7, K=64)
    e = Engine(t, d, mode=mode, budget=budget, max_batch=8, max_len=512, simulate=prof)
    assert e.simulated.startswith("simulated: chain tau")
    acc, _ = _taus(e, random_prompts(t.args, 8, seed=1, min_len=4, max_len=12), 400)
    p = project.chain_top1(tau_chain, 7)
    want = (sum(p ** k for k in range(8)) if mode == "dflash" else
            project.profile_taus(tau_chain, [budget], 7)[budget])
    se = acc.std() / np.sqrt(len(acc))
    assert len(acc) > 500 and abs(acc.mean() - want) < 4 * se + 0.02, (acc.mean(), want, se)
    better = project.profile_taus(min(2 * tau_chain, 7.5), [budget], 7)[budget] if mode != "dflash" else \
        sum(project.chain_top1(2 * tau_chain, 7) ** k for k in range(8))
    assert abs(acc.mean() - better) > 4 * se + 0.02   # the check can fail


def test_simulated_runs_are_seeded_and_per_request(pair):
    """The same seeds give the same accept lengths; a request's lengths do not depend on its batch mates."""
    t, d = pair
    prof = Profile(4.0, depth=7, K=64)
    prompts = random_prompts(t.args, 3, seed=2, min_len=4, max_len=10)

    def lengths(batch, ps, seed):
        e = Engine(t, d, mode="ddtree", budget=16, max_batch=batch, max_len=256, simulate=prof)
        return [r.accept_lengths for r in e.generate(ps, 40, seed=seed)]
    a = lengths(3, prompts, 0)
    assert a == lengths(3, prompts, 0)
    assert lengths(1, prompts[:1], 0)[0] == a[0]
    assert lengths(3, prompts, 7) != a


def test_auto_on_a_profile_uses_its_probabilities(pair):
    """budget="auto" with a profile: no calibration table (the profile is its own truth); the mean estimate of
    the smallest tree (built every drafting round) equals profile_taus within 3 %."""
    t, d = pair
    prof = Profile(4.0, depth=7, K=64)
    e = Engine(t, d, mode="ddtree", budget="auto", budgets=(4, 16, 64), max_batch=2, max_len=512,
               decide="sync", simulate=prof)
    assert e.calibration is None
    rows = []
    take = e.policy.ests.take
    e.policy.ests.take = lambda reqs, r, at: (rows.append(r.copy()), take(reqs, r, at))
    e.generate(random_prompts(t.args, 2, seed=3, min_len=4, max_len=10), 60)
    m = np.concatenate(rows).mean(0)
    want = project.profile_taus(4.0, [4, 16, 64], 7)
    built = [i for i, p in enumerate(e.plans) if p.kind == "tree" and p.nodes == 4]
    assert abs(m[built[0]] - want[4]) / want[4] < 0.03


def test_draws_are_per_position_common_to_every_plan():
    """The simulated text keys each true token by the request's output position, not by the round or depth:
    a round rooted one position later reads the same tokens one depth earlier (so the chain, every tree and
    AR meet the same text); the checker fails on a shift of two. A slot's table (`write`, read by `truth`
    and `draft`) equals the text's pure function; a round's draft at depth d lists the candidates of its
    position, and `move` carries a slot's text."""
    from kdtree.simulate import Simulation
    prof = Profile(4.0, depth=7, K=64)
    sim = Simulation(prof, 1000, 7, 4, "cpu", length=600)
    seed, s = torch.tensor([3, 9, 2**40 + 1, 77]), torch.randint(0, 500, (4,))
    for slot, sd in enumerate(seed.tolist()):
        sim.write(slot, sd)
    one = (sim.text.clone(), sim.base.clone())
    sim.text.fill_(-1)
    sim.base.fill_(-1)
    sim.write([3, 0, 2, 1], [seed[3].item(), seed[0].item(), seed[2].item(), seed[1].item()])  # one pass
    assert torch.equal(sim.text, one[0]) and torch.equal(sim.base, one[1])
    for args, msg in ((([0, 1], [5]), "2 slots for 1 seeds"), (([0, 0], [5, 6]), "distinct slots"),
                      (([4], [5]), "distinct slots in"), ((["a"], [5]), "expected two ints"),
                      (([0, 1], 5), "expected two ints")):
        with pytest.raises(ValueError, match=msg):
            sim.write(*args)
    assert torch.equal(sim.text, one[0])   # a rejected write leaves the texts as they were
    a, b2, c = (sim.truth(s + k, 8) for k in range(3))
    assert torch.equal(a[:, 1:], b2[:, :-1])
    assert not torch.equal(a[:, 1:], c[:, :-1])      # the check can fail
    pos = s[:, None] + torch.arange(1, 9)
    assert torch.equal(a, sim.tokens(seed, pos))     # the table is the text
    r = sim.ranks(seed, pos)
    assert (r == 0).float().mean() > 0.3 and (r > 0).any()   # both ranks occur: not a constant stream
    ids = sim.ids(seed, pos)                                                             # [4, 8, K]
    listed = ids.gather(2, r.clamp(max=prof.K - 1)[..., None])[..., 0]   # the true token: the rank's id
    assert torch.equal(a, torch.where(r < prof.K, listed, sim.none))
    assert all(len(set(row.tolist())) == prof.K for row in ids.view(-1, prof.K))   # distinct per position
    assert len(set(ids[:, :, 0].reshape(-1).tolist())) > 16   # rank 0's token: by position and request
    d = sim.draft(s)                                                                     # [4, 7, V]
    top = d.argsort(-1, descending=True)[..., :prof.K]
    assert torch.equal(top, ids[:, :7])   # depth d's candidates (positions s + 1 ...) in rank order
    d2 = sim.draft(s + 5)                 # the buffer is rewritten: no entry of the previous draft remains
    assert torch.equal(d2.argsort(-1, descending=True)[..., :prof.K], sim.ids(seed, pos + 5)[:, :7])
    assert int((d2 > sim.background).sum()) == 4 * 7 * prof.K
    sim.move(3, 0)
    assert torch.equal(sim.truth(s, 8)[0], sim.tokens(seed[3:], s[:1, None] + torch.arange(1, 9))[0])


@pytest.mark.parametrize("mode,budget", [("dflash", None), ("ddtree", 16), ("ddtree", "auto")])
def test_every_mode_emits_the_simulated_text(pair, mode, budget):
    """Under one profile AR, the chain, a tree and budget="auto" emit the same tokens per request (the text
    is keyed by seed and position), while their accept lengths differ; another seed gives another text."""
    t, d = pair
    prof = Profile(4.0, depth=7, K=64)
    prompts = random_prompts(t.args, 3, seed=5, min_len=4, max_len=10)
    ar = Engine(t, mode="ar", max_batch=3, max_len=256, simulate=prof).generate(prompts, 40, seed=11)
    kw = dict(budgets=(4, 16)) if budget == "auto" else {}
    e = Engine(t, d, mode=mode, budget=budget, max_batch=3, max_len=256, simulate=prof, **kw)
    got = e.generate(prompts, 40, seed=11)
    assert [r.tokens for r in got] == [r.tokens for r in ar]
    assert max(max(r.accept_lengths) for r in got) > 1 and all(set(r.accept_lengths) == {1} for r in ar)
    other = e.generate(prompts, 40, seed=12)
    assert [r.tokens for r in other] != [r.tokens for r in ar]   # the check can fail


def test_uniform_streams_are_pure_and_uniform():
    s, st = torch.tensor([1, 2, 2**40]), torch.tensor([0, 5, 5])
    u = uniforms(s, st, 4096, salt=3)
    assert torch.equal(u, uniforms(s, st, 4096, salt=3)) and not torch.equal(u, uniforms(s, st, 4096, salt=4))
    assert (u > 0).all() and (u < 1).all() and abs(float(u.mean()) - 0.5) < 0.02


@pytest.mark.parametrize("kw,needle", [
    (dict(tau_chain=9.0, depth=7), "tau_chain"), (dict(tau_chain=0.5, depth=7), "tau_chain"),
    (dict(tau_chain=3.0, depth=0), "depth"), (dict(tau_chain=3.0, depth=7, ratio=1.0), "ratio"),
    (dict(tau_chain=3.0, depth=7, K=0), "K")])
def test_bad_profiles_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):
        Profile(**kw)


def test_simulate_needs_a_batched_drafter_and_a_matching_depth(pair):
    t, d = pair
    Engine(t, mode="ar", simulate=Profile(3.0, 7, K=64), max_len=128)   # AR: any depth
    with pytest.raises(ValueError, match="Profile.K"):
        Engine(t, mode="ar", simulate=Profile(3.0, 7, K=4096), max_len=128)
    with pytest.raises(ValueError, match="depth"):
        Engine(t, d, mode="dflash", simulate=Profile(3.0, 5, K=64), max_len=128)
    with pytest.raises(ValueError, match="Profile"):
        Engine(t, d, mode="dflash", simulate="tau 3", max_len=128)


def test_a_profile_fitted_to_its_own_curve_comes_back():
    """Profile.fit on a profile's own expected tokens recovers it; on a curve that no profile of a lower
    ratio fits (a flat one), it picks another ratio (the fit can fail to be the original)."""
    budgets = (1, 4, 16, 64)
    want = project.profile_taus(4.0, budgets, 7, 0.5)
    p = Profile.fit(budgets, [want[b] for b in budgets], depth=7)
    assert abs(p.tau_chain - 4.0) < 0.15 and p.ratio == 0.5 and p.depth == 7
    flat = Profile.fit(budgets, [want[1]] * 4, depth=7)
    assert (flat.tau_chain, flat.ratio) != (p.tau_chain, p.ratio)
    with pytest.raises(ValueError, match="budgets"):
        Profile.fit((1, 4), [2.0], depth=7)


def test_a_true_token_beyond_the_list_is_none():
    """A profile whose ranks often fall beyond its K listed candidates: those positions' true token is
    `none` (the target's own choice stands in), the others the id of their rank, as the table holds them."""
    from kdtree.simulate import Simulation
    prof = Profile(1.5, depth=7, ratio=0.9, K=8)
    sim = Simulation(prof, 1000, 7, 2, "cpu", length=300)
    seed = torch.tensor([11, 2**33 + 5])
    sim.write([1, 0], [int(seed[1]), int(seed[0])])
    pos = torch.arange(300)[None].expand(2, -1)
    r = sim.ranks(seed, pos)
    assert 0.05 < (r >= prof.K).float().mean() < 0.95   # both branches occur
    want = torch.where(r < prof.K, sim.ids(seed, pos).gather(2, r.clamp(max=prof.K - 1)[..., None])[..., 0],
                       sim.none)
    assert torch.equal(sim.tokens(seed, pos), want) and torch.equal(sim.text, want)
