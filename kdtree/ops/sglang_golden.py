"""Numpy golden twin of cuda/sglang_tree.cu (launched by kdtree.bridge): our verify blocks in SGLang's EAGLE
tree format, and the greedy accept over it.

The arrays sgl-kernel's build_tree_kernel_efficient writes and verify_tree_greedy reads
(sgl-project/sglang, sgl-kernel/csrc/speculative/eagle_utils.cu at commit 29bd4e85). Per request b of a
batch, the N = draft_token_num rows are our verify block's rows (row 0 the root, the verified token at
position seq_len[b]); a request's flat row index is b * N + row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import checks
from .tree_golden import _check_parents, _ids, ancestor_mask

SGLANG_MODES = ("full", "qlen_only", "qlen_only_bitpacking")  # sgl-kernel's TreeMaskMode 0, 1, 2
SGLANG_BITPACK_MAX_N = 32


def sglang_mask_bytes(N: int) -> int:
    """Bytes per row of the bit-packed mask: 1 up to 8 rows, 2 up to 16, 4 up to 32 (more cannot be
    packed)."""
    if not 1 <= N <= SGLANG_BITPACK_MAX_N:
        raise ValueError(f"qlen_only_bitpacking holds at most {SGLANG_BITPACK_MAX_N} rows a request, "
                         f"got N={N}")
    return 1 if N <= 8 else 2 if N <= 16 else 4


@dataclass
class SglangTree:
    """One batch in SGLang's format (shapes with b requests of N rows each):
    draft_tokens int64 [b, N] (verify_tree_greedy's `candidates`), positions int64 [b * N] = seq_len + depth,
    tree_mask: "full" bool [sum(seq_len) * N + b * N * N], request b's [N, seq_len[b] + N] block at offset
    sum(seq_len[:b]) * N + b * N * N (prefix columns true); "qlen_only" bool [b * N * N] ([N, N] per request);
    "qlen_only_bitpacking" uint8 [b * N, nbytes] (bit c % 8 of byte c // 8 = column c, little endian);
    column c of the tree part is row c (0 the root, true on every row).
    retrive_index int64 [b, N] = b * N + row; retrive_next_token int64 [b, N] = the row's first child (its
    smallest child row), -1 none; retrive_next_sibling int64 [b, N] = the next larger row with the same
    parent, -1 none. Padding rows (parent -1 below row 0) are on no list, see the prefix, the root and
    themselves, and sit at position seq_len."""
    draft_tokens: np.ndarray
    positions: np.ndarray
    tree_mask: np.ndarray
    retrive_index: np.ndarray
    retrive_next_token: np.ndarray
    retrive_next_sibling: np.ndarray
    mode: str


def sglang_tree(tokens, parents, seq_lens, mode: str = "qlen_only") -> SglangTree:
    """Verify blocks (tokens [b, N], parents [b, N]: row 0 the root, parents[i] < i or -1) and each request's
    committed length seq_lens [b] (the root's position) -> SglangTree (contract above)."""
    mode = checks.one_of("mode", mode, SGLANG_MODES)
    tok = _ids("tokens", tokens)
    par = np.asarray(parents)
    if tok.ndim != 2 or tok.shape[1] == 0 or par.shape != tok.shape:
        raise ValueError(f"tokens/parents: expected equal shapes [b, N] with N >= 1, got {tok.shape} and "
                         f"{par.shape}")
    b, N = tok.shape
    sl = np.asarray(seq_lens)
    if sl.shape != (b,) or (sl.size and (not np.issubdtype(sl.dtype, np.integer) or sl.min() < 0)):
        raise ValueError(f"seq_lens: expected {b} integers >= 0, got {sl.dtype} {sl.shape}")
    for i in range(b):
        _check_parents(f"parents[{i}]", par[i], N)
        if par[i, 0] != -1:
            raise ValueError(f"parents[{i}]: row 0 is the root: expected parents[{i}, 0] = -1, "
                             f"got {par[i, 0]}")
    if mode == "qlen_only_bitpacking":
        nbytes = sglang_mask_bytes(N)
    nxt = np.full((b, N), -1, np.int64)
    sib = np.full((b, N), -1, np.int64)
    pos = np.zeros((b, N), np.int64)
    vis = np.zeros((b, N, N), bool)
    for i in range(b):
        for r in range(N - 1, 0, -1):  # head insertion from the back: each list ascends
            p = par[i, r]
            if p >= 0:
                sib[i, r], nxt[i, p] = nxt[i, p], r
        vis[i] = ancestor_mask(par[i])
        vis[i, :, 0] = True
        depth = np.zeros(N, np.int64)
        for r in range(1, N):
            depth[r] = depth[par[i, r]] + 1 if par[i, r] >= 0 else 0
        pos[i] = int(sl[i]) + depth
    if mode == "full":
        mask = np.concatenate([np.concatenate([np.ones((N, int(sl[i])), bool), vis[i]], axis=1).ravel()
                               for i in range(b)]) if b else np.zeros(0, bool)
    elif mode == "qlen_only":
        mask = vis.reshape(-1)
    else:
        bits = np.zeros((b * N, nbytes * 8), bool)
        bits[:, :N] = vis.reshape(b * N, N)
        mask = np.packbits(bits.reshape(b * N, nbytes, 8), axis=-1, bitorder="little")[..., 0]
    ridx = np.arange(b * N, dtype=np.int64).reshape(b, N)
    return SglangTree(tok.astype(np.int64), pos.reshape(-1), mask, ridx, nxt, sib, mode)


def sglang_verify_greedy(tree: SglangTree, target_predict, num_spec_steps: int):
    """verify_tree_greedy's contract: per request, from row 0 follow retrive_next_token, then the sibling
    list, to the row whose draft token equals the target's choice at the last accepted row; at most
    num_spec_steps - 1 draft rows. target_predict [b, N] (the target's token at every row).
    Returns predicts int32 [b * N] (the target's token at each accepted row, -1 at the others),
    accept_index int32 [b, num_spec_steps] (flat rows, root first, -1 padded), accept_token_num int32 [b]
    (draft rows accepted, the root not counted)."""
    S = checks.positive_int("num_spec_steps", num_spec_steps)
    b, N = tree.draft_tokens.shape
    tp = _ids("target_predict", target_predict)
    if tp.shape != (b, N):
        raise ValueError(f"target_predict: expected shape ({b}, {N}), got {tp.shape}")
    flat = tp.reshape(-1)
    predicts = np.full(b * N, -1, np.int32)
    accept = np.full((b, S), -1, np.int32)
    n_acc = np.zeros(b, np.int32)
    for i in range(b):
        last = int(tree.retrive_index[i, 0])
        accept[i, 0] = last
        cur = 0
        for _ in range(1, S):
            cur = int(tree.retrive_next_token[i, cur])
            while cur != -1 and tree.draft_tokens[i, cur] != flat[last]:
                cur = int(tree.retrive_next_sibling[i, cur])
            if cur == -1:
                break
            predicts[last] = flat[last]
            n_acc[i] += 1
            last = int(tree.retrive_index[i, cur])
            accept[i, n_acc[i]] = last
        predicts[last] = flat[last]
    return predicts, accept, n_acc
