"""Hugging Face tokenizer folders with the chat templates of Llama 3 Instruct and Qwen 2.5 (their
tokenizer_config.json's `chat_template`, tools left out), on a small BPE trained here: what the chat data
tests render with, against transformers' `apply_chat_template`."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.corpus import corpus

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
QWEN = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if "
    "(message.role == "
    '"user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}{{- '
    "'<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# name -> (template, special tokens, bos, eos: the end-of-turn token, what an assistant turn ends with)
TEMPLATES = {
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|eot_id|>",
    ),
    "qwen": (QWEN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>\n"),
}


def chat_tokenizer(folder: Path, name: str) -> Path:
    """A tokenizer folder (tokenizer.json, tokenizer_config.json) with template `name`; the tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    template, specials, bos, eos, _ = TEMPLATES[name]
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(200, seed=5), trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "chat_template": template,
        "eos_token": eos,
        "bos_token": bos,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"
