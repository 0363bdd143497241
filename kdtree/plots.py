"""Plots for the notebooks (matplotlib): draft trees, accept-length histograms, forward counts, and notebook
02's cost-aware-budget figure (`auto_figure`).

The figures drawn from records follow one contract, which the K2.6 figure (`kdtree.bench.k26_record.plot`)
shares through the helpers here: an axes is created only for data the record holds (no empty panel); legends
sit outside every axes (`legend_below`, `legend_right`, a figure legend), so none covers a curve; the layout
is matplotlib's constrained layout, so no label is cut at the figure's edge; a budget or node axis is base-2
logarithmic with integer ticks (`log2_axis`), or, where 0 is a value (AR verifies no draft node),
symmetric-log from 0 up (`node_axis`): never a negative tick. `layout_faults(fig)` names each break of
this contract in a drawn figure (the tests draw small synthetic records through it).
"""
from __future__ import annotations

import numpy as np


def _plt():
    import matplotlib
    import matplotlib.pyplot as plt
    return matplotlib, plt


def tree_layout(parents) -> tuple[np.ndarray, np.ndarray]:
    """(x = depth, y = leaf-order position) for rows of a verify block (parents[0] = -1)."""
    parents = np.asarray(parents)
    n = len(parents)
    kids = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parents[i]].append(i)
    x, y = np.zeros(n), np.zeros(n)
    nxt = [0.0]

    def place(i, d):
        x[i] = d
        if not kids[i]:
            y[i] = nxt[0]
            nxt[0] += 1
        else:
            for k in kids[i]:
                place(k, d + 1)
            y[i] = np.mean([y[k] for k in kids[i]])

    import sys
    sys.setrecursionlimit(max(1000, 4 * n))
    place(0, 0)
    return x, y


def draw_tree(vb, accepted=None, labels=None, ax=None, title=None):
    """Draw a verify block (golden.VerifyBlock): nodes by depth, the accepted path in red."""
    _, plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(10, max(3, 0.18 * vb.n)))
    x, y = tree_layout(vb.parents)
    acc = set(int(i) for i in (accepted if accepted is not None else []))
    for i in range(1, vb.n):
        p = vb.parents[i]
        on = i in acc and p in acc
        ax.plot([x[p], x[i]], [y[p], y[i]], color="crimson" if on else "0.75", lw=2.2 if on else 0.8,
                zorder=1)
    colors = ["crimson" if i in acc else "steelblue" for i in range(vb.n)]
    ax.scatter(x, y, c=colors, s=28, zorder=2)
    for i in range(vb.n):
        text = labels[i] if labels is not None else str(int(vb.tokens[i]))
        ax.annotate(text, (x[i], y[i]), xytext=(4, 2), textcoords="offset points", fontsize=7)
    ax.set_xlabel("depth")
    ax.set_yticks([])
    ax.set_title(title or f"draft tree: {vb.n - 1} nodes, accepted path of {len(acc)} rows (red)")
    return ax


def accept_histogram(lengths: dict, ax=None, title="tokens emitted per verify round"):
    """lengths: {label: [accept lengths]} -> overlaid histograms."""
    _, plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    top = max((max(v) for v in lengths.values() if len(v)), default=1)
    bins = np.arange(0.5, top + 1.5)
    for label, v in lengths.items():
        ax.hist(v, bins=bins, alpha=0.55, label=f"{label} (tau={np.mean(v):.2f})")
    ax.set_xlabel("accept length (accepted drafts + bonus)")
    ax.set_ylabel("rounds")
    ax.set_title(title)
    ax.legend()
    return ax


