"""Routed INT4 experts (cuda/moe_int4.cu): token-expert grouping, the repacked weight layout, and the expert
GEMMs; golden twin: moe_int4_golden.

Contract:
  * repack_moe(w13_packed, w13_scale, w2_packed, w2_scale) -> MoeWeights: checkpoint-format stacked experts
    (w13 int32 [E, 2I, D/8] + bf16 [E, 2I, D/32], rows [0, I) gate and [I, 2I) up; w2 int32 [E, D, I/8] + bf16
    [E, D, I/32]; D and I multiples of 32) in the kernels' fragment order (repack_int4_mma; layout in
    moe_int4.cu).
  * moe_int4(x, topk_ids, topk_weights, weights): x bf16 [T, D], topk_ids int32/int64 [T, k] in [0, E),
    topk_weights fp32 [T, k] -> fp32 [T, D] = moe_int4_golden.moe_int4 on the checkpoint-format tensors.
    Either three launches (moe_group_*, moe_gate_up_t{8,16}, moe_down_t{8,16}) or, for at most
    FUSED_MAX_PAIRS token-expert pairs, one persistent launch of moe_fused_t8_* (FUSED_BLOCKS_PER_SM blocks
    per SM).
  * group_pairs(topk_ids, topk_weights, E): moe_int4_golden.group_pairs (order within an expert unspecified on
    the GPU), no host sync; at most MAX_GROUP_EXPERTS experts for the kernel path.
  * The expert GEMMs run one block per (feature tile, work item): an item is up to `chunk` pairs of one expert
    (moe_int4_golden.group_items), so every pass of an expert with many pairs runs at once (item_pairs).
Constants shared with moe_int4.cu: FUSED_MAX_PAIRS, FUSED_BLOCKS_PER_SM (MOE_FUSED_MINB), MAX_GROUP_EXPERTS,
MAX_GROUP_PAIRS, MOE_TILE_TOKENS.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .loader import _empty, _i, _launch, _need, _on_one_gpu, _p, _sm_count

MOE_TILE_TOKENS = (8, 16, 32)  # moe_int4's expert GEMMs: pairs per pass of one expert (moe_*_t8 .. _t32)
FUSED_MAX_PAIRS = 64       # moe_fused_t8_*: the whole call in one launch up to this many token-expert pairs
FUSED_BLOCKS_PER_SM = 4    # moe_fused_t8_*'s persistent grid (moe_int4.cu's MOE_FUSED_MINB: its registers)
_FUSED_SYNC: dict = {}     # (device, stream) -> int32 [4 + FUSED_MAX_PAIRS] counters, zero between calls


def _fused_sync(dev: torch.device) -> torch.Tensor:
    """The fused kernel's counters for the stream it launches on (the current one), zero before each call (the
    kernel's last block resets them). Outside graph capture: one buffer per stream, allocated zeroed on first
    use; calls on one stream run in order, so it is never shared by two calls in flight. Inside a capture: a
    buffer of the graph's own (its zero fill is recorded too), so graphs replayed on other streams never
    share."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(4 + FUSED_MAX_PAIRS, dtype=torch.int32, device=dev)
    key = (dev.index, torch.cuda.current_stream().cuda_stream)
    buf = _FUSED_SYNC.get(key)
    if buf is None:
        buf = _FUSED_SYNC[key] = torch.zeros(4 + FUSED_MAX_PAIRS, dtype=torch.int32, device=dev)
    return buf


MAX_GROUP_EXPERTS = 4096  # moe_group_*: two int32 per expert in shared memory
MAX_GROUP_PAIRS = (1 << 24) - 1  # moe_group_*: the pair offsets' field of its packed scan
MAX_GRID_Y = 65535        # the expert GEMMs' work items go on grid.y
SERIAL_PASSES = False     # True: item_pairs defaults to T * k (each expert's passes in order in one block)


