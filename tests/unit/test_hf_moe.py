"""Hugging Face mixture-of-experts models in and out (raypar.core.model.moe_hf), against tiny random models
that transformers builds and saves here: Mixtral, and Qwen3-MoE (q/k norms, its own head_dim and expert
width, a dense block 0, norm_topk_prob), each test for both.

1. Logits from `model.init_from` at (1,1,1), at pp=2 x tp=2 and at dp=2 x ep=2 x tp=2 (each actor reading
   only its experts' slices, by global id) within 1e-5 of transformers' fp32 forward (tests/support/
   hf_models.py derives the bound: the same fp32 operations in nearly the same order; the experts'
   outputs are summed in expert order as HF's loop sums them; tp splits d_ff's sums into two halves).
2. One training step from the imported weights at dp=2 x ep=2 x tp=2 (SP), pp=2 x tp=2, dp=2 x ep=2 x
   cp=2 (Ulysses) and ZB-H1 pp=2 x cp=2 (ring) equals one process (tests/support/moe_threads.py, its 1e-5
   relative tolerance and derivation in tests/unit/test_moe_dropless.py; ring's online softmax adds a few
   rescalings per output, each a rounding of 2^-24 relative, over 2 blocks: still far under 1e-5; 1.4e-6
   the most measured in any layout here).
3. Under ZeRO 1, 2 and 3 at dp=4 x ep=2 (the experts' state sharded over their expert-dp group of 2, the
   dense state over 4), where raw `p.grad` is sharded or freed: the reduced gradients the ranks' owned
   pieces hold equal one process's (1e-5, as in 2), and each strategy's update is AdamW of those gradients
   bit for bit (`assert_zero_step` says why).
4. The step's parameters, written as a checkpoint in the ep ranks' shards and exported with
   `--format hf`, load with `from_pretrained` into logits within 1e-5 of raypar's, and raypar's greedy
   generation (`raypar generate`'s decoder on the checkpoint) gives transformers' greedy tokens.

Negative controls, each rejected by the same check on its message: the router not renormalised (1 and
generation), Qwen3-MoE's norm_topk_prob flipped in config.json (1), experts read by their local id at ep=2
(2), the experts' gradients averaged over their group and divided again, and the experts' update without
weight decay (3), the export's gate and up projections swapped (4).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from raypar.core import checkpoint, generate
from raypar.core.checkpoint import hf
from raypar.core.config.errors import ConfigError
from raypar.core.dp.optim import adamw_
from raypar.core.dp.strategy import DPStrategy
from raypar.core.model import families
from raypar.core.model.moe import MoELayer
from raypar.core.model.stage import Stage, StageSpec
from raypar.core.run_config import load_config
from tests.support.hf_models import IDS, cfg_for, hf_logits
from tests.support.hf_moe_models import EXPERTS, MAKERS, assert_logits, make_hf_mixtral
from tests.support.moe_threads import assert_matches, parallel, reduced_gradients, reference
from tests.support.threads import run_groups, run_ranks

TOL = 1e-5


class NotRenormalised(MoELayer):
    """The top-k router weights as they are: Switch's routing, not Mixtral's."""

    def gate_weights(self, top: torch.Tensor) -> torch.Tensor:
        return top


@pytest.fixture(scope="module", params=MAKERS)
def hf_moe(request, tmp_path_factory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("hf-moe") / request.param
    return path, MAKERS[request.param](path)


def loaded(path: Path, moe_class: type[MoELayer] = MoELayer, **stage) -> Stage:
    model = families.build_stage(cfg_for(path).model, init=False, **stage)
    hf.load_stage(model, str(path))
    for layer in model.moe_layers().values():
        layer.__class__ = moe_class
    return model.eval()


def test_config_fields(hf_moe):
    m = cfg_for(hf_moe[0]).model
    qwen = m.family == "qwen3_moe"
    assert m.family == hf_moe[0].name
    assert (m.moe_experts, m.moe_top_k, m.d_ff) == (EXPERTS, 2, 64)
    want = (2, 16, True, 16) if qwen else (1, 0, False, 8)
    assert (m.moe_every, m.moe_d_ff, m.qk_norm, m.head_dim) == want
    assert m.moe_renormalize and m.moe_capacity_factor == 0
    # a run may still train with a capacity (config.json implies dropless, it does not forbid it)
    assert cfg_for(hf_moe[0], "model.moe_capacity_factor=1.25").model.moe_capacity_factor == 1.25


def test_a_missing_expert_is_named_before_any_actor(hf_moe, tmp_path):
    """The last expert's down projection dropped from the files: config loading names that tensor."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "missing"
    shutil.copytree(hf_moe[0], path)
    cfg = cfg_for(hf_moe[0]).model
    last = f"layers.{cfg.n_layers - 1}.mlp.experts.{EXPERTS - 1}.w_down.weight"
    name = families.family(cfg).hf.hf_name(last)
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"model.init_from: .* has no tensor {re.escape(name)}$"):
        cfg_for(path)


