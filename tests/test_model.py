"""The MLA + MoE model: attention paths agree, the cache is exact, tree verify and compaction are right."""
import dataclasses

import numpy as np
import pytest
import torch

from kdtree import golden
from kdtree.config import TINY_A, TINY_B
from kdtree.model import KVCache, MoE, build_model, rope_inv_freq
from kdtree.validate import rel_err


def _toks(args, shape, seed):
    return torch.randint(0, args.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_naive_and_absorb_agree(tiny):
    _, args, model = tiny
    x = _toks(args, (2, 33), 1)
    model.attn_impl = "naive"
    a = model(x).logits
    model.attn_impl = "absorb"
    b = model(x).logits
    assert rel_err(b, a) < 1e-5
    assert a.std() > 0.5  # peaked logits: a wrong path would show


def test_cached_decode_equals_full_forward(tiny):
    _, args, model = tiny
    x = _toks(args, (2, 40), 2)
    full = model(x).logits
    cache = model.new_cache(64, batch=2)
    parts = [model(x[:, :25], cache).logits]
    parts += [model(x[:, t:t + 1], cache).logits for t in range(25, 40)]
    assert cache.length == 40
    assert rel_err(torch.cat(parts, 1), full) < 1e-5


def test_tree_verify_equals_each_path_run_alone(tiny):
    """Every tree row's logits equal those of a plain causal forward over its root-to-node path."""
    _, args, model = tiny
    rng = np.random.default_rng(3)
    prefix = _toks(args, (1, 17), 3)
    tree = golden.ddtree(rng.standard_normal((5, args.vocab_size)).astype(np.float32) * 3, 24)
    vb = golden.compile_tree(tree, int(rng.integers(args.vocab_size)), start_pos=17)
    cache = model.new_cache(64)
    model(prefix, cache)
    out = model(torch.from_numpy(vb.tokens)[None], cache, position_ids=torch.from_numpy(vb.positions),
                mask=torch.from_numpy(vb.mask), hidden_layers=(1,))
    for i in rng.choice(vb.n, size=6, replace=False):
        path = np.flatnonzero(vb.mask[i])  # ancestors in block order
        ref = model(torch.cat([prefix, torch.from_numpy(vb.tokens[path])[None]], 1), hidden_layers=(1,))
        assert rel_err(out.logits[0, i], ref.logits[0, -1]) < 1e-5
        assert rel_err(out.hidden[1][0, i], ref.hidden[1][0, -1]) < 1e-5


def test_compact_keeps_the_accepted_path(tiny):
    """After compaction, decoding continues exactly as if only the accepted path had been fed."""
    _, args, model = tiny
    rng = np.random.default_rng(4)
    prefix = _toks(args, (1, 12), 4)
    tree = golden.ddtree((rng.standard_normal((6, args.vocab_size)) * 4).astype(np.float32), 30)
    vb = golden.compile_tree(tree, 7, start_pos=12)
    deepest = int(np.argmax(np.asarray(tree.depths))) + 1
    keep = np.flatnonzero(vb.mask[deepest])  # root .. deepest node: non-contiguous rows
    assert len(keep) > 2 and not np.array_equal(keep, np.arange(len(keep)))
    cache = model.new_cache(80)
    model(prefix, cache)
    model(torch.from_numpy(vb.tokens)[None], cache, position_ids=torch.from_numpy(vb.positions),
          mask=torch.from_numpy(vb.mask))
    cache.compact(torch.from_numpy(keep))
    assert cache.length == 12 + len(keep)
    nxt = _toks(args, (1, 3), 5)
    got = model(nxt, cache).logits
    ref = model(torch.cat([prefix, torch.from_numpy(vb.tokens[keep])[None], nxt], 1)).logits[:, -3:]
    assert rel_err(got, ref) < 1e-5


def test_compact_matches_golden_gather():
    from kdtree.config import TINY_A
    cache = KVCache(TINY_A, 1, 40)
    cache.kv.normal_()
    cache.pe.normal_()
    before_kv = cache.kv[0, 0].numpy().copy()
    cache.length, cache.block = 30, (10, 20)
    keep = np.array([0, 2, 3, 7, 19])
    cache.compact(torch.from_numpy(keep))
    want, n = golden.compact_kv(before_kv, 10, keep)
    assert n == cache.length == 15
    np.testing.assert_array_equal(cache.kv[0, 0].numpy(), want)


def test_yarn_frequencies_are_interpolated():
    from kdtree.config import TINY_B
    plain, f1 = rope_inv_freq(TINY_B.replace(rope_scaling=None))
    yarn, f2 = rope_inv_freq(TINY_B)
    assert f1 == 1.0 and f2 != 1.0
    assert torch.allclose(yarn[:1], plain[:1])  # high frequencies kept
    assert torch.allclose(yarn[-1], plain[-1] / TINY_B.rope_scaling["factor"])  # low ones interpolated


def test_bf16_forward_close_to_fp32(tiny):
    _, args, model = tiny
    x = _toks(args, (1, 20), 6)
    ref = model(x).logits
    m16 = build_model(args, seed=11, dtype=torch.bfloat16)
    assert rel_err(m16(x).logits, ref) < 5e-2


# ----------------------------------------------------------------------------- bad input
def _snapshot(cache):
    return cache.kv.clone(), cache.pe.clone(), cache.length, cache.block


@pytest.mark.parametrize("case,needle", [
    ("token_range", "tokens"),
    ("token_dtype", "tokens"),
    ("empty", "tokens"),
    ("position_past_max", "max_position_embeddings"),
    ("negative_position", "position_ids"),
    ("mask_shape", "mask"),
    ("mask_dtype", "mask"),
    ("mask_blind_diagonal", "diagonal"),
    ("overflow", "context overflow"),
    ("hidden_layer", "hidden_layers"),
])
def test_rejected_calls_name_the_argument_and_leave_the_cache(tiny, case, needle):
    _, args, model = tiny
    cache = model.new_cache(16)
    model(_toks(args, (1, 6), 7), cache)
    snap = _snapshot(cache)
    x = _toks(args, (1, 3), 8)
    kw = {}
    if case == "token_range":
        x[0, 1] = args.vocab_size
    elif case == "token_dtype":
        x = x.float()
    elif case == "empty":
        x = x[:, :0]
    elif case == "position_past_max":
        kw["position_ids"] = torch.tensor([6, 7, args.max_position_embeddings])
    elif case == "negative_position":
        kw["position_ids"] = torch.tensor([-1, 7, 8])
    elif case == "mask_shape":
        kw["mask"] = torch.ones(3, 4, dtype=torch.bool)
    elif case == "mask_dtype":
        kw["mask"] = torch.ones(3, 3)
    elif case == "mask_blind_diagonal":
        kw["mask"] = torch.zeros(3, 3, dtype=torch.bool)
    elif case == "overflow":
        x = _toks(args, (1, 11), 9)
    elif case == "hidden_layer":
        kw["hidden_layers"] = (args.num_hidden_layers,)
    with pytest.raises(ValueError, match=needle):
        model(x, cache, **kw)
    after = _snapshot(cache)
    assert torch.equal(after[0], snap[0]) and torch.equal(after[1], snap[1]) and after[2:] == snap[2:]


def test_compact_rejects_bad_indices_and_keeps_the_cache(tiny):
    _, args, model = tiny
    cache = model.new_cache(16)
    model(_toks(args, (1, 5), 10), cache)
    model(_toks(args, (1, 4), 11), cache)
    snap = _snapshot(cache)
    for bad, err in (([0, 4], IndexError), ([-1, 2], IndexError), ([2, 1], ValueError),
                     ([[0, 1]], ValueError), ([0.0, 1.0], ValueError)):
        with pytest.raises(err, match="keep_indices"):
            cache.compact(bad)
        after = _snapshot(cache)
        assert torch.equal(after[0], snap[0]) and after[2:] == snap[2:]
    cache.compact([0, 2])
    with pytest.raises(RuntimeError, match="no appended block"):
        cache.compact([0])


def test_attn_impl_switch_rejects_unknown(tiny):
    _, _, model = tiny
    with pytest.raises(ValueError, match="attn_impl"):
        model.attn_impl = "flash"
    assert model.attn_impl in ("naive", "absorb")


@pytest.mark.parametrize("args", [TINY_A, TINY_B], ids=["tiny-a", "tiny-b (groups)"])
@pytest.mark.parametrize("shared", [1, 2], ids=["1 shared", "2 shared"])
def test_dense_moe_equals_the_routed_loop(args, shared):
    """The engine's dense MoE (every expert and the shared expert in two GEMMs, router rows in the first,
    top-k by ranks) and grouped MoE == the routed loop, on fresh inputs; the rank top-k picks topk's experts
    exactly."""
    args = dataclasses.replace(args, n_shared_experts=shared)
    m = build_model(args, seed=int(torch.randint(1 << 30, ())))
    moe = next(layer.mlp for layer in m.model.layers if isinstance(layer.mlp, MoE))
    m.prepare_paged("dense")
    _, w13, w2, S = moe.stacked()
    assert S == shared
    for _ in range(3):
        x = torch.randn(13, args.hidden_size)
        w, idx = moe.gate(x)
        comb = torch.zeros(13, args.n_routed_experts).scatter_(1, idx, w)
        assert torch.equal(moe.gate.dense_weights(x), comb)
        w2_, idx2 = moe.gate.route(x)
        assert torch.equal(idx2, idx) and torch.equal(w2_, w)
        ref, got = moe(x).double(), moe(x, "dense").double()
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
        if hasattr(torch, "_grouped_mm"):
            got = moe(x, "grouped").double()
            assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
        got = moe._gathered(x[:5]).double()  # (the compiled decode form, run eagerly here)
        assert (got - ref[:5]).abs().max() <= 1e-5 * ref.abs().max()


def test_dense_moe_checker_fails_on_a_wrong_routing():
    """The comparison above can fail: the shared expert's slot in the stacked weights scaled."""
    m = build_model(TINY_A, seed=3)
    moe = next(layer.mlp for layer in m.model.layers if isinstance(layer.mlp, MoE))
    m.prepare_paged()
    x = torch.randn(13, TINY_A.hidden_size)
    ref = moe(x).double()
    _, w13, _, _ = moe.stacked()
    I, E = TINY_A.moe_intermediate_size, TINY_A.n_routed_experts
    w13[E * 2 * I:(E + 1) * 2 * I] *= 2
    got = moe(x, "dense").double()
    assert (got - ref).abs().max() > 1e-3 * ref.abs().max()


def test_fused_weights_are_refreshed_in_place():
    """prepare_paged keeps its fused copies in the same memory (a CUDA graph captured by an earlier engine
    reads them) and copies changed weights into them; the drafter's prepare_buffered likewise."""
    from kdtree.drafter import build_drafter
    m = build_model(TINY_B, seed=4)
    d = build_drafter(m, block_size=4)
    m.prepare_paged("dense")
    m.prepare_paged("grouped")
    d.prepare_buffered()
    attn, moe = m.model.layers[0].self_attn, next(la.mlp for la in m.model.layers if isinstance(la.mlp, MoE))
    at = d.layers[0].self_attn
    kept = [attn.qkv_a, *moe.stacked()[1:3], *moe.grouped(), at.qkv]
    with torch.no_grad():
        attn.q_a_proj.weight.add_(1.0)
        moe.experts[0].gate_proj.weight.add_(1.0)
        at.q_proj.weight.add_(1.0)
    m.prepare_paged("dense")
    m.prepare_paged("grouped")
    d.prepare_buffered()
    now = [attn.qkv_a, *moe.stacked()[1:3], *moe.grouped(), at.qkv]
    assert all(a is b for a, b in zip(kept, now))
    q_lora, I = TINY_B.q_lora_rank, TINY_B.moe_intermediate_size
    assert torch.equal(attn.qkv_a[:q_lora], attn.q_a_proj.weight)
    assert torch.equal(moe.stacked()[1][:I], moe.experts[0].gate_proj.weight)
    assert torch.equal(moe.grouped()[0][0, :I], moe.experts[0].gate_proj.weight)
    assert torch.equal(at.qkv[:at.q_proj.weight.shape[0]], at.q_proj.weight)
