"""The fused decode path of the MLA + MoE model: `Transformer.forward_paged`'s decoder layers through the
small kernels of kdtree.ops.decode, cuBLAS GEMMs, verify_attn and moe_int4. It computes the function of the
torch path (Block.forward, kept as its reference), rounding to bf16 where that path rounds; the sums run in
another order, so the two agree to bf16 rounding.

One layer's step over M rows (M <= ABSORB_ROWS; above, the absorbed products are torch's batched GEMMs):
    add_rmsnorm            previous layer's residual add + input RMSNorm
    qkv_a GEMM             q_a_proj and kv_a_proj_with_mqa in one (Transformer.prepare_paged)
    mla_latent             q_a / kv_a RMSNorms, the key's rope, the latent row into the page pool
    q_b GEMM, q_absorb     the query; q_nope @ W_UK and the query's rope into verify_attn's [M, H, 576] rows
    verify_attn (2)        attention over the request's pages
    uv_absorb, o_proj GEMM o_lat @ W_UV into o_proj's [M, H * Dv] input
    add_rmsnorm            attention residual + post-attention RMSNorm
    router_scores, router_select          (MoE) sigmoid router, noaux_tc top-k
    gate+up GEMM, silu_mul, down GEMM     shared expert (MoE) or the dense MLP
    moe_int4 (1 launch for one row, 3 above)      routed INT4 experts
    moe_bf16 (3 launches)  routed bf16 experts on moe 'grouped' where BF16_EXPERTS is set and the call fits
                           (at most BF16_EXPERTS_MAX_PAIRS token-expert pairs)
The MoE output (routed fp32 + shared) and the residual add fold into the next layer's first add_rmsnorm (the
final norm's after the last layer), so a layer's output exists only as the next kernel's residual.

`unsupported(model, meta)` says why a forward cannot take this path (None when it can); `prepare(model)`
lays each dense MLP's and shared expert's gate and up weights out as two views of one [2I, D] matrix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import AttnMeta
from .layers import _launch, apply_rope, kernel_attention
from .moe import MLP, Gate, Int4Experts, MoE
from .ops import decode as dec
from .ops import gemv
from .ops import moe_bf16 as mbf

ABSORB_ROWS = 32   # rows up to which q_absorb / uv_absorb replace the absorbed products' batched GEMMs
GEMV_ROWS = 0      # rows up to which the projections take ops.gemv's kernel instead of cuBLAS (0: never)
BF16_EXPERTS = True    # bf16 routed experts (a ModuleList of MLPs) through ops.moe_bf16 where the call fits
BF16_EXPERTS_MAX_PAIRS = 64   # ... and has at most this many token-expert pairs (beyond: the grouped GEMMs)


def unsupported(model, meta: AttnMeta) -> str | None:
    """Why forward_paged cannot take the fused path for this model and metadata, or None."""
    a = model.args
    if model.device.type != "cuda":
        return "needs a CUDA device"
    if model.dtype != torch.bfloat16:
        return f"needs bf16 weights, got {model.dtype}"
    if meta.attn_impl != "kernel" or meta.start is not None:
        return "needs the paged layout with attn_impl 'kernel'"
    if a.q_lora_rank is None:
        return "needs q_lora_rank (the fused q_a / kv_a projection)"
    if a.hidden_size % 8 or a.kv_lora_rank % 256 or a.v_head_dim % 32 or a.qk_rope_head_dim % 2:
        return "needs hidden_size % 8, kv_lora_rank % 256, v_head_dim % 32 and an even rope dim"
    if any(layer._forward_hooks or layer._forward_pre_hooks for layer in model.model.layers):
        return "a decoder layer has forward hooks (the torch path runs them)"
    return None


@torch.no_grad()
def prepare(model) -> None:
    """Each dense MLP's and shared expert's gate_proj and up_proj weights become the two halves of one [2I, D]
    tensor (views: no second copy; one GEMM computes both). CUDA models only (a CPU model's views would share
    storage in a saved checkpoint). Idempotent."""
    if model.device.type != "cuda":
        return
    for layer in model.model.layers:
        mlps = [layer.mlp] if isinstance(layer.mlp, MLP) else []
        if isinstance(layer.mlp, MoE) and layer.mlp.shared_experts is not None:
            mlps.append(layer.mlp.shared_experts)
        for m in mlps:
            if _gate_up(m) is not None:
                continue
            g, u = m.gate_proj.weight, m.up_proj.weight
            if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
                continue
            both = torch.cat([g.detach(), u.detach()])
            I = g.shape[0]
            g.data, u.data = both[:I], both[I:]
            m._gate_up = both


def _gate_up(m: MLP) -> torch.Tensor | None:
    """The [2I, D] tensor whose halves are m's gate and up weights (prepare), or None when they are not (never
    prepared, or a weight was replaced since)."""
    both = getattr(m, "_gate_up", None)
    if both is None:
        return None
    g, u = m.gate_proj.weight, m.up_proj.weight
    I = g.shape[0]
    ok = (g.data_ptr() == both.data_ptr() and u.data_ptr() == both[I:].data_ptr()
          and both.shape[0] == 2 * I and g.shape == u.shape)
    return both if ok else None


def _eager(fn, *args, **kw):
    """A kdtree.ops.decode launch outside torch.compile's tracing (model._launch)."""
    return _launch(fn, *args, **kw)


