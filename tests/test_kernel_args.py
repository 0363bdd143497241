"""The kernel wrappers reject bad arguments before anything is compiled or launched (runs on a CPU)."""
import numpy as np
import pytest
import torch

from kdtree import kernels as K


def test_tree_build_rejects():
    x = torch.zeros(2, 4, 10)
    r = torch.zeros(2, dtype=torch.int64)
    for budget in (0, -1, 1025, 2.0, True):
        with pytest.raises(ValueError, match="budget"):
            K.tree_build(x, budget, r, r)
    with pytest.raises(ValueError, match="logits: expected dtype"):
        K.tree_build(x.to(torch.float16), 8, r, r)
    with pytest.raises(ValueError, match="logits: expected 3 dims"):
        K.tree_build(torch.zeros(4, 10), 8, r, r)
    with pytest.raises(ValueError, match="logits: expected a contiguous"):
        K.tree_build(torch.zeros(2, 10, 4).transpose(1, 2), 8, r, r)
    with pytest.raises(ValueError, match="logits: expected a CUDA tensor"):
        K.tree_build(x, 8, r, r)


def test_tree_kernel_fits_the_frontier_in_registers_or_goes_to_groups():
    """One slot per node plus the root's, 32 lanes: registers per lane while <= 4, then the shared-memory
    groups; the shared memory covers every slot of the chosen layout."""
    for B in range(1, 1025):
        name = K.tree_kernel(B)
        need = -(-(B + 1) // 32)
        if need <= 4:
            c = int(name.removeprefix("tree_build_c"))
            assert c in K.TREE_REG_SLOTS and need <= c and (c == 1 or need > c // 2), (B, name)
        else:
            assert name == "tree_build_groups", (B, name)
        assert K.tree_smem_bytes(B) >= 8 * B + 8 * 32 * need + 4 * (B + 1) + 2 * (B + 1)


def test_topk_rejects():
    with pytest.raises(ValueError, match="k="):
        K.topk_logprobs(torch.zeros(2, 5), 0)
    with pytest.raises(ValueError, match="CUDA"):
        K.topk_logprobs(torch.zeros(2, 5), 3)


def test_walk_and_compact_reject():
    t = torch.zeros(2, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="tokens: expected dtype"):
        K.tree_walk(t.long(), t, t)
    with pytest.raises(ValueError, match="parents: expected shape"):
        K.tree_walk(t, t[:, :3].contiguous(), t)
    with pytest.raises(ValueError, match="cache: expected dtype"):
        K.kv_compact(torch.zeros(1, 64, 576, dtype=torch.int8), t, t[:, 0], t, t[:, 0])
    with pytest.raises(ValueError, match="page_size=0: expected a positive int"):
        K.kv_compact(torch.zeros(1, 64, 576, dtype=torch.bfloat16), t, t[:, 0], t, t[:, 0], page_size=0)


def test_verify_attn_rejects():
    q = torch.zeros(1, 2, 4, 576, dtype=torch.bfloat16)
    cache = torch.zeros(128, 576, dtype=torch.bfloat16)
    pt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.tensor([10], dtype=torch.int32)
    m = torch.ones(1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="q: expected dtype"):
        K.verify_attn(q.float(), cache, pt, sl, m, 0.1)
    with pytest.raises(ValueError, match="q: expected head dim 576"):
        K.verify_attn(q[..., :512].contiguous(), cache, pt, sl, m, 0.1)
    with pytest.raises(ValueError, match="cache: expected rows of 576"):
        K.verify_attn(torch.zeros(1, 2, 4, 576, dtype=torch.bfloat16), cache[:, :512].contiguous(), pt, sl, m,
                      0.1)
    with pytest.raises(ValueError, match="whole number of pages"):
        K.verify_attn(q, cache[:100], pt, sl, m, 0.1)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        K.verify_attn(q, cache, pt, sl, m, 0.1)
    with pytest.raises(ValueError, match="impl='flash': expected one of"):
        K.verify_attn(q, cache, pt, sl, m, 0.1, impl="flash")
    for bad in (0, K.MAX_SPLITS + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"n_splits=.*expected an int in \[1, 128\] \(or None\)"):
            K.verify_attn(q, cache, pt, sl, m, 0.1, n_splits=bad)
    for bad in (0, -64, 64.0, True):
        with pytest.raises(ValueError, match="page_size=.*expected a positive int"):
            K.verify_attn(q, cache, pt, sl, m, 0.1, page_size=bad)
    with pytest.raises(ValueError, match="q: expected a non-empty"):
        K.verify_attn(q[:, :0].contiguous(), cache, pt, sl, m, 0.1)
    for bad in (1, 129, 64.0):  # N = 2, two pages of 64 rows
        with pytest.raises(ValueError, match=r"max_seq_len=.*expected an int in \[2, 128\] \(N=2"):
            K.verify_attn(q, cache, pt, sl, m, 0.1, max_seq_len=bad)


def test_pack_mask_matches_golden():
    import numpy as np

    from kdtree import golden
    m = torch.rand(3, 40, 40) < 0.5
    got = K.pack_mask(m).numpy().view(np.uint32)
    for i in range(3):
        np.testing.assert_array_equal(got[i], golden.pack_mask_bits(m[i].numpy()))


def test_moe_int4_rejects():
    T, D, I, E, k = 3, 64, 32, 4, 2
    x = torch.zeros(T, D, dtype=torch.bfloat16)
    ids = torch.zeros(T, k, dtype=torch.int32)
    w = torch.ones(T, k)
    p13, s13 = (torch.zeros(E, 2 * I, D // 8, dtype=torch.int32),
                torch.ones(E, 2 * I, D // 32, dtype=torch.bfloat16))
    p2, s2 = torch.zeros(E, D, I // 8, dtype=torch.int32), torch.ones(E, D, I // 32, dtype=torch.bfloat16)
    args = [p13, s13, p2, s2]
    bad = {0: (p13[:, :, :3].contiguous(), r"w13_packed: expected int32 \[E, 2I, D/8\]"),
           1: (s13[:, :, :1].contiguous(), r"w13_scale: expected shape \(4, 64, 2\)"),
           2: (p2[:, :, :2].contiguous(), r"w2_packed: expected shape \(4, 64, 4\)"),
           3: (s2.float(), "w2_scale: expected dtype")}
    for i, (value, match) in bad.items():
        a = list(args)
        a[i] = value
        with pytest.raises(ValueError, match=match):
            K.repack_moe(*a)
    mw = K.repack_moe(*args)  # repacking runs anywhere (torch ops)
    assert (mw.E, mw.D, mw.I) == (E, D, I)
    with pytest.raises(ValueError, match="weights: expected a MoeWeights"):
        K.moe_int4(x, ids, w, args)
    with pytest.raises(ValueError, match="x: expected dtype"):
        K.moe_int4(x.float(), ids, w, mw)
    with pytest.raises(ValueError, match=r"x: expected \[T, 64\]"):
        K.moe_int4(torch.zeros(T, 96, dtype=torch.bfloat16), ids, w, mw)
    with pytest.raises(ValueError, match=r"topk_ids: expected shape \(3, k\)"):
        K.moe_int4(x, ids[:2], w, mw)
    with pytest.raises(ValueError, match="topk_weights: expected dtype"):
        K.moe_int4(x, ids, w.double(), mw)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        K.moe_int4(x, ids, w, mw)


def test_repack_puts_each_lanes_fragment_nibbles_in_place():
    """Lane (g, c), word j of a repacked group: nibble b = input 2c and nibble 4 + b = input 2c + 1 of A
    register b, i.e. of row g + 8 (b % 2), inputs 16 j + 8 (b // 2) + 2c and + 1 of the group (checkpoint
    codes + 8)."""
    from kdtree import quant
    g_ = torch.Generator().manual_seed(6)
    R, Kin = 48, 96
    q = torch.randint(-8, 8, (R, Kin), dtype=torch.int8, generator=g_)
    packed = quant.pack(q)
    scale = torch.rand(R, Kin // 32, generator=g_).to(torch.bfloat16)
    wr, sr = K.repack_int4_mma(packed, scale)
    assert wr.shape == (R // 16, Kin // 32, 32, 2) and wr.dtype == torch.int32
    assert sr.shape == (R // 16, Kin // 32, 8, 2)
    words = wr.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], -1).view(R // 16, Kin // 32,
                                                                             8, 4, 2, 2, 4)
    # h: nibble // 4
    t, grp, g, c, j, h, b = torch.meshgrid(*(torch.arange(n) for n in nib.shape), indexing="ij")
    want = q.to(torch.int64)[t * 16 + g + 8 * (b % 2), grp * 32 + 16 * j + 8 * (b // 2) + 2 * c + h] + 8
    assert torch.equal(nib, want)
    tt, gg, g2, hh = torch.meshgrid(*(torch.arange(n) for n in sr.shape), indexing="ij")
    assert torch.equal(sr, scale[tt * 16 + g2 + 8 * hh, gg])


def test_group_pairs_groups_by_expert():
    g = torch.Generator().manual_seed(4)
    T, k, E = 9, 3, 7
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g)
    tok, pw, off, active = K.group_pairs(ids, w, E)
    # by expert, then token
    want = sorted((int(ids[t, j]), t, float(w[t, j])) for t in range(T) for j in range(k))
    assert tok.tolist() == [t for _, t, _ in want] and pw.tolist() == [x for _, _, x in want]
    assert off.tolist() == [sum(1 for e2, _, _ in want if e2 < e) for e in range(E + 1)]
    used = sorted({e for e, _, _ in want})
    assert len(active) == min(E, T * k) and active.tolist()[:len(used)] == used


def test_golden_group_pairs_is_the_torch_grouping():
    """golden.group_pairs (the moe_group kernel's twin) equals the torch path on CPU tensors, P < E
    included."""
    from kdtree import golden
    g = torch.Generator().manual_seed(11)
    for T, k, E in ((1, 1, 5), (2, 3, 16), (17, 4, 8), (40, 8, 384)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int64)
        w = torch.rand(T, k, generator=g)
        want = K.group_pairs(ids, w, E)
        got = golden.group_pairs(ids.numpy(), w.numpy(), E)
        for a, b in zip(got, want):
            assert np.array_equal(a, b.numpy())
        ids[0, 0] = -1  # another rank's expert (expert parallelism): dropped by both
        want = K.group_pairs(ids, w, E)
        got = golden.group_pairs(ids.numpy(), w.numpy(), E)
        n = int(got[2][-1])
        assert n == T * k - 1 and np.array_equal(got[2], want[2].numpy()) \
            and np.array_equal(got[3], want[3].numpy())
        assert np.array_equal(got[0], want[0][:n].numpy()) and np.array_equal(got[1], want[1][:n].numpy())


def test_group_items_torch_is_the_golden_items():
    """The expert GEMMs' work items: the torch builder (moe_int4's path past the kernel's experts) equals
    golden.group_items bit for bit, experts with none, few and many pairs, chunks of 1..32, spare rows -1;
    a wrong item is caught (the check can fail)."""
    from kdtree import golden
    g = torch.Generator().manual_seed(12)
    for T, k, E, chunk in ((1, 1, 5, 8), (9, 3, 7, 1), (40, 8, 384, 8), (129, 8, 16, 16), (65, 4, 9, 32)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids[: T // 2, 0] = E - 1  # one hot expert: several chunks
        _, _, off, _ = K.group_pairs(ids, torch.rand(T, k, generator=g), E)
        Y = K.item_rows(T * k, min(E, T * k), chunk)
        got = K._group_items_torch(off, chunk, Y).numpy()
        want = golden.group_items(off.numpy(), chunk, Y)
        assert got.dtype == np.int32 and np.array_equal(got, want)
        n = sum(-(-int(off[e + 1] - off[e]) // chunk) for e in range(E))
        assert (want[n:] == -1).all() and (want[:n, 0] >= 0).all() and n < Y
        bad = want.copy()
        bad[n - 1, 1] += 1
        assert not np.array_equal(got, bad)  # the check can fail


def test_item_chunk_fits_the_grid():
    """Pairs per work item: one pass of the tile while the items fit grid.y, else the least multiple of it
    that fits; item_pairs given is kept."""
    assert K.item_chunk(8, 8, 8) == 8 and K.item_rows(8, 8, 8) == 9
    assert K.item_chunk(1032, 384, 16) == 16
    assert K.item_chunk(262144, 384, 8) == 8
    for P, S, tile in ((16 * 65535, 384, 16), ((1 << 24) - 1, 4096, 8)):
        c = K.item_chunk(P, S, tile)
        assert c > tile and c % tile == 0 and K.item_rows(P, S, c) <= 65535 < K.item_rows(P, S, c - tile)
    assert K.item_chunk(1032, 384, 8, item_pairs=1032) == 1032


@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "8"])
def test_moe_int4_rejects_bad_item_pairs(bad):
    mw = K.MoeWeights(*(torch.zeros(1),) * 4, 4, 32, 32)
    with pytest.raises(ValueError, match="item_pairs="):
        K.moe_int4(torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int32),
                   torch.ones(2, 1), mw, item_pairs=bad)


def test_moe_int4_rejects_item_pairs_with_the_fused_path_and_too_many_pairs():
    mw = K.MoeWeights(*(torch.zeros(1),) * 4, 4, 32, 32)
    with pytest.raises(ValueError, match="item_pairs applies to the grouped GEMMs"):
        K.moe_int4(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
                   torch.ones(1, 1), mw, item_pairs=8, fused=True)
    T = (K.MAX_GROUP_PAIRS + 8) // 8  # x unfilled: the check reads no values
    with pytest.raises(ValueError, match="topk_ids: expected at most 16777215 token-expert pairs"):
        K.moe_int4(torch.empty(T, 32, dtype=torch.bfloat16),
                   torch.zeros(1, 8, dtype=torch.int32).expand(T, 8), torch.ones(1, 8).expand(T, 8), mw)


def test_moe_int4_rejects_an_unknown_tile():
    with pytest.raises(ValueError, match="tile_tokens=64"):
        K.moe_int4(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
                   torch.ones(1, 1), K.MoeWeights(*(torch.zeros(1),) * 4, 1, 32, 32), tile_tokens=64)


def test_moe_int4_rejects_fused_beyond_its_limits():
    mw = K.MoeWeights(*(torch.zeros(1),) * 4, 4, 32, 32)
    with pytest.raises(ValueError, match="fused=True runs 8-pair passes"):
        K.moe_int4(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
                   torch.ones(1, 1), mw, tile_tokens=16, fused=True)
    with pytest.raises(ValueError, match="fused=True runs 8-pair passes"):
        K.moe_int4(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
                   torch.ones(1, 1), mw, tile_tokens=32, fused=True)
    T, k = 9, 8
    with pytest.raises(ValueError,
                       match=r"fused=True: expected T \* k <= 64 token-expert pairs, got 9 x 8 = 72"):
        K.moe_int4(torch.zeros(T, 32, dtype=torch.bfloat16), torch.zeros(T, k, dtype=torch.int32),
                   torch.ones(T, k), mw, fused=True)


def test_plan_estimates_rejects():
    s, d = torch.zeros(2, 9), torch.zeros(2, 9, dtype=torch.int32)
    lp, inner, table = torch.zeros(2, 4), torch.zeros(3), torch.zeros(5, 4)
    idx, k = torch.zeros(3, dtype=torch.int32), torch.zeros(3)

    def call(**kw):
        a = dict(scores=s, depths=d, chain_lp=lp, inner=inner, table=table, idx=idx, kexp=k,
                 extrapolate=False)
        a.update(kw)
        K.plan_estimates(**a)
    bad = [(dict(scores=s.double()), "scores: expected dtype"), (dict(scores=torch.zeros(2, 1)), "scores"),
           (dict(scores=torch.zeros(2, 1026)), "scores"), (dict(depths=d[:, :8]), "depths"),
           (dict(depths=d.long()), "depths"), (dict(chain_lp=torch.zeros(3, 4)), "chain_lp"),
           (dict(chain_lp=torch.zeros(2, 65)), "chain_lp"), (dict(table=torch.zeros(5, 3)), "table"),
           (dict(table=torch.zeros(1, 4)), "table"), (dict(idx=idx.long()), "idx"),
           (dict(idx=torch.zeros(0, dtype=torch.int32)), "idx"), (dict(kexp=k[:2]), "kexp"),
           (dict(extrapolate=1), "extrapolate"), (dict(out=torch.zeros(2, 4)), "out"),
           (dict(out=torch.zeros(5, 2).t()), "out"), (dict(), "expected a CUDA tensor")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call(**kw)
