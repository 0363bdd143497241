"""Routed experts with bf16 weights for a few token-expert pairs a call (cuda/moe_bf16.cu); golden twin:
moe_bf16_golden.

Contract:
  * moe_bf16(x, topk_ids, topk_weights, w13, w2): x bf16 [T, D], topk_ids int32/int64 [T, k] in [0, E),
    topk_weights fp32 [T, k], w13 bf16 [E, 2I, D] (rows [0, I) gate, [I, 2I) up), w2 bf16 [E, D, I] ->
    fp32 [T, D] = moe_bf16_golden.moe_bf16 (the hidden activations rounded to bf16 in between). Three
    launches, no host sync: moe_int4's moe_group_* (the pairs grouped by expert), moe_bf16_gate_up into a bf16
    workspace, moe_bf16_down accumulating into the zeroed output with fp32 atomics.
  * fits(T, k, w13, w2): whether the call is this kernel's (at most MAX_PAIRS pairs, D and I multiples of 8).
"""
from __future__ import annotations

import torch

from .loader import _empty, _i, _launch, _need, _on_one_gpu, _p
from .moe_int4 import MAX_GROUP_EXPERTS, check_ids, check_routing, group_pairs

MAX_PAIRS = 256   # past this many pairs a grouped GEMM reads each expert's rows fewer times
WARPS = 8         # moe_bf16.cu: rows a block (one per warp)


def fits(T: int, k: int, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether moe_bf16 takes T tokens of k experts over these weights."""
    E, I2, D = w13.shape
    return (T * k <= MAX_PAIRS and 0 < E <= MAX_GROUP_EXPERTS and D > 0 and D % 8 == 0 and I2 > 0
            and I2 % 16 == 0 and tuple(w2.shape) == (E, D, I2 // 2))


def moe_bf16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, check_values: bool = True) -> torch.Tensor:
    """Routed experts with bf16 weights (module contract). check_values=True reads topk_ids to check them in
    [0, E) (not for graph capture)."""
    _need("w13", w13, (torch.bfloat16,), ndim=3)
    E, I2, D = w13.shape
    if 0 in (E, I2, D) or I2 % 16 or D % 8:
        raise ValueError(f"w13: expected [E, 2I, D] with E > 0 and I, D positive multiples of 8, got "
                         f"{tuple(w13.shape)}")
    I = I2 // 2
    _need("w2", w2, (torch.bfloat16,), shape=(E, D, I))
    T, k = check_routing(x, topk_ids, topk_weights, D)
    if T * k > MAX_PAIRS or E > MAX_GROUP_EXPERTS:
        raise ValueError(f"moe_bf16: {T} x {k} pairs over {E} experts: expected at most {MAX_PAIRS} pairs "
                         f"and {MAX_GROUP_EXPERTS} experts (fits() says which calls it takes)")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned tensor (the kernel reads 16 bytes a lane)")
    _on_one_gpu(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2)
    if check_values:
        check_ids(topk_ids, E)
    pair_tok, pair_w, expert_off, active = group_pairs(topk_ids, topk_weights, E)
    slots = active.shape[0]
    h = _empty(T * k, I, dtype=torch.bfloat16, device=x.device)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    _launch("moe_bf16", "moe_bf16_gate_up", (-(-I // WARPS), slots), (256,),
            (_p(x), _p(pair_tok), _p(expert_off), _p(active), _p(w13), _i(D), _i(I), _p(h)))
    _launch("moe_bf16", "moe_bf16_down", (-(-D // WARPS), slots), (256,),
            (_p(h), _p(pair_tok), _p(pair_w), _p(expert_off), _p(active), _p(w2), _i(D), _i(I), _p(out)))
    return out