def _linear(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [M, K] @ w [N, K]^T: ops.gemv for at most GEMV_ROWS rows, else cuBLAS (F.linear)."""
    return _eager(gemv.gemv, y, w) if y.shape[0] <= GEMV_ROWS else F.linear(y, w)


def _proj(mod, y: torch.Tensor) -> torch.Tensor:
    """An nn.Linear (no bias) applied to y: through `_linear`, or the module's own call where it has hooks
    (tensor parallelism's all-reduce)."""
    if mod._forward_hooks or mod._forward_pre_hooks:
        return mod(y)
    return _linear(y, mod.weight)


def _mlp(m: MLP, y: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(y)) * up(y)), y bf16 [M, D]: one gate+up GEMM where prepared, silu_mul, down."""
    if m._forward_hooks or m._forward_pre_hooks:
        return m(y)
    gu = _gate_up(m)
    if gu is not None:
        t = _linear(y, gu)                                              # [M, 2I]
        I = t.shape[1] // 2
        h = _eager(dec.silu_mul, t[:, :I], t[:, I:])
    else:
        h = _eager(dec.silu_mul, _proj(m.gate_proj, y), _proj(m.up_proj, y))
    return _proj(m.down_proj, h)


def _ffn(mlp, y: torch.Tensor, moe_path: str) -> tuple:
    """The layer's feed-forward on y bf16 [M, D] as what the next add_rmsnorm adds: ("delta", bf16 [M, D]) or
    ("moe", routed fp32 [M, D], shared bf16 [M, D] or None)."""
    if isinstance(mlp, MLP):
        return ("delta", _mlp(mlp, y))
    stacked = _bf16_experts(mlp, y) if moe_path == "grouped" else None   # its kernel form, its weights
    if (not isinstance(mlp, MoE) or not (isinstance(mlp.experts, Int4Experts) or stacked)
            or mlp._forward_hooks or mlp._forward_pre_hooks):
        return ("delta", mlp(y, moe_path))
    gate, a = mlp.gate, mlp.args
    if (type(gate) is Gate and not gate._forward_hooks and a.n_routed_experts <= dec.SEL_MAX_E
            and a.num_experts_per_tok <= dec.SEL_MAX_K and a.n_group <= 32):
        scores = _eager(dec.router_scores, y, gate.weight)                              # [M, E]
        w, ids = _eager(dec.router_select, scores, gate.e_score_correction_bias, a.n_group, a.topk_group,
                        a.num_experts_per_tok, a.norm_topk_prob, float(a.routed_scaling_factor))
    else:
        w, ids = gate(y)
    if stacked:
        routed = _eager(mbf.moe_bf16, y, ids, w.float(), *stacked, check_values=False)   # fp32 [M, D]
    else:
        routed = mlp.experts(y, w, ids)                                                 # fp32 [M, D]
    shared = _mlp(mlp.shared_experts, y) if mlp.shared_experts is not None else None
    return ("moe", routed, shared)


def _bf16_experts(mlp, y: torch.Tensor) -> tuple | None:
    """(w13 [E, 2I, D], w2 [E, D, I]): the grouped path's weights (`MoE.grouped`, which prepare_paged
    refreshes for moe 'grouped') where mlp's routed experts are bf16 MLPs that ops.moe_bf16 takes for y's rows
    (BF16_EXPERTS set, at most BF16_EXPERTS_MAX_PAIRS token-expert pairs, every expert on this rank, no
    hooks), else None."""
    def hooked(m) -> bool:
        return bool(m._forward_hooks or m._forward_pre_hooks)
    if not (BF16_EXPERTS and isinstance(mlp, MoE) and isinstance(mlp.experts, torch.nn.ModuleList)
            and len(mlp.experts) == mlp.args.n_routed_experts and not hooked(mlp.experts)
            and all(isinstance(m, MLP) and not hooked(m) for m in mlp.experts)):
        return None
    k = mlp.args.num_experts_per_tok
    if y.shape[0] * k > BF16_EXPERTS_MAX_PAIRS:
        return None
    w13, w2 = mlp.grouped()
    if w13.dtype != torch.bfloat16 or not mbf.fits(y.shape[0], k, w13, w2):
        return None
    return w13, w2


def _add_norm(x: torch.Tensor, pend, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + what `pend` adds, RMSNorm of it) through one add_rmsnorm."""
    kw = {}
    if pend is not None:
        kw = {"delta": pend[1]} if pend[0] == "delta" else {"routed": pend[1], "shared": pend[2]}
    return _eager(dec.add_rmsnorm, x, norm.weight, norm.eps, **kw)


