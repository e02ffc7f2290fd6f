"""DP strategies on thread ranks (one process, a gloo group): build a model and its strategy, train it,
compare runs, and write and reload checkpoints; `NoCopyBack`, an offload control. Used by
tests/unit/test_dp_strategy.py, tests/unit/test_offload.py and (`strategy_class`, the control)
tests/support/pipeline_threads.py."""

from __future__ import annotations

import concurrent.futures
import math
from pathlib import Path

import torch

from raypar.core import checkpoint, data
from raypar.core.config.schema import Config
from raypar.core.dp import hsdp
from raypar.core.dp.offload import Transfer
from raypar.core.dp.optim import lr_at
from raypar.core.dp.strategies import STRATEGIES
from raypar.core.dp.strategy import DPStrategy, StrategySpec
from raypar.core.model.llama import LlamaStage
from raypar.core.run_config import load_config
from tests.support.reference import Run
from tests.support.threads import run_groups, run_ranks

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
STEPS = 5
RTOL = 1e-5
PARAM_ATOL = 1e-5
BUCKET_BYTES = 40_000  # several buckets, some parameters split across owners


def make_cfg(steps: int = STEPS, *extra: str) -> Config:
    overrides = ["parallel.microbatches=1", "train.global_batch=8", f"train.steps={steps}"]
    return load_config(TINY, [*overrides, *extra])


def strategy_class(zero: int, control: type[DPStrategy] | None = None) -> type[DPStrategy]:
    """The strategy of ZeRO stage `zero`; with a negative control (a subclass overriding some steps), that
    control's overrides on top of the stage's class."""
    stage = STRATEGIES[zero]
    return stage if control is None else type(control.__name__, (control, stage), {})


class NoCopyBack(DPStrategy):
    """Negative control: the host update lands in a scratch tensor, not in the device parameters."""

    def _transfer(self, bucket):  # noqa: ANN001, ANN202 - DPStrategy's
        t = super()._transfer(bucket)
        return Transfer(t.device_grad, t.host_grad, t.host_master, t.device_params.clone())


def build(cfg: Config, group, zero: int, cls: type[DPStrategy] | None = None, dtype=None):
    m = cfg.model
    model = LlamaStage(m, seed=cfg.train.seed)
    spec = StrategySpec(cfg.train, BUCKET_BYTES, dtype=dtype, reduce_dtype=torch.float32)
    strategy = strategy_class(zero, cls)(model, spec=spec, group=group)
    return model, strategy


def owned_gradients(model: torch.nn.Module, strategy: DPStrategy) -> dict[str, torch.Tensor]:
    """This rank's pieces of the reduced gradients (all a ZeRO-2 reduction leaves), shaped like the
    parameters, NaN where another rank owns them."""
    reduced = {n: torch.full_like(q, float("nan")) for n, q in model.named_parameters()}
    for piece in strategy.layout.pieces:
        reduced[piece.slot.name].view(-1)[piece.lo : piece.hi] = strategy._grad(piece)
    return reduced


def train(cfg, group, model, strategy, steps: range, microbatches: int = 2):
    """One replica's steps: microbatches, the reduction armed for the last, clip, update."""
    dp, rank = (group.size, group.rank) if group is not None else (1, 0)
    dataset = data.open_dataset(cfg.data, cfg.model)
    sampler = data.GlobalSampler(dataset.num_samples, cfg.train.global_batch, cfg.train.seed)
    mbs = cfg.train.global_batch // (dp * microbatches)
    losses, norms = [], []
    for step in steps:
        strategy.begin_step()
        mb_losses = []
        for mb in range(microbatches):
            if mb == microbatches - 1:
                strategy.arm()
            inputs, targets = data.microbatch(dataset, sampler, step, rank * microbatches + mb, mbs)
            loss = model(inputs, targets)
            (loss / microbatches).backward()
            mb_losses.append(loss.item())
        strategy.finish()
        norm = math.sqrt(strategy.grad_sq_norm().item())
        strategy.clip_(norm, cfg.train.grad_clip)
        strategy.step(lr_at(step, cfg.train))
        losses.append(sum(mb_losses) / microbatches)
        norms.append(norm)
    return losses, norms


def run_dp(
    dp: int, zero: int, cls: type[DPStrategy] | None = None, dtype=None, extra: tuple[str, ...] = ()
) -> Run:
    cfg = make_cfg(STEPS, *extra)

    def rank(group):
        model, strategy = build(cfg, group, zero, cls, dtype)
        losses, norms = train(cfg, group, model, strategy, range(STEPS))
        return losses, norms, strategy.full_parameters()

    results = run_ranks(dp, rank)
    losses = [sum(r[0][s] for r in results) / dp for s in range(STEPS)]
    for r in results[1:]:  # every replica ends with the same parameters
        same = all(torch.equal(r[2][n], p) for n, p in results[0][2].items())
        assert same, "replicas end with different parameters"
    return Run(losses, results[0][1], results[0][2])


