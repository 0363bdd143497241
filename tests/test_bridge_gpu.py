"""kdtree.bridge on the GPU: cuda/sglang_tree.cu and the kernel-backed drop-ins against their golden twins
(marker gpu: skipped with a reason where no GPU is present)."""
import numpy as np
import pytest
import torch

from kdtree import bridge, golden

from test_bridge import check_sglang, planted_choice, tied_logits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def _to_host(tb):
    from kdtree.kernels import TreeBatch
    return TreeBatch(*(t.cpu() for t in (tb.tokens, tb.positions, tb.parents, tb.depths, tb.scores, tb.mask,
                                         tb.n_nodes)))


def _numpy(sg):
    return golden.SglangTree(*(t.cpu().numpy() for t in (sg.draft_tokens, sg.positions, sg.tree_mask,
                                                         sg.retrive_index, sg.retrive_next_token,
                                                         sg.retrive_next_sibling)), sg.mode)


SHAPES = [(1, 4, 50, 1, 0), (3, 5, 20, 31, 19), (4, 7, 300, 31, 0), (2, 15, 163840, 64, 0),
          (8, 6, 40, 255, 37), (3, 15, 1000, 1024, 0)]  # b, L, V, budget, -inf tokens a row


@pytest.mark.parametrize("mode,b,L,V,budget,masked", [(m, *s) for m in golden.SGLANG_MODES for s in SHAPES
                                                      if m != "qlen_only_bitpacking" or s[3] < 32])
def test_to_sglang_kernel_equals_golden(mode, b, L, V, budget, masked):
    rng = np.random.default_rng(b * 1000 + budget + masked)
    lg = tied_logits(rng, b, L, V, levels=6, masked=masked)
    root = torch.from_numpy(rng.integers(0, V, b)).cuda()
    start = torch.from_numpy(rng.integers(0, 4000, b)).cuda()
    tb = bridge.build_trees(lg.cuda(), budget, root, start)
    sg = bridge.to_sglang(tb, mode)
    host = _to_host(tb)
    want = golden.sglang_tree(host.tokens.numpy(), host.parents.numpy(), host.positions[:, 0].numpy(), mode)
    got = _numpy(sg)
    for name in ("draft_tokens", "positions", "tree_mask", "retrive_index", "retrive_next_token",
                 "retrive_next_sibling"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    check_sglang(host, got)
    for _ in range(3):
        ch = planted_choice(rng, host, V)
        gp, ga, gn = golden.sglang_verify_greedy(want, ch.numpy(), L + 1)
        p, a, n = bridge.sglang_verify_greedy(sg, ch.cuda(), L + 1)
        np.testing.assert_array_equal(p.cpu().numpy(), gp)
        np.testing.assert_array_equal(a.cpu().numpy(), ga)
        np.testing.assert_array_equal(n.cpu().numpy(), gn)


def test_sglang_round_replays_in_a_cuda_graph():
    """build_trees + to_sglang + the greedy accept captured once, replayed on new logits and choices."""
    rng = np.random.default_rng(9)
    b, L, V, B = 4, 8, 5000, 63
    x = torch.empty(b, L, V, device="cuda")
    ch = torch.empty(b, B + 1, dtype=torch.int64, device="cuda")
    root = torch.arange(b, device="cuda")
    start = torch.full((b,), 100, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm-up: compile and load the modules outside the capture
        x.copy_(tied_logits(rng, b, L, V).cuda())
        sg = bridge.to_sglang(bridge.build_trees(x, B, root, start, check_values=False))
        bridge.sglang_verify_greedy(sg, ch.zero_(), L + 1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tb = bridge.build_trees(x, B, root, start, check_values=False)
        sg = bridge.to_sglang(tb)
        out = bridge.sglang_verify_greedy(sg, ch, L + 1)
    for _ in range(3):
        lg = tied_logits(rng, b, L, V, levels=8)
        x.copy_(lg.cuda())
        host = bridge.build_trees(lg, B, root.cpu(), start.cpu())
        c = planted_choice(rng, host, V)
        ch.copy_(c.cuda())
        g.replay()
        want = golden.sglang_tree(host.tokens.numpy(), host.parents.numpy(), host.positions[:, 0].numpy(),
                                  "qlen_only")
        np.testing.assert_array_equal(sg.retrive_next_sibling.cpu().numpy(), want.retrive_next_sibling)
        for got, w in zip(out, golden.sglang_verify_greedy(want, c.numpy(), L + 1)):
            np.testing.assert_array_equal(got.cpu().numpy(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L,V,budget", [(15, 163840, 64), (6, 300, 1024), (3, 40, 7)])
def test_reference_dropins_on_the_gpu_equal_the_cpu_path(dtype, L, V, budget):
    rng = np.random.default_rng(L * V + budget)
    lg = tied_logits(rng, 1, L, V, levels=5)[0].to(dtype)
    got = bridge.build_ddtree_tree(lg.cuda(), budget)
    again = bridge.build_ddtree_tree(lg.cuda(), budget)  # the graph replayed
    eager = bridge.build_ddtree_tree(lg.cuda(), budget, graph=False)
    want = bridge.build_ddtree_tree(lg.float() if dtype == torch.float16 else lg, budget)
    for out in (got, again, eager):
        for g, w in zip(out[:5], want[:5]):
            assert (torch.equal(g, w) if isinstance(g, torch.Tensor) else g == w)
    bad = lg.cuda().clone()
    bad[2, 5] = float("nan")
    for graph in (True, False):
        with pytest.raises(ValueError, match="NaN"):
            bridge.build_ddtree_tree(bad, budget, graph=graph)
    bad[2, 5] = float("-inf")
    bad[1] = float("-inf")
    with pytest.raises(ValueError, match="all -inf"):
        bridge.build_ddtree_tree(bad, budget)
    n = got[0].numel()
    for _ in range(4):
        post = torch.from_numpy(rng.integers(0, V, (1, n + 1))).cuda()
        assert bridge.follow_verified_tree(got[3], post) == bridge.follow_verified_tree(want[3], post.cpu())
    tb = bridge.build_trees(lg[None].cuda(), budget, torch.tensor([3]).cuda(), torch.tensor([9]).cuda())
    post = torch.from_numpy(rng.integers(0, V, (1, budget + 1))).cuda()
    acc, n_acc, bonus = bridge.follow_trees(tb, post)
    hacc, hn, hb = bridge.follow_trees(_to_host(tb), post.cpu())
    assert torch.equal(acc.cpu(), hacc) and torch.equal(n_acc.cpu(), hn) and torch.equal(bonus.cpu(), hb)


def test_compact_dynamic_cache_with_device_rows():
    pytest.importorskip("transformers")
    from transformers import DynamicCache
    rng = np.random.default_rng(12)
    c = DynamicCache()
    ref = []
    for layer in range(2):
        k = torch.from_numpy(rng.standard_normal((1, 4, 30, 16)).astype(np.float32)).cuda()
        v = torch.from_numpy(rng.standard_normal((1, 4, 30, 16)).astype(np.float32)).cuda()
        c.update(k.clone(), v.clone(), layer)
        ref.append((k.cpu(), v.cpu()))
    keep = torch.tensor([0, 3, 4, 9], device="cuda")
    bridge.compact_dynamic_cache(c, 20, keep)
    assert c.get_seq_length() == 24
    for layer, (k, _) in zip(c.layers, ref):
        want, n = golden.compact_kv(k[0].permute(1, 0, 2).numpy(), 20, keep.cpu().numpy())
        assert torch.equal(layer.keys[0].permute(1, 0, 2).cpu(), torch.from_numpy(want[:n]))
