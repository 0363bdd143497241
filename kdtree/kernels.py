"""The CUDA kernel wrappers, re-exported from kdtree.ops (one module per kernel family; see kdtree/ops/).

    ops.tree         topk_logprobs(logits, k) -> (tokens int32 [R, k], logprobs fp32 [R, k]);
                     tree_build(logits, budget, root, start) -> TreeBatch (verify blocks of budget + 1 rows)
    ops.walk         tree_walk(tokens, parents, choice) -> (accepted int32 [b, A], acc_len [b], bonus [b]);
                     kv_compact(cache, page_table, ...) in place
    ops.verify_attn  verify_attn(q, cache, page_table, seq_len, mask, scale) -> (out bf16 [b, N, H, 512],
                     lse fp32 [b, N, H]); pack_mask(bool [b, N, N]) -> int32 words
    ops.moe_int4     repack_moe(w13, s13, w2, s2) -> MoeWeights; moe_int4(x, topk_ids, topk_weights, weights)
                     -> fp32 [T, D]; group_pairs
    ops.moe_bf16     moe_bf16(x, topk_ids, topk_weights, w13, w2) -> fp32 [T, D] (bf16 experts, few pairs)
    ops.plan_estimates  plan_estimates(scores, depths, chain_lp, ...) -> fp32 [b, plans] (budget="auto")
    ops.loader       _launch, _empty, _p, _i, _need, _on_one_gpu, compile_defines, cuda_source_dir, ...

Every name kdtree.kernels had is here (the private ones importable, outside __all__), bound to the same
object as in its home module.
Rebinding a name on this module changes only what is looked up through it (callers that call
`kernels.verify_attn`); flags the wrappers read, such as POISON (kdtree.ops.loader) and TOPK_SMALL_K
(kdtree.ops.tree), must be set in their home module.
"""
from __future__ import annotations

from .ops.loader import (PAGE_SIZE, POISON, _check_pages, _clear_compiled, _cupy_stream, _empty, _i,
                         _kernel, _launch, _module, _need, _need_page_size, _on_one_gpu, _p, _SM90A_MODULES,
                         _sm90, _sm_count, _SMEM_OPTIN, _DEFINES, cuda_source_dir, cuda_sources,
                         compile_defines)
from .ops.moe_int4 import (FUSED_BLOCKS_PER_SM, FUSED_MAX_PAIRS, MAX_GROUP_EXPERTS, MAX_GROUP_PAIRS,
                           MOE_TILE_TOKENS, _FUSED_SYNC, _fused_sync, _group_items_torch, _group_kernel,
                           _group_pairs_kernel, _group_pairs_torch, _moe_fused, MoeWeights, group_pairs,
                           item_chunk, item_rows, moe_int4, repack_int4_mma, repack_moe)
from .ops.moe_bf16 import moe_bf16
from .ops.plan_estimates import plan_estimates
from .ops.tree import (MAX_BUDGET, MAX_CANDIDATES, MAX_CHUNK, MAX_DEPTH, MAX_VOCAB, TOPK_BLOCK_FIXED_S,
                       TOPK_COLUMN_S, TOPK_SMALL_K, TOPK_SMALL_MAX_K, TREE_REG_SLOTS, TREE_SMEM_LIMIT,
                       _check_budget, _chunking, TreeBatch, check_logit_values, topk_logprobs, tree_build,
                       tree_kernel, tree_smem_bytes)
from .ops.verify_attn import (D_QK, D_V, MAX_SPLITS, VERIFY_IMPLS, VERIFY_SMEM, VERIFY_WG_SMEM,
                              VERIFY_WS_SMEM, _VERIFY_KERNELS, available_verify_impls, default_splits,
                              default_verify_impl, pack_mask, verify_attn)
from .ops.walk import kv_compact, tree_walk

__all__ = [
    # ops.loader
    "PAGE_SIZE", "POISON", "cuda_source_dir", "cuda_sources", "compile_defines",
    # ops.tree
    "MAX_BUDGET", "MAX_CANDIDATES", "MAX_CHUNK", "MAX_DEPTH", "MAX_VOCAB", "TOPK_BLOCK_FIXED_S",
    "TOPK_COLUMN_S", "TOPK_SMALL_K", "TOPK_SMALL_MAX_K", "TREE_REG_SLOTS", "TREE_SMEM_LIMIT", "TreeBatch",
    "check_logit_values", "topk_logprobs", "tree_build", "tree_kernel", "tree_smem_bytes",
    # ops.walk
    "kv_compact", "tree_walk",
    # ops.verify_attn
    "D_QK", "D_V", "MAX_SPLITS", "VERIFY_IMPLS", "VERIFY_SMEM", "VERIFY_WG_SMEM", "VERIFY_WS_SMEM",
    "available_verify_impls", "default_splits", "default_verify_impl", "pack_mask", "verify_attn",
    # ops.moe_int4
    "FUSED_BLOCKS_PER_SM", "FUSED_MAX_PAIRS", "MAX_GROUP_EXPERTS", "MAX_GROUP_PAIRS", "MOE_TILE_TOKENS",
    "MoeWeights", "group_pairs", "item_chunk", "item_rows", "moe_int4", "repack_int4_mma", "repack_moe",
    # ops.moe_bf16
    "moe_bf16",
    # ops.plan_estimates
    "plan_estimates",
]