def hsdp_groups(dp: int, shard: int) -> dict[str, list[int]]:
    """Thread ranks 0..dp-1 as raypar.core.parallel.mesh lays out HSDP: shard groups of `shard` consecutive
    ranks, replicate groups of equal shard index, and the whole dp group (the data's ranks)."""
    groups = {"dp": list(range(dp))}
    groups.update({f"dps{g}": list(range(g * shard, g * shard + shard)) for g in range(dp // shard)})
    groups.update({f"dpr{i}": list(range(i, dp, shard)) for i in range(shard)})
    return groups


class HeldAcross(hsdp.AcrossGroups):
    """The chains held until `release`: each all-reduce across groups starts only when `finish` runs it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.held: list[tuple[concurrent.futures.Future, tuple]] = []

    def after(self, first, strategy, out) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.held.append((future, (first, strategy, out)))
        return future

    def release(self) -> None:
        for future, (first, strategy, out) in self.held:
            first.wait()
            future.set_result(strategy.reduce_across_groups(out))
        self.held.clear()


class AcrossAtFinish(DPStrategy):
    """HSDP with each bucket's all-reduce across groups started in `finish`, after the whole backward, as
    before raypar.core.dp.hsdp chained it: a negative control, and the baseline benchmarks/zero_memory.py
    times the chain against."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.across.close()
        self.across = HeldAcross(self.device)

    def finish(self) -> None:
        self.across.release()
        super().finish()


def build_hsdp(cfg: Config, groups: dict, zero: int, cls: type[DPStrategy] | None = None):
    """A thread rank's model and strategy under HSDP (`groups` from `hsdp_groups`)."""
    shard_group = next(g for n, g in groups.items() if n.startswith("dps"))
    replicate = next(g for n, g in groups.items() if n.startswith("dpr"))
    model = LlamaStage(cfg.model, seed=cfg.train.seed)
    spec = StrategySpec(cfg.train, BUCKET_BYTES, reduce_dtype=torch.float32)
    return model, strategy_class(zero, cls)(model, spec=spec, group=shard_group, replicate=replicate)


def run_hsdp(
    dp: int, shard: int, zero: int, cls: type[DPStrategy] | None = None, extra: tuple[str, ...] = ()
) -> tuple[Run, list[dict]]:
    """`run_dp` under HSDP: ZeRO sharded over shard groups of `shard` ranks, replicated across them; also
    each rank's model-state bytes and padded parameter count after the last step."""
    cfg = make_cfg(STEPS, *extra)

    def rank(r: int, groups: dict) -> tuple:
        model, strategy = build_hsdp(cfg, groups, zero, cls)
        losses, norms = train(cfg, groups["dp"], model, strategy, range(STEPS))
        memory = {"bytes": strategy.model_state_bytes()["cpu"],
                  "padded": sum(b.padded for b in strategy.layout.buckets)}  # fmt: skip
        return losses, norms, strategy.full_parameters(), memory

    results = run_groups(dp, hsdp_groups(dp, shard), rank)
    losses = [sum(r[0][s] for r in results) / dp for s in range(STEPS)]
    for r in results[1:]:
        same = all(torch.equal(r[2][n], p) for n, p in results[0][2].items())
        assert same, "replicas end with different parameters"
    return Run(losses, results[0][1], results[0][2]), [r[3] for r in results]


def assert_close(run: Run, ref: Run, atol: float = PARAM_ATOL, rtol: float = RTOL) -> None:
    for what, got, want in (("loss", run.losses, ref.losses), ("grad norm", run.grad_norms, ref.grad_norms)):
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert abs(a - b) <= rtol * abs(b), f"{what} at step {step}: {a} vs {b}"
    for name, want in ref.params.items():
        err = (run.params[name] - want).abs().max().item()
        assert err <= atol, f"parameter {name} differs by {err:.3g}"


def _checkpoint(
    tmp: Path, dp: int, zero: int, steps: int, extra: tuple[str, ...] = ()
) -> tuple[str, list[dict]]:
    """Train `steps` at (dp, zero), save as the actors would; returns the URI and every rank's state."""
    cfg = make_cfg(2 * steps, *extra)
    root = str(tmp / f"ckpt-dp{dp}-z{zero}{'-'.join(('', *extra))}")
    staging = checkpoint.begin(root, steps)

    def rank(group):
        model, strategy = build(cfg, group, zero)
        train(cfg, group, model, strategy, range(steps))
        entries = [
            checkpoint.write_shard(
                staging,
                f"dp{group.rank}.pp0.tp0.{k}",
                checkpoint.snapshot({n: t for n, (t, _) in part.items()}),
                {n: s for n, (_, s) in part.items()},
            )
            for k, part in enumerate(strategy.checkpoint_parts())
        ]
        return entries, {n: t.clone() for n, t in strategy.full_state().items()}

    results = run_ranks(dp, rank)
    entries = [e for r in results for e in r[0]]
    uri = checkpoint.publish(root, staging, steps, entries, {"optimizer_steps": steps, "zero": zero})
    return uri, [r[1] for r in results]


def assert_loads_exactly(uri: str, saved: dict[str, torch.Tensor], cfg, dp: int, zero: int) -> None:
    """Every rank of a strategy at (dp, zero) that loads `uri` holds the saved state exactly."""

    def rank(group):
        model, strategy = build(cfg, group, zero)
        strategy.load(checkpoint.CheckpointReader(uri), 2)
        return strategy.full_state()

    for state in run_ranks(dp, rank) if dp > 1 else [rank(None)]:
        assert state.keys() == saved.keys()
        assert all(torch.equal(state[n], t) for n, t in saved.items())
