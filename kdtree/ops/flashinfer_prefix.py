"""FlashInfer's paged MLA as the prefix half of a split verify (kdtree.ops.attn_split), where
flashinfer-python is installed (the `peers` extra). Golden twin: verify_attn_golden.prefix_attention.

    prefix = FlashInferPrefix(heads, scale, max_batch, max_pages)      # buffers fixed: CUDA-graph safe
    prefix.plan(rows, nodes, page_table)     # host, before each round (and before a graph's capture)
    o, lse = prefix.run(q, pool)             # [b, N, H, 512] bf16, [b, N, H] fp32 natural log

Contract:
  * plan(rows, nodes, page_table, whole=False): rows host ints [b] (each request's prefix, a whole number of
    pages, `attn_split.split_rows`; whole=True: any number, the last page partly read: a pass over all of a
    one-row block's keys, its own row included), nodes N (query rows per request), page_table int32 [b, P]
    on the device (the request's pages in order). Every query row of request i sees all of its rows[i]
    rows (no mask). The lengths stay on the host; the page indices are gathered on the device. One plan
    serves every layer.
  * run(q, pool, lse=True): q bf16 [b, N, H, 576] (512 latent + 64 rope), pool bf16 [rows, 576] one layer's
    paged cache (pages of page_size rows); lse=False returns (o, None), computing no lse. Reads the pool in
    place through strided views (its latent and rope columns). A request with an empty prefix gets lse -inf
    (its o is then ignored by the merge: `attn_merge.merge_states`, `attn_split.merge_lse`).
  * Graphs (graph=True): a run() captured after a plan replays correctly after any later plan of the same
    batch and nodes (FlashInfer sizes its launch from them at plan time); plan() itself runs outside.
  * `available()`: None where FlashInfer imports, else the reason.
"""
from __future__ import annotations

import functools

import torch

from .. import checks

WORKSPACE_BYTES = 128 << 20   # FlashInfer's float workspace (its examples' size)


@functools.lru_cache(maxsize=1)
def _flashinfer():
    import flashinfer
    return flashinfer


def available() -> str | None:
    """None where flashinfer-python imports (with its MLA wrapper), else why not."""
    try:
        _flashinfer().mla.BatchMLAPagedAttentionWrapper
    except Exception as e:  # absent, or present without what it needs (a dependency, a compiler)
        return f"flashinfer is not usable here ({type(e).__name__}: {e})"[:300]
    return None


