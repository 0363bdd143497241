"""Measure a drafter's calibration (`kdtree.calibration.Calibration`) on held-out prompts and store it.

    python -m kdtree.bench.calibrate [--ckpt data/trained] [--prompts 16] [--max-new 64] [--budget 256]
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import checks, golden, weights
from ..calibration import Calibration, node_acceptance
from ..data import heldout_prompts
from ..engine import Engine
from ..round_ops import GoldenOps


def measure(target, drafter, prompts, max_new_tokens: int, budget: int = 64, progress: bool = False,
            rounds: list | None = None) -> Calibration:
    """DDTree rounds at `budget` over `prompts` (one request at a time through the engine on the host's
    golden tree steps; greedy), every node of every round recorded. The engine's own tokens and accept lengths
    are unchanged by the recording (checked: accepted nodes + 1 == each round's accept length). rounds: a
    list that receives each round's (scores, depths, accepted) arrays in best-first order (`truncations`)."""
    budget = checks.int_in("budget", budget, 1, golden.MAX_BUDGET)
    max_new_tokens = checks.positive_int("max_new_tokens", max_new_tokens)
    prompts = [checks.token_list(f"prompts[{i}]", p, target.args.vocab_size) for i, p in enumerate(prompts)]
    if not prompts:
        raise ValueError("prompts: expected at least one prompt (a calibration over nothing proves nothing)")
    cal = Calibration.empty(drafter.block_size - 1)
    cal.budget, cal.prompts = budget, len(prompts)

    class Recording(GoldenOps):
        def trees(self, logits, roots, starts):
            self.last = super().trees(logits, roots, starts)   # the round's trees, kept for walk
            return self.last

        def walk(self, tokens, parents, choice, max_accept: int):
            acc, n, bonus = super().walk(tokens, parents, choice, max_accept)
            c = choice.cpu().numpy()
            for i, (tree, blk) in enumerate(self.last):
                ok = node_acceptance(blk, c[i])
                if int(ok.sum()) + 1 != int(n[i]):
                    raise RuntimeError(f"calibration: {int(ok.sum())} accepted nodes but the walk accepted "
                                       f"{int(n[i])} rows")
                cal.add(tree.scores, tree.depths, ok)
                if rounds is not None:
                    rounds.append((tree.scores.copy(), tree.depths.copy(), ok))
            return acc, n, bonus

    need = max(len(p) for p in prompts) + max_new_tokens + budget + 2
    e = Engine(target, drafter, mode="ddtree", budget=budget, max_batch=1, backend="golden", graphs=False,
               max_len=min(target.args.max_position_embeddings, need))
    e.ops = Recording("ddtree", budget, e.page_size)
    e.runner.build = e.ops.build
    for i, p in enumerate(prompts):
        e.generate([p], max_new_tokens)
        if progress:
            print(f"\rcalibration: prompt {i + 1}/{len(prompts)}", end="", flush=True)
    if progress:
        print()
    return cal


def main(argv=None) -> None:
    """python -m kdtree.bench.calibrate [--ckpt data/trained] [--prompts 16] [--max-new 64] [--budget 256]:
    measure the pair's drafter on held-out prompts (notebook 02's split) and store the table beside the
    drafter."""
    import argparse

    ap = argparse.ArgumentParser(description="measure a drafter's calibration and store it beside the "
                                 "drafter")
    ap.add_argument("--ckpt", default="data/trained", help="folder holding target/ and drafter/")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--budget", type=int, default=256,
                    help="the tree size measured (budget=\"auto\"'s B_max)")
    a = ap.parse_args(argv)
    ckpt = Path(a.ckpt)
    t = weights.load(ckpt / "target").eval()
    d = weights.load_drafter(ckpt / "drafter", t)
    cal = measure(t, d, heldout_prompts(a.prompts, a.prompt_len), a.max_new, a.budget, progress=True)
    path = cal.save(ckpt / "drafter")
    pred, real = cal.rates()
    print(f"{path}: {int(np.sum(cal.count))} nodes; realized / predicted by depth: " + ", ".join(
        f"{np.nansum(np.asarray(cal.accepted)[i]) / max(1.0, np.nansum(np.asarray(cal.predicted)[i])):.2f}"
        for i in range(cal.depths)))


if __name__ == "__main__":
    main()
