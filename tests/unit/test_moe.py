"""The MoE layer under expert parallelism (thread ranks, no Ray) against one process holding every expert.

Rank r of an EP group of size ep holds E/ep experts and its own tokens x_r (uneven counts on purpose); the
reference is one MoELayer with all E experts applied to the tokens of every rank concatenated in rank order,
which is exactly the dispatch the parallel layer performs (capacity from the global token count, priority by
slot, then rank, then token). Outputs, input gradients, router gradients (summed over ranks: the router is
replicated, each rank's gradient comes from its own tokens) and each expert's gradient (on its owner) must
match to 1e-5 in fp32 -- only the order of a few float sums differs. The capacity factor is small enough to
drop tokens, so capacity and priority are exercised. Each negative control is a real bug the same check
catches: a combine without router weights, a capacity from the local token count. Last, the whole model at
dp=2 x pp=2 x ep=2 on thread ranks against one process, with a lost aux loss as its control.
"""

from __future__ import annotations

import math

import pytest
import torch

from raypar.core.config.schema import ModelConfig
from raypar.core.model import moe
from raypar.core.model.moe import MoELayer
from raypar.core.parallel.tp import shard_of
from raypar.core.pipeline.executor import ModelBackend
from raypar.core.run_config import load_config
from tests.support import moe_threads
from tests.support.threads import run_groups, run_ranks

E, K, CF, COEF = 4, 2, 0.75, 0.01
UNEVEN = [(2, 8), (3, 8), (1, 8), (2, 8)]  # per rank: (sequences, seq_len)
# A capacity from the local count differs between ranks with uneven tokens, and then the ranks' all-to-all
# splits disagree: gloo aborts the process (that desynchronisation is why capacity uses the global count).
# With even counts every rank computes the same wrong capacity, and the check sees the wrong result.
EVEN = [(2, 8)] * 4
TOL = 1e-5


def model_cfg(cf: float = CF) -> ModelConfig:
    return load_config(
        "examples/configs/tiny.toml",
        [
            f"model.moe_experts={E}",
            f"model.moe_top_k={K}",
            f"model.moe_capacity_factor={cf}",
            f"model.moe_aux_loss_coef={COEF}",
        ],
    ).model


def inputs(ep: int, tokens: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    d = model_cfg().d_model
    xs = [torch.randn(*tokens[r], d, generator=gen) for r in range(ep)]
    cs = [torch.randn(*tokens[r], d, generator=gen) for r in range(ep)]  # a fixed projection: loss = <y, c>
    return xs, cs


def build(cls: type[MoELayer], cfg: ModelConfig, group) -> MoELayer:
    layer = cls(cfg, None, group)
    gen = torch.Generator().manual_seed(7)
    full = {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in cls(cfg, None, None).named_parameters()}
    with torch.no_grad():  # the same global tensors whatever the layout (by global expert id)
        for name, p in layer.named_parameters():
            p.copy_(full[name])
    return layer


def aux_of(probs: torch.Tensor) -> torch.Tensor:
    """Switch's load-balancing loss written out independently: coef * E * sum_e f_e * P_e."""
    top = probs.topk(K, dim=-1).indices
    f = torch.bincount(top.reshape(-1), minlength=E).float() / top.numel()
    return COEF * E * (f * probs.mean(dim=0)).sum()


def reference(ep: int, tokens: list[tuple[int, int]] = UNEVEN) -> dict:
    xs, cs = inputs(ep, tokens)
    layer = build(MoELayer, model_cfg(), None)
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).requires_grad_()
    y = layer(x)
    aux = sum(aux_of(layer.router(x[a:b])) for a, b in _bounds(xs))  # per rank's tokens, as each rank does
    ((y * torch.cat([c.reshape(-1, c.shape[-1]) for c in cs])).sum() + aux).backward()
    return {
        "y": [y[a:b].detach() for a, b in _bounds(xs)],
        "x_grad": [x.grad[a:b] for a, b in _bounds(xs)],
        "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
        "dropped": layer.take_stats().dropped,
    }


def _bounds(xs: list[torch.Tensor]) -> list[tuple[int, int]]:
    ends = torch.tensor([t.shape[0] * t.shape[1] for t in xs]).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def parallel(ep: int, cls: type[MoELayer] = MoELayer, tokens: list[tuple[int, int]] = UNEVEN) -> list[dict]:
    xs, cs = inputs(ep, tokens)

    def rank(group) -> dict:
        layer = build(cls, model_cfg(), group)
        x = xs[group.rank].clone().requires_grad_()
        y = layer(x)
        ((y * cs[group.rank]).sum() + layer.take_aux_loss()).backward()
        return {
            "y": y.detach().reshape(-1, y.shape[-1]),
            "x_grad": x.grad.reshape(-1, x.shape[-1]),
            "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
            "kept": layer.last_kept,
            "dropped": layer.take_stats().dropped,
        }

    return run_ranks(ep, rank)


