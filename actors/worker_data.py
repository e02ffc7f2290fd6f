"""What one replica reads of the data: its microbatches of a step, their document ids, the step's target
tokens, and its share of the fixed validation batches.

`ReplicaData` is the part of an `actors.worker.Worker` (`Worker.data`) that reads locally from the global
seeded sampler (raypar.core.data), so that no data passes through the driver. Only the first and last
stages read (inputs, targets); a middle stage's has no dataset and reads nothing. The worker hands it the
config and device (`set_up`) and the replica's place among the replicas (`bind`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raypar.core import data
from raypar.core.config.schema import Config
from raypar.core.data import documents

Batch = tuple[torch.Tensor, torch.Tensor]


class ReplicaData:
    """This replica's data, for a stage that reads it (`reads`: the first or the last)."""

    def __init__(self, cfg: Config, device: torch.device, reads: bool):
        self.cfg, self.device = cfg, device
        self.dataset = self.val_dataset = None
        if reads:
            self.dataset, self.val_dataset = data.open_datasets(cfg.data, cfg.model)
        if self.dataset is not None:
            train = cfg.train
            self.sampler = data.GlobalSampler(self.dataset.num_samples, train.global_batch, train.seed)
        self.dp, self.dp_rank, self.microbatches = 1, 0, 1

    def bind(self, dp: int, dp_rank: int, microbatches: int) -> None:
        """The replicas, this one's dp rank, and the microbatches each reads per step."""
        self.dp, self.dp_rank, self.microbatches = dp, dp_rank, microbatches

    @property
    def first_mb(self) -> int:
        """This replica's first global microbatch of a step."""
        return self.dp_rank * self.microbatches

    def batch(self, step: int, mb: int) -> Batch:
        """Inputs and targets of this replica's microbatch `mb` of `step`, on the device."""
        inputs, targets = data.microbatch(
            self.dataset, self.sampler, step, self.first_mb + mb, self.cfg.microbatch_size
        )
        return inputs.to(self.device), targets.to(self.device)

    def documents(self, step: int, mb: int) -> torch.Tensor | None:
        """The microbatch's document ids under data.document_masking (raypar.core.data.documents)."""
        if not documents.masked(self.cfg.data.document_masking, self.dataset):
            return None
        mbs = self.cfg.microbatch_size
        ids = documents.microbatch_documents(self.dataset, self.sampler, step, self.first_mb + mb, mbs)
        return None if ids is None else ids.to(self.device)

    def target_tokens(self, step: int) -> int:
        """The step's target tokens over the global batch; 0 on a stage that reads no data (the driver takes
        the max over actors)."""
        if self.dataset is None:
            return 0
        return documents.target_tokens(self.dataset, self.sampler, step, self.cfg.model.seq_len)

    def loss_share(self, target_tokens: int) -> float:
        """What each microbatch's summed loss is divided by: the loss per target token of the global batch, at
        any layout (raypar.core.data.documents)."""
        return documents.loss_share(target_tokens, self.microbatches * self.dp * self.cfg.parallel.cp)

    def eval_units(self) -> tuple[int, Callable[[int], Batch], Callable[[int], torch.Tensor | None], float]:
        """This replica's microbatches of each fixed validation batch, as one forward-only pass: their count,
        each one's batch and document ids, and the loss share (per target token over all validation batches,
        as training's; under cp each rank's loss is its equal share's)."""
        cfg, mbs, batch_size = self.cfg, self.cfg.microbatch_size, self.cfg.train.global_batch
        mine = data.replica_microbatch_ids(self.dp_rank, self.dp, batch_size, mbs)
        units = [(batch, mb) for batch in range(cfg.train.eval_batches) for mb in mine]

        def batch(unit: int) -> Batch:
            inputs, targets = data.eval_microbatch(self.val_dataset, *units[unit], mbs, batch_size)
            return inputs.to(self.device), targets.to(self.device)

        def doc_ids(unit: int) -> torch.Tensor | None:
            if not documents.masked(cfg.data.document_masking, self.val_dataset):
                return None
            ids = documents.eval_documents(self.val_dataset, *units[unit], mbs, batch_size)
            return None if ids is None else ids.to(self.device)

        count = documents.eval_target_tokens(
            self.val_dataset, cfg.train.eval_batches, batch_size, cfg.model.seq_len
        )
        share = documents.loss_share(count, len(units) * self.dp * cfg.parallel.cp)
        return len(units), batch, doc_ids, share
