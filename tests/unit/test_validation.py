"""Validation settings the config refuses (data.val_fraction / data.val_source, train.eval_every). The
validation loss on actors against the one-process reference: tests/ray/test_validation.py."""

from __future__ import annotations

import pytest

from raypar.core import data
from raypar.core.config.errors import ConfigError
from tests.support.runs import tiny


def test_validation_config_errors():
    with pytest.raises(ConfigError, match="train.eval_every: needs held-out data"):
        tiny("train.eval_every=2")
    with pytest.raises(ConfigError, match="data.val_fraction: must be in"):
        tiny("data.val_fraction=1.5")
    cfg = tiny("train.eval_every=1", "data.val_fraction=0.000001", "train.eval_batches=4")
    _, val = data.open_datasets(cfg.data, cfg.model)
    with pytest.raises(ConfigError, match="train.eval_batches: 4 batches of 8 need 32 validation samples"):
        data.check_eval(val, cfg.train.eval_batches, cfg.train.global_batch)
