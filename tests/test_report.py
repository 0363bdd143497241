"""docs/results.md is what kdtree.report makes of the committed records; its checks can fail."""
import json
import re
import shutil

import pytest

from kdtree import lab, report, report_format, report_records


def test_the_page_equals_the_records():
    assert report.PAGE.read_text() == report.report(), "docs/results.md is stale: run python -m kdtree report"


def _copy(tmp_path):
    dst = tmp_path / "outputs"
    # the committed records only: not a local CPU lab run (outputs/cpu/) or a run's staging folder
    shutil.copytree(report.RECORDS, dst,
                    ignore=shutil.ignore_patterns("*.ipynb", "*.png", "*.log", lab.CPU_DIR, ".*.run-*"))
    return dst


def test_a_changed_record_changes_the_page(tmp_path):
    rec_dir = _copy(tmp_path)
    p = rec_dir / "h200" / "engine.json"
    rec = json.loads(p.read_text())
    rec["ar"]["float32"]["engine_compiled"]["tok_per_s"] *= 3
    p.write_text(json.dumps(rec))
    page = report.report(rec_dir)
    assert page != report.PAGE.read_text()
    assert f"{rec['ar']['float32']['engine_compiled']['tok_per_s']:,.0f}" in page


def test_every_goal_of_a_record_is_in_the_page():
    page = report.report()
    rec = json.loads((report.RECORDS / "h200" / "e2e.json").read_text())
    for t in report.all_targets("e2e.json", rec):
        assert t["name"] in page


def test_a_missing_record_is_named_with_its_command(tmp_path):
    rec_dir = _copy(tmp_path)
    (rec_dir / "h200" / "bridge.json").unlink()
    page = report.report(rec_dir)
    assert "No record yet: `python -m kdtree bench --bridge` writes it." in page
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "No GPU record yet" in report.report(empty)


def test_bad_records_folder_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="records"):
        report.report(tmp_path / "nowhere")
    assert report.main(["--records", str(tmp_path / "nowhere"), "--out", str(tmp_path / "page.md")]) == 2
    assert not (tmp_path / "page.md").exists()
    assert "records" in capsys.readouterr().out


def test_lab_rewrites_the_page_only_after_a_gpu_folder_run(tmp_path, monkeypatch):
    rec_dir = _copy(tmp_path)
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    monkeypatch.setattr(lab, "OUTPUTS", rec_dir)
    monkeypatch.setattr(report, "PAGE", page)
    assert lab.refresh_results(rec_dir) is None and not page.exists()          # a CPU run: outputs/ itself
    assert lab.refresh_results(tmp_path / "elsewhere") is None and not page.exists()
    assert lab.refresh_results(rec_dir / "h200") == page
    assert page.read_text() == report.report(rec_dir)


def test_auto_phase_kernels_sit_beside_the_fixed_round(tmp_path):
    """An auto cell's stage profile is tabulated beside the fixed cell of the plan it chose most; without
    profiles no such table appears; the results page has it exactly when the committed records profile an
    auto cell."""
    def prof(us, **kw):
        st = {s: {"kernels": 10, "gpu_s": us * 1e-6, "ops": 5} for s in ("draft", "build", "verify", "walk",
                                                                            "commit")}
        return {**st, "total": {"kernels": 50, "gpu_s": 5 * us * 1e-6}, **kw}
    cells = [{"batch": 8, "budget": 16, "name": "B=16", "stage_kernels": prof(100)},
             {"batch": 8, "budget": "auto", "name": "auto (previous)",
              "stage_kernels": prof(120, plan="B=16", build_nodes=32)}]
    lines = report_records._phase_kernels(cells)
    assert lines and "| 8 | auto (previous) | 10 / 120 |" in "\n".join(lines)
    assert "| 8 | B=16 | 10 / 100 |" in "\n".join(lines) and "50 / 600" in "\n".join(lines)
    assert report_records._phase_kernels([{**c, "stage_kernels": {}} for c in cells]) == []
    import json
    rec = json.loads((report.ROOT / "outputs/h200/e2e.json").read_text())
    profiled = any(c.get("budget") == "auto" and c.get("stage_kernels") for c in rec["auto"]["cells"])
    assert ("Auto's round beside" in report.report()) == profiled


# ------------------------------------------------------------------------------------------ the answer first
EXPONENT = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?[eE][-+]?\d+(?!\w|\.\d)")


def exponent_numbers(text: str) -> list[str]:
    """Every number of `text` written in exponent notation ("1e+03", "2.5E-4"), not words such as e2e or a
    commit hash."""
    return EXPONENT.findall(text)


def test_the_exponent_checker_can_fail():
    """The checker flags exponent notation wherever it stands, and the old table format (3 significant
    digits through "g") wrote one for 999.6 tok/s; it passes names and hashes that hold an e between
    digits."""
    assert exponent_numbers("| B=auto | 6.34 | 1e+03 | 1,020 |") == ["1e+03"]
    assert exponent_numbers("x 2.5E-4 and -3e7.") == ["2.5E-4", "-3e7"]
    assert exponent_numbers(f"| {999.6:.3g} |") == ["1e+03"]
    assert exponent_numbers("`e2e.json`, run c58e63d, 4,096 tokens, 1.5 x, e2e_k26.png") == []


