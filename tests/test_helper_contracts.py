"""The golden and INT4 helpers check the contracts their docstrings state (the inputs a kernel twin is
defined on), instead of answering for inputs outside them."""
import numpy as np
import pytest
import torch

from kdtree import golden, quant


def test_unpack_int4_refuses_float_words():
    w = np.array([[0x12345678, -1]], dtype=np.int32)
    assert golden.unpack_int4(w).shape == (1, 16)
    with pytest.raises(ValueError, match="packed: expected integer"):
        golden.unpack_int4(w.astype(np.float64))


@pytest.mark.parametrize("shape", [(1.9, 32), (2, 32.0), (True, 32), (2,), "ab", None])
def test_int4_weight_refuses_a_shape_that_is_not_two_ints(shape):
    packed = torch.zeros(2, 4, dtype=torch.int32)
    scale = torch.ones(2, 1, dtype=torch.bfloat16)
    with pytest.raises(quant.QuantFormatError, match="weight_shape: expected two integers"):
        quant.Int4Weight(packed, scale, shape)
    assert quant.Int4Weight(packed, scale, (2, 32)).shape == (2, 32)
    assert quant.Int4Weight(packed, scale, torch.tensor([2, 32])).in_features == 32   # a checkpoint's


def test_build_tree_refuses_log_probabilities_out_of_rank_order():
    """The best-first build reads each depth's list as topk_logprobs sorts it (largest first); an ascending
    list would build a different tree without a word."""
    rng = np.random.default_rng(3)
    lp = np.sort(np.log(rng.dirichlet(np.ones(6), size=3)), axis=1)[:, ::-1].astype(np.float32)
    tok = np.tile(np.arange(6), (3, 1))
    tree = golden.build_tree(tok, lp, 5)
    assert tree.n == 5
    lp[2, 1], lp[2, 3] = lp[2, 3], lp[2, 1]
    with pytest.raises(ValueError, match="expected each depth's list sorted largest first.*depth 2"):
        golden.build_tree(tok, lp, 5)
    inf_tail = np.array([[-0.1, -2.0, -np.inf, -np.inf]], np.float32)   # -inf ranks after finite ones: sorted
    assert golden.build_tree(np.array([[5, 6, 7, 8]]), inf_tail, 4).n == 2


def test_dequant_twin_refuses_non_finite_or_misshapen_scales():
    from kdtree.ops.moe_int4_golden import dequant_int4
    packed = np.random.default_rng(0).integers(-2**31, 2**31, (3, 8), dtype=np.int64).astype(np.int32)
    scale = np.full((3, 2), 0.5)
    assert dequant_int4(packed, scale).shape == (3, 64)
    scale[1, 1] = np.nan
    with pytest.raises(ValueError, match="scale: expected finite scales, got 1 NaN"):
        dequant_int4(packed, scale)
    with pytest.raises(ValueError, match=r"scale: expected shape \(3, 2\)"):
        dequant_int4(packed, np.ones((3, 1)))
