"""kdtree.bench.goals: one data file of goals, used by every benchmark's targets and read by the report."""
import json
import re
from pathlib import Path

import pytest

from kdtree import report
from kdtree.bench import goals

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"""(?<![\w.])(?:_goal|target|goals\.target)\(\s*["'](\w+)["']""")
BRIDGE = re.compile(r"""["'](bridge_\w+)["']\)""")  # bench.bridge.TARGETS' (row key, goal key) pairs


def _named_keys() -> set:
    """The goal keys the package and the notebooks name in target calls (and bridge.TARGETS)."""
    keys = set()
    for p in [*(ROOT / "kdtree").rglob("*.py"), *(ROOT / "notebooks").glob("*.ipynb")]:
        text = p.read_text()
        if p.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        keys |= set(NAMED.findall(text)) | set(BRIDGE.findall(text))
    return keys


def test_every_goal_the_code_names_is_in_the_file_and_every_goal_is_used():
    named = _named_keys()
    assert named - set(goals.goals()) == set()
    assert set(goals.goals()) - named == set()
    for key, g in goals.goals().items():
        assert isinstance(g["goal"], float | int) and g["record"].endswith(".json"), key
    # the checker fails on a name the file lacks
    assert NAMED.findall('x = _goal("ar_speed", 1.0)') == ["ar_speed"] and "ar_speed" not in goals.goals()


def test_target_judges_against_the_file():
    t = goals.target("ar_ms_per_token", 0.41, dtype="bfloat16", engine="compiled")   # lower is better
    assert t["met"] and t["name"] == "AR batch 1 (bfloat16): ms per token (round wall: replay + host work)"
    assert t["goal"] == goals.goal("ar_ms_per_token")["goal"] and t["engine"] == "compiled" and t["key"]
    assert not goals.target("ar_ms_per_token", 0.5, dtype="float32")["met"]
    assert goals.target("ar_x_hf", 52.1, dtype="bfloat16")["met"]                    # higher is better
    assert not goals.target("ar_x_hf", 29.2, dtype="float32")["met"]
    assert not goals.target("ar_x_hf", None, dtype="float32")["met"]
    assert goals.target("mid_x_hf", 0.5)["info"]
    assert goals.target("bridge_native_b32", 187.0)["batch"] == 32
    with pytest.raises(ValueError, match=r"needs \['dtype'\]"):
        goals.target("ar_x_hf", 30.0)
    with pytest.raises(KeyError, match="key='ar_speed'"):
        goals.target("ar_speed", 1.0)


def test_every_goal_is_found_again_from_its_name_alone():
    """The report joins records written before targets carried their key by the name's template: every
    template must match its own names and no other goal's."""
    for key, g in goals.goals().items():
        fields = {f: "auto (previous)" if f == "cell" else "8" for f in re.findall(r"{(\w+)}", g["name"])}
        t = goals.target(key, 1.0, **fields)
        t.pop("key")
        assert goals.key_of(t) == key, (key, t["name"])
    old_bridge = {"what": "native_graph / reference", "batch": 32, "budget": 1024, "value": 187.0}
    assert goals.key_of(old_bridge) == "bridge_native_b32"
    assert goals.key_of({"name": "a goal nobody set"}) is None


def test_the_report_judges_by_the_file_and_names_goals_without_a_record(tmp_path):
    gpu = tmp_path / "h200"
    gpu.mkdir()
    rec = {"targets": [{"name": "tree round, batch 1, B=64, V=163840, L=15 (us)", "measured": 20.0,
                        "goal": 1.0, "met": False}]}       # the record's own goal is stale: the file's is 25
    (gpu / "bench_kernels.json").write_text(json.dumps(rec))
    page = report.report(tmp_path)
    assert "| bench_kernels.json | tree round, batch 1, B=64, V=163840, L=15 (us) | 20 | 25 | met |" in page
    assert "Goals no record here measures yet:" in page and "AR batch 1 (<dtype>)" in page
    assert "every cell ran" not in page.split("Goals no record here")[1].split("\n")[0]


def test_a_target_prints_as_one_line_also_without_a_measurement():
    assert goals.line(goals.target("ar_x_hf", None, dtype="float32")) \
        == "[MISSED] AR batch 1 (float32): x HF generate, same checkpoint and dtype, whole requests: - " \
           "(goal 30.0)"
    old = {"what": "native_graph / reference", "batch": 1, "budget": 64, "value": 18.1, "goal": 10.0,
           "met": True}
    assert goals.line(old) == "[met] native_graph / reference, batch 1, budget 64: 18.1 (goal 10.0)"
    assert goals.line(goals.target("bridge_native_b1", 18.1)) == goals.line(old)
