"""Plots for the notebooks (matplotlib): draft trees, accept-length histograms, forward counts."""
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
