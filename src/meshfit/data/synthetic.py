"""A seeded synthetic language: a sparse first-order Markov chain over token ids.

It needs no download, and its entropy rate is known exactly, which gives a
training run a hard lower bound on the achievable loss to compare against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# Probability that the next token is drawn uniformly from the whole vocabulary
# instead of from the current token's successors. It makes every transition
# possible, so the chain is irreducible and aperiodic, and it bounds the
# contraction of power iteration by (1 - RESTART) whatever the sparse part
# looks like. It is part of the chain itself: sampling and the entropy floor
# both include it, so the floor stays exact.
RESTART = 1e-3

# Largest uniform below 1.0; keeps a rescaled uniform strictly inside [0, 1).
_BELOW_ONE = float(np.nextafter(1.0, 0.0))


class MarkovSource:
    """Random sparse first-order Markov chain over ``vocab_size`` tokens.

    Token ``i`` has ``k = min(successors, vocab_size)`` distinct successors,
    weighted by a Dirichlet(``alpha``) draw; with probability ``RESTART`` the
    next token is uniform over the whole vocabulary instead:

        P(j | i) = (1 - RESTART) * w_ij + RESTART / vocab_size

    A small ``alpha`` concentrates each row on a few successors, so the
    entropy rate sits well below ``log(vocab_size)`` and a model has something
    to learn. The restart adds about ``RESTART * log(vocab_size / RESTART)``
    (0.02 nats at 128256 tokens) to it.

    The successors of each token are one id drawn from each of ``k`` equal
    slices of the vocabulary: that makes them distinct by construction, with
    no rejection loop, and spreads them over the whole id range.

    Memory and construction time are O(vocab_size * k): ids, weights and their
    row-wise CDF are ``[vocab_size, k]`` arrays (about 100 MB for 128256 tokens
    at k=32), so real tokenizer vocabularies fit.

    Sequences are addressed by index and depend only on ``(seed, index)``:
    any rank can produce any sequence, and resuming needs only a counter.
    """

    def __init__(self, vocab_size: int, seed: int = 0, *, alpha: float = 0.1, successors: int = 32) -> None:
        if vocab_size < 2:
            raise ValueError(f"synthetic data needs vocab_size >= 2 (got {vocab_size})")
        if seed < 0:
            raise ValueError(f"synthetic data needs a non-negative seed (got {seed})")
        if alpha <= 0:
            raise ValueError(f"Dirichlet alpha must be > 0 (got {alpha})")
        if successors < 1:
            raise ValueError(f"synthetic data needs successors >= 1 (got {successors})")
        self.vocab_size = vocab_size
        self.seed = seed
        self.alpha = alpha
        self.successors = k = min(successors, vocab_size)
        rng = np.random.default_rng(seed)
        edges = (np.arange(k + 1, dtype=np.int64) * vocab_size) // k
        ids = edges[:-1] + rng.integers(0, np.diff(edges), size=(vocab_size, k))
        weights = rng.dirichlet(np.full(k, alpha), size=vocab_size)
        self.successor_ids = torch.from_numpy(ids)  # [V, k] int64, distinct within a row
        self.successor_probs = torch.from_numpy(weights)  # [V, k] float64, rows sum to 1
        self._cdf = _normalized_cdf(weights)  # [V, k], last column exactly 1.0
        self.stationary = torch.from_numpy(_stationary(ids, weights))  # [V] float64
        self._start_cdf = _normalized_cdf(self.stationary.numpy())

    def __repr__(self) -> str:
        return (
            f"MarkovSource(vocab_size={self.vocab_size}, seed={self.seed}, alpha={self.alpha}, "
            f"successors={self.successors})"
        )

    def transition_probs(self, prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """P(nxt | prev) elementwise for integer tensors of one shape (float64)."""
        prev, nxt = torch.as_tensor(prev, dtype=torch.long), torch.as_tensor(nxt, dtype=torch.long)
        hit = self.successor_ids[prev] == nxt.unsqueeze(-1)  # at most one hit: ids are distinct
        sparse = (self.successor_probs[prev] * hit).sum(dim=-1)
        return (1.0 - RESTART) * sparse + RESTART / self.vocab_size

    def entropy_floor(self) -> float:
        """Entropy rate in nats/token: H = -sum_i pi_i sum_j P_ij log P_ij.

        This is the lowest mean cross-entropy any model can reach on targets
        that follow at least one token of context. Each row has k entries of
        (1 - RESTART) * w + RESTART / V and V - k entries of RESTART / V.
        """
        uniform = RESTART / self.vocab_size
        on_support = (1.0 - RESTART) * self.successor_probs + uniform
        row_entropy = -torch.special.xlogy(on_support, on_support).sum(dim=1)
        row_entropy -= (self.vocab_size - self.successors) * uniform * math.log(uniform)
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
        u = torch.stack([self._uniforms(i, length) for i in indices], dim=1).numpy()
        # One uniform per step decides both branches: u < RESTART picks a
        # uniform token (u / RESTART is uniform on [0, 1)), otherwise the
        # rescaled remainder indexes the successor CDF.
        restart = u < RESTART
        restart_ids = np.minimum((u / RESTART * self.vocab_size).astype(np.int64), self.vocab_size - 1)
        v = np.minimum((u - RESTART) / (1.0 - RESTART), _BELOW_ONE)
        ids, cdf = self.successor_ids.numpy(), self._cdf
        tokens = np.empty(u.shape, dtype=np.int64)
        # side="right" returns the first CDF entry > u, so zero-probability
        # tokens (flat CDF steps) can never be chosen.
        tokens[0] = np.searchsorted(self._start_cdf, u[0], side="right")
        # Plain numpy here: the per-step work is tiny ([batch, k]), so per-call
        # overhead dominates and numpy's is several times lower than torch's.
        for t in range(1, length):
            prev = tokens[t - 1]
            # Count of CDF entries <= v is the same "first entry > v" index;
            # the last entry is 1.0 > v, so it stays below k.
            slot = (cdf[prev] <= v[t, :, None]).sum(axis=1)
            tokens[t] = np.where(restart[t], restart_ids[t], ids[prev, slot])
        return torch.from_numpy(np.ascontiguousarray(tokens.T))

    def _uniforms(self, index: int, length: int) -> torch.Tensor:
        if index < 0:
            raise ValueError(f"sequence index must be >= 0 (got {index})")
        # SeedSequence hashes (seed, index) into well-mixed state, so nearby
        # indices get unrelated streams (seed + index would collide across seeds).
        state = np.random.SeedSequence((self.seed, index)).generate_state(1, np.uint64)[0]
        gen = torch.Generator().manual_seed(int(state))
        return torch.rand(length, generator=gen, dtype=torch.float64)


def _normalized_cdf(probs: np.ndarray) -> np.ndarray:
    # Dividing by the last entry makes it exactly 1.0, so a uniform in [0, 1)
    # always lands inside the row despite rounding in the cumsum.
    cdf = probs.cumsum(axis=-1)
    cdf /= cdf[..., -1:]
    return cdf


def _stationary(ids: np.ndarray, probs: np.ndarray, tol: float = 1e-13) -> np.ndarray:
    """Stationary distribution of the restarted chain by power iteration.

    One step is pi'_j = (1 - RESTART) * sum_i pi_i w_ij + RESTART / V: a
    scatter-add (``bincount`` with weights) of the [V, k] sparse rows, O(V * k)
    instead of the O(V^2) of a dense product. Every row puts at least
    RESTART / V on every token, so the step contracts L1 distances by at
    least (1 - RESTART) and the loop provably terminates; a well-mixing sparse
    part converges far faster (about 45 steps for 128256 tokens at alpha=0.1).

    It runs in numpy, single-threaded: each step is a few short passes, and
    torch's multi-threaded kernels stall on their barriers when the CPU is
    shared with other processes, which made construction several times slower.
    """
    vocab_size = ids.shape[0]
    flat_ids = ids.reshape(-1)
    mass = np.empty_like(probs)  # reused: allocating [V, k] per step costs as much as the step
    pi = np.full(vocab_size, 1.0 / vocab_size)
    max_iter = math.ceil(math.log(tol / 2) / math.log1p(-RESTART)) + 100
    for _ in range(max_iter):
        np.multiply(pi[:, None], probs, out=mass)
        nxt = np.bincount(flat_ids, weights=mass.reshape(-1), minlength=vocab_size)
        nxt *= 1.0 - RESTART
        nxt += RESTART / vocab_size
        nxt /= nxt.sum()  # the map preserves total mass; this only removes rounding drift
        if np.abs(nxt - pi).sum() < tol:
            return nxt
        pi = nxt
    raise RuntimeError("power iteration for the Markov stationary distribution did not converge")
