"""kdtree.plots: notebook 02's cost-aware-budget figure keeps the figure contract (no empty panel, legends
outside the axes, nothing cut, base-2 budget axes with whole-number ticks, a node axis from 0 up)."""
import re

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kdtree import plots  # noqa: E402


def _auto(calibration=True, plans=True):
    cells = []
    for b, scale in ((1, 1.0), (8, 6.0)):
        cells += [dict(batch=b, mode="ar", budget=None, compiled=False, tok_per_s=1000 * scale),
                  dict(batch=b, mode="ar", budget=None, compiled=True, tok_per_s=2500 * scale),
                  dict(batch=b, mode="dflash", budget=None, compiled=False, tok_per_s=1200 * scale)]
        cells += [dict(batch=b, mode="ddtree", budget=B, compiled=False, tok_per_s=(1300 + 10 * B) * scale)
                  for B in (4, 16, 64)]
        plan = ["AR", "B=4", "chain", "B=64", "B=64"] if plans else None
        cells += [dict(batch=b, mode="ddtree", budget="auto", decide=d, compiled=False,
                       tok_per_s=1900 * scale, plans=plan) for d in ("previous", "sync")]
    auto = {"cells": cells}
    if calibration:
        auto["calibration_check"] = {"budgets": [1, 2, 4, 8, 16], "rounds": 40,
                                     "realized": [1.5, 1.9, 2.3, 2.6, 2.8],
                                     "calibrated": [1.5, 1.8, 2.2, 2.5, 2.7],
                                     "raw": [1.4, 1.7, 2.0, 2.3, 2.5]}
    return auto


def test_auto_figure_keeps_the_contract(tmp_path):
    fig = plots.auto_figure(_auto(), block_size=16, path=tmp_path / "e2e_auto.png")
    assert (tmp_path / "e2e_auto.png").stat().st_size > 1000
    assert len(fig.axes) == 3 and plots.layout_faults(fig) == []
    tok, plan, cal = fig.axes
    assert [t.get_text() for t in tok.get_xticklabels()] == ["4", "16", "64", "auto"]
    assert [t.get_text() for t in cal.get_xticklabels()] == ["1", "2", "4", "8", "16"]
    assert tok.get_xscale() == cal.get_xscale() == "log"
    lo, hi = tok.get_ylim()
    shown = [t.get_text() for t in tok.get_yticklabels() if lo <= t.get_position()[1] <= hi]
    assert shown and all(re.fullmatch(r"[\d,.]+", t) for t in shown), shown   # plain numbers, no 10^k
    lo, hi = plan.get_ylim()
    ticks = [t for t in plan.get_yticks() if lo <= t <= hi]
    assert lo == 0 and ticks[0] == 0 and all(t >= 0 and float(t).is_integer() for t in ticks), ticks
    assert {0, 4, 15, 64} <= {int(y) for y in plan.lines[0].get_ydata()}   # AR, B=4, the chain, B=64
    plt.close(fig)


@pytest.mark.parametrize("calibration, plans, n", [(False, True, 2), (True, False, 2), (False, False, 1)])
def test_auto_figure_draws_only_what_the_record_holds(calibration, plans, n):
    fig = plots.auto_figure(_auto(calibration, plans), block_size=16)
    assert len(fig.axes) == n and plots.layout_faults(fig) == []
    plt.close(fig)


def test_the_layout_checker_can_fail():
    """An empty panel, a legend over a curve and a label past the edge are each reported."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(4, 2))
    a.plot([1, 2], [1, 2], label="a curve")
    a.legend(loc="center")
    b.plot([], [])
    a.set_ylabel("a label far too long for so small a figure, reaching past its edges " * 2)
    faults = plots.layout_faults(fig)
    for want in ("empty axes", "legend over an axes", "cut at the figure's edge"):
        assert any(f.startswith(want) for f in faults), (want, faults)
    plt.close(fig)


def test_peers_figure_keeps_the_contract(tmp_path):
    import json
    from pathlib import Path
    record = Path(__file__).resolve().parent.parent / "outputs/h100/peers/peers_quick.json"
    rec = json.loads(record.read_text())
    fig = plots.peers_figure(rec, tmp_path / "peers.png")
    assert (tmp_path / "peers.png").stat().st_size > 0
    assert len(fig.axes) == 2 and plots.layout_faults(fig) == []
    plt.close(fig)
    only = plots.peers_figure({"targets": rec["targets"]})
    assert len(only.axes) == 1 and only.axes[0].get_title() == "targets against the peers"
    plt.close(only)
    unmeasured = {"attention": [], "targets": [{"key": "k", "name": "n", "measured": None}]}
    assert plots.peers_figure(unmeasured) is None
