"""The panels and legend of the K2.6 section's figure (`kdtree.bench.k26_record.plot`, which lays them out):
a (context, batch) cell's throughput panel, a context's round-cost panel, the shared legend.
"""
from __future__ import annotations


def throughput_panel(ax, rs, colour: dict, ylabel: bool) -> bool:
    """One (context, batch) cell's panel on ax from its rows rs: per profile (colour[tau_chain]) tok/s
    against the fixed budget, the queue's full-batch rounds, auto's stars at the slot right of the budgets
    and the DFlash chain dashed; the median AR row black; the y label where `ylabel`. Returns whether a
    queue was drawn."""
    from .. import plots
    queued = False
    fixed_all = sorted({c["budget"] for c in rs if c["mode"] == "ddtree" and c["budget"] != "auto"})
    slot = 2.0 * max(fixed_all) if fixed_all else 1.0
    for tc in sorted({c.get("tau_chain") for c in rs if c.get("tau_chain")}):
        col = colour[tc]
        d = [c for c in rs if c.get("tau_chain") == tc and c["mode"] == "ddtree" and c["budget"] != "auto"]
        if d:
            ax.plot([c["budget"] for c in d], [c["tok_per_s"] for c in d], "o-", color=col, ms=4)
        qd = [c for c in d if (c.get("queued") or {}).get("full_tok_per_s")]
        if qd:   # the serving queue's full-batch rounds
            queued = True
            ax.plot([c["budget"] for c in qd], [c["queued"]["full_tok_per_s"] for c in qd], "s-.",
                    color=col, lw=0.8, ms=3, alpha=0.6)
        au = next((c for c in rs if c.get("tau_chain") == tc and c["budget"] == "auto"), None)
        if au and (au.get("queued") or {}).get("full_tok_per_s"):
            ax.plot([slot], [au["queued"]["full_tok_per_s"]], "*", ms=9, mfc="none", color=col)
        if au:
            ax.plot([slot], [au["tok_per_s"]], "*", ms=11, color=col)
        df = next((c for c in rs if c.get("tau_chain") == tc and c["mode"] == "dflash"), None)
        if df:
            ax.axhline(df["tok_per_s"], color=col, ls="--", lw=0.8)
    ars = sorted(c["tok_per_s"] for c in rs if c["mode"] == "ar")
    if ars:   # one AR a profile, the same engine: their median
        ax.axhline(ars[len(ars) // 2], color="k", lw=1.2)
    if fixed_all:
        plots.log2_axis(ax, fixed_all, "x", extra={slot: "auto"})
    plots.thousands(ax)
    ax.set_title(f"batch {rs[0]['batch']}, context {rs[0]['context']:,}, {rs[0].get('layers')} MoE layers",
                 fontsize=9)
    ax.set_xlabel("budget B, then auto", fontsize=8)
    if ylabel:
        ax.set_ylabel("tok/s, all requests", fontsize=8)
    ax.tick_params(labelsize=7)
    return queued


def cost_panel(ax2, rows, check: list[dict], batches, shade: dict) -> None:
    """One context's round-cost panel on ax2 from its rows: per batch (colour shade[batch]) the measured
    round (`round_cost`) against the verified rows per request (`rows_verified`) and the projection's
    rounds of `check` where any; base-2 rows axis, log cost axis, its legend right of it."""
    from matplotlib.lines import Line2D

    from .. import plots
    C = rows[0]["context"]
    what, rows_top, projected = set(), 1, False
    for b in batches:
        rs = [c for c in rows if c["batch"] == b and c["budget"] != "auto"]
        pts = sorted({(rows_verified(c), round_cost(c)[0]) for c in rs if round_cost(c)[0]})
        what |= {round_cost(c)[1] for c in rs if round_cost(c)[0]}
        if pts:
            ax2.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "o", color=shade[b], ms=4,
                     label=f"batch {b}")
            rows_top = max(rows_top, max(p[0] for p in pts))
        pj = sorted({(1 if r["mode"] == "ar" else (r["budget"] or 0) + 1, r["projected_s"]) for r in check
                     if (r["context"], r["batch"]) == (C, b) and r["mode"] != "dflash"})
        if pj:
            projected = True
            ax2.plot([p[0] for p in pj], [1e3 * p[1] for p in pj], "x--", color=shade[b], lw=0.8, ms=4)
    plots.log2_axis(ax2, plots.pow2_ticks(1, rows_top), "x")
    ax2.set_yscale("log")
    plots.thousands(ax2)
    ax2.set_title(f"round cost, context {C:,}", fontsize=9)
    ax2.set_xlabel("verified rows per request", fontsize=8)
    ax2.set_ylabel(f"ms per round ({' / '.join(sorted(what))})", fontsize=8)
    ax2.tick_params(labelsize=7)
    h, lab = ax2.get_legend_handles_labels()
    h += [Line2D([], [], color="0.35", marker="o", ms=4, ls="")]
    lab += ["measured round"]
    if projected:
        h += [Line2D([], [], color="0.35", marker="x", ms=4, ls="--", lw=0.8)]
        lab += ["projected: notebook 01\nlayers + routing"]
    plots.legend_right(ax2, handles=h, labels=lab)


def figure_legend(fig, taus, fitted, colour: dict, queued_any: bool) -> None:
    """The figure's shared legend under the panels: each profile's colour (fitted ones so named), the marks of
    the fixed budgets, auto, the chain and AR, and the queue's where `queued_any`; none without a profile."""
    from matplotlib.lines import Line2D
    key = [Line2D([], [], color=colour[tc], lw=2.5) for tc in taus]
    labels = [f"chain tau {tc:g} (simulated" + (", fitted to the trained pair)" if tc in fitted else ")")
              for tc in taus]
    key += [Line2D([], [], color="0.35", marker="o", ms=4), Line2D([], [], color="0.35", marker="*", ms=10,
                                                                   ls=""),
            Line2D([], [], color="0.35", ls="--", lw=0.8), Line2D([], [], color="k", lw=1.2)]
    labels += ["DDTree, fixed budget", "auto", "DFlash chain", "AR (the cell's engine)"]
    if queued_any:
        key += [Line2D([], [], color="0.35", marker="s", ms=3, ls="-.", lw=0.8),
                Line2D([], [], color="0.35", marker="*", ms=9, mfc="none", ls="")]
        labels += ["queue, full-batch rounds", "auto, queue, full-batch rounds"]
    if taus:
        fig.legend(key, labels, loc="outside lower center", ncols=min(len(labels), 5), fontsize=8,
                   frameon=False)


def round_cost(c: dict) -> tuple:
    """(seconds, what) of row c's measured round: its GPU span, else its wall time ("wall")."""
    if c.get("round_gpu_span_median_s"):
        return c["round_gpu_span_median_s"], "GPU span"
    return c.get("round_wall_median_s"), "wall"


def rows_verified(c: dict) -> int:
    """Rows a request's round verifies: 1 for AR, the drafter block for the chain, B + 1 for a tree."""
    if c["mode"] == "ar":
        return 1
    return (c.get("block") or 1) if c["mode"] == "dflash" else c["budget"] + 1