@pytest.mark.parametrize("moe_class", [MoELayer, NotRenormalised])
def test_logits_match_hf(hf_moe, moe_class):
    path, model = hf_moe
    got = loaded(path, moe_class)(IDS).detach()
    if moe_class is MoELayer:
        assert_logits(got, hf_logits(model))
    else:
        with pytest.raises(AssertionError, match="logits differ by"):
            assert_logits(got, hf_logits(model))


def test_norm_topk_prob_flipped_is_rejected(hf_moe, tmp_path):
    """Qwen3-MoE's config.json flag is read: flipped, the same weights give other logits."""
    path, model = hf_moe
    if path.name != "qwen3_moe":
        pytest.skip("Mixtral always renormalises: config.json has no flag")
    flipped = tmp_path / "flipped"
    shutil.copytree(path, flipped)
    body = json.loads((flipped / "config.json").read_text())
    (flipped / "config.json").write_text(json.dumps({**body, "norm_topk_prob": not body["norm_topk_prob"]}))
    with pytest.raises(AssertionError, match="logits differ by"):
        assert_logits(loaded(flipped)(IDS).detach(), hf_logits(model))


def test_logits_at_pp2_tp2_match_hf(hf_moe):
    path, model = hf_moe

    def rank(group) -> torch.Tensor:
        first = loaded(path, stage=StageSpec((range(0, 1),), True, False), tp_group=group)
        last = loaded(path, stage=StageSpec((range(1, 2),), False, True), tp_group=group)
        with torch.no_grad():
            return last(first(IDS))

    assert_logits(torch.cat(run_ranks(2, rank), dim=-1), hf_logits(model))


def test_logits_at_dp2_ep2_tp2_match_hf(hf_moe):
    """Replica d holds sequence d and experts 2d, 2d+1 (on two tp ranks): its tokens go to the other
    replica's experts and back."""
    path, model = hf_moe
    groups = {"tp0": [0, 1], "tp1": [2, 3], "ep0": [0, 2], "ep1": [1, 3]}

    def rank(r: int, mine: dict) -> torch.Tensor:
        dp, tp = divmod(r, 2)
        stage = loaded(path, tp_group=mine[f"tp{dp}"], ep_group=mine[f"ep{tp}"])
        assert all(sorted(map(int, m.experts)) == [2 * dp, 2 * dp + 1] for m in stage.moe_layers().values())
        with torch.no_grad():
            return stage(IDS[dp : dp + 1])

    logits = run_groups(4, groups, rank)
    got = torch.cat([torch.cat(logits[2 * d : 2 * d + 2], dim=-1) for d in range(2)])
    assert_logits(got, hf_logits(model))


# -- training from the imported weights, on thread ranks ---------------------------------------------------
# Microbatches of one sequence in every layout: the aux loss is per microbatch, so one reference serves all.
LAYOUTS = {
    "dp2-ep2-tp2": ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                    "parallel.microbatches=2"],
    "pp2-tp2": ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=4"],
    "dp2-ep2-cp2-ulysses": ["parallel.dp=2", "parallel.ep=2", "parallel.cp=2", 'parallel.cp_style="ulysses"',
                            "parallel.microbatches=2"],
    "pp2-zbh1-cp2-ring": ["parallel.pp=2", 'parallel.schedule="zb-h1"', "parallel.cp=2",
                          "parallel.microbatches=4"],
}


def train_cfg(path: Path, layout: str):
    return cfg_for(path, *LAYOUTS[layout], "train.global_batch=4")


def import_weights(path: Path):
    return lambda model: hf.load_stage(model, str(path))


def import_by_local_id(path: Path):
    """Each rank's experts read by their index on the rank, not their global id: every ep rank holds
    experts 0 and 1's weights."""
    weights = hf.HFWeights(str(path))

    def load(model: Stage) -> None:
        hf_name = families.family(model.cfg).hf.hf_name
        hf.load_stage(model, str(path))
        with torch.no_grad():
            for i, layer in model.moe_layers().items():
                for name, param in layer.experts.named_parameters():
                    e, rest = name.split(".", 1)
                    local = f"layers.{i}.mlp.experts.{int(e) - layer.first_expert}.{rest}"
                    spec = model.shard_specs()[f"layers.{i}.mlp.experts.{name}"]
                    param.copy_(weights.read_slice(hf_name(local), *spec, tuple(param.shape)))

    return load


