"""DeepSeek-style MoE (raypar.core.model.moe, raypar.core.model.moe_balance) on thread ranks, no Ray.

1. Dropless routing (capacity factor 0) with a shared expert and a non-zero routing bias, at dp=2 x ep=2
   (1F1B and ZB-H1) and dp=2 x ep=2 x tp=2 (with SP), against one process holding every expert
   (tests/support/moe_threads.py): the loss, every gradient (tp shards assembled), the grad norm, the aux
   loss, the expert load exactly and nothing dropped. Tolerance 1e-5 relative, as
   tests/unit/test_moe_sequence_parallel.py: only the order of fp32 sums differs (dp/ep reductions of a
   few terms, tp's split of d_ff), each a few ulps (2^-24 ~ 6e-8) of a sum over <= 256 terms, well under
   1e-5; a routing or mapping error moves gradients by O(1).
2. The grouped GEMM against one matmul chain per expert (tests.support.moe_threads.LoopedExperts), one
   process: the same dot products in another kernel's order. Each output chains a dot product over d_model
   = 64 terms and one over d_ff = 128; fp32 summation in any order is within n * 2^-24 of the sum of the
   terms' magnitudes (Higham, 3.1), 192 * 6e-8 ~ 1.1e-5 in the worst case, and ~sqrt(n) * 2^-24 ~ 1e-6
   with random-signed roundings (Higham and Mary 2019): 1e-5 of each tensor's largest magnitude holds on
   any CPU's kernel order, and a wrong expert moves outputs by their own size.
3. Aux-loss-free balancing on a skewed synthetic stream at dp=2: the load spread (max / mean - 1) shrinks
   and the bias is bitwise equal on both replicas.

Negative controls: the grouped GEMM fed the wrong expert's offsets (rows of expert j through expert j+1)
fails check 1 on the loss and check 2 on the output; under ZB-H1, experts whose weight GEMMs zero-bubble
counts as deferred (they are not: the grouped GEMM computes them in B) get no gradient; a bias updated
from each replica's own loads (not all-reduced) leaves the replicas' biases different; an update with the
sign flipped does not shrink the spread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from raypar.core import checkpoint, generate
from raypar.core.checkpoint import hf
from raypar.core.config.schema import Config
from raypar.core.model.llama import LlamaStage
from raypar.core.model.moe import MoELayer
from raypar.core.model.moe_balance import apply_bias_updates, bias_updates, load_spread
from raypar.core.model.moe_experts import grouped_partial
from raypar.core.run_config import load_config
from tests.support.moe_threads import LoopedExperts, assert_matches, parallel, reference, set_routing_biases
from tests.support.threads import run_ranks

E, K, TOL = 4, 2, 1e-5


def make_cfg(tp: int = 1, schedule: str = "1f1b", **model: float) -> Config:
    overrides = {"moe_experts": E, "moe_top_k": K, "moe_capacity_factor": 0, "moe_every": 2,
                 "moe_shared_experts": 1, **model}  # fmt: skip
    return load_config("examples/configs/tiny.toml", [
        "parallel.dp=2", "parallel.ep=2", f"parallel.tp={tp}",
        f"parallel.sequence_parallel={str(tp > 1).lower()}",
        f'parallel.schedule="{schedule}"', "parallel.microbatches=1", "train.global_batch=4",
        *(f"model.{k}={v}" for k, v in overrides.items()),
    ])


class _ShiftedOffsets(MoELayer):
    """A grouped GEMM whose offsets name the wrong expert: expert j's rows go through expert j+1."""

    def local_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        experts = list(self.experts.values())
        return grouped_partial(experts[1:] + experts[:1], rows, counts)


@pytest.fixture(scope="module")
def one_process() -> dict:
    want = reference(make_cfg(), set_routing_biases)  # the same math at tp=1 and tp=2
    assert want["moe"]["dropped_tokens"] == 0
    assert all(min(load) > 0 for load in want["moe"]["expert_load"].values()), "every expert must get rows"
    return want


