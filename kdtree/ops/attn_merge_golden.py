"""Golden twin of cuda/attn_merge.cu (numpy, float64): merge_states(o1, l1, o2, l2) -> (o, lse)."""
from __future__ import annotations

import numpy as np

from .decode_golden import rb


def merge_states(o1, l1, o2, l2) -> tuple[np.ndarray, np.ndarray]:
    """o1, o2 [..., D] (each pass normalised over its own keys), l1, l2 [...] natural-log log-sum-exp (-inf:
    no key, that o ignored even where it is NaN) -> (rb(o) [..., D], lse [...]) in float64: o the weighted
    mean exp(l_i - max) o_i, 0 where both sets are empty; lse = log(exp(l1) + exp(l2)), -inf there."""
    o1, o2 = np.asarray(o1, np.float64), np.asarray(o2, np.float64)
    l1, l2 = np.asarray(l1, np.float64), np.asarray(l2, np.float64)
    if o1.shape != o2.shape or l1.shape != l2.shape or o1.shape[:-1] != l1.shape:
        raise ValueError(f"merge_states: expected o1, o2 [..., D] and l1, l2 [...] of one shape, got "
                         f"{o1.shape}, {o2.shape}, {l1.shape}, {l2.shape}")
    m = np.maximum(l1, l2)
    none = np.isneginf(m)
    m = np.where(none, 0.0, m)
    w1, w2 = np.exp(l1 - m), np.exp(l2 - m)
    den = w1 + w2
    with np.errstate(invalid="ignore", divide="ignore"):
        part1 = np.where((w1 > 0)[..., None], o1 * (w1 / np.where(den > 0, den, 1.0))[..., None], 0.0)
        part2 = np.where((w2 > 0)[..., None], o2 * (w2 / np.where(den > 0, den, 1.0))[..., None], 0.0)
        lse = np.where(none, -np.inf, m + np.log(np.where(den > 0, den, 1.0)))
    return rb(part1 + part2), lse
