"""The CUDA kernels of cuda/ (shipped as kdtree.cuda) behind torch wrappers, one module per kernel family,
each with its numpy golden twin beside it:

    loader       compile (NVRTC via CuPy), cache, launch on torch's current stream; shared argument checks
    tree         topk_logprobs, tree_build -> TreeBatch          (tree_build.cu)   twin: tree_golden
    walk         tree_walk, kv_compact                           (tree_walk.cu)    twin: walk_golden
    verify_attn  verify_attn (+ combine), pack_mask              (verify_attn.cu)  twin: verify_attn_golden
    moe_int4     repack_moe -> MoeWeights, moe_int4, group_pairs (moe_int4.cu)     twin: moe_int4_golden
    moe_bf16     moe_bf16: bf16 experts, a few pairs a call      (moe_bf16.cu)     twin: moe_bf16_golden
    plan_estimates  plan_estimates (budget="auto")     (plan_estimates.cu)  twin: plan_estimates_golden
    decode       the fused decode layer's small kernels          (decode_fused.cu) twin: decode_golden
    gemv         gemv: skinny bf16 GEMMs                         (gemv.cu)         twin: gemv_golden
    draft_attn   draft_attn: the drafter's GQA attention         (draft_attn.cu)   twin: draft_attn_golden
    attn_merge   merge_states: two passes merged by lse          (attn_merge.cu)   twin: attn_merge_golden
    (kdtree.bridge launches sglang_tree.cu)                                         twin: sglang_golden
  and the torch glue of a verify split at a page boundary (a prefix / rest cascade):
    attn_split   split_rows, shift_pages, merge_lse              (torch)           twin: verify_attn_golden
    flashinfer_prefix  FlashInferPrefix: FlashInfer's MLA over the prefix, where installed  (same twin)

Wrappers take and return torch tensors, check every argument before compiling or launching (ValueError naming
it), and launch with no host round trip unless check_values reads the device. kdtree.kernels and kdtree.golden
re-export these modules' names.
"""
