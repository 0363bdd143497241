"""docs/results.md is what kdtree.report makes of the committed records; its checks can fail."""
import json
import shutil

import pytest

from kdtree import lab, report


def test_the_page_equals_the_records():
    assert report.PAGE.read_text() == report.report(), "docs/results.md is stale: run python -m kdtree report"


def _copy(tmp_path):
    dst = tmp_path / "outputs"
    shutil.copytree(report.RECORDS, dst, ignore=shutil.ignore_patterns("*.ipynb", "*.png", "*.log"))
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
    lines = report._phase_kernels(cells)
    assert lines and "| 8 | auto (previous) | 10 / 120 |" in "\n".join(lines)
    assert "| 8 | B=16 | 10 / 100 |" in "\n".join(lines) and "50 / 600" in "\n".join(lines)
    assert report._phase_kernels([{**c, "stage_kernels": {}} for c in cells]) == []
    import json
    rec = json.loads((report.ROOT / "outputs/h200/e2e.json").read_text())
    profiled = any(c.get("budget") == "auto" and c.get("stage_kernels") for c in rec["auto"]["cells"])
    assert ("Auto's round beside" in report.report()) == profiled
