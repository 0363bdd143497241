"""kdtree.bridge on the CPU (golden paths): the reference-typed drop-ins, the tensor-native batch functions
and SGLang's EAGLE tree format, against golden.py; the GPU kernels are checked in test_bridge_gpu.py."""
import numpy as np
import pytest
import torch

from kdtree import bridge, golden


def tied_logits(rng, b, L, V, levels=4, masked=0):
    """Logits on a coarse grid (many exact ties); `masked` tokens a row at -inf (smaller trees)."""
    x = rng.integers(0, levels, size=(b, L, V)).astype(np.float32) * 0.75
    for i in range(b):
        for d in range(L):
            x[i, d, rng.choice(V, size=masked, replace=False)] = -np.inf
    return torch.from_numpy(x)


def recover(sg: golden.SglangTree):
    """Parents and depths from the linked lists alone (each row reached once, from row 0)."""
    b, N = sg.draft_tokens.shape
    par = np.full((b, N), -1, np.int64)
    seen = np.zeros((b, N), bool)
    for i in range(b):
        seen[i, 0] = True
        stack = [0]
        while stack:
            r = stack.pop()
            c = sg.retrive_next_token[i, r]
            last = -1
            while c != -1:
                assert not seen[i, c] and c > last, (i, r, c)  # each row once, lists ascending
                seen[i, c], par[i, c], last = True, r, c
                stack.append(int(c))
                c = sg.retrive_next_sibling[i, c]
    return par, seen


def dense_masks(sg: golden.SglangTree, seq_lens):
    b, N = sg.draft_tokens.shape
    if sg.mode == "qlen_only":
        return sg.tree_mask.reshape(b, N, N)
    if sg.mode == "qlen_only_bitpacking":
        bits = np.unpackbits(sg.tree_mask.reshape(b * N, -1), axis=1, bitorder="little")
        return bits[:, :N].reshape(b, N, N).astype(bool)
    out, at = [], 0
    for i in range(b):
        blk = sg.tree_mask[at:at + N * (seq_lens[i] + N)].reshape(N, seq_lens[i] + N)
        assert blk[:, :seq_lens[i]].all()
        out.append(blk[:, seq_lens[i]:])
        at += N * (seq_lens[i] + N)
    assert at == sg.tree_mask.size
    return np.stack(out)


def check_sglang(tb, sg: golden.SglangTree):
    """The SGLang arrays describe exactly our verify blocks (raises AssertionError otherwise)."""
    tok, par, pos = tb.tokens.numpy(), tb.parents.numpy(), tb.positions.numpy()
    b, N = tok.shape
    seq = pos[:, 0]
    got_par, seen = recover(sg)
    real = np.arange(N)[None, :] <= tb.n_nodes.numpy()[:, None]
    assert (seen == real).all()
    assert (got_par[real] == par[real]).all()
    assert (sg.retrive_next_token[~real] == -1).all() and (sg.retrive_next_sibling[~real] == -1).all()
    assert (sg.draft_tokens == tok).all() and (sg.positions.reshape(b, N) == pos).all()
    assert (sg.retrive_index == np.arange(b * N).reshape(b, N)).all()
    want = tb.dense_mask().numpy().copy()
    want[:, :, 0] = True
    assert (dense_masks(sg, seq) == want).all()


def planted_choice(rng, tb, V):
    """Target choices that follow a random root-to-leaf path of each tree, random elsewhere."""
    tok, par = tb.tokens.numpy(), tb.parents.numpy()
    b, N = tok.shape
    ch = rng.integers(0, V, size=(b, N))
    for i in range(b):
        n = int(tb.n_nodes[i])
        if n == 0:
            continue
        r = int(rng.integers(1, n + 1))
        while r > 0:
            ch[i, par[i, r]] = tok[i, r]
            r = par[i, r]
    return torch.from_numpy(ch.astype(np.int64))


SGLANG_TREES = ((1, 0), (7, 0), (24, 0), (31, 19), (64, 0), (200, 18))  # budget, -inf tokens a row
SGLANG_CASES = [(m, B, k) for m in golden.SGLANG_MODES for B, k in SGLANG_TREES
                if m != "qlen_only_bitpacking" or B < golden.SGLANG_BITPACK_MAX_N]  # 32 rows at most packed


