"""A Hugging Face Mixtral through Ray actors end to end: `model.init_from` at dp=2 x ep=2 (each worker
reads only its experts' slices by global id), two training steps, the run's own checkpoint (experts in
their ep ranks' shards), `--format hf` export, `from_pretrained`: transformers' logits are raypar's of the
trained checkpoint (the thread-rank checks of each step: tests/unit/test_hf_moe.py). The one Ray case of
the MoE families; Qwen3-MoE goes through the same worker code."""

from __future__ import annotations

import torch

from raypar.core import checkpoint
from raypar.core.checkpoint import hf
from raypar.core.model import families
from tests.support.hf_models import IDS, cfg_for, hf_logits
from tests.support.hf_moe_models import assert_logits, make_hf_mixtral
from tests.support.runs import run


def test_mixtral_imported_at_ep2_trains_and_exports(ray_session, tmp_path):
    from transformers import AutoModelForCausalLM

    original = make_hf_mixtral(tmp_path / "mixtral")
    cfg = cfg_for(
        tmp_path / "mixtral", "parallel.dp=2", "parallel.ep=2", "train.steps=2", "train.global_batch=4",
        "checkpoint.every=2", f'checkpoint.dir="{tmp_path / "ckpt"}"',
    )
    run(cfg, "hf-moe-ep2", tmp_path / "run")
    ckpt = checkpoint.resolve(str(tmp_path / "ckpt"))
    exported = AutoModelForCausalLM.from_pretrained(hf.export(ckpt, str(tmp_path / "exported"))).eval()
    trained = families.build_stage(cfg.model, init=False)
    reader = checkpoint.CheckpointReader(ckpt)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            p.copy_(reader.read_full(name))
        mine = trained(IDS)
    assert_logits(hf_logits(exported), mine)
    assert (hf_logits(original) - mine).abs().max().item() > 1e-3  # negative control: it did train
