"""The notebooks' parameter declarations (kdtree.lab_params): one per notebook, read by the runner before the
kernel starts, by `lab --help` and by each notebook's own check cell; the runner's quick refusals; the
shipped trained pair written only on request."""
import ast
import os
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdtree import lab, lab_params

ROOT = Path(__file__).resolve().parent.parent


def _cells(nb: Path) -> list[dict]:
    return json.loads(nb.read_text())["cells"]


def _parameters_cell(nb: Path) -> str:
    cell = next(c for c in _cells(nb) if "parameters" in c.get("metadata", {}).get("tags", []))
    return "".join(cell["source"])


def _cell_defaults(nb: Path) -> dict:
    return {t.id: ast.literal_eval(node.value) for node in ast.parse(_parameters_cell(nb)).body
            if isinstance(node, ast.Assign) for t in node.targets}


BAD = [  # (notebook, name, value, what the message says is expected)
    ("00", "n_prompts", -1, "an int >= 1"),
    ("00", "n_prompts", 0, "an int >= 1"),
    ("00", "max_new_tokens", 0, "an int >= 1"),
    ("00", "golden_cases", 0, "an int >= 1"),
    ("00", "seed", 1.5, "an int in [0, "),
    ("00", "block_size", 1, "an int >= 2"),
    ("00", "budgets", [], "a non-empty list"),
    ("00", "budgets", (4, 8), "a non-empty list"),   # the notebook adds a list to it
    ("00", "budgets", [4, "x"], "each an int >= 1"),
    ("00", "config", ["tiny-z"], "a preset"),
    ("00", "config", [], "a preset"),
    ("01", "smoke", "no", "one of ['auto', True, False]"),
    ("01", "repeats", True, "an int >= 1"),
    ("01", "config", 3, "a preset"),
    ("02", "stage", "bogus", "one of ['all', 'pair', 'auto', 'k26']"),
    ("02", "engine_hf", "no", "True or False"),
    ("02", "temperatures", [1.0], "holding 0.0"),
    ("02", "temperatures", [0.0, float("nan")], "a finite number >= 0"),
    ("02", "profile_ratio", 1.0, "a finite number in [0, 1)"),
    ("02", "k26_routing", "bogus", "one of ['model', 'uniform']"),
    ("02", "k26_cells", [[4096]], "[context, batch]"),
    ("02", "k26_profiles", [[9.0, 8]], "chain tau below drafter block"),
    ("02", "allreduce_Bps", -1.0, "None or a finite number > 0"),
    ("02", "ckpt_dir", "../no/such/pair", "a folder holding target/ and drafter/"),
    ("02", "k26_from", "no_such_record.json", "None or an existing file"),
    ("02", "k26_before", "no_such_record.json", "None or an existing file"),
    ("01", "layer_path", "eager", "one of"),
    ("03", "stage", "bogus", "one of ['all', 'target', 'drafter', 'measure']"),
    ("03", "corpus", ["perl"], "each one of ['stdlib', 'torch', 'numpy']"),
    ("03", "target_kw", {"hiden_size": 64}, "ModelArgs fields"),
    ("03", "depth_decay", 1.5, "a finite number in (0, 1]"),
    ("03", "target_lr", 0, "a finite number > 0"),
    ("03", "overwrite_trained", "yes", "True or False"),
]


@pytest.mark.parametrize("nb,name,value,want", BAD)
def test_a_bad_value_is_refused_by_the_runner_naming_parameter_value_and_expectation(nb, name, value, want):
    path = lab.find_notebooks([nb])[0]
    with pytest.raises(ValueError) as e:
        lab.check_parameters(path, {name: value})
    msg = str(e.value)
    assert msg.startswith(f"-p {name} {value!r}: expected ") and want in msg, msg


def test_the_issue_values_are_refused_before_anything_is_written(tmp_path, capsys):
    for argv in (["00", "-p", "n_prompts", "-1"], ["00", "-p", "max_new_tokens", "0"],
                 ["00", "-p", "n_prompts", "0"], ["00", "-p", "golden_cases", "0"],
                 ["02", "-p", "stage", "bogus"]):
        out = tmp_path / "never"
        assert lab.main_lab(argv + ["--device", "cpu", "--out-dir", str(out)]) == 2, argv
        assert not out.exists()
        err = capsys.readouterr().err
        assert f"-p {argv[2]} " in err and "expected" in err, err


def test_good_values_pass():
    ok = {"00": {"config": "tiny-b", "n_prompts": 1, "budgets": [4, 8], "seed": 3},
          "01": {"smoke": True, "config": "kimi-k2.6", "tree_budgets": [16]},
          "02": {"stage": "k26", "temperatures": [0, 1.0], "k26_cells": [[4096, 1], [4096, 8]],
                 "allreduce_Bps": 4.5e11, "k26_from": None, "profile_ratio": 0},
          "03": {"stage": "measure", "corpus": ["stdlib"], "target_kw": {"hidden_size": 64},
                 "ckpt_dir": "/tmp/elsewhere", "overwrite_trained": True}}
    for nb, params in ok.items():
        lab.check_parameters(lab.find_notebooks([nb])[0], params)