class FlashInferPrefix:
    """FlashInfer's BatchMLAPagedAttentionWrapper over the prefix rows of max_pages pages at most a request.
    graph=True: fixed buffers for exactly max_batch requests (an engine's batch bucket, its padding slots
    planned with 0 prefix rows), so that a captured run() replays after each plan(); graph=False: up to
    max_batch requests a plan. workspace: FlashInfer's float workspace (uint8, WORKSPACE_BYTES) to share
    with other instances whose runs never overlap (one stream, one round at a time); default its own."""

    def __init__(self, heads: int, scale: float, max_batch: int, max_pages: int, page_size: int = 64,
                 device="cuda", backend: str = "fa3", graph: bool = True,
                 workspace: torch.Tensor | None = None):
        self.heads = checks.int_in("heads", heads, 1, 1024)
        self.scale = checks.finite_float("scale", scale, 1e-30)
        self.max_batch = checks.int_in("max_batch", max_batch, 1, 1 << 16)
        self.max_pages = checks.int_in("max_pages", max_pages, 1, 1 << 24)
        self.page_size = checks.int_in("page_size", page_size, 1, 1 << 12)
        if backend not in ("fa3", "fa2", "auto"):
            raise ValueError(f"backend={backend!r}: expected 'fa3', 'fa2' or 'auto'")
        self.graph = checks.flag("graph", graph)
        try:
            cuda = torch.device(device).type == "cuda"
        except (RuntimeError, TypeError):
            cuda = False
        if not cuda:
            raise ValueError(f"device={device!r}: expected a CUDA device (FlashInfer's MLA runs on a GPU)")
        why = available()
        if why is not None:
            raise ValueError(f"FlashInferPrefix: {why}")
        if workspace is None:
            ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        elif not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8 or \
                workspace.dim() != 1 or workspace.numel() < WORKSPACE_BYTES or not workspace.is_cuda:
            raise ValueError(f"workspace: expected a CUDA uint8 tensor of at least {WORKSPACE_BYTES} bytes, "
                             f"got {getattr(workspace, 'dtype', type(workspace).__name__)} "
                             f"{tuple(getattr(workspace, 'shape', ()))}")
        else:
            ws = workspace
        self.device = ws.device   # with its index ("cuda" -> "cuda:0"), as the tensors it meets report it
        i32 = dict(dtype=torch.int32, device=self.device)
        self._empty = torch.zeros(self.max_batch, dtype=torch.bool, device=self.device)   # prefix of 0 rows
        bufs = {}
        if graph:
            bufs = dict(qo_indptr=torch.zeros(self.max_batch + 1, **i32),
                        kv_indptr=torch.zeros(self.max_batch + 1, **i32),
                        kv_indices=torch.zeros(self.max_batch * self.max_pages, **i32),
                        kv_len_arr=torch.zeros(self.max_batch, **i32))
        mla = _flashinfer().mla
        self.wrapper = mla.BatchMLAPagedAttentionWrapper(ws, use_cuda_graph=graph, backend=backend, **bufs)
        self.planned: tuple[int, int] | None = None   # (b, N) of the last plan
        self._copied = None   # an event after the last plan's copies to the device

    def plan(self, rows, nodes: int, page_table: torch.Tensor, whole: bool = False) -> None:
        """Plan the prefix pass of len(rows) requests of `nodes` query rows (module contract); host work plus
        small copies to the device, on the current stream. FlashInfer stages its schedule in one pinned host
        buffer and copies it asynchronously, so a plan first waits until the previous plan's copies have run
        (the previous round's kernels need not have)."""
        if self._copied is not None:
            self._copied.synchronize()
        if not isinstance(rows, (list, tuple)) or not rows:
            raise ValueError(f"rows: expected a non-empty list of ints (prefix rows per request), got "
                             f"{rows!r}")
        b = len(rows)
        if b > self.max_batch or (self.graph and b != self.max_batch):
            want = (f"exactly {self.max_batch} (graph=True: FlashInfer's buffers are sized for one batch; "
                    "pad with requests of 0 prefix rows)") if self.graph else f"at most {self.max_batch}"
            raise ValueError(f"rows: {b} requests, expected {want}")
        N = checks.int_in("nodes", nodes, 1, 1 << 16)
        if not isinstance(page_table, torch.Tensor):
            raise ValueError(f"page_table: expected an int32 tensor [b, P], got {type(page_table).__name__}")
        if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] < b:
            raise ValueError(f"page_table: expected int32 [b >= {b}, P], got {page_table.dtype} "
                             f"{tuple(page_table.shape)}")
        if page_table.device != self.device:
            raise ValueError(f"page_table: on {page_table.device}, expected {self.device}")
        P = page_table.shape[1]
        whole = checks.flag("whole", whole)
        pages = []
        for i, r in enumerate(rows):
            r = checks.int_in(f"rows[{i}]", r, 0, min(P, self.max_pages) * self.page_size)
            if r % self.page_size and not whole:
                raise ValueError(f"rows[{i}]={r}: expected a whole number of pages of {self.page_size} "
                                 "(or whole=True)")
            pages.append(-(-r // self.page_size))
        # FlashInfer never sees an empty request: an empty prefix reads its first page (its answer is
        # masked to lse -inf below, which the merge ignores), so every plan has work in every request
        seen = [max(n, 1) for n in pages]
        kv_indptr = torch.tensor([0] + seen, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        flat = torch.cat([torch.arange(n, dtype=torch.int64) + i * P for i, n in enumerate(seen)])
        kv_indices = page_table.reshape(-1)[flat.to(self.device, non_blocking=True)]   # [sum pages] int32
        kv_len = torch.tensor([r or self.page_size for r in rows], dtype=torch.int32)
        self.wrapper.plan(torch.arange(0, b * N + 1, N, dtype=torch.int32), kv_indptr, kv_indices, kv_len,
                          self.heads, 512, 64, self.page_size, False, self.scale, torch.bfloat16,
                          torch.bfloat16)
        self._empty[:b].copy_(torch.tensor([r == 0 for r in rows]), non_blocking=True)
        self.planned = (b, N)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def run(self, q: torch.Tensor, pool: torch.Tensor, lse: bool = True):
        """(o bf16 [b, N, H, 512], lse fp32 [b, N, H] natural log) of the planned prefix pass (module
        contract); q's b and N must be the plan's. lse=False: (o, None), no lse computed (a whole pass,
        which nothing merges)."""
        if self.planned is None:
            raise ValueError("run: no plan yet (call plan(rows, nodes, page_table) first)")
        b, N = self.planned
        if q.dtype != torch.bfloat16 or tuple(q.shape) != (b, N, self.heads, 576):
            raise ValueError(f"q: expected bf16 [{b}, {N}, {self.heads}, 576] (the plan's), got {q.dtype} "
                             f"{tuple(q.shape)}")
        if pool.dtype != torch.bfloat16 or pool.dim() != 2 or pool.shape[1] != 576 or \
                pool.shape[0] % self.page_size or not pool.is_contiguous():
            raise ValueError(f"pool: expected a contiguous bf16 [rows, 576] in whole pages of "
                             f"{self.page_size}, got {pool.dtype} {tuple(pool.shape)}")
        qf = q.reshape(b * N, self.heads, 576)
        pages = pool.view(-1, self.page_size, 576)
        got = self.wrapper.run(qf[..., :512].contiguous(), qf[..., 512:].contiguous(), pages[..., :512],
                               pages[..., 512:], return_lse=lse, return_lse_base_on_e=lse)
        if not lse:
            return got.view(b, N, self.heads, 512), None
        o, s = got
        s = s.view(b, N, self.heads).masked_fill(self._empty[:b, None, None], float("-inf"))
        return o.view(b, N, self.heads, 512), s
