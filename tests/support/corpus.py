"""A small code-like corpus and a byte-level BPE tokenizer trained on it, for the data tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = "def return class import lambda yield async await while for if else elif try except".split()


def corpus(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) + f" # doc {seed}-{i}" for i in range(n)
    ]


def train_bpe(path: Path, texts: list[str], vocab: int = 301) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path
