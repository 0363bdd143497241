"""cuda/moe_int4.cu against golden.moe_int4 (marker gpu: skipped with a reason where no GPU is present)."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kdtree import golden, quant

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


@dataclass
class MoeParam:
    T: int        # tokens
    D: int        # hidden
    I: int        # expert intermediate
    E: int        # experts
    k: int        # experts per token
    skew: bool = False  # route most tokens to expert 0 (many passes of 8 or 16 pairs)


CASES = [MoeParam(1, 64, 32, 4, 1), MoeParam(5, 256, 64, 8, 2), MoeParam(64, 512, 128, 16, 8),
         MoeParam(300, 256, 96, 16, 4), MoeParam(200, 128, 64, 8, 2, skew=True), MoeParam(2, 7168, 256, 4, 2),
         MoeParam(3, 512, 2048, 3, 1), MoeParam(32, 256, 64, 8, 2, skew=True), MoeParam(3, 768, 96, 6, 2)]


def _case(p: MoeParam, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = [quant.quantize(torch.randn(2 * p.I, p.D, generator=g) / p.D ** 0.5) for _ in range(p.E)]
    w2 = [quant.quantize(torch.randn(p.D, p.I, generator=g) / p.I ** 0.5) for _ in range(p.E)]
    p13, s13 = quant.stack_experts(w13)
    p2, s2 = quant.stack_experts(w2)
    x = torch.randn(p.T, p.D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(p.E, generator=g)[:p.k] for _ in range(p.T)]).to(torch.int32)
    if p.skew:
        ids[: p.T * 3 // 4, 0] = 0
        ids[: p.T * 3 // 4, 1:] = torch.randint(1, p.E, (p.T * 3 // 4, p.k - 1), generator=g)
    wts = torch.rand(p.T, p.k, generator=g)
    return x, ids, wts, p13, s13, p2, s2


def _check_golden(out, x, ids, wts, p13, s13, p2, s2):
    ref = golden.moe_int4(x.float().numpy(), ids.numpy(), wts.numpy(), p13.numpy(), s13.float().numpy(),
                          p2.numpy(), s2.float().numpy())
    got = out.double().cpu().numpy()
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= 1e-2, err  # bf16 activations and workspace, fp32 accumulation


def _replay_golden(g, out, statics, cases, weights):
    """Each case's (x, ids, wts) copied into the captured graph's inputs, `out` poisoned, g replayed, checked
    against the golden twin."""
    for x, ids, wts in cases:
        for dst, src in zip(statics, (x, ids, wts)):
            dst.copy_(src.cuda())
        out.fill_(float("nan"))
        g.replay()
        _check_golden(out, x, ids, wts, *weights)


# (tile_tokens, fused, item_pairs): 8-, 16- and 32-pair passes of the grouped path (one pass a work item), the
# one-launch path (small cases), the default, then items of several passes (an expert's passes in order in
# one block: 10**6 pairs) and items that are not a multiple of the pass
MODES = [(8, False, None), (16, False, None), (32, False, None), (8, True, None), (None, None, None),
         (8, False, 10 ** 6), (16, False, 10 ** 6), (16, False, 24), (8, False, 3)]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"tile{m[0]}-fused{m[1]}-items{m[2]}")
@pytest.mark.parametrize("p", CASES,
                         ids=lambda p: f"T{p.T}-D{p.D}-I{p.I}-E{p.E}-k{p.k}{'-skew' if p.skew else ''}")
def test_moe_int4_matches_golden(p, mode):
    from kdtree import kernels
    tile_tokens, fused, item_pairs = mode
    if fused and p.T * p.k > kernels.FUSED_MAX_PAIRS:
        pytest.skip(f"the fused path takes at most {kernels.FUSED_MAX_PAIRS} pairs (this case: {p.T * p.k})")
    seed = p.T * 131 + p.D + (tile_tokens or 0) + 7 * bool(fused) + (item_pairs or 0) % 1000
    x, ids, wts, p13, s13, p2, s2 = _case(p, seed=seed)
    mw = kernels.repack_moe(*(t.cuda() for t in (p13, s13, p2, s2)))
    out = kernels.moe_int4(x.cuda(), ids.cuda(), wts.cuda(), mw, tile_tokens=tile_tokens, fused=fused,
                           item_pairs=item_pairs)
    _check_golden(out, x, ids, wts, p13, s13, p2, s2)


def test_moe_grouped_graph_replays_new_routing():
    """The grouped path captured once (its work items sized from the shapes alone) replays routings it was not
    captured with: spread over the experts, then every token on the same two experts (many work items of one
    expert), each against the golden twin."""
    from kdtree import kernels
    p = MoeParam(48, 512, 128, 16, 4)
    x, ids, wts, p13, s13, p2, s2 = _case(p, seed=41)
    mw = kernels.repack_moe(*(t.cuda() for t in (p13, s13, p2, s2)))
    xs, ids_s, w_s = x.cuda(), ids.cuda(), wts.cuda()
    kernels.moe_int4(xs, ids_s, w_s, mw, fused=False)  # the module loaded before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kernels.moe_int4(xs, ids_s, w_s, mw, fused=False, check_values=False)
    cases = [_case(p, seed=42)[:3], _case(p, seed=43)[:3]]
    cases[1][1][:, 0], cases[1][1][:, 1] = 3, 11
    _replay_golden(g, out, (xs, ids_s, w_s), cases, (p13, s13, p2, s2))


def test_moe_int4_past_the_grouping_kernels_experts():
    """More experts than moe_group holds: torch groups the pairs and builds the work items; same answer."""
    from kdtree import kernels
    p = MoeParam(24, 64, 32, kernels.MAX_GROUP_EXPERTS + 4, 2, skew=True)
    x, ids, wts, p13, s13, p2, s2 = _case(p, seed=51)
    ids[:, 1] = kernels.MAX_GROUP_EXPERTS + 1  # an expert past the kernel's reach, with every token
    mw = kernels.repack_moe(*(t.cuda() for t in (p13, s13, p2, s2)))
    out = kernels.moe_int4(x.cuda(), ids.cuda(), wts.cuda(), mw, fused=False)
    _check_golden(out, x, ids, wts, p13, s13, p2, s2)


def test_moe_fused_repeated_calls_int64_ids_and_a_graph():
    """The fused kernel's counters return to zero after every call: many calls in a row (fresh inputs each,
    int32 and int64 ids, 1..8 tokens), then a captured graph replayed on new inputs."""
    from kdtree import kernels
    p = MoeParam(8, 512, 128, 24, 8)
    _, _, _, p13, s13, p2, s2 = _case(p, seed=11)
    mw = kernels.repack_moe(*(t.cuda() for t in (p13, s13, p2, s2)))
    for i in range(12):
        q = MoeParam(1 + i % 8, p.D, p.I, p.E, p.k)
        x, ids, wts, *_ = _case(q, seed=100 + i)
        ids_dev = ids.cuda().to(torch.int64 if i % 2 else torch.int32)
        out = kernels.moe_int4(x.cuda(), ids_dev, wts.cuda(), mw, fused=True)
        _check_golden(out, x, ids, wts, p13, s13, p2, s2)
    x, ids, wts, *_ = _case(p, seed=200)
    xs, ids_s, w_s = x.cuda(), ids.cuda(), wts.cuda()
    kernels.moe_int4(xs, ids_s, w_s, mw, fused=True)  # the module loaded before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kernels.moe_int4(xs, ids_s, w_s, mw, fused=True, check_values=False)
    _replay_golden(g, out, (xs, ids_s, w_s), [_case(p, seed=s)[:3] for s in (201, 202)], (p13, s13, p2, s2))
    x, ids, wts, *_ = _case(p, seed=203)  # eager calls keep working after the replays
    _check_golden(kernels.moe_int4(x.cuda(), ids.cuda(), wts.cuda(), mw, fused=True), x, ids, wts, p13, s13,
                  p2, s2)


def test_moe_fused_drops_ids_outside_the_experts_like_the_grouped_path():
    """Expert parallelism marks another rank's experts -1: both paths skip those pairs."""
    from kdtree import kernels
    p = MoeParam(6, 256, 64, 8, 4)
    x, ids, wts, p13, s13, p2, s2 = _case(p, seed=31)
    ids[0, 1] = -1
    ids[3, :] = -1  # a token with no local expert: its output is zero
    mw = kernels.repack_moe(*(t.cuda() for t in (p13, s13, p2, s2)))
    got = kernels.moe_int4(x.cuda(), ids.cuda(), wts.cuda(), mw, check_values=False, fused=True)
    want = kernels.moe_int4(x.cuda(), ids.cuda(), wts.cuda(), mw, check_values=False, fused=False)
    assert float(got[3].abs().max()) == 0.0 and float(want.norm()) > 0
    assert float((got - want).norm() / want.norm()) <= 1e-5