def bar(values: dict, ax=None, ylabel="", title=""):
    """A labelled bar chart of {label: value}."""
    _, plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    labels = list(values)
    bars = ax.bar(labels, [values[k] for k in labels],
                  color=["0.6", "tab:orange", "tab:green", "tab:blue"][:len(labels)])
    for b, k in zip(bars, labels):
        ax.annotate(f"{values[k]:.3f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return ax


# ------------------------------------------------------------------------------------------ shared helpers
def pow2_ticks(lo: float, hi: float, most: int = 10) -> list[int]:
    """Powers of two from lo up to hi (ints), every other one or sparser so at most `most` remain."""
    k0, k1 = int(np.floor(np.log2(max(lo, 1)))), int(np.ceil(np.log2(max(hi, 1))))
    step = max(1, int(np.ceil((k1 - k0 + 1) / most)))
    return [2 ** k for k in range(k0, k1 + 1, step)]


def log2_axis(ax, values, which: str = "x", extra: dict | None = None) -> None:
    """A base-2 log axis with integer ticks at `values` (positive numbers; a power-of-two grid if there are
    many), plus `extra` {position: label} (for example auto's slot right of the budgets); no minor ticks."""
    vals = sorted({float(v) for v in values if v is not None and v > 0})
    if not vals:
        return
    ticks = vals if len(vals) <= 10 else pow2_ticks(vals[0], vals[-1])
    labels = [f"{int(round(t)):,}" for t in ticks]
    for pos, lab in (extra or {}).items():
        ticks, labels = [*ticks, pos], [*labels, lab]
    getattr(ax, f"set_{which}scale")("log", base=2)
    getattr(ax, f"set_{which}ticks")(ticks, labels)
    getattr(ax, f"{which}axis").set_minor_locator(_plt()[0].ticker.NullLocator())


def node_axis(ax, top: float, which: str = "y") -> None:
    """A node-count axis that holds 0 (AR verifies none): symmetric-log base 2, linear below 1, from 0 up to
    `top`, integer ticks 0, 1, 2, 4, ...; no negative tick."""
    getattr(ax, f"set_{which}scale")("symlog", base=2, linthresh=1, linscale=0.5)
    ticks = [0, *pow2_ticks(1, max(top, 1))]
    getattr(ax, f"set_{which}ticks")(ticks, [f"{t:,}" for t in ticks])
    getattr(ax, f"{which}axis").set_minor_locator(_plt()[0].ticker.NullLocator())
    getattr(ax, f"set_{which}lim")(0, max(ticks[-1], top) * 1.3)


def thousands(ax, which: str = "y") -> None:
    """Tick labels as plain numbers with thousands separators (no 1e3 offset or exponent); on a log axis at
    1, 2 and 5 of each decade."""
    ticker = _plt()[0].ticker
    axis = getattr(ax, f"{which}axis")
    if getattr(ax, f"get_{which}scale")() == "log":
        axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_minor_locator(ticker.NullLocator())
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 10 else f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def legend_below(ax, ncols: int = 2, **kw):
    """The axes' legend under it, outside the plotting area (constrained layout makes room)."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=ncols, fontsize=7, frameon=False,
                     **kw)


def legend_right(ax, **kw):
    """The axes' legend right of it, outside the plotting area."""
    return ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=7, frameon=False, **kw)