@pytest.mark.parametrize("mode,budget,masked", SGLANG_CASES)
def test_sglang_arrays_are_our_trees_and_the_accept_is_our_walk(mode, budget, masked):
    rng = np.random.default_rng(budget * 31 + masked + len(mode))
    b, L, V = 3, 5, 20
    lg = tied_logits(rng, b, L, V, masked=masked)
    tb = bridge.build_trees(lg, budget, torch.from_numpy(rng.integers(0, V, b)),
                            torch.from_numpy(rng.integers(0, 50, b)))
    sg = bridge.to_sglang(tb, mode)
    g = golden.SglangTree(*(t.numpy() for t in (sg.draft_tokens, sg.positions, sg.tree_mask, sg.retrive_index,
                                                sg.retrive_next_token, sg.retrive_next_sibling)), sg.mode)
    check_sglang(tb, g)
    for _ in range(4):
        ch = planted_choice(rng, tb, V)
        predicts, acc_idx, n_acc = bridge.sglang_verify_greedy(sg, ch, L + 1)
        acc, acc_len, bonus = bridge.follow_trees(tb, ch)
        N = budget + 1
        for i in range(b):
            path, bon = golden.walk(tb.tokens[i].numpy(), tb.parents[i].numpy(), ch[i].numpy())
            assert acc[i, :acc_len[i]].tolist() == path.tolist() and int(bonus[i]) == bon
            assert int(n_acc[i]) == len(path) - 1
            assert (acc_idx[i, :len(path)].numpy() - i * N).tolist() == path.tolist()
            assert (acc_idx[i, len(path):] == -1).all()
            assert int(predicts[i * N + path[-1]]) == bon
            on = set((i * N + path).tolist())
            assert all(int(predicts[i * N + r]) == -1 for r in range(N) if i * N + r not in on)


def test_sglang_checker_fails_on_a_wrong_list():
    """check_sglang catches a sibling link moved, a first child dropped, and a mask bit flipped."""
    rng = np.random.default_rng(5)
    tb = bridge.build_trees(tied_logits(rng, 2, 4, 12), 20, torch.tensor([1, 2]), torch.tensor([3, 9]))
    good = golden.sglang_tree(tb.tokens.numpy(), tb.parents.numpy(), tb.positions[:, 0].numpy(), "qlen_only")
    check_sglang(tb, good)
    rows = np.flatnonzero(good.retrive_next_sibling[0] != -1)
    bad = []
    for edit in ("sibling", "child", "mask"):
        g = golden.sglang_tree(tb.tokens.numpy(), tb.parents.numpy(), tb.positions[:, 0].numpy(), "qlen_only")
        if edit == "sibling":
            g.retrive_next_sibling[0, rows[0]] = -1
        elif edit == "child":
            g.retrive_next_token[1, 0] = -1
        else:
            g.tree_mask[5 * 21 + 3] ^= True
        with pytest.raises(AssertionError):
            check_sglang(tb, g)
        bad.append(edit)
    assert bad == ["sibling", "child", "mask"]


