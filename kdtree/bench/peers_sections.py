"""The sections of `python -m kdtree.bench.peers` past the attention cells and the AR, each optional on the
command line (`add_arguments`: --no-moe, --no-topk, --no-gemm; --quick keeps each small) and written into
peers.json row by row (`run_sections`), each with its family of targets (`build_targets`):

  moe    INT4 g32 routed experts at K2.6's shape, ours against SGLang's Triton fused MoE (bench.peers_moe):
         1 / 8 / 16 / 64 / 128 tokens, uniform and concentrated routing; peers_moe_vs_sglang.
  topk   the DDTree draft's per-position top-k over K2.6's 163,840-token vocabulary (TOPK_POSITIONS rows a
         request, bf16 logits): ours (kernels.topk_logprobs: the top k sorted + their log-probabilities, the
         tree build's first stage) against torch.topk + logsumexp (the same outputs), torch.topk alone (no
         log-softmax) and FlashInfer 0.5's top-k, which has no top-k returning indices: top_k_mask_logits
         (the logits outside the top k set to -inf, fp32 [rows, V]); k = 64 (the batch-1 tree round's
         budget), 256 (budget "auto"'s largest tree) and 1024 (the batch-32 tree round's budget), at batch
         1 and 32; peers_topk_vs_best: the fastest agreeing side / ours (a side doing less work included).
  gemm   bf16 GEMMs of 1-64 rows over K2.6's projections: bench.decode.gemm_table's rows (cuBLAS through
         F.linear, ours through ops.gemv up to GEMV_MAX_ROWS rows), each checked against float32 first
         (`gemm_agreement`); peers_gemm_engine_vs_cublas: per matrix, the worst over the rows of cuBLAS
         time / the engine's own projection (`engine_path`: ops.gemv up to fused.GEMV_ROWS rows, else
         cuBLAS); peers_gemm_vs_cublas (info): the same for ops.gemv alone.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import goals
from .peers_common import AGREE, best_peer, rel_diff, run_sides, time_calls, version
from .timer import input_sets

SECTIONS = ("moe", "topk", "gemm")
TOPK_CELLS = ((1, 64), (1, 256), (32, 256), (32, 1024))    # (batch, k)
QUICK_TOPK_CELLS = ((1, 64), (32, 256))
TOPK_POSITIONS = 15        # draft positions a request (the DFlash block of 16 less its root), as bench.tree
LP_TOL = 1e-3              # log-probabilities agree within this (ours: float64 log-sum-exp; torch: float32)
TOPK_OUTPUTS = {
    "ours": "kernels.topk_logprobs: tokens [R, k] sorted by logit, their log-probabilities",
    "torch_topk_lse": "bench.baselines.topk_only: torch.topk + torch.logsumexp, the same outputs",
    "torch_topk": "torch.topk: values and indices [R, k], sorted; no log-softmax",
    "flashinfer_top_k_mask_logits": "flashinfer.sampling.top_k_mask_logits: fp32 [R, V], logits outside the "
                                    "top k set to -inf; no indices, no order, no log-softmax",
}


def find_flashinfer_topk() -> dict:
    """{"available", "version", "reason"?, "api"?}: FlashInfer's top_k_mask_logits (its 0.5 API's only top-k
    over logits; "api" not serialized) or the reason it is not loaded."""
    out = {"version": version("flashinfer-python")}
    try:
        import flashinfer.sampling as fs
        out.update(available=True, api={"top_k_mask_logits": fs.top_k_mask_logits})
    except Exception as e:  # absent, or present without what it needs (a dependency, a compiler)
        out.update(available=False, reason=f"{type(e).__name__}: {e}"[:300])
    return out


def find_peers() -> dict:
    """The sections' peers: {"sglang_moe": peers_moe.find_sglang_moe(), "flashinfer_topk": ...}."""
    from .peers_moe import find_sglang_moe
    return {"sglang_moe": find_sglang_moe(), "flashinfer_topk": find_flashinfer_topk()}


