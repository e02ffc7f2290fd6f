"""The demo's training text and tokenizer (`make demo`): the prose of Python's reference manual.

Every CPython ships its language reference's topics as plain English text (`pydoc_data.topics`, what
`help("for")` shows; 0.46 MB, PSF licence): on every machine, nothing to download. Each topic's prose
paragraphs (0.21 MB; its code examples, grammar rules and tables left out, which 120 steps would only
learn as punctuation) become one document. A byte-level BPE tokenizer (the `tokenizers` library, a raypar
dependency) is trained on them, so that a small model learns words rather than letters: at the same loss,
BPE tokens read as words where bytes read as letter soup.

    python examples/data/make_demo_corpus.py data/demo   # then:
    raypar prepare 'data/demo/docs/*.txt' --tokenizer data/demo/tokenizer.json --out data/demo/prepared
"""

from __future__ import annotations

import sys
from pathlib import Path
from pydoc_data.topics import topics

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Big enough that the manual's common words are one token each, small enough that the demo's 120 steps
# see every row of the embedding and head many times (~50K tokens a pass, ~5 passes).
VOCAB_SIZE = 2048
EOS = "<|endoftext|>"  # one of raypar.core.data.tokenizer.EOS_CANDIDATES: `raypar prepare` finds it


MIN_WORDS = 8  # a shorter "paragraph" is a heading or a caption


def prose(text: str) -> str:
    """The paragraphs of a topic, each on one line: indented lines (code, grammar), table rows and heading
    underlines end a paragraph and are left out."""
    paragraphs: list[str] = []
    lines: list[str] = []
    for line in [*text.splitlines(), ""]:
        words = line.strip()
        if words and not line.startswith(" ") and "|" not in words and set(words) - set("*=-~^"):
            lines.append(words)
            continue
        if len(" ".join(lines).split()) >= MIN_WORDS:
            paragraphs.append(" ".join(lines))
        lines = []
    return "\n\n".join(paragraphs)


def write_docs(out: Path) -> list[Path]:
    """One text file per topic with prose, in name order (so the held-out tail is the same everywhere)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in sorted(topics):
        text = prose(topics[name])
        if text:
            paths.append(out / f"{name}.txt")
            paths[-1].write_text(text + "\n", encoding="utf-8")
    return paths


def train_tokenizer(docs: list[Path], path: Path) -> None:
    """GPT-2's recipe (byte-level pre-tokenizer and decoder, so any text encodes) at VOCAB_SIZE."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in docs], trainer)
    tok.save(str(path))


def main(out: str) -> None:
    root = Path(out)
    docs = write_docs(root / "docs")
    train_tokenizer(docs, root / "tokenizer.json")
    print(f"wrote {len(docs)} topics of Python's reference manual to {root}/docs and {root}/tokenizer.json")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_demo_corpus.py OUT_DIR")
    main(sys.argv[1])