def test_a_rule_over_several_parameters_is_checked_by_the_runner_and_the_notebook(tmp_path, capsys):
    nb = lab.find_notebooks(["02"])[0]
    want = r"02_end_to_end.ipynb: profiles=\[3.0, 20.0\]: each chain tau must lie below block_size=16"
    with pytest.raises(ValueError, match=want):
        lab.check_run(nb, {"profiles": [3.0, 20.0]}, "cpu")
    lab.check_run(nb, {"profiles": [3.0, 20.0], "block_size": 32}, "cpu")
    out = tmp_path / "never"
    assert lab.main_lab(["02", "--device", "cpu", "--out-dir", str(out), "-p", "block_size", "4"]) == 2
    assert "each chain tau must lie below block_size=4" in capsys.readouterr().err and not out.exists()
    with pytest.raises(ValueError, match=r"^profiles=\[3.0, 20.0\]: each chain tau"):
        lab_params.check("02", {"profiles": [3.0, 20.0]}, base=nb.parent)


def test_every_notebook_has_one_declaration_that_matches_its_parameters_cell():
    """Names and defaults of the declaration are the parameters cell's; the defaults pass the checks."""
    nbs = lab.find_notebooks(())
    assert sorted(lab_params.NOTEBOOKS) == sorted(nb.stem for nb in nbs)
    for nb in nbs:
        decl = lab_params.declaration(nb.stem[:2])
        assert decl is lab_params.declaration(nb.stem) is lab_params.declaration(nb)
        defaults = _cell_defaults(nb)
        assert list(decl) == list(defaults), nb.name
        assert {k: p.default for k, p in decl.items()} == defaults, nb.name
        assert all(p.help for p in decl.values()), nb.name
        lab_params.check(nb.stem, defaults, base=nb.parent)  # the defaults pass
    with pytest.raises(ValueError, match="no parameter declaration for notebook '99'"):
        lab_params.declaration("99")


def test_the_declarations_agree_with_the_library():
    from kdtree import data
    from kdtree.config import ModelArgs
    assert tuple(lab_params.CORPUS_SOURCES) == data.SOURCES
    assert set(lab_params.MODEL_FIELDS) == {f.name for f in ModelArgs.__dataclass_fields__.values()}


def _first_check_lines(nb: Path) -> str:
    """The notebook's own check: the lines of its first code cell after the parameters that use lab_params."""
    code = [c for c in _cells(nb) if c["cell_type"] == "code"
            and "parameters" not in c.get("metadata", {}).get("tags", [])]
    lines = [ln for ln in "".join(code[0]["source"]).splitlines()
             if ln.startswith(("from kdtree import lab_params", "lab_params.check("))]
    return "\n".join(lines)


@pytest.mark.parametrize("nb,name,value,want",
                         [b for b in BAD if b[1] not in ("ckpt_dir", "k26_from", "k26_before")])
def test_each_notebook_checks_its_parameters_with_the_same_declaration(nb, name, value, want, monkeypatch):
    """The first code cell calls lab_params.check(NN, globals()): a papermill or Jupyter user gets the
    runner's message (as name=value)."""
    path = lab.find_notebooks([nb])[0]
    check = _first_check_lines(path)
    assert f'lab_params.check("{nb}", globals())' in check, path.name
    monkeypatch.chdir(path.parent)  # where papermill and Jupyter run it
    ns = {}
    exec(_parameters_cell(path), ns)
    exec(check, ns)  # the defaults pass
    ns[name] = value
    with pytest.raises(ValueError) as e:
        exec(check, ns)
    msg = str(e.value)
    assert msg.startswith(f"{name}={value!r}: expected ") and want in msg, msg


def test_lab_help_lists_each_parameter_with_its_allowed_values(capsys):
    with pytest.raises(SystemExit):
        lab.main_lab(["--help"])
    out = capsys.readouterr().out
    assert "n_prompts = 6" in out and "an int >= 1" in out
    assert "stage = 'all'" in out and "one of ['all', 'target', 'drafter', 'measure']" in out
    assert "overwrite_trained = False" in out and "--overwrite-trained" in out
    for nb in lab.find_notebooks(()):
        for name, p in lab_params.declaration(nb).items():
            if name not in lab.RUNNER_PARAMETERS:
                assert p.help in out, name


