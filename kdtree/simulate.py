"""Simulated acceptance (labelled so): rounds at real shapes whose accept lengths follow a profile.

With random weights (the K2.6 shape runs) the tokens mean nothing, so `Engine(..., simulate=Profile(...))`
keeps every kernel of the round at its real shape on real data (the drafter runs and its cost is real, the
tree is built, the target verifies every row, the walk, compaction and drafter update run on the accepted
path) and replaces two values with a simulated text, one per request:
  * the text: for each output position P of a request, its candidate tokens by rank (`Simulation.ids`:
    K distinct ids that vary with the request and the position, as a real text's do) and the rank of the
    target's "true" token among them (rank j with probability q_j, `project.profile_rank_probs`; a rank
    beyond the K listed matches no draft token and the target's own argmax stands in), both drawn from the
    request's counter-based stream keyed by (seed, P); tabulated for the request's slot at admission
    (`Simulation.write`), so a round reads it with a gather;
  * the draft distribution the tree is built from (`Simulation.draft`): at depth d of a round rooted at
    position s, the candidates of position s + d with probabilities q_j (the rest of the mass spread over the
    other tokens), so the tree has the profile's shape and its prefix probabilities are the profile's own
    (calibrated by construction: the budget policy's expected tokens are the same profile's);
  * the target's choice: a row at position P chooses the true token of P + 1, and a round's bonus token is
    the choice of its last accepted row.
Keyed by position, not by round or depth, the text is common to every mode and plan: AR, the chain, any
tree and budget="auto" emit the same tokens (a rank beyond the list aside, where the model's argmax over the
same context decides) and their rounds read the same tokens, so plans are compared on the same luck and
the same routing, and differ only by what they are. A round's positions lie after every earlier round's
accepted ones, so each round draws fresh independent ranks. A plan's accept lengths are distributed as the
profile predicts for it (`project.profile_taus` gives their mean for a tree; the chain's is
1 + p + ... + p^L), whatever the weights.
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


class Simulation:
    """A profile's device state for one engine: each slot's simulated text (`write` at admission: the true
    token and the candidates' base id of every position, [max_batch, length]), read by the rounds with a
    gather, and the draft logits buffer [max_batch, L, V] (rewritten by each `draft`). depth: the drafter's
    L (block_size - 1); 0 for AR. length: positions per slot (the engine's cache rows + a block + 1)."""

    def __init__(self, profile: Profile, vocab_size: int, depth: int, max_batch: int, device,
                 length: int = 4096):
        if not isinstance(profile, Profile):
            raise ValueError(f"simulate={profile!r}: expected a kdtree.simulate.Profile")
        if depth and profile.depth != depth:
            raise ValueError(f"simulate: the profile's depth {profile.depth} differs from the drafter's "
                             f"{depth} (block_size - 1)")
        if profile.K > vocab_size:
            raise ValueError(f"simulate: Profile.K={profile.K} exceeds the vocabulary ({vocab_size})")
        self.profile, self.V, self.K, self.length = profile, vocab_size, profile.K, int(length)
        q = profile.rank_probs()
        rest = max(1.0 - float(q.sum()), 1e-30)
        self.background = float(np.log(rest / max(vocab_size - profile.K, 1)))
        self.logq = torch.from_numpy(np.log(np.maximum(q, 1e-30)).astype(np.float32)).to(device)    # [K]
        self.stride = vocab_size // profile.K   # rank j's id: base + j * stride (mod V), distinct for j < K
        self.rank_ids = torch.arange(profile.K, device=device) * self.stride                      # [K]
        self.none = vocab_size   # the choice no draft token equals (a rank beyond the list)
        self.cdf = torch.from_numpy(np.cumsum(q)).to(device, torch.float64)                # [K]
        self.depths = torch.arange(1, depth + 1, device=device)[None]                      # [1, L]
        self.logits = torch.full((max_batch, depth, vocab_size), self.background, device=device)
        self._written = torch.zeros(max_batch, depth, profile.K, dtype=torch.int64, device=device)
        self.text = torch.full((max_batch, self.length), self.none, dtype=torch.int64, device=device)
        self.base = torch.zeros(max_batch, self.length, dtype=torch.int64, device=device)

    # the text as a pure function of (seed, position): `write` tabulates it, the tests read it directly
    def _draws(self, seed: torch.Tensor, pos: torch.Tensor, salt: int) -> torch.Tensor:
        """float64 [b, n] uniforms of the requests' streams (seed [b]) at positions pos [b, n]."""
        b, n = pos.shape
        return uniforms(seed.long().repeat_interleave(n), pos.reshape(-1), 1, salt=salt).view(b, n).double()

    def ids(self, seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """int64 [b, n, K]: the candidate tokens by rank at positions pos [b, n] of the requests' texts."""
        return (self._base(seed, pos)[..., None] + self.rank_ids) % self.V

    def _base(self, seed, pos):
        return (self._draws(seed, pos, 0x1D5) * self.V).long()                            # [b, n]

    def ranks(self, seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """int64 [b, n]: the true token's rank at positions pos [b, n] (K: beyond the list)."""
        return torch.searchsorted(self.cdf, self._draws(seed, pos, 0x51AD), right=True)

    def tokens(self, seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """int64 [b, n]: the true tokens at positions pos [b, n] (`none`: a rank beyond the list): `ids`'
        entry at the rank, computed without listing the K candidates."""
        return self._true(self._base(seed, pos), self.ranks(seed, pos))

    def _true(self, base: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """The true tokens from the candidates' base ids and the true ranks (both [b, n])."""
        t = (base + rank.clamp(max=self.K - 1) * self.stride) % self.V
        return torch.where(rank < self.K, t, self.none)

    # the engine's side: per slot, tabulated once, gathered by the rounds (capturable, a few kernels)
    def write(self, slot, seed) -> None:
        """The texts of requests of seeds `seed` in slots `slot` (ints, or equal-length lists of ints, the
        slots distinct: one pass for a whole admission), at admission; `move` when a slot changes."""
        one = isinstance(slot, (int, np.integer)) and not isinstance(slot, bool)
        slots, seeds = ([slot], [seed]) if one else (slot, seed)
        try:
            slots, seeds = [int(x) for x in slots], [int(x) for x in seeds]
        except (TypeError, ValueError):
            raise ValueError(f"write: slot={slot!r}, seed={seed!r}: expected two ints or two equal-length "
                             "lists of ints") from None
        if len(slots) != len(seeds):
            raise ValueError(f"write: {len(slots)} slots for {len(seeds)} seeds")
        if len(set(slots)) != len(slots) or not all(0 <= x < self.text.shape[0] for x in slots):
            raise ValueError(f"write: slot={slots}: expected distinct slots in [0, {self.text.shape[0]})")
        if not slots:
            return
        dev = self.text.device
        sd = torch.tensor(seeds, dtype=torch.int64, device=dev)
        pos = torch.arange(self.length, device=dev)[None].expand(len(seeds), -1)
        idx = torch.tensor(slots, dtype=torch.int64, device=dev)
        base = self._base(sd, pos)                                                         # [n, length]
        self.text[idx] = self._true(base, self.ranks(sd, pos))
        self.base[idx] = base

    def move(self, src: int, dst: int) -> None:
        self.text[dst], self.base[dst] = self.text[src], self.base[src]

    def _at(self, step: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        return (step.long()[:, None] + depths).clamp_(max=self.length - 1)                # [b, n]

    def truth(self, step: torch.Tensor, n: int) -> torch.Tensor:
        """The true tokens of positions step + 1 ... step + n of slots [0, b), int64 [b, n] (`none`: a rank
        beyond the list), for a round whose root sits at position step [b]."""
        b = step.shape[0]
        return self.text[:b].gather(1, self._at(step, torch.arange(1, n + 1, device=step.device)))

    def draft(self, step: torch.Tensor) -> torch.Tensor:
        """The profile's draft logits float32 [b, L, V] for slots [0, b) (a view of the buffer, valid until
        the next call) of a round rooted at position step [b]: depth d's candidates are those of position
        step + d. Torch ops only (capturable): the previous call's entries are reset, then this round's
        written."""
        b = step.shape[0]
        out, old = self.logits[:b], self._written[:b]
        base = self.base[:b].gather(1, self._at(step, self.depths))                        # [b, L]
        new = (base[..., None] + self.rank_ids) % self.V                                  # [b, L, K]
        out.scatter_(2, old, self.background)
        out.scatter_(2, new, self.logq.expand_as(new).contiguous())
        old.copy_(new)
        return out

    def choice(self, truth: torch.Tensor, positions: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The simulated target choice per row int64 [b, N]: truth [b, n] from `truth(start, n)`; a row at
        depth d (positions - start) chooses the true token of its next position, truth[:, d]."""
        d = (positions.long() - start.long()[:, None]).clamp(0, truth.shape[1] - 1)          # [b, N]
        return truth.gather(1, d)

    def bonus(self, sim_choice: torch.Tensor, real_choice: torch.Tensor, accepted: torch.Tensor,
              acc_len: torch.Tensor) -> torch.Tensor:
        """The round's bonus token int64 [b]: the simulated choice at the last accepted row, or the target's
        own choice there when that is `none`."""
        last = accepted.long().gather(1, (acc_len.long() - 1).clamp_min(0)[:, None])       # [b, 1]
        sim = sim_choice.gather(1, last)[:, 0]
        return torch.where(sim < self.none, sim, real_choice.long().gather(1, last)[:, 0])
