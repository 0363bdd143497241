"""The drafter's split-KV attention (cuda/draft_attn.cu, kdtree.ops.draft_attn): its golden twin against an
independent float64 computation and the wrapper's argument checks (on a CPU); on a GPU (marker gpu, skipped
with a reason elsewhere) the kernel against the twin and DraftAttention.forward_buffered's impl "kernel"
against impl "math"."""
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kdtree.drafter import DRAFT_ATTN_IMPLS, DraftAttention, DrafterArgs, draft_attn_kernel_fits
from kdtree.ops import draft_attn as da
from kdtree.ops.draft_attn_golden import draft_attention

ROOT = Path(__file__).resolve().parent.parent


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _torch_reference(q, k, v, ctx_len, C, scale):
    """Independent of the twin: every column scored, the dead ones masked to -inf, torch's softmax."""
    q, k, v = (torch.as_tensor(x, dtype=torch.float64) for x in (q, k, v))
    S = k.shape[2]
    col = torch.arange(S)
    seen = (col[None] < torch.as_tensor(ctx_len)[:, None]) | (col[None] >= C)             # [B, S]
    s = torch.einsum("bhrd,bhsd->bhrs", q, k) * scale
    p = s.masked_fill(~seen[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhrs,bhsd->bhrd", p, v).numpy()


# ----------------------------------------------------------------------------- CPU: golden twin, checks
@pytest.mark.parametrize("B,Hk,R,hd,C,T,lens", [
    (1, 1, 1, 8, 5, 1, [0]), (3, 2, 8, 16, 40, 8, [0, 17, 40]), (2, 4, 64, 128, 300, 8, [300, 1]),
    (2, 3, 17, 32, 64, 3, [63, 64])])
def test_golden_matches_a_masked_softmax(B, Hk, R, hd, C, T, lens):
    rng = np.random.default_rng(B * 1000 + R + C)
    q = rng.standard_normal((B, Hk, R, hd))
    k = rng.standard_normal((B, Hk, C + T, hd)) * 2
    v = rng.standard_normal((B, Hk, C + T, hd))
    scale = hd ** -0.5
    want = _torch_reference(q, k, v, lens, C, scale)
    got = draft_attention(q, k, v, np.array(lens), C, scale)
    assert got.dtype == np.float64 and got.shape == (B, Hk, R, hd)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # dead columns are never read: NaN there changes nothing
    k2, v2 = k.copy(), v.copy()
    for b, n in enumerate(lens):
        k2[b, :, n:C] = np.nan
        v2[b, :, n:C] = np.nan
    np.testing.assert_array_equal(draft_attention(q, k2, v2, np.array(lens), C, scale), got)


def test_golden_check_can_fail():
    """One context column more or less (a short context) moves the answer well past the GPU tests' 1e-2."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 16, 128)) for _ in range(3))
    k, v = np.concatenate([k, k], axis=2), np.concatenate([v, v], axis=2)   # S = 32, C = 24, T = 8
    want = draft_attention(q, k, v, np.array([5]), 24, 128 ** -0.5)
    for wrong in (4, 6):
        assert _rel(draft_attention(q, k, v, np.array([wrong]), 24, 128 ** -0.5), want) > 1e-2


def test_golden_rejects():
    q, k = np.zeros((1, 2, 4, 8)), np.zeros((1, 2, 10, 8))
    with pytest.raises(ValueError, match="C=10"):
        draft_attention(q, k, k, np.array([0]), 10, 1.0)
    with pytest.raises(ValueError, match="ctx_len: expected values"):
        draft_attention(q, k, k, np.array([9]), 8, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        draft_attention(q, k[:, :1], k, np.array([0]), 8, 1.0)


def _args(B=2, Hk=2, R=16, S=72):
    q = torch.zeros(B, Hk, R, 128, dtype=torch.bfloat16)
    kv = torch.zeros(B, Hk, S, 128, dtype=torch.bfloat16)
    return q, kv, kv.clone(), torch.zeros(B, dtype=torch.int32)


def test_wrapper_rejects_bad_arguments_before_the_device():
    q, k, v, n = _args()
    C = 64
    with pytest.raises(ValueError, match="q: expected dtype"):
        da.draft_attn(q.float(), k, v, n, C, 0.1)
    with pytest.raises(ValueError, match="q: expected head dim 128"):
        da.draft_attn(q[..., :64].contiguous(), k, v, n, C, 0.1)
    with pytest.raises(ValueError, match=r"q: expected 1 to 64 query rows"):
        da.draft_attn(torch.zeros(2, 2, 65, 128, dtype=torch.bfloat16), k, v, n, C, 0.1)
    with pytest.raises(ValueError, match="q: expected a non-empty"):
        da.draft_attn(torch.zeros(0, 2, 16, 128, dtype=torch.bfloat16), k[:0], v[:0], n[:0], C, 0.1)
    with pytest.raises(ValueError, match="q: expected a contiguous"):
        da.draft_attn(q.transpose(0, 1), k, v, n, C, 0.1)
    with pytest.raises(ValueError, match=r"kbuf: expected shape \(2, 2, '\*', 128\)"):
        da.draft_attn(q, k[:1].contiguous(), v, n, C, 0.1)
    with pytest.raises(ValueError, match="kbuf: expected dtype"):
        da.draft_attn(q, k.half(), v, n, C, 0.1)
    with pytest.raises(ValueError, match=r"vbuf: expected shape \(2, 2, 72, 128\)"):
        da.draft_attn(q, k, v[:, :, :70].contiguous(), n, C, 0.1)
    with pytest.raises(ValueError, match="kbuf: expected a contiguous"):
        da.draft_attn(q, k.transpose(0, 1), v, n, C, 0.1)
    with pytest.raises(ValueError, match="ctx_len: expected dtype torch.int32"):
        da.draft_attn(q, k, v, n.long(), C, 0.1)
    with pytest.raises(ValueError, match=r"ctx_len: expected shape \(2,\)"):
        da.draft_attn(q, k, v, n[:1], C, 0.1)
    for bad in (72, -1, 8.0, True, None):
        with pytest.raises(ValueError, match=r"C=.*expected an int in \[0, 71\]"):
            da.draft_attn(q, k, v, n, bad, 0.1)
    for bad in (0, -0.1, math.inf, math.nan, True, "0.1"):
        with pytest.raises(ValueError, match="scale=.*positive finite"):
            da.draft_attn(q, k, v, n, C, bad)
    for bad in (0, da.MAX_SPLITS + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"n_splits=.*expected an int in \[1, 128\] \(or None\)"):
            da.draft_attn(q, k, v, n, C, 0.1, n_splits=bad)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        da.draft_attn(q, k, v, n, C, 0.1)


def test_default_splits_rule():
    for B in (1, 2, 3, 8, 32, 300):
        for Hk in (1, 2, 8):
            for cols in (9, 72, 520, 4104, 32776, 10 ** 6):
                for sms in (78, 132):
                    s = da.default_splits(B, Hk, cols, sms)
                    assert 1 <= s <= min(da.MAX_SPLITS, math.ceil(cols / da.KEYS))
                    if s < min(da.MAX_SPLITS, math.ceil(cols / da.KEYS)):
                        assert B * Hk * s >= da.SPLIT_BLOCKS_PER_SM * sms   # enough blocks: no more splits
                    if s > 1:
                        assert B * Hk * (s - 1) < da.SPLIT_BLOCKS_PER_SM * sms  # the fewest that are enough
    assert da.default_splits(1, 8, 32776, 132) == 33 and da.default_splits(8, 8, 4104, 132) == 5


def test_constants_match_the_kernel_source():
    src = (ROOT / "cuda" / "draft_attn.cu").read_text()
    d = {k: int(v) for k, v in re.findall(r"#define (\w+) (\d+)", src)}
    assert d["HD"] == da.HEAD_DIM and d["ROWS"] == da.MAX_ROWS and d["KEYS"] == da.KEYS
    assert d["DRAFT_MAX_SPLITS"] == da.MAX_SPLITS
    assert da.DRAFT_SMEM == d["ROWS"] * d["STRIDE"] * 2 + 4 * d["KEYS"] * d["STRIDE"] * 2


def test_drafter_kernel_impl_is_offered_and_reaches_the_wrapper():
    assert "kernel" in DRAFT_ATTN_IMPLS
    cuda = torch.device("cuda")
    assert not draft_attn_kernel_fits(torch.device("cpu"), torch.bfloat16, 128, 64)
    assert not draft_attn_kernel_fits(cuda, torch.float32, 128, 64)
    assert not draft_attn_kernel_fits(cuda, torch.bfloat16, 64, 64)
    assert not draft_attn_kernel_fits(cuda, torch.bfloat16, 128, 65)
    assert draft_attn_kernel_fits(cuda, torch.bfloat16, 128, 64) == (
        __import__("importlib").util.find_spec("cupy") is not None)
    # on a CPU, impl "kernel" reaches the wrapper, which refuses host tensors
    at, x, cos, sin, kbuf, vbuf, n = _attention_inputs("cpu", B=2, C=16)
    with torch.no_grad(), pytest.raises(ValueError, match="expected a CUDA tensor"):
        at.forward_buffered(x, cos, sin, kbuf, vbuf, n, 16, "kernel")
    with torch.no_grad():  # while auto there stays on the torch paths
        at.forward_buffered(x, cos, sin, kbuf, vbuf, n, 16, "auto")


def _attention_inputs(device, B=3, C=256, heads=8, kv=2, T=8, seed=0, lens=None):
    """A random bf16 DraftAttention (head_dim 128, G * T = heads / kv * T rows a KV head) and one drafting
    pass's inputs over a context of capacity C (ctx_len int64, as the engine keeps it)."""
    g = torch.Generator().manual_seed(seed)
    a = DrafterArgs(hidden_size=512, num_attention_heads=heads, num_key_value_heads=kv, head_dim=128,
                    block_size=T)
    torch.manual_seed(seed)
    at = DraftAttention(a).to(device=device, dtype=torch.bfloat16).eval()
    x = torch.randn(B, T, a.hidden_size, generator=g).to(device, torch.bfloat16)
    kbuf = torch.randn(B, kv, C + T, 128, generator=g).to(device, torch.bfloat16)
    vbuf = torch.randn(B, kv, C + T, 128, generator=g).to(device, torch.bfloat16)
    n = torch.tensor(lens if lens is not None else [(i * 37) % (C + 1) for i in range(B)])
    pos = n[:, None] + torch.arange(T)
    ang = pos[..., None].float() * torch.rand(64, generator=g)
    cos, sin = ang.cos().to(device, torch.bfloat16), ang.sin().to(device, torch.bfloat16)
    return at, x, cos, sin, kbuf, vbuf, n.to(device)


# ----------------------------------------------------------------------------- GPU: kernel vs golden
def _case(rng, B, Hk, R, C, T, lens, dead=float("nan")):
    q = torch.from_numpy(rng.standard_normal((B, Hk, R, 128))).to(torch.bfloat16)
    k = torch.from_numpy(rng.standard_normal((B, Hk, C + T, 128)) * 1.5).to(torch.bfloat16)
    v = torch.from_numpy(rng.standard_normal((B, Hk, C + T, 128))).to(torch.bfloat16)
    for b, n in enumerate(lens):   # dead columns: NaN unless said otherwise (a read of one shows)
        k[b, :, n:C] = dead
        v[b, :, n:C] = dead
    return q, k, v


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("B,Hk,R,C,T,lens,splits", [
    (1, 8, 64, 4096, 8, [4096], None), (1, 8, 64, 4096, 8, [4000], 1),
    (3, 2, 8, 1000, 8, [0, 517, 1000], None),
    (3, 4, 64, 4096, 8, [1, 4096, 2049], 7), (3, 4, 64, 2048, 8, [56, 57, 120], 3),
    (2, 3, 40, 300, 8, [100, 0], 128), (2, 1, 17, 64, 1, [0, 64], 2), (1, 2, 64, 32768, 8, [4000], None),
    (2, 8, 32, 4096, 16, [4096, 3], 16)])
def test_kernel_matches_golden(B, Hk, R, C, T, lens, splits):
    """Fresh random bf16 inputs (dead columns NaN: the kernel must never read them), contexts from empty to
    full capacity, tiles ending on and off 64-key boundaries, row counts not a multiple of 16, one split and
    many (more than the live tiles: empty splits), capacity 8x past the context; every output written."""
    rng = np.random.default_rng(B * 7919 + Hk * 131 + R + C + sum(lens))
    q, k, v = _case(rng, B, Hk, R, C, T, lens)
    scale = 128 ** -0.5
    n = torch.tensor(lens, dtype=torch.int32)
    out = da.draft_attn(q.cuda(), k.cuda(), v.cuda(), n.cuda(), C, scale, n_splits=splits)
    assert out.dtype == torch.bfloat16 and out.shape == (B, Hk, R, 128)
    got = out.double().cpu().numpy()
    assert np.isfinite(got).all()
    want = draft_attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), n.numpy(), C, scale)
    for b in range(B):
        assert _rel(got[b], want[b]) <= 1e-2, (b, _rel(got[b], want[b]))


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
def test_kernel_check_can_fail():
    """The comparison above catches an off-by-one context: the twin with one column more or less is > 1e-2
    away from the kernel on a short context, the right one <= 1e-2."""
    rng = np.random.default_rng(11)
    B, Hk, R, C, T, lens = 2, 2, 64, 64, 8, [5, 40]
    q, k, v = _case(rng, B, Hk, R, C, T, lens, dead=0.5)   # finite dead columns: the wrong twin reads one
    n = torch.tensor(lens, dtype=torch.int32)
    got = da.draft_attn(q.cuda(), k.cuda(), v.cuda(), n.cuda(), C, 128 ** -0.5).double().cpu().numpy()
    args = (q.double().numpy(), k.double().numpy(), v.double().numpy())
    assert _rel(got[0], draft_attention(*args, np.array(lens), C, 128 ** -0.5)[0]) <= 1e-2
    for wrong in ([4, 40], [6, 40]):
        assert _rel(got[0], draft_attention(*args, np.array(wrong), C, 128 ** -0.5)[0]) > 1e-2


