"""The baselines every speed claim is a ratio to, apart from the benchmarks that time them:

  reference_tree_round  the public DDTree path (torch.topk + logsumexp, host heap build, numpy mask)
  topk_only             torch.topk + logsumexp alone (the tree round's first stage in torch)
  naive_verify          verify attention as two bmm and a softmax over materialized scores
  moe_bf16_baseline     dequantize the touched INT4 experts to bf16, grouped matmuls (or bf16 experts held)
  hf_generate           transformers' generate on the same checkpoint
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .. import golden
from .timer import measure


def reference_tree_round(logits: torch.Tensor, budget: int, roots, starts):
    """The public DDTree path: torch.topk + logsumexp on the GPU, copy to host, Python heapq build,
    numpy ancestor mask, request by request."""
    K = min(budget, logits.shape[-1])
    top = torch.topk(logits.float(), K, dim=-1)
    lp = top.values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    tok_h, lp_h = top.indices.cpu().numpy(), lp.cpu().numpy()
    out = []
    for i in range(logits.shape[0]):
        tree = golden.build_tree(tok_h[i], lp_h[i], budget)
        out.append(golden.compile_tree(tree, int(roots[i]), int(starts[i])))
    return out


def topk_only(logits: torch.Tensor, budget: int):
    K = min(budget, logits.shape[-1])
    top = torch.topk(logits, K, dim=-1)
    return top.values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True), top.indices


def naive_verify(q, kv, mask_full, scale):
    """q [b, NH, 576], kv [b, S, 576] bf16, mask_full [b, NH, S] bool -> [b, NH, 512]."""
    s = torch.bmm(q, kv.transpose(1, 2)).float() * scale
    s.masked_fill_(~mask_full, float("-inf"))
    p = torch.softmax(s, -1).to(torch.bfloat16)
    return torch.bmm(p, kv[:, :, :512])


def dequant_bf16(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., out, in/8] int32 + [..., out, in/32] -> bf16 [..., out, in] with torch ops (the baseline's step).
    Works on the packed bytes (two 4-bit values each) and scales in place: the only large temporaries are
    the nibbles (1 byte a weight) and the result (2 bytes a weight)."""
    b = packed.contiguous().view(torch.uint8)                                   # [..., out, in/2]
    q = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*packed.shape[:-1], -1)  # [..., out, in] uint8
    q = q.to(torch.bfloat16).sub_(8)
    q.view(*q.shape[:-1], -1, 32).mul_(scale[..., None].to(torch.bfloat16))
    return q


def moe_bf16_baseline(x, ids, w, experts, dequantized=None) -> torch.Tensor:
    """Dequantize the touched experts to bf16, then a grouped matmul (torch._grouped_mm where present, else a
    loop of matmuls), SiLU * mul, the down grouped matmul and the weighted combine. float32 [T, D].
    dequantized=(w13 [E, 2I, D], w2 [E, D, I]) bf16: experts already in memory as bf16 (no dequantization)."""
    T, D = x.shape
    k = ids.shape[1]
    touched, inverse = torch.unique(ids.reshape(-1), return_inverse=True)        # [E'], [T*k]
    if dequantized is None:
        w13 = dequant_bf16(experts.w13_packed[touched], experts.w13_scale[touched])  # [E', 2I, D]
        w2 = dequant_bf16(experts.w2_packed[touched], experts.w2_scale[touched])     # [E', D, I]
    else:
        w13, w2 = dequantized[0][touched], dequantized[1][touched]
    order = torch.argsort(inverse, stable=True)
    tok = order // k
    xs = x[tok]
    counts = torch.bincount(inverse, minlength=touched.numel())
    inter = w13.shape[1] // 2
    if hasattr(torch, "_grouped_mm") and x.is_cuda:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        act = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    else:
        parts, a = [], 0
        for j, c in enumerate(counts.tolist()):
            gu = xs[a:a + c] @ w13[j].T
            act = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)
            parts.append(act @ w2[j].T)
            a += c
        y = torch.cat(parts)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * w.reshape(-1)[order, None].float())
    return out


def hf_generate(ckpt: Path, dtype, prompts, max_new: int, compiled: bool = False) -> dict:
    """transformers' DeepseekV3ForCausalLM.generate (greedy, exactly max_new tokens) on the same checkpoint,
    one prompt at a time after a warm-up call on the first: {"tok_per_s", "tokens", "wall_s", "outputs"}.
    compiled: transformers' own fast path: a static cache, which generate() decodes through
    torch.compile(mode="reduce-overhead", fullgraph=True) (its CompileConfig; the prefill stays eager). The
    warm-up generates max_new tokens too, so the timed calls find the static cache and the compiled decode
    step at their shapes; "compile_s" is its wall time. Where the full graph does not capture, the decode
    step compiles with graph breaks: "fullgraph": False and the first error in "fullgraph_error"."""
    from transformers import AutoModelForCausalLM, CompileConfig  # a baseline only
    m = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).cuda().eval()
    extra = {}
    x0 = torch.tensor([prompts[0]], device="cuda")

    def gen(x, outs=None):
        with torch.no_grad():
            y = m.generate(x, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                           attention_mask=torch.ones_like(x), pad_token_id=0)
        if outs is not None:
            outs.append(y[0, x.shape[1]:])

    if compiled:
        m.generation_config.cache_implementation = "static"
        m.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        t0 = time.perf_counter()
        try:
            gen(x0)
            extra["fullgraph"] = True
        except Exception as e:  # a graph break somewhere in the model: compile what captures
            extra.update(fullgraph=False, fullgraph_error=f"{type(e).__name__}: {e}"[:300])
            torch._dynamo.reset()
            m.generation_config.compile_config = CompileConfig(fullgraph=False, mode="reduce-overhead")
            gen(x0)
        torch.cuda.synchronize()
        extra["compile_s"] = time.perf_counter() - t0
    outs = []
    xs = [torch.tensor([p], device="cuda") for p in [prompts[0], *prompts]]   # outside the clock
    t = measure([lambda x=x: gen(x, outs) for x in xs], len(prompts), "wall", warmup=1)
    outs = [o.tolist() for o in outs]
    outs = outs[1:]
    toks = sum(len(o) for o in outs)
    m = None  # free the baseline's weights before the next section
    torch.cuda.empty_cache()
    return {"tok_per_s": toks / sum(t.times), "tokens": toks, "wall_s": sum(t.times), "outputs": outs,
            **extra}
