"""kdtree.ops.flashinfer_prefix: refusals before any work (CPU), and on a GPU with flashinfer installed the
prefix pass against the float64 twin and merged with verify_attn into the whole."""
import numpy as np
import pytest
import torch

from kdtree import golden
from kdtree.ops import attn_split as sp
from kdtree.ops import flashinfer_prefix as fp
from kdtree.ops.verify_attn_golden import mla_tree_attention, prefix_attention

PAGE = 64


def test_arguments_are_named_before_flashinfer_is_needed():
    with pytest.raises(ValueError, match="heads"):
        fp.FlashInferPrefix(0, 0.1, 1, 1)
    with pytest.raises(ValueError, match="scale"):
        fp.FlashInferPrefix(8, float("nan"), 1, 1)
    with pytest.raises(ValueError, match="scale=True"):
        fp.FlashInferPrefix(8, True, 1, 1)
    with pytest.raises(ValueError, match="graph"):
        fp.FlashInferPrefix(8, 0.1, 1, 1, graph="yes")
    for bad in ("cpu", "gpu:x", 3.5):
        with pytest.raises(ValueError, match="expected a CUDA device"):
            fp.FlashInferPrefix(8, 0.1, 1, 1, device=bad)
    with pytest.raises(ValueError, match="backend"):
        fp.FlashInferPrefix(8, 0.1, 1, 1, backend="fa9")


def test_without_flashinfer_the_reason_is_given(monkeypatch):
    def absent():
        raise ImportError("No module named 'flashinfer'")
    fp._flashinfer.cache_clear()
    monkeypatch.setattr(fp, "_flashinfer", absent)
    assert "No module named 'flashinfer'" in fp.available()
    with pytest.raises(ValueError, match="flashinfer is not usable here"):
        fp.FlashInferPrefix(8, 0.1, 1, 1)


def _need_flashinfer():
    why = fp.available()
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("b,ctx,N,cuts", [(1, 4096, 1, [4032]), (3, 1000, 16, [960, 0, 512]),
                                         (2, 300, 65, [128, 192])])
