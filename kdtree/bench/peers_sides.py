"""The sides of bench.peers' attention cells, each a list of callables over the cell's cache sets (one per
set, rotated past L2) returning its output: ours (verify_attn), FlashInfer's MLA (its own page layout, or our
pool in place), SGLang's Triton kernels, the cascade (FlashInfer prefix + ours over the block, FlashInfer's
merge_state) and the engine's own split (ops.flashinfer_prefix + verify_attn + ops.attn_merge). `cell_inputs`
builds a cell's inputs; `OURS_SIDES` are the sides that are not a peer's kernel alone."""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from .timer import input_sets

PLAN_REPEATS = 20          # FlashInfer plan() calls timed a cell and backend


# ----------------------------------------------------------------------------- one cell's inputs
def cell_inputs(H: int, ctx: int, N: int, b: int, kind: str, seed: int = 0) -> dict:
    """Our verify_attn inputs for a context ctx (a whole number of 64-row pages) plus N appended rows per
    request: cache sets rotated past L2, an identity page table, q [b, N, H, 576], seq_len, the bool mask
    [b, N, N] (decode: [[True]]; chain: causal; tree: a DDTree's ancestor mask) and its packed words."""
    from .. import golden
    from ..ops.verify_attn import pack_mask
    if ctx % 64:
        raise ValueError(f"ctx={ctx}: expected a multiple of the page size 64")
    g = torch.Generator(device="cuda").manual_seed(seed)
    S = ctx + N
    pages = math.ceil(S / 64)
    n_sets = input_sets(b * pages * 64 * 576 * 2, hi=8)
    caches = [(torch.randn(b * pages * 64, 576, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
              for _ in range(n_sets)]
    q = (torch.randn(b, N, H, 576, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    if kind == "tree":
        rng = np.random.default_rng(N)
        m = golden.compile_tree(golden.ddtree(rng.standard_normal((15, 64)).astype(np.float32) * 2, N - 1),
                                0, 0).mask
    else:
        m = np.tril(np.ones((N, N), bool))
    mask = torch.from_numpy(m).cuda()[None].expand(b, N, N).contiguous()
    return {"caches": caches, "q": q, "mask": mask, "words": pack_mask(mask), "pages": pages,
            "page_table": torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages),
            "seq_len": torch.full((b,), S, device="cuda", dtype=torch.int32)}


# ----------------------------------------------------------------------------- the sides
def ours(x, scale):
    from ..ops.verify_attn import verify_attn
    q, pt, seq, words = x["q"], x["page_table"], x["seq_len"], x["words"]
    return [lambda c=c: verify_attn(q, c, pt, seq, words, scale, check_values=False)[0] for c in x["caches"]]


def flashinfer(api, x, H, ctx, N, b, backend, scale, prefix_only=False, plan_s=None, views=False):
    """FlashInfer's MLA over each cache set (split into its ckv / kpe page layout): the whole context with a
    causal block (prefix_only False), or the prefix alone with every query row seeing all of it (True);
    callables returning (out [b N, H, 512], lse base 2 [b N, H]). plan_s: a list given gets the host seconds
    of one plan() (median of PLAN_REPEATS, the device synchronized after each; lengths given on the host),
    the call that must precede every round's run() with that round's kv lengths on the host. views:
    FlashInfer reads our page pool in place (ckv / kpe as strided views of its [rows, 576] pages) instead of
    split contiguous copies."""
    pages = ctx // 64 if prefix_only else x["pages"]
    kv_len = ctx if prefix_only else ctx + N
    dev = x["q"].device
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    w = api["mla"](ws, backend=backend)
    per = x["pages"]
    idx = (torch.arange(b, device=dev, dtype=torch.int32)[:, None] * per
           + torch.arange(pages, device=dev, dtype=torch.int32)[None]).reshape(-1)
    # the lengths as an engine holds them, on the host (plan() reads them there: device tensors would cost a
    # copy back and a synchronization), the page indices on the device
    plan_args = (torch.arange(0, b * N + 1, N, dtype=torch.int32),
                 torch.arange(0, b * pages + 1, pages, dtype=torch.int32), idx,
                 torch.full((b,), kv_len, dtype=torch.int32), H, 512, 64, 64,
                 not prefix_only and N > 1, scale, torch.bfloat16, torch.bfloat16)
    w.plan(*plan_args)
    if plan_s is not None:
        times = []
        for _ in range(PLAN_REPEATS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            w.plan(*plan_args)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        plan_s.append(float(np.median(times)))
    q = x["q"].reshape(b * N, H, 576)
    qn, qp = q[..., :512].contiguous(), q[..., 512:].contiguous()
    keep = (lambda t: t) if views else (lambda t: t.contiguous())
    sets = [(keep(c.view(-1, 64, 576)[..., :512]), keep(c.view(-1, 64, 576)[..., 512:])) for c in x["caches"]]
    return [lambda s=s: w.run(qn, qp, s[0], s[1], return_lse=True) for s in sets]


def sglang(api, x, H, ctx, N, b, scale, tree):
    """SGLang's verify_mla (chains, N = 1 included) or extend_attention with the tree's custom mask over each
    cache set viewed as token slots ([rows, 1, 576], the value the first 512 columns)."""
    dev = x["q"].device
    rows = x["pages"] * 64
    q = x["q"].reshape(b * N, H, 576).contiguous()
    qo = torch.arange(0, b * N + 1, N, device=dev, dtype=torch.int32)
    kvp = torch.arange(0, b * ctx + 1, ctx, device=dev, dtype=torch.int32)
    r0 = torch.arange(b, device=dev, dtype=torch.int64)[:, None] * rows
    kv_idx = (r0 + torch.arange(ctx, device=dev)[None]).reshape(-1)
    blk = (r0 + ctx + torch.arange(N, device=dev)[None]).reshape(-1)
    mask = mask_ptr = None
    if tree:
        full = torch.ones(b, N, ctx + N, dtype=torch.bool, device=dev)
        full[:, :, ctx:] = x["mask"]
        mask = full.reshape(-1)
        mask_ptr = torch.arange(0, b * N * (ctx + N) + 1, N * (ctx + N), device=dev, dtype=torch.int64)
    out = torch.empty(b * N, H, 512, dtype=torch.bfloat16, device=dev)

    def call(c):
        kb = c.view(-1, 1, 576)
        k_ext = kb[blk].contiguous()
        args = (q, k_ext, k_ext[..., :512], out, kb, kb[..., :512], qo, kvp, kv_idx, mask, not tree,
                mask_ptr, N, 1.0, 1.0)
        if tree:
            api["extend"](*args, sm_scale=scale)
        elif not api["verify"](*args, sm_scale=scale):
            raise RuntimeError("sglang verify_mla declined the shape (can_handle False)")
        return out
    return [lambda c=c: call(c) for c in x["caches"]]


OURS_SIDES = ("ours", "cascade", "split")   # a cell's sides that are not a peer's kernel alone
MERGE_HEADS = 16   # FlashInfer's merge_state: 32 x heads threads a block at head_dim 512 (at most 1,024)


def cascade(api, x, H, ctx, N, b, scale):
    """FlashInfer non-causal over the prefix, ours over the block's own pages (its mask), merge_state."""
    from ..ops.verify_attn import verify_attn
    pre = flashinfer(api, x, H, ctx, N, b, "auto", scale, prefix_only=True)
    first, nb = ctx // 64, math.ceil(N / 64)
    pt = x["page_table"][:, first:first + nb].contiguous()
    seq = torch.full((b,), N, device=x["q"].device, dtype=torch.int32)

    def call(i, c):
        o_p, s_p = pre[i]()
        o_b, lse_b = verify_attn(x["q"], c, pt, seq, x["words"], scale, check_values=False)
        # merge_state launches a (512 / 16) x heads block per row: at most MERGE_HEADS heads a row
        g = math.gcd(H, MERGE_HEADS)
        o, _ = api["merge_state"](o_p.reshape(-1, g, 512), s_p.reshape(-1, g),
                                  o_b.reshape(-1, g, 512), (lse_b / math.log(2)).reshape(-1, g).contiguous())
        return o.view(b * N, H, 512)
    return [lambda i=i, c=c: call(i, c) for i, c in enumerate(x["caches"])]


def split(x, H, ctx, N, b, scale):
    """The engine's own split (prefix_attn="flashinfer"): layers.kernel_attention over the metadata with
    the prefix at the ctx committed rows (AttnMeta.with_prefix: FlashInfer over them, reading our pool in
    place; verify_attn over the block's rows with its mask; ops.attn_merge); callables returning out
    [b, N, H, 512]."""
    from ..cache import AttnMeta
    from ..layers import kernel_attention
    from ..ops.flashinfer_prefix import FlashInferPrefix
    dev = x["q"].device
    pre = FlashInferPrefix(H, scale, max_batch=b, max_pages=x["pages"], graph=False)
    pre.plan([ctx] * b, N, x["page_table"])
    cached = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    meta = AttnMeta.build(x["page_table"], cached, cached[:, None] + torch.arange(N, device=dev), x["mask"],
                          64, "kernel", mask_words=x["words"]).with_prefix(pre, cached)
    return [lambda c=c: kernel_attention(x["q"], c, meta, scale) for c in x["caches"]]