def test_no_number_on_the_page_is_in_exponent_notation():
    page = report.report()
    assert exponent_numbers(page) == [], exponent_numbers(page)[:5]
    for x, want in ((999.6, "1,000"), (999.4, "999"), (0.0000123, "0.0000123"), (-0.00571, "-0.00571"),
                    (1.2345e20, f"{1.2345e20:,.0f}"), (0.0, "0"), (2.0, "2"), (float("nan"), "nan")):
        assert report_format._num(x) == want, (x, report_format._num(x))
        assert exponent_numbers(report_format._num(x)) == []


def _k26_rec(device="Test GPU X"):
    def rows(C, b, tau, ar, best, budget, fitted=False):
        base = dict(context=C, batch=b, layers=5, run="r1", tau_chain=tau, block=8, fitted=fitted)
        return [dict(base, mode="ar", budget=None, tok_per_s=ar),
                dict(base, mode="dflash", budget=None, tok_per_s=0.9 * ar),
                dict(base, mode="ddtree", budget=budget, tok_per_s=best),
                dict(base, mode="ddtree", budget=2 * budget, tok_per_s=0.5 * best),
                dict(base, mode="ddtree", budget="auto", tok_per_s=0.9 * best)]
    cells = rows(4096, 1, 5.0, 100.0, 250.0, 8) + rows(4096, 1, 2.72, 100.0, 90.0, 4, fitted=True) \
        + rows(4096, 32, 5.0, 1000.0, 800.0, 4)
    return {"device": device, "targets": [{"name": "a goal", "measured": 2.0, "goal": 1.0, "met": True}],
            "k26": {"label": "K2.6 shape, SIMULATED", "cells": cells, "targets": []},
            "auto": {"dtype": "float32", "compile": False, "cells": [
                dict(batch=1, mode="ar", budget=None, compiled=False, tok_per_s=1000.0),
                dict(batch=1, mode="ar", budget=None, compiled=True, tok_per_s=2500.0),
                dict(batch=1, mode="ddtree", budget=64, tok_per_s=1500.0),
                dict(batch=1, mode="ddtree", budget="auto", decide="previous", tok_per_s=1400.0)]}}


def test_the_page_opens_with_the_answer(tmp_path):
    """Before the goal table: the K2.6 rows (simulated, each against the engine's AR of its own run and
    cell, on the card named), the trained pair's, and which AR each baseline is; the committed page reads
    the H200 record so. Can fail: a folder without such records has no headline."""
    gpu = tmp_path / "outputs" / "gx"
    (gpu / "probe" / "deeper").mkdir(parents=True)
    (gpu / "e2e.json").write_text(json.dumps(_k26_rec()))
    sweep = dict(_k26_rec()["k26"], device="Test GPU X", decode_path="fused")   # a bench.k26 record, below
    (gpu / "probe" / "deeper" / "e2e_k26_fused.json").write_text(json.dumps(sweep))
    (gpu / "probe" / "e2e_k26.partial.json").write_text(json.dumps(dict(sweep, decode_path="partial")))
    page = report.report(tmp_path / "outputs")
    assert page.index("## The answer: does DDTree pay?") < page.index("## gx (`outputs/gx/`)") \
        < page.index("Goals (")
    head = "\n".join(report.headline(tmp_path / "outputs"))
    assert "SIMULATED" in head and "engine's own AR" in head and "| card |" in head
    assert ("| `gx/e2e.json` | Test GPU X | 1 | 4,096 | 5 | 100 | 0.90x at B = 4 (auto 0.81x) | **2.50x** at "
            "B = 8 (auto 2.25x) |") in head
    assert "| `gx/e2e.json` | Test GPU X | 32 | 4,096 | 5 | 1,000 | - | 0.80x at B = 4 (auto 0.72x) |" in head
    assert "| `gx/probe/deeper/e2e_k26_fused.json` (fused decode) | Test GPU X | 1 | 4,096 |" in head
    assert "partial" not in head
    assert "τc 2.72 (fitted to the trained pair)" in head
    assert "**batch 1** (Test GPU X): the best fixed budget beats AR in 1 of 2" in head
    assert "**batch 32** (Test GPU X): the best fixed budget beats AR in 0 of 1" in head
    assert ("| `gx/e2e.json` auto | Test GPU X | engine, CUDA graphs, float32 | 1 | 1,000 | 1,500 (B = 64) | "
            "1.50x | 1.40x |") in head
    assert "1,000 tok/s (Test GPU X) is the engine's AR with CUDA graphs" in head and "2,500 tok/s" in head
    (gpu / "e2e.json").write_text(json.dumps({"device": "Test GPU X"}))
    (gpu / "probe" / "deeper" / "e2e_k26_fused.json").unlink()
    assert report.headline(tmp_path / "outputs") == []
    assert "## The answer" not in report.report(tmp_path / "outputs")
    # the committed page: the H200's K2.6 rows and the three ARs the goal table shows, explained
    page = report.PAGE.read_text()
    head = page[:page.index("## h200 (`outputs/h200/`)")]
    assert "## The answer: does DDTree pay?" in head and "NVIDIA H200" in head and "SIMULATED" in head
    rec = json.loads((report.RECORDS / "h200" / "e2e.json").read_text())
    ar = next(c for c in rec["pair"]["rows"] if c["mode"] == "ar")
    auto_ar = [c for c in rec["auto"]["cells"] if c["batch"] == 1 and c["mode"] == "ar"]
    for c in [ar, *auto_ar]:
        assert f"{report_format._num(c['tok_per_s'])} tok/s" in head, c
    assert "reference loop" in head and "torch.compile" in head and "engine AR, tok/s" in head


