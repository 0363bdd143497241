"""Running the lab's notebooks with papermill: `python -m kdtree lab [NOTEBOOK ...] [-p KEY VALUE ...]`.

Executed notebooks and their JSON/PNG results go to outputs/ on a CPU and to outputs/<gpu>/ (for example
outputs/h200/) when a CUDA GPU is present, so a CPU run never overwrites a GPU record.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch



def repo_root() -> Path:
    """The lab checkout: the working directory if it has notebooks/, else the package's parent."""
    cwd = Path.cwd()
    return cwd if (cwd / "notebooks").is_dir() else Path(__file__).resolve().parent.parent


ROOT = repo_root()
NOTEBOOKS = ROOT / "notebooks"
OUTPUTS = ROOT / "outputs"


def pick_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a CUDA GPU is present, else 'cpu'; anything else is checked and returned."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA GPU is visible; use 'auto' or 'cpu'")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device={device!r}: expected 'auto', 'cpu' or 'cuda[:N]'")
    return device


def device_slug(device: str) -> str | None:
    """A folder name for a GPU record ('NVIDIA H200' -> 'h200'); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    name = re.sub(r"^nvidia\s+", "", name)
    name = re.sub(r"\b(nvl|sxm\d*|pcie|hbm\w*|\d+gb)\b", "", name)
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def output_dir(device: str) -> Path:
    slug = device_slug(device)
    return OUTPUTS / slug if slug else OUTPUTS


def parse_value(text: str):
    """-p values: JSON when it parses (numbers, true/false/null, lists), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def find_notebooks(names) -> list[Path]:
    if not names:
        return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    out = []
    for n in names:
        p = Path(n)
        cands = [p, NOTEBOOKS / p, NOTEBOOKS / (p.name + ".ipynb")] + sorted(NOTEBOOKS.glob(f"{p.name}*.ipynb"))
        hit = next((c for c in cands if c.is_file()), None)
        if hit is None:
            known = [q.name for q in sorted(NOTEBOOKS.glob("*.ipynb"))]
            raise FileNotFoundError(f"notebook {n!r} not found; expected one of {known}")
        out.append(hit)
    return out


def executed_name(nb: Path, params: dict) -> str:
    """The executed copy's file name: the notebook's, or NAME-stage-STAGE.ipynb for a staged run (notebook 03's
    `stage` parameter), so that the stages of one training run, each a device command, keep their records."""
    stage = (params or {}).get("stage", "all")
    return nb.name if stage == "all" else f"{nb.stem}-stage-{stage}.ipynb"


def run_lab(notebooks=(), params: dict | None = None, device: str = "auto", out_dir: str | None = None) -> list[Path]:
    """Execute notebooks with papermill; returns the executed copies."""
    import papermill as pm

    device = pick_device(device)
    out = Path(out_dir) if out_dir else output_dir(device)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for nb in find_notebooks(notebooks):
        p = {"device": device, "out_dir": str(out.resolve()), **(params or {})}
        target = out / executed_name(nb, p)
        print(f"[kdtree lab] {nb.name} on {device} -> {target}", flush=True)
        pm.execute_notebook(str(nb), str(target), parameters=p, cwd=str(nb.parent), progress_bar=True,
                            kernel_name="python3")
        done.append(target)
    return done


def main_lab(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kdtree lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", help="notebook names or paths (default: every notebooks/NN_*.ipynb)")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                    help="papermill parameter; VALUE is parsed as JSON when it can be")
    ap.add_argument("--device", default="auto", help="auto (default), cpu or cuda[:N]")
    ap.add_argument("--out-dir", default=None, help="default: outputs/ on a CPU, outputs/<gpu>/ on a GPU")
    a = ap.parse_args(argv)
    params = {k: parse_value(v) for k, v in a.parameter}
    try:
        run_lab(a.notebooks, params, a.device, a.out_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
