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
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .layers import RMSNorm, _refresh, apply_rope
from .moe import MLP
from .ops.draft_attn import HEAD_DIM as DRAFT_HEAD_DIM
from .ops.draft_attn import MAX_ROWS as DRAFT_MAX_ROWS
from .ops.draft_attn import draft_attn as _draft_attn_op


DRAFTER_REQUIRED_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "vocab_size", "num_hidden_layers",
                         "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                         "intermediate_size")


@dataclass
class DrafterArgs:
    block_size: int = 8
    mask_token_id: int = 1023
    target_layer_ids: tuple = (0, 1, 3)
    target_hidden_size: int = 256
    vocab_size: int = 1024
    num_hidden_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self):
        ids = self.target_layer_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"DrafterArgs.target_layer_ids={ids!r}: expected a list of target layer "
                             "indices (ints)")
        self.target_layer_ids = tuple(ids)
        for name in ("block_size", "mask_token_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"DrafterArgs.{name}={v!r}: expected an int")
        for name in ("vocab_size", "target_hidden_size", "num_hidden_layers", "hidden_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DrafterArgs.{name}={v!r}: expected a positive int")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"DrafterArgs.{name}={v!r}: expected a finite number > 0")
        if min(self.target_layer_ids, default=0) < 0:
            raise ValueError(f"DrafterArgs.target_layer_ids={self.target_layer_ids}: expected layer indices "
                             ">= 0")
        if not (isinstance(self.block_size, int) and self.block_size >= 2):
            raise ValueError(f"DrafterArgs.block_size={self.block_size!r}: expected an int >= 2")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DrafterArgs.mask_token_id={self.mask_token_id}: expected in "
                             f"[0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("DrafterArgs.target_layer_ids: expected at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DrafterArgs.num_key_value_heads={self.num_key_value_heads}: expected a "
                             f"divisor of num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"DrafterArgs.head_dim={self.head_dim}: expected an even number")

    @classmethod
    def for_target(cls, target, block_size: int = 8, num_hidden_layers: int = 2, **kw) -> "DrafterArgs":
        """Defaults sized to a target's ModelArgs: layers spread over its depth, its vocab, a mask id at
        V-1."""
        n = target.num_hidden_layers
        k = min(n, 3)
        ids = tuple(sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)}))
        heads = kw.pop("num_attention_heads", 4)
        base = dict(block_size=block_size, mask_token_id=target.vocab_size - 1, target_layer_ids=ids,
                    target_hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                    num_hidden_layers=num_hidden_layers, hidden_size=target.hidden_size,
                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                    head_dim=target.hidden_size // heads, intermediate_size=2 * target.hidden_size,
                    rms_norm_eps=target.rms_norm_eps, max_position_embeddings=target.max_position_embeddings)
        base.update(kw)
        return cls(**base)

    def to_hf_config(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d.update(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_act="silu")
        return d

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DrafterArgs":
        """From a DFlash drafter's config.json (its DFlash keys at the top or under dflash_config); the keys
        that fix its shapes and its tie to the target are required."""
        if not isinstance(cfg, dict) or not isinstance(cfg.get("dflash_config", {}), dict):
            raise ValueError(f"DrafterArgs.from_hf_config: expected a JSON object, got {type(cfg).__name__}")
        names = set(cls.__dataclass_fields__)
        merged = {**cfg, **cfg.get("dflash_config", {})}
        missing = [k for k in DRAFTER_REQUIRED_KEYS if k not in merged]
        if missing:
            raise ValueError(f"DrafterArgs.from_hf_config: the drafter config lacks the required key(s) "
                             f"{missing}")
        return cls(**{k: v for k, v in merged.items() if k in names})


class DraftAttention(nn.Module):
    def __init__(self, a: DrafterArgs):
        super().__init__()
        self.a = a
        D, H, Hk, hd = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.k_proj = nn.Linear(D, Hk * hd, bias=False)
        self.v_proj = nn.Linear(D, Hk * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, a.rms_norm_eps)
        self.k_norm = RMSNorm(hd, a.rms_norm_eps)

    def kv(self, x, cos, sin):
        """x [B, T, D] -> k, v [B, Hk, T, hd] (k normed and rotated)."""
        B, T, _ = x.shape
        a = self.a
        k = self.k_norm(self.k_proj(x).view(B, T, a.num_key_value_heads, a.head_dim))
        k = apply_rope(k, cos[:, :, None], sin[:, :, None], interleave=False)
        v = self.v_proj(x).view(B, T, a.num_key_value_heads, a.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        """x [B, T, D] block states; ctx_k/ctx_v [B, Hk, C, hd] cached context. Non-causal; mask (optional,
        bool [B or 1, 1, T, C + T]: query row sees key column) for several blocks in one pass (training)."""
        a = self.a
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, a.num_attention_heads, a.head_dim))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None], interleave=False).transpose(1, 2)  # [B, H, T, hd]
        k, v = self.kv(x, cos, sin)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        rep = a.num_attention_heads // a.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)  # [B, H, T, hd]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


    def forward_buffered(self, x, cos, sin, kbuf, vbuf, ctx_len, C: int, impl: str = "auto"):
        """The drafting pass over a preallocated context (the engine's, graph-capturable): x [B, T, D] block
        states; kbuf/vbuf [B, Hk, C + T, hd], columns [0, ctx_len[b]) request b's context, columns [C, C + T)
        this pass's block (written here); ctx_len int [B]. Same result as forward(x, cos, sin, ctx_k, ctx_v)
        (query head h reads KV head h // (H / Hk)); with DFlashDrafter.prepare_buffered's fused weight, q, k
        and v come from one GEMM. impl: "kernel" (kdtree.ops.draft_attn: a split-KV kernel that reads only
        each request's ctx_len + T live columns, ctx_len on the device; bf16 on a CUDA device, head_dim 128,
        G * T <= 64), "math" (scores as one batched GEMM over every column, masked softmax, a second GEMM:
        parallel over the columns, so a few query rows over a long context keep the GPU busy) or "sdpa"
        (torch's fused attention: its grid is B x Hk x row tiles of 64, a handful of blocks at batch 1, each
        streaming the whole context), or "auto" (`draft_attn_auto`: kernel where it fits and KERNEL_AUTO is
        set, else math while sdpa's grid would be under SDPA_MIN_BLOCKS blocks, and always in float32:
        torch's fused float32 kernel runs without tensor cores; python -m kdtree.bench.drafter measures
        them)."""
        a = self.a
        B, T, _ = x.shape
        H, Hk, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        if getattr(self, "qkv", None) is not None:
            q, k, v = F.linear(x, self.qkv).split([H * hd, Hk * hd, Hk * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(B, T, H, hd))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None], interleave=False).transpose(1, 2)  # [B, H, T, hd]
        k = apply_rope(self.k_norm(k.view(B, T, Hk, hd)), cos[:, :, None], sin[:, :, None], interleave=False)
        kbuf[:, :, C:C + T] = k.transpose(1, 2)
        vbuf[:, :, C:C + T] = v.view(B, T, Hk, hd).transpose(1, 2)
        # the G = H / Hk query heads of a KV head as G * T query rows of it: K/V are never repeated
        G = H // Hk
        q = q.reshape(B, Hk, G * T, hd)
        if impl == "auto":
            impl = draft_attn_auto(kbuf.device, kbuf.dtype, B, Hk, G * T, hd)
        if impl == "kernel":
            o = _draft_attn_kernel(q.contiguous(), kbuf, vbuf, ctx_len.to(torch.int32), C, hd ** -0.5)
            return self.o_proj(o.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, -1))
        col = torch.arange(C + T, device=x.device)
        seen = (col[None] < ctx_len[:, None]) | (col[None] >= C)                               # [B, C + T]
        if impl == "math":
            s = (q @ kbuf.transpose(-1, -2)).float() * hd ** -0.5                        # [B, Hk, G*T, C+T]
            p = s.masked_fill(~seen[:, None, None, :], float("-inf")).softmax(-1)
            o = p.to(vbuf.dtype) @ vbuf                                                 # [B, Hk, G*T, hd]
        elif impl == "sdpa":
            o = F.scaled_dot_product_attention(q, kbuf, vbuf, attn_mask=seen[:, None, None, :])
        else:
            raise ValueError(f"impl={impl!r}: expected one of {DRAFT_ATTN_IMPLS}")
        return self.o_proj(o.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, -1))


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


