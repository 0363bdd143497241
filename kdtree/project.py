"""Per-user decode speed at a real model's scale, projected from single-GPU measurements.

Notebook 01 measures, at K2.6 dimensions on one GPU, one decoder layer's verify time against the number of
rows N (dense layer 0 and an INT4 MoE layer; `layer_verify`), the GPU tree round (`tree_round`) and the walk +
KV compaction (`walk_compact`). Acceptance (tau: tokens emitted per round) comes from a real drafter/target
pair (notebook 03's trained pair, or any measured tau). A round at batch b and context C then costs

    draft    drafter_layers x the dense layer's time at N = block_size rows (a DFlash drafter layer is a
             dense decoder layer over the block; the layer-0 time stands in for it) + one lm_head pass
    build    the GPU tree round at (b, budget)                                       (DDTree only)
    verify   n_dense dense layers + (n_layers - n_dense) MoE layers at N rows, + the lm_head over N rows
    walk     tree walk + KV compaction at (b, budget)                                (DDTree only)

with N = 1 for AR, block_size for the DFlash chain, budget + 1 for DDTree; lm_head time is its floor,
max(weight bytes / copy bandwidth, 2 N b V D / matmul rate), both ceilings from the same record. Layer times
between measured node counts (and tree/walk times between measured budgets) are interpolated log-log; up to
twice the largest measured count they are extrapolated along the last segment and the row says so
(`extrapolated`); further out, or below the smallest, a row is not projected. per-user tok/s = tau / round
time. Everything is one GPU's time for the whole model: what a tensor-parallel run divides (and adds
communication to) is not measured here (`python -m kdtree tp` checks sharded correctness only).

    rec = json.load(open("outputs/h200/microbench_k26.json"))
    rows = project(rec, {"ar": 1.0, "dflash": 1.5, "ddtree": {64: 2.1, 256: 2.3}}, batch=1, context=4096)

Acceptance profiles (`profile_taus`): tau per budget of an idealised drafter whose every depth puts the
target's token at rank 0 with probability p (solved from the chain's tau) and at rank j >= 1 with probability
(1 - p)(1 - r) r^(j-1), independently across depths, and whose own probabilities are exactly these
(calibrated). DDTree's tree is then the B most probable prefixes and its expected tokens per round is 1 + the
sum of their probabilities: what a drafter of a published chain tau (Kimi-K2.5-DFlash: about 4.5-5.5) could
give a tree.
"""
from __future__ import annotations

import math

import numpy as np

MODES = ("ar", "dflash", "ddtree")


def _pick(rows, **match):
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


EXTRAPOLATE = 2.0  # beyond the largest measured x, log-log extrapolation up to this factor (rows say so)


def loglog(pts, x: float) -> tuple[float | None, bool]:
    """(y at x, extrapolated?) from measured points [(x, y), ...] (x > 0, y > 0), log-log linear between
    neighbours; past the largest x up to EXTRAPOLATE times it along the last segment; else (None, False).
    Repeated measurements of one x count as their geometric mean."""
    by_x: dict = {}
    for px, py in pts:
        if not (math.isfinite(px) and math.isfinite(py) and px > 0 and py > 0):
            raise ValueError(f"loglog: expected points with finite x > 0 and y > 0, got ({px!r}, {py!r})")
        by_x.setdefault(px, []).append(math.log(py))
    pts = sorted((px, math.exp(sum(v) / len(v))) for px, v in by_x.items())
    if not pts or x < pts[0][0] or x > pts[-1][0] * EXTRAPOLATE:
        return None, False
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0))), False
    if x == pts[-1][0]:
        return pts[-1][1], False
    if len(pts) < 2:
        return None, False
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    f = math.log(x / x0) / math.log(x1 / x0)
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0))), True


def layer_time(layer_rows, kind: str, context: int, batch: int, nodes: int) -> tuple[float | None, bool]:
    """One layer's verify time (s) at `nodes` rows for (kind, context, batch), by `loglog` over the measured
    node counts: (seconds or None, extrapolated?)."""
    return loglog([(r["nodes"], r["time_s"])
                   for r in _pick(layer_rows, kind=kind, context=context, batch=batch)], nodes)


def head_time(ceilings: dict, vocab: int, hidden: int, rows: int) -> float:
    """lm_head floor (s) for `rows` output rows: bf16 weight bytes over the copy bandwidth, or the matmul
    FLOPs over the bf16 matmul rate, whichever is larger."""
    return max(2 * vocab * hidden / ceilings["copy_bandwidth_Bps"],
               2 * rows * vocab * hidden / ceilings["bf16_matmul_flops"])


