"""The MLA + MoE transformer (DeepSeek-V3 / Kimi-K2 architecture) in plain torch.

Parameter names follow the HF hub layout (`model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight`, ...),
so `state_dict()` is a checkpoint and `kdtree.weights.load` fills it from one.

One `forward` serves every step of speculative decoding:
  * prefill        tokens [B, T], positions cache.length + arange(T), causal mask
  * decode         tokens [B, 1]
  * tree verify    tokens [B, N], explicit position ids, an N x N visibility mask over the appended block;
                   every cached token stays visible. `KVCache.compact(keep)` then keeps the accepted path.

`attn_impl` chooses the attention path:
  * "naive":  K and V are decompressed per head from the cached latent (kv_b_proj applied to it).
  * "absorb": only the 512-wide latent and the 64-wide rope key are read; kv_b_proj is folded into
              the query (q_nope @ W_uk) and into the output (o_latent @ W_uv).
  * "kernel": "absorb" with the attention itself in the CUDA kernel kdtree.kernels.verify_attn (paged
              bf16 latent cache, tree mask); needs kv_lora_rank 512, qk_rope_head_dim 64, a CUDA device
              and a bf16 cache (`new_cache` makes one).
All read the same latent cache and agree to rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .cache import ATTN_IMPLS, AttnMeta, KVCache, PagedMeta, check_memory, free_bytes  # noqa: F401
from .config import ModelArgs
from .layers import RMSNorm, _launch, _refresh, apply_rope, kernel_attention, rope_inv_freq  # noqa: F401
from .moe import (GATHER_PAIRS_MAX, MLP, MOE_PATHS, RANK_TOPK_MAX, AbsentExpert, Gate,  # noqa: F401
                  Int4Experts, MoE, _repack_chunks)


def check_attn_impl(args: ModelArgs, value, where: str = "") -> str:
    """value as an attention path of a model of `args`: one of ATTN_IMPLS; 'kernel' needs the kernel's
    576-wide latent rows (kv_lora_rank 512, qk_rope_head_dim 64). `where` prefixes the message."""
    if value not in ATTN_IMPLS:
        raise ValueError(f"{where}attn_impl={value!r}: expected one of {ATTN_IMPLS}")
    if value == "kernel" and (args.kv_lora_rank, args.qk_rope_head_dim) != (512, 64):
        raise ValueError(f"{where}attn_impl='kernel' needs kv_lora_rank 512 and qk_rope_head_dim 64 (the "
                         f"kernel's 576-wide rows), got {args.kv_lora_rank} and {args.qk_rope_head_dim}")
    return value


# ----------------------------------------------------------------------------- attention
class MLA(nn.Module):
    """Multi-head latent attention. Shapes: B batch, T new tokens, S = cached + T, H heads,
    R kv_lora_rank, P rope dim, Dn/Dv nope/value head dims."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, D = args.num_attention_heads, args.hidden_size
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * args.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, args.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = nn.Linear(args.q_lora_rank, H * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, H * (args.qk_nope_head_dim + args.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(H * args.v_head_dim, D, bias=False)

    def forward(self, x, cos, sin, latent, meta: AttnMeta):
        """x [B, T, D]; cos/sin [B, T, P/2]; latent: this layer's cache [B, S_pad, R + P] (meta's cache
        layout: the block is written at rows meta.start ...) or its page pool [rows, R + P] (paged).
        Returns [B, T, D]."""
        a = self.args
        B, T, _ = x.shape
        H, Dn, R = a.num_attention_heads, a.qk_nope_head_dim, a.kv_lora_rank
        paged = meta.start is None
        qkv_a = getattr(self, "qkv_a", None) if paged else None   # Transformer.prepare_paged's fused weight
        if qkv_a is not None:   # q_a_proj and kv_a_proj_with_mqa as one GEMM
            q, kv_pe = F.linear(x, qkv_a).split([a.q_lora_rank, R + a.qk_rope_head_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q))
        else:
            q = (self.q_proj(x) if a.q_lora_rank is None
                 else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))))
            kv_pe = self.kv_a_proj_with_mqa(x)
        q = q.view(B, T, H, a.qk_head_dim)
        q_nope, q_pe = q.split([Dn, a.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None], a.rope_interleave)  # [B, T, H, P]
        kv, k_pe = kv_pe.split([R, a.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_layernorm(kv)  # [B, T, R]
        k_pe = apply_rope(k_pe, cos, sin, a.rope_interleave)  # [B, T, P]
        if paged:
            return self._paged(x, q_nope, q_pe, kv, k_pe, latent, meta)
        start = meta.start
        latent[:, start:start + T, :R] = kv.detach() if torch.is_grad_enabled() else kv
        latent[:, start:start + T, R:] = k_pe.detach() if torch.is_grad_enabled() else k_pe
        S = start + T
        kv_all, pe_all = latent[:, :S, :R], latent[:, :S, R:]  # [B, S, R], [B, S, P]
        if torch.is_grad_enabled() and meta.attn_impl != "kernel":  # training: the block's rows keep grads
            kv_all = torch.cat([kv_all[:, :start], kv.to(kv_all.dtype)], dim=1)
            pe_all = torch.cat([pe_all[:, :start], k_pe.to(pe_all.dtype)], dim=1)
        rows = latent.reshape(-1, latent.shape[-1]) if meta.attn_impl == "kernel" else None
        return self._attend(x, q_nope, q_pe, kv_all, pe_all, meta, rows)

    def _paged(self, x, q_nope, q_pe, kv, k_pe, pool, meta: AttnMeta):
        """The block's latent rows go to pool rows meta.slots; attention over the request's pages (torch
        paths: gathered through the page table to [B, kv_cap, R + P], masked by meta.bias)."""
        R = self.args.kv_lora_rank
        B, T = meta.slots.shape
        pool.index_copy_(0, meta.slots.reshape(-1),
                         torch.cat([kv, k_pe], -1).reshape(B * T, -1).to(pool.dtype))
        if meta.attn_impl == "kernel":
            return self._attend(x, q_nope, q_pe, None, None, meta, pool)
        ctx = pool.view(-1, meta.page_size, pool.shape[-1])[meta.page_table].view(B, meta.kv_cap, -1)
        return self._attend(x, q_nope, q_pe, ctx[..., :R], ctx[..., R:], meta, None, ctx)

    def _attend(self, x, q_nope, q_pe, kv_all, pe_all, meta: AttnMeta, rows=None, ctx=None):
        """Attention of the block's queries over S = meta.kv_cap keys: kv_all [B, S, R], pe_all [B, S, P]
        masked by meta.bias [B, T, S]; for attn_impl "kernel", rows = this layer's paged cache [rows, R + P]
        read through meta.page_table / seq_len / mask_words instead. ctx: [B, S, R + P] whose slices kv_all
        and pe_all are (absorb then scores latent and rope in one GEMM)."""
        a = self.args
        B, T, _ = x.shape
        H, Dn, Dv, R = a.num_attention_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        scale, S, bias, attn_impl = a.softmax_scale, meta.kv_cap, meta.bias, meta.attn_impl
        if attn_impl == "kernel":
            w = self.kv_b_proj.weight.view(H, Dn + Dv, R)
            q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w[:, :Dn])  # [B, T, H, R]
            qk = torch.cat([q_lat, q_pe], dim=-1).to(torch.bfloat16).contiguous()  # [B, T, H, 576]
            o_lat = kernel_attention(qk, rows, meta, scale)                                # [B, T, H, R]
            o = torch.einsum("bthr,hdr->bthd", o_lat.to(x.dtype), w[:, Dn:])  # [B, T, H, Dv]
        elif attn_impl == "naive":
            kvb = self.kv_b_proj(kv_all).view(B, S, H, Dn + Dv)
            k_nope, v = kvb.split([Dn, Dv], dim=-1)  # [B, S, H, Dn], [B, S, H, Dv]
            k = torch.cat([k_nope, pe_all[:, :, None].expand(B, S, H, a.qk_rope_head_dim)], dim=-1)
            qf = torch.cat([q_nope, q_pe], dim=-1)
            scores = torch.einsum("bthd,bshd->bhts", qf, k) * scale  # [B, H, T, S]
            p = (scores.float() + bias[:, None]).softmax(-1).to(x.dtype)
            o = torch.einsum("bhts,bshd->bthd", p, v)  # [B, T, H, Dv]
        elif attn_impl == "absorb":
            w = self.kv_b_proj.weight.view(H, Dn + Dv, R)
            q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w[:, :Dn])  # [B, T, H, R]
            if ctx is not None:  # [B, T, H, R + P] . [B, S, R + P]
                scores = torch.einsum("bthc,bsc->bhts", torch.cat([q_lat, q_pe], -1), ctx) * scale
            else:
                scores = (torch.einsum("bthr,bsr->bhts", q_lat, kv_all)
                          + torch.einsum("bthp,bsp->bhts", q_pe, pe_all)) * scale
            p = (scores.float() + bias[:, None]).softmax(-1).to(x.dtype)
            o_lat = torch.einsum("bhts,bsr->bthr", p, kv_all)  # [B, T, H, R]
            o = torch.einsum("bthr,hdr->bthd", o_lat, w[:, Dn:])  # [B, T, H, Dv]
        else:
            raise ValueError(f"attn_impl={attn_impl!r}: expected one of {ATTN_IMPLS}")
        return self.o_proj(o.reshape(B, T, H * Dv))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.self_attn = MLA(args)
        self.mlp = (MLP(args.hidden_size, args.intermediate_size) if layer_id < args.first_k_dense_replace
                    else MoE(args))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, latent, meta: AttnMeta):
        """x [B, T, D] -> [B, T, D]; latent: this layer's cache or page pool (MLA.forward); meta: the
        forward's AttnMeta (its attn_impl and moe switches choose the components' paths)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, latent, meta)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            return x + self.mlp(h, meta.moe)
        return x + self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, T, V] float32
    # layer id -> [B, T, D] output of that layer
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


# ----------------------------------------------------------------------------- the model
class Transformer(nn.Module):
    """MLA + MoE decoder. `Transformer(args, attn_impl)`; weights via `init_weights` or
    `kdtree.weights.load`."""

    def quantize_experts(self) -> "Transformer":
        """Every MoE layer's routed experts to the INT4 release format (in place); returns self. All layers
        are quantized before any is replaced, so a failure (non-finite weights) names its layer and changes
        nothing."""
        new = {}
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoE) and not isinstance(layer.mlp.experts, Int4Experts):
                try:
                    new[i] = Int4Experts.from_mlps(layer.mlp.experts)
                except ValueError as e:
                    raise ValueError(f"quantize_experts: layer {i}: {e}") from e
        for i, ex in new.items():
            self.model.layers[i].mlp.experts = ex
        return self

    def __init__(self, args: ModelArgs, attn_impl: str = "absorb"):
        if not isinstance(args, ModelArgs):
            raise ValueError(f"args: expected a kdtree ModelArgs (kdtree.load_config('tiny-a'), ...), got "
                             f"{type(args).__name__}")
        super().__init__()
        self.args = args
        self.attn_impl = attn_impl
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # forward_paged's layers through kdtree.fused's kernels where they apply (True), else Block.forward
        self.fused = True
        inv_freq, self.rope_attn_factor = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, value: str) -> None:
        self._attn_impl = check_attn_impl(self.args, value)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.attn_impl == "kernel" else self.dtype

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(self.args, batch, max_len, dtype=self.cache_dtype, device=self.device)

    def rope(self, position_ids: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [B, T, P/2]
        return ((freqs.cos() * self.rope_attn_factor).to(dtype),
                (freqs.sin() * self.rope_attn_factor).to(dtype))

    def _check(self, tokens, cache, position_ids, mask):
        """Validate every argument before anything is written; return (B, T, position_ids [B,T], mask
        [B,T,T])."""
        a = self.args
        checks.tensor("tokens [batch, T]", tokens, (torch.int32, torch.int64), ndim=2, device=self.device)
        B, T = tokens.shape
        if T == 0 or B == 0:
            raise ValueError(f"tokens: expected a non-empty [batch, T], got {tuple(tokens.shape)}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= a.vocab_size:
            raise ValueError(f"tokens: expected ids in [0, vocab_size={a.vocab_size}), got [{lo}, {hi}]")
        start = 0
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache: expected a KVCache, got {type(cache).__name__}")
            if cache.batch != B:
                raise ValueError(f"cache: batch {cache.batch} != tokens batch {B}")
            a = self.args
            want = (a.num_hidden_layers, a.kv_lora_rank + a.qk_rope_head_dim)
            got = (cache.latent.shape[0], cache.latent.shape[-1])
            if got != want:
                raise ValueError(f"cache: {got[0]} layers of width {got[1]}, the model needs {want[0]} of "
                                 f"width {want[1]} (make it with model.new_cache)")
            if cache.latent.device != self.device or cache.latent.dtype != self.cache_dtype:
                raise ValueError(f"cache: expected {self.cache_dtype} on {self.device}, got "
                                 f"{cache.latent.dtype} on {cache.latent.device} (make it with "
                                 "model.new_cache)")
            start = cache.length
            if start + T > cache.max_len:
                raise ValueError(f"context overflow: cache holds {start} of max_len={cache.max_len} tokens, "
                                 f"cannot append T={T}")
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=self.device).expand(B, T)
        else:
            position_ids = torch.as_tensor(position_ids, device=self.device)
            if position_ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"position_ids: expected an int tensor, got {position_ids.dtype}")
            if position_ids.dim() == 1:
                position_ids = position_ids[None].expand(B, -1)
            if tuple(position_ids.shape) != (B, T):
                raise ValueError(f"position_ids: expected shape [{T}] or [{B}, {T}], got "
                                 f"{tuple(position_ids.shape)}")
        plo, phi = int(position_ids.min()), int(position_ids.max())
        if plo < 0 or phi >= a.max_position_embeddings:
            raise ValueError(f"position_ids: expected values in [0, max_position_embeddings="
                             f"{a.max_position_embeddings}), got [{plo}, {phi}]")
        if mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()[None].expand(B, T, T)
        else:
            mask = torch.as_tensor(mask, device=self.device)
            if mask.dtype != torch.bool:
                raise ValueError(f"mask: expected a bool tensor, got {mask.dtype}")
            if mask.dim() == 2:
                mask = mask[None].expand(B, -1, -1)
            if tuple(mask.shape) != (B, T, T):
                raise ValueError(f"mask: expected shape [{T}, {T}] or [{B}, {T}, {T}], got "
                                 f"{tuple(mask.shape)}")
            if not bool(mask.diagonal(dim1=1, dim2=2).all()):
                raise ValueError("mask: every appended token must see itself (the diagonal must be True)")
        return B, T, start, position_ids, mask

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, position_ids=None, mask=None,
                hidden_layers=(), logits_for=None) -> ForwardOutput:
        """forward_grad without gradients: the inference entry (decode loops, verification)."""
        return self.forward_grad(tokens, cache, position_ids, mask, hidden_layers, logits_for)

    def forward_grad(self, tokens: torch.Tensor, cache: KVCache | None = None, position_ids=None, mask=None,
                     hidden_layers=(), logits_for=None) -> ForwardOutput:
        """Run T new tokens after the cached ones (with autograd where enabled: training uses this).

        tokens [B, T] int; cache: KVCache or None (no cache: the block attends to itself only);
        position_ids [T] or [B, T] (default: cache.length + arange(T)); mask [T, T] or [B, T, T] bool,
        mask[i, j] = token i sees appended token j (default causal; all cached tokens are always seen);
        hidden_layers: decoder layer ids whose outputs are returned; logits_for: optional index tensor
        into T selecting which rows get logits (default all).
        Returns ForwardOutput(logits [B, T', V] float32, hidden {layer: [B, T, D]}).
        On success the block is appended to the cache (cache.length += T); on a ValueError nothing changes.
        """
        B, T, start, position_ids, mask = self._check(tokens, cache, position_ids, mask)
        for i in hidden_layers:
            if not 0 <= i < self.args.num_hidden_layers:
                raise ValueError(f"hidden_layers: layer {i} out of range [0, {self.args.num_hidden_layers})")
        if self.attn_impl == "kernel" and self.device.type != "cuda":
            raise ValueError("attn_impl='kernel' needs the model on a CUDA device")
        S = start + T
        work = cache if cache is not None else self.new_cache(T, B)  # no cache: the block sees itself only
        meta = AttnMeta.for_cache(work, start, position_ids, mask, self.attn_impl)
        h = self.model.embed_tokens(tokens)  # [B, T, D]
        cos, sin = self.rope(position_ids, h.dtype)
        hidden = {}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, work.latent[i], meta)
            if i in hidden_layers:
                hidden[i] = h
        h = self.model.norm(h)
        if logits_for is not None:
            h = h[:, logits_for]
        logits = self.lm_head(h).float()
        if cache is not None:
            cache.length, cache.block = S, (start, T)
        return ForwardOutput(logits, hidden)


    @torch.no_grad()
    def prepare_paged(self, moe: str = "dense") -> "Transformer":
        """Build or refresh the fused weights forward_paged uses: each MLA's q_a_proj and kv_a_proj_with_mqa
        rows as one [q_lora + R + P, D] matrix, on a GPU the gate and up weights of each dense MLP and shared
        expert as views of one [2I, D] matrix (fused.prepare), and for moe "dense" / "grouped" each MoE's
        stacked experts
        (MoE.stacked / MoE.grouped). Copies of the weights, refreshed in place (CUDA graphs captured earlier
        keep reading valid memory and see the new values): call again after the weights change
        (kdtree.engine.Engine does at construction). Returns self."""
        if moe not in MOE_PATHS:
            raise ValueError(f"moe={moe!r}: expected one of {MOE_PATHS}")
        for layer in self.model.layers:
            attn = layer.self_attn
            if attn.args.q_lora_rank is not None:
                attn.qkv_a = _refresh(getattr(attn, "qkv_a", None),
                                      torch.cat([attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight]))
            mlp = layer.mlp
            if isinstance(mlp, MoE) and not isinstance(mlp.experts, Int4Experts):
                if moe == "dense":
                    mlp.stacked(refresh=True)
                elif moe == "grouped":
                    mlp.grouped(refresh=True)
        from . import fused
        fused.prepare(self)
        self._paged_ready = getattr(self, "_paged_ready", set()) | {(self.device, self.dtype, moe)}
        return self

    @torch.no_grad()
    def forward_paged(self, tokens: torch.Tensor, pool: torch.Tensor, meta: AttnMeta, hidden_layers=(),
                      logits_for=None) -> ForwardOutput:
        """The engine's forward: tokens [B, T] (ids already checked), pool [layers, rows, R + P] the shared
        page pool (rows = pages * page_size), meta the block's AttnMeta (paged layout). The layers take
        kdtree.fused's kernels where `fused.unsupported` allows and `self.fused` is True (bf16 on a GPU with
        attn_impl 'kernel'), else Block.forward (the reference; the two agree to bf16 rounding). Writes the
        block's latent rows to meta.slots of every layer; no value checks and no host reads (graph-capturable;
        logits_for, the rows given logits: a slice or a device index tensor there, a list being copied from
        the host).
        Returns ForwardOutput(logits [B, T', V] float32, hidden {layer: [B, T, D]})."""
        if meta.attn_impl != self.attn_impl:
            raise ValueError(f"meta: built for attn_impl={meta.attn_impl!r}, the model's is "
                             f"{self.attn_impl!r}")
        if (self.device, self.dtype, meta.moe) not in getattr(self, "_paged_ready", ()):
            self.prepare_paged(meta.moe)
        h = self.model.embed_tokens(tokens)  # [B, T, D]
        cos, sin = self.rope(meta.positions, h.dtype)
        from . import fused
        if getattr(self, "fused", True) and fused.unsupported(self, meta) is None:
            h, hidden = fused.forward_layers(self, h, cos, sin, pool, meta, hidden_layers)
        else:
            hidden = {}
            for i, layer in enumerate(self.model.layers):
                h = layer(h, cos, sin, pool[i], meta)
                if i in hidden_layers:
                    hidden[i] = h
            h = self.model.norm(h)
        if logits_for is not None:
            h = h[:, logits_for].contiguous()  # a slice's rows as an index's would be laid out
        return ForwardOutput(self.lm_head(h).float(), hidden)


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0, scale: float = 1.0) -> Transformer:
    """Random weights that give peaked, input-dependent logits (unlike the std 0.02 default init):
    linear weights N(0, scale/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.1),
    router correction bias N(0, 0.05) so that the selection-only path matters."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif "embed_tokens" in name:
            v = torch.randn(p.shape, generator=g)
        elif name == "lm_head.weight":
            v = torch.randn(p.shape, generator=g) * (2.0 * scale / math.sqrt(p.shape[1]))
        else:
            v = torch.randn(p.shape, generator=g) * (scale / math.sqrt(p.shape[-1]))
        p.copy_(v.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_((0.05 * torch.randn(b.shape, generator=g)).to(b.dtype))
    return model


def build_model(args: ModelArgs, seed: int = 0, attn_impl: str = "absorb", dtype=torch.float32,
                device="cpu") -> Transformer:
    """A randomly initialised model (see `init_weights`) on `device` in `dtype` (a floating torch dtype or
    its name). Every argument is checked before any weight is made."""
    seed = checks.int_in("seed", seed, 0, 2**64 - 1)
    dtype, device = checks.float_dtype("dtype", dtype), checks.device("device", device)
    m = Transformer(args, attn_impl)
    init_weights(m, seed)
    return m.to(device=device, dtype=dtype).eval()
