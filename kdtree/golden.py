"""Numpy golden references, re-exported from their homes beside each kernel family in kdtree/ops/: each
function is the contract of a CUDA kernel in cuda/.

    tree_golden         top-K + log-softmax, the best-first tree (its order and tie-break), compile to a
                        verify block, packed mask bits, the brute-force order oracle (tree_build.cu)
    walk_golden         walk / greedy_walk / sampled_walk, compact_kv (tree_walk.cu)
    verify_attn_golden  mla_tree_attention (verify_attn.cu)
    moe_int4_golden     unpack_int4, dequant_int4, group_pairs, group_items, moe_int4 (moe_int4.cu)
    moe_bf16_golden     moe_bf16 (moe_bf16.cu)
    sglang_golden       SGLang's EAGLE tree format and its greedy accept (sglang_tree.cu)
    plan_estimates_golden  the auto budget's expected tokens per plan (plan_estimates.cu)

Every public and private name kdtree.golden had is here, bound to the same object as in its home module.
"""
from __future__ import annotations

from .ops.moe_bf16_golden import moe_bf16
from .ops.moe_int4_golden import dequant_int4, group_items, group_pairs, moe_int4, unpack_int4
from .ops.plan_estimates_golden import plan_estimates
from .ops.sglang_golden import (SGLANG_BITPACK_MAX_N, SGLANG_MODES, SglangTree, sglang_mask_bytes,
                                sglang_tree, sglang_verify_greedy)
from .ops.tree_golden import (MAX_BUDGET, Tree, VerifyBlock, _as_logits, _check_budget, _check_parents, _ids,
                              all_prefixes_ranked, ancestor_mask, build_tree, chain_tree, compile_tree,
                              ddtree, log_softmax, pack_mask_bits, topk_logprobs)
from .ops.verify_attn_golden import mla_tree_attention
from .ops.walk_golden import compact_kv, greedy_walk, sampled_walk, walk

__all__ = [
    # ops.tree_golden
    "MAX_BUDGET", "Tree", "VerifyBlock", "all_prefixes_ranked", "ancestor_mask", "build_tree", "chain_tree",
    "compile_tree", "ddtree", "log_softmax", "pack_mask_bits", "topk_logprobs",
    # ops.walk_golden
    "compact_kv", "greedy_walk", "sampled_walk", "walk",
    # ops.sglang_golden
    "SGLANG_BITPACK_MAX_N", "SGLANG_MODES", "SglangTree", "sglang_mask_bytes", "sglang_tree",
    "sglang_verify_greedy",
    # ops.verify_attn_golden
    "mla_tree_attention",
    # ops.moe_int4_golden
    "dequant_int4", "group_items", "group_pairs", "moe_int4", "unpack_int4",
    # ops.moe_bf16_golden
    "moe_bf16",
    # ops.plan_estimates_golden
    "plan_estimates",
]
