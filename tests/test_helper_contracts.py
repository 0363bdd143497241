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
