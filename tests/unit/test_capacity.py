"""The up-front resource check (raypar.controller.capacity): the layout's placement groups against the
nodes there are and the autoscaler's node types, decided on plain resource dicts, without Ray.

Before: a run needing 4 CPUs per node on a 2-CPU cluster waited out parallel.timeout_s and then printed
Ray's resource dictionary; a run needing nodes the autoscaler adds said nothing while it waited."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from raypar.controller import capacity, cli
from raypar.controller.capacity import Need, NodeType, Verdict, decide
from raypar.controller.placement import ActorResources
from raypar.controller.run_log import RunLog
from raypar.core.config.errors import ConfigError
from raypar.core.config.load import from_dict

ROOT = Path(__file__).resolve().parents[2]
# cluster.yaml's worker types as the autoscaler reads them: 8 GPUs, 192 CPUs and the type's resource each.
TYPES = capacity.node_types_from_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
HEAD = {"CPU": 8.0, "GPU": 0.0, "memory": 3e10, "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0}


def need(per_actor: dict[str, float], group_size: int, groups: int, axes: str = "tp") -> Need:
    return Need(per_actor, group_size, groups, axes=axes, layout=f"dp={groups} x pp=1")


def test_cluster_yaml_types_are_what_the_check_reads() -> None:
    by_name = {t.name: t for t in TYPES}
    assert set(by_name) == {"ray.worker.p5", "ray.worker.g6"}  # the head is not a type to add
    assert by_name["ray.worker.p5"].resources == {"CPU": 192.0, "GPU": 8.0, "p5": 1.0}
    assert by_name["ray.worker.g6"].resources == {"CPU": 192.0, "GPU": 8.0, "g6": 1.0}
    assert by_name["ray.worker.p5"].max_workers == 4


def test_fits_on_the_nodes_there_are() -> None:
    two = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert decide(need({"CPU": 1.0}, 2, 2), two, autoscaler=False, types=None).fits_now
    # Control: a third group does not fit, and with no autoscaler that is final.
    message = (
        r"^parallel.dp: dp=3 x pp=1 needs 3 groups of 2 actors \(2 CPUs each, on one node\); the cluster's "
        r"nodes hold 2 and it has no autoscaler to add nodes$"
    )
    with pytest.raises(ConfigError, match=message):
        decide(need({"CPU": 1.0}, 2, 3), two, autoscaler=False, types=None)


def test_a_group_larger_than_any_node_is_refused_with_the_numbers() -> None:
    """The issue's case: tp=4 at 1 CPU per actor on 2-CPU nodes, STRICT_PACK on one node."""
    small = [{"CPU": 2.0}, {"CPU": 2.0}]  # 4 CPUs in all: enough in sum, not on one node
    tp4 = need({"CPU": 1.0}, 4, 1)
    message = (
        r"^parallel.tp: needs 4 CPUs per node for a tp group of 4 \(1 per actor\); the largest node has 2 "
        r"and there is no autoscaler$"
    )
    with pytest.raises(ConfigError, match=message):
        decide(tp4, small, autoscaler=False, types=None)
    two_cpu_type = [NodeType("w", {"CPU": 2.0, "GPU": 8.0}, 3)]
    with pytest.raises(ConfigError, match="largest node has 2 and the autoscaler has no larger type$"):
        decide(tp4, small, autoscaler=True, types=two_cpu_type)
    # A cp x tp group names parallel.cp; a GPU shortfall is named before the CPUs.
    with pytest.raises(ConfigError, match=r"^parallel.cp: needs 16 GPUs per node for a cp x tp group of 16 "):
        decide(need({"CPU": 1.0, "GPU": 1.0}, 16, 1, axes="cp x tp"), [HEAD], autoscaler=True, types=TYPES)
    # One actor too big names its per-actor knob; resources each somewhere but never together, the group.
    message = (
        r"^parallel.threads_per_actor: needs 3 CPUs per node for a tp group of 1 \(3 per actor\); the "
        r"largest node has 2 and there is no autoscaler$"
    )
    with pytest.raises(ConfigError, match=message):
        decide(need({"CPU": 3.0}, 1, 1), small, autoscaler=False, types=None)
    split = [{"CPU": 8.0}, {"CPU": 1.0, "GPU": 8.0}]
    message = (
        r"^parallel.tp: needs 2 CPUs, 2 GPUs on one node for a tp group of 2; no node has all of it and "
        r"there is no autoscaler$"
    )
    with pytest.raises(ConfigError, match=message):
        decide(need({"CPU": 1.0, "GPU": 1.0}, 2, 1), split, autoscaler=False, types=None)
    # Control: a type with 4 CPUs per node makes the same group a wait for one such node.
    verdict = decide(tp4, small, autoscaler=True, types=[*two_cpu_type, NodeType("big", {"CPU": 4.0}, 1)])
    assert not verdict.fits_now and verdict.nodes == "1 x big" and verdict.describe() == "4 CPUs"


