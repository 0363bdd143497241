"""Running the lab's notebooks with papermill: `python -m kdtree lab [NOTEBOOK ...] [-p KEY VALUE ...]`.

Executed notebooks and their JSON/PNG results go to outputs/ on a CPU and to outputs/<gpu>/ (for example
outputs/h200/) when a CUDA GPU is present; a GPU record folder is written only by a run on that GPU (paths
compared resolved). Each notebook runs in a copy of the output folder beside it, and its files move in only
when the whole notebook succeeded: a failed run leaves the folder as it was (the copy, with the failed
notebook, is named in the error). Every notebook name and parameter value is checked (against the notebook's
declaration in kdtree.lab_params) before torch or papermill is imported; notebook 03 writes the shipped
pair (data/trained/) only with --overwrite-trained (else its pair goes beside its record: `training_folder`).
"""
from __future__ import annotations

import ast
import filecmp
import io
import json
import os
import re
import shutil
import sys
import tempfile
import tokenize
from pathlib import Path

from . import lab_params

# torch and papermill load only once every name and value has been checked (a refusal comes at once)


def repo_root() -> Path:
    """The lab checkout: the working directory if it has notebooks/, else the package's parent."""
    cwd = Path.cwd()
    return cwd if (cwd / "notebooks").is_dir() else Path(__file__).resolve().parent.parent


ROOT = repo_root()
NOTEBOOKS = ROOT / "notebooks"
OUTPUTS = ROOT / "outputs"


def pick_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a CUDA GPU is present, else 'cpu'; anything else is checked and returned. The
    spelling is checked before torch is imported."""
    lab_params.check_device(device)
    if device == "cpu":
        return device
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA GPU is visible; use 'auto' or 'cpu'")
    return device


def device_slug(device: str) -> str | None:
    """A folder name for a GPU record ('NVIDIA H200' -> 'h200'); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    name = re.sub(r"^nvidia\s+", "", name)
    name = re.sub(r"\b(nvl|sxm\d*|pcie|hbm\w*|\d+gb)\b", "", name)
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


CPU_DIR = lab_params.CPU_DIR


def output_dir(device: str) -> Path:
    """Where a run on `device` writes by default: outputs/<gpu>/ (the GPU's record), outputs/cpu/ on the CPU
    (ignored by git; the committed CPU records at outputs/ are written only by --out-dir outputs)."""
    return OUTPUTS / (device_slug(device) or CPU_DIR)


