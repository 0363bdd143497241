"""Golden references: trees against brute force, walks, attention, compaction, bad input."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdtree import golden
from kdtree.validate import check_tree, golden_property_checks, random_logits


@st.composite
def small_logits(draw):
    L = draw(st.integers(1, 4))
    V = draw(st.integers(1, 6))
    vals = st.one_of(st.sampled_from([-np.inf, 0.0, 1.0, -1.0, 2.5]),
                     st.floats(-8, 8, allow_nan=False, width=32))
    x = np.array(draw(st.lists(vals, min_size=L * V, max_size=L * V)), dtype=np.float32).reshape(L, V)
    for r in range(L):  # at least one finite logit per depth
        if np.isneginf(x[r]).all():
            x[r, draw(st.integers(0, V - 1))] = draw(st.floats(-3, 3, width=32))
    return x


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_logits(), st.integers(1, 60))
def test_tree_is_the_top_budget_prefixes(logits, budget):
    assert check_tree(logits, budget) == []


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 16), st.integers(2, 3000), st.integers(1, 1024))
def test_large_trees_keep_their_invariants(seed, L, V, budget):
    rng = np.random.default_rng(seed)
    x = random_logits(rng, L, V)
    tree = golden.ddtree(x, budget)
    finite = np.isfinite(golden.log_softmax(x)).sum(1)
    reachable = int(np.cumprod(finite.astype(float)).sum())
    assert tree.n == min(budget, reachable)
    assert (tree.parents < np.arange(tree.n)).all()
    par = tree.parents
    has_par = par >= 0
    assert (tree.depths[has_par] == tree.depths[par[has_par]] + 1).all()
    assert (tree.depths[~has_par] == 1).all()
    assert (tree.scores[has_par] <= tree.scores[par[has_par]]).all()
    keys = list(zip(-tree.scores.astype(np.float64), tree.depths))
    assert keys == sorted(keys)  # emitted in order (parent index and rank only break remaining ties)
    # siblings carry distinct tokens, so the walk is unambiguous
    pairs = set(zip(par.tolist(), tree.tokens.tolist()))
    assert len(pairs) == tree.n


def test_property_sweep_finds_no_violation():
    r = golden_property_checks(n_cases=300, seed=5)
    assert r["failures"] == []


def test_check_tree_can_fail():
    """The brute-force check notices a tree that is not the top-B set."""
    x = np.log(np.array([[0.6, 0.4], [0.9, 0.1]], np.float32))
    good = golden.ddtree(x, 3)
    assert check_tree(x, 3) == [] and check_tree(x, 3, good) == []
    # top-3: (a), (a,a), (b)  — scores ln .6, ln .54, ln .4
    assert good.tokens.tolist() == [0, 0, 1] and good.parents.tolist() == [-1, 0, -1]
    swapped = golden.Tree(good.tokens[[0, 2, 1]], good.depths[[0, 2, 1]], np.array([-1, -1, 0], np.int32),
                          good.scores[[0, 2, 1]], good.ranks[[0, 2, 1]])  # (b) before (a,a): wrong order
    assert "tree != the top-B prefixes" in " ".join(check_tree(x, 3, swapped))
    short = golden.Tree(good.tokens[:2], good.depths[:2], good.parents[:2], good.scores[:2], good.ranks[:2])
    assert any("size 2 != 3" in e for e in check_tree(x, 3, short))
    deep = golden.Tree(good.tokens, np.array([1, 3, 1], np.int32), good.parents, good.scores, good.ranks)
    assert any("depth" in e for e in check_tree(x, 3, deep))


def test_topk_sorts_by_logprob_then_token_id():
    rng = np.random.default_rng(0)
    for _ in range(50):
        L, V = rng.integers(1, 5), rng.integers(1, 40)
        x = rng.integers(-2, 3, size=(L, V)).astype(np.float32)  # many ties
        k = int(rng.integers(1, 50))
        tt, lp = golden.topk_logprobs(x, k)
        assert tt.shape == (L, min(k, V))
        x64 = x.astype(np.float64)
        ref = x64 - (x64.max(1, keepdims=True)
                     + np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1, keepdims=True)))
        for r in range(L):
            want = sorted(range(V), key=lambda t: (-x[r, t], t))[:min(k, V)]
            assert tt[r].tolist() == want
            np.testing.assert_allclose(lp[r], ref[r, want], rtol=1e-6)


def test_chain_is_the_argmax_path():
    x = np.random.default_rng(1).standard_normal((6, 50)).astype(np.float32)
    c = golden.chain_tree(x)
    assert c.tokens.tolist() == x.argmax(1).tolist()
    assert c.parents.tolist() == [-1, 0, 1, 2, 3, 4]


def test_compile_positions_and_parents():
    x = np.random.default_rng(2).standard_normal((4, 9)).astype(np.float32) * 3
    t = golden.ddtree(x, 12)
    vb = golden.compile_tree(t, 5, start_pos=100)
    assert vb.tokens[0] == 5 and vb.positions[0] == 100 and vb.parents[0] == -1
    assert (vb.positions[1:] == 100 + t.depths).all()
    assert (vb.parents[1:] == t.parents + 1).all()
    assert vb.mask[:, 0].all() and (vb.mask.sum(1) == np.concatenate([[1], t.depths + 1])).all()


def test_pack_mask_bits_round_trip():
    rng = np.random.default_rng(3)
    for N in (1, 31, 32, 33, 100):
        m = rng.random((N, N)) < 0.5
        bits = golden.pack_mask_bits(m)
        assert bits.shape == (N, (N + 31) // 32) and bits.dtype == np.uint32
        unpacked = ((bits[:, np.arange(N) // 32] >> (np.arange(N) % 32).astype(np.uint32)) & 1).astype(bool)
        np.testing.assert_array_equal(unpacked, m)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_walk_follows_the_target(seed):
    rng = np.random.default_rng(seed)
    V = int(rng.integers(2, 12))
    t = golden.ddtree(random_logits(rng, int(rng.integers(1, 6)), V), int(rng.integers(1, 40)))
    vb = golden.compile_tree(t, 0, 0)
    # a target that agrees along a random root-to-node path, then disagrees
    end = int(rng.integers(vb.n))
    path = np.flatnonzero(vb.mask[end])
    choice = rng.integers(0, V, size=vb.n)
    for a, b in zip(path[:-1], path[1:]):
        choice[a] = vb.tokens[b]
    acc, bonus = golden.walk(vb.tokens, vb.parents, choice)
    assert acc[0] == 0 and bonus == choice[acc[-1]]
    assert np.array_equal(acc[:len(path)], path)  # the walk goes at least down the planted path
    for a, b in zip(acc[:-1], acc[1:]):
        assert vb.parents[b] == a and vb.tokens[b] == choice[a]
    kids = {int(vb.tokens[i]) for i in range(1, vb.n) if vb.parents[i] == acc[-1]}
    assert bonus not in kids  # it stopped because no child matches


def test_greedy_walk_uses_first_argmax():
    vb = golden.compile_tree(golden.chain_tree(np.eye(3, dtype=np.float32) * 5), 9, 0)  # chain 0,1,2
    logits = np.zeros((4, 3), np.float32)
    logits[0, [0, 1]] = 1.0  # tie: argmax -> token 0 -> matches the child
    acc, bonus = golden.greedy_walk(vb.tokens, vb.parents, logits)
    assert acc.tolist() == [0, 1] and bonus == 0


def _attention_loop(q_lat, q_pe, kv, pe, mask, scale):
    N, H, _ = q_lat.shape
    S = kv.shape[0]
    out = np.zeros_like(q_lat)
    for n in range(N):
        vis = list(range(S - N)) + [S - N + j for j in range(N) if mask[n, j]]
        for h in range(H):
            s = np.array([(q_lat[n, h] @ kv[j] + q_pe[n, h] @ pe[j]) * scale for j in vis])
            p = np.exp(s - s.max())
            out[n, h] = (p / p.sum()) @ kv[vis]
    return out


def test_mla_tree_attention_matches_a_loop():
    rng = np.random.default_rng(4)
    for N, H, R, P, prefix in ((2, 2, 8, 4, 5), (7, 3, 16, 8, 0), (12, 2, 8, 4, 20)):
        t = golden.ddtree(rng.standard_normal((4, 6)).astype(np.float32), N - 1)
        N = t.n + 1
        mask = golden.compile_tree(t, 0, 0).mask
        S = prefix + N
        args = (rng.standard_normal((N, H, R)), rng.standard_normal((N, H, P)), rng.standard_normal((S, R)),
                rng.standard_normal((S, P)), mask, 0.3)
        out, lse = golden.mla_tree_attention(*args)
        np.testing.assert_allclose(out, _attention_loop(*args), rtol=1e-10, atol=1e-12)
        assert lse.shape == (N, H) and np.isfinite(lse).all()


def test_mla_tree_attention_matches_torch_sdpa():
    rng = np.random.default_rng(5)
    N, H, R, P, prefix = 9, 4, 16, 8, 13
    S = prefix + N
    q = rng.standard_normal((N, H, R + P))
    k = rng.standard_normal((S, R + P))
    mask = golden.ancestor_mask(np.array([-1, 0, 0, 1, 1, 2, 3, 6, 7]))
    out, _ = golden.mla_tree_attention(q[..., :R], q[..., R:], k[:, :R], k[:, R:], mask, 0.2)
    full = np.concatenate([np.ones((N, prefix), bool), mask], 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).transpose(0, 1), torch.from_numpy(k)[None].expand(H, S, R + P),
        torch.from_numpy(k[:, :R])[None].expand(H, S, R), attn_mask=torch.from_numpy(full), scale=0.2)
    np.testing.assert_allclose(out, ref.transpose(0, 1).numpy(), rtol=1e-9, atol=1e-12)


def test_compact_kv_gather_semantics():
    rng = np.random.default_rng(6)
    c = rng.standard_normal((20, 3))
    out, n = golden.compact_kv(c, 5, [0, 2, 3, 9])  # row 7 <- row 8 while row 8 <- row 14 (overlap)
    assert n == 9
    np.testing.assert_array_equal(out[:5], c[:5])
    np.testing.assert_array_equal(out[5:9], c[[5, 7, 8, 14]])
    np.testing.assert_array_equal(out[9:], c[9:])


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("logits,needle", [
    (np.array([[0.0, np.nan]], np.float32), "NaN"),
    (np.zeros((0, 4), np.float32), "non-empty"),
    (np.zeros((2, 0), np.float32), "non-empty"),
    (np.array([[-np.inf, -np.inf]], np.float32), "all -inf"),
    (np.array([[np.inf, 0.0]], np.float32), r"\+inf"),
    (np.zeros(4, np.float32), "non-empty float array"),
    (np.zeros((2, 4), np.int32), "float"),
])
def test_bad_logits(logits, needle):
    with pytest.raises(ValueError, match=needle):
        golden.ddtree(logits, 4)


@pytest.mark.parametrize("budget", [0, -3, 2.5, True, None])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="budget"):
        golden.ddtree(np.zeros((2, 4), np.float32) + np.arange(4, dtype=np.float32), budget)


def test_bad_tree_inputs():
    with pytest.raises(ValueError, match="top_tokens/top_logprobs"):
        golden.build_tree(np.zeros((2, 3), int), np.zeros((2, 2), np.float32), 4)
    with pytest.raises(ValueError, match="log-probabilities"):
        golden.build_tree(np.zeros((1, 2), int), np.array([[0.5, -1.0]], np.float32), 4)
    with pytest.raises(ValueError, match="k="):
        golden.topk_logprobs(np.zeros((1, 2), np.float32), 0)
    with pytest.raises(ValueError, match="walk"):
        golden.walk(np.zeros(3, int), np.array([-1, 0]), np.zeros(3, int))
    with pytest.raises(IndexError, match="keep"):
        golden.compact_kv(np.zeros((4, 2)), 2, [0, 5])
    with pytest.raises(ValueError, match="strictly increasing"):
        golden.compact_kv(np.zeros((4, 2)), 0, [1, 1])


def test_equal_scores_follow_the_parents_emission_order():
    """(1,0,1) and (0,1,0) both score -3.5; parent (1,0) (-2.5) is emitted before (0,1) (-3), so its child
    comes first although its rank path is lexicographically larger."""
    lp = np.array([[-1.0, -1.5], [-1.0, -2.0], [-0.5, -1.0]], np.float32)
    tt = np.tile(np.arange(2), (3, 1))
    tree = golden.build_tree(tt, lp, 14)
    paths = []
    for i in range(tree.n):
        p = int(tree.parents[i])
        paths.append((paths[p] if p >= 0 else ()) + (int(tree.tokens[i]),))
    assert paths == [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1), (0, 0, 1), (1, 0, 0), (1, 1), (1, 0, 1),
                     (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    assert [k[1] for k in golden.all_prefixes_ranked(tt, lp)] == paths


def test_truncated_accepts_equal_the_walk_on_each_truncation():
    """round_ops.truncated_accepts: from one walk over a best-first block, the accept length of the walk on
    every truncation of that block (its first R rows: the smaller tree), against the golden walk run on each
    truncation; trees with a planted path so that walks go deep. The same count taken at rows <= R (one
    row too many) fails the check."""
    from kdtree.round_ops import truncated_accepts
    rng = np.random.default_rng(5)
    off_by_one = 0
    for _ in range(60):
        b, A = 4, 8
        acc = np.full((b, A), -1, np.int64)
        blocks, n_max = [], 0
        for i in range(b):
            V = int(rng.integers(2, 6))
            tree = golden.ddtree(random_logits(rng, A - 1, V), int(rng.integers(1, 40)))
            vb = golden.compile_tree(tree, 0, 0)
            choice = rng.integers(0, V, size=vb.n)
            path = np.flatnonzero(vb.mask[int(rng.integers(vb.n))])
            for a, c in zip(path[:-1], path[1:]):
                choice[a] = vb.tokens[c]
            got, _ = golden.walk(vb.tokens, vb.parents, choice)
            acc[i, :len(got)] = got
            blocks.append((vb, choice))
            n_max = max(n_max, vb.n)
        rows = np.arange(1, n_max + 1)
        want = np.array([[len(golden.walk(vb.tokens[:R], vb.parents[:R], choice[:R])[0])
                          for R in np.minimum(rows, vb.n)] for vb, choice in blocks])
        got = truncated_accepts(torch.from_numpy(acc), torch.from_numpy(rows)).numpy()
        assert np.array_equal(got, want), (got, want)
        assert got.min() >= 1 and np.array_equal(got[:, -1], (acc >= 0).sum(1))
        wrong = truncated_accepts(torch.from_numpy(acc), torch.from_numpy(rows + 1)).numpy()
        off_by_one += not np.array_equal(wrong, want)
    assert off_by_one == 60   # the check can fail
