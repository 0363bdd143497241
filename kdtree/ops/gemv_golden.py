"""Golden twin of cuda/gemv.cu (numpy): gemv(x, w) -> y [M, N], float64 sums of the bf16 inputs' values,
the output rounded to bf16 (returned as float64)."""
from __future__ import annotations

import numpy as np

from .decode_golden import rb


def gemv(x, w) -> np.ndarray:
    """x [M, K], w [N, K] -> rb(x w^T) [M, N]."""
    return rb(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T)
