"""The results page from the lab's JSON records: `python -m kdtree report [--records DIR] [--out FILE]`.

docs/results.md is this module's output over outputs/ (a test keeps the two equal), so its numbers cannot
drift from the records. The page opens with the answer (`headline`): does DDTree pay, at which batch and
budget, against which AR, on which card: the K2.6-shape rows (SIMULATED acceptance) and the trained pair's
(real acceptance, a tiny model), each speculative row over the engine's own AR of the same record, run and
cell. Then each GPU record folder, outputs/<gpu>/ (for example outputs/h200/), is a section: every goal of
its records in one table, then each known record's main tables; a record the folder lacks is named with the
command that writes it, an unknown one by its name only. outputs/ itself holds the CPU's smoke records: they
are named, not tabulated; outputs/cpu/ (a CPU lab run's git-ignored folder) is no GPU section. `python -m
kdtree lab` rewrites the page after a run that wrote into a GPU folder. Every number on the page is written
in positional notation (thousands separators, fixed decimals), never in exponent form. The headline's
tables are built by kdtree.report_headline, each record's tables by kdtree.report_records (its `RENDER`),
numbers and tables formatted by kdtree.report_format.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .bench import goals
from .report_format import _num, _table
from .report_headline import _k26_headline, _pair_headline
from .report_records import RENDER

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "outputs"
PAGE = ROOT / "docs" / "results.md"

# the records a GPU folder is expected to hold, in page order, with the command that writes each
GPU_RECORDS = {
    "golden_validation.json": "python -m kdtree lab 00",
    "bench_kernels.json": "python -m kdtree bench",
    "microbench_k26.json": "python -m kdtree lab 01",
    "bench_drafter.json": "python -m kdtree.bench.drafter --out outputs/<gpu>",
    "engine.json": "python -m kdtree.bench.engine --out outputs/<gpu>",
    "engine_mid.json": "python -m kdtree.bench.engine --mid-only --out outputs/<gpu>",
    "e2e.json": "python -m kdtree lab 02 (stages pair, auto, k26)",
    "trained_pair.json": "python -m kdtree lab 03 -p stage measure",
    "bridge.json": "python -m kdtree bench --bridge",
    "bench_decode.json": "python -m kdtree.bench.decode --out outputs/<gpu>/bench_decode.json",
    "peers.json": "python -m kdtree.bench.peers --out outputs/<gpu>",
}
EARLIER = "earlier"   # outputs/<gpu>/earlier/: superseded runs, never read for a section


def _targets(targets: list[dict], where: str, seen: set | None = None) -> list[list]:
    """Table rows of a record's targets ({name, measured, goal, met}; bridge.json's older {what, batch,
    budget, value, goal, met}), judged against kdtree/bench/goals.json where the target's goal is known there
    (the record's own goal and met otherwise); the keys found are added to `seen`."""
    rows = []
    for t in targets:
        key = goals.key_of(t)
        g = goals.goals().get(key) if key else None
        name = goals.shown_name(t)
        measured = t.get("measured", t.get("value"))
        if g is not None:
            if seen is not None:
                seen.add(key)
            info = g.get("info", False) or "(info)" in name
            met = goals.met(key, measured)
            goal = g["goal"]
        else:
            info, met, goal = "(info)" in name, t.get("met"), t.get("goal")
        status = "info" if info else "met" if met else "**missed**"
        rows.append([where, name, _num(measured), _num(goal), status])
    return rows


def all_targets(rec_name: str, rec) -> list[dict]:
    """Every {name, measured, goal, met} of a record: its top-level `targets`, else its sections' (a record
    whose top level repeats its sections' targets is counted once)."""
    if not isinstance(rec, dict):
        return []
    if rec.get("targets"):
        return list(rec["targets"])
    out = []
    for v in rec.values():
        if isinstance(v, dict) and v.get("targets"):
            out += v["targets"]
    return out


def headline(records: Path | str = RECORDS) -> list[str]:
    """The page's opening section: the K2.6-shape table (SIMULATED acceptance) and the trained pair's (real
    acceptance), from every GPU folder of `records`; [] where no record holds either."""
    gpus = _gpu_folders(Path(records), depth=2)
    body = _k26_headline(gpus) + _pair_headline(gpus)
    if not body:
        return []
    return ["## The answer: does DDTree pay?", "", *body]


def _gpu_folders(root: Path, depth: int = 1) -> list[Path]:
    """outputs/<gpu>/: the folders of `root` holding JSON records (at their top; depth 2: or in a subfolder
    at any depth), outputs/cpu/ (a CPU lab run's) excepted."""
    from .lab_params import CPU_DIR
    pats = ("*.json", "*/**/*.json")[:depth]
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name != CPU_DIR and any(any(p.glob(pat)) for pat in pats))