def test_the_prefix_pass_merged_with_verify_attn_is_the_whole(b, ctx, N, cuts):
    """FlashInfer over each request's prefix (in place on a shuffled pool), verify_attn over the shifted rest,
    merged: against the float64 whole within bf16 rounding; the prefix alone against prefix_attention."""
    _need_flashinfer()
    from kdtree.ops.verify_attn import verify_attn
    H, scale, dev = 16, 0.1352, "cuda"
    g = torch.Generator().manual_seed(ctx + N)
    S = ctx + N
    per = -(-S // PAGE)
    cache = (torch.randn(b * per * PAGE, 576, generator=g) * 0.5).to(torch.bfloat16)
    q = (torch.randn(b, N, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    perm = torch.randperm(b * per, generator=g).to(torch.int32)
    pool = torch.empty_like(cache)
    pool.view(-1, PAGE, 576)[perm.long()] = cache.view(-1, PAGE, 576)
    table = perm.view(b, per)                      # request i's page j sits at pool page table[i, j]
    tree = golden.ddtree(np.random.default_rng(N).standard_normal((15, 64)).astype(np.float32) * 2, N - 1) \
        if N > 1 else None
    mask = golden.compile_tree(tree, 0, 0).mask if tree is not None else np.ones((1, 1), bool)
    pre = fp.FlashInferPrefix(H, scale, max_batch=b, max_pages=per)
    pre.plan(cuts, N, table.to(dev))
    o1, l1 = pre.run(q.to(dev), pool.to(dev))
    pt, seq = sp.shift_pages(table.to(dev), torch.full((b,), S, dtype=torch.int32, device=dev),
                             torch.tensor(cuts, device=dev), PAGE)
    masks = torch.from_numpy(mask)[None].expand(b, N, N).contiguous().to(dev)
    o2, l2 = verify_attn(q.to(dev), pool.to(dev), pt, seq, masks, scale)
    o, _ = sp.merge_lse(o1, l1, o2, l2)
    for i in range(b):
        c = cache[i * per * PAGE:i * per * PAGE + S].double().numpy()
        qi = q[i].double().numpy()
        ref, _ = mla_tree_attention(qi[..., :512], qi[..., 512:], c[:, :512], c[:, 512:], mask, scale)
        got = o[i].double().cpu().numpy()
        assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-2, i
        if cuts[i]:
            ref1, lse1 = prefix_attention(qi[..., :512], qi[..., 512:], c[:cuts[i], :512], c[:cuts[i], 512:],
                                          scale)
            assert np.abs(o1[i].double().cpu().numpy() - ref1).max() / np.abs(ref1).max() <= 1e-2
            assert np.abs(l1[i].double().cpu().numpy() - lse1).max() <= 1e-2
        else:
            assert torch.isneginf(l1[i]).all()
    with pytest.raises(ValueError, match=f"exactly {b}"):   # graph mode: one batch size a wrapper
        pre.plan(cuts + [0], N, table.to(dev))


@pytest.mark.gpu
@pytest.mark.parametrize("first,N", [([640, 320], 4), ([0, 0], 4), ([0, 0], 9)],
                         ids=["captured-with-rows", "captured-empty", "captured-empty-N9"])
def test_a_captured_prefix_pass_replays_after_each_new_plan(first, N):
    """graph=True: run() captured once after a plan of `first` (an engine captures its rounds on padding
    slots: every prefix empty), then planned again with other prefix rows (the same batch and nodes) and
    replayed: each replay against the float64 prefix twin; an empty prefix gives lse -inf."""
    _need_flashinfer()
    H, scale, b, per, dev = 16, 0.1352, 2, 20, "cuda"   # N x H above 64: FlashInfer's two-CTA clusters
    g = torch.Generator().manual_seed(7)
    cache = (torch.randn(b * per * PAGE, 576, generator=g) * 0.5).to(torch.bfloat16)
    q = (torch.randn(b, N, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    table = torch.arange(b * per, dtype=torch.int32).view(b, per)
    pool_d, q_d, table_d = cache.to(dev), q.to(dev), table.to(dev)
    pre = fp.FlashInferPrefix(H, scale, max_batch=b, max_pages=per)
    pre.plan(first, N, table_d)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pre.run(q_d, pool_d)   # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = pre.run(q_d, pool_d)
    for rows in ([640, 320], [1216, 64], [0, 960]):
        pre.plan(rows, N, table_d)
        graph.replay()
        torch.cuda.synchronize()
        for i, r in enumerate(rows):
            if r == 0:
                assert torch.isneginf(lse[i]).all()
                continue
            c = cache[i * per * PAGE:i * per * PAGE + r].double().numpy()
            qi = q[i].double().numpy()
            ref, ref_l = prefix_attention(qi[..., :512], qi[..., 512:], c[:, :512], c[:, 512:], scale)
            got = o[i].double().cpu().numpy()
            assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-2, (rows, i)
            assert np.abs(lse[i].double().cpu().numpy() - ref_l).max() <= 1e-2, (rows, i)


@pytest.mark.gpu
def test_a_whole_pass_reads_partial_pages_and_replays():
    """plan(..., whole=True): rows that end inside a page (a one-row block's every key, its own included),
    captured after an empty plan and replayed after each new one, against the float64 attention over exactly
    those rows; a partial row count without whole=True is refused."""
    _need_flashinfer()
    H, scale, b, per, dev = 16, 0.1352, 2, 20, "cuda"
    g = torch.Generator().manual_seed(11)
    cache = (torch.randn(b * per * PAGE, 576, generator=g) * 0.5).to(torch.bfloat16)
    q = (torch.randn(b, 1, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    table = torch.randperm(b * per, generator=g).to(torch.int32).view(b, per)
    pool = torch.empty_like(cache)
    pool.view(-1, PAGE, 576)[table.view(-1).long()] = cache.view(-1, PAGE, 576)
    pool_d, q_d, table_d = pool.to(dev), q.to(dev), table.to(dev)
    pre = fp.FlashInferPrefix(H, scale, max_batch=b, max_pages=per)
    with pytest.raises(ValueError, match=r"rows\[0\]=645: expected a whole number of pages of 64"):
        pre.plan([645, 64], 1, table_d)
    pre.plan([0, 0], 1, table_d, whole=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pre.run(q_d, pool_d)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = pre.run(q_d, pool_d)
    for rows in ([645, 1], [64, 1279], [700, 701]):
        pre.plan(rows, 1, table_d, whole=True)
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, r in enumerate(rows):
            c = cache[i * per * PAGE:i * per * PAGE + r].double().numpy()
            qi = q[i].double().numpy()
            ref, _ = prefix_attention(qi[..., :512], qi[..., 512:], c[:, :512], c[:, 512:], scale)
            got = o[i].double().cpu().numpy()
            assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-2, (rows, i)