@pytest.mark.gpu
def test_kernel_value_check_reads_ctx_len():
    q, k, v, n = (t.cuda() for t in _args())
    with pytest.raises(ValueError, match=r"ctx_len: expected values in \[0, C=64\], got \[0, 65\]"):
        da.draft_attn(q, k, v, torch.tensor([0, 65], dtype=torch.int32).cuda(), 64, 0.1)
    with pytest.raises(ValueError, match=r"ctx_len: expected values in \[0, C=64\], got \[-1, 0\]"):
        da.draft_attn(q, k, v, torch.tensor([-1, 0], dtype=torch.int32).cuda(), 64, 0.1)


# ----------------------------------------------------------------------------- GPU: the drafter's impl
def _rel_t(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("heads,kv,T", [(8, 2, 8), (16, 2, 8), (4, 4, 3)])
def test_forward_buffered_kernel_matches_math(heads, kv, T, monkeypatch):
    """impl "kernel" against impl "math" (the reference) on a random bf16 drafter layer, requests of empty,
    partial and full contexts in one batch (G * T = 32, 64 and 3 rows a KV head); "auto" takes the kernel
    there; a wrong context length fails the comparison."""
    C = 256
    at, x, cos, sin, kbuf, vbuf, n = _attention_inputs("cuda", B=3, C=C, heads=heads, kv=kv, T=T,
                                                        lens=[0, 37, C])
    assert draft_attn_kernel_fits(kbuf.device, kbuf.dtype, 128, heads // kv * T)
    from kdtree import drafter
    monkeypatch.setattr(drafter, "KERNEL_AUTO", True)
    with torch.no_grad():
        want = at.forward_buffered(x, cos, sin, kbuf, vbuf, n, C, "math")
        got = at.forward_buffered(x, cos, sin, kbuf, vbuf, n, C, "kernel")
        auto = at.forward_buffered(x, cos, sin, kbuf, vbuf, n, C, "auto")
        assert torch.isfinite(got).all() and torch.equal(auto, got)
        for b in range(3):
            assert _rel_t(got[b], want[b]) <= 2e-2, (b, _rel_t(got[b], want[b]))
        bad = at.forward_buffered(x, cos, sin, kbuf, vbuf, n + torch.tensor([8, 0, 0], device="cuda"), C,
                                  "kernel")
        assert _rel_t(bad[0], want[0]) > 5e-2


@pytest.mark.gpu
def test_forward_buffered_kernel_replays_in_a_cuda_graph():
    """impl "kernel" captured once (no host reads), replayed after ctx_len changes in place: each replay
    equals the eager pass at the new lengths and matches impl "math" there."""
    C = 512
    at, x, cos, sin, kbuf, vbuf, n = _attention_inputs("cuda", B=3, C=C, lens=[0, 100, C])
    with torch.no_grad():
        at.forward_buffered(x, cos, sin, kbuf, vbuf, n, C, "kernel")          # compile and load first
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            at.forward_buffered(x, cos, sin, kbuf, vbuf, n, C, "kernel")
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = at.forward_buffered(x, cos, sin, kbuf, vbuf, n, C, "kernel")
        for lens in ([0, 100, C], [C, 1, 300], [64, 63, 65]):
            n.copy_(torch.tensor(lens))
            g.replay()
            torch.cuda.synchronize()
            eager = at.forward_buffered(x, cos, sin, kbuf, vbuf, n, C, "kernel")
            math_ = at.forward_buffered(x, cos, sin, kbuf, vbuf, n, C, "math")
            assert torch.equal(out, eager), lens
            for b in range(3):
                assert _rel_t(out[b], math_[b]) <= 2e-2, (lens, b)
