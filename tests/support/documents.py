"""Packed documents of uneven lengths with target masks, as a dataset (raypar.core.data.documents' protocol):
what the fine-tuning equivalence tests train on.

Sample i (a pure function of (seed, i)) holds 1 to 4 documents whose lengths are drawn unevenly; in each,
the first third is a "prompt" that is not a target, and the last token is not one either (its next token
is the next document's). So microbatches, dp ranks and cp shards hold different numbers of target tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from raypar.core.model.attention_masks import IGNORE


class PackedDocuments:
    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, num_samples: int = 64):
        self.vocab_size, self.seq_len, self.seed, self.num_samples = vocab_size, seq_len, seed, num_samples

    def _rng(self, i: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64([self.seed, 7, i]))

    def documents(self, i: int) -> torch.Tensor:
        rng = self._rng(i)
        n_docs = int(rng.integers(1, 5))
        cuts = np.sort(rng.choice(np.arange(1, self.seq_len), n_docs - 1, replace=False))
        ids = np.zeros(self.seq_len, dtype=np.int64)
        for cut in cuts:
            ids[cut:] += 1
        return torch.from_numpy(ids)

    def unmasked(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i's tokens with every next token a target (the mask ignored)."""
        rng = np.random.Generator(np.random.PCG64([self.seed, 11, i]))
        window = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_len + 1))
        return window[:-1], window[1:]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.unmasked(i)
        docs = self.documents(i)
        targets = targets.clone()
        last = torch.ones_like(docs, dtype=torch.bool)
        last[:-1] = docs[1:] != docs[:-1]
        targets[last] = IGNORE
        for d in docs.unique():
            where = (docs == d).nonzero().flatten()
            targets[where[: len(where) // 3]] = IGNORE  # the prompt
        return inputs, targets


class Unmasked(PackedDocuments):
    """Negative control: the loss mask ignored (every next token a target)."""

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.unmasked(i)
