"""kdtree.bench.k26_record: several device commands' K2.6 sections combined into one record."""
import json
import math

import pytest

from kdtree.bench import k26_record as KR


def _rows(C, b, tau, run, scale, layers=12, fitted=False):
    base = dict(context=C, batch=b, layers=layers, run=run, tau_chain=tau, block=8, fitted=fitted)
    return [dict(base, mode="ar", budget=None, tok_per_s=1.0 * scale, tau=1.0),
            dict(base, mode="dflash", budget=None, tok_per_s=2.0 * scale, tau=3.0),
            dict(base, mode="ddtree", budget=4, tok_per_s=3.0 * scale, tau=3.5),
            dict(base, mode="ddtree", budget="auto", tok_per_s=3.0 * scale, tau=3.5)]


def _section(cells, **kw):
    layers = {f"{c['context']}:{c['batch']}": c["layers"] for c in cells}
    return {"cells": cells, "targets": [], "layers": layers, "label": "x", **kw}


def _ratio(sec, what, tau, b):
    return next(t["measured"] for t in sec["targets"]
                if f"tau_c {tau:g}, 12 MoE layers, batch {b}," in t["name"] and what in t["name"])


def test_combine_keeps_each_profiles_newest_run_in_any_order():
    """Each (context, batch, profile) keeps its newest run's rows whatever the sections' order, a stale
    copy of an older run in a later section does not come back, and targets pair rows of one run."""
    r1 = _section(_rows(4096, 1, 5.0, "r1", 1.0) + _rows(4096, 8, 5.0, "r1", 1.0))
    r2 = _section(_rows(4096, 1, 5.0, "r1", 1.0) + _rows(4096, 8, 5.0, "r2", 2.0))   # b8 again
    r3 = _section(_rows(4096, 1, 5.0, "r1", 1.0) + _rows(4096, 8, 5.0, "r1", 1.0)    # b8 stale
                  + _rows(4096, 32, 5.0, "r3", 1.0, layers=11))
    for order in ([r1, r2, r3], [r3, r2, r1], [r2, r3, r1]):
        sec = KR.combine(order)
        got = {(c["batch"], c["run"]) for c in sec["cells"]}
        assert got == {(1, "r1"), (8, "r2"), (32, "r3")}, order
        assert len(sec["cells"]) == 12 and sec["runs"] == ["r1", "r2", "r3"]
        assert sec["layers"] == {"4096:1": 12, "4096:8": 12, "4096:32": 11}
        assert _ratio(sec, "(auto) / AR", 5, 1) == 3.0
    # the check can fail: folding in the order given (bench.k26.merge alone) lets the stale copy win
    from kdtree.bench.k26 import merge
    naive = merge(merge(r1, r2), r3)
    assert {(c["batch"], c["run"]) for c in naive["cells"]} != {(1, "r1"), (8, "r2"), (32, "r3")}


def test_combine_leaves_out_a_profile_cut_off_before_its_auto_row():
    """A newer run's profile at a cell without its auto row (a command's limit cut the sweep) replaces no
    earlier complete run's rows and is listed as incomplete; its complete profiles still replace theirs.
    Can fail: the same sections with the cut profile's rows completed replace the old run's."""
    old = _section(_rows(32768, 8, 3.0, "r1", 1.0) + _rows(32768, 8, 5.0, "r1", 1.0))
    cut = [c for c in _rows(32768, 8, 3.0, "r2", 2.0) if c["budget"] != "auto"]
    new = _section(_rows(32768, 8, 5.0, "r2", 2.0) + cut, partial=True)
    for order in ([old, new], [new, old]):
        sec = KR.combine(order)
        got = {(c["tau_chain"], c["run"]) for c in sec["cells"]}
        assert got == {(3.0, "r1"), (5.0, "r2")}, order
        assert sec["incomplete"] == [{"run": "r2", "context": 32768, "batch": 8, "tau_chain": 3.0, "rows": 3}]
    whole = KR.combine([old, _section(_rows(32768, 8, 5.0, "r2", 2.0) + _rows(32768, 8, 3.0, "r2", 2.0))])
    assert {(c["tau_chain"], c["run"]) for c in whole["cells"]} == {(3.0, "r2"), (5.0, "r2")}
    assert "incomplete" not in whole
    with pytest.raises(ValueError, match="auto row"):
        KR.combine([_section(cut)])