def _experts_deferred_by_zero_bubble(model: LlamaStage) -> None:
    """The experts' linears with their zero-bubble slot back: ZB-H1 then defers weight GEMMs that the
    grouped GEMM never leaves for W, and the experts get no gradient."""
    set_routing_biases(model)
    for layer in model.moe_layers().values():
        for expert in layer.experts.values():
            for linear in (expert.w_gate, expert.w_up, expert.w_down):
                linear.wgrad_store = None


@pytest.mark.parametrize("tp, schedule", [(1, "1f1b"), (2, "1f1b"), (1, "zb-h1")])
def test_dropless_with_shared_experts_matches_one_process(one_process, tp, schedule):
    got = parallel(make_cfg(tp, schedule), prepare=set_routing_biases)
    diffs = assert_matches(got, one_process, TOL)
    print(f"dropless dp=2 ep=2 tp={tp} {schedule}: max relative differences {diffs}")


def test_dropless_with_wrong_group_offsets_is_rejected(one_process):
    got = parallel(make_cfg(), _ShiftedOffsets, prepare=set_routing_biases)
    with pytest.raises(AssertionError, match=r"^loss [\d.]+ vs [\d.]+$"):
        assert_matches(got, one_process, TOL)


def test_expert_gradients_left_to_zero_bubbles_w_are_rejected(one_process):
    got = parallel(make_cfg(schedule="zb-h1"), prepare=_experts_deferred_by_zero_bubble)
    expert = r"layers\.\d\.mlp\.experts\.\d\.w_\w+\.weight"
    with pytest.raises(AssertionError, match=rf"^gradient of {expert} differs"):
        assert_matches(got, one_process, TOL)