# ------------------------------------------------------------------ refusals before the heavy imports
def _lab_in_a_fresh_interpreter(args) -> tuple[int, list[str], float, str]:
    code = ("import sys, time; t = time.perf_counter(); from kdtree.__main__ import main; "
            f"rc = main({args!r}); "
            "print(rc, [m for m in ('torch', 'numpy', 'papermill') if m in sys.modules], "
            "time.perf_counter() - t)")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    last = r.stdout.strip().splitlines()[-1]
    rc = int(last.split(" ", 1)[0])
    heavy = ast.literal_eval(last[last.index("["):last.index("]") + 1])
    return rc, heavy, wall, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["lab", "99"], "notebook '99' not found"),
    (["lab", "*"], "notebook '*': a pattern is not expanded here; expected a notebook name"),
    (["lab", "02", "-p", "stage", "bogus"], "-p stage 'bogus': expected one of"),
    (["lab", "00", "-p", "n_prompts", "-1"], "-p n_prompts -1: expected an int >= 1"),
    (["lab", "00", "-p", "n_promts", "1"], "declares no such parameter"),
    (["lab", "00", "--device", "tpu"], "device='tpu': expected 'auto', 'cpu', 'cuda' or 'cuda:N'"),
])
def test_a_bad_notebook_or_parameter_is_refused_before_torch_is_imported(args, needle, tmp_path):
    out = tmp_path / "never"
    rc, heavy, wall, err = _lab_in_a_fresh_interpreter(args + ["--out-dir", str(out)])
    assert rc == 2 and needle in err and not out.exists(), err
    assert heavy == [], heavy
    assert wall < 5.0, wall


def test_lab_help_needs_no_torch():
    code = ("import sys\nfrom kdtree.lab import main_lab\ntry:\n    main_lab(['--help'])\n"
            "except SystemExit:\n    pass\n"
            "print('HEAVY', [m for m in ('torch', 'papermill') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "HEAVY []" in r.stdout, r.stdout[-500:] + r.stderr[-2000:]


def test_the_package_still_exports_its_names():
    import kdtree
    from kdtree import TINY_A, KVCache, Transformer, build_model  # noqa: F401
    assert kdtree.model.Transformer is Transformer and callable(build_model)
    with pytest.raises(AttributeError):
        kdtree.no_such_name  # noqa: B018


# ------------------------------------------------------------------ the shipped trained pair
def test_training_writes_the_shipped_pair_only_with_the_flag(tmp_path, capsys):
    """A run on the shipped pair (however spelt) trains beside its record (out/trained; a smoke run
    out/smoke_ckpt) unless overwrite_trained; another folder is used as given; "measure" reads the pair an
    earlier stage left beside the record, else the shipped one. Nothing is refused: `make lab` runs on a
    GPU."""
    nb = lab.find_notebooks(["03"])[0]
    out = tmp_path / "out"
    for spelt in ("../data/trained", "../data/trained/", "../notebooks/../data/./trained",
                  str(ROOT / "data" / "trained")):
        for stage in ("all", "target", "drafter"):
            lab.check_run(nb, {"smoke": False, "stage": stage, "ckpt_dir": spelt}, "cuda")
    cwd = os.getcwd()
    os.chdir(nb.parent)
    try:
        for spelt in ("../data/trained", "../data/trained/", str(ROOT / "data" / "trained")):
            for stage in ("all", "target", "drafter"):
                assert lab_params.training_folder(spelt, out, stage, False, False) == str(out / "trained")
                assert lab_params.training_folder(spelt, out, stage, True, False) == str(out / "smoke_ckpt")
                assert lab_params.training_folder(spelt, out, stage, False, True) == spelt   # on request
            assert lab_params.training_folder(spelt, out, "measure", False, False) == spelt  # nothing beside
        (out / "trained" / "drafter").mkdir(parents=True)
        got = lab_params.training_folder("../data/trained", out, "measure", False, False)
        assert got == str(out / "trained")
        assert lab_params.training_folder(str(tmp_path), out, "all", False, False) == str(tmp_path)
    finally:
        os.chdir(cwd)
    # the flag goes to the notebooks that declare it; alone with others it is refused
    never = tmp_path / "never"
    assert lab.main_lab(["00", "--overwrite-trained", "--device", "cpu", "--out-dir", str(never)]) == 2
    assert "--overwrite-trained" in capsys.readouterr().err and not never.exists()


def test_notebook_03_picks_its_checkpoint_folder_through_training_folder(monkeypatch):
    nb = lab.find_notebooks(["03"])[0]
    monkeypatch.chdir(nb.parent)
    ns = {}
    exec(_parameters_cell(nb), ns)
    assert ns["overwrite_trained"] is False and lab_params.shipped_pair(ns["ckpt_dir"])
    src = "".join(next(c for c in _cells(nb) if "lab_params.check" in "".join(c["source"]))["source"])
    assert "lab_params.training_folder(ckpt_dir, out, stage, smoke, overwrite_trained)" in src
    assert src.index("training_folder") < src.index("ckpt = Path(ckpt_dir)")   # before any write
    assert lab_params.shipped_pair("../data/trained/") and lab_params.shipped_pair(ROOT / "data" / "trained")
    assert not lab_params.shipped_pair("/tmp/elsewhere")
