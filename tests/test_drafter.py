"""The DFlash drafter: public layout, cached context, argument checks."""
import pytest
import torch

from kdtree.config import TINY_A, TINY_B
from kdtree.drafter import DFlashDrafter, DrafterArgs, OracleDrafter, build_drafter
from kdtree.model import build_model
from kdtree.validate import rel_err


@pytest.fixture(scope="module")
def target():
    return build_model(TINY_B, seed=3)


def test_public_layout_names(target):
    d = build_drafter(target, block_size=16)
    names = set(d.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.0.self_attn.k_norm.weight", "layers.1.mlp.down_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # shared with the target
    assert d.fc.in_features == len(d.args.target_layer_ids) * TINY_B.hidden_size
    assert d.args.num_key_value_heads < d.args.num_attention_heads  # GQA


def test_propose_shape_and_context_cache(target):
    d = build_drafter(target, block_size=8, seed=1)
    F = d.fc.in_features
    feats = torch.randn(30, F, generator=torch.Generator().manual_seed(0))
    committed = list(range(31))
    s1 = d.session(64)
    s1.start(committed[:30], feats)
    a = s1.propose(committed)
    assert a.shape == (7, TINY_B.vocab_size) and a.dtype == torch.float32
    s2 = d.session(64)  # same context, fed in three chunks
    s2.start(committed[:10], feats[:10])
    s2.accept(feats[10:11])
    s2.accept(feats[11:])
    assert rel_err(s2.propose(committed), a) < 1e-5
    s3 = d.session(64)  # a different context changes the draft
    s3.start(committed[:30], feats.flip(0))
    assert rel_err(s3.propose(committed), a) > 1e-2


def test_root_token_conditions_every_depth(target):
    d = build_drafter(target, block_size=6, seed=2)
    s = d.session(32)
    s.start([1, 2, 3], torch.randn(3, d.fc.in_features))
    a, b = s.propose([1, 2, 3, 4]), s.propose([1, 2, 3, 5])
    assert all(rel_err(a[i], b[i]) > 1e-4 for i in range(5))  # non-causal block: all rows see the root


def test_args_round_trip_and_errors(target):
    a = DrafterArgs.for_target(TINY_B, block_size=16)
    assert DrafterArgs.from_hf_config(a.to_hf_config()) == a
    assert a.mask_token_id == TINY_B.vocab_size - 1 and max(a.target_layer_ids) < TINY_B.num_hidden_layers
    with pytest.raises(ValueError, match="block_size"):
        DrafterArgs.for_target(TINY_B, block_size=1)
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterArgs.for_target(TINY_B, mask_token_id=TINY_B.vocab_size)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DrafterArgs.for_target(TINY_B, num_key_value_heads=3)
    with pytest.raises(ValueError, match="target with vocab"):
        DFlashDrafter(a, build_model(TINY_A, seed=0))
    s = build_drafter(target).session(8)
    s.start([1], torch.randn(1, s.d.fc.in_features))
    with pytest.raises(ValueError, match="features"):
        s.accept(torch.randn(2, 5))


def test_oracle_is_calibrated_and_refuses_foreign_prompts():
    ref = list(range(100))
    o = OracleDrafter(ref, vocab_size=200, block_size=5, seed=0)
    with pytest.raises(ValueError, match="reference"):
        o.start([5, 6])
    hits = sum(int(o.propose(ref[:n]).argmax(-1)[0] == ref[n]) for n in range(2, 90))
    assert 30 < hits < 88  # often right, not always: a tree has something to find


@pytest.mark.parametrize("impl", ["auto", "math", "sdpa"])
@pytest.mark.parametrize("heads,kv", [(4, 2), (8, 1), (4, 4)])
def test_batched_draft_equals_the_session_draft(heads, kv, impl, monkeypatch):
    """The engine's drafting pass (preallocated context, query heads folded onto their KV head, no K/V
    repeated), in each attention impl, against the session's reference pass (K/V repeated per query head),
    float32: relative error <= 1e-4 for requests of different context lengths in one batch; a wrong head
    mapping fails it."""
    from kdtree.config import TINY_B
    from kdtree.drafter import build_drafter
    from kdtree.model import build_model
    t = build_model(TINY_B, seed=2)
    d = build_drafter(t, seed=5, block_size=6, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=TINY_B.hidden_size // heads)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lens = [9, 3, 17]
    F = d.fc.in_features
    feats = [torch.randn(n, F, generator=g) for n in lens]
    roots = [int(x) for x in torch.randint(0, TINY_B.vocab_size, (3,), generator=g)]
    ctx = d.new_context(3, 32)
    monkeypatch.setattr(d, "attn_impl", impl)
    for i, f in enumerate(feats):
        d.extend(ctx, f[None], torch.tensor([0]), torch.tensor([len(f)]), slot=i)
    got = d.draft(ctx, torch.tensor(roots), torch.tensor(lens)).double()
    for i, f in enumerate(feats):
        s = d.session(32)
        s.start([0] * lens[i], f)
        want = s.propose([0] * lens[i] + [roots[i]]).double()
        assert ((got[i] - want).norm() / want.norm()) < 1e-4
    if kv == 2 and heads > 2:  # the check can fail: each query group reading the other KV head
        for i in range(len(d.layers)):
            ctx.k[i][:] = ctx.k[i][:, [1, 0]].clone()
            ctx.v[i][:] = ctx.v[i][:, [1, 0]].clone()
        bad = d.draft(ctx, torch.tensor(roots), torch.tensor(lens)).double()
        assert ((bad[2] - want).norm() / want.norm()) > 1e-3


def test_draft_attention_impl_is_checked():
    from kdtree.config import TINY_B
    from kdtree.drafter import build_drafter
    from kdtree.model import build_model
    d = build_drafter(build_model(TINY_B, seed=2), seed=5)
    ctx = d.new_context(1, 8)
    d.attn_impl = "flash"
    with pytest.raises(ValueError, match="attn_impl='flash'"):
        d.draft(ctx, torch.tensor([3]), torch.tensor([0]))
