"""The drafter's calibration table: its statistics, the correction, storage, and a measurement on the trained
pair that agrees with the engine's own accept lengths."""
import json

import numpy as np
import pytest

from kdtree import golden, weights
from kdtree.bench.calibrate import measure
from kdtree.calibration import FILE, MIN_COUNT, Calibration, node_acceptance
from kdtree.validate import random_prompts


def _synthetic(shrink: float, n: int = 200000, seed=None) -> tuple[Calibration, np.ndarray, np.ndarray]:
    """Nodes whose true acceptance is shrink * their prediction; returns the table and held-back nodes (enough
    nodes that a corrected value's sampling noise stays well inside the 0.05 the checks allow)."""
    rng = np.random.default_rng(seed)
    cal = Calibration.empty(4)
    p = rng.uniform(0.001, 1.0, n)
    d = rng.integers(1, 5, n)
    cal.add(np.log(p), d, rng.random(n) < shrink * p)
    q = rng.uniform(0.05, 0.95, 500)
    return cal, q, rng.integers(1, 5, 500)


def test_a_calibrated_drafter_is_left_as_it_is():
    cal, q, d = _synthetic(1.0)
    assert np.abs(cal.correct(np.log(q), d) - q).max() < 0.05


def test_an_overconfident_drafter_is_corrected_and_the_check_can_fail():
    """Realized acceptance half the prediction: the corrected values track it; the uncorrected ones fail the
    same comparison (the check can fail)."""
    cal, q, d = _synthetic(0.5)
    want = 0.5 * q
    assert np.abs(cal.correct(np.log(q), d) - want).max() < 0.05
    assert np.abs(q - want).max() >= 0.05
    pred, real = cal.rates()
    assert np.nanmax(np.abs(real - 0.5 * pred)) < 0.1


def test_bins_scale_their_predictions_and_sparse_ones_fall_back():
    """A (depth, bin) with enough nodes scales its predictions by its realized / predicted (keeping their
    order within the bin); one with too few takes the bin's ratio over all depths, then 1; a depth beyond the
    table keeps the prediction; nothing exceeds 1."""
    cal = Calibration.empty(2)
    j = 5  # edges[5] = 0.1 <= p < 0.2
    cal.count[0][j], cal.predicted[0][j], cal.accepted[0][j] = 100, 15.0, 30          # ratio 2 at depth 1
    cal.count[1][j], cal.predicted[1][j], cal.accepted[1][j] = MIN_COUNT - 1, 3.0, 1  # sparse at depth 2
    q = cal.correct(np.log([0.11, 0.19, 0.15, 0.15, 0.6]), [1, 1, 2, 3, 1])
    pooled = 31 / 18.0
    assert np.allclose(q, [0.22, 0.38, 0.15 * pooled, 0.15, 0.6])  # bin 9 (0.6) is empty: ratio 1
    assert q[0] < q[1]  # the order within a bin is kept
    hot = Calibration.empty(1)
    hot.count[0][j], hot.predicted[0][j], hot.accepted[0][j] = 100, 15.0, 90         # ratio 6
    assert hot.correct(np.log([0.19]), [1])[0] == 1.0
    few = Calibration.empty(1)
    few.count[0][j], few.predicted[0][j], few.accepted[0][j] = MIN_COUNT - 1, 2.0, 10
    assert np.isclose(few.correct(np.log([0.15]), [1])[0], 0.15)


def test_node_acceptance_follows_the_target_down_the_tree():
    tree = golden.Tree(np.array([5, 6, 7, 8]), np.array([1, 1, 2, 2], np.int32),
                       np.array([-1, -1, 0, 1], np.int32), np.log(np.array([0.5, 0.3, 0.2, 0.1], np.float32)),
                       np.zeros(4, np.int32))
    blk = golden.compile_tree(tree, 9, 10)
    choice = np.array([6, 0, 8, 0, 0])  # root chooses 6 (node 1), node 1 chooses 8 (node 3)
    assert node_acceptance(blk, choice).tolist() == [False, True, False, True]
    cal = Calibration.empty(2)
    assert np.allclose(cal.expected_tokens(tree), 1 + np.concatenate([[0], np.cumsum([0.5, 0.3, 0.2, 0.1])]),
                       atol=1e-6)