def assert_matches(ranks: list[dict], ref: dict) -> None:
    for r, got in enumerate(ranks):
        err = (got["y"] - ref["y"][r]).abs().max().item()
        assert err <= TOL, f"output of rank {r} differs by {err:.3g}"
        err = (got["x_grad"] - ref["x_grad"][r]).abs().max().item()
        assert err <= TOL, f"input gradient of rank {r} differs by {err:.3g}"
    router = sum(got["grads"]["router.weight"] for got in ranks)
    err = (router - ref["grads"]["router.weight"]).abs().max().item()
    assert err <= TOL, f"router gradient differs by {err:.3g}"
    for got in ranks:
        for name, grad in got["grads"].items():
            if name.startswith("experts."):
                err = (grad - ref["grads"][name]).abs().max().item()
                assert err <= TOL, f"gradient of {name} differs by {err:.3g}"


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_layer_matches_one_process(ep):
    ref, ranks = reference(ep), parallel(ep)
    assert ref["dropped"] > 0, "the capacity factor must drop tokens for this test to cover capacity"
    assert_matches(ranks, ref)
    # Every rank computed the same capacity and the same kept counts, so the all-to-all could not desync.
    assert all(torch.equal(r["kept"], ranks[0]["kept"]) for r in ranks)
    assert sum(r["dropped"] for r in ranks) == ref["dropped"]
    # Each expert is held by exactly one rank, under its global id.
    held = [n.split(".")[1] for r in ranks for n in r["grads"] if n.endswith("w_up.weight")]
    assert sorted(held, key=int) == [str(e) for e in range(E)]


class _NoRouterWeights(MoELayer):
    def combine(self, out, token, weight, tokens):
        return super().combine(out, token, torch.ones_like(weight), tokens)


class _LocalCapacity(MoELayer):
    def capacity(self, local_tokens, global_tokens):
        return math.ceil(self.capacity_factor * local_tokens * self.top_k / self.n_experts)


@pytest.mark.parametrize(
    "cls, symptom", [(_NoRouterWeights, "output of rank 0"), (_LocalCapacity, "output of rank")]
)
def test_negative_controls_are_rejected(cls, symptom):
    ref, broken = reference(2, EVEN), parallel(2, cls, EVEN)
    assert ref["dropped"] > 0
    with pytest.raises(AssertionError, match=symptom):
        assert_matches(broken, ref)


def test_dropped_router_weights_change_only_what_router_gradients_see():
    """The router's gradient comes from the combine weights and the aux loss: a combine that ignores the
    weights must be caught by the router-gradient check even where outputs are not compared."""
    ref, broken = reference(2), parallel(2, _NoRouterWeights)
    router = sum(r["grads"]["router.weight"] for r in broken)
    assert (router - ref["grads"]["router.weight"]).abs().max().item() > 100 * TOL


def test_no_drop_capacity_keeps_every_token():
    """capacity_factor = E / k makes C >= tokens: nothing is dropped, at any ep."""
    xs, _ = inputs(2, UNEVEN)

    def rank(group) -> int:
        layer = build(MoELayer, model_cfg(cf=E / K), group)
        layer(xs[group.rank])
        return layer.take_stats().dropped

    assert run_ranks(2, rank) == [0, 0]


TP_EP = 2, 2  # (ep, tp)