# ----------------------------------------------------------------------------- top-k
def topk_agreement(x: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, name: str, out):
    """A side's output against ours (tok int32 [R, k], lp fp32 [R, k] on logits x [R, V]) by value, a tie at
    our k-th logit free to go either way: ({"rows_differ", "max_lp_diff"?}, why or None). "torch_topk_lse"
    (log-probabilities, indices) and "torch_topk" (values, indices): the logits at its indices equal ours, in
    order; "torch_topk_lse" also its log-probabilities within LP_TOL of ours. Any other side is a mask (logits
    kept, the rest -inf, [R, V]): every logit above our k-th kept, none below it, at least k kept."""
    xf = x.float()
    vals = xf.gather(1, tok.long())        # ours, descending
    agree = {}
    if name in ("torch_topk_lse", "torch_topk"):
        first, idx = out
        differ = (xf.gather(1, idx.long()) != vals).any(1)
        if name == "torch_topk_lse":
            agree["max_lp_diff"] = float((first.float() - lp).abs().max())
    else:
        kept, kth = torch.isfinite(out.float()), vals[:, -1:]
        differ = ((xf > kth) & ~kept).any(1) | (kept & (xf < kth)).any(1) | (kept.sum(1) < tok.shape[1])
    agree["rows_differ"] = int(differ.sum())
    if agree["rows_differ"]:
        return agree, f"{agree['rows_differ']} of {x.shape[0]} rows select other logits than ours"
    if agree.get("max_lp_diff", 0.0) > LP_TOL:
        return agree, f"log-probabilities differ from ours by {agree['max_lp_diff']:.3g} (> {LP_TOL})"
    return agree, None


