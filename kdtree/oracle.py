"""The lab's independent oracle: the simple eager generation loops (one request, numpy or kernel tree steps,
host reads everywhere). Not the public API: `kdtree.decode` runs everything through `kdtree.engine`, and tests
compare the engine with these loops (`kdtree.validate.oracle_*`), so that "engine == AR" never compares the
engine with itself. Their results at T > 0 use a torch.Generator per call (the engine's streams differ).

One speculative round (`_speculate`):
    draft    drafter session proposes logits [L, V] below the root (the last committed token)
    build    DDTree: top-K + best-first tree of <= budget nodes (DFlash: the argmax chain)
    compile  verify block: root + nodes, position ids = root_pos + depth, ancestor mask
    verify   one target forward over the block, every cached token visible
    commit   walk the target's choices down the tree; compact the cache to the accepted path;
             hand the accepted rows' features to the drafter; emit accepted tokens + the bonus token
The target cache always holds every committed token but the last (the root of the next round).

Greedy (temperature 0) speculative output equals greedy autoregressive output token for token.
At temperature > 0 every row of the verify block gets one target sample and the walk follows the samples,
so each emitted token is distributed exactly as the target's.
"""
from __future__ import annotations

import time

import torch

from . import golden
from .engine import (GenerationResult, check_drafter, check_max_new, check_prompt, check_seed, check_stop,
                     check_temperature, finish)
from .model import Transformer

ORACLE_STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit")


def _result(mode: str) -> GenerationResult:
    r = GenerationResult([], mode)
    r.stage_times = {s: 0.0 for s in ("prefill",) + ORACLE_STAGES}
    return r


class _Clock:
    def __init__(self, stats: dict, device: torch.device):
        self.stats, self.cuda = stats, device.type == "cuda"

    def __call__(self, stage: str):
        clock = self

        class _Ctx:
            def __enter__(self):
                if clock.cuda:
                    torch.cuda.synchronize()
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                if clock.cuda:
                    torch.cuda.synchronize()
                clock.stats[stage] += time.perf_counter() - self.t
        return _Ctx()


def _check_prompt(model: Transformer, prompt, max_new_tokens: int, lookahead: int) -> list[int]:
    prompt = check_prompt(prompt, model.args.vocab_size)
    check_max_new(max_new_tokens)
    need = len(prompt) + max_new_tokens + lookahead
    if need > model.args.max_position_embeddings:
        raise ValueError(f"context overflow: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + "
                         f"draft lookahead ({lookahead}) = {need} > max_position_embeddings "
                         f"({model.args.max_position_embeddings})")
    return prompt


def _check_finite(logits: torch.Tensor, ok: torch.Tensor | None = None) -> None:
    """Target logits [N, V] must be finite (a host sync: called where the round syncs anyway). ok: the row
    flags torch.isfinite(logits).all(-1), when launched earlier so the reduction overlaps other work."""
    ok = torch.isfinite(logits).all(dim=-1) if ok is None else ok
    if not bool(ok.all()):
        rows = torch.nonzero(~ok).flatten().tolist()
        raise ValueError(f"target logits: NaN or inf in verify row(s) {rows[:8]}: the target's weights or "
                         "inputs are not finite")


