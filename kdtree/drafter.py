"""Drafters: the DFlash block-diffusion drafter and a test oracle.

DFlash (public Kimi-K2.5-DFlash layout). Config keys: block_size, mask_token_id, target_layer_ids,
num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
rms_norm_eps, rope_theta. Weights: `fc` [hidden, len(target_layer_ids) * target_hidden] over the
concatenated hidden states of the target layers, then `hidden_norm`; Qwen3-style layers (q/k RMSNorm per
head, GQA, SwiGLU); a final `norm`. The target's embedding and lm_head are shared (not owned).

One draft pass: the block [root, mask, ..., mask] (block_size tokens at positions root_pos + 0..bs-1) is
embedded with the target's embedding; every layer's queries come from the block, its keys and values
from [context features ; block], attention is non-causal. Logits at block rows 1..bs-1 are the draft
distributions for depths 1..L (L = block_size - 1). Context keys/values (one projection of the context
features per layer) are cached across rounds.

A drafter hands out sessions with three calls the decode loop uses:
    start(prompt_tokens, features)   features [P, F] of the prompt (or None)
    propose(committed) -> [L, V]     draft logits below the root committed[-1] at position len(committed)-1
    accept(features)                 features [k, F] of the newly committed tokens now in the target cache

The drafter's parts, each in a module of its own, are handed on here (every name below importable from
kdtree.drafter): DrafterArgs and DRAFTER_REQUIRED_KEYS (kdtree.drafter_args), the attention DraftAttention and
the choice of its implementation, DRAFT_ATTN_IMPLS, draft_attn_auto, draft_attn_kernel_fits, draft_attn_math
(kdtree.draft_attention), and OracleDrafter (kdtree.oracle_drafter). The flags of impl "auto", KERNEL_AUTO,
SDPA_MIN_BLOCKS and _HAVE_CUPY, are kdtree.draft_attention's, read there at every call: this module reads
them from there and sets them there (`kdtree.drafter.KERNEL_AUTO = False` turns the kernel off for "auto").
"""
from __future__ import annotations

import math
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from . import draft_attention as _attention
from .draft_attention import (DRAFT_ATTN_IMPLS, DRAFT_HEAD_DIM, DRAFT_MAX_ROWS, DraftAttention,
                              draft_attn_auto, draft_attn_kernel_fits, draft_attn_math)
from .drafter_args import DRAFTER_REQUIRED_KEYS, DrafterArgs
from .layers import RMSNorm, _refresh, apply_rope
from .moe import MLP
from .oracle_drafter import OracleDrafter

__all__ = ["DRAFTER_REQUIRED_KEYS", "DrafterArgs",
           "DRAFT_ATTN_IMPLS", "DRAFT_HEAD_DIM", "DRAFT_MAX_ROWS", "DraftAttention", "draft_attn_auto",
           "draft_attn_kernel_fits", "draft_attn_math",
           "DraftLayer", "DFlashDrafter", "draft_inv_freq", "DraftContext", "DFlashSession", "init_drafter",
           "build_drafter", "OracleDrafter"]


def _attn_flag(name: str) -> property:
    return property(lambda module: getattr(_attention, name),
                    lambda module, value: setattr(_attention, name, value),
                    doc=f"kdtree.draft_attention.{name}, read and set there")


class _DrafterModule(types.ModuleType):
    """This module's type: impl "auto"'s flags as properties that read and set kdtree.draft_attention's, so a
    flag set here (`setattr`, pytest's monkeypatch and its undo) is the one that "auto" reads."""

    KERNEL_AUTO = _attn_flag("KERNEL_AUTO")
    SDPA_MIN_BLOCKS = _attn_flag("SDPA_MIN_BLOCKS")
    _HAVE_CUPY = _attn_flag("_HAVE_CUPY")


def __dir__() -> list[str]:
    return sorted({*globals(), "KERNEL_AUTO", "SDPA_MIN_BLOCKS", "_HAVE_CUPY"})


sys.modules[__name__].__class__ = _DrafterModule


