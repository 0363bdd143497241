"""ctypes bindings of libkdtree.so (include/kdtree.h; `make lib` builds build/libkdtree.so), on torch tensors.

The functions take and return what their kdtree.kernels namesakes do and launch on torch's current stream;
they check shapes and dtypes here (ValueError naming the argument), and the library checks sizes, pointers
and limits again before any launch (a failing status raises: ValueError for an argument, RuntimeError for
CUDA). Workspaces come from torch's allocator, sized by the library's queries.

    library()                                   the loaded library (KDTREE_LIB, else the checkout's build/)
    tree_build(logits, budget, root, start)     -> kernels.TreeBatch
    tree_walk(tokens, parents, choice, A)       -> (accepted, acc_len, bonus)
    kv_compact(cache, page_table, block_start, accepted, acc_len, page_size)
    verify_attn(q, cache, page_table, seq_len, mask_words, scale, ...) -> (out, lse)
    repack_moe(w13_packed, w13_scale, w2_packed, w2_scale) -> kernels.MoeWeights
    moe_int4(x, topk_ids, topk_weights, weights, ...) -> float32 [T, D]
"""
from __future__ import annotations

import ctypes as C
import functools
import math
import os
from pathlib import Path

import torch

from . import checks, kernels

STATUS = {0: "KDTREE_OK", 1: "KDTREE_ERR_NULL", 2: "KDTREE_ERR_ALIGN", 3: "KDTREE_ERR_SIZE",
          4: "KDTREE_ERR_LIMIT", 5: "KDTREE_ERR_WORKSPACE", 6: "KDTREE_ERR_NO_CUDA", 7: "KDTREE_ERR_ARCH",
          8: "KDTREE_ERR_CUDA"}
ARGUMENT_ERRORS = (1, 2, 3, 4, 5)
F32, BF16, I32, I64 = 0, 1, 2, 3
VERIFY_IMPLS = {None: 0, "wgmma": 1, "ws": 2, "mma": 3}
_p, _i, _z, _s, _f, _l = C.c_void_p, C.c_int, C.c_size_t, C.c_int64, C.c_float, C.c_longlong
_SIGNATURES = {
    "kdtree_abi_version": (_i, []),
    "kdtree_error_string": (C.c_char_p, [_i]),
    "kdtree_last_error": (C.c_char_p, []),
    "kdtree_topk_chunking": (_i, [_i, _i, _i, _i, C.POINTER(_i), C.POINTER(_i)]),
    "kdtree_default_splits": (_i, [_i, _i, _i, _i, _i]),
    "kdtree_tree_build_workspace": (_z, [_i, _i, _i, _i]),
    "kdtree_tree_build": (_i, [_p, _i, _i, _i, _i, _i, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _z, _p]),
    "kdtree_tree_walk": (_i, [_p, _p, _p, _i, _i, _i, _p, _p, _p, _p]),
    "kdtree_kv_compact": (_i, [_p, _i, _s, _i, _p, _i, _i, _i, _p, _p, _i, _p, _p]),
    "kdtree_verify_attn_splits": (_i, [_i, _i, _i, _i, _i]),
    "kdtree_verify_attn_workspace": (_z, [_i, _i, _i, _i, _i, _i]),
    "kdtree_verify_attn": (_i, [_p, _p, _s, _p, _i, _i, _p, _p, _i, _i, _i, _f, _i, _i, _i, _p, _p, _p, _z,
                                _p]),
    "kdtree_moe_repack": (_i, [_p, _p, _s, _i, _i, _p, _p, _p]),
    "kdtree_moe_workspace": (_z, [_i, _i, _i, _i, _i]),
    "kdtree_moe_int4": (_i, [_p, _p, _i, _p, _i, _i, _p, _p, _p, _p, _i, _i, _i, _i, _i, _p, _p, _z, _p]),
}


def default_path() -> Path:
    """KDTREE_LIB if set, else build/libkdtree.so in the checkout this package sits in."""
    env = os.environ.get("KDTREE_LIB")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "build" / "libkdtree.so"


@functools.cache
def library(path: str | None = None) -> C.CDLL:
    p = Path(path) if path else default_path()
    if not p.is_file():
        raise RuntimeError(f"libkdtree.so not found at {p}: build it with `make lib` (needs nvcc), or point "
                           "KDTREE_LIB at it")
    lib = C.CDLL(str(p))
    for name, (res, args) in _SIGNATURES.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    if lib.kdtree_abi_version() != 1:
        raise RuntimeError(f"{p}: ABI version {lib.kdtree_abi_version()}, these bindings speak 1")
    return lib


