"""The budget policy: what each round verifies. The runner and the scheduler ask it, never which one it is.

    logits, graph, ticket = policy.launch(b, n, sampling, clock)   # run the round it plans
    landing = policy.landing(flight, wall)       # the landed round, before its tokens are handed out
    policy.landed(flight, landing, taken)        # ... and after: {request id: tokens emitted}

`FixedBudget` (AR, DFlash, DDTree at a fixed budget) verifies the engine's own block every round: one graph
per (batch bucket, sampling). `kdtree.budget.auto.AutoBudget` (budget="auto") picks AR, the chain or a tree
size each round from measured costs and the draft's estimates, with graphs of its own.

The hooks, with what the fixed budget does:
    capture(capture_fn)       capture the policy's graphs for every bucket (the engine's round per bucket)
    start()                   after the capture, before any request (nothing)
    verify_rows()             the verify rows a request its rounds can have (the prefix split's passes)
    launch(...)               the round, replayed or eager -> (logits, whether a graph ran, ticket); with
                              the prefix split (`engine.prefix`), its pass planned first
    copy_out(ticket, buf, n)  more device -> host copies of the launched round (none)
    block(b, plan)            the verify block of a planned round (the fixed budget plans none)
    walked(plan, acc, b)      the walk's accepted rows, inside the round (nothing)
    defers(plan)              whether the round's features wait to join the drafter's context (never)
    defer_rows(feats, b)      ... keep them
    tree_rows(flight)         verify rows per request of a landed round (the engine's rows)
    move_slot(src, dst), clear_slot(s)   the policy's per-slot state follows the requests' slots
    reset()                   zero the per-slot state after the warm-up rounds
    idle()                    the engine fell idle (no request active, none in flight)
"""
from __future__ import annotations

from .graphs import Round


class FixedBudget:
    """Every round verifies the engine's own block (AR's root, DFlash's chain, DDTree's `budget` nodes)."""

    auto = None   # no decision policy

    def __init__(self, engine):
        self.e = engine

    def capture(self, capture) -> None:
        e = self.e
        for b in reversed(e.buckets):
            for sampling in (False, True) if e.graph_sampling else (False,):
                capture(Round(b, sampling), lambda: e.runner.round(b, sampling))

    def start(self) -> None:
        pass

    def verify_rows(self) -> tuple:
        return (self.e.rows,)

    def launch(self, b: int, n: int, sampling: bool, clock):
        e, key = self.e, Round(b, sampling)
        if e.prefix is not None:
            e.prefix.plan(b, e.rows)
        if key in e.cache:
            return e.cache.replay(key), True, None
        return e.runner.round(b, sampling, clock), False, None

    def copy_out(self, ticket, buf: int, n: int) -> None:
        pass

    def block(self, b: int, plan):
        raise RuntimeError("a fixed budget plans no rounds")

    def walked(self, plan, acc, b: int) -> None:
        pass

    def defers(self, plan) -> bool:
        return False

    def defer_rows(self, feats, b: int) -> None:
        pass

    def landing(self, flight, wall: float):
        return None

    def tree_rows(self, flight) -> int:
        return self.e.rows

    def landed(self, flight, landing, taken: dict) -> None:
        pass

    def move_slot(self, src: int, dst: int) -> None:
        pass

    def clear_slot(self, s: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def idle(self) -> None:
        pass