def item_rows(P: int, S: int, chunk: int) -> int:
    """Rows of moe_group's items [Y, 2] that hold every work item of P pairs on at most S experts."""
    return -(-P // chunk) + S


def item_chunk(P: int, S: int, tile_tokens: int, item_pairs: int | None = None) -> int:
    """Pairs per work item: item_pairs if given, else one pass of the tile (tile_tokens pairs), made a
    multiple of it just large enough for the items to fit grid.y (MAX_GRID_Y)."""
    if item_pairs is not None:
        return item_pairs
    m = max(1, -(-P // (tile_tokens * max(1, MAX_GRID_Y - S))))
    while item_rows(P, S, m * tile_tokens) > MAX_GRID_Y:
        m += 1
    return m * tile_tokens


def group_pairs(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int):
    """Token-expert pairs grouped by expert, with no host sync (graph-capturable), on any device
    (moe_int4_golden.group_pairs' contract).

    Returns pair_tok int32 [P] (the token of each pair, P = T * k, pairs grouped by expert), pair_w float32
    [P], expert_off int32 [E + 1] (expert e owns pairs [off[e], off[e + 1])) and active int32 [min(E, P)] (the
    experts that have pairs first, by id, then empty ones). Ids outside [0, E) are dropped (expert parallelism
    marks another rank's experts -1): entries past expert_off[E] are then unspecified. On a CUDA device one
    launch of moe_group_* (the order of pairs within an expert is then unspecified); elsewhere torch ops
    (stable order)."""
    if topk_ids.is_cuda and n_experts <= MAX_GROUP_EXPERTS:
        return _group_pairs_kernel(topk_ids, topk_weights, n_experts)
    return _group_pairs_torch(topk_ids, topk_weights, n_experts)


def _group_pairs_kernel(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int):
    return _group_kernel(topk_ids, topk_weights, n_experts, 0)[:4]


def _group_kernel(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int, chunk: int):
    """One launch of moe_group_*: group_pairs' four tensors, and the work items int32 [Y, 2] of `chunk` pairs
    (Y = item_rows) when chunk > 0, else None."""
    T, k = topk_ids.shape
    P, dev = T * k, topk_ids.device
    ids = topk_ids.contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    pair_tok = _empty(P, dtype=torch.int32, device=dev)
    pair_w = _empty(P, dtype=torch.float32, device=dev)
    expert_off = _empty(n_experts + 1, dtype=torch.int32, device=dev)
    S = min(n_experts, P)
    active = _empty(S, dtype=torch.int32, device=dev)
    Y = item_rows(P, S, chunk) if chunk > 0 else 0
    items = _empty(Y, 2, dtype=torch.int32, device=dev) if chunk > 0 else None
    name = "moe_group_i32" if ids.dtype == torch.int32 else "moe_group_i64"
    items_p = _p(items) if items is not None else np.uint64(0)
    _launch("moe_int4", name, (1,), (1024,),
            (_p(ids), _p(w), _i(P), _i(k), _i(n_experts), _i(S), _i(chunk), _i(Y), _p(pair_tok), _p(pair_w),
             _p(expert_off), _p(active), items_p), smem=8 * n_experts)
    return pair_tok, pair_w, expert_off, active, items


def _group_items_torch(expert_off: torch.Tensor, chunk: int, Y: int) -> torch.Tensor:
    """moe_group's work items from the offsets with torch ops (no host sync): int32 [Y, 2]
    (moe_int4_golden.group_items)."""
    dev = expert_off.device
    off = expert_off.to(torch.int64)
    n = (off[1:] - off[:-1] + chunk - 1) // chunk                 # items of each expert
    end = torch.cumsum(n, 0)                                     # [E] items through expert e
    y = torch.arange(Y, device=dev)
    e = torch.searchsorted(end, y, right=True).clamp_(max=off.shape[0] - 2)
    p0 = off[e] + (y - (end[e] - n[e])) * chunk
    live = y < end[-1]
    return torch.stack([torch.where(live, e, -1), torch.where(live, p0, -1)], 1).to(torch.int32)


def _group_pairs_torch(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int):
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat < n_experts), flat, n_experts)  # out of range: one bucket past E
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
        raise ValueError(f"repack: expected packed [..., R, K/8] and scale [..., R, K/32] with R % 16 == 0 "
                         f"and K % 32 == 0, got {tuple(packed.shape)} and {tuple(scale.shape)}")
    G = K // 32
    # axes after the lead: tile, half, g, grp, j, w, c -> tile, grp, g, c, j, w, half; register b = 2 w + half
    b = packed.contiguous().view(torch.uint8).view(*lead, R // 16, 2, 8, G, 2, 2, 4)
    n = len(lead)
    perm = list(range(n)) + [n + i for i in (0, 3, 2, 6, 4, 5, 1)]
    regs = b.permute(*perm).reshape(-1, 4)
    wr = torch.empty(regs.shape[0], dtype=torch.int32, device=packed.device)
    shift = 4 * torch.arange(4, device=packed.device, dtype=torch.int64)
    for i in range(0, regs.shape[0], 1 << 24):  # 512 MB of int64 at a time
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
        raise ValueError(f"w13_packed: expected int32 [E, 2I, D/8] with I and D positive multiples of 32, "
                         f"got {tuple(w13_packed.shape)}")
    _need("w13_scale", w13_scale, (torch.bfloat16,), shape=(E, I2, D // 32))
    _need("w2_packed", w2_packed, (torch.int32,), shape=(E, D, I // 8))
    _need("w2_scale", w2_scale, (torch.bfloat16,), shape=(E, D, I // 32))
    w13, s13 = repack_int4_mma(w13_packed, w13_scale)
    w2, s2 = repack_int4_mma(w2_packed, w2_scale)
    return MoeWeights(w13, s13, w2, s2, E, D, I)


def check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, D: int) -> tuple:
    """(T, k) of a routed-experts call: x bf16 [T, D] with T > 0, topk_ids int32 / int64 [T, k] with k >= 1,
    topk_weights float32 [T, k]; ValueError naming the argument otherwise (reads no device memory)."""
    _need("x", x, (torch.bfloat16,), ndim=2)
    T = x.shape[0]
    if T == 0 or x.shape[1] != D:
        raise ValueError(f"x: expected [T, {D}] with T > 0 (the experts' hidden size), got {tuple(x.shape)}")
    _need("topk_ids", topk_ids, (torch.int32, torch.int64), ndim=2, contiguous=False)
    if topk_ids.shape[0] != T or topk_ids.shape[1] == 0:
        raise ValueError(f"topk_ids: expected shape ({T}, k) with k >= 1, got {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    _need("topk_weights", topk_weights, (torch.float32,), shape=(T, k), contiguous=False)
    return T, k


def check_ids(topk_ids: torch.Tensor, E: int) -> None:
    """Every expert id in [0, E) (reads the ids: not under graph capture)."""
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= E:
        raise ValueError(f"topk_ids: expected expert ids in [0, {E}), got values in [{lo}, {hi}]")


def moe_int4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: MoeWeights,
             check_values: bool = True, tile_tokens: int | None = None,
             fused: bool | None = None, item_pairs: int | None = None) -> torch.Tensor:
    """Routed experts with INT4 weights (moe_int4_golden.moe_int4 on the checkpoint-format tensors).

    x bf16 [T, D]; topk_ids int32/int64 [T, k]; topk_weights float32 [T, k]; weights: repack_moe(...).
    Returns float32 [T, D]. Pairs are grouped by expert in one launch (group_pairs, no host sync), then two
    launches: gate+up with SiLU * mul into a bf16 workspace, down + combine. tile_tokens (MOE_TILE_TOKENS):
    pairs per pass of one expert (a pass streams the expert's rows once; 32 reads an expert holding up to 32
    pairs once, at one block an SM); default 8 while experts hold few pairs (T <= 8, or T * k <= 8 E), else
    16. fused: the whole call in one launch (moe_fused_t8_*: grouping, zeroing, gate+up and down in a
    persistent grid of FUSED_BLOCKS_PER_SM blocks per SM) for at most FUSED_MAX_PAIRS pairs; default: for one
    token (T == 1) unless tile_tokens is 16 or 32 or item_pairs is given. item_pairs: pairs of one expert
    per block of the GEMMs (best a multiple of tile_tokens): default one pass (tile_tokens), so an expert's
    passes run in parallel (item_chunk widens it only to fit grid.y); item_pairs >= T * k runs each expert's
    passes in order in one block. check_values=True reads topk_ids to check them in [0, E) (not for graph
    capture)."""
    if tile_tokens is not None and tile_tokens not in MOE_TILE_TOKENS:
        raise ValueError(f"tile_tokens={tile_tokens!r}: expected one of {MOE_TILE_TOKENS} or None")
    if fused and tile_tokens in (16, 32):
        raise ValueError("fused=True runs 8-pair passes: expected tile_tokens None or 8")
    if not isinstance(weights, MoeWeights):
        raise ValueError(f"weights: expected a MoeWeights from kernels.repack_moe, "
                         f"got {type(weights).__name__}")
    E, D, I = weights.E, weights.D, weights.I
    T, k = check_routing(x, topk_ids, topk_weights, D)
    P = T * k
    if P > MAX_GROUP_PAIRS:
        raise ValueError(f"topk_ids: expected at most {MAX_GROUP_PAIRS} token-expert pairs (T * k), "
                         f"got {T} x {k} = {P}")
    if item_pairs is not None:
        if isinstance(item_pairs, bool) or not isinstance(item_pairs, int) or item_pairs <= 0:
            raise ValueError(f"item_pairs={item_pairs!r}: expected a positive int (pairs a work item) "
                             f"or None")
        if fused:
            raise ValueError("item_pairs applies to the grouped GEMMs: expected fused None or False")
    if fused and P > FUSED_MAX_PAIRS:
        raise ValueError(f"fused=True: expected T * k <= {FUSED_MAX_PAIRS} token-expert pairs, "
                         f"got {T} x {k} = {P}")
    _on_one_gpu(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=weights.w13, s13=weights.s13,
                w2=weights.w2, s2=weights.s2)
    if check_values:
        check_ids(topk_ids, E)
    if fused is None:
        fused = T == 1 and P <= FUSED_MAX_PAIRS and tile_tokens in (None, 8) and item_pairs is None
    if fused:
        return _moe_fused(x, topk_ids, topk_weights, weights)
    if tile_tokens is None:
        tile_tokens = 8 if T <= 8 or T * k <= 8 * E else 16
    S = min(E, P)
    chunk = item_chunk(P, S, tile_tokens, P if item_pairs is None and SERIAL_PASSES else item_pairs)
    Y = item_rows(P, S, chunk)
    if Y > MAX_GRID_Y:
        raise ValueError(f"item_pairs={item_pairs}: {Y} work items exceed grid.y's {MAX_GRID_Y}; "
                         f"expected at least {item_chunk(P, S, tile_tokens)} pairs an item")
    if topk_ids.is_cuda and E <= MAX_GROUP_EXPERTS:
        pair_tok, pair_w, expert_off, _, items = _group_kernel(topk_ids, topk_weights, E, chunk)
    else:
        pair_tok, pair_w, expert_off, _ = _group_pairs_torch(topk_ids, topk_weights, E)
        items = _group_items_torch(expert_off, chunk, Y)
    h = _empty(T * k, I, dtype=torch.bfloat16, device=x.device)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    t = f"t{tile_tokens}"
    _launch("moe_int4", "moe_gate_up_" + t, (I // 16, Y), (256,),
            (_p(x), _p(pair_tok), _p(expert_off), _p(items), _i(chunk), _p(weights.w13), _p(weights.s13),
             _i(D), _i(I), _p(h)))
    _launch("moe_int4", "moe_down_" + t, (D // 32, Y), (256,),  # bf16 as raw pointers (uint16 in .cu)
            (_p(h), _p(pair_tok), _p(pair_w), _p(expert_off), _p(items), _i(chunk), _p(weights.w2),
             _p(weights.s2), _i(D), _i(I), _p(out)))
    return out


def _moe_fused(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               weights: MoeWeights) -> torch.Tensor:
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