def parse_value(text: str):
    """-p values: JSON when it parses (numbers, true/false/null, lists), else a Python literal (True, False,
    None, tuples, quoted strings), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


RUNNER_PARAMETERS = ("device", "out_dir")  # set by run_lab (--device, --out-dir), never by -p


GLOB = set("*?[]")   # pattern characters: a notebook argument is a name, never a pattern


def find_notebooks(names=()) -> list[Path]:
    """Every notebooks/NN_*.ipynb (no names), or each name resolved to exactly one notebook (a path, a file
    name with or without .ipynb, or a prefix such as '03' that only one notebook starts with). names: a list
    or tuple of str / os.PathLike, or one of them; ValueError naming the notebook argument for another type,
    an empty name or a glob pattern ('*': the shell's, unexpanded), FileNotFoundError for a name that matches
    none; both list the notebooks."""
    if names is None or (isinstance(names, (list, tuple)) and not names):
        return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    known = [q.name for q in sorted(NOTEBOOKS.glob("*.ipynb"))]
    if isinstance(names, (str, os.PathLike)):
        names = [names]
    if not isinstance(names, (list, tuple)):
        raise ValueError(f"notebooks: expected a list of notebook names or paths, got "
                         f"{type(names).__name__}; the notebooks: {known}")
    out = []
    for n in names:
        if not isinstance(n, (str, os.PathLike)) or not os.fspath(n).strip():
            raise ValueError(f"notebook {n!r}: expected a notebook name or path (a non-empty str), one of "
                             f"{known}")
        if GLOB & set(os.fspath(n)):
            raise ValueError(f"notebook {os.fspath(n)!r}: a pattern is not expanded here; expected a "
                             f"notebook name, a prefix such as '00', or a path, one of {known} (none: all of "
                             "them)")
        p = Path(n)
        exact = next((c for c in (p, NOTEBOOKS / p, NOTEBOOKS / (p.name + ".ipynb"))
                      if c.is_file() and c.suffix == ".ipynb"), None)
        hits = [exact] if exact else [NOTEBOOKS / k for k in known if k.startswith(p.name)]
        if not hits:
            raise FileNotFoundError(f"notebook {n!r} not found; expected one of {known}")
        if len(hits) > 1:
            raise ValueError(f"notebook {n!r} matches {[h.name for h in hits]}: name one of them")
        out.append(hits[0])
    return out


def declared_parameters(nb: Path) -> dict[str, str]:
    """{name: its comment} of the notebook's cell tagged 'parameters' (top-level assignments)."""
    cells = json.loads(nb.read_text())["cells"]
    cell = next((c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        return {}
    src = "".join(cell["source"])
    comments = {t.start[0]: t.string.lstrip("# ").strip()
                for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    out = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = comments.get(node.lineno, "")
    return out


def check_parameters(nb: Path, params: dict) -> None:
    """-p names the notebook declares in its parameters cell (not the runner's own), each value as the
    notebook's declaration in kdtree.lab_params wants it (type, range, choices; paths read from the notebook's
    folder). ValueError naming the parameter, the value and what was expected; no torch needed."""
    declared = declared_parameters(nb)
    has_declaration = nb.stem in lab_params.NOTEBOOKS
    for k, v in params.items():
        if k in RUNNER_PARAMETERS:
            raise ValueError(f"-p {k}: set by the runner (use --{k.replace('_', '-')})")
        if k not in declared:
            raise ValueError(f"-p {k}: {nb.name} declares no such parameter; it declares "
                             f"{sorted(n for n in declared if n not in RUNNER_PARAMETERS)}")
        want = lab_params.problem(nb.stem, k, v, nb.parent) if has_declaration else None
        if want:
            raise ValueError(f"-p {k} {v!r}: expected {want}")


def check_run(nb: Path, params: dict, device: str) -> None:
    """The declaration's rules over several parameters (`lab_params.RULES`) for a run on `device` (resolved).
    ValueError naming the notebook."""
    if nb.stem in lab_params.NOTEBOOKS:
        try:
            lab_params.check_rules(nb.stem, {**params, "device": device}, nb.parent)
        except ValueError as e:
            raise ValueError(f"{nb.name}: {e}") from None


def executed_name(nb: Path, params: dict) -> str:
    """The executed copy's file name: the notebook's, or NAME-stage-STAGE.ipynb for a staged run (notebook
    03's `stage` parameter), so that the stages of one training run, each a device command, keep their
    records."""
    stage = (params or {}).get("stage", "all")
    return nb.name if stage == "all" else f"{nb.stem}-stage-{stage}.ipynb"


def check_out_dir(out: Path, device: str) -> Path:
    """The output folder a run on `device` may write: ValueError when it is a file or lies under one, or when
    it is another GPU's record folder (outputs/<gpu>/, compared resolved: '..', '.', trailing slashes and
    links are seen through)."""
    _not_under_a_file(out, "--out-dir")
    r = out.resolve()
    if r.parent == OUTPUTS.resolve() and r.name != CPU_DIR and device_slug(device) != r.name:
        raise ValueError(f"--out-dir {out}: outputs/{r.name}/ holds the {r.name} GPU's records; a run on "
                         f"{device} writes to {output_dir(device)} (or to a folder outside outputs/)")
    return out


def check_record_dir(out, device: str, flag: str = "--out") -> Path:
    """A benchmark's output folder for a run on `device`: ValueError naming `flag` when it is a file or lies
    under one, or when it lies anywhere inside another GPU's record folder (outputs/<gpu>/..., compared
    resolved), whose records only a run on that GPU writes."""
    out = Path(out)
    _not_under_a_file(out, flag)
    r, root = out.resolve(), OUTPUTS.resolve()
    if root in r.parents:
        gpu = r.relative_to(root).parts[0]
        if gpu in _gpu_dirs() and gpu != device_slug(device):
            raise ValueError(f"{flag} {out}: outputs/{gpu}/ holds the {gpu} GPU's records; a run on "
                             f"{device} writes to {output_dir(device)} (or to a folder outside outputs/)")
    return out


def record_dir_or_exit(out, device: str, prog: str) -> Path:
    """check_record_dir for a command line: its refusal as SystemExit prefixed by `prog`."""
    try:
        return check_record_dir(out, device)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}") from None


def _not_under_a_file(out: Path, flag: str) -> None:
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise ValueError(f"{flag} {out}: {p} is a file, not a folder")


def _gpu_dirs() -> set[str]:
    """The GPU record folders under outputs/ (its subfolders but the CPU one)."""
    if not OUTPUTS.is_dir():
        return set()
    return {p.name for p in OUTPUTS.iterdir() if p.is_dir() and p.name != CPU_DIR}


TRAINED = ROOT / "data" / "trained"   # the shipped pair (notebook 03's default ckpt_dir, "../data/trained")


def _normalized(nb: Path, params: dict) -> dict:
    """params with a ckpt_dir that resolves to data/trained written as the notebook's own default string, so
    the notebook's guard (a smoke run never writes there) sees it however it was spelt."""
    v = params.get("ckpt_dir")
    if isinstance(v, str) and (nb.parent / v).resolve() == TRAINED.resolve():
        return {**params, "ckpt_dir": "../data/trained"}
    return params


class LabRunError(RuntimeError):
    """A notebook failed; `run_dir` holds its executed copy (with the traceback) and the files it wrote, the
    output folder is as it was."""

    def __init__(self, cause: BaseException, run_dir: Path):
        super().__init__(str(cause))
        self.cause, self.run_dir = cause, run_dir


def _same(a: Path, b: Path) -> bool:
    if a.is_dir() != b.is_dir():
        return False
    if not a.is_dir():
        return filecmp.cmp(a, b, shallow=False)
    c = filecmp.dircmp(a, b)
    return (not (c.left_only or c.right_only or c.diff_files or c.funny_files)
            and all(_same(a / d, b / d) for d in c.common_dirs))


def _run_staged(out: Path, run) -> None:
    """run(folder) in a copy of `out` made beside it; on success the entries it added or changed move into
    `out` (each file by an atomic rename), on failure LabRunError names the copy and `out` is untouched."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.run-", dir=out.parent))
    for f in out.iterdir():
        if f.is_dir():
            shutil.copytree(f, tmp / f.name, symlinks=True)
        else:
            shutil.copy2(f, tmp / f.name)
    try:
        run(tmp)
    except Exception as e:
        raise LabRunError(e, tmp) from e
    for f in tmp.iterdir():
        dst = out / f.name
        if dst.exists() and _same(f, dst):
            continue
        if dst.is_dir():
            shutil.rmtree(dst)
        os.replace(f, dst)   # the copy lies beside `out`: one file system, a rename
    shutil.rmtree(tmp)


def run_lab(notebooks=(), params: dict | None = None, device: str = "auto",
            out_dir: str | None = None, overwrite_trained: bool = False) -> list[Path]:
    """Execute notebooks with papermill; returns the executed copies. Every check (the arguments, notebook
    names, parameters, the output folder) runs before anything is written, the names and values before torch
    is imported; notebooks as `find_notebooks` takes them.
    overwrite_trained: passed to the notebooks that declare it (03: a training run may replace
    data/trained/)."""
    lab_params.check_device(device)
    if params is not None and not (isinstance(params, dict) and all(isinstance(k, str) for k in params)):
        raise ValueError(f"params: expected a dict {{parameter name: value}}, got {type(params).__name__}")
    if out_dir is not None and not (isinstance(out_dir, (str, os.PathLike)) and os.fspath(out_dir).strip()):
        raise ValueError(f"out_dir={out_dir!r}: expected a folder (a non-empty str or os.PathLike), or None "
                         "for the default")
    if not isinstance(overwrite_trained, bool):
        raise ValueError(f"overwrite_trained={overwrite_trained!r}: expected True or False")
    nbs = find_notebooks(notebooks)
    for nb in nbs:  # every notebook's parameters checked before anything runs or is written
        check_parameters(nb, params or {})
    per_nb = {nb: dict(params or {}) for nb in nbs}
    if overwrite_trained:
        takers = [nb for nb in nbs if "overwrite_trained" in declared_parameters(nb)]
        if not takers:
            raise ValueError("--overwrite-trained: none of the notebooks named trains the pair (notebook "
                             "03_train_pair does)")
        for nb in takers:
            per_nb[nb]["overwrite_trained"] = True
    device = pick_device(device)
    for nb in nbs:
        check_run(nb, per_nb[nb], device)
    out = check_out_dir(Path(out_dir) if out_dir else output_dir(device), device)
    import papermill as pm

    cpu_threads(device)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for nb in nbs:
        p = _normalized(nb, {"device": device, **per_nb[nb]})
        name = executed_name(nb, p)
        print(f"[kdtree lab] {nb.name} on {device} -> {out / name}", flush=True)

        def run(folder, nb=nb, p=p, name=name):
            pm.execute_notebook(str(nb), str(folder / name), cwd=str(nb.parent), progress_bar=True,
                                parameters={**p, "out_dir": str(folder.resolve())}, kernel_name="python3",
                                config=kernel_config())
        _run_staged(out, run)
        done.append(out / name)
    refresh_results(out)
    return done


def kernel_config():
    """The notebooks' kernels talk to papermill over local IPC sockets, not TCP on localhost (no network
    port, and no "running over TCP without encryption" warning from every kernel)."""
    from traitlets.config import Config
    return Config({"KernelManager": {"transport": "ipc"}})


def cpu_threads(device: str, environ=None) -> str | None:
    """On a CPU run, the torch threads of the notebooks' kernels (which inherit this process's environment):
    KDTREE_TORCH_THREADS where set, else OMP_NUM_THREADS where set, else 1 (the tiny models' paths gain
    nothing from more, and beside other CPU load several threads contend). Sets OMP_NUM_THREADS and returns
    it; None (and no change) on a GPU run."""
    env = os.environ if environ is None else environ
    if device != "cpu":
        return None
    n = env.get("KDTREE_TORCH_THREADS") or env.get("OMP_NUM_THREADS") or "1"
    if not (n.isdigit() and int(n) > 0):
        raise ValueError(f"KDTREE_TORCH_THREADS / OMP_NUM_THREADS={n!r}: expected a positive int")
    env["OMP_NUM_THREADS"] = n
    return n


def refresh_results(out: Path) -> Path | None:
    """After a run into a GPU record folder (outputs/<gpu>/) of this checkout: docs/results.md rewritten from
    the records (kdtree.report); returns the page, or None where the folder is not one (a CPU run, a folder
    elsewhere, an installed package without docs/)."""
    from . import report
    out = Path(out).resolve()
    if out.parent != OUTPUTS.resolve() or out.name == CPU_DIR or not report.PAGE.parent.is_dir():
        return None
    report.PAGE.write_text(report.report(OUTPUTS))
    print(f"[kdtree lab] {report.PAGE} rewritten from the records", flush=True)
    return report.PAGE


def notebooks_help() -> str:
    """The notebooks and their parameters from each one's declaration (name = default  help; allowed values),
    for `lab --help`; a notebook without one: its parameters cell's lines."""
    lines = ["notebooks and their parameters (-p NAME VALUE; device, out_dir: --device, --out-dir; paths are "
             "read from notebooks/):"]
    for nb in find_notebooks(()):
        lines.append(f"  {nb.stem}")
        if nb.stem in lab_params.NOTEBOOKS:
            lines += lab_params.describe(nb.stem, skip=RUNNER_PARAMETERS)
            continue
        cells = json.loads(nb.read_text())["cells"]
        cell = next((c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
        for line in "".join(cell["source"] if cell else []).splitlines():
            name = line.split("=", 1)[0].strip()
            if "=" in line and name.isidentifier() and name not in RUNNER_PARAMETERS:
                lines.append(f"    {line.strip()}")
    return "\n".join(lines)


def main_lab(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kdtree lab", description=__doc__, epilog=notebooks_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*",
                    help="notebook names or paths (default: every notebooks/NN_*.ipynb)")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                    help="papermill parameter; VALUE is parsed as JSON when it can be")
    ap.add_argument("--device", default="auto", help="auto (default), cpu or cuda[:N]")
    ap.add_argument("--out-dir", default=None, help="default: outputs/ on a CPU, outputs/<gpu>/ on a GPU")
    ap.add_argument("--overwrite-trained", action="store_true",
                    help="let notebook 03 train into data/trained/, replacing the shipped pair")
    a = ap.parse_args(argv)
    params = {k: parse_value(v) for k, v in a.parameter}
    try:
        run_lab(a.notebooks, params, a.device, a.out_dir, overwrite_trained=a.overwrite_trained)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LabRunError as err:  # the failing cell's exception in a few lines, not the traceback
        from papermill.exceptions import PapermillExecutionError
        e = err.cause
        if isinstance(e, PapermillExecutionError):
            what = f"cell {e.exec_count}: {e.ename}: {str(e.evalue)[:600]}"
        else:
            what = f"{type(e).__name__}: {str(e)[:600]}"
        print(f"error: a notebook failed in {what}\n(the output folder is as it was; the executed copy, with "
              f"the full traceback, is in {err.run_dir})", file=sys.stderr)
        return 1
    return 0