@pytest.fixture(scope="module")
def one_process(hf_moe) -> dict:
    path = hf_moe[0]
    return reference(train_cfg(path, "pp2-tp2"), import_weights(path))  # one layout-free reference


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_step_matches_one_process(hf_moe, one_process, layout):
    path = hf_moe[0]
    got = parallel(train_cfg(path, layout), prepare=import_weights(path))
    print(f"{layout}: max relative differences {assert_matches(got, one_process, TOL)}")


def test_experts_read_by_local_id_are_rejected(hf_moe, one_process):
    path = hf_moe[0]
    got = parallel(train_cfg(path, "dp2-ep2-tp2"), prepare=import_by_local_id(path))
    with pytest.raises(AssertionError, match=r"^loss [\d.]+ vs [\d.]+$"):
        assert_matches(got, one_process, TOL)


# -- ZeRO 1, 2 and 3 at dp=4 x ep=2: the experts' state shards over their expert-dp group of 2 -------------
ZERO_LAYOUT = ["parallel.dp=4", "parallel.ep=2", "parallel.microbatches=1", "train.global_batch=4"]
LR = 1e-2


class ExpertsAveragedTwice(DPStrategy):
    """Negative control: the dense rule on the experts: averaged over their expert-dp group (2 ranks), then
    divided by dp x cp as the expert rule divides the group's sum."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reduce_op = "avg"


class ExpertsNotDecayed(DPStrategy):
    """Negative control: the experts' update without AdamW's weight decay (their gradients stay right)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._decayed = []


def zero_step(path: Path, zero: int, **kwargs) -> dict:
    cfg = cfg_for(path, *ZERO_LAYOUT, f"parallel.zero={zero}")
    return parallel(cfg, prepare=import_weights(path), lr=LR, **kwargs)


