"""Sampling (the numerics contract): which samples a step trains on, whatever the layout.

``GlobalSampler`` maps a step to a fixed, ordered global batch of sample indices; a microbatch is a slice
of it addressed by its *global* microbatch index, so which samples a step sees does not depend on dp or on
the number of microbatches, and resuming needs only the step. Validation batches are taken in order.
"""

from __future__ import annotations

import numpy as np
import torch

from raypar.core.config.errors import ConfigError
from raypar.core.data.reading import Dataset


class GlobalSampler:
    """Step -> the ordered sample indices of its global batch; a pure function of (seed, step).

    Epoch e is a permutation of all samples drawn from PCG64([seed, e]), cut into
    num_samples // global_batch whole batches; the remainder of each epoch is dropped (a different
    remainder every epoch), so a batch never straddles two epochs and no sample repeats within one.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        if num_samples < global_batch:
            raise ConfigError(
                f"train.global_batch: {global_batch} exceeds the dataset's {num_samples} samples; "
                "use a smaller global batch or seq_len, or more data"
            )
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.batches_per_epoch = num_samples // global_batch
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)  # the last epoch's permutation, cached

    def batch_indices(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, pos = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._epoch, self._perm = epoch, rng.permutation(self.num_samples)
        return self._perm[pos * self.global_batch : (pos + 1) * self.global_batch].copy()


def replica_microbatch_ids(dp_rank: int, dp: int, global_batch: int, mb_size: int) -> range:
    """The global microbatch indices data-parallel replica `dp_rank` of `dp` processes in a step."""
    if global_batch % (dp * mb_size):
        raise ValueError(f"global_batch {global_batch} is not divisible by dp*mb_size = {dp}*{mb_size}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} out of range [0, {dp})")
    per_replica = global_batch // (dp * mb_size)
    return range(dp_rank * per_replica, (dp_rank + 1) * per_replica)


def microbatch(
    dataset: Dataset, sampler: GlobalSampler, step: int, mb_index: int, mb_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows mb_index*mb_size ... of step's global batch, as (inputs, targets) int64 of shape [mb_size, T]."""
    batch = sampler.global_batch
    if batch % mb_size or not 0 <= mb_index < batch // mb_size:
        raise ValueError(f"microbatch {mb_index} of size {mb_size} is not in a global batch of {batch}")
    rows = sampler.batch_indices(step)[mb_index * mb_size : (mb_index + 1) * mb_size]
    inputs, targets = zip(*(dataset.sample(int(i)) for i in rows), strict=True)
    return torch.stack(inputs), torch.stack(targets)


def check_eval(val: Dataset | None, eval_batches: int, global_batch: int) -> None:
    """ConfigError unless `val` holds `eval_batches` global batches."""
    if val is not None and val.num_samples < eval_batches * global_batch:
        raise ConfigError(
            f"train.eval_batches: {eval_batches} batches of {global_batch} need "
            f"{eval_batches * global_batch} validation samples, the held-out data has {val.num_samples}"
        )


def eval_microbatch(dataset: Dataset, batch: int, mb_index: int, mb_size: int, global_batch: int):
    """Microbatch `mb_index` of validation batch `batch`: samples in order (no shuffling), so every
    evaluation sees the same batches whatever the layout. Returns (inputs, targets) [mb_size, T]."""
    first = batch * global_batch + mb_index * mb_size
    inputs, targets = zip(*(dataset.sample(first + i) for i in range(mb_size)), strict=True)
    return torch.stack(inputs), torch.stack(targets)
