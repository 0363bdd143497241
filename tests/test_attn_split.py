"""kdtree.ops.attn_split: a verify split at a page boundary and merged by log-sum-exp equals the whole (its
float64 golden halves), the shifted page table reads the rest's rows, bad arguments are named."""
import numpy as np
import pytest
import torch

from kdtree import golden
from kdtree.ops import attn_split as sp
from kdtree.ops.verify_attn_golden import mla_tree_attention, prefix_attention

PAGE = 64


def _case(seed, ctx, N, H=4, R=32, P=8):
    rng = np.random.default_rng(seed)
    S = ctx + N
    q_lat, q_pe = rng.standard_normal((N, H, R)), rng.standard_normal((N, H, P))
    kv, pe = rng.standard_normal((S, R)), rng.standard_normal((S, P))
    tree = golden.ddtree(rng.standard_normal((15, 64)).astype(np.float32) * 2, N - 1) if N > 1 else None
    mask = golden.compile_tree(tree, 0, 0).mask if tree is not None else np.ones((1, 1), bool)
    return q_lat, q_pe, kv, pe, mask, 0.3


def _merged(case, cut, convert=True):
    q_lat, q_pe, kv, pe, mask, scale = case
    o1, l1 = prefix_attention(q_lat, q_pe, kv[:cut], pe[:cut], scale)
    o2, l2 = mla_tree_attention(q_lat, q_pe, kv[cut:], pe[cut:], mask, scale)
    if not convert:   # FlashInfer's base-2 lse taken as natural log
        l1 = l1 / np.log(2)
    o, lse = sp.merge_lse(*(torch.from_numpy(x) for x in (o1, l1, o2, l2)))
    return o.numpy(), lse.double().numpy()


@pytest.mark.parametrize("ctx,N,cut", [(300, 9, 256), (130, 1, 128), (64, 17, 0), (200, 33, 192)])
def test_the_two_halves_merged_equal_the_whole(ctx, N, cut):
    case = _case(ctx + N, ctx, N)
    ref_o, ref_l = mla_tree_attention(*case)
    o, lse = _merged(case, cut)
    assert np.abs(o - ref_o).max() / np.abs(ref_o).max() <= 1e-12
    assert np.abs(lse - ref_l).max() <= 1e-12


def test_the_merge_check_fails_on_an_unconverted_base_2_lse():
    """The checker above can fail: a base-2 lse read as natural log weights the halves wrongly."""
    case = _case(1, 300, 9)
    ref_o, _ = mla_tree_attention(*case)
    o, _ = _merged(case, 256, convert=False)
    assert np.abs(o - ref_o).max() / np.abs(ref_o).max() > 1e-3
    assert sp.lse2_to_ln(torch.tensor([1.0])).item() == pytest.approx(np.log(2))