def test_gpu_groups_wait_for_nodes_the_autoscaler_adds() -> None:
    """dp=2 x tp=8 on a CPU head: two 8-GPU nodes to come."""
    verdict = decide(need({"CPU": 1.0, "GPU": 1.0}, 8, 2), [HEAD], autoscaler=True, types=TYPES)
    assert verdict.waits_for == {"CPU": 16.0, "GPU": 16.0}
    assert verdict.describe() == "16 GPUs and 16 CPUs"
    assert verdict.nodes == "such as 2 x ray.worker.p5"  # g6 would do as well: the autoscaler picks
    line = verdict.line(300.0)
    assert line.startswith("waiting for the autoscaler to add nodes with 16 GPUs and 16 CPUs (such as 2 x")
    assert line.endswith("each placement group waits up to parallel.placement_timeout_s=300s")
    # Control: one group already placed on a GPU node there is leaves one node to wait for.
    gpu_node = {"CPU": 192.0, "GPU": 8.0, "g6": 1.0}
    one_left = decide(need({"CPU": 1.0, "GPU": 1.0}, 8, 2), [HEAD, gpu_node], True, TYPES)
    assert one_left.describe() == "8 GPUs and 8 CPUs"


def test_more_nodes_than_max_workers_allows_is_refused() -> None:
    per_type = need({"CPU": 1.0, "GPU": 1.0, "p5": 0.001}, 8, 5)  # 5 p5 nodes; cluster.yaml allows 4
    message = (
        r"^parallel.dp: dp=5 x pp=1 needs 5 more groups of 8 actors .* cannot add them within their "
        r"max_workers \(ray.worker.p5 <= 4, ray.worker.g6 <= 4\)$"
    )
    with pytest.raises(ConfigError, match=message):
        decide(per_type, [HEAD], autoscaler=True, types=TYPES)
    # Control: 4 fit within the bound (and without the node type, 5 fit across p5 and g6).
    four = decide(need({"CPU": 1.0, "GPU": 1.0, "p5": 0.001}, 8, 4), [HEAD], True, TYPES)
    assert four.nodes == "4 x ray.worker.p5"
    five = decide(need({"CPU": 1.0, "GPU": 1.0}, 8, 5), [HEAD], True, TYPES)
    assert five.nodes == "such as 1 x ray.worker.g6, 4 x ray.worker.p5"


def test_node_type_no_node_or_type_declares_is_refused() -> None:
    g7 = need({"CPU": 1.0, "GPU": 1.0, "g7": 0.001}, 8, 1)
    message = (
        r"^parallel.node_type: no node of the cluster and no node type of its autoscaler has the resource "
        r"'g7' \(known: g6, p5\)$"
    )
    with pytest.raises(ConfigError, match=message):
        decide(g7, [HEAD], autoscaler=True, types=TYPES)
    # Control: g6, which ray.worker.g6 declares, waits for a g6 node and only that.
    g6 = decide(need({"CPU": 1.0, "GPU": 1.0, "g6": 0.001}, 8, 1), [HEAD], autoscaler=True, types=TYPES)
    assert g6.nodes == "1 x ray.worker.g6"
    # Ray's per-node resources are not offered as node types.
    with pytest.raises(ConfigError, match=r"has the resource 'g6' \(known: none\)$"):
        decide(need({"CPU": 1.0, "g6": 0.001}, 1, 1), [HEAD], autoscaler=False, types=None)


