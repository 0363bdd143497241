"""Requests and their results: the argument checks, the page pool, the host record of each request."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import checks
from ..model import Transformer

# an eager round's stages; a graph replay is one "round"
STAGES = ("draft", "build", "verify", "walk", "commit")


@dataclass
class GenerationResult:
    tokens: list[int]                      # generated tokens (prompt excluded)
    mode: str
    target_forwards: int = 0               # prefill chunks included (its rounds added as it leaves)
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify round (>= 1)
    tree_sizes: list[int] = field(default_factory=list)      # verify rows per round (root included)
    # seconds per stage of the rounds it was in (added as it leaves: `Scheduler.release`)
    stage_times: dict[str, float] = field(
        default_factory=lambda: {s: 0.0 for s in ("prefill",) + STAGES + ("round",)})
    wall_time: float = 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / max(len(self.tokens), 1)

    @property
    def mean_accept_length(self) -> float:
        """tau: mean tokens emitted per verify round (accepted drafts + the bonus token)."""
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else float("nan")

    def summary(self) -> dict:
        return {"mode": self.mode, "new_tokens": len(self.tokens), "target_forwards": self.target_forwards,
                "forwards_per_token": self.forwards_per_token, "tau": self.mean_accept_length,
                "rounds": len(self.accept_lengths), "wall_s": self.wall_time,
                "stage_s": dict(self.stage_times)}


# ----------------------------------------------------------------------------- argument checks
def check_prompt(prompt, vocab_size: int) -> list[int]:
    return checks.token_list("prompt", prompt, vocab_size)


def check_max_new(max_new_tokens) -> int:
    return checks.positive_int("max_new_tokens", max_new_tokens)


TEMPERATURE_MAX = float(np.finfo(np.float32).max)   # the rounds hold temperatures in float32


def check_temperature(temperature) -> float:
    return checks.finite_float("temperature", temperature, lo=0.0, hi=TEMPERATURE_MAX,
                               note=" (0: greedy; the rounds compute in float32)")


def check_seed(seed) -> int:
    seed = checks.int_in("seed", seed, 0, note=" (below 2**63)")
    if seed >= 2**63:
        raise ValueError(f"seed={seed!r}: expected an int >= 0 (below 2**63)")
    return seed


def check_stop(stop_tokens, vocab_size: int | None = None) -> set[int]:
    """stop_tokens: token ids as a prompt takes them (checks.token_list: list, tuple, set of ints, 1-D
    integer tensor or array; empty allowed), in [0, vocab_size) when given; None: none."""
    if stop_tokens is None:
        return set()
    if isinstance(stop_tokens, (set, frozenset)):   # order does not matter for a stop set
        stop_tokens = list(stop_tokens)
    try:
        return set(checks.token_list("stop_tokens", stop_tokens, vocab_size, allow_empty=True))
    except ValueError as e:
        detail = str(e).removeprefix("stop_tokens: ")
        raise ValueError(f"stop_tokens={stop_tokens!r}: expected token ids (ints) in a list, tuple, set or "
                         f"1-D integer tensor ({detail})") from None


def check_drafter(model: Transformer, drafter) -> None:
    if not (hasattr(drafter, "session") and hasattr(drafter, "block_size")):
        raise ValueError(f"drafter: expected a drafter (block_size, session()), got {type(drafter).__name__}")
    dv = getattr(getattr(drafter, "args", None), "vocab_size", getattr(drafter, "vocab_size", None))
    if dv is not None and dv != model.args.vocab_size:
        raise ValueError(f"drafter: vocabulary {dv} differs from the target's {model.args.vocab_size}")
    attached = getattr(drafter, "_target", None)   # a DFlashDrafter drafts through its target's embedding
    if attached is not None and attached[0] is not model:
        raise ValueError("drafter: attached to " + ("no target" if attached[0] is None else "another target")
                         + ": it drafts through its target's embedding, lm_head and hidden states "
                         "(drafter.attach(model) checks the shapes and attaches it to this one)")


def finish(out: list[int], new: list[int], max_new: int, stop: set[int]) -> bool:
    """Append `new` to `out` up to max_new and the first stop token; True when generation is over."""
    for t in new:
        out.append(t)
        if t in stop or len(out) >= max_new:
            return True
    return False


class PagePool:
    """Free list of the pool's pages 1..n-1 (page 0 is the scratch page padding rows write to) and the count
    reserved by admitted requests."""

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.free = list(range(n_pages - 1, 0, -1))
        self.reserved = 0  # reserved by requests, not yet taken

    @property
    def capacity(self) -> int:
        return self.n_pages - 1

    def can_reserve(self, n: int) -> bool:
        return len(self.free) - self.reserved >= n

    def take(self) -> int:
        self.reserved -= 1
        return self.free.pop()

    def give_back(self, pages: list[int], unused_reservation: int) -> None:
        self.free.extend(reversed(pages))
        self.reserved -= unused_reservation


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    temperature: float
    seed: int
    stop: set[int]
    result: GenerationResult
    reserve: int                      # pages this request may take in all
    pages: list[int] = field(default_factory=list)
    # prompt + every accepted token (host drafters read it)
    committed: list[int] = field(default_factory=list)
    length: int = 0                   # cached rows (host mirror of the device length)
    slot: int = -1
    session: object = None            # a host drafter's session
    t0: float = 0.0
    syn0: float = 0.0                 # synthetic_s at t0 (fills, simulated texts: not in wall_time)
    est: np.ndarray | None = None     # budget="auto": expected tokens per plan from its last draft round
    est_sum: np.ndarray | None = None  # ... summed over its draft rounds (`Estimates.long_run`)
    est_n: int = 0                     # ... their count
    est_at: int = -1                   # ... the launch index of the round that drafted est
    stage0: dict | None = None        # the engine's stage sums and landed rounds as it joined (`release`)
    rounds0: int = 0
    synthetic: int = 0                # random context rows inserted before the root after prefill