# -- the grouped GEMM against the per-expert loop -----------------------------------------------------------
def experts_run(cls: type[MoELayer]) -> dict[str, torch.Tensor]:
    """One dropless layer's output and gradients on uneven random tokens (seeded: the same for every cls)."""
    torch.manual_seed(0)
    layer = LlamaStage(make_cfg().model, seed=1).moe_layers()["1"]
    layer.__class__ = cls
    x = torch.randn(3, 16, layer.router.weight.shape[1], requires_grad=True)
    y = layer(x)
    (y * torch.randn_like(y)).sum().backward()
    return {"output": y.detach(), "input gradient": x.grad} | {n: p.grad for n, p in layer.named_parameters()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, w in want.items():
        err = (got[name] - w).abs().max().item()
        assert err <= TOL * w.abs().max().item(), f"{name} differs by {err:.3g}"


def test_grouped_gemm_matches_the_per_expert_loop():
    assert_same(experts_run(MoELayer), experts_run(LoopedExperts))


def test_grouped_gemm_with_wrong_offsets_is_rejected():
    with pytest.raises(AssertionError, match=r"^output differs by"):
        assert_same(experts_run(_ShiftedOffsets), experts_run(LoopedExperts))


# -- aux-loss-free balancing -------------------------------------------------------------------------------
RATE, STEPS, TOKENS = 0.01, 40, 64
Update = Callable[..., dict[str, torch.Tensor]]


def _local_loads(layers, rate, group, device):  # each replica its own loads: the bug the all-reduce avoids
    return bias_updates(layers, rate, None, device)


def _flipped_sign(layers, rate, group, device):  # the busiest expert made busier
    return bias_updates(layers, -rate, group, device)


def balance(update: Update = bias_updates) -> list[dict]:
    """STEPS steps of a skewed stream on 2 replicas (each its own tokens; forward only: the bias moves by
    loads, not gradients): the global load spread per step and the final bias of each replica."""
    cfg = make_cfg(moe_bias_update_rate=RATE).model
    skew = torch.randn(cfg.d_model, generator=torch.Generator().manual_seed(5))

    def replica(group) -> dict:
        layer = LlamaStage(cfg, seed=1).moe_layers()["1"]
        with torch.no_grad():  # the router favours expert 0 for tokens along `skew`
            layer.router.weight[0] += skew / skew.norm() * 0.2
        gen, spreads = torch.Generator().manual_seed(group.rank), []
        for _ in range(STEPS):
            with torch.no_grad():
                layer(torch.randn(TOKENS, cfg.d_model, generator=gen) + skew)
            steps = update({"1": layer}, RATE, group, torch.device("cpu"))
            load = group.all_reduce(layer.take_stats().load.clone(), "sum")
            spreads.append(load_spread(load.tolist()))
            apply_bias_updates({"1": layer}, steps)
        return {"spreads": spreads, "bias": layer.expert_bias.clone()}

    return run_ranks(2, replica)


def assert_balanced(replicas: list[dict]) -> None:
    spreads = replicas[0]["spreads"]
    first, last = sum(spreads[:3]) / 3, sum(spreads[-10:]) / 10
    assert first > 0.5, f"the stream must start skewed: spread {first:.2f}"
    assert last < first / 2, f"expert load spread did not shrink: {first:.2f} -> {last:.2f}"
    for r in replicas[1:]:
        same = torch.equal(r["bias"], replicas[0]["bias"])
        assert same, f"routing bias differs between replicas: {r['bias']} vs {replicas[0]['bias']}"


def test_bias_balancing_shrinks_the_spread_and_stays_equal_on_replicas():
    assert_balanced(balance())


@pytest.mark.parametrize("update, symptom", [
    (_local_loads, "routing bias differs between replicas"),
    (_flipped_sign, "expert load spread did not shrink"),
])
def test_broken_bias_updates_are_rejected(update, symptom):
    with pytest.raises(AssertionError, match=symptom):
        assert_balanced(balance(update))


# -- checkpoints out: --format hf refuses what a family cannot compute; sampling routes with the biases ----
def moe_checkpoint(tmp_path, shared: int, **model: object) -> tuple[str, LlamaStage]:
    """A one-process checkpoint of an MoE model with non-zero routing biases, as a run writes it."""
    cfg = make_cfg(moe_shared_experts=shared, **model).model
    stage = LlamaStage(cfg, seed=3)
    set_routing_biases(stage)
    tensors = dict(stage.named_parameters()) | stage.routing_biases()
    specs = {n: checkpoint.ShardSpec.full(t.shape) for n, t in tensors.items()}
    meta = {"model": dataclasses.asdict(cfg)}
    return checkpoint.save(str(tmp_path / "ckpt"), 1, {"dp0.pp0.tp0": (tensors, specs)}, meta), stage


@pytest.mark.parametrize("shared, model, refusal", [
    (1, {}, "model.moe_shared_experts=1: Hugging Face's LlamaForCausalLM has no experts"),
    (0, {}, "model.moe_experts=4: Hugging Face's LlamaForCausalLM has no experts"),
    (1, {"family": '"mixtral"'}, "model.moe_shared_experts=1: MixtralForCausalLM has no shared experts"),
    (0, {"family": '"mixtral"'}, "model.moe_renormalize=False: MixtralForCausalLM always renormalises"),
    (0, {"family": '"mixtral"', "moe_renormalize": "true", "moe_every": 1},
     r"layers\.0\.mlp\.expert_bias is not zero: Hugging Face's routers route without a bias"),
])  # fmt: skip
def test_hf_export_refuses_what_the_family_cannot_compute_naming_the_field(tmp_path, shared, model, refusal):
    step, _ = moe_checkpoint(tmp_path, shared, **model)
    with pytest.raises(checkpoint.CheckpointError, match=refusal):
        hf.export(step, str(tmp_path / "hf"))


def test_generate_loads_the_routing_biases(tmp_path):
    step, stage = moe_checkpoint(tmp_path, 1)
    model, _ = generate.load(step)
    # 4 layers, MoE every 2nd: the layers the loop below checks, listed (an empty dict would pass it)
    assert sorted(stage.routing_biases()) == ["layers.1.mlp.expert_bias", "layers.3.mlp.expert_bias"]
    for name, bias in stage.routing_biases().items():
        assert bias.abs().max() > 0 and torch.equal(model.routing_biases()[name], bias), name