def _check(name: str, rc: int) -> None:
    if rc == 0:
        return
    msg = library().kdtree_last_error().decode()
    err = ValueError if rc in ARGUMENT_ERRORS else RuntimeError
    raise err(f"{STATUS.get(rc, rc)}: {msg}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _workspace(nbytes: int, dev) -> torch.Tensor:
    if nbytes == 0:
        raise ValueError(library().kdtree_last_error().decode())
    return torch.empty(nbytes, dtype=torch.uint8, device=dev)


# ----------------------------------------------------------------------------- tree build, walk, compaction
def tree_build(logits: torch.Tensor, budget: int, root_tokens: torch.Tensor, start_pos: torch.Tensor):
    """kernels.tree_build through the C ABI (no value checks: the library never reads the device)."""
    checks.tensor("logits", logits, (torch.float32, torch.bfloat16), ndim=3, contiguous=True)
    b, L, V = logits.shape
    budget = checks.int_in("budget", budget, 1, kernels.MAX_BUDGET)
    checks.tensor("root_tokens", root_tokens, (torch.int32,), shape=(b,), contiguous=True)
    checks.tensor("start_pos", start_pos, (torch.int32,), shape=(b,), contiguous=True)
    lib, dev = library(), logits.device
    ws = _workspace(lib.kdtree_tree_build_workspace(b, L, V, budget), dev)
    N, W = budget + 1, (budget + 32) // 32
    e = kernels._empty
    out = kernels.TreeBatch(*(e(b, N, dtype=dt, device=dev) for dt in
                              (torch.int32, torch.int32, torch.int32, torch.int32, torch.float32)),
                            mask=e(b, N, W, dtype=torch.int32, device=dev),
                            n_nodes=e(b, dtype=torch.int32, device=dev))
    outs = (out.tokens, out.positions, out.parents, out.depths, out.scores, out.mask, out.n_nodes)
    _check("kdtree_tree_build", lib.kdtree_tree_build(
        logits.data_ptr(), BF16 if logits.dtype == torch.bfloat16 else F32, b, L, V, budget,
        root_tokens.data_ptr(), start_pos.data_ptr(), *(_ptr(t) for t in outs), ws.data_ptr(), ws.numel(),
        _stream()))
    return out


def tree_walk(tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor, max_accept: int = 64):
    checks.tensor("tokens", tokens, (torch.int32,), ndim=2, contiguous=True)
    b, N = tokens.shape
    checks.tensor("parents", parents, (torch.int32,), shape=(b, N), contiguous=True)
    checks.tensor("choice", choice, (torch.int32,), shape=(b, N), contiguous=True)
    A = checks.int_in("max_accept", max_accept, 1, 1024)
    dev = tokens.device
    acc = kernels._empty(b, A, dtype=torch.int32, device=dev)
    n = kernels._empty(b, dtype=torch.int32, device=dev)
    bonus = kernels._empty(b, dtype=torch.int32, device=dev)
    _check("kdtree_tree_walk", library().kdtree_tree_walk(
        tokens.data_ptr(), parents.data_ptr(), choice.data_ptr(), b, N, A, acc.data_ptr(), n.data_ptr(),
        bonus.data_ptr(), _stream()))
    return acc, n, bonus


def kv_compact(cache: torch.Tensor, page_table: torch.Tensor, block_start: torch.Tensor,
               accepted: torch.Tensor, acc_len: torch.Tensor, page_size: int = kernels.PAGE_SIZE) -> None:
    checks.tensor("cache", cache, (torch.bfloat16, torch.float16, torch.float32), ndim=3, contiguous=True)
    n_layers, rows, D = cache.shape
    checks.tensor("page_table", page_table, (torch.int32,), ndim=2, contiguous=True)
    b, max_pages = page_table.shape
    checks.tensor("block_start", block_start, (torch.int32,), shape=(b,), contiguous=True)
    checks.tensor("accepted", accepted, (torch.int32,), ndim=2, contiguous=True)
    checks.tensor("acc_len", acc_len, (torch.int32,), shape=(b,), contiguous=True)
    _check("kdtree_kv_compact", library().kdtree_kv_compact(
        cache.data_ptr(), n_layers, rows, D * cache.element_size(), page_table.data_ptr(), b, max_pages,
        page_size, block_start.data_ptr(), accepted.data_ptr(), accepted.shape[1], acc_len.data_ptr(),
        _stream()))


# ----------------------------------------------------------------------------- verify attention
def verify_attn(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_len: torch.Tensor,
                mask: torch.Tensor, scale: float, page_size: int = kernels.PAGE_SIZE,
                max_seq_len: int | None = None, impl: str | None = None, n_splits: int | None = None):
    """kernels.verify_attn through the C ABI: mask as packed int32 words [b, N, ceil(N / 32)]; max_seq_len
    (default: the page table's capacity) sizes the context splits."""
    checks.tensor("q", q, (torch.bfloat16,), ndim=4, contiguous=True)
    b, N, H, _ = q.shape
    checks.tensor("cache", cache, (torch.bfloat16,), ndim=2, contiguous=True)
    checks.tensor("page_table", page_table, (torch.int32,), ndim=2, contiguous=True)
    checks.tensor("seq_len", seq_len, (torch.int32,), shape=(b,), contiguous=True)
    checks.tensor("mask", mask, (torch.int32,), shape=(b, N, (N + 31) // 32), contiguous=True)
    if impl not in VERIFY_IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {tuple(VERIFY_IMPLS)}")
    lib, dev = library(), q.device
    cap = page_table.shape[1] * page_size
    keys = cap if max_seq_len is None else checks.int_in("max_seq_len", max_seq_len, N, cap)
    ns = 0 if n_splits is None else checks.int_in("n_splits", n_splits, 1, kernels.MAX_SPLITS)
    ws = _workspace(lib.kdtree_verify_attn_workspace(b, N, H, keys, VERIFY_IMPLS[impl], ns), dev)
    out = kernels._empty(b, N, H, kernels.D_V, dtype=torch.bfloat16, device=dev)
    lse = kernels._empty(b, N, H, dtype=torch.float32, device=dev)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale={scale!r}: expected a positive finite float")
    _check("kdtree_verify_attn", lib.kdtree_verify_attn(
        q.data_ptr(), cache.data_ptr(), cache.shape[0], page_table.data_ptr(), page_table.shape[1], page_size,
        seq_len.data_ptr(), mask.data_ptr(), b, N, H, float(scale), keys, VERIFY_IMPLS[impl], ns,
        out.data_ptr(), lse.data_ptr(), ws.data_ptr(), ws.numel(), _stream()))
    return out, lse


# ----------------------------------------------------------------------------- INT4 MoE
def _repack(packed: torch.Tensor, scale: torch.Tensor):
    mats, R, K8 = packed.shape
    K = K8 * 8
    w = kernels._empty(mats, R // 16, K // 32, 32, 2, dtype=torch.int32, device=packed.device)
    s = kernels._empty(mats, R // 16, K // 32, 8, 2, dtype=torch.bfloat16, device=packed.device)
    _check("kdtree_moe_repack", library().kdtree_moe_repack(packed.data_ptr(), scale.data_ptr(), mats, R, K,
                                                            w.data_ptr(), s.data_ptr(), _stream()))
    return w, s


def repack_moe(w13_packed, w13_scale, w2_packed, w2_scale) -> kernels.MoeWeights:
    """kernels.repack_moe in the library's repacking kernels (same layout, bit for bit)."""
    checks.tensor("w13_packed", w13_packed, (torch.int32,), ndim=3, contiguous=True)
    E, I2, D8 = w13_packed.shape
    I, D = I2 // 2, D8 * 8
    checks.tensor("w13_scale", w13_scale, (torch.bfloat16,), shape=(E, I2, D // 32), contiguous=True)
    checks.tensor("w2_packed", w2_packed, (torch.int32,), shape=(E, D, I // 8), contiguous=True)
    checks.tensor("w2_scale", w2_scale, (torch.bfloat16,), shape=(E, D, I // 32), contiguous=True)
    w13, s13 = _repack(w13_packed, w13_scale)
    w2, s2 = _repack(w2_packed, w2_scale)
    return kernels.MoeWeights(w13, s13, w2, s2, E, D, I)


def moe_int4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: kernels.MoeWeights,
             tile_tokens: int | None = None, fused: bool | None = None) -> torch.Tensor:
    checks.tensor("x", x, (torch.bfloat16,), ndim=2, contiguous=True)
    T = x.shape[0]
    checks.tensor("topk_ids", topk_ids, (torch.int32, torch.int64), ndim=2, contiguous=True)
    k = topk_ids.shape[1]
    checks.tensor("topk_weights", topk_weights, (torch.float32,), shape=(T, k), contiguous=True)
    lib, dev = library(), x.device
    E, D, I = weights.E, weights.D, weights.I
    ws = _workspace(lib.kdtree_moe_workspace(T, k, E, D, I), dev)
    ws[:4 * (4 + kernels.FUSED_MAX_PAIRS)].zero_()  # the fused path's counters: calls leave them zero
    out = kernels._empty(T, D, dtype=torch.float32, device=dev)
    _check("kdtree_moe_int4", lib.kdtree_moe_int4(
        x.data_ptr(), topk_ids.data_ptr(), I64 if topk_ids.dtype == torch.int64 else I32,
        topk_weights.data_ptr(), T, k, weights.w13.data_ptr(), weights.s13.data_ptr(), weights.w2.data_ptr(),
        weights.s2.data_ptr(), E, D, I, tile_tokens or 0, -1 if fused is None else int(bool(fused)),
        out.data_ptr(), ws.data_ptr(), ws.numel(), _stream()))
    return out
