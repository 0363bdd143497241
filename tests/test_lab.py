"""`python -m kdtree lab`: papermill run into a chosen folder, argument handling, packaging of data files."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdtree import lab

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_lab_cli_runs_notebook_00_with_parameters(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KDTREE_OUT_DIR"}
    cmd = [sys.executable, "-m", "kdtree", "lab", "00", "--device", "cpu", "--out-dir", str(tmp_path),
           "-p", "config", '["tiny-b"]', "-p", "n_prompts", "1", "-p", "max_new_tokens", "12",
           "-p", "budgets", "[4]", "-p", "budget", "8", "-p", "block_size", "4", "-p", "golden_cases", "10"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "golden_validation.json").read_text())
    assert rec["params"]["n_prompts"] == 1 and rec["params"]["config"] == ["tiny-b"]
    c = rec["configs"]["tiny-b"]
    assert c["max_rel_logits_err_vs_transformers"] <= 1e-4
    assert c["ddtree_equals_ar"] is True and c["dflash_equals_ar"] is True
    assert c["target_forwards_per_token"]["ar"] == 1.0
    for png in ("golden_tree.png", "golden_forwards_per_token.png", "golden_accept_hist.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert (tmp_path / "00_golden_validation.ipynb").exists()


def test_notebook_01_smoke_run_on_a_cpu(tmp_path):
    """The K2.6 microbenchmark notebook's CPU smoke set: every section that can run on a CPU writes its
    numbers."""
    env = {k: v for k, v in os.environ.items() if k != "KDTREE_OUT_DIR"}
    cmd = [sys.executable, "-m", "kdtree", "lab", "01", "--device", "cpu", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "microbench_k26.json").read_text())
    assert rec["smoke"] is True and rec["config"] == "tiny-a" and rec["ceilings"] is None
    assert {(r["batch"], r["budget"]) for r in rec["tree_round"]} == {(1, 16), (1, 64), (4, 16), (4, 64)}
    assert all(r["reference_s"] > 0 for r in rec["tree_round"])
    assert [r["tokens"] for r in rec["moe_int4"]] == [1, 8, 64]
    # no GPU clock state on a CPU, and no waiting for one
    assert rec["gpu_state"] == {"start": None, "end": None}
    assert all(r["gpu_state"] is None and r["settle_s"] == 0.0 for r in rec["moe_int4"])
    assert {r["kind"] for r in rec["layer_verify"]} == {"dense", "moe"}
    # MoE rows count their distinct routed experts (tiny-a: 8, top 2; their kernel time is a GPU row's)
    moe = [r for r in rec["layer_verify"] if r["kind"] == "moe"]
    assert all(2 <= r["experts_touched"] <= min(8, 2 * r["nodes"] * r["batch"]) for r in moe)
    assert [r["experts_touched"] for r in moe if r["nodes"] == r["batch"] == 1] == [2]
    assert not any("moe_kernel_s" in r for r in rec["layer_verify"])
    assert rec["builder_share"] and all(0 < s["reference_share"] < 1 for s in rec["builder_share"])
    for png in ("microbench_tree.png", "microbench_moe.png", "microbench_layer.png"):
        assert (tmp_path / png).stat().st_size > 1000


@pytest.mark.slow   # the whole notebook: make test runs it, make test-fast leaves it out
def test_notebook_02_smoke_run_on_a_cpu(tmp_path):
    """The end-to-end notebook's CPU smoke set: the committed trained pair on held-out prompts (lossless), the
    projection from the committed GPU record of notebook 01, the cost-aware budget's section and the K2.6
    sweep's code path at tiny dimensions."""
    env = {k: v for k, v in os.environ.items() if k != "KDTREE_OUT_DIR"}
    cmd = [sys.executable, "-m", "kdtree", "lab", "02", "--device", "cpu", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "e2e.json").read_text())
    rows = rec["pair"]["rows"]
    assert rec["smoke"] is True and [(m["mode"], m["budget"]) for m in rows] == [
        ("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]
    assert all(m["lossless"] for m in rows if m["mode"] != "ar")
    assert all(sum(m["accept_hist"]) == m["rounds"] > 0 for m in rows)
    if (ROOT / "outputs" / "h200" / "microbench_k26.json").exists():
        proj = rec["projection"]["rows"]
        assert {(p["mode"], p["budget"]) for p in proj} >= {("ar", None), ("dflash", None), ("ddtree", 16)}
        assert all(p["tok_per_s"] > 0 for p in proj)
        assert (tmp_path / "e2e_projection.png").stat().st_size > 1000
        prof = rec["profiles"]["rows"]
        assert {p["profile_chain_tau"] for p in prof} == {3.0, 5.0, 8.0}
        assert all(p["tau"] >= 1 for p in prof) and (tmp_path / "e2e_profiles.png").stat().st_size > 1000
    assert (tmp_path / "e2e_pair.png").stat().st_size > 1000
    # section 5: the cost-aware budget through the engine; section 6: the K2.6 sweep's code path (tiny, CPU)
    auto = rec["auto"]["cells"]
    assert {(c["batch"], c["name"]) for c in auto} >= {(1, "AR"), (2, "auto (previous)"), (2, "auto (sync)")}
    assert all(c["equals_ar"] for c in auto) and all(c["plans"] for c in auto if c["budget"] == "auto")
    k26 = rec["k26"]["cells"]
    assert rec["k26"]["label"].startswith("K2.6 shape, random weights, SIMULATED") and len(k26) == 5
    assert not any(c.get("error") for c in k26)
    names = [t["name"] for t in rec["targets"]]
    assert any(n.startswith("trained pair, batch 2: auto") for n in names) \
        and any("K2.6 sim" in n for n in names)
    for png in ("e2e_auto.png", "e2e_k26.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_notebook_03_smoke_run_on_a_cpu(tmp_path):
    """The trained-pair notebook's CPU smoke set: all stages, checkpoints in a temporary folder, lossless."""
    env = {k: v for k, v in os.environ.items() if k != "KDTREE_OUT_DIR"}
    real = ROOT / "data" / "trained"
    before = sorted((p.name, p.stat().st_mtime) for p in real.rglob("*")) if real.exists() else None
    cmd = [sys.executable, "-m", "kdtree", "lab", "03", "--device", "cpu", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "trained_pair.json").read_text())
    assert rec["smoke"] is True and rec["target"]["final_heldout_ppl"] > 1 and rec["drafter"]["heldout"]
    modes = [(m["temperature"], m["mode"], m["budget"]) for m in rec["measure"]]
    assert modes == [(T, m, b) for T in (0.0, 1.0) for m, b in (("ar", None), ("dflash", None), ("ddtree", 4),
                                                                  ("ddtree", 8))]
    assert all(m["lossless"] for m in rec["measure"] if m["temperature"] == 0.0 and m["mode"] != "ar")
    assert [t["met"] for t in rec["targets"]][-1] is True  # losslessness target
    after = sorted((p.name, p.stat().st_mtime) for p in real.rglob("*")) if real.exists() else None
    assert after == before  # the smoke never writes the real checkpoints
    for png in ("trained_target_loss.png", "trained_drafter_accuracy.png", "trained_pair.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_parse_value():
    assert lab.parse_value("3") == 3 and lab.parse_value("0.5") == 0.5
    assert lab.parse_value("[1, 2]") == [1, 2] and lab.parse_value("true") is True
    assert lab.parse_value("tiny-a") == "tiny-a"
    assert lab.parse_value("False") is False and lab.parse_value("None") is None  # Python's spelling too
    assert lab.parse_value("[[3.0, 8]]") == [[3.0, 8]] and lab.parse_value("model") == "model"


def test_bad_lab_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="00_golden_validation.ipynb"):
        lab.find_notebooks(["99_nope"])
    with pytest.raises(ValueError, match="device"):
        lab.pick_device("tpu")
    assert lab.main_lab(["99_nope", "--out-dir", str(tmp_path)]) == 2


@pytest.mark.parametrize("names", [["*"], ["0*"], ["0?_golden_validation"], ["[0]0"]])
def test_a_glob_is_refused_naming_the_notebook_argument_and_listing_the_notebooks(names, capsys):
    with pytest.raises(ValueError, match=r"notebook '.*': a pattern is not expanded here") as e:
        lab.find_notebooks(names)
    assert all(nb.name in str(e.value) for nb in lab.find_notebooks(()))
    assert lab.main_lab(names) == 2
    assert "error: notebook " in capsys.readouterr().err


@pytest.mark.parametrize("kw,needle", [(dict(notebooks=[3]), r"notebook 3: expected a notebook name"),
                                       (dict(notebooks=[""]), r"notebook '': expected a notebook name"),
                                       (dict(notebooks=7), r"notebooks: expected a list of notebook names"),
                                       (dict(params=[("seed", 1)]), r"params: expected a dict"),
                                       (dict(out_dir=123), r"out_dir=123: expected a folder"),
                                       (dict(out_dir=""), r"out_dir='': expected a folder"),
                                       (dict(overwrite_trained="no"), r"overwrite_trained='no': expected")])
def test_run_lab_checks_its_arguments_before_anything_is_written(kw, needle, tmp_path):
    kw = dict(notebooks=["00"], device="cpu", out_dir=str(tmp_path / "never")) | kw
    with pytest.raises(ValueError, match=needle):
        lab.run_lab(**kw)
    assert not (tmp_path / "never").exists()


def test_one_notebook_name_is_taken_as_a_name():
    want = [lab.NOTEBOOKS / "00_golden_validation.ipynb"]
    assert lab.find_notebooks("00") == lab.find_notebooks(["00"]) == want


def test_cpu_records_never_land_in_a_gpu_folder():
    assert lab.output_dir("cpu") == lab.OUTPUTS / "cpu"
    assert lab.device_slug("cpu") is None


def test_a_cpu_run_leaves_the_checkout_clean():
    """A CPU run's default folder is ignored by git (nothing it writes shows as a change), is not taken for a
    GPU's record folder, and is not a record docs/results.md is rebuilt from."""
    cpu = lab.output_dir("cpu")
    probe = cpu / "00_golden_validation.ipynb"
    r = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=lab.ROOT)
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.returncode == 0, f"{probe} is not ignored by git"
    assert lab.check_out_dir(cpu, "cpu") == cpu
    assert lab.refresh_results(cpu) is None


def test_package_data_is_importable():
    """cuda/ and data/configs/ ship inside the package (kdtree.cuda, kdtree.configs)."""
    from kdtree.config import CONFIG_DIR
    from kdtree.kernels import cuda_source_dir
    assert (CONFIG_DIR / "kimi-k2.6.json").is_file()
    assert (cuda_source_dir() / "tree_build.cu").is_file()


def test_staged_runs_keep_their_own_executed_copy():
    nb = Path("notebooks/03_train_pair.ipynb")
    assert lab.executed_name(nb, {"device": "cpu"}) == "03_train_pair.ipynb"
    assert lab.executed_name(nb, {"stage": "all"}) == "03_train_pair.ipynb"
    assert lab.executed_name(nb, {"stage": "drafter"}) == "03_train_pair-stage-drafter.ipynb"


def test_lab_parameters_must_be_declared_and_in_range(tmp_path, capsys):
    nb03 = lab.find_notebooks(["03"])[0]
    lab.check_parameters(nb03, {"stage": "drafter", "n_prompts": 4})
    for bad, needle in (({"stage": "../.."}, r"-p stage '\.\./\.\.': expected one of \['all', 'target'"),
                        ({"out_dir": "/tmp/x"}, "-p out_dir: set by the runner"),
                        ({"device": "cpu"}, "-p device: set by the runner"),
                        ({"n_promts": 4}, "-p n_promts: 03_train_pair.ipynb declares no such parameter")):
        with pytest.raises(ValueError, match=needle):
            lab.check_parameters(nb03, bad)
    out = tmp_path / "never"
    assert lab.main_lab(["03", "--out-dir", str(out), "-p", "stage", "../.."]) == 2
    assert not out.exists()  # refused before anything is written
    assert "expected one of" in capsys.readouterr().err
    with pytest.raises(ValueError, match="matches .*: name one of them"):
        lab.find_notebooks(["0"])
    # papermill's parser misses it
    assert "block_size" in lab.declared_parameters(lab.find_notebooks(["00"])[0])


def _notebook(path, body: str):
    """A two-cell notebook at path: the lab's parameters cell (device, out_dir), then `body`."""
    cells = [{"cell_type": "code", "id": "p", "metadata": {"tags": ["parameters"]}, "execution_count": None,
              "outputs": [], "source": ['device = "auto"\n', 'out_dir = "."\n']},
             {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": None, "outputs": [],
              "source": [body]}]
    path.write_text(json.dumps({"cells": cells,
                                "metadata": {"kernelspec": {"name": "python3", "language": "python",
                                                            "display_name": "Python 3"}},
                                "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_a_failing_notebook_reports_its_cell_in_a_few_lines(tmp_path, capsys):
    nb = _notebook(tmp_path / "99_fails.ipynb", 'raise RuntimeError("the cause, stated")\n')
    assert lab.main_lab([str(nb), "--device", "cpu", "--out-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    msg = err[err.index("error:"):]  # after papermill's progress bar
    assert "RuntimeError: the cause, stated" in msg and len(msg.strip().split("\n")) <= 3


@pytest.mark.slow
def test_staged_notebook_03_smoke_runs_share_their_checkpoints_on_a_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KDTREE_OUT_DIR"}
    for stage in ("target", "drafter", "measure"):
        cmd = [sys.executable, "-m", "kdtree", "lab", "03", "--device", "cpu", "--out-dir", str(tmp_path),
               "-p", "stage", stage]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (stage, r.stderr[-3000:])
        assert (tmp_path / f"03_train_pair-stage-{stage}.ipynb").exists()
    assert (tmp_path / "smoke_ckpt" / "target" / "config.json").exists()
    assert (tmp_path / "smoke_ckpt" / "drafter" / "config.json").exists()
    assert json.loads((tmp_path / "trained_pair.json").read_text())["measure"]


def test_a_gpu_record_folder_is_written_only_by_its_gpu(tmp_path):
    """A CPU run into outputs/h200 (however the path is spelt) is refused before anything runs; so is a
    folder that is a file or lies under one."""
    for spelt in ("h200", "./h200/", "x/../h200"):
        with pytest.raises(ValueError, match=r"outputs/h200/ holds the h200 GPU's records"):
            lab.check_out_dir(lab.OUTPUTS / spelt, "cpu")
    assert lab.check_out_dir(lab.OUTPUTS, "cpu") == lab.OUTPUTS
    f = tmp_path / "f"
    f.write_text("x")
    for bad in (f, f / "sub"):
        with pytest.raises(ValueError, match="is a file, not a folder"):
            lab.check_out_dir(bad, "cpu")
    before = sorted(p.name for p in (lab.OUTPUTS / "h200").iterdir())
    spelt = str(lab.OUTPUTS / "." / "h200" / ".." / "h200")
    assert lab.main_lab(["00", "--device", "cpu", "--out-dir", spelt]) == 2
    assert sorted(p.name for p in (lab.OUTPUTS / "h200").iterdir()) == before


def test_the_shipped_pair_is_named_one_way_for_the_notebooks_guard():
    nb = lab.find_notebooks(["03"])[0]
    for spelt in ("../data/trained/", "../data/./trained", "../notebooks/../data/trained"):
        assert lab._normalized(nb, {"ckpt_dir": spelt})["ckpt_dir"] == "../data/trained"
    assert lab._normalized(nb, {"ckpt_dir": "/tmp/elsewhere"})["ckpt_dir"] == "/tmp/elsewhere"


def test_a_failed_notebook_leaves_the_output_folder_as_it_was(tmp_path, capsys):
    """The notebook writes a record into its out_dir, then fails: the folder keeps its earlier files byte for
    byte, and the error names the copy that holds the failed run."""
    nb = tmp_path / "98_writes_then_fails.ipynb"
    cells = [{"cell_type": "code", "id": "p", "metadata": {"tags": ["parameters"]}, "execution_count": None,
              "outputs": [], "source": ['device = "auto"\n', 'out_dir = "."\n']},
             {"cell_type": "code", "id": "w", "metadata": {}, "execution_count": None, "outputs": [],
              "source": ['import pathlib\n', 'pathlib.Path(out_dir, "rec.json").write_text("new")\n',
                         'raise RuntimeError("after writing")\n']}]
    kernel = {"name": "python3", "language": "python", "display_name": "Python 3"}
    nb.write_text(json.dumps({"cells": cells, "metadata": {"kernelspec": kernel}, "nbformat": 4,
                              "nbformat_minor": 5}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "rec.json").write_text("old")
    (out / nb.name).write_text("the committed executed copy")
    assert lab.main_lab([str(nb), "--device", "cpu", "--out-dir", str(out)]) == 1
    assert (out / "rec.json").read_text() == "old"
    assert (out / nb.name).read_text() == "the committed executed copy"
    err = capsys.readouterr().err
    assert "the output folder is as it was" in err and "RuntimeError: after writing" in err


def test_lab_help_lists_every_notebook_and_its_parameters_and_info_refuses_arguments(capsys):
    with pytest.raises(SystemExit):
        lab.main_lab(["--help"])
    out = capsys.readouterr().out
    for nb in lab.find_notebooks(()):
        assert nb.stem in out
        for name in lab.declared_parameters(nb):
            if name not in lab.RUNNER_PARAMETERS:
                assert f"    {name} = " in out, name
    from kdtree.__main__ import main
    assert main(["info", "extra"]) == 2


def test_no_parameters_cell_comment_holds_an_equals_sign():
    """papermill reads a parameters cell line by line; an '=' inside a comment makes it warn that it cannot
    parse the line (and a user cannot tell whether the parameter is settable)."""
    for nb in lab.find_notebooks(()):
        cells = json.loads(nb.read_text())["cells"]
        cell = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
        for line in "".join(cell["source"]).splitlines():
            assert "=" not in line.partition("#")[2], (nb.name, line)


def test_papermill_reads_every_declared_parameter_without_a_warning(caplog):
    """papermill's own parser (what `lab` and papermill's --parameters use) reads each notebook's parameters
    cell: every declared parameter, no "Unable to parse line" warning."""
    translators = pytest.importorskip("papermill.translators")
    for nb in lab.find_notebooks(()):
        cells = json.loads(nb.read_text())["cells"]
        cell = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
        caplog.clear()
        with caplog.at_level("WARNING", logger="papermill"):
            found = translators.PythonTranslator.inspect({"source": "".join(cell["source"])})
        assert not [r.getMessage() for r in caplog.records], nb.name
        assert {p.name for p in found} == set(lab.declared_parameters(nb)), nb.name


def test_cpu_runs_take_one_torch_thread_unless_told():
    from kdtree.lab import cpu_threads
    env = {}
    assert cpu_threads("cpu", env) == "1" and env == {"OMP_NUM_THREADS": "1"}
    env = {"OMP_NUM_THREADS": "4"}
    assert cpu_threads("cpu", env) == "4" and env["OMP_NUM_THREADS"] == "4"
    env = {"OMP_NUM_THREADS": "4", "KDTREE_TORCH_THREADS": "3"}
    assert cpu_threads("cpu", env) == "3" and env["OMP_NUM_THREADS"] == "3"
    env = {}
    assert cpu_threads("cuda", env) is None and env == {}          # a GPU run keeps the environment
    env = {"KDTREE_TORCH_THREADS": "two"}
    with pytest.raises(ValueError, match="KDTREE_TORCH_THREADS"):
        cpu_threads("cpu", env)
    assert env == {"KDTREE_TORCH_THREADS": "two"}                  # refused before it sets anything


def test_tests_run_tiny_models_on_one_thread():
    import torch
    want = int(os.environ.get("KDTREE_TORCH_THREADS", "1"))
    assert torch.get_num_threads() == want


def test_every_notebook_validates_without_warnings():
    """Each notebook is valid nbformat 4.5 as committed: every cell has an id (nbformat warns on every run
    where one is missing, and will refuse such a notebook later)."""
    import warnings

    import nbformat
    for nb_path in sorted((lab.ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(nb_path.read_text())
        missing = [i for i, c in enumerate(nb["cells"]) if "id" not in c]
        assert not missing, f"{nb_path.name}: cells {missing} have no id"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            nbformat.validate(nbformat.reads(nb_path.read_text(), as_version=4))


def test_a_notebook_kernel_talks_over_ipc_without_a_tcp_warning(tmp_path, capfd):
    """The lab's kernels use local IPC sockets: no port on localhost and no "running over TCP without
    encryption" line from each kernel (the line the default transport prints shows the check can fail)."""
    nb = _notebook(tmp_path / "98_quiet.ipynb", "print('ran')\n")
    assert lab.kernel_config().KernelManager.transport == "ipc"
    assert lab.main_lab([str(nb), "--device", "cpu", "--out-dir", str(tmp_path / "out")]) == 0
    out, err = capfd.readouterr()
    assert "without encryption" not in out + err
    assert (tmp_path / "out" / "98_quiet.ipynb").exists()


def test_a_benchmark_writes_no_other_gpus_record_folder(tmp_path, monkeypatch):
    """lab.check_record_dir (the benchmarks' --out): anywhere inside another GPU's outputs/<gpu>/ is refused
    naming the flag, however spelt; this GPU's folder, a new folder and folders outside outputs/ are taken;
    bench.k26's CLI refuses before anything runs."""
    import torch

    from kdtree.bench import k26 as bench_k26
    monkeypatch.setattr(lab, "device_slug", lambda device: "h100" if device == "cuda" else None)
    for spelt in ("h200/decode_floor", "h200/./decode_floor/../peers", "h200/new/deeper", "h200"):
        with pytest.raises(ValueError, match="--out .*outputs/h200/ holds the h200 GPU's records"):
            lab.check_record_dir(lab.OUTPUTS / spelt, "cuda")
    for fine in (lab.OUTPUTS / "h100" / "x", lab.OUTPUTS / "a100", lab.OUTPUTS, tmp_path / "h200"):
        assert lab.check_record_dir(fine, "cuda") == fine
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="--peers-out .* is a file"):
        lab.check_record_dir(tmp_path / "f" / "x", "cuda", "--peers-out")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_k26, "run", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit, match="bench_k26: --out .*h200"):
        bench_k26.main(["--cells", "4096:1", "--profiles", "5:8", "--out", str(lab.OUTPUTS / "h200" / "x")])
    assert not (lab.OUTPUTS / "h200" / "x").exists()


@pytest.mark.parametrize("module, argv", [
    ("engine", []), ("e2e", []), ("drafter", []), ("moe", ["--bf16"]), ("peers", []),
    ("k26", ["--cells", "4096:1", "--profiles", "5:8"])])
def test_every_benchmark_cli_refuses_another_gpus_folder(module, argv, monkeypatch):
    """Each benchmark's --out inside another GPU's record folder: SystemExit naming it, nothing created."""
    import importlib

    import torch
    monkeypatch.setattr(lab, "device_slug", lambda device: "h100" if device == "cuda" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    target = lab.OUTPUTS / "h200" / "not_here"
    mod = importlib.import_module(f"kdtree.bench.{module}")
    with pytest.raises(SystemExit, match="outputs/h200/ holds the h200 GPU's records"):
        mod.main([*argv, "--out", str(target)])
    assert not target.exists()
