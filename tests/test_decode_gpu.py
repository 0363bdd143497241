"""The whole DDTree round on the GPU (kernel backend + kernel attention) against AR and the golden path.

With bf16 attention, a tree-verify row and the AR row for the same token are computed from differently
shaped inputs and round differently, so two greedy outputs may part at a near-tie of the target's logits.
The tests therefore require: identical outputs, or a first divergence at a near-tie of the float32
reference (|margin| <= 2% of the logits' std; validate.divergence), and most prompts identical."""
import numpy as np
import pytest
import torch

from kdtree.decode import generate_ar, generate_ddtree, generate_dflash
from kdtree.drafter import OracleDrafter, build_drafter
from kdtree.validate import divergence, kernel_checks, kernel_model, random_prompts, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return kernel_model(seed=3)


def test_kernel_attention_matches_absorb(model):
    x = torch.randint(0, model.args.vocab_size, (1, 300), device="cuda")
    ref_model = kernel_model(seed=3)
    ref_model.attn_impl = "absorb"
    a = ref_model(x).logits
    b = model(x).logits
    assert rel_err(b, a) < 2e-2
    # tree verify through the cache as well
    from kdtree import golden
    rng = np.random.default_rng(0)
    tree = golden.ddtree(rng.standard_normal((7, 50)).astype(np.float32) * 3, 40)
    vb = golden.compile_tree(tree, 5, 300)
    outs = []
    for m in (ref_model, model):
        c = m.new_cache(400)
        m(x, c)
        outs.append(m(torch.from_numpy(vb.tokens)[None].cuda(), c, position_ids=torch.from_numpy(vb.positions).cuda(),
                      mask=torch.from_numpy(vb.mask).cuda()).logits)
    assert rel_err(outs[1], outs[0]) < 2e-2


def _same_or_near_tie(model, prompt, ar, r, log):
    dv = divergence(model, prompt, ar.tokens, r.tokens)
    log.append(dv is None)
    assert dv is None or dv["near_tie"], dv


@pytest.mark.parametrize("budget,block", [(8, 4), (64, 16), (512, 16)])
def test_kernel_ddtree_equals_ar(model, budget, block):
    same = []
    for i, prompt in enumerate(random_prompts(model.args, 6, seed=budget)):
        ar = generate_ar(model, prompt, 64)
        o = OracleDrafter(prompt + ar.tokens, model.args.vocab_size, block, seed=i)
        dd = generate_ddtree(model, o, prompt, 64, budget=budget, backend="kernel")
        _same_or_near_tie(model, prompt, ar, dd, same)
        gd = generate_ddtree(model, o, prompt, 64, budget=budget, backend="golden")
        _same_or_near_tie(model, prompt, ar, gd, same)
    assert sum(same) >= len(same) // 2, same


def test_kernel_dflash_and_dflash_drafter(model):
    d = build_drafter(model, block_size=8, seed=1)
    same = []
    for prompt in random_prompts(model.args, 4, seed=9):
        ar = generate_ar(model, prompt, 48)
        _same_or_near_tie(model, prompt, ar, generate_dflash(model, d, prompt, 48, backend="kernel"), same)
        _same_or_near_tie(model, prompt, ar, generate_ddtree(model, d, prompt, 48, budget=32, backend="kernel"), same)
    assert sum(same) >= len(same) // 2, same


def test_divergence_detects_a_wrong_token(model):
    """The near-tie criterion can fail: a token replaced by an unlikely one is not a near tie."""
    prompt = random_prompts(model.args, 1, seed=2)[0]
    ar = generate_ar(model, prompt, 16)
    with torch.no_grad():
        x = torch.tensor([prompt + ar.tokens[:5]], device="cuda")
        model.attn_impl = "absorb"
        worst = int(model(x, logits_for=[-1]).logits[0, -1].argmin())
        model.attn_impl = "kernel"
    bad = ar.tokens[:5] + [worst] + ar.tokens[6:]
    dv = divergence(model, prompt, ar.tokens, bad)
    assert dv["index"] == 5 and not dv["near_tie"]


def test_kernel_checks_report():
    r = kernel_checks(seed=1, n_prompts=2, max_new_tokens=24)
    assert r["tree_build_and_walk_equal_golden"] and r["kernel_ddtree_equals_ar"], r
    assert r["verify_attn_rel_err_vs_float64"] <= 1e-2
    f = r["kernel_forwards_per_token"]
    assert f["ddtree"] < f["dflash"] < f["ar"] == 1.0
