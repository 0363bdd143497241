"""cuda/moe_bf16.cu against golden.moe_bf16 (the GPU cases carry the marker gpu: skipped with a reason where
no GPU is present), its wrapper's argument checks, and the fused path taking it for bf16 experts."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kdtree import golden
from kdtree.ops import moe_bf16 as mbf

gpu = pytest.mark.gpu


@dataclass
class Case:
    T: int
    D: int
    I: int
    E: int
    k: int
    skew: bool = False   # most tokens on expert 0: more than one pass of PC pairs


CASES = [Case(1, 2048, 512, 32, 4), Case(1, 64, 32, 4, 1), Case(5, 256, 72, 8, 2), Case(16, 512, 128, 16, 8),
         Case(40, 264, 96, 8, 2, skew=True), Case(3, 7168, 256, 4, 2), Case(32, 256, 64, 16, 8),
         Case(256, 64, 32, 4, 1, skew=True)]   # the last two: MAX_PAIRS pairs, 192 on one expert
TOL = 1e-3   # against the twin with h rounded to bf16 as the kernel keeps it: fp32 sums, rare 1-ulp h ties


def _case(p: Case, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(p.E, 2 * p.I, p.D, generator=g) / p.D ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(p.E, p.D, p.I, generator=g) / p.I ** 0.5).to(torch.bfloat16)
    x = torch.randn(p.T, p.D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(p.E, generator=g)[:p.k] for _ in range(p.T)]).to(torch.int64)
    if p.skew:
        ids[: p.T * 3 // 4, 0] = 0
        ids[: p.T * 3 // 4, 1:] = torch.randint(1, p.E, (p.T * 3 // 4, p.k - 1), generator=g)
    wts = torch.rand(p.T, p.k, generator=g)
    return [t.to(device) for t in (x, ids, wts, w13, w2)]


def rel_err(got: torch.Tensor, ref: np.ndarray) -> float:
    got = got.double().cpu().numpy()
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _golden(x, ids, wts, w13, w2, round_h=True):
    return golden.moe_bf16(x.float().cpu().numpy(), ids.cpu().numpy(), wts.cpu().numpy(),
                           w13.float().cpu().numpy(), w2.float().cpu().numpy(), round_h=round_h)


def test_the_checker_fails_on_a_wrong_answer():
    x, ids, wts, w13, w2 = _case(Case(3, 64, 32, 4, 2), 0)
    ref = _golden(x, ids, wts, w13, w2)
    wrong = torch.from_numpy(ref).clone()
    wrong[1, 5] += 0.5 * np.abs(ref).max()
    assert rel_err(torch.from_numpy(ref), ref) == 0.0
    assert rel_err(wrong, ref) > TOL
    assert rel_err(torch.full_like(wrong, float("nan")), ref) == float("inf")   # poisoned, never written
    # h kept at fp32 instead of bf16 (the kernel's contract): the tolerance tells them apart
    unrounded = torch.from_numpy(_golden(x, ids, wts, w13, w2, round_h=False))
    assert rel_err(unrounded, ref) > TOL


def test_the_twin_rounds_h_to_nearest_even_and_counts_a_repeated_expert_twice():
    from kdtree.ops.moe_bf16_golden import _round_bf16
    a = np.random.default_rng(0).standard_normal(2000) * 3
    want = torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).double().numpy()
    assert np.array_equal(_round_bf16(a), want)
    x, _, _, w13, w2 = _case(Case(1, 64, 32, 4, 1), 1)
    once = _golden(x, torch.tensor([[2]]), torch.ones(1, 1), w13, w2)
    twice = _golden(x, torch.tensor([[2, 2]]), torch.ones(1, 2), w13, w2)
    assert np.allclose(twice, 2 * once)


@gpu
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.T}-D{p.D}-I{p.I}-E{p.E}-k{p.k}{'-skew' * p.skew}")
def test_moe_bf16_matches_golden(p, ids_dtype):
    for seed in (1, 2):
        x, ids, wts, w13, w2 = _case(p, seed, "cuda")
        out = mbf.moe_bf16(x, ids.to(ids_dtype), wts, w13, w2)
        err = rel_err(out, _golden(x, ids, wts, w13, w2))
        assert err <= TOL, err


@gpu
def test_moe_bf16_replays_in_a_graph():
    x, ids, wts, w13, w2 = _case(Case(2, 256, 64, 8, 4), 3, "cuda")
    mbf.moe_bf16(x, ids, wts, w13, w2, check_values=False)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mbf.moe_bf16(x, ids, wts, w13, w2, check_values=False)
    x2, ids2, wts2, _, _ = _case(Case(2, 256, 64, 8, 4), 4, "cuda")
    x.copy_(x2)
    ids.copy_(ids2)
    wts.copy_(wts2)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _golden(x, ids, wts, w13, w2)) <= TOL


@gpu
@pytest.mark.parametrize("B,T", [(1, 1), (2, 9)])
def test_the_fused_path_takes_bf16_experts_and_matches_the_torch_path(monkeypatch, B, T, paged_block,
                                                                       fused_model):
    """forward_paged's fused layers with BF16_EXPERTS (moe_bf16 for the routed experts) against the same
    fused layers without it (the torch grouped path for the experts) and against Block.forward (model.fused
    False), on a bf16 model whose experts stay bf16 (queries scaled as validate.kernel_model does, so bf16
    rounding moves the logits little): the kernel ran, logits within bf16 rounding."""
    from kdtree import fused
    monkeypatch.setattr(fused, "BF16_EXPERTS_MAX_PAIRS", mbf.MAX_PAIRS)   # (2, 9): 72 pairs, past the default
    m = fused_model(5, int4=False, moe="grouped")
    calls = []
    real = mbf.moe_bf16
    monkeypatch.setattr(mbf, "moe_bf16", lambda *a, **k: calls.append(1) or real(*a, **k))
    pool, meta, tokens = paged_block(m, B, T, 100, "grouped")
    assert fused.unsupported(m, meta) is None
    logits = {}
    for name, on, path in (("kernel", True, True), ("grouped", False, True), ("torch", False, False)):
        monkeypatch.setattr(fused, "BF16_EXPERTS", on)
        m.fused = path
        logits[name] = m.forward_paged(tokens, pool.clone(), meta).logits.double()
    m.fused = True
    assert calls
    for other in ("grouped", "torch"):
        rel = (logits["kernel"] - logits[other]).norm() / logits[other].norm()
        assert rel < 1e-2, (other, rel)


@pytest.mark.parametrize("change, needle", [
    (dict(x=lambda x: x.float()), "x: expected dtype torch.bfloat16"),
    (dict(w13=lambda w: w[:, :-1]), "w13: expected"),
    (dict(w2=lambda w: w[:, :, :-8]), "w2: expected"),
    (dict(x=lambda x: x[:, :-8]), "x: expected"),
    (dict(ids=lambda i: i[:, :0]), "topk_ids: expected shape"),
    (dict(wts=lambda w: w.double()), "topk_weights: expected dtype torch.float32"),
    (dict(ids=lambda i: i.float()), "topk_ids: expected dtype"),
])
def test_bad_arguments_are_named_before_any_launch(change, needle):
    x, ids, wts, w13, w2 = _case(Case(2, 64, 32, 4, 2), 0)
    got = dict(x=x, ids=ids, wts=wts, w13=w13, w2=w2)
    for k, f in change.items():
        got[k] = f(got[k])
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        mbf.moe_bf16(got["x"], got["ids"], got["wts"], got["w13"], got["w2"])


def test_a_misaligned_or_empty_tensor_is_refused_before_the_device():
    x, ids, wts, w13, w2 = _case(Case(2, 64, 32, 4, 2), 0)
    shifted = x.reshape(-1).clone()
    off = torch.cat([shifted.new_zeros(1), shifted])[1:].view(2, 64)   # one element past an aligned start
    assert off.data_ptr() % 16
    with pytest.raises(ValueError, match="x: expected a 16-byte aligned"):
        mbf.moe_bf16(off, ids, wts, w13, w2)
    with pytest.raises(ValueError, match="E > 0"):
        mbf.moe_bf16(x, ids, wts, w13[:0], w2[:0])
    assert not mbf.fits(2, 2, w13[:0], w2[:0])


def test_too_many_pairs_are_refused_and_fits_says_so():
    x, ids, wts, w13, w2 = _case(Case(2, 64, 32, 4, 2), 0)
    assert mbf.fits(2, 2, w13, w2) and not mbf.fits(mbf.MAX_PAIRS + 1, 1, w13, w2)
    big = torch.zeros(mbf.MAX_PAIRS + 1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="pairs"):
        mbf.moe_bf16(x[:1].expand(mbf.MAX_PAIRS + 1, -1).contiguous(), big, torch.ones(big.shape), w13, w2)


def test_the_fused_layer_takes_moe_bf16_up_to_its_pair_cap(monkeypatch):
    """fused._bf16_experts (the dispatch, on the CPU): a bf16 MoE's experts go to moe_bf16 by default while
    rows x top-k <= BF16_EXPERTS_MAX_PAIRS, to the grouped GEMMs beyond and whenever BF16_EXPERTS is off."""
    from kdtree import fused
    from kdtree.model import build_model
    from kdtree.validate import tiny_kernel_args
    args = tiny_kernel_args().replace(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                      moe_intermediate_size=64)
    m = build_model(args, seed=0, dtype=torch.bfloat16, device="cpu")
    mlp = next(layer.mlp for layer in m.model.layers if hasattr(layer.mlp, "experts"))
    D, k, cap = args.hidden_size, args.num_experts_per_tok, fused.BF16_EXPERTS_MAX_PAIRS
    assert fused.BF16_EXPERTS and cap == 64
    y = torch.randn(cap // k, D, dtype=torch.bfloat16)
    got = fused._bf16_experts(mlp, y)
    assert got is not None and got[0].shape == (16, 128, D)
    assert fused._bf16_experts(mlp, torch.randn(cap // k + 1, D, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(fused, "BF16_EXPERTS", False)
    assert fused._bf16_experts(mlp, y) is None
