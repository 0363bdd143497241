"""The fused decode layer: golden twins (kdtree.ops.decode_golden) against torch's own ops on the CPU, the
kernels (cuda/decode_fused.cu) against the twins, and the fused forward against the torch path (gpu)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kdtree.config import ModelArgs
from kdtree.model import Gate, RMSNorm, apply_rope
from kdtree.ops import decode_golden as gold

gpu = pytest.mark.gpu


def _bf(rng, *shape, scale=1.0):
    """Random bf16 values: (torch bf16 tensor, float64 array of the same values)."""
    t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).to(torch.bfloat16)
    return t, t.double().numpy()


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------- twins vs torch (CPU)
def test_rb_rounds_as_torch_does():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000) * 10.0 ** rng.integers(-8, 8, 10000), [0.0, -0.0, 1e38]])
    want = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(gold.rb(x), want)


@pytest.mark.parametrize("kind", ["none", "delta", "routed", "routed_shared"])
@torch.no_grad()
def test_add_rmsnorm_twin_matches_the_torch_layer_steps(kind):
    rng = np.random.default_rng(len(kind))
    M, D = 3, 256
    x, xn = _bf(rng, M, D)
    norm = RMSNorm(D, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(1 + 0.1 * rng.standard_normal(D).astype(np.float32)))
    w = norm.weight.detach().double().numpy()
    kw, ref_x = {}, x
    if kind == "delta":
        d, dn = _bf(rng, M, D)
        kw, ref_x = {"delta": dn}, x + d
    elif kind.startswith("routed"):
        r = torch.from_numpy(rng.standard_normal((M, D)).astype(np.float32))
        kw["routed"] = r.numpy()
        y = r.to(torch.bfloat16)
        if kind == "routed_shared":
            s, kw["shared"] = _bf(rng, M, D)
            y = y + s
        ref_x = x + y
    gx, gy = gold.add_rmsnorm(xn, w, 1e-6, **kw)
    np.testing.assert_array_equal(gx, ref_x.double().numpy())
    assert _rel(gy, norm(ref_x).double().numpy()) < 4e-3


@torch.no_grad()
def test_mla_latent_and_absorb_twins_match_the_torch_path():
    rng = np.random.default_rng(1)
    M, QL, R, P, H, Dn, Dv = 2, 96, 64, 16, 3, 32, 32
    qkv, qkvn = _bf(rng, M, QL + R + P)
    wq, wqn = _bf(rng, QL)
    wkv, wkvn = _bf(rng, R)
    ang = torch.from_numpy(rng.uniform(0, 6, (M, P // 2)).astype(np.float32))
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    q, rows = gold.mla_latent(qkvn, QL, R, wqn, wkvn, cos.double().numpy(), sin.double().numpy(), 1e-6, True)
    nq, nkv = RMSNorm(QL, 1e-6).to(torch.bfloat16), RMSNorm(R, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        nq.weight.copy_(wq)
        nkv.weight.copy_(wkv)
    assert _rel(q, nq(qkv[:, :QL]).double().numpy()) < 4e-3
    assert _rel(rows[:, :R], nkv(qkv[:, QL:QL + R]).double().numpy()) < 4e-3
    np.testing.assert_array_equal(rows[:, R:], apply_rope(qkv[:, QL + R:], cos, sin, True).double().numpy())
    qb, qbn = _bf(rng, M, H, Dn + P)
    wkvb, wkvbn = _bf(rng, H, Dn + Dv, R, scale=0.1)
    qk = gold.q_absorb(qbn, wkvbn, cos.double().numpy(), sin.double().numpy(), Dn, False)
    lat = torch.einsum("mhd,hdr->mhr", qb[..., :Dn].double(), wkvb[:, :Dn].double())
    assert _rel(qk[..., :R], lat.numpy()) < 4e-3
    np.testing.assert_array_equal(qk[..., R:], apply_rope(qb[..., Dn:], cos[:, None], sin[:, None],
                                                          False).double().numpy())
    ol, oln = _bf(rng, M, H, R)
    o = torch.einsum("mhr,hdr->mhd", ol.double(), wkvb[:, Dn:].double()).reshape(M, -1)
    assert _rel(gold.uv_absorb(oln, wkvbn, Dn), o.numpy()) < 4e-3


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
@torch.no_grad()
def test_router_twins_match_gate_forward(groups):
    rng = np.random.default_rng(groups[0])
    args = ModelArgs(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=groups[0],
                     topk_group=groups[1], routed_scaling_factor=2.827)
    gate = Gate(args)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16))
        gate.e_score_correction_bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(4))
    x, xn = _bf(rng, 5, 64)
    scores = gold.router_scores(xn, gate.weight.double().numpy())
    ref = gate.scores(x.float())
    assert _rel(scores, ref.numpy()) < 1e-6
    w, ids = gold.router_select(ref.numpy(), gate.e_score_correction_bias.numpy(), *groups, 4, True, 2.827)
    rw, rids = gate(x.float(), ref)
    np.testing.assert_array_equal(ids, rids.numpy())
    np.testing.assert_allclose(w, rw.numpy(), rtol=1e-6)


def test_silu_mul_twin_matches_torch():
    rng = np.random.default_rng(2)
    g, gn = _bf(rng, 4, 64, scale=3)
    u, un = _bf(rng, 4, 64)
    np.testing.assert_array_equal(gold.silu_mul(gn, un), (F.silu(g) * u).double().numpy())


def test_wrappers_name_the_bad_argument_before_the_device():
    from kdtree.ops import decode as dec
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w:"):
        dec.add_rmsnorm(x, torch.zeros(32, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="x:"):
        dec.add_rmsnorm(torch.zeros(2, 63, dtype=torch.bfloat16), torch.zeros(63, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        dec.add_rmsnorm(x, torch.zeros(64, dtype=torch.bfloat16), float("nan"))
    with pytest.raises(ValueError, match="routed"):
        dec.add_rmsnorm(x, torch.zeros(64, dtype=torch.bfloat16), 1e-6, routed=x)
    with pytest.raises(ValueError, match="k="):
        dec.router_select(torch.zeros(2, 16), torch.zeros(16), 1, 1, 0, True, 1.0)
    with pytest.raises(ValueError, match="n_group"):
        dec.router_select(torch.zeros(2, 16), torch.zeros(16), 3, 1, 2, True, 1.0)
    with pytest.raises(ValueError, match="g, u"):
        dec.silu_mul(torch.zeros(2, 12, dtype=torch.bfloat16), torch.zeros(2, 12, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="wkvb"):
        bf = torch.bfloat16
        dec.q_absorb(torch.zeros(1, 2, 80, dtype=bf), torch.zeros(2, 96, 100, dtype=bf),
                     torch.zeros(1, 8, dtype=bf), torch.zeros(1, 8, dtype=bf), 64, True)
    with pytest.raises(ValueError, match="CUDA"):
        dec.add_rmsnorm(x, torch.zeros(64, dtype=torch.bfloat16), 1e-6)


def test_fused_path_declines_a_cpu_model(tiny):
    from kdtree import fused
    from kdtree.model import AttnMeta
    _, args, model = tiny
    meta = AttnMeta(None, None, torch.zeros(1, 1, dtype=torch.long), None, None, None, 64, 64)
    assert "CUDA" in fused.unsupported(model, meta)


# ----------------------------------------------------------------------------- kernels vs twins (GPU)
@pytest.fixture
def dec_gpu(poison_outputs):
    from kdtree.ops import decode
    return decode


@gpu
@pytest.mark.parametrize("M,D", [(1, 7168), (5, 256), (33, 2048), (2, 24), (3, 40960)])   # 40960: read back
@pytest.mark.parametrize("kind", ["none", "delta", "routed", "routed_shared"])
def test_add_rmsnorm_kernel_matches_twin(dec_gpu, M, D, kind):
    rng = np.random.default_rng(M * D + len(kind))
    x, xn = _bf(rng, M, D)
    w, wn = _bf(rng, D)
    kw, gkw = {}, {}
    if kind == "delta":
        d, gkw["delta"] = _bf(rng, M, D)
        kw["delta"] = d.cuda()
    elif kind.startswith("routed"):
        r = torch.from_numpy(rng.standard_normal((M, D)).astype(np.float32))
        kw["routed"], gkw["routed"] = r.cuda(), r.numpy()
        if kind == "routed_shared":
            s, gkw["shared"] = _bf(rng, M, D)
            kw["shared"] = s.cuda()
    xo, y = dec_gpu.add_rmsnorm(x.cuda(), w.cuda(), 1e-5, **kw)
    gx, gy = gold.add_rmsnorm(xn, wn, 1e-5, **gkw)
    np.testing.assert_array_equal(xo.double().cpu().numpy(), gx)
    assert _rel(y.double().cpu().numpy(), gy) < 1e-2
    assert not torch.isnan(y).any()


@gpu
@pytest.mark.parametrize("M,QL,interleave", [(1, 1536, True), (7, 0, False), (40, 128, True)])
def test_mla_latent_kernel_matches_twin(dec_gpu, M, QL, interleave):
    rng = np.random.default_rng(M + QL)
    R, P, rows = 512, 64, 256
    qkv, qkvn = _bf(rng, M, QL + R + P)
    wq, wqn = _bf(rng, QL)
    wkv, wkvn = _bf(rng, R)
    cos, cn = _bf(rng, M, P // 2)
    sin, sn = _bf(rng, M, P // 2)
    slots = torch.from_numpy(rng.permutation(rows)[:M].astype(np.int64))
    pool = torch.full((rows, R + P), float("nan"), dtype=torch.bfloat16, device="cuda")
    q = dec_gpu.mla_latent(qkv.cuda(), wq.cuda() if QL else None, wkv.cuda(), cos.cuda(), sin.cuda(),
                           slots.cuda(), pool, 1e-6, interleave)
    gq, grows = gold.mla_latent(qkvn, QL, R, wqn, wkvn, cn, sn, 1e-6, interleave)
    got = pool[slots.cuda()].double().cpu().numpy()
    if QL:
        assert _rel(q.double().cpu().numpy(), gq) < 1e-2
    assert _rel(got[:, :R], grows[:, :R]) < 1e-2
    np.testing.assert_array_equal(got[:, R:], grows[:, R:])
    others = np.setdiff1d(np.arange(rows), slots.numpy())
    assert torch.isnan(pool[torch.from_numpy(others).cuda()]).all()   # no other row written


@gpu
@pytest.mark.parametrize("M,H", [(1, 64), (9, 8), (32, 16)])
def test_absorb_kernels_match_twins(dec_gpu, M, H):
    rng = np.random.default_rng(M * H)
    Dn, Dv, R, P = 128, 128, 512, 64
    qb, qbn = _bf(rng, M, H, Dn + P)
    w, wn = _bf(rng, H, Dn + Dv, R, scale=0.1)
    cos, cn = _bf(rng, M, P // 2)
    sin, sn = _bf(rng, M, P // 2)
    qk = dec_gpu.q_absorb(qb.cuda(), w.cuda(), cos.cuda(), sin.cuda(), Dn, True)
    gqk = gold.q_absorb(qbn, wn, cn, sn, Dn, True)
    assert _rel(qk[..., :R].double().cpu().numpy(), gqk[..., :R]) < 1e-2
    np.testing.assert_array_equal(qk[..., R:].double().cpu().numpy(), gqk[..., R:])
    ol, oln = _bf(rng, M, H, R)
    o = dec_gpu.uv_absorb(ol.cuda(), w.cuda(), Dn)
    assert _rel(o.double().cpu().numpy(), gold.uv_absorb(oln, wn, Dn)) < 1e-2


@gpu
@pytest.mark.parametrize("M,E,D,k,groups", [(1, 384, 7168, 8, (1, 1)), (9, 384, 7168, 8, (1, 1)),
                                            (130, 256, 512, 8, (8, 4)), (3, 16, 64, 4, (4, 2)),
                                            (2, 100, 256, 6, (4, 2)), (4, 200, 128, 8, (8, 3)),
                                            (5, 500, 512, 8, (1, 1)), (1, 1024, 256, 32, (8, 4))])
def test_router_kernels_match_twins(dec_gpu, M, E, D, k, groups):
    rng = np.random.default_rng(M + E)
    x, xn = _bf(rng, M, D)
    w, wn = _bf(rng, E, D, scale=D ** -0.5)
    s = dec_gpu.router_scores(x.cuda(), w.cuda())
    assert _rel(s.double().cpu().numpy(), gold.router_scores(xn, wn)) < 1e-5
    bias = torch.from_numpy(rng.standard_normal(E).astype(np.float32) * 0.05)
    for b in (bias, bias.to(torch.bfloat16)):
        wt, ids = dec_gpu.router_select(s, b.cuda(), *groups, k, True, 2.827)
        gw, gids = gold.router_select(s.cpu().numpy(), b.float().numpy(), *groups, k, True, 2.827)
        np.testing.assert_array_equal(ids.cpu().numpy(), gids)
        np.testing.assert_array_equal(wt.cpu().numpy(), gw)


@gpu
def test_router_select_checker_can_fail(dec_gpu):
    """The selection compared with the twin on other bias values differs: the check sees a wrong answer."""
    rng = np.random.default_rng(9)
    s = torch.from_numpy(rng.random((4, 384)).astype(np.float32)).cuda()
    bias = torch.from_numpy(rng.standard_normal(384).astype(np.float32) * 0.05)
    _, ids = dec_gpu.router_select(s, bias.cuda(), 1, 1, 8, True, 1.0)
    _, gids = gold.router_select(s.cpu().numpy(), -bias.numpy(), 1, 1, 8, True, 1.0)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(ids.cpu().numpy(), gids)


@gpu
@pytest.mark.parametrize("M,I,fused", [(1, 2048, True), (9, 2048, False), (3, 18432, True)])
def test_silu_mul_kernel_matches_twin(dec_gpu, M, I, fused):
    rng = np.random.default_rng(M + I)
    gu, gun = _bf(rng, M, 2 * I, scale=2)
    if fused:
        out = dec_gpu.silu_mul(gu.cuda()[:, :I], gu.cuda()[:, I:])
    else:
        out = dec_gpu.silu_mul(gu[:, :I].contiguous().cuda(), gu[:, I:].contiguous().cuda())
    np.testing.assert_array_equal(out.double().cpu().numpy(), gold.silu_mul(gun[:, :I], gun[:, I:]))


# ----------------------------------------------------------------------------- fused forward vs torch (GPU)
@gpu
@pytest.mark.parametrize("B,T,ctx", [(1, 1, 300), (2, 9, 130), (4, 9, 70)])
def test_fused_forward_matches_the_torch_path(B, T, ctx, paged_block, fused_model):
    """forward_paged's fused layers against Block.forward (model.fused False): logits, the requested hidden
    states and the latent rows written, for decode, a tree block, and more rows than the absorb kernels
    take."""
    from kdtree import fused
    m = fused_model(3)
    L = m.args.num_hidden_layers
    pool, meta, tokens = paged_block(m, B, T, ctx)
    assert fused.unsupported(m, meta) is None
    outs = {}
    for f in (True, False):
        m.fused = f
        p = pool.clone()
        out = m.forward_paged(tokens, p, meta, hidden_layers=(0, L - 1))
        outs[f] = (out, p)
    (a, pa), (b, pb) = outs[True], outs[False]
    rel = (a.logits - b.logits).double().norm() / b.logits.double().norm()
    assert rel < 1e-2, rel
    for i in (0, L - 1):
        assert ((a.hidden[i] - b.hidden[i]).double().norm() / b.hidden[i].double().norm()) < 1e-2
    assert ((pa.double() - pb.double()).norm() / pb.double().norm()) < 1e-3
    m.fused = True
    bad = m.forward_paged(tokens, pool.clone()[[1, 0, *range(2, L)]], meta)  # layers' caches swapped: caught
    assert (bad.logits - b.logits).double().norm() / b.logits.double().norm() > 1e-2


# ----------------------------------------------------------------------------- skinny GEMM (ops.gemv)
def test_gemv_names_the_bad_argument_before_the_device():
    from kdtree.ops.gemv import gemv
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="x:"):
        gemv(torch.zeros(2, 12, dtype=bf), torch.zeros(4, 12, dtype=bf))
    with pytest.raises(ValueError, match="w:"):
        gemv(torch.zeros(2, 16, dtype=bf), torch.zeros(4, 8, dtype=bf))
    with pytest.raises(ValueError, match="CUDA"):
        gemv(torch.zeros(2, 16, dtype=bf), torch.zeros(4, 16, dtype=bf))


@gpu
@pytest.mark.parametrize("M,N,K", [(1, 2112, 7168), (8, 384, 7168), (9, 12288, 1536), (16, 100, 2056),
                                   (3, 7168, 8192)])
def test_gemv_matches_twin(poison_outputs, M, N, K):
    from kdtree.ops import gemv_golden
    from kdtree.ops.gemv import gemv
    rng = np.random.default_rng(M + N + K)
    x, xn = _bf(rng, M, K)
    w, wn = _bf(rng, N, K, scale=K ** -0.5)
    y = gemv(x.cuda(), w.cuda())
    want = gemv_golden.gemv(xn, wn)
    assert _rel(y.double().cpu().numpy(), want) < 1e-2 and not torch.isnan(y).any()
    with pytest.raises(AssertionError):   # the check sees a wrong answer: another weight row order
        assert _rel(y.double().cpu().numpy(), gemv_golden.gemv(xn, wn[::-1])) < 1e-2
