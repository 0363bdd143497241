"""The scheduler: waiting and active requests, their slots and pages, and when to admit (eager or grouped).

Requests sit in slots 0..n-1 of the engine's static state (a finishing request's slot takes the last one's).
Pages: a request reserves at admission the pages its longest context can need (prompt + max_new_tokens + the
block's rows) and takes them as it grows; one that cannot reserve waits (no preemption); one that could never
fit is refused by `request`.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import checks
from .requests import (GenerationResult, PagePool, Request, check_max_new, check_seed, check_stop,
                       check_temperature)

ADMIT_FIT = 32   # grouped admission: the recent admissions whose times fit `Scheduler.admit_cost`


class Scheduler:
    """waiting -> active (admission: `admit`, `due`) -> finished / errors (`release`); the page pool."""

    def __init__(self, engine, n_pages: int, admission: str):
        self.e = engine
        self.pages = PagePool(n_pages)
        self.admission = admission
        self.waiting: list[Request] = []
        self.active: list[Request] = []
        self.finished: dict = {}
        self.errors: dict[int, Exception] = {}
        self.next_id = 0
        self.admits: list = []     # grouped: the last ADMIT_FIT clean admissions' (prompt rows, seconds)
        self.fit = None            # grouped: admit_cost's fit of admits (None: not fitted since a change)
        self.rent = 0.0            # grouped: idle slots' seconds since admission was first deferred

    def admissible(self) -> bool:
        e = self.e
        return bool(self.waiting and len(self.active) < e.max_batch
                    and self.pages.can_reserve(self.waiting[0].reserve)) and self.due()

    def due(self) -> bool:
        """Whether to admit now. "eager": always (each waiting request as soon as a slot and its pages are
        free). "grouped" (ski rental): an admission costs a fixed time (`admit_cost`; a MoE prefill forward
        reads every expert its rows route to, most of them once a few requests are in it) on top of its rows,
        and stalls every slot meanwhile; a free slot left idle loses its share of a round. So a freed slot
        waits for company until the idle slots' seconds (`rent`, `bill`: each round's idle slots' share of
        its wall time) reach that fixed time: the rounds lost to waiting never cost more than the admission
        they save. It admits at once while no request is active, where every waiting request has a slot
        already, until an admission has been timed, and in a deterministic engine (each request prefills
        alone: grouping saves no forward). The saving assumes the group's prompts share their chunks'
        forwards (same-length chunks, `Prefill.run`), as a benchmark's equal prompts do."""
        e = self.e
        free = e.max_batch - len(self.active)
        if (self.admission == "eager" or e.deterministic or not self.active
                or free >= len(self.waiting)):
            return True
        fit = self.admit_cost()
        return fit is None or self.rent >= fit[0]

    def grouping(self) -> bool:
        """Whether freed slots wait for company (`due`): grouped admission in an engine that is not
        deterministic, once an admission has been timed. The requests admitted together then end much as a
        static batch does (`Estimates.expected`, `rounds_left`)."""
        e = self.e
        return self.admission == "grouped" and not e.deterministic and self.admit_cost() is not None

    def bill(self, live: int, wall: float) -> None:
        """Grouped admission: add a round's idle slots' share of its wall time to the rent. A round's time
        hardly depends on its rows (it streams the weights once), so an idle slot loses 1 / max_batch of a
        full round's tokens, which a full round makes up in that share of its time."""
        e = self.e
        self.rent += (e.max_batch - live) * wall / e.max_batch

    def admit_cost(self) -> tuple[float, float] | None:
        """Grouped admission: (fixed seconds, seconds per prompt row) of an admission, least squares over the
        last ADMIT_FIT admissions that captured no prefill graph and lost no request (both at least 0); while
        they all have the same rows, (their median seconds, 0): the fixed cost's bound; None before the
        first."""
        if not self.admits:
            return None
        if self.fit is None:   # refitted only when an admission was added
            x, y = np.array(self.admits, np.float64).T
            if len(set(x.tolist())) < 2:
                self.fit = float(np.median(y)), 0.0
            else:
                (f, c), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
                self.fit = max(float(f), 0.0), max(float(c), 0.0)
        return self.fit

    def can_overlap(self) -> bool:
        """Whether the next round may launch before the one in flight lands: every active request's rows of
        both rounds (the flight's accepted rows, unknown on the host, and the next block's) fit its
        reservation, and not every request ends with the flight (each emits at least one token a round), as
        then the launched round would be wasted."""
        e = self.e
        room = e.max_accept + e.rows
        return (all(r.length + room <= r.reserve * e.page_size for r in self.active)
                and not all(len(r.result.tokens) + 1 >= r.max_new for r in self.active))

    def admit(self, emitted) -> None:
        """The waiting requests that fit (a slot and their page reservation, in order) join and prefill
        (`Prefill.run`). One whose admission fails leaves whole, its pages back, never a result; its error
        is recorded for step() to raise."""
        e = self.e
        new = []
        while (self.waiting and len(self.active) < e.max_batch
               and self.pages.can_reserve(self.waiting[0].reserve)):
            r = self.waiting.pop(0)
            self.pages.reserved += r.reserve
            r.slot = len(self.active)
            r.stage0, r.rounds0 = dict(e.runner.stage_sum), e.rounds
            self.active.append(r)
            new.append(r)
        if new:
            self.rent = 0.0
            graphs, t0 = len(e.prefill.graphs), e.prefill_s
            try:
                e.prefill.run(new, emitted)
            except Exception as err:   # outside any one request's steps: every request still joining leaves
                self.abandon(new, err, emitted)
                return
            rows, secs = sum(len(r.prompt) for r in new), e.prefill_s - t0
            captured = len(e.prefill.graphs) != graphs
            e.admissions += 1
            e.last_admission = (len(new), rows, secs, captured)
            # a capture's time is not an admission's cost, nor is a failed request's cut-short prefill
            if (self.admission == "grouped" and not captured
                    and not any(r.rid in self.errors for r in new)):
                self.admits, self.fit = (self.admits + [(rows, secs)])[-ADMIT_FIT:], None

    def abandon(self, reqs: list[Request], err: Exception, emitted) -> None:
        """Requests of a failed admission that are still active leave whole (the highest slot first): each
        records `err` for step() to raise, emits nothing, gives its pages back and is never a result."""
        for r in sorted(reqs, key=lambda r: -r.slot):
            if 0 <= r.slot < len(self.active) and self.active[r.slot] is r:
                self.errors.setdefault(r.rid, err)
                emitted.pop(r.rid, None)
                self.release(r)

    def grow(self, r: Request, rows: int) -> None:
        """Give request r pages for cache rows [0, rows), all or none (RuntimeError beyond its reservation).
        Their page-table entries go in one copy that does not wait for the device (from pinned memory on a
        GPU): item assignment of a host number copies it from pageable memory and synchronizes the stream,
        which under overlap waits for the round in flight."""
        e = self.e
        have = len(r.pages)
        need = -(-rows // e.page_size) - have
        if need <= 0:
            return
        if have + need > r.reserve:
            raise RuntimeError(f"request {r.rid}: needs page {r.reserve + 1} of a reservation of {r.reserve}")
        new = [self.pages.take() for _ in range(need)]
        src = torch.tensor(new, dtype=e.page_table.dtype)
        if e.device.type == "cuda":
            src = src.pin_memory()
        e.page_table[r.slot, have:have + need].copy_(src, non_blocking=True)
        r.pages += new

    def release(self, r: Request) -> None:
        """r leaves: its pages go back, the last active request takes its slot."""
        e = self.e
        self.pages.give_back(r.pages, r.reserve - len(r.pages))
        s, last = r.slot, len(self.active) - 1
        if s != last:
            m = self.active[last]
            e.move_slot(last, s)
            m.slot = s
            self.active[s] = m
        self.active.pop()
        e.clear_slot(last)
        r.result.wall_time = time.perf_counter() - r.t0 - (e.synthetic_s - r.syn0)
        res, was = r.result, r.stage0 or {}
        res.target_forwards += e.rounds - r.rounds0   # the rounds landed while it was active
        for key, v in e.runner.stage_sum.items():
            res.stage_times[key] = res.stage_times.get(key, 0.0) + v - was.get(key, 0.0)
        r.slot = -1
        if r.rid not in self.errors:
            self.finished[r.rid] = r.result

    def raise_errors(self) -> None:
        """One ValueError naming every request that failed since the last call ("request 3: ...", or
        "requests 1, 2: ..." for one error shared), chained from the first error; the record is cleared."""
        if self.errors:
            errors, self.errors = self.errors, {}
            by: dict[str, list[int]] = {}
            for rid, err in sorted(errors.items()):
                by.setdefault(str(err), []).append(rid)
            raise ValueError("; ".join(f"request{'s' * (len(ids) > 1)} {', '.join(map(str, ids))}: {msg}"
                                       for msg, ids in by.items())) from errors[min(errors)]

    def request(self, prompt, max_new_tokens, temperature, seed, stop_tokens, synthetic_context,
                 what: str = "prompt") -> Request:
        """add_request's arguments checked into a Request (id -1, not queued); `what` names the prompt."""
        e = self.e
        prompt = checks.token_list(what, prompt, e.model.args.vocab_size)
        max_new = check_max_new(max_new_tokens)
        temperature = check_temperature(temperature)
        seed = check_seed(seed)
        stop = check_stop(stop_tokens, e.model.args.vocab_size)
        synthetic = checks.int_in("synthetic_context", synthetic_context, 0)
        if synthetic and e.mode != "ar" and not e.batched_drafter:
            raise ValueError("synthetic_context: a host drafter keeps its own context; use mode 'ar' or the "
                             "batched DFlash drafter")
        need = len(prompt) + synthetic + max_new + e.lookahead
        mpe = e.model.args.max_position_embeddings
        if need > mpe:
            raise ValueError(f"context overflow: {what} ({len(prompt)}) + max_new_tokens ({max_new}) + draft "
                             f"lookahead ({e.lookahead}) = {need} > max_position_embeddings ({mpe})")
        if need > e.max_len:
            raise ValueError(f"context overflow: {what} ({len(prompt)}) + max_new_tokens ({max_new}) + draft "
                             f"lookahead ({e.lookahead}) = {need} > the engine's max_len ({e.max_len})")
        reserve = -(-need // e.page_size)
        if reserve > self.pages.capacity:
            raise ValueError(f"{what} + max_new_tokens: {need} rows need {reserve} pages, the pool has "
                             f"{self.pages.capacity} (max_tokens)")
        return Request(-1, prompt, max_new, temperature, seed, stop, GenerationResult([], e.mode), reserve,
                       synthetic=synthetic)

    def queue(self, req: Request) -> int:
        """A checked Request into the waiting queue under the next id; returns the id."""
        req.rid = self.next_id
        self.next_id += 1
        self.waiting.append(req)
        return req.rid