def routed_kernel(rec: dict, context: int, batch: int, nodes: int) -> tuple[float, float, str]:
    """The routed experts inside the recorded MoE layer time at (context, batch, nodes) under its random
    routing: (kernel seconds, experts touched, source). Source "layer": the layer rows' own `moe_kernel_s`
    and `experts_touched` (`bench.layer.routed`) by `loglog` over nodes, with `layer_time`'s reach; else
    "moe_int4": that separate bench's at batch x nodes tokens, clamped to its range (records from before the
    layer rows carried them; its own random rows and the pair grouping in its time make it differ from the
    layer's own). ValueError where neither has them."""
    own = [r for r in _pick(rec.get("layer_verify", []), kind="moe", context=context, batch=batch)
           if r.get("moe_kernel_s") and r.get("experts_touched")]
    if own:
        k, _ = loglog([(r["nodes"], r["moe_kernel_s"]) for r in own], nodes)
        u, _ = loglog([(r["nodes"], r["experts_touched"]) for r in own], nodes)
        if k is not None and u is not None:
            return k, u, "layer"
    rows = sorted((r["tokens"], r["kernel_s"], r["experts_touched"]) for r in rec.get("moe_int4", []))
    if not rows:
        raise ValueError(f"rec: no routed-kernel time for context={context}, batch={batch}, "
                         f"nodes={nodes} (the layer rows' moe_kernel_s) and rec['moe_int4'] is empty")
    x = min(max(batch * nodes, rows[0][0]), rows[-1][0])
    return (loglog([(t, k) for t, k, _ in rows], x)[0], loglog([(t, u) for t, _, u in rows], x)[0],
            "moe_int4")


def routing_correction(rec: dict, kernel_s: float, context: int, batch: int, nodes: int) -> float:
    """Seconds to add to one MoE layer's recorded verify time (random routing over batch x nodes rows) when
    the routed experts' kernel took `kernel_s` on the round's own routing (measured: a real tree's siblings
    share experts, so fewer are read, by more tokens each): kernel_s less the routed kernel's time inside the
    recorded layer time (`routed_kernel`)."""
    return float(kernel_s) - routed_kernel(rec, context, batch, nodes)[0]