def _attention(attn, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
               meta: AttnMeta) -> torch.Tensor:
    """MLA over the paged latent cache (MLA._paged / _attend with attn_impl 'kernel'): y bf16 [M, D] ->
    [M, D]; writes the block's latent rows to pool rows meta.slots."""
    a = attn.args
    B, T = meta.slots.shape
    M = B * T
    Dn, Dv, R, P = a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank, a.qk_rope_head_dim
    qkv = _linear(y, attn.qkv_a)                                                        # [M, QL + R + P]
    q = _eager(dec.mla_latent, qkv, attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight, cos, sin,
               meta.slots.reshape(M), pool, attn.kv_a_layernorm.eps, a.rope_interleave, check_values=False)
    qb = _proj(attn.q_b_proj, q)                                                        # [M, H (Dn + P)]
    H = qb.shape[1] // (Dn + P)
    w = attn.kv_b_proj.weight.view(H, Dn + Dv, R)
    qb = qb.view(M, H, Dn + P)
    if M <= ABSORB_ROWS:
        qk = _eager(dec.q_absorb, qb, w, cos, sin, Dn, a.rope_interleave)              # [M, H, R + P]
    else:
        q_lat = torch.einsum("mhd,hdr->mhr", qb[..., :Dn], w[:, :Dn])
        q_pe = apply_rope(qb[..., Dn:], cos[:, None], sin[:, None], a.rope_interleave)
        qk = torch.cat([q_lat, q_pe], -1).contiguous()
    o_lat = kernel_attention(qk.view(B, T, H, R + P), pool, meta, a.softmax_scale)     # [B, T, H, R]
    o_lat = o_lat.view(M, H, R)
    if M <= ABSORB_ROWS:
        o = _eager(dec.uv_absorb, o_lat, w, Dn)                                         # [M, H Dv]
    else:
        o = torch.einsum("mhr,hdr->mhd", o_lat, w[:, Dn:]).reshape(M, H * Dv)
    return _proj(attn.o_proj, o)


def forward_layers(model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   pool: torch.Tensor, meta: AttnMeta, hidden_layers=()) -> tuple[torch.Tensor, dict]:
    """The decoder layers and the final norm: h bf16 [B, T, D] (the embeddings), cos / sin bf16 [B, T, P/2],
    pool [layers, rows, R + P]. Returns (normed bf16 [B, T, D], {layer id: its output [B, T, D]} for
    hidden_layers)."""
    B, T, D = h.shape
    M = B * T
    cos, sin = cos.reshape(M, -1).contiguous(), sin.reshape(M, -1).contiguous()
    x, pend, hidden = h.reshape(M, D).contiguous(), None, {}
    layers = model.model.layers
    for i, layer in enumerate(layers):
        x, y = _add_norm(x, pend, layer.input_layernorm)
        if i - 1 in hidden_layers:
            hidden[i - 1] = x.view(B, T, D)
        attn = _attention(layer.self_attn, y, cos, sin, pool[i], meta)
        x, y = _add_norm(x, ("delta", attn), layer.post_attention_layernorm)
        pend = _ffn(layer.mlp, y, meta.moe)
    x, y = _add_norm(x, pend, model.model.norm)
    if len(layers) - 1 in hidden_layers:
        hidden[len(layers) - 1] = x.view(B, T, D)
    return y.view(B, T, D), hidden