def _choose(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] -> next token per row: argmax (T = 0) or one sample from softmax(logits / T), drawn on
    the logits' device with `gen` (a generator of that device: no copy of an [N, V] block to the host).
    Sampling checks the logits first (NaN would reach the sampler); at T = 0 callers check after their
    sync."""
    if temperature == 0:
        return logits.argmax(-1)
    _check_finite(logits)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).flatten()


def oracle_ar(model: Transformer, prompt, max_new_tokens: int, stop_tokens=(), temperature: float = 0.0,
                seed: int = 0) -> GenerationResult:
    """Plain autoregressive decoding: one target forward per token."""
    prompt = _check_prompt(model, prompt, max_new_tokens, 0)
    temperature = check_temperature(temperature)
    gen = torch.Generator(device=model.device).manual_seed(check_seed(seed))
    res = _result("ar")
    clock = _Clock(res.stage_times, model.device)
    t0 = time.perf_counter()
    cache = model.new_cache(len(prompt) + max_new_tokens)
    stop = check_stop(stop_tokens)
    x = torch.tensor([prompt], device=model.device)
    with clock("prefill"):
        logits = model(x, cache, logits_for=[-1]).logits[0]
    res.target_forwards += 1
    while True:
        with clock("commit"):
            tok = int(_choose(logits, temperature, gen)[-1])
            if temperature == 0:
                _check_finite(logits)
        if finish(res.tokens, [tok], max_new_tokens, stop):
            break
        with clock("verify"):
            logits = model(torch.tensor([[tok]], device=model.device), cache).logits[0]
        res.target_forwards += 1
        res.accept_lengths.append(1)
        res.tree_sizes.append(1)
    res.wall_time = time.perf_counter() - t0
    return res


BACKENDS = ("golden", "kernel")


def _check_backend(backend: str, model: Transformer) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "kernel" and model.device.type != "cuda":
        raise ValueError("backend='kernel' needs the model on a CUDA device")
    return backend


class _Rounds:
    """One speculative decode's state (the target's cache, the drafter's session, the stage clock, the result)
    and its two round paths: `kernel` (the GPU tree steps) and `golden` (numpy tree steps)."""

    def __init__(self, model: Transformer, drafter, cache, res: GenerationResult, clock, gen,
                 temperature: float):
        self.model, self.cache, self.res, self.clock, self.gen = model, cache, res, clock, gen
        self.session = drafter.session(cache.max_len)
        self.layers = tuple(drafter.target_layer_ids)
        self.temperature, self.max_accept = temperature, drafter.block_size

    def features(self, out, rows=None) -> torch.Tensor | None:
        if not self.layers:
            return None
        f = torch.cat([out.hidden[i][0] for i in self.layers], dim=-1)  # [T, n_layers * D]
        return f if rows is None else f[rows]

    def prefill(self, prompt: list[int]) -> int:
        """The prompt into the cache and the drafter's session; the first token."""
        model, T = self.model, self.temperature
        with self.clock("prefill"):
            out = model(torch.tensor([prompt], device=model.device), self.cache, hidden_layers=self.layers)
            first = int(_choose(out.logits[0, -1:], T, self.gen)[0])
            if T == 0:
                _check_finite(out.logits[0, -1:])
            self.session.start(prompt, self.features(out))
        self.res.target_forwards += 1
        return first

    def kernel(self, committed: list[int], budget: int | None) -> list[int]:
        """One round through the GPU kernels (budget None: the DFlash chain); the tokens it emits."""
        from . import kernels
        model, clock, dev = self.model, self.clock, self.model.device
        with clock("draft"):
            draft = self.session.propose(committed).to(dev)  # [L, V]
        with clock("tree_build"):
            root = torch.tensor([committed[-1]], dtype=torch.int32, device=dev)
            start = torch.tensor([len(committed) - 1], dtype=torch.int32, device=dev)
            if budget is None:  # the DFlash chain: argmax per depth
                L = draft.shape[0]
                toks = torch.cat([root, draft.argmax(-1).to(torch.int32)])[None]
                parents = torch.arange(-1, L, dtype=torch.int32, device=dev)[None]
                positions = start + torch.arange(L + 1, dtype=torch.int32, device=dev)[None]
                mask = torch.ones(L + 1, L + 1, dtype=torch.bool, device=dev).tril()[None]
            else:
                tb = kernels.tree_build(draft[None].contiguous(), budget, root, start)
                toks, parents, positions = tb.tokens, tb.parents, tb.positions
        with clock("tree_compile"):
            if budget is not None:
                mask = tb.dense_mask()
        with clock("verify"):
            out = model(toks.long(), self.cache, position_ids=positions[0], mask=mask,
                        hidden_layers=self.layers)
        self.res.target_forwards += 1
        with clock("commit"):
            choice = _choose(out.logits[0], self.temperature, self.gen)[None]
            # read after the sync
            ok = torch.isfinite(out.logits[0]).all(dim=-1) if self.temperature == 0 else None
            acc, acc_len, bonus = kernels.tree_walk(toks, parents, choice, max_accept=self.max_accept)
            n_acc = int(acc_len[0])  # the round's device-to-host sync: how many rows were accepted
            if ok is not None:
                _check_finite(out.logits[0], ok)
            rows = acc[0, :n_acc].long()
            new = toks[0, rows[1:]].tolist() + [int(bonus[0])]
            self.cache.compact_rows(acc, n_acc)
            if self.layers:
                self.session.accept(self.features(out, rows))
            self.res.tree_sizes.append(toks.shape[1])
        return new

    def golden(self, committed: list[int], build) -> list[int]:
        """One round through the numpy tree steps (`build`: the draft's tree); the tokens it emits."""
        model, clock, dev = self.model, self.clock, self.model.device
        with clock("draft"):
            draft = self.session.propose(committed)  # [L, V]
        with clock("tree_build"):
            tree = build(draft.float().cpu().numpy())
        with clock("tree_compile"):
            vb = golden.compile_tree(tree, committed[-1], len(committed) - 1)
            toks = torch.from_numpy(vb.tokens)[None].to(dev)
            pos = torch.from_numpy(vb.positions).to(dev)
            mask = torch.from_numpy(vb.mask).to(dev)
        with clock("verify"):
            out = model(toks, self.cache, position_ids=pos, mask=mask, hidden_layers=self.layers)
        self.res.target_forwards += 1
        with clock("commit"):
            choice = _choose(out.logits[0], self.temperature, self.gen).cpu().numpy()
            if self.temperature == 0:
                _check_finite(out.logits[0])
            accepted, bonus = golden.walk(vb.tokens, vb.parents, choice)
            self.cache.compact(torch.from_numpy(accepted))
            rows = torch.from_numpy(accepted).to(dev)
            if self.layers:
                self.session.accept(self.features(out, rows))
            new = [int(t) for t in vb.tokens[accepted[1:]]] + [bonus]
            self.res.tree_sizes.append(vb.n)
        return new


