"""Bridges to other DDTree code: drop-ins for the public reference's tree functions, batch variants that stay
on the device, and SGLang's EAGLE tree format. Each runs the CUDA kernels on CUDA tensors and the golden
twins (golden.py) on CPU tensors; every name below is importable from kdtree.bridge.

Files, one format each (each module's docstring states its signatures and where it differs from the source):
    native     tensor-native, a batch with no host copy and no dicts (capturable in a CUDA graph):
               build_trees, follow_trees, tree_attention_mask
    reference  the public DDTree release's ddtree.py, same signatures and return types: build_ddtree_tree,
               compile_ddtree_tree, follow_verified_tree, compact_dynamic_cache, REFERENCE_SUBTIMES
    sglang     sgl-kernel's build_tree_kernel_efficient outputs and verify_tree_greedy: to_sglang,
               sglang_verify_greedy, SglangTensors, SGLANG_MAX_N
docs/bridges.md is the page for integrations.
"""
from ..kernels import TreeBatch
from .native import build_trees, follow_trees, tree_attention_mask
from .reference import (REFERENCE_SUBTIMES, build_ddtree_tree, compact_dynamic_cache, compile_ddtree_tree,
                        follow_verified_tree)
from .sglang import SGLANG_MAX_N, SglangTensors, sglang_verify_greedy, to_sglang

__all__ = ["REFERENCE_SUBTIMES", "SGLANG_MAX_N", "SglangTensors", "TreeBatch", "build_ddtree_tree",
           "build_trees", "compact_dynamic_cache", "compile_ddtree_tree", "follow_trees",
           "follow_verified_tree", "sglang_verify_greedy", "to_sglang", "tree_attention_mask"]