def test_shifted_pages_read_the_rows_after_the_cut():
    rng = np.random.default_rng(0)
    b, P = 3, 6
    pages = torch.from_numpy(rng.permutation(b * P).astype(np.int32)).view(b, P)
    rows = torch.arange(b * P * PAGE).view(-1, 1)                       # pool row r holds the value r
    seq = torch.tensor([300, 130, 381], dtype=torch.int32)
    cut = torch.tensor(sp.split_rows([290, 129, 64], PAGE))
    assert cut.tolist() == [256, 128, 64]
    pt, seq_rest = sp.shift_pages(pages, seq, cut, PAGE)
    assert seq_rest.tolist() == [44, 2, 317] and pt.dtype == torch.int32
    for i in range(b):
        def row(table, j):
            return int(rows[table[i, j // PAGE] * PAGE + j % PAGE])
        want = [row(pages, j) for j in range(int(cut[i]), int(seq[i]))]
        assert [row(pt, j) for j in range(int(seq_rest[i]))] == want


def test_both_halves_empty_or_one_empty():
    o = torch.randn(2, 3, 5)
    lse = torch.randn(2, 3)
    empty = torch.full((2, 3), float("-inf"))
    got, l = sp.merge_lse(torch.full_like(o, float("nan")), empty, o, lse)   # an empty prefix's output
    assert torch.allclose(got, o) and torch.allclose(l, lse)
    got, l = sp.merge_lse(o, empty, o, empty)
    assert torch.isfinite(got).all() and torch.isneginf(l).all()


def test_shift_pages_checks_the_cut_when_asked_and_merge_promotes_every_input():
    pt = torch.arange(6, dtype=torch.int32).view(2, 3)
    seq = torch.tensor([100, 150], dtype=torch.int32)
    with pytest.raises(ValueError, match="prefix: expected whole pages of 64"):
        sp.shift_pages(pt, seq, torch.tensor([64, 70]), PAGE, check_values=True)
    with pytest.raises(ValueError, match="within \\[0, seq_len\\]"):
        sp.shift_pages(pt, seq, torch.tensor([128, 64]), PAGE, check_values=True)
    assert sp.shift_pages(pt, seq, torch.tensor([64, 128]), PAGE, check_values=True)[1].tolist() == [36, 22]
    o32, l32 = torch.randn(2, 4), torch.randn(2)
    o64, l64 = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    assert sp.merge_lse(o32, l32, o64, l64)[1].dtype == torch.float64


@pytest.mark.parametrize("call, needle", [
    (lambda: sp.split_rows([1, -1], PAGE), "committed\\[1\\]"),
    (lambda: sp.split_rows(5, PAGE), "committed: expected a list"),
    (lambda: sp.split_rows([5], 0), "page_size"),
    (lambda: sp.shift_pages(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32),
                            torch.zeros(2, dtype=torch.int32), PAGE), "page_table: expected int32"),
    (lambda: sp.shift_pages(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                            torch.zeros(2, dtype=torch.int32), PAGE), r"seq_len: expected an integer tensor"),
    (lambda: sp.shift_pages(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                            torch.zeros(2), PAGE), "prefix: expected an integer"),
    (lambda: sp.merge_lse(torch.zeros(2, 4), torch.zeros(2), torch.zeros(2, 5), torch.zeros(2)), "merge_lse"),
])
def test_bad_arguments_are_named(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("ctx,N,cut", [(4096, 1, 4032), (1000, 16, 960), (300, 65, 128)])
def test_verify_attn_over_the_shifted_pages_merges_into_the_whole(ctx, N, cut):
    """On the GPU: verify_attn over the rest's shifted page table (random page order), merged with the float64
    prefix half, against the float64 whole: within bf16 rounding (1e-2 relative)."""
    from kdtree.ops.verify_attn import verify_attn
    H, scale = 16, 0.1352
    g = torch.Generator().manual_seed(ctx + N)
    S = ctx + N
    pages = -(-S // PAGE)
    cache = (torch.randn(pages * PAGE, 576, generator=g) * 0.5).to(torch.bfloat16)
    q = (torch.randn(1, N, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    pool = torch.empty_like(cache)
    pool.view(pages, PAGE, 576)[perm.long()] = cache.view(pages, PAGE, 576)   # request page j: pool perm[j]
    rng = np.random.default_rng(N)
    tree = golden.ddtree(rng.standard_normal((15, 64)).astype(np.float32) * 2, N - 1) if N > 1 else None
    mask = golden.compile_tree(tree, 0, 0).mask if tree is not None else np.ones((1, 1), bool)
    c64, q64 = cache[:S].double().numpy(), q[0].double().numpy()
    ref, _ = mla_tree_attention(q64[..., :512], q64[..., 512:], c64[:, :512], c64[:, 512:], mask, scale)
    o1, l1 = prefix_attention(q64[..., :512], q64[..., 512:], c64[:cut, :512], c64[:cut, 512:], scale)
    dev = "cuda"
    pt, seq = sp.shift_pages(perm[None].to(dev), torch.tensor([S], dtype=torch.int32, device=dev),
                             torch.tensor([cut], device=dev), PAGE)
    o2, l2 = verify_attn(q.to(dev), pool.to(dev), pt, seq, torch.from_numpy(mask)[None].to(dev), scale)
    o, _ = sp.merge_lse(torch.from_numpy(o1).float().to(dev), torch.from_numpy(l1).float().to(dev),
                        o2[0], l2[0])
    got = o.double().cpu().numpy()
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-2
