"""`raypar prepare SOURCES --out DIR`: documents tokenized into a dataset the training reads.

Plain text streams into token shards (Arrow IPC, raypar.core.data.prepare; local or a pyarrow.fs URI).
Conversations, prompt/completion pairs and whole documents are packed into samples of --seq-len with loss
masks and document boundaries (raypar.core.data.chat, raypar.core.data.packed), every row checked before
anything is written. Bad input is a UsageError or ConfigError naming the flag: one line, exit 2 (cli.main).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from raypar.controller.usage import UsageError
from raypar.core.config.errors import ConfigError


def add_parser(sub: Any) -> None:
    """The `prepare` subcommand on the CLI's subparsers."""
    cmd = sub.add_parser("prepare", help="tokenize documents into token shards (Arrow IPC)")
    cmd.add_argument(
        "sources", nargs="+",
        help="text file globs (** allowed; one document per file), or .parquet / .jsonl files, globs or "
        "pyarrow.fs URIs (one document per row of --column)",
    )
    cmd.add_argument(
        "--out", required=True, help="output directory, or a pyarrow.fs URI (s3://bucket/path, gs://, hdfs://)"
    )
    cmd.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json (default: byte-level)")
    cmd.add_argument(  # appended, so that a second --column is refused rather than silently the one kept
        "--column", action="append", help="the text column of tables (default: text)"
    )
    cmd.add_argument("--eos", metavar="TOKEN", help="the token between documents (default: found)")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmd.add_argument(
        "--format", choices=("text", "chat", "prompt-completion"), default="text",
        help="text documents (default); chat: JSONL/Parquet rows of messages, rendered by the tokenizer's "
        "chat template, loss on assistant turns; prompt-completion: prompt/completion rows, loss on "
        "completions",
    )
    cmd.add_argument(
        "--pack", choices=("stream", "documents"), default="stream",
        help="stream: one token stream (default for text); documents: whole documents packed into samples of "
        "--seq-len with their boundaries kept, which data.document_masking masks by default (always so for "
        "chat formats)",
    )
    cmd.add_argument(
        "--seq-len", type=int, metavar="T", help="sample length of packed data (model.seq_len)"
    )
    cmd.add_argument(
        "--overflow", choices=("truncate", "drop"), default="truncate",
        help="a document longer than --seq-len: cut to it (default) or left out; counted either way",
    )


def run(args: argparse.Namespace) -> int:
    from raypar.core import data
    from raypar.core.data import remote
    from raypar.core.data.tokenizer import load

    if args.column and len(args.column) > 1:
        raise UsageError(
            f"--column: one text column per document, got {len(args.column)} ({', '.join(args.column)}); "
            "join the columns into one before preparing"
        )
    column = args.column[0] if args.column else "text"
    if args.format != "text" or args.pack == "documents":
        return _packed(args, column)
    if "://" not in args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out: {args.out} exists and is not a directory")
    if "://" in args.out:
        try:
            remote.check_storage(args.out)
        except ValueError as err:
            raise UsageError(f"--out: {err}") from None
    try:
        index = data.prepare(args.sources, args.out, tokenizer=load(args.tokenizer, args.eos),
                             column=column, progress=not args.no_progress)
    except FileExistsError as err:
        raise UsageError(f"--out: {err}") from None
    except ConfigError:  # already names its key (--tokenizer, --column, a source file)
        raise
    except ValueError as err:  # a source file that cannot be read
        raise UsageError(f"sources: {err}") from None
    except OSError as err:
        raise UsageError(f"--out: cannot write {args.out}: {err.strerror or err}") from None
    print(f"raypar: {index['total_tokens']:,} tokens ({index['vocab']}, vocab {index['vocab_size']:,}) from "
          f"{index['documents']:,} documents -> {args.out}")
    return 0


def _packed(args: argparse.Namespace, column: str) -> int:
    """Conversations, prompt/completion pairs or whole documents packed into samples with loss masks and
    document boundaries (raypar.core.data.chat, raypar.core.data.packed); every row is checked before
    anything is written."""
    import numpy as np

    from raypar.core.data import chat, packed
    from raypar.core.data.corpus import Corpus, expand_globs
    from raypar.core.data.tokenizer import load

    if args.seq_len is None or args.seq_len <= 1:
        raise UsageError(f"--seq-len: packing needs the model's sequence length (> 1), got {args.seq_len}")
    if "://" in args.out or (Path(args.out).exists() and not Path(args.out).is_dir()):
        raise UsageError(f"--out: packed data is written to a local directory, got {args.out}")
    tok = load(args.tokenizer, args.eos)
    if args.format == "text":
        eos = [] if tok.eos_id is None else [tok.eos_id]

        def texts() -> Any:
            for batch in Corpus.open(args.sources, column).batches(text=args.tokenizer is not None):
                for ids in tok.encode_batch(batch):
                    ids = np.concatenate([ids.astype(np.uint32), np.asarray(eos, dtype=np.uint32)])
                    yield ids, np.ones(len(ids), dtype=np.uint8)

        docs, files = texts(), list(args.sources)
    else:
        if args.tokenizer is None:
            raise UsageError(f"--tokenizer: --format {args.format} needs a Hugging Face tokenizer.json")
        files = expand_globs(args.sources)
        if not files:
            raise UsageError(f"sources: {' '.join(args.sources)} match no file")
        renderer = chat.ChatRenderer(args.tokenizer)
        docs = chat.documents(files, args.format, renderer)
    samples, counts = packed.pack(docs, args.seq_len, args.overflow, tok.eos_id or 0)
    try:
        template = renderer.record() if args.format == "chat" else None  # for raypar generate --chat
        packed.write(samples, counts, args.out, args.seq_len, tok, files, template)
    except FileExistsError as err:
        raise UsageError(f"--out: {err}") from None
    except ValueError as err:
        raise UsageError(f"sources: {err}") from None
    print(f"raypar: {counts['documents']:,} documents ({counts['truncated']:,} truncated, "
          f"{counts['dropped']:,} dropped by --overflow {args.overflow}) in {len(samples):,} samples of "
          f"{args.seq_len} tokens, "
          f"{counts['target_tokens']:,} target tokens -> {args.out}")
    return 0
