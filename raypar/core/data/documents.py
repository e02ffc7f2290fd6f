"""Packed documents and target masks in the data path (fine-tuning; `data.document_masking`).

A dataset with documents answers `sample(i)` with targets that are attention_masks.IGNORE where a token
is not trained on (a prompt, a turn that is not the assistant's, the last token of a document, whose next
token belongs to the next one), and `documents(i)`: each token's document id [T]. The trainer reads both
per microbatch from the global sampler on every stage, so the boundaries travel with the microbatch
without crossing the pipeline.

The loss of a step is the sum over its target tokens divided by the global batch's number of target tokens
(`target_tokens`), whatever the layout: each (microbatch, dp rank, cp rank) unit divides its sum by
`loss_share` = that count / (dp x cp x microbatches), and the executor's mean over microbatches and the
DP mean over dp x cp ranks turn the units' shares into the one sum over the one count. Every rank derives
the count from the sampler up front, so no collective is needed before the backward.
"""

from __future__ import annotations

from typing import Any

import torch

from raypar.core.model.attention_masks import IGNORE


def has_documents(dataset: Any) -> bool:
    return callable(getattr(dataset, "documents", None))


def masked(document_masking: bool | str, dataset: Any) -> bool:
    """Whether `dataset`'s documents attend only within themselves under `data.document_masking`: true
    (the CLI refused data without boundaries), or "auto" on data that records them."""
    return document_masking is True or (document_masking == "auto" and has_documents(dataset))


def microbatch_documents(
    dataset: Any, sampler: Any, step: int, mb_index: int, mb_size: int
) -> torch.Tensor | None:
    """Document ids [mb_size, T] of the rows `sampling.microbatch` returns for the same arguments, or None
    for a dataset without documents."""
    if not has_documents(dataset):
        return None
    rows = sampler.batch_indices(step)[mb_index * mb_size : (mb_index + 1) * mb_size]
    return torch.stack([dataset.documents(int(i)) for i in rows])


def target_tokens(dataset: Any, sampler: Any, step: int, seq_len: int) -> int:
    """The number of target tokens in step `step`'s global batch (every token without documents)."""
    rows = sampler.batch_indices(step)
    if not has_documents(dataset):
        return len(rows) * seq_len
    return sum(int((dataset.sample(int(i))[1] != IGNORE).sum()) for i in rows)


def loss_share(target_count: int, units: int) -> float:
    """What one of `units` (microbatches x dp x cp) loss units divides its target-token sum by."""
    return max(target_count, 1) / units


def eval_documents(
    dataset: Any, batch: int, mb_index: int, mb_size: int, global_batch: int
) -> torch.Tensor | None:
    """Document ids of `sampling.eval_microbatch`'s rows for the same arguments (None without documents)."""
    if not has_documents(dataset):
        return None
    first = batch * global_batch + mb_index * mb_size
    return torch.stack([dataset.documents(first + i) for i in range(mb_size)])


def eval_target_tokens(dataset: Any, batches: int, global_batch: int, seq_len: int) -> int:
    """Target tokens of the first `batches` validation batches (sampling.eval_microbatch's samples)."""
    if not has_documents(dataset):
        return batches * global_batch * seq_len
    return sum(int((dataset.sample(i)[1] != IGNORE).sum()) for i in range(batches * global_batch))
