"""Benchmarks as a package: one timer, the GPU's clock state, the baselines and the goals apart, one module
per kernel family, the engine-level benchmarks beside them.

  timer      measure(fn, repeats, mode): graph / events / wall / host timing, input sets rotated past L2
  clocks     gpu_state, settle_gpu: SM clock, power and clock caps from nvidia-smi
  ceilings   copy bandwidth and bf16 matmul rate, measured in the run that divides by them
  baselines  the reference paths every ratio is to (the public tree path, naive attention, bf16 MoE, HF)
  goals      goals.json: every goal of the lab, read by the benchmarks' targets and by the report
  tree, verify, moe, layer   the kernel families' benchmarks (notebook 01); suite: `python -m kdtree bench`
  engine     `python -m kdtree.bench.engine`: the engine against transformers, AR / DFlash / DDTree
             (engine_sections: its sections)
  e2e, k26   notebook 02's trained-pair and K2.6-shape sections (k26_cells, k26_record, k26_figure);
             bridge: `python -m kdtree bench --bridge`
  decode     `python -m kdtree.bench.decode`: decode layers against their byte floor (decode_layers), skinny
             GEMMs; floors: an engine round's byte floor by part
  peers      `python -m kdtree.bench.peers`: our kernels beside FlashInfer's and SGLang's, same inputs
             (peers_common: loading and timing the sides; peers_moe: INT4 MoE; peers_sections: top-k, GEMMs)
"""
import importlib

# each name of __all__ and its home module, imported on first use (so `python -m kdtree.bench.<module>` runs
# a module no import of this package has loaded yet)
_NAMES = {   # home module: the names this package hands on from it
    "baselines": ("dequant_bf16", "moe_bf16_baseline", "naive_verify", "reference_tree_round", "topk_only"),
    "ceilings": ("copy_bandwidth", "matmul_rate", "measure_ceilings"),
    "clocks": ("CAP_REASONS", "gpu_state", "parse_gpu_state", "settle_gpu"),
    "decode_layers": ("bench_layer_fused",),
    "goals": ("goals",),
    "layer": ("bench_layer", "layer_model"),
    "moe": ("MOE_WARM_S", "bench_moe"),
    "suite": ("run", "summary"),
    "timer": ("L2_BYTES", "Times", "input_sets", "measure"),
    "tree": ("bench_tree", "bench_tree_reference", "bench_walk"),
    "verify": ("VERIFY_ABLATIONS", "bench_attn", "bench_verify_ablation", "verify_smem_model"),
}
_HOMES = {name: home for home, names in _NAMES.items() for name in names}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mod = importlib.import_module(f".{home}", __name__)
    return mod if home == name else getattr(mod, name)


__all__ = ["CAP_REASONS", "L2_BYTES", "MOE_WARM_S", "Times", "VERIFY_ABLATIONS", "bench_attn", "bench_layer",
           "bench_layer_fused", "bench_moe", "bench_tree", "bench_tree_reference", "bench_verify_ablation",
           "bench_walk", "copy_bandwidth", "dequant_bf16", "goals", "gpu_state", "input_sets", "layer_model",
           "matmul_rate", "measure", "measure_ceilings", "moe_bf16_baseline", "naive_verify",
           "parse_gpu_state", "reference_tree_round", "run", "settle_gpu", "summary", "topk_only",
           "verify_smem_model"]
