"""The shared argument checks (kdtree.checks) and their use across the API: numpy scalars accepted, bools and
floats-as-ints refused, the argument named, no device values read."""
import numpy as np
import pytest
import torch

from kdtree import checks, golden, kernels
from kdtree.config import TINY_A
from kdtree.engine import Engine
from kdtree.model import build_model


@pytest.mark.parametrize("v", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_ints_accept_numpy_scalars(v):
    assert checks.positive_int("n", v) == 3 and type(checks.positive_int("n", v)) is int


@pytest.mark.parametrize("v,needle", [(True, "n=True: expected a positive int"),
                                      (np.bool_(True), "n=(np.)?True"),
                                      (3.0, "n=3.0: expected a positive int"), (0, "n=0"), ("3", "n='3'"),
                                      (None, "n=None")])
def test_ints_refuse_bools_floats_and_out_of_range(v, needle):
    with pytest.raises(ValueError, match=needle):
        checks.positive_int("n", v)


def test_bounds_are_named_in_the_message():
    with pytest.raises(ValueError, match=r"k=9: expected an int in \[1, 8\] \(top-k\)"):
        checks.int_in("k", 9, 1, 8, " (top-k)")
    with pytest.raises(ValueError, match=r"s=-1: expected an int >= 0"):
        checks.int_in("s", -1, 0)
    assert checks.int_in("s", np.int16(-5)) == -5


@pytest.mark.parametrize("v", [0.5, np.float32(0.5), np.float64(0.5), 1, np.int64(1)])
def test_floats_accept_numpy_and_ints(v):
    assert checks.finite_float("t", v, lo=0.0) == float(v)


@pytest.mark.parametrize("v", [True, float("nan"), float("inf"), np.float32("nan"), -0.1, "0.5", None])
def test_floats_refuse_bools_non_finite_and_negative(v):
    with pytest.raises(ValueError, match="t=.*expected a finite number >= 0"):
        checks.finite_float("t", v, lo=0.0)


def test_token_lists():
    assert checks.token_list("p", np.array([1, 2])) == [1, 2]
    assert checks.token_list("p", torch.tensor([[4, 5]])) == [4, 5]
    assert checks.token_list("p", (np.int64(7),), 8) == [7]
    for bad, needle in (([1.0, 2.0], "expected integer token ids, got 1.0"), ([True], "got True"),
                        ([], "at least one token"), ([8], r"in \[0, 8\)"), ("ab", "got str"),
                        (np.array([1.5]), "float64"), (torch.zeros(2, 2, dtype=torch.long), r"\[1, T\]")):
        with pytest.raises(ValueError, match=needle):
            checks.token_list("p", bad, 8)


def test_tensor_checks_read_no_values():
    """A meta tensor has no values: a check that read one would raise; these check type, dtype, shape only."""
    t = torch.empty(2, 3, dtype=torch.int32, device="meta")
    assert checks.tensor("t", t, (torch.int32,), ndim=2, shape=(2, None), contiguous=True) is t
    for kw, needle in ((dict(dtypes=(torch.int64,)), "expected dtype torch.int64, got torch.int32"),
                       (dict(ndim=3), "expected 3 dims"), (dict(shape=(2, 4)), r"expected shape \(2, 4\)"),
                       (dict(device="cpu"), "expected device cpu, got meta")):
        with pytest.raises(ValueError, match=needle):
            checks.tensor("t", t, **kw)
    with pytest.raises(RuntimeError):  # the contrast: reading a value of it fails
        int(t.max())
    with pytest.raises(ValueError, match="expected a torch.Tensor, got list"):
        checks.tensor("t", [1])


def test_the_api_uses_the_shared_checks():
    """The same refusals and acceptances through golden, kernels' static checks, the model and the engine."""
    m = build_model(TINY_A, seed=0)
    with pytest.raises(ValueError, match=r"budget=True: expected an int in \[1, 4096\]"):
        golden.ddtree(np.zeros((2, 8), np.float32), True)
    assert len(golden.ddtree(np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32),
                             np.int64(3)).tokens) == 3
    with pytest.raises(ValueError, match=r"budget=2.0: expected an int in \[1, 1024\]"):
        kernels._check_budget(2.0)
    with pytest.raises(ValueError, match=r"tokens \[batch, T\]: expected dtype"):
        m(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="max_batch=True: expected a positive int"):
        Engine(m, max_batch=True)
    with pytest.raises(ValueError, match=r"max_len=0: expected an int in \[1, "):
        Engine(m, max_len=0)
    e = Engine(m, max_batch=np.int64(2), max_len=np.int64(64), prefill_chunk=np.int32(16))
    assert e.max_batch == 2 and e.max_len == 64
    rid = e.add_request(np.array([1, 2, 3]), np.int64(2), temperature=np.float32(0.0), seed=np.int64(1),
                        stop_tokens=(np.int64(5),))
    assert len(e.run()[rid].tokens) <= 2
