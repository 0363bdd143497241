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
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .config import ModelArgs, yarn_mscale

ATTN_IMPLS = ("naive", "absorb", "kernel")
MOE_PATHS = ("loop", "dense", "grouped")  # MoE.forward's paths for MLP experts
GATHER_PAIRS_MAX = 16  # MoE._gathered: (token, expert) pairs up to which compiled grouped rounds take it
RANK_TOPK_MAX = 64  # Gate._ranks: top-k by ranks ([N, E, E] comparisons) up to this many experts


# ----------------------------------------------------------------------------- small modules
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] and the cos/sin magnitude factor (YaRN's attention factor)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if args.rope_scaling is None:
        return 1.0 / pos_freqs, 1.0
    rs = args.rope_scaling
    factor = float(rs["factor"])
    orig = rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(n_rot: float) -> float:
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp  # 1 -> keep the original frequency, 0 -> interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all:
        attn_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    else:
        attn_factor = yarn_mscale(factor)
    return inv_freq, float(attn_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [..., P] by angles given as cos/sin [..., P/2] (broadcast over heads by the caller).

    Interleaved (DeepSeek's storage): pairs (x[2i], x[2i+1]); the output is de-interleaved
    [x_even*c - x_odd*s, x_odd*c + x_even*s], the same layout for queries and keys, so dot products
    are those of the interleaved rotation.
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Sigmoid router with a selection-only correction bias and group-limited top-k (noaux_tc)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts), persistent=True)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> the sigmoid scores float32 [N, E] (computed in float32, as the reference does)."""
        return F.linear(x.float(), self.weight.float()).sigmoid()

    def _weights(self, w: torch.Tensor) -> torch.Tensor:
        """Chosen experts' scores -> their combine weights (normalised when norm_topk_prob, scaled)."""
        if self.args.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.args.routed_scaling_factor

    def forward(self, x: torch.Tensor, scores=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k] int64). scores: the sigmoid scores [N, E] when
        the caller computed them (MoE._dense, whose expert GEMM carries the router's rows in float32)."""
        a = self.args
        if scores is None:
            scores = self.scores(x)  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        if a.n_group > 1:
            grouped = choice.view(-1, a.n_group, a.n_routed_experts // a.n_group)  # [N, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = group_scores.topk(a.topk_group, dim=-1).indices
            gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~gmask.repeat_interleave(a.n_routed_experts // a.n_group, dim=1),
                                        float("-inf"))
        idx = choice.topk(a.num_experts_per_tok, dim=-1).indices  # [N, k]
        return self._weights(scores.gather(1, idx)), idx

    def _ranks(self, scores: torch.Tensor) -> torch.Tensor | None:
        """Each expert's rank by selection score (0 the best, ties to the lower id, as topk orders distinct
        scores): int [N, E] from [N, E] comparisons, elementwise work a compiler fuses into one kernel where
        topk takes several. None with groups or more than RANK_TOPK_MAX experts (then topk)."""
        a, E = self.args, self.args.n_routed_experts
        if a.n_group > 1 or E > RANK_TOPK_MAX:
            return None
        c = scores + self.e_score_correction_bias.float()
        j = torch.arange(E, device=scores.device)
        ci, cj = c[:, :, None], c[:, None, :]                                           # [N, E(i), E(j)]
        beats = (cj > ci) | ((cj == ci) & (j[None, :] < j[:, None]))
        return beats.sum(-1)                                                            # [N, E]

    def route(self, x: torch.Tensor, scores=None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's (weights [N, k], ids [N, k]) with the top-k taken by `_ranks` where it applies (the
        engine's grouped path; forward itself keeps topk, the oracle's)."""
        if scores is None:
            scores = self.scores(x)  # [N, E]
        rank = self._ranks(scores)
        if rank is None:
            return self(x, scores)
        r = torch.arange(self.args.num_experts_per_tok, device=x.device)
        idx = (rank[:, None, :] == r[None, :, None]).to(torch.int32).argmax(-1)   # [N, k]: rank r's expert
        return self._weights(scores.gather(1, idx)), idx

    def dense_weights(self, x: torch.Tensor, scores=None) -> torch.Tensor:
        """The routing as one weight per expert: x [N, D] -> float32 [N, E], forward's weights at its ids and
        0 elsewhere (the top-k by `_ranks` where it applies)."""
        if scores is None:
            scores = self.scores(x)  # [N, E]
        rank = self._ranks(scores)
        if rank is None:
            w, idx = self(x, scores)
            return torch.zeros_like(scores).scatter_(1, idx, w)
        return self._weights(torch.where(rank < self.args.num_experts_per_tok, scores, 0.0))   # [N, E]


class Int4Experts(nn.Module):
    """The routed experts in the INT4 release format (kdtree/quant.py), stacked:
    w13_packed int32 [E, 2I, D/8] (rows [0, I) gate, [I, 2I) up), w13_scale bf16 [E, 2I, D/32],
    w2_packed int32 [E, D, I/8], w2_scale bf16 [E, D, I/32].

    forward(x [N, D], weights [N, k], idx [N, k]) -> float32 [N, D]: on a GPU with bf16 activations the
    moe_int4 kernel; elsewhere a reference path that dequantizes each touched expert (exact q * scale)."""

    def __init__(self, w13_packed, w13_scale, w2_packed, w2_scale):
        super().__init__()
        from .quant import QuantFormatError
        for name, t, kinds in (("w13_packed", w13_packed, (torch.int32,)),
                               ("w2_packed", w2_packed, (torch.int32,)),
                               ("w13_scale", w13_scale, (torch.bfloat16, torch.float16, torch.float32)),
                               ("w2_scale", w2_scale, (torch.bfloat16, torch.float16, torch.float32))):
            if not isinstance(t, torch.Tensor) or t.dtype not in kinds:
                raise QuantFormatError(f"{name}: expected a tensor of {' or '.join(map(str, kinds))}, got "
                                       f"{getattr(t, 'dtype', type(t).__name__)}")
        if w13_packed.dim() != 3 or 0 in w13_packed.shape or (w13_packed.shape[1] // 2) % 32 \
                or w13_packed.shape[1] % 2 or w13_packed.shape[2] % 4:
            raise QuantFormatError(f"w13_packed: expected int32 [E, 2I, D/8] with E > 0 and I, D multiples "
                                   f"of 32, got {tuple(w13_packed.shape)}")
        E, I2, D8 = w13_packed.shape
        want = {"w13_scale": (E, I2, D8 * 8 // 32), "w2_packed": (E, D8 * 8, I2 // 2 // 8),
                "w2_scale": (E, D8 * 8, I2 // 2 // 32)}
        for name, t in (("w13_scale", w13_scale), ("w2_packed", w2_packed), ("w2_scale", w2_scale)):
            if tuple(t.shape) != want[name]:
                raise QuantFormatError(f"{name}: expected shape {want[name]} for w13_packed "
                                       f"{tuple(w13_packed.shape)}, got {tuple(t.shape)}")
        self.register_buffer("w13_packed", w13_packed)
        self.register_buffer("w13_scale", w13_scale)
        self.register_buffer("w2_packed", w2_packed)
        self.register_buffer("w2_scale", w2_scale)
        # experts [id_offset, id_offset + E) of the router's (kdtree.tp)
        self.id_offset, self.subset = 0, False

    @property
    def released(self) -> bool:
        """True when only moe_int4's repacked copy is kept (`keep_kernel_only`, `random_kernel_only`)."""
        return self.w13_packed.is_meta

    def _need_release_format(self, what: str) -> None:
        if self.released:
            raise ValueError(f"Int4Experts.{what}: only the kernel-format copy is kept (keep_kernel_only); "
                             "the release-format weights this needs were dropped")

    def keep_kernel_only(self, chunk: int = 32) -> "Int4Experts":
        """Keep one copy of the experts: moe_int4's repacked weights (made `chunk` experts at a time, so the
        repack's temporaries stay small); the release-format buffers become shape-only (meta) tensors, and the
        reference path, `expert_weights`, `select` and saving refuse. Returns self."""
        if not self.released:
            src = (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)
            self._kernel_weights = _repack_chunks(lambda lo, hi: tuple(t[lo:hi] for t in src),
                                                  src[0].shape[0], chunk)
            self._to_meta()
        return self

    @classmethod
    def random_kernel_only(cls, E: int, D: int, I: int, device="cpu", seed: int = 0, scale: float = 0.01,
                           chunk: int = 32) -> "Int4Experts":
        """`random(...)` experts kept in moe_int4's layout only: each block of `chunk` experts is drawn in the
        release format and repacked into the kept copy, so the release format of the whole layer never
        exists (one copy of the layer's experts in memory)."""
        def block(lo, hi):
            r = cls.random(hi - lo, D, I, device=device, seed=seed * 100003 + lo, scale=scale)
            return r.w13_packed, r.w13_scale, r.w2_packed, r.w2_scale
        mw = _repack_chunks(block, E, chunk)
        meta = torch.device("meta")
        out = cls(torch.empty(E, 2 * I, D // 8, dtype=torch.int32, device=meta),
                  torch.empty(E, 2 * I, D // 32, dtype=torch.bfloat16, device=meta),
                  torch.empty(E, D, I // 8, dtype=torch.int32, device=meta),
                  torch.empty(E, D, I // 32, dtype=torch.bfloat16, device=meta))
        out._kernel_weights = mw
        return out

    def _to_meta(self) -> None:
        for name in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            t = getattr(self, name)
            setattr(self, name, torch.empty(t.shape, dtype=t.dtype, device="meta"))

    def select(self, lo: int, hi: int) -> "Int4Experts":
        """Experts [lo, hi) only (expert parallelism): routed ids outside the range contribute nothing
        here."""
        self._need_release_format("select")
        E = self.w13_packed.shape[0]
        if not 0 <= lo < hi <= E:
            raise ValueError(f"select: expected 0 <= lo < hi <= {E}, got lo={lo}, hi={hi}")
        sub = Int4Experts(*(t[lo:hi].clone() for t in (self.w13_packed, self.w13_scale, self.w2_packed,
                                                         self.w2_scale)))
        sub.id_offset, sub.subset = self.id_offset + lo, True
        return sub

    @classmethod
    def from_mlps(cls, experts) -> "Int4Experts":
        """Quantize bf16/fp32 experts (MLP modules) into the release format."""
        from .quant import quantize, stack_experts
        w13 = [quantize(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().float().cpu())
               for m in experts]
        w2 = [quantize(m.down_proj.weight.detach().float().cpu()) for m in experts]
        dev = experts[0].gate_proj.weight.device
        return cls(*(t.to(dev) for t in (*stack_experts(w13), *stack_experts(w2))))

    @classmethod
    def random(cls, E: int, D: int, I: int, device="cpu", seed: int = 0,
               scale: float = 0.01) -> "Int4Experts":
        """Random packed words and scales at any size (every int32 is a valid set of eight 4-bit values)."""
        g = torch.Generator(device=device).manual_seed(seed)

        def words(*shape):
            return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device, generator=g)

        def scales(*shape):
            return (torch.rand(shape, device=device, generator=g) * scale).to(torch.bfloat16)
        return cls(words(E, 2 * I, D // 8), scales(E, 2 * I, D // 32), words(E, D, I // 8),
                   scales(E, D, I // 32))

    def expert_weights(self, e: int, dtype=torch.float32):
        """(w13 [2I, D], w2 [D, I]) of expert e, dequantized."""
        from .quant import Int4Weight
        self._need_release_format("expert_weights")
        E, I2, D8 = self.w13_packed.shape
        w13 = Int4Weight(self.w13_packed[e], self.w13_scale[e], (I2, D8 * 8)).dequantize(dtype)
        w2 = Int4Weight(self.w2_packed[e], self.w2_scale[e], (D8 * 8, I2 // 2)).dequantize(dtype)
        return w13, w2

    def kernel_weights(self):
        """The experts in moe_int4's fragment order (kernels.repack_moe), made once per device and kept: the
        checkpoint-format buffers stay for saving and the reference path (twice the expert memory)."""
        from . import kernels
        mw = getattr(self, "_kernel_weights", None)
        if self.released:
            return mw
        if mw is None or mw.w13.device != self.w13_packed.device:
            mw = kernels.repack_moe(self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)
            self._kernel_weights = mw
        return mw

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.subset:  # router ids -> this module's; another rank's experts become -1, which grouping drops
            E = self.w13_packed.shape[0]
            idx = idx - self.id_offset
            idx = torch.where((idx >= 0) & (idx < E), idx, torch.full_like(idx, -1))
        if x.is_cuda and x.dtype == torch.bfloat16:
            from . import kernels
            return _launch(kernels.moe_int4, x.contiguous(), idx, weights.float(), self.kernel_weights(),
                           check_values=False)
        I = self.w13_packed.shape[1] // 2
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx[idx >= 0]).tolist():
            tok, slot = torch.where(idx == e)
            w13, w2 = self.expert_weights(e, torch.float32)
            gu = x[tok].float() @ w13.T
            y.index_add_(0, tok, ((F.silu(gu[:, :I]) * gu[:, I:]) @ w2.T) * weights[tok, slot, None].float())
        return y


def _repack_chunks(block, E: int, chunk: int):
    """kernels.MoeWeights of E experts from block(lo, hi) -> release-format (w13, s13, w2, s2) of experts
    [lo, hi), repacked `chunk` at a time into the kept tensors (repack_moe is per expert)."""
    from . import kernels
    out = None
    for lo in range(0, E, chunk):
        hi = min(E, lo + chunk)
        part = kernels.repack_moe(*block(lo, hi))
        if out is None:
            out = kernels.MoeWeights(*(torch.empty((E,) + t.shape[1:], dtype=t.dtype, device=t.device)
                                       for t in (part.w13, part.s13, part.w2, part.s2)), E, part.D, part.I)
        for name in ("w13", "s13", "w2", "s2"):
            getattr(out, name)[lo:hi] = getattr(part, name)
        del part
    return out


@torch.compiler.disable
def _launch(fn, *args, **kw):
    """A kdtree.kernels call (CuPy launches on torch's stream) run outside torch.compile's graphs: dynamo must
    not trace the launch plumbing; the compiled code around it stays compiled."""
    return fn(*args, **kw)


def _refresh(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """A derived weight kept across calls: `new` copied into `old` when it can hold it (same shape, dtype and
    device: memory a captured CUDA graph may read stays valid), else `new` itself. Returns the kept tensor."""
    new = new.detach()
    if old is not None and old.shape == new.shape and old.dtype == new.dtype and old.device == new.device:
        return old.copy_(new)
    return new.contiguous()


class AbsentExpert(nn.Module):
    """A routed expert held by another rank (kdtree.tp shards experts): it contributes nothing here."""


class MoE(nn.Module):
    """Routed experts (top-k of n_routed_experts) plus the always-on shared expert. The routed experts are
    MLP modules, or one Int4Experts after `quantize_experts()` (or when loaded from an INT4 checkpoint)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.gate = Gate(args)
        self.experts = nn.ModuleList(MLP(args.hidden_size, args.moe_intermediate_size)
                                     for _ in range(args.n_routed_experts))
        self.shared_experts = (MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
                               if args.n_shared_experts else None)

    def quantize_experts(self) -> None:
        """Replace the routed experts by their INT4 release-format quantization."""
        if not isinstance(self.experts, Int4Experts):
            self.experts = Int4Experts.from_mlps(self.experts)

    def stacked(self, refresh: bool = False):
        """The dense path's weights, stacked once and kept (a second copy of the MLP experts; refresh: copied
        again from the experts, in place where the shapes allow, as `Transformer.prepare_paged` does): (own
        [E'] int64 ids of the routed experts this rank holds, w13 [(E' + S) * 2I (+ E), D], w2 [(E' + S) * I,
        D], S). Slot s < E' is routed expert own[s], slot E' + c chunk c of the shared expert (its
        intermediate cut into S slices of I; S = 0 when it is not a multiple of I, and the shared expert then
        runs apart); w13 rows s * 2I + j are slot s's gate (j < I) and up rows, w2 row s * I + i column i of
        its down projection. In float32 the router's E rows follow in w13 (one GEMM for the router and the
        experts)."""
        st = getattr(self, "_stacked", None)
        w0 = next(m for m in self.experts if isinstance(m, MLP)).gate_proj.weight
        if refresh or st is None or st[1].device != w0.device or st[1].dtype != w0.dtype:
            own = [e for e, m in enumerate(self.experts) if isinstance(m, MLP)]
            mlps = [(self.experts[e].gate_proj.weight, self.experts[e].up_proj.weight,
                     self.experts[e].down_proj.weight) for e in own]
            S, sh, I = 0, self.shared_experts, w0.shape[0]
            if sh is not None and sh.gate_proj.weight.shape[0] % I == 0:   # (a TP shard's slice may not be)
                S = sh.gate_proj.weight.shape[0] // I
                mlps += [(sh.gate_proj.weight[c * I:(c + 1) * I], sh.up_proj.weight[c * I:(c + 1) * I],
                          sh.down_proj.weight[:, c * I:(c + 1) * I]) for c in range(S)]
            w13 = torch.cat([torch.cat([g, u]) for g, u, _ in mlps]
                            + ([self.gate.weight.to(w0.dtype)] if w0.dtype == torch.float32 else [])).detach()
            w2 = torch.cat([d.t() for _, _, d in mlps])
            old = st if st is not None and st[3] == S else (None,) * 4
            st = self._stacked = (torch.tensor(own, device=w0.device) if old[0] is None else old[0],
                                  _refresh(old[1], w13), _refresh(old[2], w2), S)
        return st

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Every held expert and the shared expert over every token as two plain GEMMs, the routing's weights
        (0 where not routed, 1 for the shared expert) applied between them: y = sum over slots of
        w * (silu(x W_gate) * (x W_up)) W_down. Fixed shapes, no host reads, no atomics (capturable and
        deterministic). x [N, D] -> [N, D] in x's dtype, the shared expert included."""
        own, w13, w2, S = self.stacked()
        E, N = self.args.n_routed_experts, x.shape[0]
        n_slots = own.numel() + S
        I = w2.shape[0] // n_slots
        gu = F.linear(x, w13)                                          # [N, slots * 2I (+ E)]
        scores = gu[:, n_slots * 2 * I:].sigmoid() if gu.shape[1] > n_slots * 2 * I else None
        comb = self.gate.dense_weights(x, scores)                     # [N, E]
        if own.numel() < E:
            comb = comb[:, own]                                        # [N, E']
        if S:
            comb = torch.cat([comb, comb.new_ones(N, S)], 1)           # [N, slots]
        gu = gu[:, :n_slots * 2 * I].view(N, n_slots, 2 * I)
        h = F.silu(gu[..., :I]) * gu[..., I:] * comb[..., None].to(x.dtype)   # [N, slots, I]
        y = h.reshape(N, n_slots * I) @ w2                             # [N, D]
        return y if S or self.shared_experts is None else y + self.shared_experts(x)

    def grouped(self, refresh: bool = False):
        """The grouped path's weights: w13 [E, 2I, D] (gate rows then up rows per expert) and w2 [E, D, I],
        stacked once and kept (a second copy of the experts; refresh as in `stacked`)."""
        st = getattr(self, "_grouped_w", None)
        w0 = self.experts[0].gate_proj.weight
        if refresh or st is None or st[0].device != w0.device or st[0].dtype != w0.dtype:
            w13 = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in self.experts])
            w2 = torch.stack([m.down_proj.weight for m in self.experts])
            old = st or (None, None)
            st = self._grouped_w = (_refresh(old[0], w13), _refresh(old[1], w2))
        return st

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts as two grouped GEMMs over the (token, expert) pairs sorted by expert (torch's
        _grouped_mm: per-group sizes read on the device, so no host reads and capturable; an expert no token
        chose is not read), combined by un-permuting and summing each token's k rows (no atomics), plus the
        shared expert. x [N, D] -> [N, D]. Needs every routed expert on this rank."""
        N, k = x.shape[0], self.args.num_experts_per_tok
        if N * k <= GATHER_PAIRS_MAX and torch.compiler.is_compiling():
            return self._gathered(x)
        w13, w2 = self.grouped()
        I = w2.shape[2]
        weights, idx = self.gate.route(x)                              # [N, k]
        flat = idx.flatten()                                           # [N k]
        order = flat.argsort(stable=True)                              # pairs by expert
        counts = (flat[:, None] == torch.arange(w13.shape[0], device=x.device)).sum(0)   # [E]
        offs = counts.cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs)           # [N k, 2I]
        h = F.silu(gu[:, :I]) * gu[:, I:] * weights.flatten()[order, None].to(x.dtype)
        ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)                         # [N k, D]
        y = torch.empty_like(ys).index_copy_(0, order, ys).view(N, k, -1).sum(1)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """The grouped path for a few (token, expert) pairs (decode; chosen under torch.compile): each pair's
        projections as an elementwise product summed over the input dim, the chosen expert's rows indexed in
        place, which the compiler turns into reductions reading the chosen experts' weights directly (no sort,
        no grouped GEMM set-up; eagerly it would build the [pairs, 2I, D] product). x [N, D] -> [N, D]."""
        N, k = x.shape[0], self.args.num_experts_per_tok
        w13, w2 = self.grouped()
        I = w2.shape[2]
        weights, idx = self.gate.route(x)                              # [N, k]
        e = idx.flatten()                                              # [N k], pair p = n k + j
        xp = x[:, None, :].expand(N, k, x.shape[1]).reshape(N * k, 1, -1)             # [N k, 1, D]
        gu = (xp * w13[e]).sum(-1, dtype=torch.float32)                                 # [N k, 2I]
        h = F.silu(gu[:, :I]) * gu[:, I:] * weights.flatten()[:, None]                  # [N k, I] float32
        ys = (h.to(x.dtype)[:, None, :] * w2[e]).sum(-1, dtype=torch.float32)          # [N k, D]
        y = ys.view(N, k, -1).sum(1).to(x.dtype)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    def forward(self, x: torch.Tensor, path: str = "loop") -> torch.Tensor:
        """x [..., D]. path (MLP experts; INT4 experts always take Int4Experts.forward): "loop" over the
        routed experts with host reads, "dense" every expert by `_dense` (capturable, batch-invariant),
        "grouped" the routed pairs by `_grouped` (capturable, reads only the chosen experts)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        if path == "dense" and not isinstance(self.experts, Int4Experts):
            return self._dense(x).view(shape)
        if path == "grouped" and not isinstance(self.experts, Int4Experts):
            return self._grouped(x).view(shape)
        weights, idx = self.gate(x)  # [N, k]
        if isinstance(self.experts, Int4Experts):
            y = self.experts(x, weights, idx)
        else:
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            counts = torch.bincount(idx.flatten(), minlength=self.args.n_routed_experts).tolist()
            for e, c in enumerate(counts):
                if c == 0 or isinstance(self.experts[e], AbsentExpert):
                    continue
                tok, slot = torch.where(idx == e)
                out = self.experts[e](x[tok])
                y.index_add_(0, tok, out.float() * weights[tok, slot, None])
        y = y.to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


# ----------------------------------------------------------------------------- latent KV cache
@dataclass
class AttnMeta:
    """Attention metadata of one forward, built once per forward and read by every layer: B requests, T block
    rows each, and the attention and MoE implementation switches. Two layouts:
      paged (start None; `build`, kdtree.engine): the block's latent rows go to rows `slots` of a shared page
        pool; the keys are the request's pages, kv_cap rows masked by bias / mask_words;
      cache (start an int; `for_cache`, Transformer.forward_grad): the block's rows go to rows start ...
        start + T of each request's contiguous cache (KVCache.latent); the keys are its first kv_cap =
        start + T rows.
    Every tensor field is a device tensor and every other field a host constant of the shapes (never a value
    read from the device), so a forward built from it can be captured in a CUDA graph and replayed with the
    tensors rewritten in place (other lengths, pages, masks)."""
    page_table: torch.Tensor | None   # int32 [B, P]: request b's pages (paged; the cache's for "kernel")
    slots: torch.Tensor | None        # int64 [B, T]: pool row of each block row (paged)
    positions: torch.Tensor           # int [B, T]: rope position ids
    seq_len: torch.Tensor | None      # int32 [B]: cached rows including the block (paged, or "kernel")
    mask_words: torch.Tensor | None   # int32 [B, T, ceil(T/32)]: block visibility bits (attn_impl "kernel")
    bias: torch.Tensor | None         # float32 [B, T, kv_cap]: 0 visible, -inf not (torch attention paths)
    kv_cap: int                       # keys attended per request: P * page_size (paged), start + T (cache)
    page_size: int
    moe: str = "loop"                 # MoE.forward's path for MLP experts: "loop" | "dense" | "grouped"
    attn_impl: str = "absorb"         # MLA's path: "naive" | "absorb" | "kernel"
    start: int | None = None          # cache layout: rows cached before the block; None: paged

    def __post_init__(self):
        if self.moe not in MOE_PATHS:
            raise ValueError(f"moe={self.moe!r}: expected one of {MOE_PATHS}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r}: expected one of {ATTN_IMPLS}")

    @classmethod
    def build(cls, page_table, cache_len, positions, mask, page_size: int, attn_impl: str, moe: str = "loop",
              mask_words=None) -> "AttnMeta":
        """page_table int32 [B, P]; cache_len int [B] rows cached before the block; positions int [B, T];
        mask bool [B, T, T] (block row i sees block row j); mask_words: its packed bits when already known."""
        B, T = positions.shape
        P = page_table.shape[1]
        dev = positions.device
        rows = cache_len.long()[:, None] + torch.arange(T, device=dev)                       # [B, T]
        slots = page_table.long().gather(1, rows // page_size) * page_size + rows % page_size
        seq_len = (cache_len + T).to(torch.int32)
        kv_cap = P * page_size
        words = bias = None
        if attn_impl == "kernel":
            if mask_words is None:
                from .kernels import pack_mask
                mask_words = pack_mask(mask)
            words = mask_words
        else:
            if mask is None:  # unpack the bits: bit j % 32 of word j // 32
                j = torch.arange(T, device=dev)
                mask = ((mask_words[:, :, j // 32] >> (j % 32)) & 1).bool()
            rel = torch.arange(kv_cap, device=dev)[None] - cache_len.long()[:, None]       # [B, S]
            seen = mask.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, kv_cap))   # [B, T, S]
            vis = (rel < 0)[:, None] | (seen & (rel < T)[:, None])
            bias = torch.zeros(B, T, kv_cap, device=dev).masked_fill(~vis, float("-inf"))
        return cls(page_table, slots, positions.long(), seq_len, words, bias, kv_cap, page_size, moe,
                   attn_impl)

    @classmethod
    def for_cache(cls, cache: "KVCache", start: int, positions, mask, attn_impl: str) -> "AttnMeta":
        """The cache layout: T block rows after `start` cached ones in `cache` (a KVCache); positions int
        [B, T]; mask bool [B, T, T] (block row i sees block row j; every cached row is seen)."""
        B, T = positions.shape
        S, dev = start + T, positions.device
        page_table = seq_len = words = bias = None
        if attn_impl == "kernel":
            from .kernels import pack_mask
            page_table = cache.page_table()
            seq_len = torch.full((B,), S, dtype=torch.int32, device=dev)
            words = pack_mask(mask)
        else:
            bias = torch.zeros(B, T, S, dtype=torch.float32, device=dev)
            bias[:, :, start:] = torch.zeros(B, T, T, device=dev).masked_fill(~mask, float("-inf"))
        return cls(page_table, None, positions, seq_len, words, bias, S, KVCache.PAGE_SIZE, "loop", attn_impl,
                   start)


PagedMeta = AttnMeta  # the paged layout's name in the engine and the benchmarks


def free_bytes(device) -> int:
    """Memory an allocation on `device` can take now: the GPU's free memory, or the host's available memory
    (MemAvailable, else the physical total)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(what: str, nbytes: int, device) -> None:
    """ValueError naming `what` (the arguments that size it) when nbytes exceeds what the device has free,
    before anything is allocated."""
    free = free_bytes(device)
    if nbytes > free:
        raise ValueError(f"{what}: needs {nbytes / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB "
                         f"free on {torch.device(device)}")


class KVCache:
    """Per-layer latent cache: latent [layers, B, S_pad, kv_lora_rank + rope_dim], the normalized latent
    (`kv` view) then the rotated rope key (`pe` view). Rows are padded to whole pages of PAGE_SIZE, so that
    one layer, viewed as [B * S_pad, 576], is a paged cache whose page table is `page_table()`.
    `length` tokens are committed; `forward` appends a block after them."""

    PAGE_SIZE = 64

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype=torch.float32, device="cpu"):
        max_len = checks.positive_int("KVCache max_len", max_len, note=" (rows of the cache)")
        batch = checks.positive_int("KVCache batch", batch)
        L, R = args.num_hidden_layers, args.kv_lora_rank
        s_pad = -(-max_len // self.PAGE_SIZE) * self.PAGE_SIZE
        item = torch.empty(0, dtype=dtype).element_size()
        check_memory(f"KVCache batch={batch}, max_len={max_len}",
                     L * batch * s_pad * (R + args.qk_rope_head_dim) * item, device)
        self.latent = torch.zeros(L, batch, s_pad, R + args.qk_rope_head_dim, dtype=dtype, device=device)
        self.kv, self.pe = self.latent[..., :R], self.latent[..., R:]
        self.length = 0
        self.block: tuple[int, int] | None = None  # (start, n) of the last appended block
        self.max_len, self.batch = max_len, batch

    def compact(self, keep_indices) -> None:
        """Keep rows `keep_indices` (strictly increasing, within the last appended block) and drop the rest.

        The kept rows move, in order, to the front of the block; `length` becomes block_start + len(keep).
        """
        if self.block is None:
            raise RuntimeError("KVCache.compact: no appended block to compact (call forward first; compact "
                               "once)")
        start, n = self.block
        keep = torch.as_tensor(keep_indices)
        if keep.dtype not in (torch.int32, torch.int64) or keep.dim() != 1:
            raise ValueError(f"compact keep_indices: expected a 1-D integer sequence, got dtype "
                             f"{keep.dtype}, shape {tuple(keep.shape)}")
        keep = keep.to(torch.int64)
        if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= n):
            raise IndexError(f"compact keep_indices: expected values in [0, {n}) (the appended block), "
                             f"got min {int(keep.min())}, max {int(keep.max())}")
        if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
            raise ValueError("compact keep_indices: expected strictly increasing indices (a path in tree "
                             "order)")
        k = keep.numel()
        if k:
            src = keep.to(self.latent.device) + start
            self.latent[:, :, start:start + k] = self.latent[:, :, src]
        self.length = start + k
        self.block = None

    def page_table(self) -> torch.Tensor:
        """int32 [B, S_pad / PAGE_SIZE]: request b's pages in a layer viewed as [B * S_pad, D]."""
        B, s_pad = self.batch, self.latent.shape[2]
        n = s_pad // self.PAGE_SIZE
        return torch.arange(B * n, dtype=torch.int32, device=self.latent.device).view(B, n)

    def compact_rows(self, accepted: torch.Tensor, acc_len: int) -> None:
        """GPU compaction (kernels.kv_compact) of batch row 0: keep block rows accepted[0, :acc_len]."""
        from . import kernels
        if self.block is None:
            raise RuntimeError("KVCache.compact_rows: no appended block to compact")
        if self.batch != 1:
            raise ValueError("KVCache.compact_rows: batch 1 only (one block start per request)")
        start, n = self.block
        L = self.latent.shape[0]
        kernels.kv_compact(self.latent.view(L, -1, self.latent.shape[-1]), self.page_table(),
                           torch.tensor([start], dtype=torch.int32, device=self.latent.device), accepted,
                           torch.tensor([acc_len], dtype=torch.int32, device=self.latent.device),
                           page_size=self.PAGE_SIZE, check_values=False)
        self.length = start + acc_len
        self.block = None

    def truncate(self, length: int) -> None:
        length = checks.int_in("truncate length", length, 0, self.length)
        self.length, self.block = length, None


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
            from . import kernels
            w = self.kv_b_proj.weight.view(H, Dn + Dv, R)
            q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w[:, :Dn])  # [B, T, H, R]
            qk = torch.cat([q_lat, q_pe], dim=-1).to(torch.bfloat16).contiguous()  # [B, T, H, 576]
            o_lat, _ = _launch(kernels.verify_attn, qk, rows, meta.page_table, meta.seq_len, meta.mask_words,
                               scale, page_size=meta.page_size, check_values=False, max_seq_len=S)
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
        super().__init__()
        self.args = args
        self.attn_impl = attn_impl
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # forward_paged's layers through kdtree.fused's kernels where they apply (True), else Block.forward
        self.fused = False
        inv_freq, self.rope_attn_factor = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, value: str) -> None:
        if value not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={value!r}: expected one of {ATTN_IMPLS}")
        if value == "kernel" and (self.args.kv_lora_rank, self.args.qk_rope_head_dim) != (512, 64):
            raise ValueError(f"attn_impl='kernel' needs kv_lora_rank 512 and qk_rope_head_dim 64 (the "
                             f"kernel's 576-wide rows), got {self.args.kv_lora_rank} and "
                             f"{self.args.qk_rope_head_dim}")
        self._attn_impl = value

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
    """A randomly initialised model (see `init_weights`) on `device` in `dtype`."""
    m = Transformer(args, attn_impl)
    init_weights(m, seed)
    return m.to(device=device, dtype=dtype).eval()
