"""Whether the cluster can hold the run's actors, decided before any placement group is asked for.

A placement group that cannot be placed waits out `parallel.placement_timeout_s` and then fails with
Ray's resource dictionary; a group that no node and no node type of the autoscaler can ever hold waits for
nothing. So the driver compares what the layout needs (one STRICT_PACK group of cp x tp actors per
replica and stage, each actor's bundle) with the nodes' total resources (`ray.nodes()`) and, when the
cluster has an autoscaler, with the node types it may launch (the `available_node_types` of its cluster
config):

- everything fits on the nodes there are: place now;
- some groups fit only on nodes the autoscaler can add: say so, and what for, and wait for them;
- a group fits on no node and no node type, or the autoscaler's bounds cannot add enough nodes, or there
  is no autoscaler: a ConfigError with the numbers (exit 2, before any actor starts).

`decide` is pure (tests/unit/test_capacity.py runs it on resource dicts); `check` reads Ray. Totals, not
what is free now: resources another run holds come back when it ends, which the placement's timeout
bounds; this check only answers "can it ever fit". It is generous where it cannot know: each type's
`max_workers` counts as free (nodes of that type already up are among the nodes there are, and are not
subtracted), so a refusal is certain and a wait is only possible.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import yaml

from raypar.controller.placement import TIMEOUT_KEY, autoscaler_running, resources_for
from raypar.core.config.errors import ConfigError
from raypar.core.config.rules import RAY_RESOURCES
from raypar.core.config.schema import Config

Resources = dict[str, float]

# Where `ray up` leaves the cluster config on the head, and what the head's autoscaler monitor reads
# (`--autoscaling-config=~/ray_bootstrap_config.yaml`); Ray Tune detects a launched cluster by it too.
BOOTSTRAP_CONFIG = Path("~/ray_bootstrap_config.yaml")

# Besides RAY_RESOURCES, Ray gives every node it starts `node:<ip>` (the head `node:__internal_head__`)
# and `accelerator_type:<name>`: a custom resource a run asks for is any other name.
BUILT_IN_PREFIXES = ("node:", "accelerator_type:")

UNITS = {"GPU": "GPUs", "CPU": "CPUs"}


@dataclass(frozen=True)
class NodeType:
    """A worker type the autoscaler may launch: what each node of it has, and how many it may add."""

    name: str
    resources: Resources
    max_workers: int


@dataclass(frozen=True)
class Need:
    """The run's actors as placement groups: `groups` STRICT_PACK groups of `group_size` bundles each."""

    per_actor: Resources
    group_size: int  # cp x tp actors, which share a node
    groups: int  # dp x pp
    axes: str = "tp"  # the mesh axes of a group ("tp", "cp x tp"), as a refusal names them
    layout: str = ""  # e.g. "dp=2 x pp=1", as a refusal names it

    @property
    def group_key(self) -> str:
        """The config key a refusal of a group too big for any node names."""
        return "parallel.tp" if self.axes == "tp" else "parallel.cp"

    @property
    def per_group(self) -> Resources:
        return {k: v * self.group_size for k, v in self.per_actor.items() if v}


@dataclass(frozen=True)
class Verdict:
    """Fits on the nodes there are (`waits_for` empty), or only after the autoscaler adds `nodes`."""

    waits_for: Resources = field(default_factory=dict)  # summed over the groups left over
    # How the autoscaler could add them: "2 x ray.worker.p5"; or why that was not checked.
    nodes: str = ""

    @property
    def fits_now(self) -> bool:
        return not self.waits_for

    def describe(self) -> str:
        """"16 GPUs and 16 CPUs": what `raypar status` says the run waits for."""
        shown = [k for k in ("GPU", "CPU") if self.waits_for.get(k)] or sorted(self.waits_for)
        return " and ".join(f"{_num(self.waits_for[k])} {UNITS.get(k, k)}" for k in shown)

    def line(self, timeout_s: float) -> str:
        """The one line the driver prints while it waits, with how long it waits."""
        return (
            f"waiting for the autoscaler to add nodes with {self.describe()} ({self.nodes}); each placement "
            f"group waits up to {TIMEOUT_KEY}={timeout_s:g}s"
        )


def _num(x: float) -> str:
    return f"{x:g}"


def _fits(group: Resources, free: Resources) -> bool:
    return all(free.get(k, 0.0) >= v - 1e-9 for k, v in group.items())


def _take(group: Resources, free: Resources) -> None:
    for k, v in group.items():
        free[k] = free.get(k, 0.0) - v


