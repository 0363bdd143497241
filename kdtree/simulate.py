"""Simulated acceptance (labelled so): rounds at real shapes whose accept lengths follow a profile.

With random weights (the K2.6 shape runs) the tokens mean nothing, so `Engine(..., simulate=Profile(...))`
keeps every kernel of the round at its real shape on real data (the drafter runs and its cost is real, the
tree is built, the target verifies every row, the walk, compaction and drafter update run on the accepted
path) and replaces two values:
  * the draft distribution the tree is built from: the profile's drafter (`Profile.logits`: at every depth
    the rank-j token has probability q_j, `project.profile_rank_probs`; the rest of the mass spread over the
    other tokens), so the tree has the profile's shape and its prefix probabilities are the profile's own
    (calibrated by construction: the budget policy's expected tokens are the same profile's);
  * the target's choice: per request and output position, the target's "true" rank is drawn from the same
    profile (rank j with probability q_j, independently across positions, a rank beyond the listed ones
    matching no draft token), from the request's counter-based stream keyed by the position; a round
    starting at position s reads positions s + 1 ... s + L as its depths 1 ... L (the rank's token at that
    depth); a row at depth d chooses the true token of depth d + 1, and a round's bonus token is the true
    token at the last accepted row (the target's own argmax there when the true token lies beyond the list).
    Keyed by position, not by round, the draws are common to every plan (the same request sees the same
    rank at the same position under the chain, any tree or AR), so plans are compared on the same luck:
    their differences are the plans', not sampling noise. A round's positions lie after every earlier
    round's accepted ones, so each round still draws fresh independent ranks.
So a plan's accept lengths are distributed as the profile predicts for it (`project.profile_taus` gives
their mean for a tree; the chain's is 1 + p + ... + p^L), whatever the weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import checks
from .project import chain_top1, profile_rank_probs
from .round_ops import uniforms


@dataclass(frozen=True)
class Profile:
    """The profile of a drafter whose chain has `tau_chain` expected tokens over `depth` positions (the rank-0
    probability p solves 1 + p + ... + p^depth = tau_chain), rank j >= 1 with (1 - p)(1 - ratio) ratio^(j-1),
    listed up to rank K - 1."""
    tau_chain: float
    depth: int
    ratio: float = 0.5
    K: int = 256

    def __post_init__(self):
        checks.int_in("depth", self.depth, 1, 63)
        checks.int_in("K", self.K, 1, 4096)
        checks.finite_float("ratio", self.ratio, lo=0.0)
        if not self.ratio < 1:
            raise ValueError(f"ratio={self.ratio!r}: expected in [0, 1)")
        checks.finite_float("tau_chain", self.tau_chain, lo=1.0)
        if not self.tau_chain < self.depth + 1:
            raise ValueError(f"tau_chain={self.tau_chain!r}: expected in [1, depth + 1 = {self.depth + 1})")

    @property
    def name(self) -> str:
        return f"simulated: chain tau {self.tau_chain:g} (ratio {self.ratio:g}, depth {self.depth})"

    @classmethod
    def fit(cls, budgets, taus, depth: int, K: int = 256) -> "Profile":
        """The profile whose trees' expected tokens (`project.profile_taus`) best match measured tokens per
        round `taus` at `budgets` (least squares over a grid of chain tau and ratio): e.g. a trained pair's
        realized truncation curve (`calibration.truncations`) as a profile for other shapes."""
        from .project import profile_taus
        budgets, taus = [int(b) for b in budgets], np.asarray(taus, np.float64)
        if len(budgets) != len(taus) or not len(budgets):
            raise ValueError(f"budgets / taus: expected equal non-empty lists, got {len(budgets)} and "
                             f"{len(taus)}")
        best = None
        for tc in np.linspace(1.05, min(depth + 0.95, 12.0), 60):
            for r in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
                got = profile_taus(float(tc), budgets, depth, r)
                err = float(sum((got[b] - t) ** 2 for b, t in zip(budgets, taus)))
                if best is None or err < best[0]:
                    best = (err, float(tc), r)
        return cls(round(best[1], 3), depth, best[2], K)

    def rank_probs(self) -> np.ndarray:
        """q [K]: the probability of each listed rank (the rest, 1 - sum q, lies beyond the list)."""
        return profile_rank_probs(chain_top1(self.tau_chain, self.depth), self.ratio, self.K)

    def tokens(self, vocab_size: int) -> np.ndarray:
        """int64 [depth, K]: the token id of rank j at depth d (distinct within a depth; ids mean nothing)."""
        if self.K > vocab_size:
            raise ValueError(f"Profile.K={self.K} exceeds the vocabulary ({vocab_size})")
        rng = np.random.default_rng(12345)
        return np.stack([rng.permutation(vocab_size)[:self.K] for _ in range(self.depth)]).astype(np.int64)


class Simulation:
    """A profile's device tables for one engine: the draft logits [max_batch, L, V] and the draws."""

    def __init__(self, profile: Profile, vocab_size: int, depth: int, max_batch: int, device):
        if not isinstance(profile, Profile):
            raise ValueError(f"simulate={profile!r}: expected a kdtree.simulate.Profile")
        if profile.depth != depth:
            raise ValueError(f"simulate: the profile's depth {profile.depth} differs from the drafter's "
                             f"{depth} (block_size - 1)")
        self.profile = profile
        q = profile.rank_probs()
        rest = max(1.0 - float(q.sum()), 1e-30)
        tok = profile.tokens(vocab_size)                                                   # [L, K]
        lg = np.full((depth, vocab_size), np.log(rest / max(vocab_size - profile.K, 1)), np.float32)
        np.put_along_axis(lg, tok, np.log(np.maximum(q, 1e-30)).astype(np.float32)[None], 1)
        self.logits = torch.from_numpy(lg).to(device)[None].expand(max_batch, -1, -1).contiguous()
        self.tok = torch.from_numpy(tok).to(device)                                        # [L, K]
        self.depths = torch.arange(depth, device=device)[None]                              # [1, L]
        self.none = vocab_size   # the choice no draft token equals (a rank beyond the list, the last depth)
        self.cdf = torch.from_numpy(np.cumsum(q)).to(device, torch.float64)                # [K]

    def truth(self, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """The target's true token per depth 1..L, int64 [b, L] (`none`: a rank beyond the list) of a round
        whose root sits at position step [b]: depth d's rank drawn from the request's stream keyed by (seed,
        step + d), one draw per position whatever the round."""
        b, L = step.shape[0], self.tok.shape[0]
        pos = (step.long()[:, None] + self.depths).reshape(-1)                               # [b * L]
        u = uniforms(seed.repeat_interleave(L), pos, 1, salt=0x51AD).view(b, L).double()     # [b, L]
        r = torch.searchsorted(self.cdf, u, right=True)                                    # rank, K: beyond
        K = self.tok.shape[1]
        t = self.tok[self.depths, r.clamp(max=K - 1)]                                      # [b, L]
        return torch.where(r < K, t, self.none)

    def choice(self, truth: torch.Tensor, positions: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The simulated target choice per row int64 [b, N]: the true token of depth(row) + 1 (`none` at the
        last depth)."""
        L = truth.shape[1]
        d = (positions.long() - start.long()[:, None]).clamp(0, L)                       # [b, N] depth
        padded = torch.cat([truth, torch.full_like(truth[:, :1], self.none)], 1)           # [b, L + 1]
        return padded.gather(1, d)

    def bonus(self, sim_choice: torch.Tensor, real_choice: torch.Tensor, accepted: torch.Tensor,
              acc_len: torch.Tensor) -> torch.Tensor:
        """The round's bonus token int64 [b]: the simulated choice at the last accepted row, or the target's
        own choice there when that is `none`."""
        last = accepted.long().gather(1, (acc_len.long() - 1).clamp_min(0)[:, None])       # [b, 1]
        sim = sim_choice.gather(1, last)[:, 0]
        return torch.where(sim < self.none, sim, real_choice.long().gather(1, last)[:, 0])