class DraftLayer(nn.Module):
    def __init__(self, a: DrafterArgs):
        super().__init__()
        self.self_attn = DraftAttention(a)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Block-diffusion drafter; `embed` and `lm_head` are the target's (shared, not in state_dict).
    attn_impl: the engine's drafting attention over its preallocated context
    (DraftAttention.forward_buffered), one of DRAFT_ATTN_IMPLS; set it before an engine captures its
    graphs."""

    attn_impl = "auto"

    def __init__(self, args: DrafterArgs, target=None):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(len(args.target_layer_ids) * args.target_hidden_size, args.hidden_size,
                            bias=False)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.register_buffer("inv_freq", draft_inv_freq(args), persistent=False)
        self._target = [target]  # a list keeps the target out of this module's parameters
        if target is not None:
            self.attach(target)

    def attach(self, target) -> "DFlashDrafter":
        a, t = self.args, target.args
        if (t.vocab_size, t.hidden_size) != (a.vocab_size, a.target_hidden_size):
            raise ValueError(f"drafter expects a target with vocab {a.vocab_size} and hidden "
                             f"{a.target_hidden_size}, got {t.vocab_size} and {t.hidden_size}")
        if a.hidden_size != t.hidden_size:
            raise ValueError(f"drafter hidden_size {a.hidden_size} must equal the target's {t.hidden_size} "
                             "(shared embedding and lm_head)")
        if max(a.target_layer_ids) >= t.num_hidden_layers:
            raise ValueError(f"target_layer_ids {a.target_layer_ids}: the target has {t.num_hidden_layers} "
                             "layers")
        self._target = [target]
        return self

    @property
    def target(self):
        if self._target[0] is None:
            raise RuntimeError("DFlashDrafter: no target attached (DFlashDrafter(args, target) or "
                               ".attach(target))")
        return self._target[0]

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def target_layer_ids(self) -> tuple:
        return self.args.target_layer_ids

    def rope(self, pos: torch.Tensor, dtype):
        f = pos[..., None].float() * self.inv_freq
        return f.cos().to(dtype), f.sin().to(dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, C, n_target_layers * target_hidden] -> [B, C, D]."""
        return self.hidden_norm(self.fc(features))

    def forward(self, block_tokens, block_pos, ctx_k, ctx_v) -> torch.Tensor:
        """block_tokens [B, bs], block_pos [B, bs]; ctx_k/ctx_v per layer [B, Hk, C, hd] -> logits
        [B, bs, V]."""
        x = self.target.model.embed_tokens(block_tokens).to(self.fc.weight.dtype)
        cos, sin = self.rope(block_pos, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i])
        return self.target.lm_head(self.norm(x).to(self.target.dtype)).float()

    def forward_blocks(self, features: torch.Tensor, blocks: torch.Tensor,
                       anchors: torch.Tensor) -> torch.Tensor:
        """Training pass: m blocks per sequence at once, each drafted as at inference.

        features [B, n, F] target features of positions 0..n-1; blocks [B, m, bs] block tokens
        ([root, mask, ...]); anchors [B, m] the roots' positions. Block j sees the context positions
        < anchors[b, j] (the root's own features are not in the cache when it is drafted) and its own block,
        non-causally, as propose() does. Returns logits [B, m, bs, V] float32."""
        B, n, _ = features.shape
        m, bs = blocks.shape[1:]
        dev = features.device
        ctx = self.project_context(features.to(self.fc.weight.dtype))                   # [B, n, D]
        cos_c, sin_c = self.rope(torch.arange(n, device=dev)[None].expand(B, n), ctx.dtype)
        pos = (anchors[:, :, None] + torch.arange(bs, device=dev)).reshape(B, m * bs)  # [B, m*bs]
        x = self.target.model.embed_tokens(blocks.reshape(B, m * bs)).to(self.fc.weight.dtype)
        cos, sin = self.rope(pos, x.dtype)
        seen_ctx = torch.arange(n, device=dev)[None, None] < anchors.repeat_interleave(bs, 1)[:, :, None]
        blk = torch.arange(m, device=dev).repeat_interleave(bs)
        seen_blk = (blk[:, None] == blk[None, :])[None].expand(B, -1, -1)
        mask = torch.cat([seen_ctx, seen_blk], dim=2)[:, None]                       # [B, 1, m*bs, n + m*bs]
        for layer in self.layers:
            ck, cv = layer.self_attn.kv(ctx, cos_c, sin_c)
            x = layer(x, cos, sin, ck, cv, mask)
        return self.target.lm_head(self.norm(x).to(self.target.dtype)).float().view(B, m, bs, -1)

    # ------------------------------------------------------------- the engine's batched, preallocated path
    def new_context(self, batch: int, max_len: int) -> "DraftContext":
        self.prepare_buffered()
        return DraftContext(self, batch, max_len)

    @torch.no_grad()
    def prepare_buffered(self) -> "DFlashDrafter":
        """(Re)build the fused weights of the engine's path (draft, extend): each layer's q/k/v projections as
        one [(H + 2 Hk) hd, D] matrix (k/v rows also used alone by extend), its MLP's gate and up rows as one
        [2I, D] matrix. Copies, refreshed in place (graphs captured earlier stay valid and see the new
        values): new_context calls it, so an engine built after the weights change uses them."""
        for layer in self.layers:
            at, mlp = layer.self_attn, layer.mlp
            at.qkv = _refresh(getattr(at, "qkv", None), torch.cat([at.q_proj.weight, at.k_proj.weight,
                                                                    at.v_proj.weight]))
            mlp.gate_up = _refresh(getattr(mlp, "gate_up", None), torch.cat([mlp.gate_proj.weight,
                                                                            mlp.up_proj.weight]))
        return self

    @staticmethod
    def _kv(at, x, cos, sin):
        """DraftAttention.kv, k and v in one GEMM (the k/v rows of prepare_buffered's matrix) when it ran."""
        a, (B, T, _) = at.a, x.shape
        if getattr(at, "qkv", None) is None:
            return at.kv(x, cos, sin)
        Hk, hd = a.num_key_value_heads, a.head_dim
        k, v = F.linear(x, at.qkv[a.num_attention_heads * hd:]).view(B, T, 2 * Hk, hd).split(Hk, dim=2)
        k = apply_rope(at.k_norm(k), cos[:, :, None], sin[:, :, None], interleave=False)
        return k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def _mlp(mlp, x):
        """The SwiGLU MLP with gate and up in one GEMM when prepare_buffered ran."""
        gu = getattr(mlp, "gate_up", None)
        if gu is None:
            return mlp(x)
        g, u = F.linear(x, gu).chunk(2, dim=-1)
        return mlp.down_proj(F.silu(g) * u)

    @torch.no_grad()
    def draft(self, ctx: "DraftContext", root: torch.Tensor, ctx_len: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, L, V] float32 below roots [B] at positions ctx_len [B] (the context holds
        positions [0, ctx_len)); B <= ctx.batch (slots 0..B-1). No host reads."""
        if self.attn_impl not in DRAFT_ATTN_IMPLS:
            raise ValueError(f"DFlashDrafter.attn_impl={self.attn_impl!r}: expected one of "
                             f"{DRAFT_ATTN_IMPLS}")
        a = self.args
        B, bs = root.shape[0], a.block_size
        block = torch.full((B, bs), a.mask_token_id, dtype=torch.long, device=root.device)
        block[:, 0] = root
        pos = ctx_len.long()[:, None] + torch.arange(bs, device=root.device)
        x = self.target.model.embed_tokens(block).to(self.fc.weight.dtype)
        cos, sin = self.rope(pos, x.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn.forward_buffered(h, cos, sin, ctx.k[i][:B], ctx.v[i][:B], ctx_len,
                                                     ctx.max_len, self.attn_impl)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
        return self.target.lm_head(self.norm(x[:, 1:]).to(self.target.dtype)).float()

    @torch.no_grad()
    def extend(self, ctx: "DraftContext", features: torch.Tensor, ctx_len: torch.Tensor, count: torch.Tensor,
               slot: int = 0) -> None:
        """Append features [B, A, F] of slots slot..slot+B-1 at context positions ctx_len + j for j < count[b]
        (rows j >= count go to the block columns, overwritten by the next draft). No host reads."""
        B, A, _ = features.shape
        dev = features.device
        x = self.project_context(features.to(self.fc.weight.dtype))                       # [B, A, D]
        j = torch.arange(A, device=dev)[None]
        cos, sin = self.rope(ctx_len.long()[:, None] + j, x.dtype)
        col = torch.where(j < count[:, None], ctx_len.long()[:, None] + j,
                          ctx.max_len + j % self.args.block_size)
        for i, layer in enumerate(self.layers):
            kk, vv = self._kv(layer.self_attn, x, cos, sin)                               # [B, Hk, A, hd]
            idx = col[:, None, :, None].expand_as(kk)
            ctx.k[i][slot:slot + B].scatter_(2, idx, kk)
            ctx.v[i][slot:slot + B].scatter_(2, idx, vv)

    def session(self, max_len: int) -> "DFlashSession":
        return DFlashSession(self, max_len)


def draft_inv_freq(args: DrafterArgs) -> torch.Tensor:
    """The drafter's RoPE frequencies float32 [head_dim / 2] (plain RoPE at rope_theta)."""
    return 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))