def test_combine_prefers_a_finished_sweeps_rows_and_forms_the_targets_again():
    """A run's rows in a partial record (written before its draft times were added) and in its finished
    record: the finished copies win in either order, as do its other fields; one run alone gets its
    targets formed from its rows, not the stale ones it carried."""
    full = _section([dict(c, draft_s=0.1) for c in _rows(4096, 8, 5.0, "r1", 1.0)], label="full")
    part = _section(_rows(4096, 8, 5.0, "r1", 1.0), label="partial", partial=True)
    for order in ([part, full], [full, part]):
        sec = KR.combine(order)
        assert {c["draft_s"] for c in sec["cells"] if c["mode"] != "ar"} == {0.1}, order
        assert sec["label"] == "full" and "partial" not in sec
    one = KR.combine([dict(full, targets=[{"name": "stale"}])])
    names = [t["name"] for t in one["targets"]]
    assert "stale" not in names and len(names) == 2 and all("batch 8" in n for n in names), names


def test_combine_takes_a_cell_whose_layer_count_changed_once_every_profile_is_rerun():
    """A cell measured at 11 layers for two profiles, then at 10 for each in its own command: the fold
    passes through a mixed cell (the first new command), the combined rows do not mix, in any order; a
    cell left mixed is refused."""
    old = _section(_rows(4096, 32, 3.0, "r1", 1.0, layers=11) + _rows(4096, 32, 5.0, "r1", 1.0, layers=11))
    a = _section(_rows(4096, 32, 3.0, "r2", 2.0, layers=10), partial=True)
    b = _section(_rows(4096, 32, 5.0, "r3", 2.0, layers=10), partial=True)
    for order in ([old, a, b], [b, old, a]):
        sec = KR.combine(order)
        assert {(c["run"], c["layers"]) for c in sec["cells"]} == {("r2", 10), ("r3", 10)}, order
        assert sec["layers"] == {"4096:32": 10} and len(sec["targets"]) == 4
    with pytest.raises(ValueError, match=r"would mix \[10, 11\] MoE layers"):
        KR.combine([old, a])


def test_combine_rejects_what_it_cannot_place():
    ok = _section(_rows(4096, 1, 5.0, "r1", 1.0))
    with pytest.raises(ValueError, match="no sections"):
        KR.combine([])
    with pytest.raises(ValueError, match="section 1 has no 'cells'"):
        KR.combine([ok, {"targets": []}])
    bad = _section([dict(c, run=None) for c in _rows(4096, 8, 5.0, None, 1.0)])
    with pytest.raises(ValueError, match="without its run: ar None at 4096:8"):
        KR.combine([ok, bad])
    with pytest.raises(ValueError, match="routings"):
        KR.combine([ok, _section(_rows(4096, 8, 5.0, "r2", 1.0), routing="uniform")])


def test_finish_projects_the_rows_and_sets_the_target():
    from test_project import _rec
    rows = [dict(c, round_gpu_span_median_s=0.01) for c in _rows(4096, 1, 5.0, "r1", 1.0)]
    sec = _section(rows, targets=[{"name": "K2.6 projection old", "measured": 0.0}])
    assert KR.finish(sec, None) == [] and "projection_check" not in sec   # no record: left as it is
    chk = KR.finish(sec, _rec(), drafter_layers=3, n_layers=61, vocab=1000, hidden=64)
    assert {r["mode"] for r in chk} == {"ar", "dflash", "ddtree"} and sec["projection_check"] == chk
    proj = [t for t in sec["targets"] if t["name"].startswith("K2.6 projection")]
    assert len(proj) == 1 and math.isclose(proj[0]["measured"], sum(r["within"] for r in chk) / len(chk))
    (full,) = sec["projection_full"]["rows"]
    assert full["best_budget"] == 4 and math.isclose(full["speedup"],
                                                     full["ddtree_tok_per_s"] / full["ar_tok_per_s"])


def test_finish_projects_a_cut_off_sweeps_rows_with_their_runs_measured_draft():
    """A sweep cut off after its DFlash row wrote its speculative rows without `draft_s`: finish gives
    each the draft and commit seconds its own run's DFlash row measured (`stages`), never another run's, so
    the projection's drafter is the measured one, its context update included. Can fail: without it the
    drafter is modelled from the record (another time) and the commit left out."""
    from test_project import _rec
    rows = [dict(c, round_gpu_span_median_s=0.01) for c in _rows(4096, 1, 5.0, "r1", 1.0)]
    for c in rows:
        if c["mode"] == "dflash":
            c["stages"] = {"draft": {"gpu_s": 0.0042}, "commit": {"gpu_s": 0.0005}}
    other = [dict(c, round_gpu_span_median_s=0.01) for c in _rows(4096, 1, 3.0, "r2", 1.0)]
    from kdtree import project
    modelled = project.check_engine(_rec(), [dict(c) for c in rows + other], drafter_layers=3, vocab=1000,
                                    hidden=64)
    sec = _section(rows + other)
    chk = KR.finish(sec, _rec(), drafter_layers=3, n_layers=61, vocab=1000, hidden=64)
    spec = [c for c in sec["cells"] if c["mode"] != "ar"]
    assert {(c["run"], c.get("draft_s"), c.get("commit_s")) for c in spec} == {("r1", 0.0042, 0.0005),
                                                                              ("r2", None, None)}
    for r, m in zip(chk, modelled):
        if r["tau_chain"] == 5.0 and r["mode"] != "ar":
            assert r["parts"]["draft"] == 0.0042 != m["parts"]["draft"]
            assert r["parts"]["commit"] == 0.0005 and m["parts"]["commit"] == 0.0
        else:
            assert r["parts"] == m["parts"] and r["parts"]["commit"] == 0.0


