"""Deterministic, learnable synthetic token corpus.

Why: demos and benchmarks need a data stream that (a) a small LM visibly learns, so a
loss curve shows training is real and a resumed run can be compared against an
uninterrupted one, and (b) is addressable by position, so resuming from a checkpoint
only needs the step number: :meth:`SyntheticTokens.batch` is a pure function of
``(seed, step)`` -- no iterator state to save, identical across processes and restarts.

The corpus is a fixed sparse random Markov chain: every token has ``branching``
possible successors with fixed, skewed probabilities. A model first learns the
unigram frequencies, then the bigram table, so the loss falls from ``ln(vocab_size)``
towards :meth:`SyntheticTokens.entropy_rate`. Generation is plain numpy, vectorised
over the batch (one cheap step per position), far cheaper than a train step.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

# SeedSequence tags separating the chain's definition from per-step batch streams.
_CHAIN_TAG, _BATCH_TAG = 0, 1


class SyntheticTokens:
    """Batches of ``int32`` token sequences ``[batch_size, seq_len + 1]`` from a fixed
    random Markov chain determined by ``seed``.

    ``batch(step)["tokens"][:, :-1]`` are the model inputs and ``[:, 1:]`` the targets.
    ``branching`` is the number of successors per token: smaller means a lower loss
    floor and faster visible learning. Construction is O(vocab_size * branching).
    """

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0,
                 branching: int = 4) -> None:
        if vocab_size < 2 or seq_len < 1 or batch_size < 1:
            raise ValueError("need vocab_size >= 2, seq_len >= 1, batch_size >= 1")
        if seed < 0:
            raise ValueError("seed must be non-negative")
        self.vocab_size, self.seq_len, self.batch_size = int(vocab_size), int(seq_len), int(batch_size)
        self.seed = int(seed)
        self.branching = int(min(branching, vocab_size))

        rng = np.random.default_rng([self.seed, _CHAIN_TAG])
        k = self.branching
        # Successor table [V, k]. Duplicates within a row are allowed (they just merge
        # probability mass); entropy_rate accounts for them.
        self._successors = rng.integers(0, self.vocab_size, size=(self.vocab_size, k), dtype=np.int32)
        # Skewed transition probabilities, one profile shared by all tokens (which
        # successor gets which weight is already random), so the successor *choices*
        # of a batch can be drawn vectorised up front and only the table lookup is
        # sequential.
        weights = 0.5 ** np.arange(k) + 0.05
        self._probs = weights / weights.sum()
        self._cdf = np.cumsum(self._probs)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The batch at training position ``step`` (>= 0): ``{"tokens": int32 [B, T+1]}``.

        Pure in ``(seed, step)``: any instance with the same constructor arguments
        returns bit-identical arrays for the same step, in any process."""
        if step < 0:
            raise ValueError("step must be non-negative")
        rng = np.random.default_rng([self.seed, _BATCH_TAG, int(step)])
        b, t = self.batch_size, self.seq_len + 1
        u = rng.random((t - 1, b))
        choice = np.minimum(np.searchsorted(self._cdf, u, side="right"), self.branching - 1)
        seq = np.empty((t, b), dtype=np.int32)  # time-major: each step writes a contiguous row
        seq[0] = rng.integers(0, self.vocab_size, size=b, dtype=np.int32)
        succ = self._successors
        for i in range(1, t):
            seq[i] = succ[seq[i - 1], choice[i - 1]]
        tokens = np.ascontiguousarray(seq.T)
        return {"tokens": tokens}

    def iterate(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Endless stream of batches starting at ``start_step`` (resume = pass the
        checkpointed step)."""
        step = start_step
        while True:
            yield self.batch(step)
            step += 1

    def entropy_rate(self, iters: int = 500) -> float:
        """Per-token entropy (nats) of the chain under its stationary distribution:
        roughly the loss floor of a perfect bigram model (approximate: batches start
        from a uniform token, and the stationary distribution comes from a lazy power
        iteration)."""
        v = self.vocab_size
        # Merge duplicate successors of a row so the per-state entropy is exact.
        flat = (np.arange(v, dtype=np.int64)[:, None] * v + self._successors).ravel()
        uniq, inverse = np.unique(flat, return_inverse=True)
        p = np.bincount(inverse.ravel(), weights=np.broadcast_to(self._probs, (v, self.branching)).ravel())
        row_entropy = np.bincount(uniq // v, weights=-p * np.log(p), minlength=v)
        pi = np.full(v, 1.0 / v)
        for _ in range(iters):  # lazy chain: same fixed point, converges even if periodic
            pi = 0.5 * pi + 0.5 * np.bincount(
                self._successors.ravel(), weights=(pi[:, None] * self._probs[None, :]).ravel(), minlength=v)
        return float((pi * row_entropy).sum())
