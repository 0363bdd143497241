"""Admission's prefill: the admitted requests' prompts through the target, chunk by chunk, into the cache.

Prefill chunks: a CUDA graph per exact (requests, rows) shape, captured the first time the shape is seen
(that chunk runs eagerly) and replayed after it; the same kernels at the same shapes, so the tokens are the
eager prefill's bit for bit. At most PREFILL_GRAPHS shapes, each of at most PREFILL_GRAPH_ROWS rows (their
static buffers are allocated with the decode graphs); other chunks run eagerly.
"""
from __future__ import annotations

import time

import torch

from ..model import PagedMeta
from ..round_ops import all_finite, choose
from .graphs import PrefillKey, blas_for, capturing, end_pool
from .requests import Request, finish

PREFILL_GRAPHS = 16
PREFILL_GRAPH_ROWS = 512


class Prefill:
    """The engine's prefill (`run`) and its graphs: `graphs` {(requests, rows): CUDAGraph, or False where
    the capture failed}, their static buffers (`buffers`) and memory pool."""

    def __init__(self, engine):
        self.e = engine
        self.graphs: dict = {}
        self.pool_id = None
        self.mark_t = 0.0

    def run(self, reqs: list[Request], emitted) -> None:
        """The admitted requests' prompts, chunk by chunk: one forward per chunk for every request whose chunk
        has the same length (so same-length prompts share each forward; deterministic engines prefill each
        request alone, keeping a request's arithmetic independent of its batch mates), then each request's
        first token from one batched choice. A request whose admission fails (its pages, its chunk's forward,
        non-finite logits, its drafter session or synthetic rows; the batched choice or simulated texts: every
        request in them) leaves whole: its error is recorded for step() to raise, its pages go back, it emits
        nothing and is never a result. The others' slots stay put until every prefill forward is done."""
        e = self.e
        self.mark(None)
        t0 = time.perf_counter()
        leave, synth = [], 0.0
        ok = self.pages(reqs, t0, leave)
        self.mark("pages")
        feats, last = {r.rid: [] for r in ok}, {}
        self.forwards(ok, feats, last, leave)
        ok, first = self.first_tokens(ok, last, leave)
        for r, tok in zip(ok, first):
            if tok is None:
                e.scheduler.errors[r.rid] = ValueError("target logits: NaN or inf in verify row(s) [0] of "
                                                       "the prefill: the target's weights or inputs are not "
                                                       "finite")
                leave.append(r)
                continue
            try:
                synth = self.start(r, tok, feats[r.rid], t0, synth)
            except Exception as err:   # this request fails alone (its drafter session, its synthetic rows)
                e.scheduler.errors[r.rid] = err
                leave.append(r)
                continue
            emitted[r.rid] = [tok]
            if finish(r.result.tokens, [tok], r.max_new, r.stop):
                leave.append(r)
        self.mark("requests")
        live = [r for r in ok if r.rid not in e.scheduler.errors]
        if e.sim is not None and live:
            synth += self.simulated_texts(live, leave, emitted)
        e.synthetic_s += synth   # before any release: a request ending here leaves its fill out too
        for r in sorted(leave, key=lambda r: -r.slot):  # slots move only now, the highest first
            e.scheduler.release(r)
        self.mark("release")
        e.prefill_s += time.perf_counter() - t0 - synth

    def pages(self, reqs: list[Request], t0: float, leave: list) -> list[Request]:
        """Each request's pages for its prompt; those that got them (a failure: its error recorded, the
        request in `leave`)."""
        e, ok = self.e, []
        for r in reqs:
            r.t0, r.syn0 = t0, e.synthetic_s
            try:
                e.scheduler.grow(r, len(r.prompt))
            except Exception as err:
                e.scheduler.errors[r.rid] = err
                leave.append(r)
                continue
            r.committed = list(r.prompt)
            ok.append(r)
        return ok

    def forwards(self, ok: list[Request], feats: dict, last: dict, leave: list) -> None:
        """The prompts chunk by chunk, a forward per group of same-length chunks (per request when
        deterministic); a group whose forward fails leaves `ok` for `leave`, its error recorded."""
        e = self.e
        for c0 in range(0, max((len(r.prompt) for r in ok), default=0), e.prefill_chunk):
            groups: dict = {}
            for r in ok:
                T = min(e.prefill_chunk, len(r.prompt) - c0)
                if T > 0:
                    groups.setdefault(r.rid if e.deterministic else T, []).append(r)
            for group in groups.values():
                try:
                    self.chunk(group, c0, feats, last)
                except Exception as err:  # these requests fail alone; the batch in flight is untouched
                    for r in group:
                        e.scheduler.errors[r.rid] = err
                        leave.append(r)
                        ok.remove(r)

    def first_tokens(self, ok: list[Request], last: dict, leave: list) -> tuple[list[Request], list]:
        """(the requests, each one's first token or None where its logits are not finite), from one batched
        choice and one host read; where the choice fails, every request leaves (([], []))."""
        e = self.e
        if not ok:
            return ok, []
        try:   # one batched choice: a failure fails every request in it
            dev = e.device
            logits = torch.stack([last[r.rid] for r in ok])                                 # [n, V]
            finite = all_finite(logits)
            pos = torch.tensor([len(r.prompt) - 1 for r in ok], device=dev)
            first = choose(logits[:, None], torch.tensor([r.temperature for r in ok], device=dev),
                           torch.tensor([r.seed for r in ok], device=dev), pos,
                           any(r.temperature > 0 for r in ok))[:, -1]
            both = torch.stack([finite.long(), first]).tolist()                             # one host read
        except Exception as err:
            for r in ok:
                e.scheduler.errors[r.rid] = err
            leave += ok
            self.mark("first")
            return [], []
        self.mark("first")
        return ok, [tok if fin else None for fin, tok in zip(*both)]

    def simulated_texts(self, live: list[Request], leave: list, emitted: dict) -> float:
        """The simulated texts of the live requests, timed alone as the fill is (set-up, not work): its
        seconds. A failed write fails every live request."""
        e = self.e
        e.sync()
        ts = time.perf_counter()
        try:
            e.sim.write([r.slot for r in live], [r.seed for r in live])
        except Exception as err:   # one write for them all: every live request fails
            for r in live:
                e.scheduler.errors[r.rid] = err
                emitted.pop(r.rid, None)
            gone = {r.rid for r in leave}
            leave += [r for r in live if r.rid not in gone]
        e.sync()
        secs = time.perf_counter() - ts
        self.mark(None)
        return secs

    def start(self, r: Request, tok: int, feats: list, t0: float, synth: float) -> float:
        """Request r's slot set up after its prompt: its first token `tok` as the root, its length,
        temperature, seed and live flag, a host drafter's session (from the prompt's `feats`), the
        synthetic rows; its prefill seconds (since t0, less the synthetic fills') recorded. Returns `synth`
        plus its own fill's seconds."""
        e = self.e
        s, P = r.slot, len(r.prompt)
        if e.mode != "ar" and not e.batched_drafter:
            r.session = e.drafter.session(e.kv_cap)
            r.session.start(r.prompt, torch.cat(feats) if feats else None)
        for t, v in ((e.root, tok), (e.lens, P), (e.temp, r.temperature), (e.seed, r.seed), (e.live, 1)):
            t[s].fill_(v)   # a fill kernel: item assignment would copy from the host and synchronize
        r.length = P
        r.committed.append(tok)
        if r.synthetic:   # timed alone: the device idle before and after
            self.mark("requests")
            e.sync()
            ts = time.perf_counter()
            self.synthesize(r)
            e.sync()
            synth += time.perf_counter() - ts
            self.mark(None)
        r.result.stage_times["prefill"] += time.perf_counter() - t0 - synth
        return synth

    def mark(self, phase: str | None) -> None:
        """With `prefill_phases` a dict: synchronize the device, then add the seconds since the last mark to
        `phase` (None: a start, or the end of an untimed span such as the synthetic fill). The phases:
        pages, forward (the target's prompt forwards), drafter (its context from their features), first
        (the first tokens' choice and host read), requests (the per-request bookkeeping), release. Off (None,
        the default) it does nothing: no synchronization is added."""
        e = self.e
        if e.prefill_phases is None:
            return
        e.sync()
        now = time.perf_counter()
        if phase is not None:
            e.prefill_phases[phase] = e.prefill_phases.get(phase, 0.0) + now - self.mark_t
        self.mark_t = now

    def chunk(self, group: list[Request], c0: int, feats: dict, last: dict) -> None:
        """Prompt rows [c0, c0 + T) of every request in `group` (all of one chunk length T) in one forward."""
        e = self.e
        dev, n = e.device, len(group)
        T = min(e.prefill_chunk, len(group[0].prompt) - c0)
        slots = torch.tensor([r.slot for r in group], device=dev)
        start = torch.full((n,), c0, device=dev)
        tokens = torch.tensor([r.prompt[c0:c0 + T] for r in group], device=dev)              # [n, T]
        logits, f = self.forward(tokens, e.page_table[slots], start)
        for i, r in enumerate(group):
            r.result.target_forwards += 1
            if c0 + T == len(r.prompt):
                last[r.rid] = logits[i].clone()
        e.prefill_forwards += 1
        self.mark("forward")
        if f is None:
            return
        count = torch.full((n,), T, device=dev)
        if e.batched_drafter:
            first = group[0].slot
            if [r.slot for r in group] == list(range(first, first + n)):  # admitted together: adjacent slots
                e.drafter.extend(e.ctx, f, start, count, slot=first)
            else:
                for i, r in enumerate(group):
                    e.drafter.extend(e.ctx, f[i:i + 1], start[i:i + 1], count[i:i + 1], slot=r.slot)
        else:
            for i, r in enumerate(group):
                feats[r.rid].append(f[i].clone())
        self.mark("drafter")

    def eager(self, tokens, page_table, start):
        """tokens [n, T] at positions start[b] + j written into the pool through page_table [n, P]; returns
        the last rows' logits [n, V] float32 and the drafter's features [n, T, F] (None in mode ar)."""
        e = self.e
        dev, (n, T) = e.device, tokens.shape
        mask = torch.ones(n, T, T, dtype=torch.bool, device=dev).tril()
        meta = PagedMeta.build(page_table, start, start[:, None] + torch.arange(T, device=dev), mask,
                               e.page_size, e.model.attn_impl, e.moe)
        with blas_for(dev, n * T):
            out = e.model.forward_paged(tokens, e.pool, meta, e.layers, logits_for=slice(T - 1, T))
        f = torch.cat([out.hidden[i] for i in e.layers], -1) if e.layers else None
        return out.logits[:, -1], f

    def forward(self, tokens, page_table, start):
        """`eager`'s contract; a replay of the shape's graph once it has one (the outputs are then the
        static buffers' views, rewritten by the next prefill forward)."""
        e = self.e
        n, T = tokens.shape
        key = PrefillKey(n, T)
        g = self.graphs.get(key)
        if not g:
            out = self.eager(tokens, page_table, start)
            if (g is None and e.graphs and n * T <= self.tok.numel()
                    and sum(1 for v in self.graphs.values() if v) < PREFILL_GRAPHS):
                self.graphs[key] = self.capture(n, T)
            return out
        self.tok[:n * T].view(n, T).copy_(tokens)
        self.pt[:n].copy_(page_table)
        self.starts[:n].copy_(start)
        g.replay()
        e.prefill_replays += 1
        f = None if self.feat is None else self.feat[:n * T].view(n, T, -1)
        return self.logits[:n], f

    def buffers(self) -> None:
        """The prefill graphs' static inputs and outputs, allocated once (so serving new prompt shapes leaves
        torch.cuda.memory_allocated as it was)."""
        e = self.e
        dev, a, B = e.device, e.model.args, e.max_batch
        rows = min(PREFILL_GRAPH_ROWS, B * e.prefill_chunk)
        self.tok = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.pt = torch.zeros_like(e.page_table)
        self.starts = torch.zeros(B, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(B, a.vocab_size, dtype=torch.float32, device=dev)
        self.feat = (torch.zeros(rows, len(e.layers) * a.hidden_size, dtype=e.model.dtype,
                                     device=dev)
                         if e.layers else None)

    def capture(self, n: int, T: int):
        """A graph of `eager` over the static buffers' first n requests and n x T rows (all prefill
        graphs share one memory pool: their outputs are copied to the static buffers, so the pool holds
        temporaries only); False where the capture fails (that shape then runs eagerly)."""
        e = self.e
        tok, pt, st = self.tok[:n * T].view(n, T), self.pt[:n], self.starts[:n]
        cur = torch.cuda.current_stream(e.device)
        e.cache.side.wait_stream(cur)
        g = torch.cuda.CUDAGraph()
        if self.pool_id is None:   # the id known before the capture, so a failed one can end its pool
            self.pool_id = torch.cuda.graph_pool_handle()
        try:
            with capturing(g, self.pool_id, e.cache.side):
                logits, f = self.eager(tok, pt, st)
                self.logits[:n].copy_(logits)
                if f is not None:
                    self.feat[:n * T].view(n, T, -1).copy_(f)
        except RuntimeError as err:  # torch.AcceleratorError is one
            torch.cuda.synchronize(e.device)
            end_pool(e.device, self.pool_id)
            self.pool_id = None
            e.cache.retries.append(f"prefill {(n, T)}: {str(err).splitlines()[0][:120]}")
            return False
        finally:
            cur.wait_stream(e.cache.side)
        return g

    @torch.no_grad()
    def synthesize(self, r: Request) -> None:
        """r.synthetic random rows at positions [length, length + C) before the root (add_request)."""
        e = self.e
        C, s, L0 = r.synthetic, r.slot, r.length
        e.scheduler.grow(r, L0 + C)
        g = torch.Generator(device=e.device).manual_seed(r.seed * 7919 + r.rid)
        rows = torch.arange(L0, L0 + C, device=e.device)
        slots = e.page_table[s].long()[rows // e.page_size] * e.page_size + rows % e.page_size
        a = e.model.args
        e.pool[:, slots] = (0.5 * torch.randn(a.num_hidden_layers, C, e.pool.shape[-1], generator=g,
                                                 device=e.device)).to(e.pool.dtype)
        if e.ctx is not None:
            for t in e.ctx.k + e.ctx.v:
                t[s, :, L0:L0 + C] = torch.randn(t.shape[1], C, t.shape[3], generator=g,
                                                 device=e.device).to(t.dtype)
        e.lens[s] += C
        r.length += C
        r.committed[-1:-1] = [0] * C