def test_sglang_bad_input():
    rng = np.random.default_rng(1)
    tb = bridge.build_trees(tied_logits(rng, 1, 3, 40), 40, torch.tensor([1]), torch.tensor([3]))
    with pytest.raises(ValueError, match="qlen_only_bitpacking holds at most 32"):
        bridge.to_sglang(tb, "qlen_only_bitpacking")
    with pytest.raises(ValueError, match="mode='dense'"):
        bridge.to_sglang(tb, "dense")
    sg = bridge.to_sglang(tb)
    with pytest.raises(ValueError, match="target_predict"):
        bridge.sglang_verify_greedy(sg, torch.zeros(1, 40, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_spec_steps"):
        bridge.sglang_verify_greedy(sg, torch.zeros(1, 41, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="tree_mask"):
        bridge.to_sglang(tb, "qlen_only", tree_mask=torch.zeros(10, dtype=torch.bool))


def test_full_mode_into_the_callers_buffer_writes_only_the_tree_columns():
    rng = np.random.default_rng(2)
    tb = bridge.build_trees(tied_logits(rng, 2, 3, 10), 6, torch.tensor([1, 2]), torch.tensor([4, 2]))
    N = 7
    size = (4 + 2) * N + 2 * N * N
    buf = torch.zeros(size, dtype=torch.bool)
    sg = bridge.to_sglang(tb, "full", tree_mask=buf)
    assert sg.tree_mask is buf
    ref = bridge.to_sglang(tb, "full").tree_mask
    blk0 = buf[:N * (4 + N)].view(N, 4 + N)
    assert not blk0[:, :4].any() and torch.equal(blk0[:, 4:], ref[:N * (4 + N)].view(N, 4 + N)[:, 4:])


# ----------------------------------------------------------------------------- reference-typed drop-ins
@pytest.mark.parametrize("budget,masked", [(1, 0), (16, 0), (64, 0), (100, 29)])
def test_build_ddtree_tree_equals_golden(budget, masked):
    rng = np.random.default_rng(budget + masked)
    L, V = 6, 30
    lg = tied_logits(rng, 1, L, V, masked=masked)[0]
    tok, dep, parents, child_maps, vis, sub = bridge.build_ddtree_tree(lg, budget)
    t = golden.ddtree(lg.numpy(), budget)
    vb = golden.compile_tree(t, 0, 0)
    assert tok.dtype == torch.long and dep.dtype == torch.long and vis.dtype == torch.bool
    assert isinstance(parents, list) and isinstance(child_maps, list)
    assert set(sub) == set(bridge.REFERENCE_SUBTIMES)
    assert tok.tolist() == t.tokens.tolist() and dep.tolist() == t.depths.tolist()
    assert parents == vb.parents.tolist() and torch.equal(vis, torch.from_numpy(vb.mask))
    assert len(child_maps) == t.n + 1
    assert sorted((p, tk, r) for p, m in enumerate(child_maps) for tk, r in m.items()) == sorted(
        (int(vb.parents[r]), int(vb.tokens[r]), r) for r in range(1, vb.n))
    if masked:
        assert t.n < budget  # -inf tokens are never nodes
    for _ in range(6):
        post = torch.from_numpy(rng.integers(0, V, (1, t.n + 1)))
        r = int(rng.integers(0, t.n + 1))
        while r > 0:  # plant a path
            post[0, vb.parents[r]] = int(vb.tokens[r])
            r = int(vb.parents[r])
        path, nxt = bridge.follow_verified_tree(child_maps, post)
        gp, gb = golden.walk(vb.tokens, vb.parents, post[0].numpy())
        assert path == gp.tolist() and nxt == gb


def test_build_ddtree_tree_empty_cases_match_the_reference():
    lg = torch.randn(4, 9)
    for budget, x in ((0, lg), (-3, lg), (5, lg[:0])):
        tok, dep, parents, child_maps, vis, _ = bridge.build_ddtree_tree(x, budget)
        assert tok.numel() == dep.numel() == 0 and parents == [-1] and child_maps == [{}]
        assert vis.tolist() == [[True]]


def test_reference_dropin_bad_input():
    with pytest.raises(ValueError, match="draft_logits: expected 2 dims"):
        bridge.build_ddtree_tree(torch.randn(1, 4, 9), 4)
    with pytest.raises(ValueError, match="budget"):
        bridge.build_ddtree_tree(torch.randn(4, 9), 2000)
    with pytest.raises(ValueError, match="budget"):
        bridge.build_ddtree_tree(torch.randn(4, 9), 2.5)
    with pytest.raises(ValueError, match="NaN"):
        bridge.build_ddtree_tree(torch.full((4, 9), float("nan")), 4)
    _, _, _, child_maps, _, _ = bridge.build_ddtree_tree(torch.randn(4, 9), 5)
    with pytest.raises(ValueError, match=r"posterior: expected \[1, 6\]"):
        bridge.follow_verified_tree(child_maps, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="child_maps"):
        bridge.follow_verified_tree({}, torch.zeros(1, 5, dtype=torch.long))


def _buffers(n_max, length, dtype=torch.float32):
    return (torch.full((1, n_max), -5, dtype=torch.long), torch.full((1, n_max), -5, dtype=torch.long),
            torch.full((1, 1, n_max, length), 7.0, dtype=dtype), torch.zeros(n_max, n_max, dtype=torch.bool))


def test_compile_ddtree_tree_writes_the_block_and_clears_the_previous_one():
    rng = np.random.default_rng(3)
    tok, dep, parents, _, vis, _ = bridge.build_ddtree_tree(tied_logits(rng, 1, 4, 12)[0], 9)
    n1 = tok.numel() + 1
    ids_b, pos_b, mask_b, vis_b = _buffers(16, 64)
    mask_b.zero_()
    mask_b[0, 0, :5, 20:25] = -1.0  # the previous round's block
    ids, pos, m, past, cur = bridge.compile_ddtree_tree(
        torch.tensor(11), 30, tok, dep, vis, 30, torch.float32, "cpu", ids_b, pos_b, mask_b, vis_b, 20, 5)
    assert (past, cur) == (30, n1) and m.shape == (1, 1, n1, 30 + n1)
    assert ids[0].tolist() == [11] + tok.tolist() and pos[0].tolist() == [30] + (dep + 30).tolist()
    assert (m[0, 0, :, :30] == 0).all()  # the previous block is past now
    vb = golden.compile_tree(golden.Tree(tok.numpy(), dep.numpy().astype(np.int32),
                                         np.array(parents[1:], np.int32) - 1, np.zeros(n1 - 1, np.float32),
                                         np.zeros(n1 - 1, np.int32)), 11, 30)
    want = torch.where(torch.from_numpy(vb.mask), 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(m[0, 0, :, 30:], want)
    tb = bridge.build_trees(tied_logits(rng, 2, 4, 12), 9, torch.tensor([1, 2]), torch.tensor([0, 0]))
    am = bridge.tree_attention_mask(tb, 30)
    for i in range(2):
        v = tb.dense_mask()[i]
        assert (am[i, 0, :, :30] == 0).all() and torch.equal(am[i, 0, :, 30:] == 0, v)
    with pytest.raises(ValueError, match="attention_mask_buffer columns"):
        bridge.compile_ddtree_tree(torch.tensor(11), 30, tok, dep, vis, 60, torch.float32, "cpu",
                                   *_buffers(16, 64), 0, 0)


def _dynamic_cache(rng, layers, past, window, heads=2, D=8):
    from transformers import DynamicCache
    c = DynamicCache()
    ref = []
    for layer in range(layers):
        k = torch.from_numpy(rng.standard_normal((1, heads, past + window, D)).astype(np.float32))
        v = torch.from_numpy(rng.standard_normal((1, heads, past + window, D)).astype(np.float32))
        c.update(k.clone(), v.clone(), layer)
        ref.append((k, v))
    return c, ref


@pytest.mark.parametrize("as_tensor", [False, True])
def test_compact_dynamic_cache_equals_golden(as_tensor):
    pytest.importorskip("transformers")
    rng = np.random.default_rng(4)
    c, ref = _dynamic_cache(rng, 3, 10, 7)
    keep = [0, 2, 3, 6]
    bridge.compact_dynamic_cache(c, 10, torch.tensor(keep) if as_tensor else keep)
    assert c.get_seq_length() == 14
    for layer, (k, v) in zip(c.layers, ref):
        for got, src in ((layer.keys, k), (layer.values, v)):
            want, n = golden.compact_kv(src[0].permute(1, 0, 2).numpy(), 10, keep)
            assert torch.equal(got[0].permute(1, 0, 2), torch.from_numpy(want[:n]))


def test_compact_dynamic_cache_refuses_bad_rows_untouched():
    pytest.importorskip("transformers")
    rng = np.random.default_rng(6)
    c, ref = _dynamic_cache(rng, 2, 5, 4)
    for past, keep, needle in ((5, [0, 4], r"keep_current_indices\[1\]"), (12, [0], "past_length=12"),
                               (5, torch.tensor([0, 1], dtype=torch.int32), "int64")):
        with pytest.raises(ValueError, match=needle):
            bridge.compact_dynamic_cache(c, past, keep)
        assert c.get_seq_length() == 9 and torch.equal(c.layers[0].keys, ref[0][0])
    bridge.compact_dynamic_cache(c, 5, [])
    assert c.get_seq_length() == 5


def test_tensor_native_batch_equals_golden_per_request():
    rng = np.random.default_rng(7)
    b, L, V, B = 4, 5, 25, 33
    lg = tied_logits(rng, b, L, V, masked=3)
    root, start = torch.from_numpy(rng.integers(0, V, b)), torch.from_numpy(rng.integers(0, 99, b))
    tb = bridge.build_trees(lg, B, root, start)
    for i in range(b):
        t = golden.ddtree(lg[i].numpy(), B)
        vb = golden.compile_tree(t, int(root[i]), int(start[i]))
        n = vb.n
        assert int(tb.n_nodes[i]) == t.n
        assert tb.tokens[i, :n].tolist() == vb.tokens.tolist()
        assert tb.parents[i, :n].tolist() == vb.parents.tolist()
        assert (tb.parents[i, n:] == -1).all() and (tb.tokens[i, n:] == int(root[i])).all()
        assert torch.equal(tb.dense_mask()[i, :n, :n], torch.from_numpy(vb.mask))
    with pytest.raises(ValueError, match="root_tokens"):
        bridge.build_trees(lg, B, root[:2], start)