DRAFT_ATTN_IMPLS = ("auto", "kernel", "math", "sdpa")
SDPA_MIN_BLOCKS = 16   # "auto": below this many blocks of torch's fused attention, the batched-GEMM form


@torch.compiler.disable
def _draft_attn_kernel(q, kbuf, vbuf, ctx_len, C: int, scale: float) -> torch.Tensor:
    """kdtree.ops.draft_attn.draft_attn with no host reads (check_values=False: graph-capturable), run outside
    torch.compile's graphs (dynamo must not trace the launch plumbing)."""
    return _draft_attn_op(q, kbuf, vbuf, ctx_len, C, scale, check_values=False)


_HAVE_CUPY = importlib.util.find_spec("cupy") is not None  # the kernels' launcher is installed
KERNEL_AUTO = True    # impl "auto" takes "kernel" (where it fits) only when set; by name it always runs


def draft_attn_kernel_fits(device: torch.device, dtype: torch.dtype, head_dim: int, rows: int,
                           have_cupy: bool | None = None) -> bool:
    """impl "auto"'s first choice: the split-KV kernel (kdtree.ops.draft_attn) for bfloat16 buffers on a CUDA
    device, head_dim 128 and at most 64 query rows per KV head (G * T), where CuPy is installed (have_cupy:
    that condition given, e.g. for a GPU record read on another machine)."""
    cupy_ok = _HAVE_CUPY if have_cupy is None else have_cupy
    return (torch.device(device).type == "cuda" and dtype == torch.bfloat16 and head_dim == DRAFT_HEAD_DIM
            and rows <= DRAFT_MAX_ROWS and cupy_ok)


