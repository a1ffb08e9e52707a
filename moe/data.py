"""Training data: a synthetic Markov source with a known entropy floor (default), or a real corpus.

* `MarkovSource(vocab, branching, seed)`: each token has `branching` possible successors with fixed
  random probabilities. The best possible next-token loss is the chain's conditional entropy
  H(X_t+1 | X_t) under its stationary distribution: `entropy_floor` (nats). A model that learns
  drives its loss toward it, which makes "the model learns" checkable.
* `TokenFile(path)`: plain text read as bytes (vocab 256) or a `.bin` of uint16 tokens (memory-mapped).

`batch(step, rank, batch_size, seq_len)` is a pure function of its arguments: every rank draws its
own data, and a resumed run sees exactly the batches it would have seen.
"""
from __future__ import annotations

import os

import numpy as np
import torch


class MarkovSource:
    """Cost: building is O(vocab x branching) (a 32k vocabulary takes well under a second) and a
    batch is one vectorised step per position for a chunk of `CHUNK_STEPS` steps at a time."""

    CHUNK_STEPS = 64  # steps whose sequences are drawn together (same result as one by one)

    def __init__(self, vocab: int = 64, branching: int = 4, seed: int = 0):
        if not 2 <= branching <= vocab:
            raise ValueError(f"MarkovSource: branching={branching} must be in [2, vocab={vocab}]")
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.next = _distinct_successors(rng, vocab, branching)  # [vocab, branching]
        logits = rng.standard_normal((vocab, branching)) * 1.5
        self.probs = np.exp(logits - logits.max(-1, keepdims=True))
        self.probs /= self.probs.sum(-1, keepdims=True)
        self._cum = np.cumsum(self.probs, -1)
        self._cum[:, -1] = 1.0
        pi = np.full(vocab, 1.0 / vocab)
        for _ in range(5000):  # power iteration for the stationary distribution, sparse
            nxt = np.bincount(self.next.ravel(), weights=(pi[:, None] * self.probs).ravel(), minlength=vocab)
            done = np.abs(nxt - pi).sum() < 1e-13
            pi = nxt
            if done:
                break
        row_entropy = -(self.probs * np.log(self.probs)).sum(-1)
        self.entropy_floor = float((pi * row_entropy).sum())
        self._cached = (None, None)

    def batch(self, step: int, rank: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64 tokens; a pure function of the arguments."""
        key = (step // self.CHUNK_STEPS, rank, batch_size, seq_len)
        if self._cached[0] != key:
            self._cached = (key, self._chunk(*key))
        first = (step % self.CHUNK_STEPS) * batch_size
        return torch.from_numpy(self._cached[1][first:first + batch_size].copy())

    def _chunk(self, chunk: int, rank: int, batch_size: int, seq_len: int) -> np.ndarray:
        rng = np.random.default_rng([chunk, rank, batch_size, seq_len])
        n = self.CHUNK_STEPS * batch_size
        out = np.empty((n, seq_len + 1), dtype=np.int64)
        out[:, 0] = cur = rng.integers(0, self.vocab, n)
        u = rng.random((seq_len, n))
        for t in range(seq_len):
            choice = (u[t][:, None] > self._cum[cur]).sum(-1)
            out[:, t + 1] = cur = self.next[cur, choice]
        return out


def _distinct_successors(rng, vocab: int, branching: int) -> np.ndarray:
    """[vocab, branching] successor ids, distinct within each row: draw, redraw rows with repeats."""
    out = rng.integers(0, vocab, (vocab, branching))
    while True:
        s = np.sort(out, axis=1)
        bad = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if not bad.any():
            return out
        out[bad] = rng.integers(0, vocab, (int(bad.sum()), branching))


class TokenFile:
    """`path`: plain text (bytes, vocab 256) or a `.bin` of uint16 tokens (memory-mapped). Errors name
    the example's --data flag and the file."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--data {path!r}: no such file (plain text, or a .bin of uint16 tokens)")
        self.path, size = path, os.path.getsize(path)
        if path.endswith(".bin"):
            if size % 2:
                raise ValueError(f"--data {path!r}: a .bin file holds uint16 tokens (2 bytes each), "
                                 f"but this one has an odd size ({size} bytes)")
            if size < 4:
                raise ValueError(f"--data {path!r}: needs at least 2 tokens, has {size // 2}")
            self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
            self.vocab = int(self.tokens.max()) + 1
        else:
            with open(path, "rb") as f:
                self.tokens = np.frombuffer(f.read(), dtype=np.uint8)
            self.vocab = 256
        if len(self.tokens) < 2:
            raise ValueError(f"--data {path!r}: needs at least 2 tokens, has {len(self.tokens)}")
        self.entropy_floor = None

    def check_seq_len(self, seq_len: int) -> None:
        """ValueError unless the file holds a window of seq_len + 1 tokens with a choice of start."""
        if len(self.tokens) < seq_len + 2:
            raise ValueError(f"--data {self.path!r}: {len(self.tokens)} tokens, but seq_len={seq_len} needs at least "
                             f"{seq_len + 2}")

    def batch(self, step: int, rank: int, batch_size: int, seq_len: int) -> torch.Tensor:
        self.check_seq_len(seq_len)
        n = len(self.tokens) - seq_len - 1
        gen = np.random.default_rng(1_000_003 * step + 7919 * rank + 1)
        starts = gen.integers(0, n, size=batch_size)
        return torch.from_numpy(np.stack([np.asarray(self.tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts]))