def pack(group: Resources, count: int, nodes: list[Resources]) -> int:
    """How many of `count` identical groups fit on `nodes` (first fit; the capacities are not changed)."""
    free = [dict(n) for n in nodes]
    placed = 0
    for _ in range(count):
        slot = next((f for f in free if _fits(group, f)), None)
        if slot is None:
            break
        _take(group, slot)
        placed += 1
    return placed


def custom_names(resources: Resources) -> set[str]:
    return {k for k in resources if k not in RAY_RESOURCES and not k.startswith(BUILT_IN_PREFIXES)}


def decide(
    need: Need, nodes: list[Resources], autoscaler: bool | None, types: list[NodeType] | None
) -> Verdict:
    """Fits now, fits after scaling (a Verdict naming what it waits for), or a ConfigError with the numbers.
    `autoscaler` None: its monitor did not say; `types` None: the autoscaler's node types are unknown."""
    group = need.per_group
    placed = pack(group, need.groups, nodes)
    if placed == need.groups:
        return Verdict()
    left = need.groups - placed
    scales = autoscaler is not False
    # What nodes may ever hold the groups: those there are, and one of each type the autoscaler launches.
    # With an autoscaler whose types are unknown, nothing can be ruled out.
    known_all = not scales or types is not None
    offered = nodes + ([t.resources for t in types] if scales and types else [])
    for name in sorted(custom_names(group)):
        if known_all and not any(name in r for r in offered):
            known = ", ".join(sorted(set().union(*(custom_names(r) for r in offered)))) or "none"
            where = "no node of the cluster" + (" and no node type of its autoscaler" if scales else "")
            raise ConfigError(f"parallel.node_type: {where} has the resource {name!r} (known: {known})")
    if known_all and not any(_fits(group, r) for r in offered):
        raise ConfigError(_too_big(need, offered, scales))
    if not scales:
        raise ConfigError(
            f"parallel.dp: {need.layout} needs {need.groups} groups of {need.group_size} actors "
            f"({_amounts(group)} each, on one node); the cluster's nodes hold {placed} and it has no "
            "autoscaler to add nodes"
        )
    waits_for = {k: v * left for k, v in group.items()}
    if autoscaler is None:
        return Verdict(waits_for, "no autoscaler report, so neither it nor its node types were checked")
    if types is None:
        return Verdict(waits_for, "its node types are unknown here, so not checked against them")
    added = _add_nodes(group, left, types)
    if added is None:
        bound = ", ".join(f"{t.name} <= {t.max_workers}" for t in types)
        raise ConfigError(
            f"parallel.dp: {need.layout} needs {left} more groups of {need.group_size} actors "
            f"({_amounts(group)} each, on one node) than the cluster's nodes hold, and the autoscaler's "
            f"node types cannot add them within their max_workers ({bound})"
        )
    # Where several types hold a group, the autoscaler picks among them: this is one way, not its plan.
    some = "such as " if sum(_fits(group, t.resources) for t in types) > 1 else ""
    return Verdict(waits_for, some + ", ".join(f"{n} x {t}" for t, n in sorted(added.items())))


def _add_nodes(group: Resources, count: int, types: list[NodeType]) -> dict[str, int] | None:
    """New nodes that hold `count` groups, packed type by type (the type holding the most groups per node
    first); None when the types' max_workers do not allow enough. The autoscaler decides which it really
    launches: this only bounds whether some choice exists."""
    per_node = {t.name: pack(group, count, [t.resources]) for t in types}
    added: dict[str, int] = {}
    for t in sorted(types, key=lambda t: -per_node[t.name]):
        if count <= 0 or not per_node[t.name]:
            break
        n = min(t.max_workers, math.ceil(count / per_node[t.name]))
        if n:
            added[t.name] = n
            count -= n * per_node[t.name]
    return added if count <= 0 else None


def _amounts(r: Resources) -> str:
    return ", ".join(f"{_num(v)} {UNITS.get(k, k)}" for k, v in sorted(r.items()))


# The key a refusal names when the group is one actor: the per-actor knob behind the resource it lacks.
PER_ACTOR_KEYS = {"CPU": "parallel.threads_per_actor", "GPU": "parallel.gpus_per_actor"}