def test_moe_int4_rejects_expert_ids_out_of_range():
    from kdtree import kernels
    x, ids, wts, p13, s13, p2, s2 = _case(MoeParam(4, 64, 32, 4, 2), seed=9)
    ids[2, 1] = 4
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 4\)"):
        kernels.moe_int4(x.cuda(), ids.cuda(), wts.cuda(),
                         kernels.repack_moe(*(t.cuda() for t in (p13, s13, p2, s2))))


def test_int4_experts_kernel_path_matches_reference_path():
    """The model's Int4Experts: the kernel (bf16 on the GPU) against its dequantizing reference path."""
    from kdtree.model import Int4Experts
    g = torch.Generator(device="cuda").manual_seed(5)
    ex = Int4Experts.random(16, 256, 64, device="cuda", seed=3, scale=0.02)
    x = torch.randn(40, 256, device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.randn(40, 16, device="cuda", generator=g)
    w, ids = scores.softmax(-1).topk(4, dim=-1)
    got = ex(x, w, ids)
    ref = ex(x.float(), w, ids)  # float32 input takes the reference path
    assert (ref.norm() > 0) and float((got - ref).norm() / ref.norm()) <= 1e-2


@pytest.mark.parametrize("T,k,E,dtype,skew", [(1, 1, 4, torch.int32, False), (1, 8, 384, torch.int32, False),
                                              (3, 2, 4096, torch.int64, False),
                                              (64, 8, 384, torch.int32, True),
                                              (1024, 8, 384, torch.int64, False),
                                              (700, 3, 7, torch.int32, True)])
def test_moe_group_matches_golden(T, k, E, dtype, skew):
    """moe_group_* vs golden.group_pairs and group_items: offsets, active slots and work items bit for bit
    (the items' spare rows poisoned first); within an expert the pairs as
    a multiset (the kernel's order there is unspecified). Fresh random routing per case; an id out of range is
    dropped."""
    from kdtree import kernels
    g = torch.Generator().manual_seed(T * 7 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if skew:
        ids[: T * 3 // 4, 0] = E - 1
    ids[T // 2, 0] = E  # out of range: dropped by both
    ids = ids.to(dtype)
    w = torch.rand(T, k, generator=g)
    chunk = 1 + (T * k) % 13  # work items of 1..13 pairs
    got = kernels._group_kernel(ids.cuda(), w.cuda(), E, chunk)
    tok, pw, off, act, items = (t.cpu().numpy() for t in got)
    rt, rw, ro, ra = golden.group_pairs(ids.numpy(), w.numpy(), E)
    assert np.array_equal(off, ro) and np.array_equal(act, ra)
    Y = kernels.item_rows(T * k, min(E, T * k), chunk)
    assert np.array_equal(items, golden.group_items(ro, chunk, Y))
    n = int(ro[-1])
    assert n == T * k - 1
    for e in range(E):
        a, b = slice(ro[e], ro[e + 1]), slice(ro[e], ro[e + 1])
        assert sorted(zip(tok[a].tolist(), pw[a].tolist())) == sorted(zip(rt[b].tolist(), rw[b].tolist()))
