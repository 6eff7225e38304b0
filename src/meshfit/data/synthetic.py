"""A seeded synthetic language: a first-order Markov chain over token ids.

It needs no download, and its entropy rate is known exactly, which gives a
training run a hard lower bound on the achievable loss to compare against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class MarkovSource:
    """Random first-order Markov chain over ``vocab_size`` tokens.

    Each row of the transition matrix is a Dirichlet(``alpha``) draw. A small
    ``alpha`` concentrates each row on a few successors, so the entropy rate
    sits well below ``log(vocab_size)`` and a model has something to learn.

    Sequences are addressed by index and depend only on ``(seed, index)``:
    any rank can produce any sequence, and resuming needs only a counter.

    Memory is about ``16 * vocab_size**2`` bytes (float64 transition matrix
    and its row-wise CDF), so keep the vocabulary to a few thousand tokens.
    """

    def __init__(self, vocab_size: int, seed: int = 0, *, alpha: float = 0.1) -> None:
        if vocab_size < 2:
            raise ValueError(f"synthetic data needs vocab_size >= 2 (got {vocab_size})")
        if seed < 0:
            raise ValueError(f"synthetic data needs a non-negative seed (got {seed})")
        if alpha <= 0:
            raise ValueError(f"Dirichlet alpha must be > 0 (got {alpha})")
        self.vocab_size = vocab_size
        self.seed = seed
        self.alpha = alpha
        rng = np.random.default_rng(seed)
        transition = rng.dirichlet(np.full(vocab_size, alpha), size=vocab_size)
        self.transition = torch.from_numpy(transition)  # [V, V], rows sum to 1
        self.stationary = _stationary(self.transition)  # [V]
        self._start_cdf = _normalized_cdf(self.stationary)
        self._cdf = _normalized_cdf(self.transition)

    def __repr__(self) -> str:
        return f"MarkovSource(vocab_size={self.vocab_size}, seed={self.seed}, alpha={self.alpha})"

    def entropy_floor(self) -> float:
        """Entropy rate in nats/token: H = -sum_i pi_i sum_j P_ij log P_ij.

        This is the lowest mean cross-entropy any model can reach on targets
        that follow at least one token of context.
        """
        row_entropy = -torch.special.xlogy(self.transition, self.transition).sum(dim=1)
        return float(self.stationary @ row_entropy)

    def sequence(self, index: int, length: int) -> torch.Tensor:
        """Sequence number ``index``: ``length`` token ids (int64), start token drawn from pi."""
        return self.sequences([index], length)[0]

    def sequences(self, indices: Sequence[int], length: int) -> torch.Tensor:
        """Stack of sequences ``[len(indices), length]``; row r equals ``sequence(indices[r], length)``.

        Every sequence draws its uniforms from its own generator, so a row is
        the same whatever batch it is generated in; the chain is then stepped
        for all rows at once.
        """
        if length < 1:
            raise ValueError(f"sequence length must be >= 1 (got {length})")
        # Time-major so each step reads one contiguous row of uniforms.
        uniforms = torch.stack([self._uniforms(i, length) for i in indices], dim=1)
        tokens = torch.empty(uniforms.shape, dtype=torch.long)
        # right=True returns the first CDF entry > u, so zero-probability
        # tokens (flat CDF steps) can never be chosen.
        tokens[0] = torch.searchsorted(self._start_cdf, uniforms[0], right=True)
        for t in range(1, length):
            rows = self._cdf[tokens[t - 1]]
            tokens[t] = torch.searchsorted(rows, uniforms[t].unsqueeze(1), right=True).squeeze(1)
        return tokens.T.contiguous()

    def _uniforms(self, index: int, length: int) -> torch.Tensor:
        if index < 0:
            raise ValueError(f"sequence index must be >= 0 (got {index})")
        # SeedSequence hashes (seed, index) into well-mixed state, so nearby
        # indices get unrelated streams (seed + index would collide across seeds).
        state = np.random.SeedSequence((self.seed, index)).generate_state(1, np.uint64)[0]
        gen = torch.Generator().manual_seed(int(state))
        return torch.rand(length, generator=gen, dtype=torch.float64)


def _normalized_cdf(probs: torch.Tensor) -> torch.Tensor:
    # Dividing by the last entry makes it exactly 1.0, so a uniform in [0, 1)
    # always lands inside the vocabulary despite rounding in the cumsum.
    cdf = probs.cumsum(dim=-1)
    return cdf / cdf[..., -1:]


def _stationary(transition: torch.Tensor, tol: float = 1e-14, max_iter: int = 100_000) -> torch.Tensor:
    """Stationary distribution by power iteration (pi <- pi P).

    Dirichlet rows are (almost surely) strictly positive, so the chain is
    irreducible and aperiodic and the iteration converges geometrically;
    it is O(V^2) per step, unlike an O(V^3) eigendecomposition.
    """
    pi = torch.full((transition.shape[0],), 1.0 / transition.shape[0], dtype=transition.dtype)
    for _ in range(max_iter):
        nxt = pi @ transition
        nxt /= nxt.sum()
        if torch.sum(torch.abs(nxt - pi)) < tol:
            return nxt
        pi = nxt
    raise RuntimeError("power iteration for the Markov stationary distribution did not converge")
