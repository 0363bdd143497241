"""CuPy RawModule wrappers for the CUDA kernels in cuda/ (shipped as kdtree.cuda).

Torch tensors in, torch tensors out; every launch goes on torch's current stream, with no host round
trip, so a round can be captured in a CUDA graph (pass check_values=False there: value checks read the
device). Every argument is checked before anything is compiled or launched; a bad one raises ValueError
naming it. Kernel contracts are in each .cu file's header; golden twins in kdtree/golden.py.

    topk_logprobs(logits, k)                -> (tokens int32 [R, k], logprobs float32 [R, k])
    tree_build(logits, budget, root, start) -> TreeBatch (verify blocks of budget + 1 rows)
    tree_walk(tokens, parents, choice)      -> (accepted int32 [b, A], acc_len int32 [b], bonus int32 [b])
    kv_compact(cache, page_table, ...)      in place
    verify_attn(q, cache, page_table, seq_len, mask, scale) -> (out bf16 [b, N, H, 512], lse fp32 [b, N, H])
    repack_moe(w13, s13, w2, s2) -> MoeWeights;  moe_int4(x, topk_ids, topk_weights, weights) -> fp32 [T, D]
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import checks

MAX_BUDGET = 1024
MAX_VOCAB = 262144         # MAX_CHUNK * MAX_CANDIDATES / MAX_BUDGET
MAX_DEPTH = 63
MAX_CANDIDATES = 16384      # n_chunks * K candidates per row held in topk_merge's registers (1024 x 16)
MAX_CHUNK = 16384           # topk_partial holds a chunk in registers: 512 threads x 32 keys
TOPK_SMALL_MAX_K = 256      # topk_*_small's limit (beyond, one maximum per thread bounds too loosely)
TOPK_SMALL_K = 16           # topk_logprobs takes topk_*_small up to this K: measured faster at 16 (batch 1, 8, 32:
                            # 14-23%), slower at 64 (its lists are ranked by counting, quadratic in their length)
PAGE_SIZE = 64
D_QK, D_V = 576, 512


# ----------------------------------------------------------------------------- module loading
def cuda_source_dir() -> Path:
    """kdtree/cuda/ inside an installed (non-editable) package, else the checkout's cuda/."""
    here = Path(__file__).resolve().parent
    installed = here / "cuda"
    return installed if installed.is_dir() else here.parent / "cuda"


def cuda_sources() -> list[Path]:
    return sorted(cuda_source_dir().glob("*.cu"))  # headers (*.cuh) are included by these