def _found(folder: Path, name: str) -> Path | None:
    """Record `name` of a GPU folder: at its top, else in exactly one of its subfolders (a run recorded
    beside its README; `earlier/` left out), else None."""
    top = folder / name
    if top.is_file():
        return top
    subs = [p for p in sorted(folder.glob(f"*/{name}")) if p.parent.name != EARLIER]
    return subs[0] if len(subs) == 1 else None


def _folder(folder: Path, expected) -> list[str]:
    lines, rows, seen = [], [], set()
    have = {p.name: p for p in sorted(folder.glob("*.json"))}
    for name in expected:
        path = _found(folder, name)
        if path is None:
            how = GPU_RECORDS.get(name, "")
            lines += [f"### {name}", "", f"No record yet: `{how}` writes it.", ""]
            continue
        rec = json.loads(path.read_text())
        lines += [f"### {name}", ""]
        if path.parent != folder:
            lines += [f"Recorded in `{path.parent.name}/` (its README there tells the run).", ""]
        if name in RENDER:
            lines += RENDER[name](rec)
        rows += _targets(all_targets(name, rec), name, seen)
    others = [n for n in have if n not in expected]
    if others:
        names = ", ".join(f"`{n}`" for n in others)
        lines += [f"Other records here (probes and earlier runs): {names}.", ""]
    head = []
    if rows:
        met = sum(r[-1] == "met" for r in rows)
        n = sum(r[-1] != "info" for r in rows)
        head = [f"Goals ({goals.PATH.parent.name}/{goals.PATH.name}): {met} of {n} met (rows marked info are "
                "context, not goals).", "", *_table(["record", "what", "measured", "goal", "status"], rows)]
    unmeasured = [k for k, g in goals.goals().items()
                  if k not in seen and not g.get("info") and not g.get("failure_only")]
    if unmeasured:
        head += ["Goals no record here measures yet: " + "; ".join(
            re.sub(r"{(\w+)}", r"<\1>", goals.goal(k)["name"]) + f" ({goals.goal(k)['record']})"
            for k in unmeasured) + ".", ""]
    return head + lines


def report(records: Path | str = RECORDS) -> str:
    """The page (markdown) for the record folder `records` (outputs/ and its GPU subfolders)."""
    root = Path(records)
    if not root.is_dir():
        raise ValueError(f"records: {root} is not a folder (expected the lab's outputs/)")
    lines = ["# Results", "",
             "Generated by `python -m kdtree report` from the JSON records under `outputs/`; do not edit it.",
             "Absolute times are from the GPU named in each section; ratios compare rows of one run.", ""]
    lines += headline(root)
    gpus = _gpu_folders(root, depth=2)
    if not gpus:
        lines += ["No GPU record yet: run `make lab` on a machine with a CUDA GPU.", ""]
    for g in gpus:
        lines += [f"## {g.name} (`outputs/{g.name}/`)", "", *_folder(g, tuple(GPU_RECORDS))]
    cpu = sorted(p.name for p in root.glob("*.json"))
    if cpu:  # rewritten by every CPU `make lab`: named here, not tabulated
        lines += ["## CPU smoke records (`outputs/`)", "",
                  "`make lab` on a CPU runs the notebooks with tiny defaults and writes "
                  + ", ".join(f"`{n}`" for n in cpu) + ": they show that the notebooks run, not how fast "
                  "anything is, and no goal applies to them.", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree report", description=__doc__.splitlines()[0])
    ap.add_argument("--records", default=str(RECORDS), help="the record folder (default: outputs/)")
    ap.add_argument("--out", default=str(PAGE), help="the page (default: docs/results.md); - prints it")
    a = ap.parse_args(argv)
    try:
        page = report(a.records)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if a.out == "-":
        print(page, end="")
        return 0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