# ------------------------------------------------------------------------------------------ notebook 02
def auto_figure(auto: dict, block_size: int, path=None):
    """Notebook 02 section 5's figure from the record's `auto` section (kdtree.bench.e2e.trained_pair):
    tok/s of all requests per fixed budget for each batch (AR, AR + torch.compile and the DFlash chain as
    lines, auto's decide modes at the "auto" slot right of the budgets); the nodes auto verified round by
    round at the first batch against the best fixed budget; the calibration's expected tokens per truncation
    against the realized. A panel is drawn only where its data is recorded; legends sit under the axes.
    Saved at `path` when given; returns the figure."""
    from matplotlib.lines import Line2D
    _, plt = _plt()
    cells = [c for c in auto.get("cells", []) if not c.get("error") and c.get("tok_per_s")]
    batches = sorted({c["batch"] for c in cells})
    budgets = sorted({c["budget"] for c in cells if c["mode"] == "ddtree" and c["budget"] != "auto"})
    first = next((c for c in cells if c["budget"] == "auto" and c.get("plans")
                  and c.get("decide") in (None, "previous")), None) or \
        next((c for c in cells if c["budget"] == "auto" and c.get("plans")), None)
    cc = auto.get("calibration_check") or {}
    panels = ["tok/s"] * bool(cells and budgets) + ["plan"] * bool(first) + ["calibration"] * bool(
        cc.get("budgets"))
    fig = plt.figure(layout="constrained", figsize=(5.4 * max(1, len(panels)), 4.8))
    axes = dict(zip(panels, fig.subplots(1, len(panels), squeeze=False)[0])) if panels else {}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if "tok/s" in axes:
        ax, slot = axes["tok/s"], 2.0 * max(budgets)
        for i, b in enumerate(batches):
            col = colors[i % len(colors)]
            rs = [c for c in cells if c["batch"] == b]
            fixed = [c for c in rs if c["mode"] == "ddtree" and c["budget"] != "auto"]
            ax.plot([c["budget"] for c in fixed], [c["tok_per_s"] for c in fixed], "o-", color=col)
            for want, ls in ((("ar", False), "-"), (("ar", True), "-."), (("dflash", False), "--")):
                m = next((c for c in rs if (c["mode"], bool(c.get("compiled"))) == want), None)
                if m:
                    ax.axhline(m["tok_per_s"], color=col, ls=ls, lw=0.9)
            for c in (c for c in rs if c["budget"] == "auto"):
                ax.plot([slot], [c["tok_per_s"]], "*" if c.get("decide") in (None, "previous") else "s",
                        ms=11 if c.get("decide") in (None, "previous") else 7, color=col, alpha=0.85)
        log2_axis(ax, budgets, "x", extra={slot: "auto"})
        ax.set_yscale("log")
        thousands(ax)
        ax.set(xlabel="budget B (fixed), then auto", ylabel="tok/s, all requests",
               title="the trained pair through the engine")
        key = [Line2D([], [], color=colors[i % len(colors)], lw=6) for i in range(len(batches))]
        labels = [f"batch {b}" for b in batches]
        key += [Line2D([], [], color="0.3", marker="o"), Line2D([], [], color="0.3"),
                Line2D([], [], color="0.3", ls="-."), Line2D([], [], color="0.3", ls="--"),
                Line2D([], [], color="0.3", marker="*", ms=10, ls=""),
                Line2D([], [], color="0.3", marker="s", ms=6, ls="")]
        labels += ["DDTree, fixed budget", "AR", "AR + torch.compile", "DFlash chain",
                   "auto, decide previous", "auto, decide sync"]
        legend_below(ax, ncols=3, handles=key, labels=labels)
    if "plan" in axes:
        ax = axes["plan"]
        size = {"AR": 0, "chain": block_size - 1}
        ys = [size.get(n, int(n[2:]) if str(n).startswith("B=") else 0) for n in first["plans"]]
        ax.step(range(len(ys)), ys, where="post", label=f"auto ({first.get('decide') or 'previous'}): "
                "draft nodes verified")
        fixed = [c for c in cells if c["batch"] == first["batch"] and c["mode"] == "ddtree"
                 and c["budget"] != "auto"]
        top = max(ys, default=1)
        if fixed:
            best = max(fixed, key=lambda c: c["tok_per_s"])
            ax.axhline(best["budget"], color="gray", ls="--",
                       label=f"best fixed budget, B = {best['budget']}")
            top = max(top, best["budget"])
        node_axis(ax, top)
        ax.set(xlabel="round", ylabel=f"draft nodes verified (AR 0, chain {block_size - 1})",
               title=f"auto's plan per round, batch {first['batch']}")
        legend_below(ax)
    if "calibration" in axes:
        ax = axes["calibration"]
        for k, st in (("realized", "k-o"), ("calibrated", "o--"), ("raw", "o:")):
            if cc.get(k):
                ax.plot(cc["budgets"], cc[k], st, label=k)
        log2_axis(ax, cc["budgets"], "x")
        ax.set(xlabel="tree truncated to B nodes", ylabel="tokens per round",
               title=f"expected vs realized, {cc.get('rounds', '?')} held-out rounds")
        legend_below(ax, ncols=3)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def peers_figure(rec: dict, path=None):
    """Notebook 01's figure of a `python -m kdtree.bench.peers` record: the attention cells' times per side
    (ours, each peer; log scale, one group of bars a cell), and every target of the record as its measured
    ratio (a peer's time over ours, or ours over theirs as the target says: above 1 ours is faster) against
    the goal line at 1. A panel is drawn only where its data is recorded; legends sit under the axes. Saved at
    `path` when given; returns the figure (None when the record holds neither)."""
    _, plt = _plt()
    cells = [c for c in rec.get("attention", []) if c.get("time_s")]
    targets = [t for t in rec.get("targets", []) if t.get("measured") is not None]
    panels = ["attention"] * bool(cells) + ["targets"] * bool(targets)
    if not panels:
        return None
    fig = plt.figure(layout="constrained", figsize=(7.0 * len(panels), 5.0))
    axes = dict(zip(panels, fig.subplots(1, len(panels), squeeze=False)[0]))
    if "attention" in axes:
        ax = axes["attention"]
        sides = sorted({s for c in cells for s in c["time_s"]}, key=lambda s: (s != "ours", s))
        width = 0.8 / len(sides)
        for j, side in enumerate(sides):
            xs = [i + j * width for i, c in enumerate(cells) if side in c["time_s"]]
            ys = [c["time_s"][side] * 1e6 for c in cells if side in c["time_s"]]
            ax.bar(xs, ys, width, label=side)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
        ax.set_xticklabels([f"{c['kind']} N={c['nodes']}\nb={c['batch']} {c['context'] // 1024}K "
                            f"H={c['heads']}" for c in cells], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("us per call (median)")
        ax.set_title("MLA attention: ours and the peers")
        legend_below(ax, ncols=min(4, len(sides)))
    if "targets" in axes:
        ax = axes["targets"]
        keys = sorted({t["key"] for t in targets})
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, t in enumerate(targets):
            ax.barh(i, t["measured"], color=colors[keys.index(t["key"]) % len(colors)])
        ax.axvline(1.0, color="k", lw=1, ls="--")
        ax.set_yticks(range(len(targets)))
        ax.set_yticklabels([t["name"][:60] for t in targets], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("measured ratio (above 1: ours is faster)")
        ax.set_title("targets against the peers")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def layout_faults(fig) -> list[str]:
    """What breaks this module's figure contract in a drawn figure, one line each ([] for none): an axes
    without a drawn point (an empty panel: a line of no points counts as none), a legend over an axes (a
    figure legend or an axes' own), an axes' labels, ticks or legend or the figure's title and legends
    reaching within 2 pixels (at 100 dpi) of the figure's edge or past it (cut)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    page = fig.bbox
    faults = []
    boxes = [(ax, ax.get_window_extent(r)) for ax in fig.axes]

    def name(ax):
        return ax.get_title() or ax.get_ylabel() or f"axes {fig.axes.index(ax)}"

    m = 2 * fig.dpi / 100

    def cut(bb) -> bool:
        return bb.x0 < page.x0 + m or bb.y0 < page.y0 + m or bb.x1 > page.x1 - m or bb.y1 > page.y1 - m

    def drawn(ax) -> bool:
        return (any(len(ln.get_xdata()) for ln in ax.lines) or bool(ax.patches) or bool(ax.images)
                or any(len(c.get_offsets()) or c.get_paths() for c in ax.collections))

    for ax in fig.axes:
        if not drawn(ax):
            faults.append(f"empty axes: {name(ax)}")
        if cut(ax.get_tightbbox(r)):
            faults.append(f"cut at the figure's edge: {name(ax)}")
    legends = [(lg, None) for lg in fig.legends]
    legends += [(ax.get_legend(), ax) for ax in fig.axes if ax.get_legend()]
    for lg, owner in legends:
        bb = lg.get_window_extent(r)
        for ax, box in boxes:
            w = min(bb.x1, box.x1) - max(bb.x0, box.x0)
            h = min(bb.y1, box.y1) - max(bb.y0, box.y0)
            if w > 1 and h > 1:
                faults.append(f"legend over an axes: {name(ax)}"
                              + (f" (the legend of {name(owner)})" if owner is not None else ""))
        if cut(bb):
            faults.append("legend cut at the figure's edge")
    if fig._suptitle is not None and cut(fig._suptitle.get_window_extent(r)):
        faults.append("title cut at the figure's edge")
    return faults
