"""The model's latent KV cache and each forward's attention metadata: `AttnMeta` (paged: rows of a shared page
pool, the engine's layout; cache: a contiguous per-request cache, `KVCache`), and the memory checks."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from . import checks
from .config import ModelArgs
from .moe import MOE_PATHS

ATTN_IMPLS = ("naive", "absorb", "kernel")


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
    # the prefix / rest split (`with_prefix`, attn_impl "kernel", paged): a planned prefix pass (e.g.
    # ops.flashinfer_prefix.FlashInferPrefix: run(q, pool) -> (o, lse)) over each request's first
    # prefix_rows rows, and verify_attn over the rest through rest_page_table / rest_seq_len
    prefix: object | None = None
    rest_page_table: torch.Tensor | None = None   # int32 [B, P]: the pages after the prefix
    rest_seq_len: torch.Tensor | None = None      # int32 [B]: seq_len - prefix rows
    prefix_whole: bool = False   # the prefix pass is the whole attention (a one-row block): no rest, no merge

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

    def with_prefix(self, prefix, prefix_rows: torch.Tensor) -> "AttnMeta":
        """This metadata with its attention split at prefix_rows (int32 [B] on the device, whole pages, at
        most seq_len - T each: the caller's contract, not read back): `prefix` (planned for those rows)
        attends the first prefix_rows rows, verify_attn the rest, merged by log-sum-exp
        (layers.kernel_attention). Paged layout with attn_impl "kernel" only; no host reads (capturable)."""
        from .ops.attn_split import shift_pages
        if self.attn_impl != "kernel" or self.start is not None:
            raise ValueError(f"with_prefix: expected the paged layout with attn_impl 'kernel', got "
                             f"attn_impl={self.attn_impl!r}, start={self.start!r}")
        B = self.page_table.shape[0]
        if not isinstance(prefix_rows, torch.Tensor) or tuple(prefix_rows.shape) != (B,):
            raise ValueError(f"prefix_rows: expected an int tensor [{B}], got "
                             f"{getattr(prefix_rows, 'shape', type(prefix_rows).__name__)}")
        pt, seq = shift_pages(self.page_table, self.seq_len, prefix_rows, self.page_size)
        return replace(self, prefix=prefix, rest_page_table=pt, rest_seq_len=seq, prefix_whole=False)

    def with_whole(self, prefix) -> "AttnMeta":
        """This metadata with the whole attention through `prefix`, planned over every key of a one-row
        block (seq_len rows a request, its own included: FlashInferPrefix.plan(..., whole=True)); paged
        layout, attn_impl "kernel", T = 1."""
        if self.attn_impl != "kernel" or self.start is not None or self.positions.shape[1] != 1:
            raise ValueError(f"with_whole: expected the paged layout with attn_impl 'kernel' and a one-row "
                             f"block, got attn_impl={self.attn_impl!r}, start={self.start!r}, "
                             f"T={self.positions.shape[1]}")
        return replace(self, prefix=prefix, rest_page_table=None, rest_seq_len=None, prefix_whole=True)

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
        if not isinstance(args, ModelArgs):
            raise ValueError(f"KVCache args: expected a kdtree ModelArgs, got {type(args).__name__}")
        max_len = checks.positive_int("KVCache max_len", max_len, note=" (rows of the cache)")
        batch = checks.positive_int("KVCache batch", batch)
        dtype = checks.float_dtype("KVCache dtype", dtype)
        device = checks.device("KVCache device", device)
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
