"""Generation: losslessness in CI, forward-pass reduction, stop tokens, sampling, bad input."""
import numpy as np
import pytest
import torch

from kdtree.config import ModelArgs
from kdtree.decode import STAGES, generate_ar, generate_ddtree, generate_dflash
from kdtree.drafter import OracleDrafter, build_drafter
from kdtree.model import build_model
from kdtree.validate import DEFAULT_CASES, losslessness, random_prompts


@pytest.mark.slow
def test_greedy_speculative_output_equals_ar(tiny):
    """20 random prompts x 64 new tokens x 6 (mode, drafter, block size, budget) cases, per config."""
    name, _, model = tiny
    rep = losslessness(model, n_prompts=20, max_new_tokens=64, cases=DEFAULT_CASES, seed=1)
    for case, r in rep.items():
        assert r["prompts"] == 20 and r["tokens"] == 20 * 64, (name, case)
        assert r["mismatches"] == 0, (name, case, r["mismatches"])
    # the oracle cases accepted multi-token paths, so compaction of non-trivial paths was exercised
    assert max(rep["ddtree[oracle bs=16 B=128]"]["accept_lengths"]) >= 6


def test_oracle_shows_the_forward_reduction(tiny):
    _, _, model = tiny
    fpt = {"ar": [], "dflash": [], "ddtree": []}
    for i, prompt in enumerate(random_prompts(model.args, 4, seed=7)):
        ar = generate_ar(model, prompt, 48)
        o = OracleDrafter(prompt + ar.tokens, model.args.vocab_size, block_size=16, seed=i)
        df = generate_dflash(model, o, prompt, 48)
        dd = generate_ddtree(model, o, prompt, 48, budget=64)
        assert ar.tokens == df.tokens == dd.tokens
        for k, r in (("ar", ar), ("dflash", df), ("ddtree", dd)):
            fpt[k].append(r.forwards_per_token)
    m = {k: float(np.mean(v)) for k, v in fpt.items()}
    assert m["ar"] == 1.0
    assert m["dflash"] < 0.7 and m["ddtree"] < 0.85 * m["dflash"], m


def test_stats_are_consistent(tiny):
    _, args, model = tiny
    prompt = random_prompts(args, 1, seed=3)[0]
    ar = generate_ar(model, prompt, 30)
    dd = generate_ddtree(model, OracleDrafter(prompt + ar.tokens, args.vocab_size, 8), prompt, 30, budget=16)
    assert dd.target_forwards == 1 + len(dd.accept_lengths)
    # the prefill emits the first token; the last round may be cut by max_new_tokens
    assert sum(dd.accept_lengths[:-1]) < len(dd.tokens) - 1 <= sum(dd.accept_lengths)
    assert all(n >= 1 for n in dd.accept_lengths) and all(2 <= n <= 17 for n in dd.tree_sizes)
    assert set(STAGES) <= set(dd.stage_times) and all(v >= 0 for v in dd.stage_times.values())
    assert dd.stage_times["verify"] > 0 and dd.stage_times["build"] > 0
    s = dd.summary()
    assert s["new_tokens"] == 30 and s["tau"] == pytest.approx(np.mean(dd.accept_lengths))


def test_stop_tokens_and_max_new_tokens(tiny):
    _, args, model = tiny
    prompt = random_prompts(args, 1, seed=4)[0]
    ar = generate_ar(model, prompt, 40)
    stop = ar.tokens[17]
    first = ar.tokens.index(stop)
    o = OracleDrafter(prompt + ar.tokens, args.vocab_size, 8)
    d = build_drafter(model, block_size=4)
    outs = [generate_ar(model, prompt, 40, stop_tokens=[stop]),
            generate_dflash(model, o, prompt, 40, stop_tokens=[stop]),
            generate_ddtree(model, o, prompt, 40, budget=32, stop_tokens=[stop]),
            generate_ddtree(model, d, prompt, 40, budget=8, stop_tokens=[stop])]
    for r in outs:
        assert r.tokens == ar.tokens[:first + 1], r.mode
    for n in (1, 2, 13):
        assert generate_ddtree(model, o, prompt, n, budget=32).tokens == ar.tokens[:n]


def _micro():
    args = ModelArgs(vocab_size=6, hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1,
                     intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                     num_experts_per_tok=2, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64)
    return build_model(args, seed=5)


class _TargetDrafter:
    """Test helper: drafts depth 1 from the target's own distribution, depth 2 uniform."""
    block_size, target_layer_ids = 3, ()

    def __init__(self, model):
        self.model = model

    def session(self, max_len):
        return self

    def start(self, prompt, features=None):
        pass

    def accept(self, features=None):
        pass

    def propose(self, committed):
        with torch.no_grad():
            d1 = self.model(torch.tensor([committed])).logits[0, -1]
        return torch.stack([d1, torch.zeros_like(d1)])


@pytest.mark.slow   # ~30-40 s on 2 idle cores, minutes beside other CPU load
def test_sampled_ddtree_has_the_target_distribution():
    """T = 1: the joint law of two generated tokens equals the target's exact one (chi-square, p < 1e-4)."""
    model = _micro()
    prompt = [1, 4, 2]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p2 = torch.stack([torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
                          for a in range(6)])
    exact = (p1[:, None] * p2).flatten().numpy()  # [36]
    drafter = _TargetDrafter(model)
    n, counts, accepted = 2000, np.zeros(36), 0
    for s in range(n):
        r = generate_ddtree(model, drafter, prompt, 2, budget=10, temperature=1.0, seed=s)
        counts[r.tokens[0] * 6 + r.tokens[1]] += 1
        accepted += r.accept_lengths[0] > 1
    assert accepted > 0.5 * n  # the second token often came from an accepted tree node
    keep = exact * n >= 5
    chi2 = (((counts - n * exact) ** 2) / (n * exact))[keep].sum() + 0.0
    assert chi2 < 75.0, chi2  # df <= 35: the 1e-4 critical value is about 75


@pytest.mark.parametrize("call,needle", [
    (lambda m, o: generate_ddtree(m, o, [1, 2], 8, budget=0), "budget"),
    (lambda m, o: generate_ddtree(m, o, [1, 2], 8, budget=-4), "budget"),
    (lambda m, o: generate_ddtree(m, o, [], 8, budget=4), "prompt"),
    (lambda m, o: generate_dflash(m, o, [1, 10**6], 8), "prompt"),
    (lambda m, o: generate_ar(m, [1, 2], 0), "max_new_tokens"),
    (lambda m, o: generate_ar(m, [1, 2], 4, temperature=float("nan")), "temperature"),
    (lambda m, o: generate_ddtree(m, o, [1, 2], 10**5, budget=4), "context overflow"),
])
def test_bad_generation_arguments(tiny, call, needle):
    _, args, model = tiny
    o = OracleDrafter([1, 2, 3], args.vocab_size, 8)
    with pytest.raises(ValueError, match=needle):
        call(model, o)
