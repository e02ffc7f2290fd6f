"""Conversations and prompt/completion pairs into tokens and a loss mask (`raypar prepare --format chat`,
`--format prompt-completion`).

Rows come from JSON-lines or Parquet files: `messages` (OpenAI style: a list of {role, content} with an
optional boolean `train`), or `prompt` and `completion` strings. A conversation is rendered by the
tokenizer's own chat template (`chat_template` in the tokenizer_config.json beside its tokenizer.json)
through transformers' `apply_chat_template`, so the tokens are the ones transformers gives. The loss mask
is 1 on the tokens of each assistant turn (unless `train` is false): the text an assistant turn adds is
what rendering the conversation up to that turn adds to rendering it up to the turn before with the
generation prompt, which needs a template whose history renders the same as it grows (prefix-stable; a
template that rewrites earlier turns is refused with its name). Prompt/completion pairs are the prompt's
tokens then the completion's with the EOS token, the mask 1 on the completion and EOS.

A row that is not a conversation is a ConfigError naming file, row and field (exit 2 at the CLI).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from raypar.core.config.errors import ConfigError

CHAT, PROMPT_COMPLETION = "chat", "prompt-completion"
ROLES = ("system", "user", "assistant", "tool")
Document = tuple[np.ndarray, np.ndarray]  # token ids (uint32), loss mask (uint8)


def read_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row number from 1, row) of a .jsonl / .json-lines or .parquet file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a broken file
            raise ConfigError(f"{path}: not a readable Parquet file ({str(err)[:100]})") from None
        yield from enumerate(table.to_pylist(), start=1)
        return
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    raise ConfigError(f"{path}: row {number}: not JSON (one object per line)") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}), so not JSON lines") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None


def check_messages(row: Any, where: str) -> list[dict[str, Any]]:
    """The row's messages, or a ConfigError naming `where` (file: row N) and the field."""
    if not isinstance(row, dict) or "messages" not in row:
        raise ConfigError(f"{where}: field 'messages': missing (a chat row is an object with messages)")
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: field 'messages': must be a non-empty list of messages")
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: field '{field}': must be an object with role and content")
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise ConfigError(f"{where}: field '{field}.role': must be a string, one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: field '{field}.content': must be a string")
        if not isinstance(m.get("train", True), bool):
            raise ConfigError(f"{where}: field '{field}.train': must be true or false")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: field 'messages': no assistant turn (nothing to learn)")
    return [
        {"role": m["role"], "content": m["content"]} | ({"train": m["train"]} if "train" in m else {})
        for m in messages
    ]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("--format chat, --chat: need transformers (pip install 'raypar[chat]')") from None
    return transformers


class ChatRenderer:
    """The chat template of the tokenizer at `tokenizer_path` (a tokenizer.json with its
    tokenizer_config.json beside it), through transformers; or (`from_record`) the one a prepared
    directory, and so a checkpoint, recorded (`record`)."""

    def __init__(self, tokenizer_path: str | None = None, tok: Any = None):
        if tok is not None:
            self.tok = tok
            return
        AutoTokenizer = _transformers().AutoTokenizer  # noqa: N806 - the library's class
        folder = Path(str(tokenizer_path)).parent
        if not (folder / "tokenizer_config.json").is_file():
            raise ConfigError(f"--tokenizer: no tokenizer_config.json beside {tokenizer_path}")
        try:
            self.tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as err:  # noqa: BLE001 - transformers raises many types for a broken folder
            why = str(err)[:120]
            raise ConfigError(f"--tokenizer: {folder} is not a Hugging Face tokenizer: {why}") from None
        if not getattr(self.tok, "chat_template", None):
            raise ConfigError(f"--tokenizer: {folder}/tokenizer_config.json has no chat_template")

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ChatRenderer:
        from tokenizers import Tokenizer

        fast = _transformers().PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(record["json"]), chat_template=record["chat_template"],
            bos_token=record.get("bos_token"), eos_token=record.get("eos_token"),
        )
        return cls(tok=fast)

    def record(self) -> dict[str, Any]:
        """What `from_record` needs besides the tokenizer JSON: into the prepared index, then checkpoints."""
        return {"chat_template": self.tok.chat_template, "bos_token": self.tok.bos_token,
                "eos_token": self.tok.eos_token}

    @property
    def end_of_turn(self) -> int:
        """The template's EOS token (an instruct model's end of turn: <|eot_id|>, <|im_end|>)."""
        return int(self.tok.eos_token_id)

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of `messages` followed by the generation prompt (what the model answers)."""
        text = self.text(messages, "--prompt", generation_prompt=True)
        return list(self.tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, messages: list[dict[str, Any]], where: str, generation_prompt: bool = False) -> str:
        try:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as err:  # noqa: BLE001 - a template raises whatever its author wrote
            why = str(err)[:120]
            raise ConfigError(f"{where}: field 'messages': the chat template raised: {why}") from None

    def render(self, messages: list[dict[str, Any]], where: str) -> Document:
        """Token ids and loss mask of one conversation."""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        text = self.text(plain, where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or not m.get("train", True):
                continue
            before = self.text(plain[:i], where, generation_prompt=True) if i else ""
            upto = self.text(plain[: i + 1], where)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ConfigError(
                    f"{where}: field 'messages[{i}]': the chat template is not prefix-stable (it renders "
                    "earlier turns differently as the conversation grows): assistant tokens cannot be found"
                )
            spans.append((len(before), len(upto)))
        encoded = self.tok.backend_tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoded.ids, dtype=np.uint32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for t, (start, _) in enumerate(encoded.offsets):
            mask[t] = any(a <= start < b for a, b in spans)
        return ids, mask

    def prompt_completion(self, row: Any, where: str) -> Document:
        for field in ("prompt", "completion"):
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ConfigError(f"{where}: field '{field}': missing or not a string")
        encode = self.tok.backend_tokenizer.encode
        prompt = encode(row["prompt"], add_special_tokens=False).ids
        completion = encode(row["completion"], add_special_tokens=False).ids + [self.tok.eos_token_id]
        ids = np.asarray(prompt + completion, dtype=np.uint32)
        return ids, np.r_[np.zeros(len(prompt)), np.ones(len(completion))].astype(np.uint8)


def documents(files: list[str], fmt: str, renderer: ChatRenderer) -> Iterator[Document]:
    """Every row of `files` rendered (all rows are checked before the caller writes anything)."""
    for path in files:
        for number, row in read_rows(path):
            where = f"{path}: row {number}"
            if fmt == CHAT:
                yield renderer.render(check_messages(row, where), where)
            else:
                yield renderer.prompt_completion(row, where)
