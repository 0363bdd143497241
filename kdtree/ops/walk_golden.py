"""Numpy golden twin of kdtree.ops.walk (cuda/tree_walk.cu): the accept walk down a verify block and the KV
compaction of the accepted rows.
"""
from __future__ import annotations

import numpy as np

from .. import checks
from .tree_golden import _check_parents, _ids


# ----------------------------------------------------------------------------- walk
def walk(tokens, parents, target_choice) -> tuple[np.ndarray, int]:
    """Follow the target down the verify block.

    tokens [N], parents [N] (row 0 the root), target_choice [N]: the target's next token at every row
    (argmax for greedy, a sample for T > 0). From the root, move to the child whose token equals the
    target's choice while one exists. Returns (accepted rows [k] int64, starting with 0; bonus token =
    target_choice at the last accepted row)."""
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    choice = np.asarray(target_choice)
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(f"walk: expected tokens [N] with N >= 1 (row 0 the root), got shape {tokens.shape}")
    for name, a in (("tokens", tokens), ("parents", parents), ("target_choice", choice)):
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"walk: {name} must hold integers, got {a.dtype}")
    N = tokens.shape[0]
    if parents.shape != (N,) or choice.shape != (N,):
        raise ValueError(f"walk: expected tokens, parents, target_choice all of shape [{N}], got "
                         f"{tokens.shape}, {parents.shape}, {choice.shape}")
    _ids("walk: tokens", tokens)
    _ids("walk: target_choice", choice)
    _check_parents("walk: parents", parents, N)
    if N and parents[0] != -1:
        raise ValueError(f"walk: row 0 is the root: expected parents[0] = -1, got {int(parents[0])}")
    children: dict[tuple[int, int], int] = {}
    for i in range(1, N):
        children.setdefault((int(parents[i]), int(tokens[i])), i)
    path = [0]
    while (nxt := children.get((path[-1], int(choice[path[-1]])))) is not None:
        path.append(nxt)
    return np.array(path, np.int64), int(choice[path[-1]])


def greedy_walk(tokens, parents, target_logits) -> tuple[np.ndarray, int]:
    """walk() with the target's argmax (lowest token id on ties) at every row; target_logits [N, V]."""
    x = np.asarray(target_logits)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"target_logits: expected a float array [N, V], got {x.dtype} {x.shape}")
    if np.isnan(x).any():
        raise ValueError(f"target_logits: NaN at row {int(np.flatnonzero(np.isnan(x).any(-1))[0])}")
    return walk(tokens, parents, x.argmax(axis=-1))


def sampled_walk(tokens, parents, target_samples) -> tuple[np.ndarray, int]:
    """walk() with one target sample per row (drawn from the target's distribution at T > 0)."""
    return walk(tokens, parents, target_samples)

# ----------------------------------------------------------------------------- KV compaction
def compact_kv(cache, block_start: int, keep) -> tuple[np.ndarray, int]:
    """Gather semantics: out[block_start + j] = cache[block_start + keep[j]] for every j at once; all other
    rows unchanged. keep: strictly increasing indices into the block. Returns (out, new_length)."""
    block_start = checks.int_in("block_start", block_start, 0)
    c = np.array(cache, copy=True)
    k = np.asarray(keep)
    if k.size and (not np.issubdtype(k.dtype, np.integer) or k.dtype == np.bool_):
        raise ValueError(f"compact_kv keep: expected integer row indices, got {k.dtype}")
    keep = k.astype(np.int64)
    if keep.ndim != 1 or (keep.size > 1 and (np.diff(keep) <= 0).any()):
        raise ValueError("compact_kv keep: expected a strictly increasing 1-D index array")
    if keep.size and (keep[0] < 0 or block_start + keep[-1] >= c.shape[0]):
        raise IndexError(f"compact_kv keep: expected values in [0, {c.shape[0] - block_start}), got "
                         f"[{keep[0]}, {keep[-1]}]")
    c[block_start:block_start + keep.size] = np.asarray(cache)[block_start + keep]
    return c, block_start + keep.size
