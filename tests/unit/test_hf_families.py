"""The llama family's variants against transformers' own modelling code: Llama 3.x's RoPE scalings (llama3,
yarn), Qwen2 (q/k/v biases), Qwen3 dense (per-head q/k norms, a head_dim of its own), Mistral without a
sliding window and with one (5 tokens: shorter than the 16 trained on and the 26 generated; that
transformers applies it is the export check's control: its config.json's window set to null moves the
logits). For each, a tiny random
model built and saved by transformers (tests.support.hf_models.FAMILY_KINDS) is read with `model.init_from`:

- logits at (1,1,1) within LOGITS_ATOL of transformers' fp32 forward, and the loss of a training batch;
- one training step at pp=2 x tp=2, at cp=2 and at ZB-H1 pp=2 x tp=2 with SP (thread ranks on the core's
  executor) equal to one process (the window also at Ulysses cp=2);
- `--format hf` export -> `from_pretrained` gives transformers' logits again;
- `generate_ids`' greedy tokens equal transformers' greedy `generate`.

Tolerances: logits 1e-5 (tests/unit/test_hf.py: the same fp32 operations in nearly the same order; the
models are drawn with initializer_range 0.1, logits up to ~2, so fp32 rounding of ~1e-7 relative per
operation leaves them ~1e-6 apart, and a switched-off variant moves greedy tokens); layouts 1e-5 relative
(tests/support/pipeline_threads.py: fp32 sums in another order).
Each check has a negative control that the same check rejects, matched on its message: the variant's switch
turned off (RoPE scaling ignored, biases dropped, q/k norm skipped, the window ignored), at the layouts the
switch's own tp/cp plumbing broken (bias slices on the wrong tp rank, the q/k norm gradient not summed over
tp, cp's RoPE tables unscaled).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raypar.core import checkpoint, data
from raypar.core.checkpoint import hf
from raypar.core.config.errors import ConfigError
from raypar.core.config.schema import Config, ModelConfig
from raypar.core.generate import generate_ids
from raypar.core.model import families
from raypar.core.model.llama.rope import rope_tables
from tests.support.hf_models import FAMILY_KINDS, IDS, LOGITS_ATOL, cfg_for, hf_logits, make_hf_family_model
from tests.support.pipeline_threads import assert_step_matches, reference_step, run_step

# kind -> the ModelConfig switch that makes it what it is, turned off (the negative control)
SWITCH_OFF = {
    "llama3": {"rope_scaling": "none"},
    "yarn": {"rope_scaling": "none"},
    "qwen2": {"qkv_bias": False},
    "qwen3": {"qk_norm": False},
    "mistral": {"rope_theta": 10000.0},  # nothing to switch off: Llama's computation; a wrong theta instead
    "mistral-window": {"sliding_window": 0},
}
LAYOUTS = {
    "pp2-tp2": ("parallel.pp=2", "parallel.tp=2"),
    "cp2-ring": ("parallel.cp=2",),
    # zero-bubble's split backward (biases and q/k norms in B, the linears' weight GEMMs in W) under SP
    "zbh1-pp2-tp2-sp": ("parallel.pp=2", 'parallel.schedule="zb-h1"', "parallel.tp=2",
                        "parallel.sequence_parallel=true"),
}


@pytest.fixture(scope="module", params=list(FAMILY_KINDS))
def family_model(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    kind = request.param
    path = tmp_path_factory.mktemp("hf") / kind
    return kind, path, make_hf_family_model(path, kind)


def loaded(cfg: ModelConfig, path: Path) -> torch.nn.Module:
    stage = families.build_stage(cfg, init=False)
    hf.load_stage(stage, str(path))
    return stage


def assert_logits_match(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    assert err <= LOGITS_ATOL, f"logits differ from transformers' by {err:.3g}"


def test_config_is_the_variant(family_model):
    kind, path, _ = family_model
    m = cfg_for(path).model
    assert m.family == "llama"
    assert {k: getattr(m, k) for k in SWITCH_OFF[kind]} != SWITCH_OFF[kind]
    assert m.head_dim == (16 if kind == "qwen3" else 8)


def test_logits_and_loss_match_transformers(family_model):
    kind, path, model = family_model
    cfg = cfg_for(path)
    with torch.no_grad():
        assert_logits_match(loaded(cfg.model, path)(IDS), hf_logits(model))
    # The loss of the batch the layout tests train on, which they compare with this one process.
    dataset = data.open_dataset(cfg.data, cfg.model)
    sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
    inputs, targets = data.microbatch(dataset, sampler, 0, 0, cfg.train.global_batch)
    with torch.no_grad():
        want = F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item()
    assert abs(reference_step(cfg)[0] - want) <= 1e-5 * want
    # Negative control: the variant's switch off (scaling ignored, biases dropped, q/k norm skipped, the
    # window ignored).
    off = dataclasses.replace(cfg.model, **SWITCH_OFF[kind])
    with torch.no_grad(), pytest.raises(AssertionError, match="logits differ from transformers'"):
        assert_logits_match(loaded(off, path)(IDS), hf_logits(model))


_REFERENCES: dict[str, tuple] = {}


def reference(kind: str, cfg: Config) -> tuple:
    if kind not in _REFERENCES:
        _REFERENCES[kind] = reference_step(cfg)
    return _REFERENCES[kind]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_as_one_process(family_model, layout):
    kind, path, _ = family_model
    want = reference(kind, cfg_for(path))
    assert_step_matches(run_step(cfg_for(path, *LAYOUTS[layout], "parallel.microbatches=2")), want)


def test_window_trains_under_ulysses(family_model):
    """Mistral's window at Ulysses cp (the window mask over all tokens of a rank's heads) trains as one
    process; ring cp is in LAYOUTS."""
    kind, path, _ = family_model
    if kind != "mistral-window":
        pytest.skip("the window's own cp layout")
    layout = ("parallel.cp=2", 'parallel.cp_style="ulysses"', "parallel.microbatches=2")
    assert_step_matches(run_step(cfg_for(path, *layout)), reference(kind, cfg_for(path)))


def _bias_on_the_other_rank(model, coord, groups) -> None:
    """Each tp rank's q bias slice swapped with the other rank's (a bias split apart from its rows)."""
    with torch.no_grad():
        for block in model.layers.values():
            bias = block.attn.wq.bias
            bias.copy_(bias.roll(bias.shape[0] // 2))


def _qk_norm_gradient_not_summed(model, coord, groups) -> None:
    """The per-head norms' weight gradients left partial (each tp rank's heads only)."""
    for block in model.layers.values():
        block.attn.q_norm.group = block.attn.k_norm.group = None


def _cp_rope_unscaled(model, coord, groups) -> None:
    """cp ranks rotate by the unscaled frequencies (the scaling lost where positions are sharded)."""
    cos, sin = rope_tables(dataclasses.replace(model.cfg, rope_scaling="none"))
    model.rope_cos, model.rope_sin = cos, sin


# kind -> (layout, hook breaking the variant's own parallel plumbing there, the message the check fails with)
LAYOUT_CONTROLS = {
    "llama3": ("cp2-ring", _cp_rope_unscaled, "^loss"),
    "yarn": ("cp2-ring", _cp_rope_unscaled, "^loss"),
    "qwen2": ("pp2-tp2", _bias_on_the_other_rank, "^loss"),
    "qwen3": ("pp2-tp2", _qk_norm_gradient_not_summed, "^grad norm"),  # only the norms' gains move
}


def test_layout_control_is_rejected(family_model):
    kind, path, _ = family_model
    if kind not in LAYOUT_CONTROLS:
        pytest.skip(f"{kind} has no parallel plumbing of its own (test_executor_equivalence.py has Llama's)")
    layout, hook, message = LAYOUT_CONTROLS[kind]
    got = run_step(cfg_for(path, *LAYOUTS[layout], "parallel.microbatches=2"), model_hook=hook)
    with pytest.raises(AssertionError, match=message):
        assert_step_matches(got, reference(kind, cfg_for(path)))


def test_export_loads_in_transformers(family_model, tmp_path):
    """init_from -> a raypar checkpoint -> export --format hf -> from_pretrained: transformers' logits."""
    from transformers import AutoModelForCausalLM

    kind, path, model = family_model
    cfg = cfg_for(path).model
    stage = loaded(cfg, path)
    tensors = dict(stage.named_parameters())
    specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
    meta = {"model": dataclasses.asdict(cfg)}
    step = checkpoint.save(str(tmp_path / "ckpt"), 1, {"dp0.pp0.tp0": (tensors, specs)}, meta)
    out = Path(hf.export(step, str(tmp_path / "hf")))
    exported = AutoModelForCausalLM.from_pretrained(out).float().eval()
    # Mistral without a window is exported as the Llama it computes
    assert type(exported).__name__ == ("LlamaForCausalLM" if kind == "mistral" else type(model).__name__)
    assert_logits_match(hf_logits(exported), hf_logits(model))
    # Negative control: the exported config.json without the variant's field (no RoPE scaling; Qwen's
    # biases and q/k norms not loaded by Llama's model; Mistral's window dropped).
    body = json.loads((out / "config.json").read_text())
    if kind == "mistral-window":
        assert body["sliding_window"] == 5
        body["sliding_window"] = None
    elif kind in ("llama3", "yarn"):
        body["rope_parameters"] = {"rope_type": "default", "rope_theta": body["rope_theta"]}
    elif kind == "mistral":
        body["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        body |= {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (out / "config.json").write_text(json.dumps(body))
    wrong = AutoModelForCausalLM.from_pretrained(out).float().eval()
    with pytest.raises(AssertionError, match="logits differ from transformers'"):
        assert_logits_match(hf_logits(wrong), hf_logits(model))


@pytest.mark.parametrize(("model_type", "window", "message"), [
    ("llama", 4096, r"sliding_window=4096 is not supported \(Llama's attention is full causal"),
    ("mistral", 0, r"sliding_window=0 is not supported \(a positive integer or null\)"),
    ("mistral", True, r"sliding_window=True is not supported \(a positive integer or null\)"),
])
def test_window_hf_cannot_compute_refused(untied, tmp_path, model_type, window, message):
    """A window on a Llama (whose attention ignores it) or one that is no window is refused, naming it."""
    windowed = tmp_path / "windowed"
    shutil.copytree(untied[0], windowed)
    body = json.loads((windowed / "config.json").read_text())
    body |= {"model_type": model_type, "sliding_window": window}
    (windowed / "config.json").write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=r"config.json: " + message):
        cfg_for(windowed)


def assert_same_tokens(got: list[int], want: list[int]) -> None:
    assert got == want, f"greedy tokens differ: {got} vs transformers' {want}"


def test_greedy_generate_matches_transformers(family_model):
    kind, path, model = family_model
    cfg, prompt, new = cfg_for(path).model, IDS[0, :6].tolist(), 20  # 26 positions: past seq_len 16
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt) :]
    assert_same_tokens(generate_ids(loaded(cfg, path).eval(), prompt, new), want.tolist())
    off = dataclasses.replace(cfg, **SWITCH_OFF[kind])
    with pytest.raises(AssertionError, match="greedy tokens differ"):
        assert_same_tokens(generate_ids(loaded(off, path).eval(), prompt, new), want.tolist())
