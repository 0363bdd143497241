"""The MoE feed-forward of the MLA + MoE model: the SwiGLU `MLP`, the sigmoid router `Gate` (noaux_tc), the
routed experts as MLPs or stacked INT4 (`Int4Experts`, the release format of kdtree/quant.py), and `MoE`
(top-k routed experts plus the shared expert) with its three paths for MLP experts (MOE_PATHS)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs
from .layers import _launch, _refresh

MOE_PATHS = ("loop", "dense", "grouped")  # MoE.forward's paths for MLP experts
GATHER_PAIRS_MAX = 16  # MoE._gathered: (token, expert) pairs up to which compiled grouped rounds take it
RANK_TOPK_MAX = 64  # Gate._ranks: top-k by ranks ([N, E, E] comparisons) up to this many experts


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


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
    """The routed experts of MoE._grouped for given routing (capturable, no host reads): the (token, expert)
    pairs sorted by expert, two torch._grouped_mm over stacked experts w13 [E, 2I, D] and w2 [E, D, I], each
    token's k rows weighted and summed. x [N, D], weights / idx [N, k] -> [N, D] in x's dtype."""
    N, k = idx.shape
    I = w2.shape[2]
    flat = idx.flatten()                                           # [N k]
    order = flat.argsort(stable=True)                              # pairs by expert
    counts = (flat[:, None] == torch.arange(w13.shape[0], device=x.device)).sum(0)   # [E]
    offs = counts.cumsum(0).to(torch.int32)
    gu = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs)           # [N k, 2I]
    h = F.silu(gu[:, :I]) * gu[:, I:] * weights.flatten()[order, None].to(x.dtype)
    ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)                         # [N k, D]
    return torch.empty_like(ys).index_copy_(0, order, ys).view(N, k, -1).sum(1)


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
        weights, idx = self.gate.route(x)                              # [N, k]
        y = grouped_experts(x, weights, idx, *self.grouped())
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
