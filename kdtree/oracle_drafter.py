"""The test oracle drafter: OracleDrafter reads the target's own future greedy tokens and drafts calibrated
distributions around them, with the session calls of a drafter (kdtree.drafter: start, propose, accept)."""
from __future__ import annotations

import numpy as np
import torch

from . import checks


class OracleDrafter:
    """TEST ORACLE, not a model: it reads the target's own future greedy tokens.

    `reference` is prompt + the target's greedy continuation. For a root at committed length n, each depth d
    gets a calibrated draft distribution around the true token t = reference[n - 1 + d]: `k` decoy tokens and
    t share weights w ~ Dirichlet(concentration) (sorted, largest first), and t takes slot j with probability
    w[j], so the truth is a sample of the draft's own distribution. With probability `miss` the truth is left
    out (it gets background mass only). Background: the remaining `background` mass spread over the
    vocabulary with N(0, noise) log-jitter. Deterministic per (seed, n). Off the reference (never, while the
    decoding is lossless) the truth is unknown and only decoys are drawn.
    """

    target_layer_ids: tuple = ()

    def __init__(self, reference, vocab_size: int, block_size: int = 8, concentration: float = 0.3,
                 k: int = 4, miss: float = 0.05, background: float = 0.02, noise: float = 0.5, seed: int = 0):
        vocab_size = checks.positive_int("OracleDrafter vocab_size", vocab_size)
        reference = checks.token_list("OracleDrafter reference", reference, vocab_size, allow_empty=True)
        block_size = checks.int_in("OracleDrafter block_size", block_size, 2,
                                   note=" (the root and at least one drafted depth)")
        k = checks.int_in("OracleDrafter k", k, 0, vocab_size - 1, " (decoys besides the true token)")
        concentration = checks.finite_float("OracleDrafter concentration", concentration, lo=1e-6)
        miss = checks.finite_float("OracleDrafter miss", miss, lo=0.0, hi=1.0)
        background = checks.finite_float("OracleDrafter background", background, lo=0.0, hi=0.999)
        noise = checks.finite_float("OracleDrafter noise", noise, lo=0.0)
        seed = checks.int_in("OracleDrafter seed", seed, 0)
        self.reference = reference
        self.vocab_size, self.block_size = vocab_size, block_size
        self.concentration, self.k, self.miss = concentration, k, miss
        self.background, self.noise, self.seed = background, noise, seed

    def session(self, max_len: int) -> "OracleDrafter":
        return self

    def start(self, prompt_tokens, features=None) -> None:
        n = len(prompt_tokens)
        if self.reference[:n] != [int(t) for t in prompt_tokens]:
            raise ValueError("OracleDrafter: the reference does not start with this prompt")

    def accept(self, features=None) -> None:
        pass

    def propose(self, committed) -> torch.Tensor:
        n = len(committed)
        L, V = self.block_size - 1, self.vocab_size
        rng = np.random.default_rng((self.seed, n))
        on_track = self.reference[:n] == list(map(int, committed))
        probs = np.full((L, V), self.background / V)
        probs *= np.exp(self.noise * rng.standard_normal((L, V)))
        for d in range(1, L + 1):
            j = n - 1 + d
            truth = self.reference[j] if on_track and j < len(self.reference) else -1
            k = min(self.k + 1, V)
            w = np.sort(rng.dirichlet([self.concentration] * k))[::-1] * (1 - self.background)
            tokens = rng.permutation(V)[:k + 1]
            tokens = [t for t in tokens if t != truth][:k]
            if truth >= 0 and rng.random() >= self.miss:
                slot = int(rng.choice(k, p=w / w.sum()))
                tokens[slot] = truth
            probs[d - 1, tokens] += w
        return torch.from_numpy(np.log(probs).astype(np.float32))