def round_parts(rec: dict, mode: str, batch: int, context: int, budget: int | None = None,
                block_size: int = 16, drafter_layers: int = 6, n_layers: int = 61, n_dense: int = 1,
                vocab: int = 163840, hidden: int = 7168, draft_s: float | None = None,
                moe_kernel_s: float | None = None, commit_s: float | None = None) -> dict | None:
    """Seconds per round by part ({draft, build, verify, walk, commit}, plus extrapolated: bool) for one mode;
    None where a needed measurement is missing (node count or budget outside what `loglog` reaches, batch not
    in the record). Tree round and walk times are interpolated over the measured budgets likewise (below the
    smallest measured budget, that budget's time: an upper bound). draft_s: the drafter's measured seconds a
    round (else modelled as drafter_layers dense layers + the head). commit_s: the drafter's measured context
    update a round (the accepted rows' features into its K/V; measured only: 0 where not given, and for AR).
    moe_kernel_s: the routed experts' kernel seconds per MoE layer on the engine's own routing
    (`routing_correction`; else the record's random routing)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    if mode == "ddtree" and (not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"budget={budget!r}: expected a positive int for mode 'ddtree'")
    layers, ceil = rec["layer_verify"], rec["ceilings"]
    if not ceil:
        raise ValueError("rec['ceilings'] is empty: project from a GPU record (copy bandwidth and matmul "
                         "rate)")
    N = {"ar": 1, "dflash": block_size, "ddtree": (budget or 0) + 1}[mode]
    (dense, x1), (moe, x2) = (layer_time(layers, k, context, batch, N) for k in ("dense", "moe"))
    if dense is None or moe is None:
        return None
    if moe_kernel_s is not None:
        moe += routing_correction(rec, moe_kernel_s, context, batch, N)
    parts = {"draft": 0.0, "build": 0.0, "verify": n_dense * dense + (n_layers - n_dense) * moe
             + head_time(ceil, vocab, hidden, N * batch), "walk": 0.0,
             "commit": 0.0 if mode == "ar" or commit_s is None else float(commit_s)}
    extrapolated = x1 or x2
    if mode != "ar":
        d, x3 = layer_time(layers, "dense", context, batch, block_size)
        if d is None:
            return None
        parts["draft"] = (drafter_layers * d + head_time(ceil, vocab, hidden, (block_size - 1) * batch)
                          if draft_s is None else float(draft_s))
        extrapolated |= x3 and draft_s is None
    if mode == "ddtree":
        tree = [(r["budget"], r["gpu_graph_s"]) for r in _pick(rec["tree_round"], batch=batch)
                if r.get("gpu_graph_s")]
        walk = [(r["budget"], r["time_s"]) for r in _pick(rec.get("walk_compact", []), batch=batch)]
        if not tree or not walk:
            return None
        # below the smallest measured budget: the smallest measured one's time (an upper bound)
        build, x4 = loglog(tree, max(budget, min(b for b, _ in tree)))
        w, x5 = loglog(walk, max(budget, min(b for b, _ in walk)))
        if build is None:
            return None
        if w is None:
            return None
        parts["build"], parts["walk"] = build, w
        extrapolated |= x4 or x5
    parts["extrapolated"] = bool(extrapolated)
    return parts


def project(rec: dict, taus: dict, batch: int, context: int, **kw) -> list[dict]:
    """Rows {mode, budget, tau, round_s, parts, tok_per_s, speedup_vs_ar, tau_to_match_ar, extrapolated} for
    AR, the DFlash chain and DDTree at each budget of taus["ddtree"] ({budget: tau}); taus["dflash"] the
    chain's tau. Budgets that cannot be projected (see round_parts) are left out. kw: round_parts' block_size,
    drafter_layers, n_layers, ..."""
    out = []
    cases = [("ar", None, 1.0)] + ([("dflash", None, taus["dflash"])] if "dflash" in taus else []) + \
        [("ddtree", int(B), t) for B, t in sorted(taus.get("ddtree", {}).items())]
    for mode, B, tau in cases:
        if not (isinstance(tau, (int, float)) and tau >= 1):
            raise ValueError(f"tau of {mode} {B or ''}: expected a number >= 1 (tokens per round), got "
                             f"{tau!r}")
        parts = round_parts(rec, mode, batch, context, B, **kw)
        if parts is None:
            continue
        ext = parts.pop("extrapolated")
        t = sum(parts.values())
        out.append({"mode": mode, "budget": B, "batch": batch, "context": context, "tau": float(tau),
                    "round_s": t, "parts": parts, "tok_per_s": tau / t, "extrapolated": ext})
    ar = next((r for r in out if r["mode"] == "ar"), None)
    for r in out:  # tau_to_match_ar: the tokens per round at which this mode's round pays for itself
        r["speedup_vs_ar"] = r["tok_per_s"] / ar["tok_per_s"] if ar else None
        r["tau_to_match_ar"] = r["round_s"] / ar["round_s"] if ar else None
    return out


# ----------------------------------------------------------------------------- acceptance profiles
def chain_top1(tau_chain: float, depth: int) -> float:
    """p with 1 + p + p^2 + ... + p^depth = tau_chain (the chain's expected tokens per round when each depth's
    argmax is the target's token with probability p, independently)."""
    if not (isinstance(depth, int) and depth >= 1):
        raise ValueError(f"depth={depth!r}: expected a positive int")
    if not (1.0 <= tau_chain < depth + 1):
        raise ValueError(f"tau_chain={tau_chain!r}: expected in [1, {depth + 1}) for depth {depth}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        p = (lo + hi) / 2
        if sum(p ** d for d in range(depth + 1)) < tau_chain:
            lo = p
        else:
            hi = p
    return (lo + hi) / 2


def profile_rank_probs(p_top: float, ratio: float, K: int) -> np.ndarray:
    """[K]: probability that the target's token is the drafter's rank-j token (p_top at rank 0, then
    (1 - p_top)(1 - ratio) ratio^(j - 1)); the mass beyond rank K - 1 is left out."""
    if not (0 < p_top < 1 and 0 <= ratio < 1 and K >= 1):
        raise ValueError(f"expected 0 < p_top < 1, 0 <= ratio < 1, K >= 1; got {p_top}, {ratio}, {K}")
    j = np.arange(K)
    return np.where(j == 0, p_top, (1 - p_top) * (1 - ratio) * ratio ** np.maximum(j - 1, 0))


def profile_taus(tau_chain: float, budgets, depth: int = 15, ratio: float = 0.5) -> dict[int, float]:
    """{budget: expected tokens per DDTree round} for the calibrated profile whose chain has tau_chain (see
    the module doc): 1 + the summed probability of the tree's nodes, the tree built by golden.build_tree."""
    from . import golden
    p = chain_top1(tau_chain, depth)
    out = {}
    for B in budgets:
        K = int(B)
        # a calibrated drafter ranks its tokens by their probability: below a chain tau of about 2 - ratio
        # the profile's rank 1 outweighs its rank 0, so the list is sorted as that drafter would rank it
        q = np.sort(profile_rank_probs(p, ratio, K))[::-1]
        keep = q > 0
        lp = np.full((depth, K), -np.inf, dtype=np.float32)
        lp[:, keep] = np.log(q[keep]).astype(np.float32)
        tt = np.tile(np.arange(K, dtype=np.int32), (depth, 1))
        tree = golden.build_tree(tt, lp, K)
        out[K] = 1.0 + float(np.exp(tree.scores.astype(np.float64)).sum())
    return out


def _rows(c: dict) -> int:
    """Verify rows per request of an engine cell."""
    return {"ar": 1, "dflash": c.get("block") or 16}.get(c["mode"], (c.get("budget") or 0) + 1)


def fit_moe_kernel(cells, top_k: int = 8) -> tuple[float, float] | None:
    """The routed experts' kernel seconds per MoE layer as alpha * experts touched + beta * (token, expert)
    pairs, least squares on the relative error over the engine cells that measured it on their own routing
    (moe_kernel_s and experts_touched; pairs = verify rows x batch x top_k): alpha the price of reading one
    expert, beta of one pair's arithmetic. (alpha, beta), or None under two such cells or a fit that is not
    positive."""
    pts = [(c["experts_touched"], _rows(c) * c["batch"] * top_k, c["moe_kernel_s"]) for c in cells
           if not c.get("error") and c.get("budget") != "auto" and c.get("moe_kernel_s")
           and c.get("experts_touched")]
    if len(pts) < 2:
        return None
    A = np.array([[t / k, p / k] for t, p, k in pts])
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones(len(pts)), rcond=None)
    return (float(alpha), float(beta)) if alpha > 0 and beta > 0 else None


def check_engine(rec: dict, cells, tolerance: float = 0.10, full_layers: int = 61, routing: bool = True,
                 top_k: int = 8, **kw) -> list[dict]:
    """The projection against measured engine rounds at a partial depth (bench.k26's cells): for every cell
    {mode, budget, batch, context, layers, block, round_gpu_span_median_s, draft_s, commit_s, moe_kernel_s
    (all optional), tau} of AR, DFlash or a fixed DDTree budget, the round time projected at 1 + layers layers
    (the dense layer 0 and `layers` MoE layers) from `rec` (notebook 01's record), with the cell's measured
    routed-expert kernel time (`moe_kernel_s`, routing True), draft and commit times. Rows {.., projected_s,
    measured_s, ratio, within, full_s, full_tok_per_s}: full_s the same parts at `full_layers` layers
    (PROJECTED), full_tok_per_s the cell's tau over it. A cell that counted its experts but has no kernel time
    (routing True) takes the kernel time of `fit_moe_kernel` over the cells that have both
    (moe_kernel_modelled True in its row): a real tree's nodes share experts (a 65-node tree at batch 1 reads
    ~60 of 384, random routing ~276), so the record's random-routing layer time over-projects it.
    routing_reference: what the correction took as the layer's own routed kernel (`routed_kernel`'s source).
    Cells the record cannot project are left out. kw: round_parts' vocab, hidden, drafter_layers."""
    out = []
    fit = fit_moe_kernel(cells, top_k) if routing else None
    for c in cells:
        if c.get("error") or c.get("budget") == "auto" or not c.get("round_gpu_span_median_s"):
            continue
        kern, modelled = (c.get("moe_kernel_s"), False) if routing else (None, False)
        if routing and kern is None and fit is not None and c.get("experts_touched"):
            kern, modelled = fit[0] * c["experts_touched"] + fit[1] * _rows(c) * c["batch"] * top_k, True
        at = dict(block_size=c.get("block") or 16, n_dense=1, draft_s=c.get("draft_s"), moe_kernel_s=kern,
                  commit_s=c.get("commit_s"), **kw)
        parts = round_parts(rec, c["mode"], c["batch"], c["context"], c.get("budget"),
                            n_layers=1 + c["layers"], **at)
        full = round_parts(rec, c["mode"], c["batch"], c["context"], c.get("budget"), n_layers=full_layers,
                           **at)
        if parts is None:
            continue
        ext = parts.pop("extrapolated")
        t, m = sum(parts.values()), c["round_gpu_span_median_s"]
        fs = None if full is None else sum(v for k, v in full.items() if k != "extrapolated")
        ref = routed_kernel(rec, c["context"], c["batch"], _rows(c))[2] if kern is not None else None
        out.append({k: c.get(k) for k in ("mode", "budget", "batch", "context", "layers", "tau_chain",
                                          "experts_touched")} |
                   {"moe_kernel_s": kern, "moe_kernel_modelled": modelled, "routing_reference": ref,
                    "projected_s": t, "measured_s": m,
                    "ratio": t / m, "within": abs(t / m - 1) <= tolerance,
                    "parts": parts, "extrapolated": ext, "full_layers": full_layers, "full_s": fs,
                    "full_tok_per_s": c["tau"] / fs if fs and c.get("tau") else None})
    return out


# ----------------------------------------------------------------------------- several GPUs (projected)
def busiest_rank_experts(touched: int, experts: int, world: int, trials: int = 2000, seed: int = 0) -> float:
    """Expected experts on the busiest rank when `touched` distinct experts of `experts` (placed in `world`
    equal contiguous blocks, expert parallelism) are drawn uniformly: the mean over seeded draws of the
    largest count per rank."""
    if not (1 <= world <= experts and experts % world == 0 and 0 <= touched <= experts):
        raise ValueError(f"expected 1 <= world <= experts, experts % world == 0, 0 <= touched <= experts; "
                         f"got touched={touched}, experts={experts}, world={world}")
    rng = np.random.default_rng(seed)
    per = experts // world
    draws = np.argsort(rng.random((trials, experts)), axis=1)[:, :touched] // per           # rank of each
    counts = np.stack([(draws == r).sum(1) for r in range(world)], 1)
    return float(counts.max(1).mean())


def project_multi(rec: dict, taus: dict, batch: int, context: int, world: int, allreduce_latency_s: float,
                  allreduce_Bps: float, experts: int = 384, top_k: int = 8, n_layers: int = 61,
                  n_dense: int = 1, hidden: int = 7168, **kw) -> list[dict]:
    """PROJECTED rows (labelled so) for `world` GPUs from one GPU's record: per MoE layer, its measured time
    less its routed kernel's (`routed_kernel`) split over the ranks (tensor-parallel
    attention and dense work), plus the MoE kernel on the busiest rank (its share of the round's touched
    experts, `busiest_rank_experts`, at the kernel's time per expert), plus two all-reduces a layer (latency
    + rows * hidden * 2 bytes / bandwidth; both given, stated in every row); the dense layers split over
    the ranks; the drafter, tree build and walk as on one GPU. Rows as `project`'s plus world, the
    all-reduce settings, "projected": True."""
    for name, v in (("allreduce_latency_s", allreduce_latency_s), ("allreduce_Bps", allreduce_Bps)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v!r}: expected a positive number (state the assumption)")
    one = project(rec, taus, batch, context, n_layers=n_layers, n_dense=n_dense, hidden=hidden, **kw)
    out = []
    for r in one:
        rows = {"ar": 1, "dflash": kw.get("block_size", 16)}.get(r["mode"], (r["budget"] or 0) + 1)
        N = r["batch"] * rows                                                   # the round's verify rows
        layer, ext = layer_time(rec["layer_verify"], "moe", context, batch, N // batch)
        dense, _ = layer_time(rec["layer_verify"], "dense", context, batch, N // batch)
        kern, touched, _ = routed_kernel(rec, context, batch, N // batch)
        touched = min(experts, max(top_k, round(touched)))
        busiest = busiest_rank_experts(touched, experts, world)
        moe_rank = kern * busiest / touched
        ar_s = 2 * (allreduce_latency_s + N * hidden * 2 / allreduce_Bps)
        moe_layer = max(layer - kern, 0.0) / world + moe_rank + ar_s
        dense_layer = dense / world + ar_s
        verify = (n_dense * dense_layer + (n_layers - n_dense) * moe_layer
                  + head_time(rec["ceilings"], kw.get("vocab", 163840), hidden, N) / world)
        parts = dict(r["parts"], verify=verify)
        t = sum(parts.values())
        out.append({**{k: r[k] for k in ("mode", "budget", "batch", "context", "tau")}, "round_s": t,
                    "parts": parts, "tok_per_s": r["tau"] / t, "extrapolated": r["extrapolated"] or ext,
                    "world": world, "allreduce_latency_s": allreduce_latency_s,
                    "allreduce_Bps": allreduce_Bps,
                    "busiest_rank_experts": busiest, "touched_experts": touched, "projected": True})
    ar = next((r for r in out if r["mode"] == "ar"), None)
    for r in out:
        r["speedup_vs_ar"] = r["tok_per_s"] / ar["tok_per_s"] if ar else None
    return out