def test_cli_combines_into_the_record_and_leaves_it_alone_on_bad_input(tmp_path, capsys):
    into = tmp_path / "e2e.json"
    auto_t = {"name": "auto t", "measured": 1.0, "goal": 1, "met": True}
    base = {"device": "gpu", "auto": {"targets": [auto_t]}, "k26": _section(_rows(4096, 1, 5.0, "r1", 1.0))}
    into.write_text(json.dumps(base))
    other = tmp_path / "run2.json"
    queued = [dict(c, queued={"full_tok_per_s": 0.9 * c["tok_per_s"], "requests": 16})
              for c in _rows(4096, 8, 5.0, "r2", 1.0)]   # the figure draws the queue's rows too
    other.write_text(json.dumps({"k26": _section(queued)}))
    before = into.read_text()
    for bad, msg in ((tmp_path / "missing.json", "not a readable JSON record"),
                     (tmp_path / "e2e_b.json", "has no 'k26' section")):
        if "_b" in bad.name:
            bad.write_text(json.dumps({"auto": {}}))
        with pytest.raises(SystemExit, match=msg):
            KR.main(["--into", str(into), str(other), str(bad)])
        assert into.read_text() == before and not (tmp_path / "e2e_k26.png").exists()
    KR.main(["--into", str(into), str(other)])
    rec = json.loads(into.read_text())
    assert rec["k26"]["runs"] == ["r1", "r2"] and rec["device"] == "gpu"
    assert {c["batch"] for c in rec["k26"]["cells"]} == {1, 8}
    names = [t["name"] for t in rec["targets"]]
    assert sum("queue of 16" in n for n in names) == 2
    assert names[0] == "auto t" and sum("K2.6 sim" in n for n in names) == len(rec["k26"]["targets"])
    assert (tmp_path / "e2e_k26.png").stat().st_size > 0 and "runs r1, r2" in capsys.readouterr().out


def test_plot_draws_only_the_cells_present_with_legends_outside(tmp_path):
    """The figure from a small record: one tok/s panel per (context, batch) cell present (a missing cell
    leaves no empty panel), a round-cost panel only for a context with measured rounds, every legend
    outside the axes, nothing cut at the edge, base-2 budget ticks that are whole numbers (and auto). The
    checker can fail: a panel without points and a legend inside an axes are reported."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kdtree import plots
    def span(c):
        return 0.01 * (1 + c["budget"]) if isinstance(c["budget"], int) else 0.01
    timed = [dict(c, round_gpu_span_median_s=span(c),
                  queued={"full_tok_per_s": 0.9 * c["tok_per_s"]} if c["batch"] == 8 else None)
             for c in _rows(4096, 1, 5.0, "r1", 1.0) + _rows(4096, 8, 5.0, "r1", 8.0)
             + _rows(4096, 8, 3.0, "r1", 6.0, fitted=True)]
    untimed = _rows(32768, 1, 5.0, "r1", 0.9)   # no round times: no round-cost panel for its context
    sec = _section(timed + untimed, device="Test GPU")
    fig = KR.plot(sec, [], tmp_path / "k26.png")
    assert (tmp_path / "k26.png").stat().st_size > 1000
    titles = sorted(ax.get_title() for ax in fig.axes)
    assert titles == ["batch 1, context 32,768, 12 MoE layers", "batch 1, context 4,096, 12 MoE layers",
                      "batch 8, context 4,096, 12 MoE layers", "round cost, context 4,096"], titles
    assert plots.layout_faults(fig) == []
    assert fig.legends and all(ax.get_legend() is None for ax in fig.axes
                               if not ax.get_title().startswith("round cost"))
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "chain tau 3 (simulated, fitted to the trained pair)" in texts
    assert "queue, full-batch rounds" in texts
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels and all(t.replace(",", "").isdigit() or t == "auto" for t in labels), labels
    plt.close(fig)
    # the checker can fail
    bad, (a, b) = plt.subplots(1, 2)
    a.plot([1, 2], [1, 2], label="x")
    a.legend(loc="center")
    b.plot([], [])
    faults = plots.layout_faults(bad)
    assert any(f.startswith("legend over an axes") for f in faults) and any(f.startswith("empty axes")
                                                                               for f in faults), faults
    plt.close(bad)