class DraftContext:
    """Preallocated context keys/values of every drafter layer for `batch` request slots: k[i], v[i]
    [batch, Hk, max_len + block_size, hd] (columns past max_len: the drafting block). Slot b's context length
    is the engine's (the target cache's length), kept by the caller."""

    def __init__(self, drafter: DFlashDrafter, batch: int, max_len: int):
        a = drafter.args
        shape = (batch, a.num_key_value_heads, max_len + a.block_size, a.head_dim)
        w = drafter.fc.weight
        self.k = [torch.zeros(shape, device=w.device, dtype=w.dtype) for _ in drafter.layers]
        self.v = [torch.zeros(shape, device=w.device, dtype=w.dtype) for _ in drafter.layers]
        self.batch, self.max_len = batch, max_len

    def move(self, src: int, dst: int) -> None:
        """Slot dst takes slot src's context (the engine keeps its active requests in slots 0..n-1)."""
        for t in self.k + self.v:
            t[dst].copy_(t[src])


class DFlashSession:
    """Per-request drafting state: the cached context keys/values of every drafter layer."""

    def __init__(self, drafter: DFlashDrafter, max_len: int):
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"max_len={max_len!r}: expected a positive int")
        self.d, self.max_len = drafter, max_len
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0
        self.started = False

    @torch.no_grad()
    def start(self, prompt_tokens, features: torch.Tensor) -> None:
        a = self.d.args
        dev, dt = self.d.fc.weight.device, self.d.fc.weight.dtype
        shape = (1, a.num_key_value_heads, 0, a.head_dim)
        self.k = [torch.zeros(shape, device=dev, dtype=dt) for _ in self.d.layers]
        self.v = [torch.zeros(shape, device=dev, dtype=dt) for _ in self.d.layers]
        self.length = 0
        self.started = True
        self.accept(features)

    @torch.no_grad()
    def accept(self, features: torch.Tensor) -> None:
        """features [k, F] for the next k context positions."""
        if not self.started:
            raise RuntimeError("DFlashSession.accept: call start(prompt_tokens, features) first")
        if features.dim() != 2 or features.shape[1] != self.d.fc.in_features:
            raise ValueError(f"features: expected [k, {self.d.fc.in_features}], got {tuple(features.shape)}")
        k = features.shape[0]
        if self.length + k > self.max_len:
            raise ValueError(f"features: {k} more positions overflow the session ({self.length} of max_len "
                             f"{self.max_len})")
        if k == 0:
            return
        ctx = self.d.project_context(features[None].to(self.d.fc.weight.dtype))  # [1, k, D]
        pos = torch.arange(self.length, self.length + k, device=ctx.device)[None]
        cos, sin = self.d.rope(pos, ctx.dtype)
        for i, layer in enumerate(self.d.layers):
            kk, vv = layer.self_attn.kv(ctx, cos, sin)
            self.k[i] = torch.cat([self.k[i], kk], dim=2)
            self.v[i] = torch.cat([self.v[i], vv], dim=2)
        self.length += k

    @torch.no_grad()
    def propose(self, committed) -> torch.Tensor:
        """Draft logits [L, V] for the L tokens after committed[-1] (at position len(committed) - 1)."""
        a = self.d.args
        if not self.started:
            raise RuntimeError("DFlashSession.propose: call start(prompt_tokens, features) first")
        if len(committed) == 0 or not 0 <= int(committed[-1]) < a.vocab_size:
            raise ValueError(f"committed: expected a non-empty list ending in a token id in "
                             f"[0, {a.vocab_size})")
        root_pos = len(committed) - 1
        dev = self.d.fc.weight.device
        block = torch.full((1, a.block_size), a.mask_token_id, dtype=torch.int64, device=dev)
        block[0, 0] = int(committed[-1])
        pos = torch.arange(root_pos, root_pos + a.block_size, device=dev)[None]
        return self.d(block, pos, self.k, self.v)[0, 1:]


@torch.no_grad()
def init_drafter(drafter: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    g = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return drafter


def build_drafter(target, args: DrafterArgs | None = None, seed: int = 0, **kw) -> DFlashDrafter:
    """A randomly initialised DFlash drafter attached to `target` (same device and dtype)."""
    args = args or DrafterArgs.for_target(target.args, **kw)
    d = init_drafter(DFlashDrafter(args), seed).to(device=target.device, dtype=target.dtype).eval()
    return d.attach(target)
