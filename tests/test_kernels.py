"""GPU kernels against their golden twins (marker gpu: skipped with a reason where no GPU is present)."""
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdtree import golden
from kdtree.validate import random_logits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def _u32(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy().view(np.uint32)


def _logits(rng, b, L, V, dtype):
    x = np.stack([random_logits(rng, L, V) for _ in range(b)])
    t = torch.from_numpy(x).to(dtype)
    return t, t.float().numpy()  # the golden sees exactly the values the kernel sees


@pytest.mark.parametrize("V,K,dtype", [(2, 1, torch.float32), (7, 5, torch.bfloat16),
                                       (1000, 64, torch.float32), (163840, 64, torch.bfloat16),
                                       (163840, 1024, torch.float32), (262144, 1024, torch.bfloat16),
                                       (50000, 1024, torch.bfloat16)])
def test_topk_matches_golden(V, K, dtype):
    from kdtree import kernels
    rng = np.random.default_rng(V + K)
    t, x = _logits(rng, 3, 4, V, dtype)
    tok, lp = kernels.topk_logprobs(t.cuda().reshape(12, V), K)
    gt, gl = golden.topk_logprobs(x.reshape(12, V), K)
    np.testing.assert_array_equal(tok.cpu().numpy(), gt)
    np.testing.assert_array_equal(lp.cpu().numpy(), gl)


@pytest.mark.parametrize("kind", ["normal", "ties", "inf_holes", "one_finite"])
@pytest.mark.parametrize("R,V,K", [(15, 163840, 16), (15, 163840, 64), (64, 262144, 64), (15, 163840, 256),
                                   (6, 3000, 200)])
def test_topk_small_paths_match_golden(kind, R, V, K, monkeypatch):
    """topk_*_small up to their limit (TOPK_SMALL_MAX_K, above the K where topk_logprobs picks them): the
    ranked lists under a real bound (distinct values), the radix fallback (thousands of ties at the bound),
    small chunks without a bound, in the partial and the merge."""
    from kdtree import kernels
    from kdtree.ops import tree as ops_tree  # topk_logprobs reads TOPK_SMALL_K there
    assert K <= kernels.TOPK_SMALL_MAX_K
    monkeypatch.setattr(ops_tree, "TOPK_SMALL_K", kernels.TOPK_SMALL_MAX_K)
    rng = np.random.default_rng(V + K + R + len(kind))
    if kind == "normal":
        x = rng.standard_normal((R, V)).astype(np.float32) * 3
    elif kind == "ties":
        x = rng.integers(-3, 3, size=(R, V)).astype(np.float32)
    elif kind == "inf_holes":
        x = rng.standard_normal((R, V)).astype(np.float32)
        x[rng.random((R, V)) < 0.9] = -np.inf
    else:  # one finite logit per row: the rest of the top-K is -inf, by token
        x = np.full((R, V), -np.inf, dtype=np.float32)
        x[np.arange(R), rng.integers(V, size=R)] = 1.0
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(x).to(dtype)
        tok, lp = kernels.topk_logprobs(t.cuda(), K, check_values=False)
        gt, gl = golden.topk_logprobs(t.float().numpy(), K)
        np.testing.assert_array_equal(tok.cpu().numpy(), gt)
        np.testing.assert_array_equal(lp.cpu().numpy(), gl)


def _check_tree(tb, i, x, budget, root, start):
    tree = golden.ddtree(x, budget)
    vb = golden.compile_tree(tree, root, start)
    n = tree.n
    assert int(tb.n_nodes[i]) == n
    N = budget + 1
    np.testing.assert_array_equal(tb.tokens[i, :n + 1].cpu().numpy(), vb.tokens)
    np.testing.assert_array_equal(tb.positions[i, :n + 1].cpu().numpy(), vb.positions)
    np.testing.assert_array_equal(tb.parents[i, :n + 1].cpu().numpy(), vb.parents)
    np.testing.assert_array_equal(tb.depths[i, 1:n + 1].cpu().numpy(), tree.depths)
    np.testing.assert_array_equal(tb.scores[i, 1:n + 1].cpu().numpy(), tree.scores)
    full = np.eye(N, dtype=bool)
    full[:n + 1, :n + 1] = vb.mask
    np.testing.assert_array_equal(_u32(tb.mask[i]), golden.pack_mask_bits(full))
    pad = slice(n + 1, N)  # padding rows: root token, start position, no parent
    assert (tb.tokens[i, pad] == root).all() and (tb.parents[i, pad] == -1).all()
    assert (tb.positions[i, pad] == start).all()
    return vb


@pytest.mark.parametrize("b,L,V,budget,dtype", [(1, 15, 163840, 64, torch.bfloat16),
                                                (4, 15, 163840, 1024, torch.bfloat16),
                                                (3, 7, 1000, 256, torch.float32), (2, 1, 3, 5, torch.float32),
                                                (2, 16, 2, 1024, torch.float32)])
def test_tree_build_matches_golden(b, L, V, budget, dtype):
    from kdtree import kernels
    rng = np.random.default_rng(b * L + V + budget)
    t, x = _logits(rng, b, L, V, dtype)
    root = torch.from_numpy(rng.integers(0, V, b)).cuda()
    start = torch.from_numpy(rng.integers(0, 5000, b)).cuda()
    tb = kernels.tree_build(t.cuda(), budget, root, start)
    for i in range(b):
        _check_tree(tb, i, x[i], budget, int(root[i]), int(start[i]))


FUZZ_EXAMPLES = int(os.environ.get("KDTREE_FUZZ_EXAMPLES", "10000"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**32 - 1), b=st.integers(1, 3), L=st.integers(1, 16),
       logV=st.floats(math.log(2), math.log(262144)), logB=st.floats(0, math.log(1024)),
       bf16=st.booleans())
def test_fuzz_tree_build_and_walk(seed, b, L, logV, logB, bf16):
    """>= 10,000 random cases (ties, -inf, identical rows; B 1..1024, V 2..262144, L 1..16): zero
    mismatches."""
    from kdtree import kernels
    V, budget = max(2, int(math.exp(logV))), max(1, min(1024, int(math.exp(logB))))
    if V * L * b > 4_000_000:  # keep the numpy golden quick
        V = 4_000_000 // (L * b)
    rng = np.random.default_rng(seed)
    t, x = _logits(rng, b, L, V, torch.bfloat16 if bf16 else torch.float32)
    root = torch.from_numpy(rng.integers(0, V, b)).cuda()
    start = torch.from_numpy(rng.integers(0, 1000, b)).cuda()
    tb = kernels.tree_build(t.cuda(), budget, root, start)
    choice = torch.from_numpy(rng.integers(0, V, (b, budget + 1))).cuda()
    vbs = []
    for i in range(b):
        vb = _check_tree(tb, i, x[i], budget, int(root[i]), int(start[i]))
        end = int(rng.integers(vb.n))  # plant a path so that walks go deep
        path = np.flatnonzero(vb.mask[end])
        for a_, b_ in zip(path[:-1], path[1:]):
            choice[i, a_] = int(vb.tokens[b_])
        vbs.append(vb)
    acc, ln, bonus = kernels.tree_walk(tb.tokens, tb.parents, choice, max_accept=L + 1)
    for i, vb in enumerate(vbs):
        ga, gb = golden.walk(vb.tokens, vb.parents, choice[i, :vb.n].cpu().numpy())
        assert int(ln[i]) == len(ga) and int(bonus[i]) == gb
        np.testing.assert_array_equal(acc[i, :len(ga)].cpu().numpy(), ga)
        assert (acc[i, len(ga):] == -1).all()


def _paged(rng, b, n_layers, rows_per_req, D=576, page=64):
    pages_per = math.ceil(rows_per_req / page)
    total = b * pages_per + 3
    perm = rng.permutation(total)[:b * pages_per].reshape(b, pages_per)
    cache = torch.randn(n_layers, total * page, D,
                        generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    return cache.to(torch.bfloat16).cuda(), torch.from_numpy(perm.astype(np.int32)).cuda()


def _rows(cache_l, pt_b, n, page=64):
    idx = [int(pt_b[r // page]) * page + r % page for r in range(n)]
    return cache_l[idx]


def test_kv_compact_matches_golden():
    from kdtree import kernels
    rng = np.random.default_rng(0)
    b, n_layers = 5, 3
    cache, pt = _paged(rng, b, n_layers, 300)
    start = torch.tensor([0, 10, 63, 100, 200], dtype=torch.int32).cuda()
    accs = [[0], [0, 2, 3, 9], [0, 1, 2, 3, 4], [0, 5, 6, 40, 41, 90], [0, 63, 64, 65]]
    A = 8
    acc = torch.full((b, A), -1, dtype=torch.int32)
    for i, a in enumerate(accs):
        acc[i, :len(a)] = torch.tensor(a)
    ln = torch.tensor([len(a) for a in accs], dtype=torch.int32).cuda()
    before = [[_rows(cache[l], pt[i], 300).float().cpu().numpy() for l in range(n_layers)] for i in range(b)]
    kernels.kv_compact(cache, pt, start, acc.cuda(), ln)
    for i in range(b):
        for l in range(n_layers):
            want, _ = golden.compact_kv(before[i][l], int(start[i]), accs[i])
            np.testing.assert_array_equal(_rows(cache[l], pt[i], 300).float().cpu().numpy(), want)


_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
IMPLS = [pytest.param(i, marks=pytest.mark.skipif(
             not _HOPPER, reason=f"the {i} kernel needs a compute capability 9.0 GPU"))
         for i in ("wgmma", "ws")] + ["mma"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("b,N,H,prefix,tree,splits", [
    (1, 1, 64, 4096, False, None), (2, 17, 16, 300, True, None), (1, 64, 8, 1000, True, 3),
    (3, 5, 4, 0, True, 4), (2, 33, 2, 129, False, 2), (1, 256, 1, 70, True, None),
    (2, 1, 128, 2000, False, 7), (1, 40, 3, 64, True, 1), (1, 1, 128, 8000, False, 100)])
def test_verify_attn_matches_golden(b, N, H, prefix, tree, splits, impl):
    """Both kernels against the float64 golden: trees and chains, head counts whose N*H is not a multiple of
    the 64-row block, prefixes on and off page boundaries, explicit context splits (some of them empty)."""
    from kdtree import kernels
    rng = np.random.default_rng(b * N * H + prefix)
    S = prefix + N
    cache, pt = _paged(rng, b, 1, S)
    cache = cache[0]
    q = (torch.randn(b, N, H, 576) * 0.5).to(torch.bfloat16).cuda()
    masks = []
    for i in range(b):
        if tree:
            t = golden.ddtree(rng.standard_normal((6, 8)).astype(np.float32) * 2, N - 1) if N > 1 else None
            m = golden.compile_tree(t, 0, 0).mask if t is not None and t.n + 1 == N \
                else np.tril(np.ones((N, N), bool))
        else:
            m = np.tril(np.ones((N, N), bool))
        masks.append(m)
    mask = torch.from_numpy(np.stack(masks)).cuda()
    seq = torch.full((b,), S, dtype=torch.int32).cuda()
    scale = 0.0721
    out, lse = kernels.verify_attn(q, cache, pt, seq, mask, scale, n_splits=splits, impl=impl)
    for i in range(b):
        kv = _rows(cache, pt[i], S).double().cpu().numpy()
        qi = q[i].double().cpu().numpy()
        want, wl = golden.mla_tree_attention(qi[..., :512], qi[..., 512:], kv[:, :512], kv[:, 512:], masks[i],
                                             scale)
        got = out[i].double().cpu().numpy()
        assert np.isfinite(got).all()
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= 1e-2, err
        np.testing.assert_allclose(lse[i].cpu().numpy(), wl, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page", [16, 128])
def test_verify_attn_other_page_sizes(page, impl):
    """Pages of 16 and 128 rows (a 64-key tile spans several pages, or part of one), shuffled page tables."""
    from kdtree import kernels
    rng = np.random.default_rng(page)
    b, N, H, prefix = 2, 9, 8, 300
    S = prefix + N
    cache, pt = _paged(rng, b, 1, S, page=page)
    cache = cache[0]
    q = (torch.randn(b, N, H, 576) * 0.5).to(torch.bfloat16).cuda()
    m = np.tril(np.ones((N, N), bool))
    out, _ = kernels.verify_attn(q, cache, pt, torch.full((b,), S, dtype=torch.int32).cuda(),
                                 torch.from_numpy(np.stack([m] * b)).cuda(), 0.0721, page_size=page,
                                 impl=impl)
    for i in range(b):
        kv = _rows(cache, pt[i], S, page=page).double().cpu().numpy()
        qi = q[i].double().cpu().numpy()
        want, _ = golden.mla_tree_attention(qi[..., :512], qi[..., 512:], kv[:, :512], kv[:, 512:], m, 0.0721)
        err = np.linalg.norm(out[i].double().cpu().numpy() - want) / np.linalg.norm(want)
        assert err <= 1e-2, err


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_attn_capacity_past_the_context(impl):
    """A page table 8x longer than the context (as a model's cache): splits sized for the capacity (unchecked
    values), for seq_len's maximum (checked) and for a host bound (max_seq_len) all match golden; the splits
    past the context are empty."""
    from kdtree import kernels
    rng = np.random.default_rng(7)
    b, N, H, S = 2, 4, 16, 700
    cache, pt = _paged(rng, b, 1, 8 * S)
    cache = cache[0]
    q = (torch.randn(b, N, H, 576) * 0.5).to(torch.bfloat16).cuda()
    m = np.tril(np.ones((N, N), bool))
    seq = torch.tensor([S, S - 100], dtype=torch.int32).cuda()
    mask = torch.from_numpy(np.stack([m] * b)).cuda()
    for kw in ({"check_values": False}, {}, {"max_seq_len": S, "check_values": False}):
        out, _ = kernels.verify_attn(q, cache, pt, seq, mask, 0.0721, impl=impl, **kw)
        for i in range(b):
            Si = int(seq[i])
            kv = _rows(cache, pt[i], Si).double().cpu().numpy()
            qi = q[i].double().cpu().numpy()
            want, _ = golden.mla_tree_attention(qi[..., :512], qi[..., 512:], kv[:, :512], kv[:, 512:], m,
                                                0.0721)
            err = np.linalg.norm(out[i].double().cpu().numpy() - want) / np.linalg.norm(want)
            assert err <= 1e-2, (kw, i, err)


def test_gpu_bad_values_rejected_before_launch():
    from kdtree import kernels
    x = torch.randn(1, 3, 100).cuda()
    x[0, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        kernels.tree_build(x, 8, torch.zeros(1, dtype=torch.int32).cuda(),
                           torch.zeros(1, dtype=torch.int32).cuda())
    q = torch.zeros(1, 2, 4, 576, dtype=torch.bfloat16).cuda()
    cache = torch.zeros(128, 576, dtype=torch.bfloat16).cuda()
    m = torch.ones(1, 2, 2, dtype=torch.bool).cuda()
    with pytest.raises(ValueError, match="page index out of range"):
        kernels.verify_attn(q, cache, torch.tensor([[0, 2]], dtype=torch.int32).cuda(),
                            torch.tensor([10], dtype=torch.int32).cuda(), m, 0.1)
    with pytest.raises(ValueError, match="seq_len"):
        kernels.verify_attn(q, cache, torch.tensor([[0, 1]], dtype=torch.int32).cuda(),
                            torch.tensor([1], dtype=torch.int32).cuda(), m, 0.1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (the nvidia-h200-x2 kind)")
def test_kernels_run_on_the_current_device_and_name_a_mismatch():
    """A second GPU: the kernels run there under torch.cuda.device(1) (modules load per device), and a call
    whose tensors sit on another device than the current one is refused with both devices named."""
    from kdtree import kernels
    rng = np.random.default_rng(12)
    t, x = _logits(rng, 2, 3, 5000, torch.bfloat16)
    gt, gl = golden.topk_logprobs(x.reshape(6, 5000), 16)
    with torch.cuda.device(1):
        tok, lp = kernels.topk_logprobs(t.to("cuda:1").reshape(6, 5000), 16)
        assert tok.device.index == 1
        np.testing.assert_array_equal(tok.cpu().numpy(), gt)
        np.testing.assert_array_equal(lp.cpu().numpy(), gl)
    with torch.cuda.device(0), \
            pytest.raises(ValueError, match=r"tensors on cuda:1 but the current CUDA device is cuda:0"):
        kernels.topk_logprobs(t.to("cuda:1").reshape(6, 5000), 16)
