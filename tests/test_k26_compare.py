"""kdtree.bench.k26_compare: two K2.6 sweeps matched row by row, their ratios, refusals, the files written."""
import json

import pytest

from kdtree.bench import k26_compare as kc


def _row(mode, budget, tps, span, floor_s=None, kernels=None, tau=5.0, ctx=4096, batch=1, **kw):
    c = {"context": ctx, "batch": batch, "tau_chain": tau, "mode": mode, "budget": budget, "tok_per_s": tps,
         "round_gpu_span_median_s": span, "layers": 12, **kw}
    if floor_s is not None:
        c["floor"] = {"bytes": 1, "parts": {}, "s": floor_s, "fraction": floor_s / span}
    if kernels is not None:
        c["stages"] = {"draft": {"kernels": kernels - 10, "gpu_s": 1e-3},
                       "verify": {"kernels": 10, "gpu_s": 1e-3}}
    return c


def _rec(rows, device="NVIDIA H200", path="torch"):
    return {"device": device, "layers": {"4096:1": 12}, "decode_path": path, "cells": rows}


BEFORE = _rec([_row("ar", None, 200.0, 5e-3, 2e-3), _row("dflash", None, 300.0, 12e-3, 5e-3, kernels=900),
               _row("ddtree", 8, 330.0, 12.5e-3, 5.5e-3), _row("ddtree", 32, 310.0, 14e-3, 6e-3),
               _row("ddtree", "auto", 320.0, 12.4e-3), _row("ddtree", 64, 1.0, 1.0, error="out of memory")])
AFTER = _rec([_row("ar", None, 400.0, 2.5e-3, 2e-3), _row("dflash", None, 500.0, 7e-3, 5e-3, kernels=400),
              _row("ddtree", 8, 600.0, 7.5e-3, 5.5e-3), _row("ddtree", 32, 640.0, 8e-3, 6e-3),
              _row("ddtree", "auto", 620.0, 7.6e-3), _row("ddtree", 64, 500.0, 9e-3)], path="fused")


def test_rows_are_matched_and_ratios_are_each_sides_own():
    cmp = kc.compare(BEFORE, AFTER, ("torch", "fused"))
    assert [(r["mode"], str(r["budget"])) for r in cmp["rows"]] == [
        ("ar", "None"), ("dflash", "None"), ("ddtree", "8"), ("ddtree", "32"), ("ddtree", "auto")]
    ar = cmp["rows"][0]
    assert ar["speedup"] == pytest.approx(2.0)
    assert ar["before"]["floor_fraction"] == pytest.approx(0.4)
    assert ar["after"]["floor_fraction"] == pytest.approx(0.8)
    assert cmp["rows"][1]["before"]["kernels"] == 900 and cmp["rows"][1]["after"]["kernels"] == 400
    (cell,) = cmp["cells"]
    assert cell["before"]["best_fixed_over_ar"] == pytest.approx(330 / 200)
    assert cell["before"]["best_fixed_budget"] == 8
    assert cell["after"]["best_fixed_over_ar"] == pytest.approx(640 / 400)
    assert cell["after"]["best_fixed_budget"] == 32
    assert cell["after"]["auto_over_best_fixed"] == pytest.approx(620 / 640)
    # B=64 failed before: on one side only, so listed and left out of the ratios
    assert len(cmp["unmatched"]) == 1 and "64" in cmp["unmatched"][0]


def test_markdown_and_files(tmp_path):
    b, a = tmp_path / "b.json", tmp_path / "a" / "e2e.json"
    a.parent.mkdir()
    b.write_text(json.dumps(BEFORE))
    a.write_text(json.dumps({"device": "NVIDIA H200", "k26": AFTER}))   # notebook 02's record: its section
    cmp = kc.main([str(b), str(a), "--labels", "torch", "fused"])
    md = (a.parent / "k26_compare.md").read_text()
    assert "| 4096 | 1 | 5 | ar |  | 2.00 | 5.00 | 2.50 | 2.00x | 40 | 80 |" in md
    assert "1.65 | 1.60 |" in md
    assert json.loads((a.parent / "k26_compare.json").read_text())["rows"] == cmp["rows"]
    assert (a.parent / "k26_compare.png").stat().st_size > 1000


def test_refusals_write_nothing(tmp_path):
    b, a = tmp_path / "b.json", tmp_path / "a.json"
    b.write_text(json.dumps(BEFORE))
    a.write_text(json.dumps({**AFTER, "device": "NVIDIA H100 80GB HBM3"}))
    with pytest.raises(SystemExit, match="different cards"):
        kc.main([str(b), str(a)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]
    kc.main([str(b), str(a), "--mixed"])   # shown when asked
    with pytest.raises(ValueError, match="share no measured row"):
        kc.compare(BEFORE, _rec([_row("ar", None, 1.0, 1.0, ctx=32768)]))
    with pytest.raises(ValueError, match="share no measured row"):   # the same cell built with 6 layers
        kc.compare(BEFORE, _rec([_row("ar", None, 400.0, 2.5e-3, layers=6)]))
    with pytest.raises(ValueError, match="labels"):
        kc.compare(BEFORE, AFTER, ("one",))
    with pytest.raises(ValueError, match="expected a K2.6 sweep"):
        (tmp_path / "x.json").write_text("[1, 2]")
        kc.load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="not JSON"):
        (tmp_path / "y.json").write_text("{")
        kc.load(tmp_path / "y.json")
    with pytest.raises(ValueError, match="expected an e2e_k26.json"):
        kc.load(tmp_path / "missing.json")


def test_a_record_without_its_card_is_compared_as_unknown():
    # notebook 02 compares its own section (written without the card's name) with a bench record
    cmp = kc.compare(BEFORE, {k: v for k, v in AFTER.items() if k != "device"})
    assert cmp["devices"] == ["NVIDIA H200", None] and len(cmp["rows"]) == 5
    assert "NVIDIA H200 / None" in kc.markdown(cmp)


def test_each_sides_ratios_come_from_its_own_rows_and_spans_are_the_full_batch_rounds():
    # B=64 measured only after (it failed before): after's best fixed budget is still B=64
    after = _rec([*AFTER["cells"][:5], _row("ddtree", 64, 700.0, 9e-3)])
    after["cells"][0]["full_round_gpu_span_median_s"] = 2e-3    # AR: its rounds with every slot live
    cmp = kc.compare(BEFORE, after)
    (cell,) = cmp["cells"]
    assert cell["after"]["best_fixed_budget"] == 64
    assert cell["after"]["best_fixed_over_ar"] == pytest.approx(1.75)
    assert cell["before"]["best_fixed_budget"] == 8
    ar = cmp["rows"][0]
    assert ar["after"]["round_s"] == 2e-3 and ar["speedup"] == pytest.approx(2.5)
    with pytest.raises(ValueError, match="different routings"):
        kc.compare(BEFORE, {**AFTER, "routing": "uniform"})
    assert kc.compare({**BEFORE, "cells": [_row("ddtree", 16.0, 1.0, 1.0)]},
                      {**AFTER, "cells": [_row("ddtree", 16.0, 2.0, 0.5)]})["rows"][0]["speedup"] == 2.0
