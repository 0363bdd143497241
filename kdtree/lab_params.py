"""The lab notebooks' parameters: one declaration per notebook (each parameter's default, allowed values and
one line of help), read by the runner (`python -m kdtree lab`: every -p value is checked before the kernel
starts), by `python -m kdtree lab --help`, and by each notebook's first code cell
(`lab_params.check("00", globals())`), so that papermill, Jupyter and the command line refuse a bad value
with the same words.

A declaration's names and defaults are those of the notebook's cell tagged `parameters` (a test keeps them
equal). Paths are read relative to the notebook's folder (where papermill and Jupyter run it). Besides each
value on its own, a few rules look at several (notebook 02's chain taus must lie below the block size).
Notebook 03 writes the shipped pair (`data/trained/`) only with `overwrite_trained=True` (`python -m kdtree
lab 03 --overwrite-trained`); otherwise its pair goes beside its record (`training_folder`).

This module imports neither torch nor numpy, so that the runner refuses a bad name or value at once.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from .config import ModelArgs
from .lab_kinds import (Config, Device, File, Flag, Float, Folder, Int, Keys, Kind, ListOf,  # noqa: F401
                        Maybe, OneOf, Param, Row, Text, WritableFolder, _is_int, _is_number, _path)

CORPUS_SOURCES = ("stdlib", "torch", "numpy")   # kdtree.data.SOURCES (a test keeps them equal)
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelArgs))   # what target_kw may override
CPU_DIR = "cpu"   # outputs/cpu/: a CPU lab run's folder (git-ignored: the checkout stays clean)
TRAINED_DEFAULT = "../data/trained"   # notebook 03's ckpt_dir: the shipped pair, beside notebooks/
TRAINED = Path(__file__).resolve().parent.parent / "data" / "trained"   # the package checkout's pair
SEED_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------- rules
def shipped_pair(path, base: Path | None = None) -> bool:
    """Whether `path` (relative to `base`, default the working directory) is the shipped trained pair: the
    notebooks' own default ../data/trained or the package checkout's data/trained, compared resolved ('..',
    '.', trailing slashes and links seen through)."""
    base = Path.cwd() if base is None else Path(base)
    p = _path(path, base).resolve()
    return p in (TRAINED.resolve(), (base / TRAINED_DEFAULT).resolve())


def training_folder(ckpt_dir, out, stage: str, smoke: bool, overwrite_trained: bool) -> str:
    """Notebook 03's checkpoint folder: `ckpt_dir`, except where that is the shipped pair (`shipped_pair`,
    however spelt) and overwrite_trained is not True: a smoke run's pair goes to out/smoke_ckpt, a full run's
    to out/trained (beside its record; git ignores both), so data/trained/ is written only on request. A
    "measure" stage reads out/trained when an earlier stage left a pair there, else the shipped pair."""
    if overwrite_trained is True or not shipped_pair(ckpt_dir):
        return str(ckpt_dir)
    mine = Path(out) / ("smoke_ckpt" if smoke else "trained")
    if stage == "measure" and not (mine / "drafter").is_dir():
        return str(ckpt_dir)
    return str(mine)


def _chain_taus_below_the_block(v: dict, base: Path | None) -> str | None:
    bad = [t for t in v["profiles"] if t >= v["block_size"]]
    if bad:
        return (f"profiles={v['profiles']!r}: each chain tau must lie below block_size={v['block_size']!r} "
                "(a chain of block_size - 1 draft depths emits at most block_size tokens a round)")
    return None


# ---------------------------------------------------------------------------------------------- declarations
POS = Int(1)
POSITIVE_INTS = ListOf(Int(1))
SEED = Int(0, SEED_MAX)
DEVICE = Device()
SMOKE = OneOf("auto", True, False)
OUT_DIR = Text()

NOTEBOOKS: dict[str, dict[str, Param]] = {
    "00_golden_validation": {
        "config": Param(Config(many=True), ["tiny-a", "tiny-b"], "model configurations to validate"),
        "seed": Param(SEED, 0, "seed of the models, prompts and random trees"),
        "device": Param(DEVICE, "auto", "where the models run (the runner's --device)"),
        "n_prompts": Param(POS, 6, "random prompts per config"),
        "max_new_tokens": Param(POS, 64, "tokens generated per prompt"),
        "budget": Param(POS, 64, "DDTree draft nodes per round"),
        "block_size": Param(Int(2), 16, "drafter block: block_size - 1 draft depths (L)"),
        "budgets": Param(POSITIVE_INTS, [4, 16, 64, 256], "the oracle sweep's budgets"),
        "golden_cases": Param(POS, 300, "random trees checked against brute force"),
        "out_dir": Param(OUT_DIR, "../outputs", "where the record goes (the runner's --out-dir)"),
    },
    "01_k26_microbench": {
        "device": Param(DEVICE, "auto", "where the benchmarks run (the runner's --device)"),
        "smoke": Param(SMOKE, "auto", "auto: the tiny set on a CPU, the full set on a GPU"),
        "config": Param(Config(), "kimi-k2.6", "shapes of the MoE and layer sections"),
        "vocab": Param(POS, 163840, "draft vocabulary of the tree round"),
        "depth": Param(POS, 15, "draft depths of the tree round (block size - 1)"),
        "tree_batches": Param(POSITIVE_INTS, [1, 8, 32, 128], "tree round: batch sizes"),
        "tree_budgets": Param(POSITIVE_INTS, [16, 64, 256, 1024], "tree round: budgets"),
        "attn_contexts": Param(POSITIVE_INTS, [4096, 32768], "verify attention: context lengths"),
        "attn_nodes": Param(POSITIVE_INTS, [1, 16, 64, 256], "verify attention: tree nodes"),
        "attn_batches": Param(POSITIVE_INTS, [1, 8], "verify attention: batch sizes"),
        "walk_batches": Param(POSITIVE_INTS, [1, 8, 32], "walk + compaction: batch sizes"),
        "walk_budgets": Param(POSITIVE_INTS, [64, 256, 1024], "walk + compaction: budgets"),
        "moe_tokens": Param(POSITIVE_INTS, [1, 8, 16, 64, 128, 256, 512, 1024], "INT4 MoE: token counts"),
        "layer_contexts": Param(POSITIVE_INTS, [4096, 32768], "one layer's verify: context lengths"),
        "layer_nodes": Param(POSITIVE_INTS, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                             "one layer's verify: tree nodes"),
        "layer_batches": Param(POSITIVE_INTS, [1, 8, 32], "one layer's verify: batch sizes"),
        "layer_path": Param(OneOf("auto", "torch", "fused"), "auto",
                            "one layer's verify: the decode path timed (auto: fused on a GPU, as the engine "
                            "runs, torch elsewhere)"),
        "n_layers": Param(POS, 61, "layers of the whole-model projections"),
        "repeats": Param(POS, 20, "timed repeats per measurement"),
        "peers": Param(SMOKE, "auto", "section 5c, the field's kernels beside ours (auto: on a GPU)"),
        "out_dir": Param(OUT_DIR, "../outputs", "where the record goes (the runner's --out-dir)"),
    },
    "02_end_to_end": {
        "device": Param(DEVICE, "auto", "where the pair runs (the runner's --device)"),
        "smoke": Param(SMOKE, "auto", "auto: a tiny prompt set on a CPU, the full set on a GPU"),
        "ckpt_dir": Param(Folder(("target", "drafter")), "../data/trained", "the trained pair (notebook 03)"),
        "eval_prompts": Param(POS, 8, "held-out prompts"),
        "prompt_len": Param(POS, 64, "tokens per prompt"),
        "max_new_tokens": Param(POS, 128, "tokens generated per prompt"),
        "budgets": Param(POSITIVE_INTS, [16, 32, 64, 128, 256, 512, 1024], "DDTree budgets measured"),
        "temperatures": Param(ListOf(Float(0), contains=0.0), [0.0], "sampling temperatures (T = 0 is the "
                              "lossless reference)"),
        "microbench": Param(Text(), "../outputs/h200/microbench_k26.json",
                            "notebook 01's GPU record: the K2.6 cost curves (none there: no projection)"),
        "proj_batches": Param(POSITIVE_INTS, [1, 8], "projection: batch sizes"),
        "proj_contexts": Param(POSITIVE_INTS, [4096, 32768], "projection: context lengths"),
        "drafter_layers": Param(POS, 6, "projection: drafter layers (Kimi-K2.5-DFlash: 6 at hidden 7168)"),
        "profiles": Param(ListOf(Float(1, lo_open=True)), [3.0, 5.0, 8.0],
                          "chain taus of idealised calibrated drafters (kdtree.project.profile_taus)"),
        "profile_ratio": Param(Float(0, 1, hi_open=True), 0.5,
                               "their rank-j probability decays as ratio^(j-1) after rank 0"),
        "block_size": Param(Int(2), 16, "projection: drafter block (block_size - 1 draft depths)"),
        "engine_batches": Param(POSITIVE_INTS, [8, 32],
                                "section 4: the engine at these batch sizes (GPU only)"),
        "engine_hf": Param(Flag(), True, "section 4: transformers' generate on the same checkpoint as the AR "
                           "baseline"),
        "n_layers": Param(POS, 61, "projection: layers of the whole model"),
        "multi_world": Param(POS, 8, "section 3: GPUs of the several-GPU projection"),
        "allreduce_latency_s": Param(Maybe(Float(0, lo_open=True)), None,
                                     "section 3: a measured all-reduce's latency (tp.allreduce_cost)"),
        "allreduce_Bps": Param(Maybe(Float(0, lo_open=True)), None,
                               "section 3: a measured all-reduce's bandwidth (tp.allreduce_cost)"),
        "auto_batches": Param(POSITIVE_INTS, [1, 8, 32],
                              "section 5: the cost-aware budget at these batch sizes"),
        "auto_budgets": Param(POSITIVE_INTS, [4, 8, 16, 32, 64, 128, 256],
                              "section 5: fixed budgets, and auto's candidates"),
        "auto_repeats": Param(POS, 3, "sections 5, 6: timed runs per engine (their median)"),
        "k26_cells": Param(ListOf(Row(("context", POS), ("batch", POS)), min_len=0), [],
                           "section 6 (GPU): the K2.6-shape cells, e.g. [[4096, 1], [4096, 8]]"),
        "k26_profiles": Param(ListOf(Row(("chain tau", Float(1, lo_open=True)), ("drafter block", Int(2)),
                                         cond=(lambda t, b: t < b, "chain tau below drafter block"))),
                              [[3.0, 8], [5.0, 8], [8.0, 16]], "section 6: simulated profiles"),
        "k26_budgets": Param(POSITIVE_INTS, [4, 8, 16, 32, 64, 128], "section 6: budgets"),
        "k26_trained": Param(Flag(), True,
                             "section 6: the trained pair's realized curve as one more profile"),
        "k26_routing": Param(OneOf("model", "uniform"), "model", "section 6: the router (random as it is, or "
                             "k26.HashedGate)"),
        "k26_queue": Param(Int(0), 2, "section 6: from batch 2 on, queued requests per batch slot"),
        "k26_from": Param(Maybe(File()), None, "section 6: an e2e_k26.json of python -m kdtree.bench.k26 to "
                          "show instead"),
        "k26_before": Param(Maybe(File()), None, "section 6: the same card's sweep on an earlier decode path "
                            "(an e2e_k26.json), shown beside as a before / after table"),
        "stage": Param(OneOf("all", "pair", "auto", "k26"), "all", "one part only, merged into the record"),
        "seed": Param(SEED, 0, "seed of the prompts"),
        "out_dir": Param(OUT_DIR, "../outputs", "where the record goes (the runner's --out-dir)"),
    },
    "03_train_pair": {
        "device": Param(DEVICE, "auto", "where training runs (the runner's --device)"),
        "smoke": Param(SMOKE, "auto", "auto: the tiny set on a CPU (checkpoints in a scratch folder)"),
        "stage": Param(OneOf("all", "target", "drafter", "measure"), "all",
                       "one stage only (one device command each)"),
        "ckpt_dir": Param(WritableFolder(), TRAINED_DEFAULT, "target/ and drafter/ in the HF layout"),
        "overwrite_trained": Param(Flag(), False, "True: a training run may replace the shipped pair "
                                   "data/trained/ (the runner's --overwrite-trained)"),
        "corpus": Param(ListOf(OneOf(*CORPUS_SOURCES), distinct=True), ["stdlib", "torch"],
                        "kdtree.data.SOURCES: Python sources present wherever the lab runs"),
        "seed": Param(SEED, 0, "seed of training and the prompts"),
        "target_kw": Param(Keys(MODEL_FIELDS, "ModelArgs fields (e.g. hidden_size)"), {},
                           "overrides of kdtree.train.target_args"),
        "target_steps": Param(POS, 2800, "target: optimizer steps"),
        "target_batch": Param(POS, 64, "target: sequences per step"),
        "target_seq_len": Param(POS, 256, "target: tokens per sequence"),
        "target_lr": Param(Float(0, lo_open=True), 3e-3, "target: peak learning rate"),
        "target_time_limit_s": Param(Maybe(Float(0, lo_open=True)), 420, "target: stop past this wall time"),
        "n_prompts": Param(POS, 16384, "greedy corpus for the drafter: prompts"),
        "prompt_len": Param(POS, 64, "greedy corpus: tokens per prompt"),
        "new_tokens": Param(POS, 128, "greedy corpus: tokens generated per prompt"),
        "block_size": Param(Int(2), 16, "drafter block (block_size - 1 draft depths)"),
        "drafter_layers": Param(POS, 2, "drafter: layers"),
        "drafter_steps": Param(POS, 3500, "drafter: optimizer steps (the cosine schedule)"),
        "drafter_batch": Param(POS, 64, "drafter: sequences per step"),
        "anchors": Param(POS, 16, "drafter: blocks per sequence per step"),
        "depth_decay": Param(Float(0, 1, lo_open=True), 0.9, "drafter: loss weight of depth k is "
                             "depth_decay^(k-1)"),
        "soft_weight": Param(Float(0), 1.0,
                             "drafter: weight of KL(target || drafter) beside the cross-entropy"),
        "drafter_lr": Param(Float(0, lo_open=True), 3e-3, "drafter: peak learning rate"),
        "drafter_time_limit_s": Param(Maybe(Float(0, lo_open=True)), 300,
                                      "drafter: stop past this wall time"),
        "eval_prompts": Param(POS, 8, "measurement: held-out prompts"),
        "max_new_tokens": Param(POS, 128, "measurement: tokens generated per prompt"),
        "budgets": Param(POSITIVE_INTS, [16, 32, 64, 128, 256, 512, 1024], "measurement: DDTree budgets"),
        "temperatures": Param(ListOf(Float(0)), [0.0, 1.0], "measurement: sampling temperatures"),
        "out_dir": Param(OUT_DIR, "../outputs", "where the record goes (the runner's --out-dir)"),
    },
}

RULES: dict[str, tuple[Callable[[dict, Path | None], str | None], ...]] = {
    "02_end_to_end": (_chain_taus_below_the_block,),
}


def find(notebook) -> str | None:
    """The declaration's key for a notebook: its stem ('03_train_pair'), a path to it, or a prefix such as
    '03' that one notebook starts with; None when no declaration matches."""
    stem = Path(str(notebook)).stem
    if stem in NOTEBOOKS:
        return stem
    hits = [k for k in NOTEBOOKS if k.startswith(stem)] if stem else []
    return hits[0] if len(hits) == 1 else None


def declaration(notebook) -> dict[str, Param]:
    """{name: Param} of a notebook ('00', '00_golden_validation' or its path); ValueError when none."""
    key = find(notebook)
    if key is None:
        raise ValueError(f"no parameter declaration for notebook {str(notebook)!r}; "
                         f"declared: {sorted(NOTEBOOKS)}")
    return NOTEBOOKS[key]


def problem(notebook, name: str, value, base: Path | None = None) -> str | None:
    """What `value` of the notebook's parameter `name` should be, or None when it is allowed (or the name is
    not declared: the runner checks names against the parameters cell)."""
    p = declaration(notebook).get(name)
    return None if p is None else p.problem(value, base)


def check_rules(notebook, values: dict, base: Path | None = None) -> None:
    """The rules over several parameters (defaults fill what `values` lacks); ValueError with the rule's
    message."""
    key = find(notebook)
    if key is None:
        return
    decl = NOTEBOOKS[key]
    full = {k: values[k] if k in values else p.default for k, p in decl.items()}
    for rule in RULES.get(key, ()):
        msg = rule(full, base)
        if msg:
            raise ValueError(msg)


def check(notebook, values: dict, base: Path | None = None) -> None:
    """Every declared parameter found in `values` (a notebook passes globals()), then the rules; ValueError
    'name=value: expected ...' on the first bad one. base: the folder paths are read from (default: the
    working directory, the notebook's own)."""
    base = Path.cwd() if base is None else Path(base)
    for name, p in declaration(notebook).items():
        if name in values:
            want = p.problem(values[name], base)
            if want:
                raise ValueError(f"{name}={values[name]!r}: expected {want}")
    check_rules(notebook, values, base)


def check_device(device) -> str:
    """device as given when it is 'auto', 'cpu', 'cuda' or 'cuda:N' (no torch needed), else ValueError."""
    if not DEVICE.ok(device, None):
        raise ValueError(f"device={device!r}: expected {DEVICE.expect}")
    return device


def describe(notebook, skip=()) -> list[str]:
    """Lines for `lab --help`: 'name = default  help; allowed values' per parameter."""
    out = []
    for name, p in declaration(notebook).items():
        if name not in skip:
            out.append(f"    {name} = {p.default!r}  {p.help}; {p.kind.expect}")
    return out
