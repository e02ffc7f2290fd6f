"""MoE and expert-parallel configuration rules, the EP/EDP groups of the mesh, and which replicas survive a
failure under expert parallelism (no Ray started)."""

from __future__ import annotations

import pytest

from raypar.controller.actor_calls import moe_totals
from raypar.controller.actor_mesh import ActorMesh
from raypar.controller.connection import RunFailure
from raypar.controller.mesh_builder import MeshBuilder
from raypar.core.config.errors import ConfigError
from raypar.core.model.llama import count_params, flops_per_token
from raypar.core.observe.step_report import MoELayerReport
from raypar.core.parallel.mesh import Coord, Mesh
from raypar.core.run_config import load_config
from tests.support.moe_threads import moe_report

TINY = "examples/configs/tiny.toml"
MOE = ["model.moe_experts=4", "parallel.dp=4", "train.global_batch=8"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.ep=2"], "parallel.ep: needs model.moe_experts > 0"),
        ([*MOE, "parallel.ep=3"], "parallel.ep: must divide model.moe_experts=4"),
        ([*MOE, "parallel.dp=2", "parallel.ep=4"], "parallel.ep: must divide parallel.dp=2"),
        ([*MOE, "model.moe_top_k=5"], "model.moe_top_k: must be in [1, moe_experts=4]"),
        ([*MOE, "model.moe_capacity_factor=-1"], "model.moe_capacity_factor: must be positive, or 0 for"),
        ([*MOE, "model.moe_bias_update_rate=-0.1"], "model.moe_bias_update_rate: must be >= 0"),
        ([*MOE, "model.moe_shared_experts=-1"], "model.moe_shared_experts: must be >= 0"),
        ([*MOE, "model.d_model=68", "model.n_heads=2", "model.n_kv_heads=2"],
         "model.d_model: must be a multiple of 8 with MoE"),
        ([*MOE, "model.d_ff=132", "parallel.tp=2"], "model.d_ff: d_ff/tp must be a multiple of 8 with MoE"),
        ([*MOE, "model.moe_every=9"], "model.moe_every: must be in [1, n_layers=4]"),
        ([*MOE, "parallel.ep=0"], "parallel.ep: must be a positive size"),
        ([*MOE, 'train.recompute="full"'], 'train.recompute: "full" does not support MoE blocks'),
    ],
)
def test_bad_moe_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(TINY, overrides)


def test_elastic_dps_stay_multiples_of_ep():
    cfg = load_config(TINY, [*MOE, "parallel.ep=2", "parallel.microbatches=1", "parallel.max_dp=4"])
    assert cfg.valid_dps() == [2, 4]  # 1 and 3 split the batch, but not into EP groups


def test_ep_and_edp_groups():
    mesh = Mesh(dp=4, pp=2, tp=2, ep=2)
    groups = mesh.groups()
    ep = {n: m for n, m in groups.items() if n.startswith("ep.")}
    edp = {n: m for n, m in groups.items() if n.startswith("edp.")}
    assert len(ep) == len(edp) == 2 * 2 * 2  # (stage, tp rank) x (2 EP groups | 2 expert slices)
    assert ep[Mesh.ep_group(Coord(3, 1, 0), 3, 2)] == [Coord(2, 1, 0), Coord(3, 1, 0)]
    assert edp[Mesh.edp_group(Coord(3, 1, 0), 3, 2)] == [Coord(1, 1, 0), Coord(3, 1, 0)]
    # Replicas after failures: groups follow dp ranks (positions), not replica ids.
    groups = Mesh(dp=2, pp=1, tp=1, ep=2).groups([5, 2])
    assert groups[Mesh.ep_group(Coord(5, 0, 0), 0, 2)] == [Coord(5, 0, 0), Coord(2, 0, 0)]
    assert not any(n.startswith("edp.") for n in groups)  # dp == ep: every replica holds other experts
    with pytest.raises(ValueError, match="ep=2 must divide dp=3"):
        Mesh(dp=3, pp=1, tp=1, ep=2)


class _Bookkeeping(MeshBuilder):
    """Only the replica bookkeeping of the mesh: no actors to kill."""

    def drop_replicas(self, ids: set[int]) -> None:
        self.roster.replicas = [d for d in self.roster.replicas if d not in ids]


class _Survivors(ActorMesh):
    builder_class = _Bookkeeping


def test_survivors_keep_their_expert_slice():
    mesh = _Survivors(load_config(TINY, [*MOE, "parallel.ep=2"]), "t")
    before = [0, 1, 2, 3, 4, 5]  # slices 0, 1, 0, 1, 0, 1
    mesh.roster.replicas = [1, 2, 4, 5]  # 0 and 3 died: slice 0 held by 2 and 4, slice 1 by 1 and 5
    mesh.recovery.keep_expert_slices(before)
    assert mesh.replicas == [2, 1, 4, 5]
    mesh.roster.replicas = [0, 2]  # every holder of slice 1 died: only a checkpoint has those experts
    with pytest.raises(RunFailure, match="expert slice 1 of ep=2 is lost"):
        mesh.recovery.keep_expert_slices([0, 1, 2, 3])


def test_moe_totals_count_tp_rank0_and_average_aux_over_replicas():
    stats = {"1": MoELayerReport([3, 1], 1, 0.02)}
    other_tp, replica = Coord(0, 0, 1), Coord(1, 0, 0)
    per_actor = {
        Coord(0, 0, 0): moe_report(Coord(0, 0, 0), stats),
        other_tp: moe_report(other_tp, stats),  # the same tokens on another tp rank: not counted twice
        replica: moe_report(replica, {"1": MoELayerReport([2, 2], 0, 0.04)}),
    }
    totals = moe_totals(per_actor)
    assert totals["expert_load"] == {"1": [5, 3]} and totals["dropped_tokens"] == 1
    assert totals["aux_loss"] == pytest.approx(0.03)
    assert moe_totals({Coord(0, 0, 0): moe_report(Coord(0, 0, 0), {})}) is None


def test_parameter_and_flop_counts():
    dense = load_config(TINY).model
    moe = load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=2"]).model
    mlp, router = 3 * dense.d_model * dense.d_ff, dense.d_model * 4
    assert count_params(moe) - count_params(dense) == 2 * (3 * mlp + router)  # 2 MoE blocks, 4 experts
    assert flops_per_token(moe) - flops_per_token(dense) == 6 * 2 * (mlp + router)  # top-2: one more MLP