def run_tp_ep() -> list[dict]:
    """tp=2 x ep=2 on 4 threads (rank = 2 * ep_rank + tp_rank): each rank's outputs and gradients."""
    ep, tp = TP_EP
    xs, cs = inputs(ep, UNEVEN)
    groups = {f"tp{e}": [2 * e, 2 * e + 1] for e in range(ep)} | {f"ep{t}": [t, 2 + t] for t in range(tp)}

    def rank(r: int, mine: dict) -> dict:
        e, t = divmod(r, tp)
        tp_group, ep_group = mine[f"tp{e}"], mine[f"ep{t}"]
        layer = MoELayer(model_cfg(), tp_group, ep_group)
        full = dict(build(MoELayer, model_cfg(), None).named_parameters())
        with torch.no_grad():
            for name, p in layer.named_parameters():
                dim = layer.get_submodule(name.rpartition(".")[0]).shard_dim
                p.copy_(shard_of(full[name].detach(), dim, tp_group))
        x = xs[e].clone().requires_grad_()
        y = layer(x)
        ((y * cs[e]).sum() + layer.take_aux_loss()).backward()
        return {
            "y": y.detach().reshape(-1, y.shape[-1]),
            "x_grad": x.grad.reshape(-1, x.shape[-1]),
            "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
            "dims": {
                n: layer.get_submodule(n.rpartition(".")[0]).shard_dim for n, _ in layer.named_parameters()
            },
            "tp_group": tp_group,
        }

    return run_groups(ep * tp, groups, rank)


def assert_tp_ep_matches(ranks: list[dict], ref: dict) -> None:
    ep, tp = TP_EP
    for t in range(tp):  # each tp rank's EP group sees the whole computation
        same_tp = [ranks[2 * e + t] for e in range(ep)]
        for e, got in enumerate(same_tp):
            err = (got["y"] - ref["y"][e]).abs().max().item()
            assert err <= TOL, f"output of ep rank {e}, tp rank {t} off by {err:.3g}"
            err = (got["x_grad"] - ref["x_grad"][e]).abs().max().item()
            assert err <= TOL, f"input gradient of ep rank {e}, tp rank {t} off by {err:.3g}"
        router = sum(got["grads"]["router.weight"] for got in same_tp)
        err = (router - ref["grads"]["router.weight"]).abs().max().item()
        assert err <= TOL, f"router gradient over tp rank {t}'s EP group off by {err:.3g}"
        for got in same_tp:
            for name, grad in got["grads"].items():
                if name.startswith("experts."):
                    want = shard_of(ref["grads"][name], got["dims"][name], got["tp_group"])
                    assert (grad - want).abs().max().item() <= TOL, name


def test_experts_split_across_tp_with_expert_parallelism():
    """Each expert's gate/up rows and down columns split across the tp pair, the router replicated; both tp
    ranks route the same tokens: every rank's output and gradients as one process's."""
    assert_tp_ep_matches(run_tp_ep(), reference(TP_EP[0]))


def test_experts_without_their_tp_reduction_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the experts' outputs left as the tp ranks' partial sums (the all-reduce after the
    down projection dropped)."""
    monkeypatch.setattr(moe, "reduce_from_tp", lambda x, group: x)
    with pytest.raises(AssertionError, match="output of ep rank 0, tp rank 0 off by"):
        assert_tp_ep_matches(run_tp_ep(), reference(TP_EP[0]))


# -- MoE on both pipeline stages ---------------------------------------------------------------------------
class _AuxLeftOnEarlierStages(ModelBackend):
    """The bug: a stage before the last keeps its MoE aux loss out of its backward (only the stage that ends
    in the loss would carry the balancing term)."""

    def compute(self, op: str, chunk: int, mb: int) -> None:
        super().compute(op, chunk, mb)
        self.aux.clear()


def test_dp2_pp2_ep2_matches_one_process():
    """Experts on both stages of a 1F1B pipeline at dp=2 x ep=2 (blocks 1 and 3 MoE, one per stage), one
    step on 8 thread ranks against one process holding every expert (tests/support/moe_threads.py: loss,
    every gradient, grad norm, aux loss, expert load; 1e-5 as tests/unit/test_moe_dropless.py says why):
    stage 0's aux loss joins its backward without a loss of its own. Control: that aux loss left out; the
    gradients upstream of block 1's router differ (the first checked, embed.weight, fails)."""
    cfg = load_config("examples/configs/tiny.toml", [
        "parallel.dp=2", "parallel.pp=2", "parallel.ep=2", "parallel.microbatches=4", "train.global_batch=8",
        f"model.moe_experts={E}", f"model.moe_top_k={K}", f"model.moe_capacity_factor={E / K}",
        "model.moe_every=2",
    ])
    want = moe_threads.reference(cfg)
    assert want["moe"]["dropped_tokens"] == 0 and want["moe"]["aux_loss"] > 0
    moe_threads.assert_matches(moe_threads.parallel(cfg), want, TOL)
    with pytest.raises(AssertionError, match=r"^gradient of embed\.weight differs"):
        broken = moe_threads.parallel(cfg, backend_class=_AuxLeftOnEarlierStages)
        moe_threads.assert_matches(broken, want, TOL)
