"""cuda/attn_merge.cu (merge_states) against its float64 twin; the twin against attn_split.merge_lse."""
import numpy as np
import pytest
import torch

from kdtree.ops import attn_merge as am
from kdtree.ops import attn_merge_golden as amg
from kdtree.ops import attn_split as sp


def _inputs(R, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    o1, o2 = torch.randn(R, D, generator=g, dtype=dtype), torch.randn(R, D, generator=g, dtype=dtype)
    l1, l2 = torch.randn(R, generator=g, dtype=dtype) * 3, torch.randn(R, generator=g, dtype=dtype) * 3
    l1[0] = -float("inf")                       # the first pass saw no key: its row holds NaN, ignored
    o1[0] = float("nan")
    l2[1] = -float("inf")
    l1[2] = l2[2] = -float("inf")               # neither: 0 and -inf
    o2[2] = float("nan")
    l1[3], l2[3] = 40.0, -40.0                  # one pass dominates
    return o1, l1, o2, l2


def test_the_twin_is_attn_splits_merge():
    o1, l1, o2, l2 = _inputs(37, 24, seed=1)
    want_o, want_l = sp.merge_lse(o1, l1, o2, l2)
    from kdtree.ops.decode_golden import rb
    got_o, got_l = amg.merge_states(o1.numpy(), l1.numpy(), o2.numpy(), l2.numpy())
    assert np.array_equal(np.isneginf(got_l), np.isneginf(want_l.numpy()))
    fin = np.isfinite(got_l)
    assert np.abs(got_l[fin] - want_l.numpy()[fin]).max() <= 1e-12
    assert np.abs(got_o - rb(want_o.numpy())).max() <= 1e-2 * np.abs(got_o).max()
    assert (got_o[2] == 0).all() and np.isfinite(got_o).all()
    with pytest.raises(ValueError, match="merge_states: expected o1, o2"):
        amg.merge_states(o1.numpy(), l1.numpy(), o2.numpy()[:, :8], l2.numpy())


def test_arguments_are_named_before_any_launch():
    o = torch.zeros(4, 16, dtype=torch.bfloat16)
    lse = torch.zeros(4)
    with pytest.raises(ValueError, match="o1"):
        am.merge_states(o.float(), lse, o, lse)
    with pytest.raises(ValueError, match="D a positive multiple of 8"):
        am.merge_states(o[:, :12].contiguous(), lse, o[:, :12].contiguous(), lse)
    with pytest.raises(ValueError, match=r"lse2: expected float32 \[4\]"):
        am.merge_states(o, lse, o, torch.zeros(5))
    with pytest.raises(ValueError, match="lse1"):
        am.merge_states(o, lse.double(), o, lse)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("shape", [(5, 3, 16, 512), (4, 8), (300, 64)])
def test_merge_states_equals_its_twin(shape):
    """Fresh random passes (empty ones with NaN rows among them) against the float64 twin: o within bf16
    rounding, lse within fp32's; the passes swapped in their lse give another answer (the check can fail)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    *lead, D = shape
    R = int(np.prod(lead))
    o1, l1, o2, l2 = _inputs(R, D, seed=R + D, dtype=torch.float32)
    dev = [t.reshape(*lead, *t.shape[1:]).to("cuda") for t in (o1, l1, o2, l2)]
    dev[0], dev[2] = dev[0].to(torch.bfloat16), dev[2].to(torch.bfloat16)
    o, lse = am.merge_states(*dev)
    want_o, want_l = amg.merge_states(*(t.float().cpu().numpy() for t in dev))
    got_o, got_l = o.double().cpu().numpy(), lse.double().cpu().numpy()
    assert o.shape == tuple(shape) and lse.shape == tuple(lead) and np.isfinite(got_o).all()
    assert np.abs(got_o - want_o).max() <= 1e-2 * np.abs(want_o).max()
    assert np.array_equal(np.isneginf(got_l), np.isneginf(want_l))
    fin = np.isfinite(want_l)
    assert (np.abs(got_l[fin] - want_l[fin]) <= 1e-4 * np.maximum(1.0, np.abs(want_l[fin]))).all()
    # the passes' lse swapped: row 0's NaN o1 now weighs 1 (NaN out, as the contract says), the rest differ
    swapped, _ = am.merge_states(dev[0], dev[3], dev[2], dev[1])
    diff = np.abs(swapped.double().cpu().numpy() - want_o).reshape(R, D)
    assert np.isnan(diff[0]).all() and diff[1:].max() > 0.05
