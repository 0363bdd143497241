"""Our MLA attention beside the field's, same inputs, one run: python -m kdtree.bench.peers [--out DIR].

Peers are found where a user installed them (the `peers` extra; on the device, wheels as for papermill) and
never installed here; one that is absent or fails to load is skipped with its reason in the record:
  flashinfer  flashinfer-python's BatchMLAPagedAttentionWrapper (backends fa3, fa2) and merge_state
  sglang      SGLang's Triton kernels, loaded by path from the installed wheel's
              sglang/kernels/ops/attention/ (verify_mla: chain verify; extend_attention: a custom mask)
              under stub modules for its runtime utilities (sglang/__init__ and the server never load)

Cells (`CELLS`: heads, context, nodes N, batch, mask): decode N = 1 at batch 1 / 8 / 32, chains N = 8 / 16
(causal), DDTree trees N = 16 / 64 / 128, at 64 heads (one GPU) and 8 (a TP-8 rank), contexts 4K and 32K.
Every side reads the same random latent cache, each in its own layout (ours: pages of 64 rows of 576;
FlashInfer: split ckv / kpe pages; SGLang: token slots), rotated past L2; times are CUDA-event medians of
queued eager calls. A peer's time counts only where its output agrees with ours (max |diff| / max |ours| <=
AGREE) and ours with the float64 golden twin on request 0 (contexts up to GOLDEN_MAX_KEYS). Trees also get
"cascade": FlashInfer non-causal over the prefix, ours over the block's pages only, merged by merge_state.
Every cell where FlashInfer loads also gets "split": the engine's own prefix_attn="flashinfer" path
(ops.flashinfer_prefix over the context, verify_attn over the block with its mask, ops.attn_merge), the
path a user turns on where it beats "ours", the engine's default.

Then the engine's AR at batch 1 on the trained target, graphed and with compile=True, against transformers'
compiled static-cache generate (same checkpoint, bf16, tokens compared; `ar_section`).

Then the sections of bench.peers_sections (each optional: --no-moe, --no-topk, --no-gemm; --no-attention
leaves out the cells above): INT4 routed experts against SGLang's Triton fused MoE (bench.peers_moe), the
draft's per-position top-k against torch and FlashInfer, bf16 GEMMs (bench.decode.gemm_table: cuBLAS, ours).

Record `peers.json`: device, versions, the peers found or skipped, one row per cell ({side: seconds},
{side: agreement}, FlashInfer's plan() host seconds), the AR section, `flashinfer_in_engine` (what taking
FlashInfer whole for the engine's non-tree rounds, or the split for any round, would gain and cost), the
sections' rows ("moe", "topk", "gemm") and `targets` (ours and the split against the best peer; a tree's
fused kernel against the cascade; the engine's AR against transformers' compiled generate; each section's
family).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import torch

from . import goals
from .peers_common import AGREE, QUEUE_CYCLES, SGLANG_FILES, rel_diff  # noqa: F401  (re-exported)
from .peers_common import clear_cuda_error as _clear_cuda_error
from .peers_common import flashinfer_in_engine, format_in_engine  # noqa: F401  (re-exported)
from .peers_common import sglang_stubs as _sglang_stubs
from .peers_common import version as _version
from . import peers_sides as ps
from .timer import measure

GOLDEN_MAX_KEYS = 8448     # ours is checked against the float64 twin on request 0 up to this many keys
SCALE = 0.1352             # softmax scale of the random inputs (1 / sqrt(192) x YaRN's mscale, K2.6-like)
CELLS = tuple((H, ctx, N, b, kind) for H in (64, 8) for ctx in (4096, 32768) for N, b, kind in (
    (1, 1, "decode"), (1, 8, "decode"), (1, 32, "decode"), (8, 1, "chain"), (16, 1, "chain"),
    (16, 1, "tree"), (64, 1, "tree"), (128, 1, "tree")))
QUICK_CELLS = ((64, 4096, 1, 1, "decode"), (64, 4096, 1, 8, "decode"), (64, 4096, 16, 1, "chain"),
               (64, 4096, 64, 1, "tree"))


# ----------------------------------------------------------------------------- finding the peers
def find_peers() -> dict:
    """{name: {"available", "version", "reason"?, "api"?}}: each peer loaded (its entry points in "api", not
    serialized) or the reason it is not."""
    out = {}
    fi = {"version": _version("flashinfer-python")}
    try:
        import flashinfer
        fi.update(available=True, api={"mla": flashinfer.mla.BatchMLAPagedAttentionWrapper,
                                       "merge_state": flashinfer.merge_state})
    except Exception as e:  # absent, or present without what it needs (a dependency, a compiler)
        fi.update(available=False, reason=f"{type(e).__name__}: {e}"[:300])
    out["flashinfer"] = fi
    sg = {"version": _version("sglang")}
    try:
        if importlib.util.find_spec("sglang") is None:
            raise ImportError("sglang is not installed (pip install sglang==0.5.23 --no-deps)")
        import triton  # noqa: F401  (the kernels are Triton's)
        _sglang_stubs()
        base = "sglang.kernels.ops.attention."
        vm = importlib.import_module(base + "verify_mla")
        ea = importlib.import_module(base + "extend_attention")
        sg.update(available=True, api={"verify": vm.verify_shared_kv_fwd, "extend": ea.extend_attention_fwd})
    except Exception as e:
        sg.update(available=False, reason=f"{type(e).__name__}: {e}"[:300])
    out["sglang"] = sg
    return out


# ----------------------------------------------------------------------------- a cell, the run
def _golden_ok(x, out, ctx, N, scale) -> float:
    from ..ops.verify_attn_golden import mla_tree_attention
    c = x["caches"][0][: ctx + N].double().cpu().numpy()
    q = x["q"][0].double().cpu().numpy()
    ref, _ = mla_tree_attention(q[..., :512], q[..., 512:], c[:, :512], c[:, 512:],
                                x["mask"][0].cpu().numpy(), scale)
    return rel_diff(out[0].float(), torch.from_numpy(ref).to(out.device))


def run_cell(peers: dict, H: int, ctx: int, N: int, b: int, kind: str, repeats: int = 30) -> dict:
    """One cell: {heads, context, nodes, batch, kind, time_s {side: s}, agree {side: rel diff}, skipped
    {side: reason}, golden (ours vs the twin, request 0), best_peer, ours_over_best_peer}."""
    x = ps.cell_inputs(H, ctx, N, b, kind)
    row = {"heads": H, "context": ctx, "nodes": N, "batch": b, "kind": kind, "time_s": {}, "agree": {},
           "skipped": {}}
    ours = ps.ours(x, SCALE)
    ref = ours[0]().reshape(b * N, H, 512)
    small = ctx + N <= GOLDEN_MAX_KEYS
    row["golden"] = _golden_ok(x, ref.view(b, N, H, 512), ctx, N, SCALE) if small else None
    row["time_s"]["ours"] = measure(ours, repeats, queued=True, queue_cycles=QUEUE_CYCLES).median
    sides, plans = {}, {}
    if peers["flashinfer"]["available"]:
        api = peers["flashinfer"]["api"]
        if kind != "tree":
            for backend in ("fa3", "fa2"):
                sides[f"flashinfer_{backend}"] = lambda be=backend: [
                    (lambda f=f: f()[0]) for f in ps.flashinfer(
                        api, x, H, ctx, N, b, be, SCALE, plan_s=plans.setdefault(f"flashinfer_{be}", []))]
            # fa3 reading our pool in place: whether an engine could hand it the pages it already has
            sides["flashinfer_fa3_pool"] = lambda: [
                (lambda f=f: f()[0]) for f in ps.flashinfer(
                    api, x, H, ctx, N, b, "fa3", SCALE, views=True,
                    plan_s=plans.setdefault("flashinfer_fa3_pool", []))]
        else:
            sides["cascade"] = lambda: ps.cascade(api, x, H, ctx, N, b, SCALE)
        sides["split"] = lambda: ps.split(x, H, ctx, N, b, SCALE)
    if peers["sglang"]["available"]:
        sides["sglang"] = lambda: ps.sglang(peers["sglang"]["api"], x, H, ctx, N, b, SCALE, kind == "tree")
    for name, make in sides.items():
        try:
            calls = make()
            d = rel_diff(calls[0]().reshape(b * N, H, 512), ref)
            row["agree"][name] = d
            if not d <= AGREE:
                row["skipped"][name] = f"output differs from ours by {d:.3g} (> {AGREE})"
                continue
            row["time_s"][name] = measure(calls, repeats, queued=True, queue_cycles=QUEUE_CYCLES).median
        except Exception as e:  # a peer that cannot take the shape: the cell says why
            row["skipped"][name] = f"{type(e).__name__}: {e}"[:300]
            _clear_cuda_error()
    # host seconds of the plan() each FlashInfer round needs first (with the round's lengths on the host)
    row["plan_s"] = {k: v[0] for k, v in plans.items() if v and k in row["time_s"]}
    peer_t = {k: v for k, v in row["time_s"].items() if k not in ps.OURS_SIDES}
    if peer_t:
        best = min(peer_t, key=peer_t.get)
        row["best_peer"], row["ours_over_best_peer"] = best, peer_t[best] / row["time_s"]["ours"]
    if "cascade" in row["time_s"]:
        row["ours_over_cascade"] = row["time_s"]["cascade"] / row["time_s"]["ours"]
    if "split" in row["time_s"]:   # the engine's prefix_attn="flashinfer" path against its default ("off")
        row["split_over_ours"] = row["time_s"]["ours"] / row["time_s"]["split"]
        if peer_t:
            row["split_over_best_peer"] = peer_t[row["best_peer"]] / row["time_s"]["split"]
    x = None
    torch.cuda.empty_cache()
    return row


def ar_section(ckpt: str = "data/trained", n_prompts: int = 4, prompt_len: int = 64,
               max_new: int = 64) -> dict:
    """The engine's AR at batch 1 (graphed, bf16) on the trained target against transformers' compiled
    static-cache generate on the same checkpoint and dtype: {engine (graphed rounds), engine_compiled (the
    same with compile=True: its regions through torch.compile, then graphed), hf_compiled (tok/s, wall),
    tokens_equal / compiled_tokens_equal (each engine's tokens against transformers'), best ("graphs" or
    "compiled", the faster engine), engine_over_hf_compiled (the best engine's tok/s over transformers')},
    the graphed engine's rounds without overlap ("engine_serial") and the round wall time the overlap saves
    ("overlap_gain_s"); {"skipped": why} where transformers is absent."""
    from .. import weights
    from ..data import heldout_prompts
    from ..engine import Engine
    from .baselines import hf_generate
    from .serve import run_engine, serial
    try:
        import transformers
    except ImportError as e:
        return {"skipped": f"transformers is not installed ({e})"}
    prompts = heldout_prompts(n_prompts, prompt_len)
    target = weights.load(Path(ckpt) / "target", device="cuda", dtype=torch.bfloat16).eval()
    max_len = 1 << math.ceil(math.log2(prompt_len + max_new + 2))
    keys = ("tok_per_s", "tokens", "round_wall_median_s", "round_gpu_span_median_s")
    runs = {}
    for name, compile in (("graphs", False), ("compiled", True)):
        e = Engine(target, mode="ar", max_batch=1, max_len=max_len, graph_sampling=False, compile=compile)
        run_engine(e, prompts[:1], 8)          # warm-up (the compiled regions compile here)
        runs[name] = run_engine(e, prompts, max_new)
        if name == "graphs":
            ser = serial(e, prompts, max_new, runs[name]["outputs"])   # rounds that land before the next
        del e
    del target
    torch.cuda.empty_cache()
    hf = hf_generate(Path(ckpt) / "target", torch.bfloat16, prompts, max_new, compiled=True)
    eng, comp = runs["graphs"], runs["compiled"]
    best = "compiled" if comp["tok_per_s"] > eng["tok_per_s"] else "graphs"
    rec = {"checkpoint": str(ckpt), "transformers": transformers.__version__, "prompts": n_prompts,
           "prompt_len": prompt_len, "max_new_tokens": max_new,
           "engine": {k: eng.get(k) for k in keys},
           "engine_compiled": {k: comp.get(k) for k in keys},
           "engine_serial": ser,
           "overlap_gain_s": ser["round_wall_median_s"] - eng["round_wall_median_s"],
           "hf_compiled": {k: v for k, v in hf.items() if k != "outputs"},
           "tokens_equal": hf["outputs"] == eng["outputs"],
           "compiled_tokens_equal": hf["outputs"] == comp["outputs"],
           "best": best}
    rec["engine_over_hf_compiled"] = runs[best]["tok_per_s"] / hf["tok_per_s"]
    return rec


def build_targets(rows: list[dict], ar: dict | None = None) -> list[dict]:
    out = []
    if ar and "engine_over_hf_compiled" in ar:
        out.append(goals.target("peers_ar_vs_hf_compiled", ar["engine_over_hf_compiled"]))
    for r in rows:
        where = {"heads": r["heads"], "context": r["context"], "nodes": r["nodes"], "batch": r["batch"],
                 "kind": r["kind"]}
        if "ours_over_best_peer" in r:
            out.append(goals.target("peers_attention_vs_best", r["ours_over_best_peer"],
                                    peer=r["best_peer"], **where))
        if "ours_over_cascade" in r:
            out.append(goals.target("peers_tree_vs_cascade", r["ours_over_cascade"], **where))
        if "split_over_best_peer" in r:
            out.append(goals.target("peers_split_vs_best", r["split_over_best_peer"], peer=r["best_peer"],
                                    **where))
    return out


def run(out: Path, quick: bool = False, repeats: int = 30, cells=None, progress: bool = True,
        ar: bool = True, attention: bool = True, **sections) -> dict:
    """Every attention cell (where attention) into out/peers.json, then the AR section (`ar_section`) where
    ar, then the sections of bench.peers_sections that `sections` (moe=, topk=, gemm=; default on) leaves
    on; the record is written after each row, its targets recomputed; returns it. On a machine without a
    CUDA GPU the record holds only the peers found and says why nothing ran."""
    from . import peers_sections
    out = Path(out)
    peers = {**find_peers(), **peers_sections.find_peers()}
    rec = {"bench": "peers", "torch": torch.__version__, "quick": quick, "agree_tolerance": AGREE,
           "peers": {k: {kk: vv for kk, vv in v.items() if kk != "api"} for k, v in peers.items()},
           "attention": [], "targets": []}
    peers_sections.start(rec, **sections)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "peers.json"

    def save():
        rec["flashinfer_in_engine"] = flashinfer_in_engine(rec["attention"], rec.get("ar"))
        rec["targets"] = build_targets(rec["attention"], rec.get("ar")) + peers_sections.build_targets(rec)
        path.write_text(json.dumps(rec, indent=1) + "\n")
    if not torch.cuda.is_available():
        rec["skipped"] = "no CUDA GPU on this machine: no cell ran"
        save()
        return rec
    rec["device"] = torch.cuda.get_device_name()
    todo = list(cells or (QUICK_CELLS if quick else CELLS)) if attention else []
    if progress and todo:
        from ..progress import tqdm
        todo = tqdm(todo, desc="peers")
    for cell in todo:
        rec["attention"].append(run_cell(peers, *cell, repeats=repeats))
        save()
    if ar:
        rec["ar"] = ar_section(n_prompts=2 if quick else 4, max_new=32 if quick else 64)
        save()
    return peers_sections.run_sections(rec, peers, save, quick, repeats, progress)


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'H':>3}{'ctx':>7}{'N':>5}{'b':>4} {'kind':<7}{'ours us':>9}  peers (us), skipped"]
    for r in rows:
        t = r["time_s"]
        others = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in t.items() if k != "ours")
        skips = "; ".join(f"{k}: {v[:60]}" for k, v in r["skipped"].items())
        lines.append(f"{r['heads']:>3}{r['context']:>7}{r['nodes']:>5}{r['batch']:>4} {r['kind']:<7}"
                     f"{t['ours'] * 1e6:9.1f}  {others}" + (f"  [{skips}]" if skips else ""))
    return "\n".join(lines)


KINDS = ("decode", "chain", "tree")


def parse_cell(text: str) -> tuple:
    """'H:ctx:N:b:kind' -> (heads, context, nodes, batch, kind): context a positive multiple of 64, decode
    cells one node, the rest at least two; ValueError naming what is wrong."""
    parts = text.split(":")
    if len(parts) != 5:
        raise ValueError(f"--cells {text!r}: expected heads:context:nodes:batch:kind, e.g. "
                         "64:32768:16:1:chain")
    *nums, kind = parts
    try:
        H, ctx, N, b = (int(x) for x in nums)
    except ValueError:
        raise ValueError(f"--cells {text!r}: heads, context, nodes and batch must be ints") from None
    if kind not in KINDS:
        raise ValueError(f"--cells {text!r}: kind {kind!r}, expected one of {KINDS}")
    if min(H, ctx, N, b) < 1 or ctx % 64:
        raise ValueError(f"--cells {text!r}: expected positive ints and a context that is a multiple of 64")
    if (kind == "decode") != (N == 1):
        raise ValueError(f"--cells {text!r}: a decode cell has 1 node, a chain or a tree at least 2")
    return H, ctx, N, b, kind


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m kdtree.bench.peers",
                                 description="our MLA attention beside FlashInfer's, SGLang's (peers.json)")
    ap.add_argument("--out", default=None, help="record folder (default: outputs/<gpu>/, outputs/cpu/)")
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK_CELLS)} cells instead of {len(CELLS)}")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls a side (median)")
    ap.add_argument("--no-ar", action="store_true", help="leave out the AR section (engine vs transformers)")
    ap.add_argument("--cells", nargs="+", default=None, metavar="H:CTX:N:B:KIND",
                    help="these attention cells instead of the default list (kind: decode, chain or tree)")
    from . import peers_sections
    peers_sections.add_arguments(ap)
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: expected a positive int")
    on = peers_sections.chosen(a)
    cells = None
    if a.cells is not None:
        try:
            cells = [parse_cell(c) for c in a.cells]
        except ValueError as e:
            ap.error(str(e))
        if a.quick or not on["attention"]:
            ap.error("--cells: choose the attention cells without --quick or --no-attention")
    if a.no_ar and not any(on.values()):
        ap.error("every section is left out (--no-ar, " + ", ".join(f"--no-{s}" for s in on)
                 + "): nothing to run")
    from ..lab import output_dir, record_dir_or_exit
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = record_dir_or_exit(a.out, dev, "python -m kdtree.bench.peers") if a.out else output_dir(dev)
    rec = run(out, quick=a.quick, repeats=a.repeats, cells=cells, ar=not a.no_ar, **on)
    for name, p in rec["peers"].items():
        print(f"{name} {p.get('version')}: " + ("found" if p["available"] else f"skipped ({p['reason']})"))
    if rec.get("skipped"):
        print(rec["skipped"])
    else:
        att = format_rows(rec["attention"]) if rec["attention"] else ""
        eng = format_in_engine(rec.get("flashinfer_in_engine") or [])
        print("\n".join(p for p in (att, eng, peers_sections.format_sections(rec)) if p))
        if "engine_over_hf_compiled" in rec.get("ar", {}):
            a_ = rec["ar"]
            eng, comp, hf = a_["engine"], a_["engine_compiled"], a_["hf_compiled"]
            print(f"AR b1: engine {eng['tok_per_s']:.1f} tok/s (tokens equal: {a_['tokens_equal']}), "
                  f"compiled {comp['tok_per_s']:.1f} (tokens equal: {a_['compiled_tokens_equal']}), "
                  f"transformers compiled {hf['tok_per_s']:.1f}")
        for t in rec["targets"]:
            print(goals.line(t))
    print(out / "peers.json")
    return rec


if __name__ == "__main__":
    main()