def topk_cell(peer: dict, b: int, k: int, repeats: int = 30, vocab: int = 163840,
              positions: int = TOPK_POSITIONS, seed: int = 0, timer=time_calls) -> dict:
    """One cell: logits bf16 [b * positions, vocab] (randn x 3, as bench.tree; `timer.input_sets` sets
    rotated past L2): {batch, positions, rows, k, vocab, dtype, outputs (TOPK_OUTPUTS), golden (ours vs
    tree_golden.topk_logprobs on row 0), time_s / timing {side}, agree {side}, skipped {side: why},
    best_peer, ours_over_best_peer}. peer: find_flashinfer_topk()'s entry."""
    from .. import golden, kernels
    from .baselines import topk_only
    R = b * positions
    g = torch.Generator(device="cuda").manual_seed(seed + 7919 * b + k)
    xs = [(torch.randn(R, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
          for _ in range(input_sets(R * vocab * 2, lo=2))]
    row = {"batch": b, "positions": positions, "rows": R, "k": k, "vocab": vocab, "dtype": "bfloat16",
           "outputs": dict(TOPK_OUTPUTS), "time_s": {}, "timing": {}, "agree": {}, "skipped": {}}
    ours = [lambda x=x: kernels.topk_logprobs(x, k, check_values=False) for x in xs]
    tok, lp = ours[0]()
    g_tok, g_lp = golden.topk_logprobs(xs[0][:1].float().cpu().numpy(), k)
    row["golden"] = {"tokens_equal": bool((tok[0].cpu().numpy() == g_tok[0]).all()),
                     "max_lp_diff": float(np.abs(lp[0].cpu().numpy() - g_lp[0]).max())}
    if not (row["golden"]["tokens_equal"] and row["golden"]["max_lp_diff"] <= LP_TOL):
        row["skipped"]["ours"] = f"differs from tree_golden.topk_logprobs on row 0: {row['golden']}"
        return row
    row["time_s"]["ours"], row["timing"]["ours"] = timer(ours, repeats)
    sides = {"torch_topk_lse": lambda: [lambda x=x: topk_only(x, k) for x in xs],
             "torch_topk": lambda: [lambda x=x: torch.topk(x, k, dim=-1) for x in xs]}
    if peer.get("available"):
        mask = peer["api"]["top_k_mask_logits"]
        sides["flashinfer_top_k_mask_logits"] = lambda: [lambda x=x: mask(x, k) for x in xs]
    else:
        row["skipped"]["flashinfer_top_k_mask_logits"] = f"not loaded: {peer.get('reason')}"
    run_sides(row, sides, lambda name, out: topk_agreement(xs[0], tok, lp, name, out), repeats, timer)
    return best_peer(row)


def topk_section(peer: dict, cells=TOPK_CELLS, repeats: int = 30, progress: bool = True,
                 config: str = "kimi-k2.6"):
    """`topk_cell` rows for each (batch, k) of `cells` at the config's vocabulary, yielded as measured."""
    from ..config import load_config
    vocab = load_config(config).vocab_size
    todo = list(cells)
    if progress:
        from ..progress import tqdm
        todo = tqdm(todo, desc="peers top-k")
    for b, k in todo:
        yield topk_cell(peer, b, k, repeats, vocab)


# ----------------------------------------------------------------------------- GEMMs
def gemm_agreement(shapes, rows, seed: int = 0) -> dict:
    """{(name, rows): {"cublas": rel diff, "gemv": rel diff}}: F.linear (cuBLAS) and ops.gemv on random bf16
    w [out, in] and x [rows, in] against float32 x @ w.T, for each (name, out, in) of `shapes` and each row
    count of `rows` up to GEMV_MAX_ROWS."""
    import torch.nn.functional as F

    from ..ops.gemv import GEMV_MAX_ROWS, gemv
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    with torch.no_grad():
        for name, n_out, n_in in shapes:
            w = (torch.randn(n_out, n_in, device="cuda", generator=g) / math.sqrt(n_in)).to(torch.bfloat16)
            for r in (r for r in rows if r <= GEMV_MAX_ROWS):
                x = torch.randn(r, n_in, device="cuda", generator=g).to(torch.bfloat16)
                ref = x.float() @ w.float().T
                out[(name, r)] = {"cublas": rel_diff(F.linear(x, w), ref), "gemv": rel_diff(gemv(x, w), ref)}
            del w
    return out


def gemm_section(rows, repeats: int = 30, progress: bool = True) -> list[dict]:
    """bench.decode.gemm_table's rows over K26_GEMMS at `rows` (its timing: CUDA-graph replays, weights
    rotated past L2), each up to GEMV_MAX_ROWS rows with agree {"cublas", "gemv"} (`gemm_agreement`),
    skipped {side: why} where a side is off by more than AGREE, and cublas_over_gemv (cuBLAS time / ours)
    where both agree and were timed."""
    from .decode import K26_GEMMS, gemm_table
    bar = None
    if progress:
        from ..progress import tqdm
        bar = tqdm(total=len(K26_GEMMS) * len(rows), desc="peers gemm")
    try:
        table = gemm_table(rows, K26_GEMMS, repeats, bar=bar)
    finally:
        if bar is not None:
            bar.close()
    agree = gemm_agreement(K26_GEMMS, rows)
    for r in table:
        a = agree.get((r["name"], r["rows"]))
        if a is None:
            continue
        r["agree"] = a
        bad = {k: f"output differs from float32 by {v:.3g} (> {AGREE})" for k, v in a.items()
               if not v <= AGREE}
        if bad:
            r["skipped"] = bad
        elif r.get("time_s") and r.get("gemv_time_s"):
            r["cublas_over_gemv"] = r["time_s"] / r["gemv_time_s"]
    return table


def engine_path(rows: int) -> str:
    """The projection the engine's fused decode runs for `rows` rows: ops.gemv up to fused.GEMV_ROWS rows,
    else cuBLAS."""
    from ..fused import GEMV_ROWS
    return "ops.gemv" if rows <= GEMV_ROWS else "cuBLAS"


def engine_over_cublas(r: dict) -> float | None:
    """cuBLAS time / the time of the engine's own projection (engine_path) in a gemm row: 1.0 where the
    engine runs cuBLAS, cublas_over_gemv where it runs ours; None where that side was not measured."""
    if not r.get("time_s"):
        return None
    return 1.0 if engine_path(r["rows"]) == "cuBLAS" else r.get("cublas_over_gemv")


# ----------------------------------------------------------------------------- the record
def start(rec: dict, **on) -> dict:
    """An empty row list in rec for each section of SECTIONS that `on` does not turn off (moe=False, ...)."""
    for s in SECTIONS:
        if on.get(s, True):
            rec[s] = []
    return rec


def run_sections(rec: dict, peers: dict, save, quick: bool = False, repeats: int = 30,
                 progress: bool = True) -> dict:
    """The sections `start` opened in rec, on a CUDA GPU: each row appended as it is measured, then save()
    (which writes the record). peers: find_peers()'s entries (with their "api"). Returns rec."""
    from . import peers_moe
    if "moe" in rec:
        rec["moe_setup"] = s = peers_moe.setup(quick)
        for row in peers_moe.moe_section(peers["sglang_moe"], s["tokens"], s["routings"], repeats,
                                         s["configs"], progress=progress):
            rec["moe"].append(row)
            save()
    if "topk" in rec:
        for row in topk_section(peers["flashinfer_topk"], QUICK_TOPK_CELLS if quick else TOPK_CELLS, repeats,
                                progress):
            rec["topk"].append(row)
            save()
    if "gemm" in rec:
        from .decode import GEMM_ROWS, QUICK_ROWS
        rec["gemm"] = gemm_section(QUICK_ROWS if quick else GEMM_ROWS, repeats, progress)
        save()
    return rec


def build_targets(rec: dict) -> list[dict]:
    """The sections' targets: peers_moe_vs_sglang per MoE row, peers_topk_vs_best per top-k row, and per
    matrix (the worst over its row counts) peers_gemm_engine_vs_cublas and peers_gemm_vs_cublas (info);
    rows without a measured ratio give none."""
    from .peers_moe import moe_targets
    out = moe_targets(rec.get("moe", []))
    for r in rec.get("topk", []):
        if "ours_over_best_peer" in r:
            out.append(goals.target("peers_topk_vs_best", r["ours_over_best_peer"], k=r["k"],
                                    vocab=r["vocab"], batch=r["batch"], positions=r["positions"],
                                    peer=r["best_peer"]))
    worst, engine = {}, {}
    for r in rec.get("gemm", []):
        if "cublas_over_gemv" in r and (r["name"] not in worst
                                        or r["cublas_over_gemv"] < worst[r["name"]]["cublas_over_gemv"]):
            worst[r["name"]] = r
        ratio = engine_over_cublas(r)
        if ratio is not None and (r["name"] not in engine or ratio < engine[r["name"]][0]):
            engine[r["name"]] = (ratio, r)
    for name, r in worst.items():
        out.append(goals.target("peers_gemm_vs_cublas", r["cublas_over_gemv"], matrix=name,
                                shape=f"{r['out']} x {r['in']}", rows=r["rows"]))
    for name, (ratio, r) in engine.items():
        out.append(goals.target("peers_gemm_engine_vs_cublas", ratio, matrix=name,
                                shape=f"{r['out']} x {r['in']}", rows=r["rows"], path=engine_path(r["rows"])))
    return out


def format_sections(rec: dict) -> str:
    """The sections' rows as plain text (what the command prints)."""
    from .peers_moe import format_moe
    lines = [format_moe(rec["moe"])] if rec.get("moe") else []
    if rec.get("topk"):
        lines.append(f"{'top-k b':>8}{'k':>6}{'ours us':>9}  peers (us), skipped")
        for r in rec["topk"]:
            t = r["time_s"]
            ours = f"{t['ours'] * 1e6:9.1f}" if "ours" in t else f"{'-':>9}"
            others = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in t.items() if k != "ours")
            skips = "; ".join(f"{k}: {v[:60]}" for k, v in r["skipped"].items())
            lines.append(f"{r['batch']:>8}{r['k']:>6}{ours}  {others}" + (f"  [{skips}]" if skips else ""))
    if rec.get("gemm"):
        lines.append(f"{'gemm':<16}{'rows':>5}{'cuBLAS us':>10}{'ours us':>9}")
        for r in rec["gemm"]:
            t = "-" if r.get("time_s") is None else f"{r['time_s'] * 1e6:.1f}"
            o = f"{r['gemv_time_s'] * 1e6:.1f}" if r.get("gemv_time_s") else "-"
            skip = f"  [{'; '.join(r['skipped'].values())[:80]}]" if r.get("skipped") else ""
            lines.append(f"{r['name']:<16}{r['rows']:>5}{t:>10}{o:>9}{skip}")
    return "\n".join(lines)


def add_arguments(ap) -> None:
    """--no-attention and one --no-<section> flag a section of SECTIONS."""
    for name, what in (("attention", "the MLA attention cells"), ("moe", "the INT4 MoE section (SGLang)"),
                       ("topk", "the top-k section (torch, FlashInfer)"), ("gemm", "the bf16 GEMM section")):
        ap.add_argument(f"--no-{name}", action="store_true", help=f"leave out {what}")


def chosen(a) -> dict:
    """{"attention": bool, "moe": ..., "topk": ..., "gemm": ...} from `add_arguments`' flags."""
    return {s: not getattr(a, f"no_{s}") for s in ("attention",) + SECTIONS}
