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
    def __init__(self, vocab: int = 64, branching: int = 4, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.next = torch.stack([torch.randperm(vocab, generator=gen)[:branching] for _ in range(vocab)])
        self.probs = torch.softmax(torch.randn(vocab, branching, generator=gen) * 1.5, dim=-1)
        trans = torch.zeros(vocab, vocab, dtype=torch.float64)
        trans.scatter_(1, self.next, self.probs.double())
        pi = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
        for _ in range(2000):  # power iteration for the stationary distribution
            pi = pi @ trans
        row_entropy = -(self.probs.double() * self.probs.double().log()).sum(-1)
        self.entropy_floor = float((pi * row_entropy).sum())

    def batch(self, step: int, rank: int, batch_size: int, seq_len: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1_000_003 * step + 7919 * rank + 1)
        out = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
        out[:, 0] = torch.randint(0, self.vocab, (batch_size,), generator=gen)
        for t in range(seq_len):
            choice = torch.multinomial(self.probs[out[:, t]], 1, generator=gen).squeeze(1)
            out[:, t + 1] = self.next[out[:, t], choice]
        return out


class TokenFile:
    def __init__(self, path: str):
        if not os.path.exists(path):
            raise FileNotFoundError(f"--data {path!r}: no such file (plain text, or a .bin of uint16 tokens)")
        if path.endswith(".bin"):
            self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
            self.vocab = int(self.tokens.max()) + 1
        else:
            self.tokens = np.frombuffer(open(path, "rb").read(), dtype=np.uint8)
            self.vocab = 256
        if len(self.tokens) < 2:
            raise ValueError(f"--data {path!r}: needs at least 2 tokens")
        self.entropy_floor = None

    def batch(self, step: int, rank: int, batch_size: int, seq_len: int) -> torch.Tensor:
        n = len(self.tokens) - seq_len - 1
        if n <= 0:
            raise ValueError(f"data has {len(self.tokens)} tokens; seq_len={seq_len} needs more")
        gen = np.random.default_rng(1_000_003 * step + 7919 * rank + 1)
        starts = gen.integers(0, n, size=batch_size)
        return torch.from_numpy(np.stack([np.asarray(self.tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts]))