def test_outputs_cpu_is_no_gpu_section(tmp_path):
    """A CPU lab run's git-ignored outputs/cpu/ neither makes a GPU section nor enters the headline."""
    rec_dir = _copy(tmp_path)
    cpu = rec_dir / lab.CPU_DIR
    cpu.mkdir()
    (cpu / "e2e.json").write_text(json.dumps(_k26_rec("cpu")))
    page = report.report(rec_dir)
    assert "## cpu (" not in page and "`cpu/e2e.json`" not in page
    assert page == report.report(report.RECORDS)


def test_a_folder_with_both_decode_paths_gets_a_before_after_line(tmp_path):
    """Same folder, same cell and profile on --decode-path torch and fused: one line with both ARs and both
    ratios; the 'less to win' reading only where the ratio fell while AR rose. Can fail: a lone path (or two
    paths in different folders) gets no line."""
    gpu = tmp_path / "outputs" / "gx"
    (gpu / "df").mkdir(parents=True)
    torch_sec = dict(_k26_rec()["k26"], device="Test GPU X", decode_path="torch")
    fused_cells = [dict(c, tok_per_s=c["tok_per_s"] * (1.5 if c["mode"] == "ar" else 1.2))
                   for c in torch_sec["cells"]]
    (gpu / "df" / "e2e_k26_torch.json").write_text(json.dumps(torch_sec))
    (gpu / "df" / "e2e_k26_fused.json").write_text(json.dumps(dict(torch_sec, cells=fused_cells,
                                                                  decode_path="fused")))
    head = "\n".join(report.headline(tmp_path / "outputs"))
    line = next(ln for ln in head.splitlines() if ln.startswith("- The fused decode layers") and "τc 5" in ln
                and "batch 1," in ln)
    assert "(`gx/df/`, Test GPU X, batch 1, context 4,096, 5 MoE layers, τc 5): AR 100 -> 150 tok/s" in line
    assert "the best fixed budget over AR 2.50x -> 2.00x; auto 2.25x -> 1.80x" in line
    assert line.endswith("a faster AR leaves DDTree less to win.")
    # a fused record whose ratio rose and which has no auto row: neither the reading nor the auto ratios
    rose = [dict(c, tok_per_s=c["tok_per_s"] * (1.1 if c["mode"] == "ar" else 1.5))
            for c in torch_sec["cells"] if c.get("budget") != "auto"]
    fused_rec = dict(torch_sec, cells=rose, decode_path="fused")
    (gpu / "df" / "e2e_k26_fused.json").write_text(json.dumps(fused_rec))
    line = next(ln for ln in "\n".join(report.headline(tmp_path / "outputs")).splitlines()
                if ln.startswith("- The fused decode layers") and "τc 5" in ln and "batch 1," in ln)
    assert line.endswith("the best fixed budget over AR 2.50x -> 3.41x.") and "auto" not in line
    (gpu / "df" / "e2e_k26_torch.json").rename(gpu / "e2e_k26_torch_elsewhere.json")   # no longer one folder
    (gpu / "other").mkdir()
    (gpu / "e2e_k26_torch_elsewhere.json").rename(gpu / "other" / "e2e_k26_torch.json")
    assert "- The fused decode layers" not in "\n".join(report.headline(tmp_path / "outputs"))


def test_a_record_in_one_subfolder_is_read_and_earlier_runs_are_not(tmp_path):
    """A GPU folder's expected record at its top, else in exactly one subfolder (not `earlier/`): its
    targets count, and the section says where it lies; two candidates or only an earlier run count as none."""
    g = tmp_path / "outputs" / "h100"
    rec = {"targets": [{"key": "peers_ar_vs_hf_compiled", "name": "x", "measured": 6.4, "goal": 3.0,
                        "met": True}]}
    (g / "earlier" / "abc").mkdir(parents=True)
    (g / "earlier" / "peers.json").write_text(json.dumps(rec))
    page = report.report(tmp_path / "outputs")
    assert "No record yet: `python -m kdtree.bench.peers --out outputs/<gpu>` writes it." in page
    (g / "peers").mkdir()
    (g / "peers" / "peers.json").write_text(json.dumps(rec))
    page = report.report(tmp_path / "outputs")
    assert "Recorded in `peers/`" in page and "| 6.4 | 3 | met |" in page
    (g / "other").mkdir()
    (g / "other" / "peers.json").write_text(json.dumps(rec))
    assert "Recorded in" not in report.report(tmp_path / "outputs")