def _speculate(model: Transformer, drafter, prompt, max_new_tokens: int, build, mode: str, lookahead: int,
               stop_tokens=(), temperature: float = 0.0, seed: int = 0, backend: str = "golden",
               budget: int | None = None) -> GenerationResult:
    backend = _check_backend(backend, model)
    prompt = _check_prompt(model, prompt, max_new_tokens, drafter.block_size)
    temperature = check_temperature(temperature)
    gen = torch.Generator(device=model.device).manual_seed(check_seed(seed))
    res = _result(mode)
    t0 = time.perf_counter()
    stop = check_stop(stop_tokens)
    cache = model.new_cache(len(prompt) + max_new_tokens + lookahead + 1)
    rounds = _Rounds(model, drafter, cache, res, _Clock(res.stage_times, model.device), gen, temperature)
    first = rounds.prefill(prompt)
    committed = prompt + [first]
    done = finish(res.tokens, [first], max_new_tokens, stop)
    while not done:
        new = rounds.kernel(committed, budget) if backend == "kernel" else rounds.golden(committed, build)
        committed += new
        res.accept_lengths.append(len(new))
        done = finish(res.tokens, new, max_new_tokens, stop)
    res.wall_time = time.perf_counter() - t0
    return res


def oracle_dflash(model: Transformer, drafter, prompt, max_new_tokens: int, stop_tokens=(),
                    temperature: float = 0.0, seed: int = 0, backend: str = "golden") -> GenerationResult:
    """DFlash: verify the drafter's argmax chain (L = block_size - 1 tokens) each round.
    backend "golden": tree steps in numpy; "kernel": walk and compaction on the GPU (kdtree.kernels)."""
    check_drafter(model, drafter)
    return _speculate(model, drafter, prompt, max_new_tokens, golden.chain_tree, "dflash",
                      drafter.block_size, stop_tokens, temperature, seed, backend)


def oracle_ddtree(model: Transformer, drafter, prompt, max_new_tokens: int, budget: int, stop_tokens=(),
                    temperature: float = 0.0, seed: int = 0, backend: str = "golden") -> GenerationResult:
    """DDTree: verify the best-first tree of `budget` draft nodes each round.
    backend "golden": build/compile/walk in numpy (golden.py); "kernel": the whole round on the GPU
    (kernels.tree_build, the model's verify forward, kernels.tree_walk, kernels.kv_compact); the verify
    block then always has budget + 1 rows (padding rows see only themselves and are never accepted)."""
    check_drafter(model, drafter)
    budget = golden._check_budget(budget)
    if backend == "kernel" and budget > 1024:
        raise ValueError(f"budget={budget}: the kernel backend supports at most 1024")
    return _speculate(model, drafter, prompt, max_new_tokens, lambda lg: golden.ddtree(lg, budget), "ddtree",
                      budget + 1, stop_tokens, temperature, seed, backend, budget)