def test_storage_round_trip_and_bad_files(tmp_path):
    cal, _, _ = _synthetic(0.7, n=2000, seed=1)
    cal.save(tmp_path)
    back = Calibration.load(tmp_path)
    assert back == cal
    assert Calibration.load(tmp_path / "nowhere") is None
    (tmp_path / FILE).write_text("{")
    with pytest.raises(ValueError, match="not a calibration table"):
        Calibration.load(tmp_path)
    raw = json.loads(json.dumps(cal.__dict__))
    raw["accepted"][0][0] = raw["count"][0][0] + 1
    (tmp_path / FILE).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="inconsistent calibration table"):
        Calibration.load(tmp_path)


def test_measure_on_the_trained_pair_agrees_with_the_engine():
    """Every round's accepted nodes + 1 equal its accept length (checked inside measure); the table counts
    every node of every round, and the drafter's top nodes are accepted more often than its bottom ones."""
    t = weights.load("data/trained/target").eval()
    d = weights.load_drafter("data/trained/drafter", t)
    prompts = random_prompts(t.args, 2, seed=11, min_len=20, max_len=40)
    cal = measure(t, d, prompts, 24, budget=16)
    n = np.asarray(cal.count)
    assert cal.prompts == 2 and cal.budget == 16 and n.sum() >= 16 * 2 * 24 // d.block_size
    assert n.sum() % 16 == 0  # 16 nodes a round: the trained drafter's trees are full
    pred, real = cal.rates()
    hi, lo = n[:, -3:].sum(), n[:, :4].sum()
    assert hi and lo
    assert np.asarray(cal.accepted)[:, -3:].sum() / hi > np.asarray(cal.accepted)[:, :4].sum() / lo
    with pytest.raises(ValueError, match="prompts: expected at least one prompt"):
        measure(t, d, [], 8)
    with pytest.raises(ValueError, match="budget=0"):
        measure(t, d, prompts, 8, budget=0)


def test_the_trained_drafter_carries_its_calibration(tmp_path):
    """data/trained/drafter holds a table measured on held-out prompts; load_drafter attaches it, and a broken
    one is a CheckpointError naming the file."""
    import shutil
    t = weights.load("data/trained/target").eval()
    d = weights.load_drafter("data/trained/drafter", t)
    assert isinstance(d.calibration, Calibration) and d.calibration.depths == d.block_size - 1
    assert np.sum(d.calibration.count) > 10000
    shutil.copytree("data/trained/drafter", tmp_path / "drafter")
    (tmp_path / "drafter" / FILE).write_text("[]")
    with pytest.raises(weights.CheckpointError, match="calibration.json: not a calibration table"):
        weights.load_drafter(tmp_path / "drafter", t)
    weights.save_drafter(d, tmp_path / "drafter")  # new weights: the stale table goes
    assert not (tmp_path / "drafter" / FILE).exists()
    assert weights.load_drafter(tmp_path / "drafter", t).calibration is None


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r.update(edges=[0.0, float("nan"), 1.0]), "edges="),
    (lambda r: r.update(edges=["0", "0.5", "1"]), "edges="),
    (lambda r: r.update(edges=list(reversed(r["edges"]))), "strictly ascending"),
    (lambda r: r["predicted"][0].__setitem__(0, float("nan")), "a bin holds"),
    (lambda r: r["count"][0].__setitem__(1, 2.5), "a bin holds"),
    (lambda r: r.update(budget=-1), "budget=-1"),
])
def test_a_calibration_is_checked_however_it_arrives(tmp_path, edit, needle):
    """Loaded from a file or built by hand (as Engine(calibration=...) takes it): the same checks."""
    from dataclasses import asdict
    raw = asdict(Calibration.empty(3))
    raw["count"][0][0], raw["accepted"][0][0], raw["predicted"][0][0] = 4, 1, 0.5
    edit(raw)
    with pytest.raises(ValueError, match=needle):
        Calibration(**raw)
    (tmp_path / "calibration.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="inconsistent calibration table"):
        Calibration.load(tmp_path)