def test_an_autoscaler_whose_types_are_unknown_is_waited_for() -> None:
    """A cluster started by hand with --autoscaling-config, KubeRay, a driver off the head: nothing can be
    ruled out, so the run waits (bounded by parallel.placement_timeout_s) and says what it did not check."""
    verdict = decide(need({"CPU": 1.0, "GPU": 1.0, "g7": 0.001}, 16, 1), [HEAD], autoscaler=True, types=None)
    assert verdict.describe() == "16 GPUs and 16 CPUs"
    assert "(its node types are unknown here, so not checked against them)" in verdict.line(60.0)
    # The monitor that did not report (None) is not taken for "no autoscaler", and the line says so.
    silent = decide(need({"CPU": 1.0}, 4, 1), [{"CPU": 2.0}], autoscaler=None, types=None)
    assert "(no autoscaler report, so neither it nor its node types were checked)" in silent.line(60.0)


def test_check_reads_the_nodes_and_the_bootstrap_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The Ray side on a fake cluster state: ray.nodes(), the monitor's answer, the bootstrap config."""
    cfg = from_dict({"model": {"n_kv_heads": 4}, "parallel": {"tp": 4, "device": "cpu"}})
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": False, "Resources": {"CPU": 64.0}}]
    monkeypatch.setattr(capacity.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(capacity, "autoscaler_running", lambda: True)
    bootstrap = tmp_path / "ray_bootstrap_config.yaml"
    monkeypatch.setattr(capacity, "BOOTSTRAP_CONFIG", bootstrap)
    assert capacity.check(cfg, 1).nodes.startswith("its node types are unknown")  # no config here: wait
    bootstrap.write_text((ROOT / "examples" / "cluster-local.yaml").read_text())  # 2-CPU fake node types
    with pytest.raises(ConfigError, match="largest node has 2 and the autoscaler has no larger type$"):
        capacity.check(cfg, 1)
    # Control: tp=2 fits the alive 2-CPU node (the dead 64-CPU one never counted).
    assert capacity.check(from_dict({"parallel": {"tp": 2, "device": "cpu"}}), 1).fits_now


def test_the_driver_posts_the_wait_and_clears_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What the control actor gets (and `raypar status` reads back) before and after the placement."""
    log = RunLog(from_dict({}), "demo", tmp_path, actor_mesh=None, progress=False)
    shown: list[str] = []
    monkeypatch.setattr(log, "event", shown.append)
    posted: list[dict] = []
    control = SimpleNamespace(update=SimpleNamespace(remote=posted.append))
    log.announce_wait(control, Verdict())  # fits now: nothing said, nothing posted
    assert (shown, posted) == ([], [])
    waits = Verdict({"GPU": 16.0, "CPU": 16.0}, "2 x ray.worker.p5")
    log.announce_wait(control, waits)
    assert shown == [waits.line(300.0)]
    waiting = "demo: waiting for 16 GPUs and 16 CPUs (the autoscaler adds nodes)"
    assert cli.status_lines(posted[-1:]) == [waiting]
    # Control: once placed, status says "starting" again (until the first step's line).
    log.announce_wait(control, Verdict())
    assert cli.status_lines(posted[-1:]) == ["demo: starting"] and len(posted) == 2
    # The wait it names is the placement budget, not the collectives' timeout_s (issue 27).
    log.cfg = from_dict({"parallel": {"timeout_s": 60, "placement_timeout_s": 1200}})
    log.announce_wait(control, waits)
    assert shown[-1].endswith("each placement group waits up to parallel.placement_timeout_s=1200s")


def test_node_type_asks_a_sliver_of_the_types_resource() -> None:
    assert ActorResources(1.0, 1.0, "g6").bundle() == {"CPU": 1.0, "GPU": 1.0, "g6": 0.001}
    assert ActorResources(1.0, 1.0).bundle() == {"CPU": 1.0, "GPU": 1.0}  # control: any node


@pytest.mark.parametrize("value", ["g 6", "6g", "GPU", "node:10.0.0.1", "accelerator_type:L4", "g6\n"])
def test_badly_formed_node_type_is_refused(value: str) -> None:
    rule = r"^parallel.node_type: must be empty or the custom resource a worker type declares .*, got "
    with pytest.raises(ConfigError, match=rule):
        from_dict({"parallel": {"node_type": value}})


def test_well_formed_node_types_pass() -> None:
    for value in ("", "g6", "p5", "my-type.v2"):  # control for the refusals above
        assert from_dict({"parallel": {"node_type": value}}).parallel.node_type == value