@functools.cache
def _module(name: str):
    """Compile cuda/<name>.cu once per process (NVRTC via CuPy); `#line` keeps errors pointing at the file."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError("the kernel backend needs CuPy (pip install -e '.[gpu]') and a CUDA GPU") from e
    path = cuda_source_dir() / f"{name}.cu"
    code = f'#line 1 "{path}"\n' + _edited(name, path.read_text())
    options = ("-std=c++17", f"-I{cuda_source_dir()}")
    if os.environ.get("KDTREE_LINEINFO"):  # source lines for profilers (ncu's source page)
        options += ("-lineinfo",)
    if name in _SM90A_MODULES and _sm90():  # warpgroup MMA needs the arch-specific target
        options += ("-arch=sm_90a", "-DKDTREE_WGMMA=1")
    return cupy.RawModule(code=code, options=options)


_SM90A_MODULES = {"verify_attn"}
_SOURCE_EDITS: dict[str, tuple[tuple[str, str], ...]] = {}


def _edited(name: str, code: str, edits=None) -> str:
    for old, new in (_SOURCE_EDITS.get(name, ()) if edits is None else edits):
        if old not in code:
            raise ValueError(f"source_edits: {old!r} does not occur in cuda/{name}.cu")
        code = code.replace(old, new)
    return code


@contextlib.contextmanager
def source_edits(name: str, edits):
    """Timing experiments only: while the block runs, cuda/<name>.cu is compiled with the textual edits
    [(old, new), ...] applied (every occurrence; each old must occur, else ValueError). Outputs of an edited
    kernel are not meant to be right (bench.bench_verify_ablation removes parts of a tile's work this way)."""
    edits = tuple((str(a), str(b)) for a, b in edits)
    _edited(name, (cuda_source_dir() / f"{name}.cu").read_text(), edits)  # fail before any compile
    prev = _SOURCE_EDITS.get(name)
    _SOURCE_EDITS[name] = edits
    _clear_compiled()
    try:
        yield
    finally:
        if prev is None:
            _SOURCE_EDITS.pop(name, None)
        else:
            _SOURCE_EDITS[name] = prev
        _clear_compiled()


def _clear_compiled() -> None:
    _module.cache_clear()
    _kernel.cache_clear()
    _SMEM_OPTIN.clear()


@functools.cache
def _sm90() -> bool:
    """The current GPU is a Hopper (compute capability 9.0): sm_90a builds and the wgmma kernels."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@functools.cache
def _kernel(module: str, name: str):
    return _module(module).get_function(name)


_SMEM_OPTIN: dict = {}


def _launch(module: str, name: str, grid, block, args, smem: int = 0) -> None:
    import cupy
    k = _kernel(module, name)
    total = smem + k.shared_size_bytes  # the 48 KB default limit counts static + dynamic shared memory
    if total > 48 * 1024 and not _SMEM_OPTIN.get((module, name)):
        dev = torch.cuda.current_device()
        limit = cupy.cuda.runtime.getDeviceProperties(dev)["sharedMemPerBlockOptin"]
        if total > limit:
            raise ValueError(f"{name}: needs {total} bytes of shared memory, the device allows {limit}")
        k.max_dynamic_shared_size_bytes = limit - k.shared_size_bytes
        _SMEM_OPTIN[(module, name)] = True
    with _cupy_stream(torch.cuda.current_stream().cuda_stream):
        k(grid, block, args, shared_mem=smem)


@functools.cache
def _cupy_stream(ptr: int):
    """CuPy's handle on one of torch's streams (by its raw pointer), made once."""
    import warnings

    import cupy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers Stream.from_external
        return cupy.cuda.ExternalStream(ptr)


def _p(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _i(x) -> np.int32:
    return np.int32(x)


# ----------------------------------------------------------------------------- checks
POISON = False  # tests set this: outputs are filled with NaN / -7777 before every launch


def _empty(*shape, dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan") if dtype.is_floating_point else 0xA5 if dtype == torch.uint8 else -7777)
    return t


def _need(name: str, t, dtypes, ndim=None, shape=None, contiguous=True) -> None:
    """Type, dtype, rank, shape, contiguity, then device (so the first four are checkable on a CPU)."""
    checks.tensor(name, t, dtypes, ndim=ndim, shape=shape, contiguous=contiguous)


def _need_page_size(page_size) -> None:
    checks.positive_int("page_size", page_size)


def _on_one_gpu(**tensors) -> None:
    """After the static checks: every tensor on the same CUDA device, the current one (kernels launch on the
    current device's current stream)."""
    for k, v in tensors.items():
        if v.device.type != "cuda":
            raise ValueError(f"{k}: expected a CUDA tensor, got device {v.device}")
    devs = {k: v.device for k, v in tensors.items()}
    if len(set(devs.values())) > 1:
        raise ValueError(f"tensors on different devices: {devs}")
    dev, cur = next(iter(devs.values())), torch.cuda.current_device()
    if dev.index != cur:
        raise ValueError(f"tensors on {dev} but the current CUDA device is cuda:{cur}: call under "
                         f"torch.cuda.device({dev.index}) (or torch.cuda.set_device)")


def _check_budget(budget) -> int:
    return checks.int_in("budget", budget, 1, MAX_BUDGET)


def check_logit_values(logits: torch.Tensor, name: str = "logits") -> None:
    """NaN, +inf or an all -inf row -> ValueError (reads the device: not for graph capture)."""
    x = logits.float() if logits.dtype != torch.float32 else logits
    if bool(torch.isnan(x).any()):
        raise ValueError(f"{name}: NaN present; expected finite values or -inf")
    if bool(torch.isposinf(x).any()):
        raise ValueError(f"{name}: +inf present; expected finite values or -inf")
    if bool(torch.isneginf(x).all(dim=-1).any()):
        raise ValueError(f"{name}: a row is all -inf; expected at least one finite logit per depth")


# ----------------------------------------------------------------------------- top-K + log-softmax
@functools.cache
def _sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


# topk_partial's time per block on the H200 (512 threads, one block per SM): ~12.9 us fixed (its block-wide
# selection passes) + ~0.34 ns a column, fitted to batch 1 (270 blocks of 9,102 columns, 48 us) and batch 32
# (4,800 blocks of 16,384, 686 us) at V = 163,840.
TOPK_BLOCK_FIXED_S, TOPK_COLUMN_S = 12.9e-6, 0.34e-9


@functools.lru_cache(maxsize=256)
def _chunking(R: int, V: int, K: int, sms: int = 132) -> tuple[int, int]:
    """(chunks per row, chunk width) minimising the busiest SM's time: R * n_chunks blocks, one per SM at a
    time, each costing TOPK_BLOCK_FIXED_S + TOPK_COLUMN_S * width (a partial last round costs a whole one);
    at least 256 and at most MAX_CHUNK columns a chunk, a multiple of 8 columns (16-byte loads),
    n_chunks * K <= MAX_CANDIDATES; fewer chunks on a tie (less merging)."""
    lo = math.ceil(V / MAX_CHUNK)
    hi = max(lo, min(MAX_CANDIDATES // K, math.ceil(V / 256)))
    best = None
    for nch in range(lo, hi + 1):
        chunk = -(-math.ceil(V / nch) // 8) * 8
        n = math.ceil(V / chunk)
        cost = math.ceil(R * n / sms) * (TOPK_BLOCK_FIXED_S + TOPK_COLUMN_S * chunk)
        if best is None or cost < best[0]:
            best = (cost, n, chunk)
    return best[1], best[2]


def topk_logprobs(logits: torch.Tensor, k: int, check_values: bool = True):
    """logits [R, V] (or [..., V]) bf16/fp32 -> (tokens int32 [R, k'], logprobs fp32 [R, k']), k' = min(k, V);
    sorted by logit descending (so by log-probability), then token ascending (golden.topk_logprobs)."""
    _need("logits", logits, (torch.float32, torch.bfloat16))
    if logits.dim() < 2 or logits.shape[-1] == 0 or logits.numel() == 0:
        raise ValueError(f"logits: expected a non-empty [..., V] tensor, got shape {tuple(logits.shape)}")
    V = logits.shape[-1]
    if V > MAX_VOCAB:
        raise ValueError(f"logits: vocabulary {V} exceeds the supported maximum {MAX_VOCAB}")
    k = checks.int_in("k", k, 1, MAX_BUDGET)
    _on_one_gpu(logits=logits)
    if check_values:
        check_logit_values(logits)
    x = logits.reshape(-1, V)
    R, K = x.shape[0], min(int(k), V)
    nch, chunk = _chunking(R, V, K, _sm_count(x.device))
    dev = x.device
    cand_key = _empty(R, nch, K, dtype=torch.int32, device=dev)
    cand_tok = _empty(R, nch, K, dtype=torch.int32, device=dev)
    part_max = _empty(R, nch, dtype=torch.float32, device=dev)
    part_sum = _empty(R, nch, dtype=torch.float64, device=dev)
    out_tok = _empty(R, K, dtype=torch.int32, device=dev)
    out_lp = _empty(R, K, dtype=torch.float32, device=dev)
    small = "_small" if K <= TOPK_SMALL_K else ""  # few block barriers, lists ranked by counting
    name = f"topk_partial{small}_" + ("bf16" if x.dtype == torch.bfloat16 else "f32")
    _launch("tree_build", name, (nch, R), (512,),
            (_p(x), _i(V), _i(K), _i(chunk), _p(cand_key), _p(cand_tok), _p(part_max), _p(part_sum)))
    Kp = 1 << max(0, math.ceil(math.log2(K)))
    _launch("tree_build", f"topk_merge{small}", (R,), (1024,),
            (_p(cand_key), _p(cand_tok), _p(part_max), _p(part_sum), _i(nch), _i(K), _i(Kp), _p(out_tok),
             _p(out_lp)))  # both top-K kernels use static shared memory only
    return out_tok, out_lp


# ----------------------------------------------------------------------------- tree build
@dataclass
class TreeBatch:
    """Verify blocks of N = budget + 1 rows per request (root first); see cuda/tree_build.cu."""
    tokens: torch.Tensor     # int32 [b, N]
    positions: torch.Tensor  # int32 [b, N]
    parents: torch.Tensor    # int32 [b, N]
    depths: torch.Tensor     # int32 [b, N]
    scores: torch.Tensor     # float32 [b, N]
    mask: torch.Tensor       # uint32 bits as int32 [b, N, ceil(N / 32)]
    n_nodes: torch.Tensor    # int32 [b]

    def dense_mask(self) -> torch.Tensor:
        """bool [b, N, N] from the bits."""
        N = self.tokens.shape[1]
        j = torch.arange(N, device=self.mask.device)
        words = self.mask[:, :, j // 32]
        return ((words >> (j % 32)) & 1).bool()


TREE_REG_SLOTS = (1, 2, 4)  # frontier registers per lane of tree_build_c* (cuda/tree_build.cu); beyond: _groups


def tree_kernel(B: int) -> str:
    """tree_build_c{C} while one slot per node plus the root's fits C <= 4 registers per lane (B <= 127), else
    tree_build_groups (H200, batch 1: 20 vs 24 us at B = 64; 370 vs 700 us at B = 1024)."""
    need = math.ceil((B + 1) / 32)
    return next((f"tree_build_c{c}" for c in TREE_REG_SLOTS if c >= need), "tree_build_groups")


def tree_smem_bytes(B: int, L: int = 0, K: int = 0) -> int:
    """Dynamic shared memory of tree_build: popped keys, frontier keys (32 slots a group), slot scores, parent
    rows, and (L, K > 0) the staged log-probabilities [L, K]."""
    return 8 * B + 256 * math.ceil((B + 1) / 32) + 4 * (B + 1) + 4 * L * K + 2 * (B + 1)


TREE_SMEM_LIMIT = 200 * 1024


def tree_build(logits: torch.Tensor, budget: int, root_tokens: torch.Tensor, start_pos: torch.Tensor,
               check_values: bool = True) -> TreeBatch:
    """Draft logits [b, L, V] (bf16/fp32) -> per request the best-first tree of `budget` nodes, compiled.

    root_tokens, start_pos: int32/int64 [b] (the root's token and position). Same result as
    golden.ddtree + golden.compile_tree + golden.pack_mask_bits, request by request."""
    budget = _check_budget(budget)
    _need("logits", logits, (torch.float32, torch.bfloat16), ndim=3)
    b, L, V = logits.shape
    if b == 0 or L == 0 or V == 0:
        raise ValueError(f"logits: expected a non-empty [batch, L, V], got {tuple(logits.shape)}")
    if L > MAX_DEPTH:
        raise ValueError(f"logits: depth L={L} exceeds the supported maximum {MAX_DEPTH}")
    _need("root_tokens", root_tokens, (torch.int32, torch.int64), shape=(b,), contiguous=False)
    _need("start_pos", start_pos, (torch.int32, torch.int64), shape=(b,), contiguous=False)
    _on_one_gpu(logits=logits, root_tokens=root_tokens, start_pos=start_pos)
    tok, lp = topk_logprobs(logits.reshape(b * L, V), budget, check_values)
    K = tok.shape[1]
    N = budget + 1
    W = (N + 31) // 32
    dev = logits.device
    out = TreeBatch(*(_empty(b, N, dtype=dt, device=dev) for dt in
                      (torch.int32, torch.int32, torch.int32, torch.int32, torch.float32)),
                    mask=_empty(b, N, W, dtype=torch.int32, device=dev),
                    n_nodes=_empty(b, dtype=torch.int32, device=dev))
    root = root_tokens.to(torch.int32).contiguous()
    start = start_pos.to(torch.int32).contiguous()
    stage = tree_smem_bytes(budget, L, K) <= TREE_SMEM_LIMIT
    _launch("tree_build", tree_kernel(budget), (b,), (256,),
            (_p(tok), _p(lp), _i(L), _i(K), _i(budget), _i(int(stage)), _p(root),
             _p(start), _p(out.tokens), _p(out.positions),
             _p(out.parents), _p(out.depths), _p(out.scores), _p(out.mask), _p(out.n_nodes)),
            smem=tree_smem_bytes(budget, L, K) if stage else tree_smem_bytes(budget))
    return out


# ----------------------------------------------------------------------------- walk + compaction
def tree_walk(tokens: torch.Tensor, parents: torch.Tensor, choice: torch.Tensor, max_accept: int = MAX_DEPTH + 1):
    """Accept down the tree along the target's choices (golden.walk), for a batch of verify blocks.

    tokens, parents int32 [b, N]; choice int32/int64 [b, N] (target argmax or per-row samples).
    Returns accepted int32 [b, max_accept] (rows, root first, -1 padded), acc_len int32 [b], bonus int32 [b]."""
    _need("tokens", tokens, (torch.int32,), ndim=2)
    b, N = tokens.shape
    _need("parents", parents, (torch.int32,), shape=(b, N))
    _need("choice", choice, (torch.int32, torch.int64), shape=(b, N), contiguous=False)
    _on_one_gpu(tokens=tokens, parents=parents, choice=choice)
    if not 1 <= max_accept <= 1024:
        raise ValueError(f"max_accept={max_accept}: expected in [1, 1024]")
    ch = choice.to(torch.int32).contiguous()
    accepted = _empty(b, max_accept, dtype=torch.int32, device=tokens.device)
    acc_len = _empty(b, dtype=torch.int32, device=tokens.device)
    bonus = _empty(b, dtype=torch.int32, device=tokens.device)
    _launch("tree_walk", "tree_walk", (b,), (32,),
            (_p(tokens), _p(parents), _p(ch), _i(N), _i(max_accept), _p(accepted), _p(acc_len), _p(bonus)))
    return accepted, acc_len, bonus


def _check_pages(page_table: torch.Tensor, num_pages: int, check_values: bool) -> None:
    if check_values and page_table.numel():
        lo, hi = int(page_table.min()), int(page_table.max())
        if lo < 0 or hi >= num_pages:
            raise ValueError(f"page_table: page index out of range: expected [0, {num_pages}), got [{lo}, {hi}]")


def kv_compact(cache: torch.Tensor, page_table: torch.Tensor, block_start: torch.Tensor, accepted: torch.Tensor,
               acc_len: torch.Tensor, page_size: int = PAGE_SIZE, check_values: bool = True) -> None:
    """In place, per request and layer: row block_start + j <- row block_start + accepted[j], j < acc_len
    (golden.compact_kv). cache [layers, rows, D] (rows = pages * page_size; D * itemsize a multiple of 16)."""
    _need("cache", cache, (torch.bfloat16, torch.float16, torch.float32), ndim=3)
    _need_page_size(page_size)
    n_layers, rows, D = cache.shape
    row_bytes = D * cache.element_size()
    if row_bytes % 16:
        raise ValueError(f"cache: row of {row_bytes} bytes; expected a multiple of 16")
    if rows % page_size:
        raise ValueError(f"cache: {rows} rows is not a whole number of pages of {page_size}")
    _need("page_table", page_table, (torch.int32,), ndim=2)
    b, max_pages = page_table.shape
    _need("block_start", block_start, (torch.int32,), shape=(b,))
    _need("accepted", accepted, (torch.int32,), ndim=2)
    _need("acc_len", acc_len, (torch.int32,), shape=(b,))
    _on_one_gpu(cache=cache, page_table=page_table, block_start=block_start, accepted=accepted, acc_len=acc_len)
    _check_pages(page_table, rows // page_size, check_values)
    if accepted.shape[0] != b:
        raise ValueError(f"accepted: expected {b} rows (batch), got {accepted.shape[0]}")
    A = accepted.shape[1]
    if check_values:
        ln = acc_len.cpu()
        if int(ln.min()) < 0 or int(ln.max()) > A:
            raise ValueError(f"acc_len: expected values in [0, {A}]")
        acc = accepted.cpu()
        for i in range(b):
            a = acc[i, :int(ln[i])]
            if a.numel() and (int(a.min()) < 0 or (a.numel() > 1 and not bool((a[1:] > a[:-1]).all()))):
                raise ValueError(f"accepted[{i}]: expected strictly increasing rows >= 0")
            end = int(block_start[i]) + (int(a.max()) if a.numel() else 0)
            if end >= max_pages * page_size:
                raise ValueError(f"accepted[{i}]: row {end} is past the request's pages ({max_pages * page_size} rows)")
    _launch("tree_walk", "kv_compact", (b, n_layers), (128,),
            (_p(cache), np.int64(rows * row_bytes // 16), _i(row_bytes // 16), _p(page_table), _i(max_pages),
             _i(page_size), _p(block_start), _p(accepted), _i(A), _p(acc_len)), smem=A * row_bytes)


# ----------------------------------------------------------------------------- verify attention
VERIFY_SMEM = 64 * 584 * 2 + 2 * 32 * 584 * 2 + 64 * 40 * 2 + 4 * 64 * 4
VERIFY_WG_SMEM = 1024 + 3 * 9 * 8192 + 8192 + 3 * 64 * 4  # verify_attn_wg: slack, Q, 2 K/V tiles, P, row stats
VERIFY_WS_SMEM = 1024 + 9 * 8192 + 4 * 9 * 4096 + 8192 + 64 * 4 + 16 * 8  # verify_attn_ws: + 4 stages, barriers
# verify_attn_wg (Hopper), verify_attn_ws (Hopper, warp-specialized), verify_attn_partial (mma.sync, any sm_80+)
VERIFY_IMPLS = ("wgmma", "ws", "mma")
_VERIFY_KERNELS = {"wgmma": ("verify_attn_wg", VERIFY_WG_SMEM, 64), "ws": ("verify_attn_ws", VERIFY_WS_SMEM, 32),
                   "mma": ("verify_attn_partial", VERIFY_SMEM, 32)}  # kernel, dynamic shared memory, keys a tile


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [b, N, N] -> int32 bit words [b, N, ceil(N / 32)] (bit j % 32 of word j // 32)."""
    b, N, _ = mask.shape
    W = (N + 31) // 32
    m = torch.zeros(b, N, W * 32, dtype=torch.int64, device=mask.device)
    m[:, :, :N] = mask.to(torch.int64)
    weights = (1 << torch.arange(32, device=mask.device, dtype=torch.int64))
    words = (m.view(b, N, W, 32) * weights).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


MAX_SPLITS = 128  # context splits per (request, 64-row block): verify_attn.cu's MAX_SPLITS (combine's weights)


@functools.lru_cache(maxsize=1024)  # a Python search of up to 128 candidates: ~60 us a call uncached
def default_splits(b: int, NH: int, max_keys: int, sms: int = 132, tile: int = 32) -> int:
    """Context splits per (request, 64-row block) minimising the time in units of one tile's load (~72 KB a
    block): rounds of blocks (one per SM at a time; a partial last round costs a whole one) x (tiles per split
    + 1 for the Q load and start), plus the combine's reading of the splits' fp32 partials (2 KB per split and
    query row, spread over the SMs); at least 4 tiles a split; fewer splits on a tie. E.g. 64 row blocks on
    132 SMs: 2 splits (128 blocks, one round), not 3 (192 blocks, two rounds)."""
    blocks = b * math.ceil(NH / 64)
    tiles = math.ceil(max_keys / tile)
    best = None
    for s in range(1, max(1, min(MAX_SPLITS, tiles // 4)) + 1):
        cost = math.ceil(blocks * s / sms) * (math.ceil(tiles / s) + 1)
        if s > 1:
            cost += s * b * NH * 2048 / (sms * 73728)
        if best is None or cost < best[0]:
            best = (cost, s)
    return best[1]


def available_verify_impls() -> tuple[str, ...]:
    """The verify_attn kernels this GPU runs: all of VERIFY_IMPLS on compute capability 9.0, else only 'mma'."""
    return VERIFY_IMPLS if _sm90() else ("mma",)


def default_verify_impl() -> str:
    """verify_attn's kernel when impl is None: the warpgroup-MMA kernel on Hopper, the mma.sync kernel elsewhere."""
    return "wgmma" if _sm90() else "mma"


def verify_attn(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_len: torch.Tensor,
                mask: torch.Tensor, scale: float, page_size: int = PAGE_SIZE, n_splits: int | None = None,
                check_values: bool = True, impl: str | None = None, max_seq_len: int | None = None):
    """MLA-absorb tree-verify attention (golden.mla_tree_attention).

    q bf16 [b, N, H, 576]; cache bf16 [rows, 576] (one layer, paged); page_table int32 [b, max_pages];
    seq_len int32 [b] (cached rows including the N appended ones); mask: bool [b, N, N] or packed int32
    words [b, N, ceil(N/32)] over the appended block; scale: softmax scale (YaRN mscale included).
    impl: "wgmma" (Hopper's warpgroup MMA, tiles of 64 keys), "ws" (warpgroup MMA, warp-specialized over a
    4-stage ring of 32-key tiles) or "mma" (mma.sync, tiles of 32); None takes "wgmma" on a compute capability 9.0
    GPU, else "mma". max_seq_len: a bound on seq_len known on the host
    (a caller's cache length), which sizes the context splits; without it they are sized for seq_len's maximum
    when check_values, else for the page table's capacity (splits past a shorter context cost a little each).
    Returns out bf16 [b, N, H, 512], lse fp32 [b, N, H]."""
    if impl is not None and impl not in VERIFY_IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {VERIFY_IMPLS} or None")
    if n_splits is not None:
        n_splits = checks.int_in("n_splits", n_splits, 1, MAX_SPLITS, " (or None)")
    _need("q", q, (torch.bfloat16,), ndim=4)
    b, N, H, Dq = q.shape
    if Dq != D_QK:
        raise ValueError(f"q: expected head dim {D_QK} (512 latent + 64 rope), got {Dq}")
    if min(b, N, H) == 0:
        raise ValueError(f"q: expected a non-empty [b, N, H, {D_QK}] tensor, got shape {tuple(q.shape)}")
    _need_page_size(page_size)
    _need("cache", cache, (torch.bfloat16,), ndim=2)
    if cache.shape[1] != D_QK:
        raise ValueError(f"cache: expected rows of {D_QK}, got shape {tuple(cache.shape)}")
    if cache.shape[0] % page_size:
        raise ValueError(f"cache: {cache.shape[0]} rows is not a whole number of pages of {page_size}")
    _need("page_table", page_table, (torch.int32,), ndim=2)
    if page_table.shape[0] != b:
        raise ValueError(f"page_table: expected {b} rows (batch), got {page_table.shape[0]}")
    _need("seq_len", seq_len, (torch.int32,), shape=(b,))
    W = (N + 31) // 32
    if mask.dtype == torch.bool:
        _need("mask", mask, (torch.bool,), shape=(b, N, N), contiguous=False)
    else:
        _need("mask", mask, (torch.int32,), shape=(b, N, W))
    max_keys = page_table.shape[1] * page_size
    keys = max_keys  # what the context splits are sized for
    if max_seq_len is not None:
        keys = checks.int_in("max_seq_len", max_seq_len, N, max_keys, f" (N={N} to pages x page_size)")
    _on_one_gpu(q=q, cache=cache, page_table=page_table, seq_len=seq_len, mask=mask)
    _check_pages(page_table, cache.shape[0] // page_size, check_values)
    if mask.dtype == torch.bool:
        if check_values and not bool(mask.diagonal(dim1=1, dim2=2).all()):
            raise ValueError("mask: every appended row must see itself (the diagonal must be True)")
        mask = pack_mask(mask)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: expected a positive finite float")
    if check_values:
        lo, hi = int(seq_len.min()), int(seq_len.max())
        if lo < N or hi > keys:
            what = "max_seq_len" if max_seq_len is not None else "pages x page_size"
            raise ValueError(f"seq_len: expected values in [N={N}, {keys}] ({what}), got [{lo}, {hi}]")
        keys = hi
    NH = N * H
    if impl is None:
        impl = default_verify_impl()
    elif impl != "mma" and not _sm90():
        raise ValueError(f'impl="{impl}": needs a compute capability 9.0 GPU (Hopper); use impl="mma"')
    name, smem, tile = _VERIFY_KERNELS[impl]
    if n_splits is None:
        n_splits = default_splits(b, NH, keys, _sm_count(q.device), tile)
    dev = q.device
    ws_o = _empty(n_splits, b, NH, D_V, dtype=torch.float32, device=dev)
    ws_ml = _empty(n_splits, b, NH, 2, dtype=torch.float32, device=dev)
    out = _empty(b, N, H, D_V, dtype=torch.bfloat16, device=dev)
    lse = _empty(b, N, H, dtype=torch.float32, device=dev)
    _launch("verify_attn", name, (n_splits, math.ceil(NH / 64), b), (256,),
            (_p(q), _p(cache), _p(page_table), _i(page_table.shape[1]), _i(page_size), _p(seq_len), _p(mask),
             _i(N), _i(H), np.float32(scale * math.log2(math.e)), _p(ws_o), _p(ws_ml)), smem=smem)
    _launch("verify_attn", "verify_attn_combine", (NH, b), (128,),
            (_p(ws_o), _p(ws_ml), _i(n_splits), _i(NH), _p(out), _p(lse)))
    return out, lse


# ----------------------------------------------------------------------------- INT4 MoE experts
MOE_TILE_TOKENS = (8, 16)  # moe_int4's expert GEMMs: pairs per pass of one expert (moe_*_t8 / moe_*_t16)
FUSED_MAX_PAIRS = 64       # moe_fused_t8_*: the whole call in one launch up to this many token-expert pairs
FUSED_BLOCKS_PER_SM = 4    # moe_fused_t8_*'s persistent grid (moe_int4.cu's MOE_FUSED_MINB: its register budget)
_FUSED_SYNC: dict = {}     # (device, stream) -> int32 [4 + FUSED_MAX_PAIRS] counters, zero between calls


def _fused_sync(dev: torch.device) -> torch.Tensor:
    """The fused kernel's counters for the stream it launches on (the current one), zero before each call (the
    kernel's last block resets them). Outside graph capture: one buffer per stream, allocated zeroed on first
    use; calls on one stream run in order, so it is never shared by two calls in flight. Inside a capture: a
    buffer of the graph's own (its zero fill is recorded too), so graphs replayed on other streams never share."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(4 + FUSED_MAX_PAIRS, dtype=torch.int32, device=dev)
    key = (dev.index, torch.cuda.current_stream().cuda_stream)
    buf = _FUSED_SYNC.get(key)
    if buf is None:
        buf = _FUSED_SYNC[key] = torch.zeros(4 + FUSED_MAX_PAIRS, dtype=torch.int32, device=dev)
    return buf


MAX_GROUP_EXPERTS = 4096  # moe_group_*: two int32 per expert in shared memory


def group_pairs(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int):
    """Token-expert pairs grouped by expert, with no host sync (graph-capturable), on any device
    (golden.group_pairs' contract).

    Returns pair_tok int32 [P] (the token of each pair, P = T * k, pairs grouped by expert), pair_w float32 [P],
    expert_off int32 [E + 1] (expert e owns pairs [off[e], off[e + 1])) and active int32 [min(E, P)] (the
    experts that have pairs first, by id, then empty ones). Ids outside [0, E) are dropped (expert parallelism
    marks another rank's experts -1): entries past expert_off[E] are then unspecified. On a CUDA device one
    launch of moe_group_* (the order of pairs within an expert is then unspecified); elsewhere torch ops
    (stable order)."""
    if topk_ids.is_cuda and n_experts <= MAX_GROUP_EXPERTS:
        return _group_pairs_kernel(topk_ids, topk_weights, n_experts)
    return _group_pairs_torch(topk_ids, topk_weights, n_experts)


def _group_pairs_kernel(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int):
    T, k = topk_ids.shape
    P, dev = T * k, topk_ids.device
    ids = topk_ids.contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    pair_tok = _empty(P, dtype=torch.int32, device=dev)
    pair_w = _empty(P, dtype=torch.float32, device=dev)
    expert_off = _empty(n_experts + 1, dtype=torch.int32, device=dev)
    S = min(n_experts, P)
    active = _empty(S, dtype=torch.int32, device=dev)
    name = "moe_group_i32" if ids.dtype == torch.int32 else "moe_group_i64"
    _launch("moe_int4", name, (1,), (1024,), (_p(ids), _p(w), _i(P), _i(k), _i(n_experts), _i(S), _p(pair_tok),
                                              _p(pair_w), _p(expert_off), _p(active)), smem=8 * n_experts)
    return pair_tok, pair_w, expert_off, active


def _group_pairs_torch(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int):
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat < n_experts), flat, n_experts)  # out of range: a bucket past the last
    order = torch.argsort(flat, stable=True)
    pair_tok = (order // k).to(torch.int32)
    pair_w = topk_weights.reshape(-1)[order].to(torch.float32).contiguous()
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))[:n_experts]
    expert_off = torch.zeros(n_experts + 1, dtype=torch.int32, device=flat.device)
    expert_off[1:] = torch.cumsum(counts, 0).to(torch.int32)
    active = torch.argsort((counts == 0).to(torch.int8), stable=True)[:min(n_experts, T * k)].to(torch.int32)
    return pair_tok, pair_w, expert_off, active


def repack_int4_mma(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint-format INT4 [..., R, K/8] int32 + [..., R, K/32] scales -> moe_int4's fragment order:
    int32 [..., R/16, K/32, 32, 2] and scales [..., R/16, K/32, 8, 2] (layout in cuda/moe_int4.cu: word j of
    lane (g, c) holds A register b as nibbles b and 4 + b). Torch ops on the tensors' device; R a multiple of
    16, K of 32."""
    *lead, R, K8 = packed.shape
    K = K8 * 8
    if R % 16 or K % 32 or tuple(scale.shape) != (*lead, R, K // 32):
        raise ValueError(f"repack: expected packed [..., R, K/8] and scale [..., R, K/32] with R % 16 == 0 and "
                         f"K % 32 == 0, got {tuple(packed.shape)} and {tuple(scale.shape)}")
    G = K // 32
    b = packed.contiguous().view(torch.uint8).view(*lead, R // 16, 2, 8, G, 2, 2, 4)  # tile, half, g, grp, j, w, c
    n = len(lead)
    perm = list(range(n)) + [n + i for i in (0, 3, 2, 6, 4, 5, 1)]                   # tile, grp, g, c, j, w, half
    regs = b.permute(*perm).reshape(-1, 4)                                           # register b = 2 w + half
    wr = torch.empty(regs.shape[0], dtype=torch.int32, device=packed.device)
    shift = 4 * torch.arange(4, device=packed.device, dtype=torch.int64)
    for i in range(0, regs.shape[0], 1 << 24):                                       # 512 MB of int64 at a time
        r = regs[i:i + (1 << 24)].to(torch.int64)
        word = (((r & 0xF) << shift) | ((r >> 4) << (shift + 16))).sum(-1)           # disjoint bits: sum = or
        wr[i:i + (1 << 24)] = word - ((word >> 31) << 32)                            # as signed 32-bit
    wr = wr.view(*lead, R // 16, G, 32, 2)
    sr = scale.contiguous().view(*lead, R // 16, 2, 8, G)
    sr = sr.permute(*(list(range(n)) + [n, n + 3, n + 2, n + 1])).contiguous()       # tile, grp, g, half
    return wr, sr


@dataclass
class MoeWeights:
    """Routed INT4 experts in moe_int4's fragment order (repack_moe); E experts, hidden D, intermediate I."""
    w13: torch.Tensor  # int32 [E, 2I/16, D/32, 32, 2]
    s13: torch.Tensor  # bf16 [E, 2I/16, D/32, 8, 2]
    w2: torch.Tensor   # int32 [E, D/16, I/32, 32, 2]
    s2: torch.Tensor   # bf16 [E, D/16, I/32, 8, 2]
    E: int
    D: int
    I: int


def repack_moe(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
               w2_scale: torch.Tensor) -> MoeWeights:
    """Checkpoint-format stacked experts (kdtree.model.Int4Experts' buffers) -> MoeWeights, checked:
    w13_packed int32 [E, 2I, D/8] (rows [0, I) gate, [I, 2I) up), w13_scale bf16 [E, 2I, D/32],
    w2_packed int32 [E, D, I/8], w2_scale bf16 [E, D, I/32]; D and I multiples of 32."""
    _need("w13_packed", w13_packed, (torch.int32,), ndim=3)
    E, I2, D8 = w13_packed.shape
    I, D = I2 // 2, D8 * 8
    if E == 0 or I == 0 or I2 % 2 or I % 32 or D == 0 or D % 32:
        raise ValueError(f"w13_packed: expected int32 [E, 2I, D/8] with I and D positive multiples of 32, got "
                         f"{tuple(w13_packed.shape)}")
    _need("w13_scale", w13_scale, (torch.bfloat16,), shape=(E, I2, D // 32))
    _need("w2_packed", w2_packed, (torch.int32,), shape=(E, D, I // 8))
    _need("w2_scale", w2_scale, (torch.bfloat16,), shape=(E, D, I // 32))
    w13, s13 = repack_int4_mma(w13_packed, w13_scale)
    w2, s2 = repack_int4_mma(w2_packed, w2_scale)
    return MoeWeights(w13, s13, w2, s2, E, D, I)


def moe_int4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: MoeWeights,
             check_values: bool = True, tile_tokens: int | None = None, fused: bool | None = None) -> torch.Tensor:
    """Routed experts with INT4 weights (golden.moe_int4 on the checkpoint-format tensors).

    x bf16 [T, D]; topk_ids int32/int64 [T, k]; topk_weights float32 [T, k]; weights: repack_moe(...).
    Returns float32 [T, D]. Pairs are grouped by expert in one launch (group_pairs, no host sync), then two
    launches: gate+up with SiLU * mul into a bf16 workspace, down + combine. tile_tokens (MOE_TILE_TOKENS): pairs
    per pass of one expert; default 8 while experts hold few pairs (T <= 8, or T * k <= 8 E), else 16 (H200, K2.6
    shapes: 8 is 1.2x faster at 1-256 tokens, 16 is 1.2x faster at 1024). fused: the whole call in one launch
    (moe_fused_t8_*: grouping, zeroing, gate+up and down in a persistent grid) for at most FUSED_MAX_PAIRS pairs;
    default: for one token (T == 1) unless tile_tokens is 16 (H200, K2.6 shapes: 0.073 vs 0.080 ms at one token
    with three fused blocks per SM, 0.067 at FUSED_BLOCKS_PER_SM = 4; not faster than the three launches from two
    tokens on)."""
    if tile_tokens is not None and tile_tokens not in MOE_TILE_TOKENS:
        raise ValueError(f"tile_tokens={tile_tokens!r}: expected one of {MOE_TILE_TOKENS} or None")
    if fused and tile_tokens == 16:
        raise ValueError("fused=True runs 8-pair passes: expected tile_tokens None or 8")
    if not isinstance(weights, MoeWeights):
        raise ValueError(f"weights: expected a MoeWeights from kernels.repack_moe, got {type(weights).__name__}")
    E, D, I = weights.E, weights.D, weights.I
    _need("x", x, (torch.bfloat16,), ndim=2)
    T = x.shape[0]
    if T == 0 or x.shape[1] != D:
        raise ValueError(f"x: expected [T, {D}] with T > 0 (the experts' hidden size), got {tuple(x.shape)}")
    _need("topk_ids", topk_ids, (torch.int32, torch.int64), ndim=2, contiguous=False)
    if topk_ids.shape[0] != T or topk_ids.shape[1] == 0:
        raise ValueError(f"topk_ids: expected shape ({T}, k) with k >= 1, got {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    P = T * k
    if fused and P > FUSED_MAX_PAIRS:
        raise ValueError(f"fused=True: expected T * k <= {FUSED_MAX_PAIRS} token-expert pairs, got {T} x {k} = {P}")
    _need("topk_weights", topk_weights, (torch.float32,), shape=(T, k), contiguous=False)
    _on_one_gpu(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=weights.w13, s13=weights.s13,
                w2=weights.w2, s2=weights.s2)
    if check_values:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"topk_ids: expected expert ids in [0, {E}), got values in [{lo}, {hi}]")
    if fused is None:
        fused = T == 1 and P <= FUSED_MAX_PAIRS and tile_tokens != 16
    if fused:
        return _moe_fused(x, topk_ids, topk_weights, weights)
    pair_tok, pair_w, expert_off, active = group_pairs(topk_ids, topk_weights, E)
    slots = active.shape[0]
    h = _empty(T * k, I, dtype=torch.bfloat16, device=x.device)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    if tile_tokens is None:
        tile_tokens = 8 if T <= 8 or T * k <= 8 * E else 16
    t = f"t{tile_tokens}"
    _launch("moe_int4", "moe_gate_up_" + t, (I // 16, slots), (256,),
            (_p(x), _p(pair_tok), _p(expert_off), _p(active), _p(weights.w13), _p(weights.s13), _i(D), _i(I), _p(h)))
    _launch("moe_int4", "moe_down_" + t, (D // 32, slots), (256,),  # bf16 tensors go as raw pointers (uint16 in .cu)
            (_p(h), _p(pair_tok), _p(pair_w), _p(expert_off), _p(active), _p(weights.w2), _p(weights.s2), _i(D),
             _i(I), _p(out)))
    return out


def _moe_fused(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: MoeWeights) -> torch.Tensor:
    """moe_int4 in one launch of moe_fused_t8_* (checked arguments; T * k <= FUSED_MAX_PAIRS)."""
    E, D, I = weights.E, weights.D, weights.I
    T, k = topk_ids.shape
    dev = x.device
    ids = topk_ids.contiguous()
    w = topk_weights.contiguous()
    h = _empty(T * k, I, dtype=torch.bfloat16, device=dev)
    out = _empty(T, D, dtype=torch.float32, device=dev)  # the kernel zeroes it before accumulating
    n_sm = _sm_count(dev)
    name = "moe_fused_t8_i32" if ids.dtype == torch.int32 else "moe_fused_t8_i64"
    _launch("moe_int4", name, (FUSED_BLOCKS_PER_SM * n_sm,), (256,),
            (_p(x), _p(ids), _p(w), _i(T * k), _i(k), _i(E), _p(weights.w13), _p(weights.s13), _p(weights.w2),
             _p(weights.s2), _i(D), _i(I), _i(T), _p(h), _p(out), _p(_fused_sync(dev))))
    return out