def _too_big(need: Need, offered: list[Resources], scales: bool) -> str:
    """A group no node and no node type holds: the first resource it lacks, with the largest amount there
    is; or, where each resource is somewhere but never all on one node, the whole group."""
    group = need.per_group
    tail = "the autoscaler has no larger type" if scales else "there is no autoscaler"
    lacking = [k for k in sorted(group, key=lambda k: (k != "GPU", k != "CPU", k))
               if not any(r.get(k, 0.0) >= group[k] - 1e-9 for r in offered)]  # fmt: skip
    what = f"a {need.axes} group of {need.group_size}"
    if not lacking:
        where = f"needs {_amounts(group)} on one node for {what}; no node has all of it"
        return f"{need.group_key}: {where} and {tail}"
    short = lacking[0]
    key = need.group_key if need.group_size > 1 else PER_ACTOR_KEYS.get(short, "parallel.node_type")
    unit = UNITS.get(short, short)
    largest = max((r.get(short, 0.0) for r in offered), default=0.0)
    return (
        f"{key}: needs {_num(group[short])} {unit} per node for {what} ({_num(need.per_actor[short])} per "
        f"actor); the largest node has {_num(largest)} and {tail}"
    )


def node_types_from_config(config: dict[str, Any]) -> list[NodeType]:
    """The worker types of a cluster config (`available_node_types`, less the head's)."""
    head = config.get("head_node_type")
    default_max = int(config.get("max_workers", 0))
    return [
        NodeType(name, {k: float(v) for k, v in (body.get("resources") or {}).items()},
                 int(body.get("max_workers", default_max)))  # fmt: skip
        for name, body in (config.get("available_node_types") or {}).items()
        if name != head
    ]


def need_for(cfg: Config, dp: int) -> Need:
    """The placement groups `ActorMesh.start` asks for at `dp` replicas."""
    par = cfg.parallel
    res = resources_for(par.device, par.threads_per_actor, par.gpus_per_actor, par.node_type)
    return Need(
        res.bundle(), par.cp * par.tp, dp * par.pp, axes="tp" if par.cp == 1 else "cp x tp",
        layout=f"dp={dp} x pp={par.pp}",
    )


def node_types_from_raycluster(ray_cr: dict[str, Any]) -> list[NodeType]:
    """The worker groups of a KubeRay RayCluster as the autoscaler sees them: Ray's own converter (the one
    KubeRay's autoscaler runs: rayStartParams' num-cpus, num-gpus and custom `resources`, else the
    containers' limits; max_workers = maxReplicas x numOfHosts)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    return node_types_from_config(_derive_autoscaling_config_from_ray_cr(ray_cr))


# In a KubeRay pod: the cluster's name (KubeRay sets it in every Ray container) and the pod's namespace.
KUBERAY_CLUSTER_ENV = "RAY_CLUSTER_NAME"
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def kuberay_node_types() -> list[NodeType] | None:
    """In a KubeRay pod (the head, where a RayJob's driver runs): the RayCluster read from the Kubernetes
    API with the pod's service account, as KubeRay's autoscaler reads it; None outside KubeRay or when the
    API refuses (the head's service account may not get rayclusters: the check then waits, not refuses)."""
    name = os.environ.get(KUBERAY_CLUSTER_ENV)
    if not name or not POD_NAMESPACE_FILE.is_file():
        return None
    from ray.autoscaler._private.kuberay.node_provider import KubernetesHttpApiClient

    try:
        ray_cr = KubernetesHttpApiClient(POD_NAMESPACE_FILE.read_text().strip()).get(f"rayclusters/{name}")
    except Exception as err:  # noqa: BLE001 - no API access: the node types are unknown, said once
        print(f"raypar: cannot read RayCluster {name} from Kubernetes ({err}); its groups are not checked",
              file=sys.stderr)  # fmt: skip
        return None
    return node_types_from_raycluster(ray_cr)


def autoscaler_node_types() -> list[NodeType] | None:
    """The worker types the autoscaler may launch: from the config `ray up` left on the head (where
    `ray job submit` and `ray attach` run the driver), or under KubeRay from the RayCluster; None elsewhere
    (a driver off the head, a cluster started by hand with --autoscaling-config): Ray has no public call
    that returns them."""
    path = BOOTSTRAP_CONFIG.expanduser()
    if path.is_file():
        return node_types_from_config(yaml.safe_load(path.read_text()))
    return kuberay_node_types()


def check(cfg: Config, dp: int) -> Verdict:
    """`decide` on this cluster. The autoscaler is asked about only when the nodes there are fall short:
    its monitor may take seconds to report (placement.autoscaler_running)."""
    need = need_for(cfg, dp)
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if pack(need.per_group, need.groups, nodes) == need.groups:
        return Verdict()
    return decide(need, nodes, autoscaler_running(), autoscaler_node_types())