def draft_attn_auto(device, dtype: torch.dtype, batch: int, kv_heads: int, rows: int, head_dim: int,
                    have_cupy: bool | None = None) -> str:
    """The impl "auto" takes: "kernel" where KERNEL_AUTO is set and `draft_attn_kernel_fits`, else "math"
    where `draft_attn_math`, else "sdpa"."""
    if KERNEL_AUTO and draft_attn_kernel_fits(device, dtype, head_dim, rows, have_cupy):
        return "kernel"
    return "math" if draft_attn_math(batch, kv_heads, rows, dtype) else "sdpa"


def draft_attn_math(batch: int, kv_heads: int, rows: int, dtype: torch.dtype) -> bool:
    """impl "auto"'s choice where the kernel does not fit: the batched-GEMM form ("math") for float32, or
    while torch's fused attention would run fewer than SDPA_MIN_BLOCKS blocks (batch x KV heads x tiles of 64
    query rows)."""
    return dtype == torch.float32 or batch * kv_heads * -(-rows // 64) < SDPA_MIN_BLOCKS


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


# ----------------------------------------------------------------------------- test oracle
class OracleDrafter:
    """TEST ORACLE, not a model: it reads the target's own future greedy tokens.

    `reference` is prompt + the target's greedy continuation. For a root at committed length n, each depth d
    gets a calibrated draft distribution around the true token t = reference[n - 1 + d]: `k` decoy tokens and
    t share weights w ~ Dirichlet(concentration) (sorted, largest first), and t takes slot j with probability
    w[j], so the truth is a sample of the draft's own distribution. With probability `miss` the truth is left
    out (it gets background mass only). Background: the remaining `background` mass spread over the
    vocabulary with N(0, noise) log-jitter. Deterministic per (seed, n). Off the reference (never, while the
    decoding is lossless) the truth is unknown and only decoys are drawn.
    """

    target_layer_ids: tuple = ()

    def __init__(self, reference, vocab_size: int, block_size: int = 8, concentration: float = 0.3,
                 k: int = 4, miss: float = 0.05, background: float = 0.02, noise: float = 0.5, seed: int = 0):
        vocab_size = checks.positive_int("OracleDrafter vocab_size", vocab_size)
        reference = checks.token_list("OracleDrafter reference", reference, vocab_size, allow_empty=True)
        block_size = checks.int_in("OracleDrafter block_size", block_size, 2,
                                   note=" (the root and at least one drafted depth)")
        k = checks.int_in("OracleDrafter k", k, 0, vocab_size - 1, " (decoys besides the true token)")
        concentration = checks.finite_float("OracleDrafter concentration", concentration, lo=1e-6)
        miss = checks.finite_float("OracleDrafter miss", miss, lo=0.0, hi=1.0)
        background = checks.finite_float("OracleDrafter background", background, lo=0.0, hi=0.999)
        noise = checks.finite_float("OracleDrafter noise", noise, lo=0.0)
        seed = checks.int_in("OracleDrafter seed", seed, 0)
        self.reference = reference
        self.vocab_size, self.block_size = vocab_size, block_size
        self.concentration, self.k, self.miss = concentration, k, miss
        self.background, self.noise, self.seed = background, noise, seed

    def session(self, max_len: int) -> "OracleDrafter":
        return self

    def start(self, prompt_tokens, features=None) -> None:
        n = len(prompt_tokens)
        if self.reference[:n] != [int(t) for t in prompt_tokens]:
            raise ValueError("OracleDrafter: the reference does not start with this prompt")

    def accept(self, features=None) -> None:
        pass

    def propose(self, committed) -> torch.Tensor:
        n = len(committed)
        L, V = self.block_size - 1, self.vocab_size
        rng = np.random.default_rng((self.seed, n))
        on_track = self.reference[:n] == list(map(int, committed))
        probs = np.full((L, V), self.background / V)
        probs *= np.exp(self.noise * rng.standard_normal((L, V)))
        for d in range(1, L + 1):
            j = n - 1 + d
            truth = self.reference[j] if on_track and j < len(self.reference) else -1
            k = min(self.k + 1, V)
            w = np.sort(rng.dirichlet([self.concentration] * k))[::-1] * (1 - self.background)
            tokens = rng.permutation(V)[:k + 1]
            tokens = [t for t in tokens if t != truth][:k]
            if truth >= 0 and rng.random() >= self.miss:
                slot = int(rng.choice(k, p=w / w.sum()))
                tokens[slot] = truth
            probs[d - 1, tokens] += w
        return torch.from_numpy(np.log(probs).astype(np.float32))
