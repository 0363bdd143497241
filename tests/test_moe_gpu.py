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
         MoeParam(3, 512, 2048, 3, 1)]


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


@pytest.mark.parametrize("tile_tokens", [None, 8, 16])
@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.T}-D{p.D}-I{p.I}-E{p.E}-k{p.k}{'-skew' if p.skew else ''}")
def test_moe_int4_matches_golden(p, tile_tokens):
    from kdtree import kernels
    x, ids, wts, p13, s13, p2, s2 = _case(p, seed=p.T * 131 + p.D + (tile_tokens or 0))
    mw = kernels.repack_moe(*(t.cuda() for t in (p13, s13, p2, s2)))
    out = kernels.moe_int4(x.cuda(), ids.cuda(), wts.cuda(), mw, tile_tokens=tile_tokens)
    ref = golden.moe_int4(x.float().numpy(), ids.numpy(), wts.numpy(), p13.numpy(), s13.float().numpy(),
                          p2.numpy(), s2.float().numpy())
    got = out.double().cpu().numpy()
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= 1e-2, err  # bf16 activations and workspace, fp32 accumulation


def test_moe_int4_rejects_expert_ids_out_of_range():
    from kdtree import kernels
    x, ids, wts, p13, s13, p2, s2 = _case(MoeParam(4, 64, 32, 4, 2), seed=9)
    ids[2, 1] = 4
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 4\)"):
        kernels.moe_int4(x.cuda(), ids.cuda(), wts.cuda(), kernels.repack_moe(*(t.cuda() for t in (p13, s13, p2, s2))))


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
                                              (3, 2, 4096, torch.int64, False), (64, 8, 384, torch.int32, True),
                                              (1024, 8, 384, torch.int64, False), (700, 3, 7, torch.int32, True)])
def test_moe_group_matches_golden(T, k, E, dtype, skew):
    """moe_group_* vs golden.group_pairs: offsets and active slots bit for bit; within an expert the pairs as a
    multiset (the kernel's order there is unspecified). Fresh random routing per case; an id out of range is
    dropped."""
    from kdtree import kernels
    g = torch.Generator().manual_seed(T * 7 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if skew:
        ids[: T * 3 // 4, 0] = E - 1
    ids[T // 2, 0] = E  # out of range: dropped by both
    ids = ids.to(dtype)
    w = torch.rand(T, k, generator=g)
    tok, pw, off, act = (t.cpu().numpy() for t in kernels._group_pairs_kernel(ids.cuda(), w.cuda(), E))
    rt, rw, ro, ra = golden.group_pairs(ids.numpy(), w.numpy(), E)
    assert np.array_equal(off, ro) and np.array_equal(act, ra)
    n = int(ro[-1])
    assert n == T * k - 1
    for e in range(E):
        a, b = slice(ro[e], ro[e + 1]), slice(ro[e], ro[e + 1])
        assert sorted(zip(tok[a].tolist(), pw[a].tolist())) == sorted(zip(rt[b].tolist(), rw[b].tolist()))
