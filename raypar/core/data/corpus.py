"""Where documents come from: text files (one document each) or a column of Parquet / JSON-lines tables
read through `pyarrow.dataset`, from local paths, globs or any `pyarrow.fs` URI (s3://, gs://, hdfs://).

Tables are read batch by batch (`Dataset.to_batches`), so memory holds one record batch, not the corpus.

    corpus = Corpus.open(["data/*.parquet"], column="text")   # ConfigError: nothing matches, no such column
    for texts in corpus.batches(): ...                       # lists of documents (str, or bytes for files)
    corpus.describe()                                        # what the dataset index records
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from raypar.core.config.errors import ConfigError

TABLE_FORMATS = {
    ".parquet": "parquet", ".pq": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json"
}
# Column types that hold documents (a column of nulls only holds none): a tokenizer reads strings.
_TEXT_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view, pa.types.is_null)
BATCH_ROWS = 1024  # documents per record batch read (and per tokenizer call)
TEXT_BATCH_BYTES = 8 * 2**20  # text files per tokenizer call, by size


def expand_globs(globs: list[str]) -> list[str]:
    """Files matching any glob (``**`` recursive, ``~`` expanded), absolute, deduplicated and sorted."""
    found = set()
    for pattern in globs:
        for path in glob.glob(os.path.expanduser(pattern), recursive=True):
            if os.path.isfile(path):
                found.add(os.path.abspath(path))
    return sorted(found)


def file_inside(directory: str | os.PathLike[str], name: object, where: str) -> Path:
    """`directory`/`name` for a file name read out of a file a user was handed (a prepared dataset's
    index, a Hugging Face weight index), refused unless it names a file inside `directory`: an absolute
    path or one climbing out with `..` would let such a file read anything this process can (and copy it
    into checkpoints and exports). Checked on the text, not through symlinks: a Hugging Face cache links
    its files out of the snapshot directory on purpose. ConfigError naming `where` (file and key)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: expected a file name, got {name!r}")
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm == "." or norm == ".." or norm.startswith(".." + os.sep):
        raise ConfigError(f"{where}: {name!r} is not inside {directory} (absolute, or leads out with '..')")
    return Path(directory) / norm


def table_format(source: str) -> str | None:
    """"parquet" or "json" for a table source (by extension), None for text."""
    return TABLE_FORMATS.get(Path(source.split("?")[0].rstrip("/")).suffix.lower())


def _decode(path: str, body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {err.start} is 0x{body[err.start]:02x}); convert it "
            "(iconv -t UTF-8) or prepare it byte-level (without --tokenizer)"
        ) from None


@dataclass
class Corpus:
    text_files: list[str]
    tables: list[Any]  # pyarrow.dataset.Dataset, one per table source
    sources: list[str]
    column: str

    @classmethod
    def open(cls, sources: list[str], column: str = "text") -> Corpus:
        import pyarrow.dataset as ds
        import pyarrow.fs as pafs

        text_globs, tables = [], []
        for source in sources:
            fmt = table_format(source)
            if fmt is None:
                text_globs.append(source)
                continue
            try:
                if "://" in source:
                    fs, path = pafs.FileSystem.from_uri(source)
                    table = ds.dataset(path, filesystem=fs, format=fmt)
                else:
                    files = expand_globs([source])
                    if not files:
                        raise ConfigError(f"{source}: matches no file")
                    table = ds.dataset(files, format=fmt)
            except (OSError, ValueError) as err:
                if isinstance(err, ConfigError):
                    raise
                raise ConfigError(f"{source}: cannot open as {fmt}: {err}") from None
            if column not in table.schema.names:
                names = ", ".join(table.schema.names) or "none"
                raise ConfigError(f"--column: {column!r} is not a column of {source} (columns: {names})")
            kind = table.schema.field(column).type
            if not any(is_kind(kind) for is_kind in _TEXT_TYPES):
                raise ConfigError(f"--column: {column!r} of {source} holds {kind}, not text (strings)")
            tables.append(table)
        files = expand_globs(text_globs) if text_globs else []
        if text_globs and not files:
            raise ConfigError(f"{', '.join(text_globs)}: matches no file")
        return cls(files, tables, list(sources), column)

    def batches(self, text: bool = False) -> Iterator[list[str | bytes]]:
        """Documents in a fixed order (text files sorted by path, then each table's rows), in batches.

        Text files come as their bytes, or with `text` (for a tokenizer that reads Unicode) decoded as
        UTF-8: a file that is not UTF-8 is refused, naming it and the first bad byte, rather than decoded
        with replacement characters that would silently become training data (ValueError)."""
        batch: list[str | bytes] = []
        size = 0
        for path in self.text_files:
            try:
                body = Path(path).read_bytes()
            except OSError as err:  # a ValueError: the input is bad, not the output directory
                raise ValueError(f"{path}: cannot read: {err.strerror or err}") from None
            batch.append(_decode(path, body) if text else body)
            size += len(body)
            if size >= TEXT_BATCH_BYTES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch
        for table in self.tables:
            try:
                for record_batch in table.to_batches(columns=[self.column], batch_size=BATCH_ROWS):
                    texts = [t for t in record_batch.column(0).to_pylist() if t]  # null or "" is no document
                    if texts:
                        yield texts
            except (OSError, pa.ArrowException) as err:  # a row that breaks the schema, a broken file
                raise ValueError(f"{', '.join(table.files)}: cannot read: {str(err)[:200]}") from None

    def describe(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "column": self.column if self.tables else None,
            "files": [{"path": p, "bytes": os.path.getsize(p)} for p in self.text_files]
            + [{"path": f} for t in self.tables for f in t.files],
        }
