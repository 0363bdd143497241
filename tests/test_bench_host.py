import pytest

from kdtree import weights
from kdtree.bench import host
from kdtree.data import heldout_prompts


@pytest.fixture(scope="module")
def pair():
    t = weights.load("data/trained/target").eval()
    return t, weights.load_drafter("data/trained/drafter", t)


def test_host_timers_count_the_engines_methods_and_restore_them(pair):
    """A fixed-budget run on the CPU: one row with tok/s and tau, `land` timed once a landed round and
    `launch` once a launched one; the engine's methods are the class's own again afterwards."""
    before = {k: getattr(*m) for k, m in host.METHODS.items()}
    rows = host.run(*pair, heldout_prompts(2, 64, seed=2), batches=(2,), plans=("B=8",), max_new=6,
                    repeats=1, progress=False)
    assert {k: getattr(*m) for k, m in host.METHODS.items()} == before
    (row,) = rows
    assert row["batch"] == 2 and row["plan"] == "B=8" and row["tok_per_s"] > 0 and row["tau"] >= 1
    us = row["host_us_per_round"]
    assert us["land"] > 0 and us["launch"] > 0 and list(us.values()) == sorted(us.values(), reverse=True)


@pytest.mark.parametrize("kw, match", [(dict(plans=("B=5",)), "plans"), (dict(batches=(0,)), "batch"),
                                       (dict(repeats=0), "repeats"), (dict(batches=(4,)), "prompts")])
def test_host_run_rejects_bad_arguments_before_running(kw, match):
    args = dict(batches=(2,), plans=("B=8",), max_new=4, repeats=1, progress=False) | kw
    with pytest.raises(ValueError, match=match):
        host.run(None, None, [[1] * 64] * 2, **args)
