"""INT4 group-32 routed experts at Kimi K2.6's shape (384 experts, top 8, hidden 7168 -> 2048): our moe_int4
kernel beside SGLang's Triton fused MoE for int4 w4a16 weights, same inputs; a section of
`python -m kdtree.bench.peers` (`moe_section`).

SGLang's side is loaded by path from the installed wheel under stub modules (`find_sglang_moe`; its package
__init__ files, its kernel registry and server never run):
  sglang/kernels/ops/moe/fused_moe_triton_kernels.py  invoke_fused_moe_kernel (-> fused_moe_kernel_gptq_awq:
                                                      use_int4_w4a16, block_shape [0, 32], no zero points),
                                                      act_and_mul_triton, moe_sum_reduce_triton
  sglang/kernels/ops/moe/moe_align_small_numel.py     the align SGLang itself runs up to SMALL_NUMEL_LIMIT
                                                      (64) token-expert pairs
  sglang/test/kernels/moe_align.py                    Triton moe_align_block_size above that (SGLang runs a
                                                      JIT CUDA align there, which is not loaded here)
A call (`sglang_moe_call`) runs what SGLang's _fused_moe_kernel_sequence runs for such weights on CUDA, with
that file's Triton kernels where SGLang would take a CUDA one (silu_and_mul, moe_sum_reduce): align, gate+up
GEMM [T k, 2I], SiLU(gate) * up [T k, I], down GEMM times the routing weight [T, k, D], the sum over k -> bf16
[T, D]. Its weights are ours reinterpreted without a copy (`sglang_int4_layout`), checked to read back bit
for bit the matrix our checkpoint format holds (`layout_mismatch`) before any time counts.

Per token count and routing (`ROUTINGS`; `moe_routing`): ours (checked against Int4Experts' fp32 reference
path, which dequantizes exactly) and SGLang's block configs (MOE_CONFIGS) swept with the align precomputed,
the fastest kept and timed with the align ("sglang") and without ("sglang_no_align": a lower bound of SGLang's
time where its own align is CUDA), each checked against ours; the row's best peer is the faster of the two.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import torch

from . import goals
from .moe import CONCENTRATED_NOISE, ROUTINGS, moe_routing  # noqa: F401
from ..quant import GROUP, Int4Weight
from .peers_common import (AGREE, bare_package, best_peer, rel_diff, run_sides, sglang_stubs, time_calls,
                           version)

MOE_TOKENS = (1, 8, 16, 64, 128)
QUICK_MOE_TOKENS = (1, 64)
# SGLang's block configs tried at each cell (no tuned int4_w4a16 file for E=384, N=2048 on H100 / H200 ships
# in the wheel): its get_default_config for M <= E first, then wider N / K tiles and larger M for more tokens
MOE_CONFIGS = (
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1},
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
     "num_stages": 3},
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
     "num_stages": 3},
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1, "num_warps": 4,
     "num_stages": 2},
    {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
     "num_stages": 3},
    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_warps": 4,
     "num_stages": 3},
)
QUICK_CONFIGS = 3          # --quick sweeps the first three
SGLANG_MOE_FILES = ("kernels/ops/moe/fused_moe_triton_kernels.py", "kernels/ops/moe/moe_align_small_numel.py",
                    "test/kernels/moe_align.py")


# ----------------------------------------------------------------------------- loading SGLang's files
def _refuse(*args, **kwargs):
    raise NotImplementedError("a stub: SGLang's activation-quantizing kernels are not loaded (bf16 inputs)")


def _moe_stubs() -> None:
    """sglang_stubs plus what the MoE files import: bare packages for their folders and stubs, as SGLang
    decides on CUDA with its environment unset: PDL launches from sm90 on (is_arch_support_pdl), no MoE
    padding (get_moe_padding_size 0), batch-invariant mode off, no CPU / AMX path; its fp8 / int8 activation
    quantizers refuse (never called with bf16 activations)."""
    root = sglang_stubs()
    for name, sub in (("sglang.kernels.ops.moe", "kernels/ops/moe"), ("sglang.test", "test"),
                      ("sglang.test.kernels", "test/kernels"), ("sglang.kernels.jit", None),
                      ("sglang.kernels.ops.quantization", None), ("sglang.srt.layers", None),
                      ("sglang.srt.layers.moe", None)):
        bare_package(name, root / sub if sub else None)

    def cap():
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    stubs = {
        "sglang.kernels.jit.utils": {"is_arch_support_pdl": lambda: cap()[0] >= 9},
        "sglang.kernels.ops.quantization.fp8_kernel": dict.fromkeys(
            ("per_token_group_quant_fp8", "scaled_fp8_quant", "sglang_per_token_group_quant_fp8"), _refuse),
        "sglang.kernels.ops.quantization.int8_kernel": dict.fromkeys(
            ("per_token_group_quant_int8", "per_token_quant_int8", "sglang_per_token_group_quant_int8"),
            _refuse),
        "sglang.srt.batch_invariant_ops": {"is_batch_invariant_mode_enabled": lambda: False},
        "sglang.srt.layers.moe.utils": {"get_moe_padding_size": lambda is_aiter_moe=False: 0},
        "sglang.srt.utils": {"is_cpu": lambda: False, "cpu_has_amx_support": lambda: False,
                             "is_sm90_supported": lambda: cap()[0] == 9, "is_musa": lambda: False,
                             "is_xpu": lambda: False},
    }
    for name, attrs in stubs.items():
        m = sys.modules.get(name) or types.ModuleType(name)
        for k, v in attrs.items():
            if not hasattr(m, k):
                setattr(m, k, v)
        sys.modules[name] = m


def find_sglang_moe() -> dict:
    """{"available", "version", "files", "reason"?, "api"?}: SGLang's fused-MoE entry points loaded by path
    (module docstring; "api", not serialized: invoke, act_and_mul, sum_reduce, align_small, small_limit,
    align_triton, bf16, fp16) or the reason they are not."""
    out = {"version": version("sglang"), "files": list(SGLANG_MOE_FILES)}
    try:
        if importlib.util.find_spec("sglang") is None:
            raise ImportError("sglang is not installed (pip install sglang==0.5.23 --no-deps)")
        import triton.language as tl
        _moe_stubs()
        fm = importlib.import_module("sglang.kernels.ops.moe.fused_moe_triton_kernels")
        sn = importlib.import_module("sglang.kernels.ops.moe.moe_align_small_numel")
        ref = importlib.import_module("sglang.test.kernels.moe_align")
        out.update(available=True, api={
            "invoke": fm.invoke_fused_moe_kernel, "act_and_mul": fm.act_and_mul_triton,
            "sum_reduce": fm.moe_sum_reduce_triton, "align_small": sn.moe_align_small_numel,
            "small_limit": sn.SMALL_NUMEL_LIMIT, "align_triton": ref.moe_align_block_size_triton,
            "bf16": tl.bfloat16, "fp16": tl.float16})
    except Exception as e:  # absent, or present without what it needs
        out.update(available=False, reason=f"{type(e).__name__}: {e}"[:300])
    return out


# ----------------------------------------------------------------------------- the INT4 layout adapter
def sglang_int4_layout(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our checkpoint INT4 (kdtree.quant: int32 [..., N, K/8], input 8c + i in bits 4i..4i+3 of word c, stored
    q + 8; scale [..., N, K/32]) -> the layout fused_moe_kernel_gptq_awq reads with use_int4_w4a16 and no
    zero points: uint8 [..., N, K/2], input k in bits 4 (k % 2)..4 (k % 2) + 3 of byte k // 2, stored q + 8
    (the kernel subtracts 8), and the scale unchanged (group_size 32). On a little-endian machine byte j of
    word c holds inputs 8c + 2j (low nibble) and 8c + 2j + 1 (high), so this is the words' bytes
    reinterpreted: a view, no copy, for contiguous tensors. Checked: int32 words, scale [..., N, K/32]
    floating point."""
    if sys.byteorder != "little":
        raise RuntimeError("sglang_int4_layout views int32 words as bytes: little-endian machines only")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32 or packed.dim() < 2:
        raise ValueError(f"packed: expected int32 [..., N, K/8], got {getattr(packed, 'dtype', packed)} "
                         f"{tuple(getattr(packed, 'shape', ()))}")
    want = (*packed.shape[:-1], packed.shape[-1] * 8 // GROUP)
    if not isinstance(scale, torch.Tensor) or not scale.dtype.is_floating_point or tuple(scale.shape) != want:
        raise ValueError(f"scale: expected a floating-point tensor of shape {want} (one per {GROUP} inputs "
                         f"of packed {tuple(packed.shape)}), got {getattr(scale, 'dtype', scale)} "
                         f"{tuple(getattr(scale, 'shape', ()))}")
    return packed.contiguous().view(torch.uint8), scale.contiguous()


def dequant_sglang_int4(qweight: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """float32 [..., N, K]: the weights fused_moe_kernel_gptq_awq reads (use_int4_w4a16, has_zp False) from
    qweight uint8 [..., N, K/2] and scale [..., N, K/group]: (((qweight[n, k // 2] >> 4 (k % 2)) & 0xF) - 8)
    * scale[n, k // group], its address arithmetic written in torch ops (the matrix before its bf16 cast)."""
    if qweight.dtype != torch.uint8 or qweight.dim() < 2:
        raise ValueError(f"qweight: expected uint8 [..., N, K/2], got {qweight.dtype} {tuple(qweight.shape)}")
    K = qweight.shape[-1] * 2
    if K % group or tuple(scale.shape) != (*qweight.shape[:-1], K // group):
        raise ValueError(f"scale: expected shape {(*qweight.shape[:-1], K // group)} for qweight "
                         f"{tuple(qweight.shape)}, got {tuple(scale.shape)}")
    k = torch.arange(K, device=qweight.device)
    nib = (qweight.to(torch.int32)[..., k // 2] >> (4 * (k % 2))) & 0xF
    return (nib - 8).to(torch.float32) * scale.to(torch.float32)[..., k // group]


def layout_mismatch(packed: torch.Tensor, scale: torch.Tensor, qweight: torch.Tensor,
                    qscale: torch.Tensor) -> str | None:
    """None where SGLang's reading of (qweight, qscale) (`dequant_sglang_int4`) equals, bit for bit, the
    matrix our checkpoint format holds (kdtree.quant's q * scale of packed int32 [..., N, K/8] and scale
    [..., N, K/32], float32, exact); else what differs: how many weights, the first one's index, both
    values."""
    K = packed.shape[-1] * 8
    rows = packed.numel() * 8 // K
    ours = Int4Weight(packed.reshape(rows, K // 8), scale.reshape(rows, K // GROUP), (rows, K)).dequantize()
    ours = ours.view(*packed.shape[:-1], K)
    try:
        theirs = dequant_sglang_int4(qweight, qscale)
    except ValueError as e:
        return str(e)
    if theirs.shape != ours.shape:
        return f"SGLang's reading has shape {tuple(theirs.shape)}, ours {tuple(ours.shape)}"
    bad = ours.view(torch.int32) != theirs.view(torch.int32)
    n = int(bad.sum())
    if not n:
        return None
    i = tuple(int(v) for v in bad.nonzero()[0])
    return (f"{n} of {bad.numel()} weights differ; first at {i}: ours {float(ours[i])!r}, "
            f"SGLang's reading {float(theirs[i])!r}")


# ----------------------------------------------------------------------------- SGLang's call
def align_name(api: dict, pairs: int) -> str:
    return ("moe_align_small_numel (SGLang's own path at this size)" if pairs <= api["small_limit"] else
            "test.kernels.moe_align.moe_align_block_size_triton (SGLang runs a JIT CUDA align at this size)")


def _align(api: dict, ids: torch.Tensor, block_m: int, E: int):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) of SGLang's align for ids int32 [T, k] over E
    experts and BLOCK_SIZE_M block_m, the buffers sized as its moe_align_block_size wrapper sizes them; the
    kernel as `align_name` says."""
    numel, dev = ids.numel(), ids.device
    pad = numel * block_m if numel < E + 1 else numel + (E + 1) * (block_m - 1)
    pad = (pad + 3) // 4 * 4
    sorted_ids = torch.empty(pad, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(-(-pad // block_m), dtype=torch.int32, device=dev)
    npad = torch.empty(1, dtype=torch.int32, device=dev)
    if numel <= api["small_limit"]:
        api["align_small"](ids, E + 1, block_m, sorted_ids, expert_ids, npad)   # "+1 offset" buckets
    else:
        sorted_ids.fill_(numel)                                                  # padding slots: no token
        api["align_triton"](ids, E, block_m, sorted_ids, expert_ids, npad)
    return sorted_ids, expert_ids, npad


def sglang_moe_call(api: dict, x, w, ids, weights, config: dict, align: bool = True):
    """A callable running SGLang's int4 w4a16 MoE (module docstring) on x bf16 (or fp16) [T, D] routed by w
    fp32 / ids int32 [T, k] (contiguous) over weights (w13 uint8 [E, 2I, D/2], s13 [E, 2I, D/32], w2 uint8
    [E, D, I/2], s2 [E, D, I/32]: `sglang_int4_layout`) at block config `config`, returning [T, D] in x's
    dtype (SGLang's rule: bf16 compute for bf16 inputs, else fp16). align False: the align runs once here
    and every call reuses its outputs."""
    w13, s13, w2, s2 = weights
    T, k = ids.shape
    E, N2, D, dev, dt = w13.shape[0], w13.shape[1], w2.shape[1], x.device, x.dtype
    bm = config["BLOCK_SIZE_M"]
    pre = None if align else _align(api, ids, bm, E)
    quant = dict(compute_type=api["bf16"] if dt == torch.bfloat16 else api["fp16"], use_fp8_w8a8=False,
                 use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=True, per_channel_quant=False,
                 block_shape=[0, GROUP])

    def call():
        sid, eid, npad = pre if pre is not None else _align(api, ids, bm, E)
        c1 = torch.empty(T * k, N2, dtype=dt, device=dev)
        api["invoke"](x, w13, None, c1, None, s13, None, w, ids, sid, eid, npad, False, k, config, **quant)
        c2 = torch.empty(T * k, N2 // 2, dtype=dt, device=dev)
        api["act_and_mul"](c1, c2, config, ids, eid, False, "silu")
        c3 = torch.empty(T, k, D, dtype=dt, device=dev)
        api["invoke"](c2, w2, None, c3, None, s2, None, w, ids, sid, eid, npad, True, 1, config, **quant)
        out = torch.empty(T, D, dtype=dt, device=dev)
        api["sum_reduce"](c3, out, 1.0)                  # the routing weights carry the routed scaling
        return out
    return call


# ----------------------------------------------------------------------------- a cell, the section
def _agree(out, ref):
    d = rel_diff(out, ref)
    return d, None if d <= AGREE else f"output differs from ours by {d:.3g} (> {AGREE})"


def _sweep(api, views, x, w, ids, ref, configs, repeats: int, timer):
    """(the fastest config or None, [{config, agree, time_s, timing} or {config, agree?, skipped}]): SGLang's
    call at each config with the align precomputed, checked against ours (ref) before it is timed
    (max(5, repeats // 3) repeats)."""
    tried = []
    for cfg in configs:
        t = {"time_s": {}, "timing": {}, "agree": {}, "skipped": {}}
        make = lambda cfg=cfg: [sglang_moe_call(api, x, w, ids, v, cfg, align=False) for v in views]
        run_sides(t, {"s": make}, lambda name, out: _agree(out, ref), max(5, repeats // 3), timer)
        tried.append({"config": dict(cfg), **{k: t[k]["s"] for k in t if "s" in t[k]}})
    ok = [t for t in tried if "time_s" in t]
    return (min(ok, key=lambda t: t["time_s"])["config"] if ok else None), tried


def moe_cell(peer: dict, sets, views, x, w, ids, repeats: int = 30, configs=MOE_CONFIGS,
             timer=time_calls) -> dict:
    """One token count's row: {tokens, pairs, experts_touched, reference (ours vs Int4Experts' fp32
    reference path, rel diff), time_s / timing {side}, agree {side: rel diff vs ours}, skipped {side: why},
    sglang_configs (`_sweep`), sglang_config (the fastest), sglang_align (`align_name`), sglang_align_s,
    best_peer, ours_over_best_peer}. sets: Int4Experts, one per input set (rotated); views: each set's
    weights in SGLang's layout (w13, s13, w2, s2); peer: find_sglang_moe()'s entry. Ours counts only within
    AGREE of the reference; a peer only within AGREE of ours."""
    T, k = ids.shape
    row = {"tokens": T, "pairs": T * k, "experts_touched": int(torch.unique(ids).numel()), "time_s": {},
           "timing": {}, "agree": {}, "skipped": {}}
    with torch.no_grad():
        ours = [lambda s=s: s(x, w, ids) for s in sets]
        ref = ours[0]()
        row["reference"] = rel_diff(ref, sets[0](x.float(), w, ids))
        if not row["reference"] <= AGREE:
            row["skipped"]["ours"] = f"differs from the fp32 reference by {row['reference']:.3g} (> {AGREE})"
            return row
        row["time_s"]["ours"], row["timing"]["ours"] = timer(ours, repeats)
        if not peer.get("available"):
            row["skipped"]["sglang"] = f"not loaded: {peer.get('reason')}"
            return row
        api = peer["api"]
        best, row["sglang_configs"] = _sweep(api, views, x, w, ids, ref, configs, repeats, timer)
        if best is None:
            row["skipped"]["sglang"] = "no block config ran and agreed with ours (sglang_configs says why)"
            return row
        row["sglang_config"], row["sglang_align"] = best, align_name(api, T * k)
        sides = {"sglang": lambda: [sglang_moe_call(api, x, w, ids, v, best) for v in views],
                 "sglang_no_align": lambda: [sglang_moe_call(api, x, w, ids, v, best, align=False)
                                             for v in views]}
        run_sides(row, sides, lambda name, out: _agree(out, ref), repeats, timer)
        E = views[0][0].shape[0]
        try:
            row["sglang_align_s"] = timer([lambda: _align(api, ids, best["BLOCK_SIZE_M"], E)], repeats)[0]
        except Exception as e:  # noqa: BLE001 - the align's own time is a detail; the row stands
            row["skipped"]["sglang_align"] = f"{type(e).__name__}: {e}"[:300]
    return best_peer(row)


def layout_check(experts, view) -> str | None:
    """`layout_mismatch` of one set's first and last experts, w13 and w2 (None: exact)."""
    for e in (0, experts.w13_packed.shape[0] - 1):
        for packed, scale, q, s in ((experts.w13_packed, experts.w13_scale, view[0], view[1]),
                                    (experts.w2_packed, experts.w2_scale, view[2], view[3])):
            bad = layout_mismatch(packed[e:e + 1], scale[e:e + 1], q[e:e + 1], s[e:e + 1])
            if bad:
                return f"expert {e}: {bad}"
    return None


def setup(quick: bool = False, config: str = "kimi-k2.6") -> dict:
    """The section's parameters as the record keeps them ("moe_setup"), `moe_section`'s keywords under
    "tokens", "routings", "configs"."""
    from ..config import load_config
    a = load_config(config)
    return {"config": config, "experts": a.n_routed_experts, "hidden": a.hidden_size,
            "intermediate": a.moe_intermediate_size, "top_k": a.num_experts_per_tok, "group": GROUP,
            "tokens": list(QUICK_MOE_TOKENS if quick else MOE_TOKENS), "routings": list(ROUTINGS),
            "configs": [dict(c) for c in (MOE_CONFIGS[:QUICK_CONFIGS] if quick else MOE_CONFIGS)],
            "sglang_layout": "our int32 words viewed as uint8 [E, N, K/2] (sglang_int4_layout), scales as "
                             "they are, block_shape [0, 32], no zero points"}


def moe_section(peer: dict, tokens=MOE_TOKENS, routings=ROUTINGS, repeats: int = 30, configs=MOE_CONFIGS,
                config: str = "kimi-k2.6", seed: int = 0, progress: bool = True):
    """Rows of `moe_cell` ({"routing", "layout", ...}) for each token count and routing, yielded as measured,
    on the GPU: two random sets of the config's routed experts (Int4Experts.random, rotated past L2: 8.5 GB a
    set at K2.6's shape, plus moe_int4's repacked copy) and their SGLang layout, checked exact
    (`layout_check`; else the peer is skipped with the mismatch)."""
    from ..config import load_config
    from ..moe import Int4Experts
    a = load_config(config)
    E, D, I = a.n_routed_experts, a.hidden_size, a.moe_intermediate_size
    sets = [Int4Experts.random(E, D, I, device="cuda", seed=seed + i) for i in range(2)]
    for s in sets:
        s.kernel_weights()   # moe_int4's repacked copy, made before any timing
    views = [(*sglang_int4_layout(s.w13_packed, s.w13_scale), *sglang_int4_layout(s.w2_packed, s.w2_scale))
             for s in sets]
    bad = layout_check(sets[0], views[0])
    if bad and peer.get("available"):
        peer = {**peer, "available": False, "reason": f"the INT4 layout adapter is not exact: {bad}"}
    todo = [(T, r) for T in tokens for r in routings]
    if progress:
        from ..progress import tqdm
        todo = tqdm(todo, desc="peers moe")
    try:
        for T, r in todo:
            x, w, ids = moe_routing(a, T, r, "cuda", seed + T)
            yield {"routing": r, "layout": bad or "exact", **moe_cell(peer, sets, views, x, w, ids, repeats,
                                                                       configs)}
    finally:
        del sets, views
        torch.cuda.empty_cache()


def moe_targets(rows: list[dict]) -> list[dict]:
    """peers_moe_vs_sglang per row with a best peer: the faster SGLang call's time / ours."""
    return [goals.target("peers_moe_vs_sglang", r["ours_over_best_peer"], tokens=r["tokens"],
                         routing=r["routing"], peer=r["best_peer"])
            for r in rows if "ours_over_best_peer" in r]


def format_moe(rows: list[dict]) -> str:
    lines = [f"{'moe T':>6} {'routing':<13}{'experts':>8}{'ours us':>9}  sglang (us), config, skipped"]
    for r in rows:
        t = r["time_s"]
        ours = f"{t['ours'] * 1e6:9.1f}" if "ours" in t else f"{'-':>9}"
        others = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in t.items() if k != "ours")
        cfg = r.get("sglang_config")
        cfg = f"  M{cfg['BLOCK_SIZE_M']} N{cfg['BLOCK_SIZE_N']} K{cfg['BLOCK_SIZE_K']}" if cfg else ""
        skips = "; ".join(f"{k}: {v[:60]}" for k, v in r["skipped"].items())
        lines.append(f"{r['tokens']:>6} {r['routing']:<13}{r['experts_touched']:>8}{ours}  {others}{cfg}"
                     + (f"  [{skips}]" if skips else ""))
    return "\n".join(lines)