def adamw_from(path: Path, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The imported parameters after one AdamW step on `grads` in one process (decay on matrices, as the
    strategies decay)."""
    cfg = cfg_for(path)
    params = {n: p.detach().clone() for n, p in loaded(path).named_parameters()}
    names = list(params)
    adamw_(
        [params[n] for n in names], [grads[n] for n in names],
        [torch.zeros_like(params[n]) for n in names], [torch.zeros_like(params[n]) for n in names],
        0, cfg.train, LR, [params[n] for n in names if params[n].dim() >= 2],
    )
    return params


def assert_zero_step(got: dict, path: Path, one_process: dict) -> None:
    """The reduced gradients the ranks' owned pieces hold (raw p.grad is sharded or freed under ZeRO >= 1)
    against one process, at the module's 1e-5 (four replicas' fp32 gradients summed in another order); then
    the parameters each rank's strategy updated, assembled, against AdamW of those same reduced gradients in
    one process, bit for bit: AdamW is elementwise (raypar.core.dp.optim.adamw_), so how the state is
    sharded changes none of its arithmetic."""
    reduced = reduced_gradients(got)
    assert any(".mlp.experts." in n for n in reduced)  # the check covers the experts
    assert_matches({**got, "grads": reduced}, one_process, TOL)
    want = adamw_from(path, reduced)
    for name, tensor in want.items():
        assert torch.equal(got["params"][name], tensor), f"parameter {name} differs after the update"


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_step_at_dp4_ep2_matches_one_process(hf_moe, one_process, zero):
    path = hf_moe[0]
    assert_zero_step(zero_step(path, zero), path, one_process)


@pytest.mark.parametrize("zero, control, message", [
    (2, ExpertsAveragedTwice, r"^gradient of layers\.\d+\.mlp\.experts\."),
    (3, ExpertsNotDecayed, r"^parameter layers\.\d+\.mlp\.experts\.\S+ differs after the update"),
], ids=["zero2-averaged-twice", "zero3-not-decayed"])
def test_zero_step_controls_are_rejected(hf_moe, one_process, zero, control, message):
    path = hf_moe[0]
    with pytest.raises(AssertionError, match=message):
        assert_zero_step(zero_step(path, zero, expert_control=control), path, one_process)


# -- export --format hf and generation ---------------------------------------------------------------------
def trained_checkpoint(path: Path, root: Path) -> tuple[str, Stage]:
    """One AdamW step at dp=2 x ep=2 x tp=2, its parameters written as the ranks write them: dense tensors
    by replica 0, each ep rank's experts in its own shard; and the stepped model in one process."""
    cfg = train_cfg(path, "dp2-ep2-tp2")
    params = parallel(cfg, prepare=import_weights(path), lr=1e-2)["params"]
    per_rank = cfg.model.moe_experts // 2
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in params.items():  # experts.<global id>: ep rank id // per_rank, replica of that rank
        ep_rank = int(name.split(".")[4]) // per_rank if ".experts." in name else None
        key = "dp0.pp0.tp0.0" if ep_rank is None else f"dp{ep_rank}.pp0.tp0.e0"
        shards.setdefault(key, {})[name] = tensor
    full = checkpoint.ShardSpec.full
    entries = {k: (t, {n: full(x.shape) for n, x in t.items()}) for k, t in shards.items()}
    step = checkpoint.save(str(root / "ckpt"), 1, entries, {"model": dataclasses.asdict(cfg.model)})
    model = families.build_stage(cfg.model, init=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return step, model.eval()


@pytest.fixture(scope="module")
def trained(hf_moe, tmp_path_factory) -> tuple[str, Stage]:
    return trained_checkpoint(hf_moe[0], tmp_path_factory.mktemp("trained"))


def from_pretrained(out: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def test_export_loads_in_transformers(trained, tmp_path):
    step, model = trained
    out = hf.export(step, str(tmp_path / "hf"))
    exported = from_pretrained(out)
    assert type(exported).__name__ == families.family(model.cfg).hf.fmt.architecture
    with torch.no_grad():
        assert_logits(exported(IDS).logits, model(IDS))


def test_export_with_gate_and_up_swapped_is_rejected(trained, tmp_path, monkeypatch):
    step, model = trained
    mapping = families.family(model.cfg).hf
    gate, up = mapping.fmt.projections["w_gate"], mapping.fmt.projections["w_up"]
    swapped = {**mapping.fmt.projections, "w_gate": up, "w_up": gate}
    monkeypatch.setattr(mapping, "fmt", dataclasses.replace(mapping.fmt, projections=swapped))
    exported = from_pretrained(hf.export(step, str(tmp_path / "hf")))
    with torch.no_grad(), pytest.raises(AssertionError, match="logits differ by"):
        assert_logits(exported(IDS).logits, model(IDS))


def greedy_tokens_equal(raypar: list[int], transformers: list[int]) -> None:
    assert raypar == transformers, f"greedy tokens differ: raypar {raypar}, transformers {transformers}"


@pytest.mark.parametrize("moe_class", [MoELayer, NotRenormalised])
def test_greedy_generation_matches_transformers(trained, tmp_path, moe_class):
    step, _ = trained
    exported = from_pretrained(hf.export(step, str(tmp_path / "hf")))
    prompt, n = IDS[0, :5].tolist(), 10
    with torch.no_grad():
        want = exported.generate(IDS[:1, :5], max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, 5:]
    model, _ = generate.load(step)
    for layer in model.moe_layers().values():
        layer.__class__ = moe_class
    got = generate.generate_ids(model, prompt, n)
    if moe_class is MoELayer:
        greedy_tokens_equal(got, want.tolist())
    else:
        with pytest.raises(AssertionError, match="greedy tokens differ"):
            greedy_tokens_equal(got, want.tolist())


# -- a windowed Mixtral (its attention is Mistral's: model.sliding_window) ----------------------------------
def test_windowed_mixtral_in_and_out(tmp_path):
    """A Mixtral with a 5-token window (16 tokens here) imports with model.sliding_window=5: transformers'
    logits (control: the window ignored is rejected by the same check); exported, its config.json has the
    window again and transformers' logits follow."""
    path = tmp_path / "mixtral"
    model = make_hf_mixtral(path, sliding_window=5)
    cfg = cfg_for(path).model
    assert cfg.sliding_window == 5
    stage = loaded(path)
    with torch.no_grad():
        assert_logits(stage(IDS), hf_logits(model))
        ignored = families.build_stage(dataclasses.replace(cfg, sliding_window=0), init=False)
        ignored.load_state_dict(stage.state_dict())
        with pytest.raises(AssertionError, match="logits differ by"):
            assert_logits(ignored.eval()(IDS), hf_logits(model))
    tensors = dict(stage.named_parameters())
    specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
    step = checkpoint.save(
        str(tmp_path / "ckpt"), 1, {"dp0.pp0.tp0": (tensors, specs)}, {"model": dataclasses.asdict(cfg)}
    )
    exported = from_pretrained(hf.export(step, str(tmp_path / "hf")))
    assert exported.config.sliding_window == 5
    assert_logits(hf_logits(exported), hf_logits(model))


# -- presets ------------------------------------------------------------------------------------------------
# Parameters of the published checkpoints (transformers' num_parameters() of Mixtral-8x7B-v0.1 and
# Qwen3-30B-A3B); tests/unit/test_families.py checks that the stage and transformers' model of the exported
# config.json count what the cost counts.
PUBLISHED = {"mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_presets_have_the_published_parameter_counts(preset):
    cfg = load_config(None, [f'model.preset="{preset}"']).model
    assert families.family(cfg).cost.count_params(cfg) == PUBLISHED[preset]
    assert cfg.moe_renormalize and cfg.moe_capacity_factor == 0  # their routing: renormalised, dropless
