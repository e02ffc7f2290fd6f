"""cluster.yaml and examples/cluster-local.yaml, checked offline with Ray's own config code.

`ray up` runs `prepare_config` (merge the provider's defaults.yaml, fill per-type worker bounds) and
`validate_config` (ray-schema.json plus a few rules) before any cloud call; both are offline, and so
is the autoscaler's bin packing. What `ray up` does next for AWS (`fillout_available_node_types_resources`,
`bootstrap_config`: IAM, key pairs, subnets) needs an AWS account and is left out.

One smoke test starts the fake cluster for real. No test here calls `ray.init` in this process or
`ray stop`: other tests share a local Ray instance in this process, and other Ray instances may run
on the machine.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer, get_nodes_for
from ray.autoscaler._private.util import fill_node_type_min_max_workers, prepare_config, validate_config

try:
    from tests.fake_cluster import FakeCluster
except ImportError:  # pytest run without the repository root on sys.path
    from fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster.yaml"
LOCAL_YAML = ROOT / "examples" / "cluster-local.yaml"

Config = dict[str, Any]


def load(path: Path) -> Config:
    return yaml.safe_load(path.read_text())


def ray_prepare_and_validate(config: Config) -> Config:
    """What `ray up` does to a config before it first talks to the cloud."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def ray_validate_fake(config: Config) -> Config:
    """What the autoscaler does with a fake_multinode config: it reads it as written (Ray's wheel has
    no defaults file for this provider, so `prepare_config` fails), validates it, and fills in
    per-type worker bounds."""
    config = copy.deepcopy(config)
    validate_config(config)
    fill_node_type_min_max_workers(config)
    validate_config(config)
    return config


def check_worker_bounds(config: Config) -> None:
    """Bounds Ray leaves unchecked: validate_config compares only the sum of min_workers with the
    global max_workers, not each type's min with its max."""
    for name, node_type in config["available_node_types"].items():
        lo, hi = node_type.get("min_workers", 0), node_type.get("max_workers", config["max_workers"])
        if not 0 <= lo <= hi <= config["max_workers"]:
            raise ValueError(
                f"{name}: need 0 <= min_workers ({lo}) <= max_workers ({hi}) <= {config['max_workers']}"
            )


def worker_types(config: Config) -> dict[str, Config]:
    return {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}


def start_command(commands: list[str]) -> str:
    (line,) = [c for c in commands if "ray start" in c]
    return line


# -- cluster.yaml -------------------------------------------------------------------------------


def test_cluster_yaml_passes_rays_preparation_and_validation() -> None:
    config = ray_prepare_and_validate(load(CLUSTER_YAML))
    check_worker_bounds(config)
    assert config["provider"]["type"] == "aws"
    assert config["available_node_types"][config["head_node_type"]]["max_workers"] == 0


def test_head_has_no_gpus_and_two_worker_types_have_eight() -> None:
    config = load(CLUSTER_YAML)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert not re.match(r"(p\d|g\d)", head["node_config"]["InstanceType"])  # not a GPU instance family
    workers = worker_types(config)
    assert len(workers) == 2
    families = sorted(w["node_config"]["InstanceType"].split(".")[0] for w in workers.values())
    assert re.fullmatch(r"g[56]", families[0]) and re.fullmatch(r"p4d|p5", families[1]), families
    for name, worker in workers.items():
        assert worker["resources"]["GPU"] == 8, name
        assert 0 <= worker["min_workers"] <= worker["max_workers"], name


def test_every_node_pins_an_ami() -> None:
    # Without ImageId, `ray up` picks Ray's built-in Ubuntu 18.04 / CUDA 11 DLAMI, too old for H100.
    for name, node_type in load(CLUSTER_YAML)["available_node_types"].items():
        assert node_type["node_config"].get("ImageId"), name


def test_token_auth_and_private_dashboard() -> None:
    config = ray_prepare_and_validate(load(CLUSTER_YAML))
    # The token made by `ray get-auth-token --generate` is mounted at Ray's default path on each node.
    assert config["file_mounts"]["/home/ubuntu/.ray/auth_token"] == "~/.ray/auth_token"
    head_start = start_command(config["head_start_ray_commands"])
    worker_start = start_command(config["worker_start_ray_commands"])
    for line in (head_start, worker_start):
        assert "RAY_AUTH_MODE=token ray start" in line
    assert any("export RAY_AUTH_MODE=token" in c for c in config["initialization_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "0.0.0.0" not in CLUSTER_YAML.read_text()


def test_raypar_is_mounted_and_installed_on_every_node() -> None:
    config = ray_prepare_and_validate(load(CLUSTER_YAML))
    assert config["file_mounts"]["/home/ubuntu/raypar"] == "."
    install = "pip install -e '/home/ubuntu/raypar[gpu]'"
    # prepare_config folds setup_commands into both of these lists.
    assert install in config["head_setup_commands"]
    assert install in config["worker_setup_commands"]
    assert ".gitignore" in config["rsync_filter"]  # keeps the local .venv out of the upload


def test_autoscaler_packs_gpu_demand_onto_gpu_nodes_within_bounds() -> None:
    config = ray_prepare_and_validate(load(CLUSTER_YAML))
    scorer = functools.partial(
        _default_utilization_scorer, node_availability_summary=NodeAvailabilitySummary({})
    )

    def plan(demand: list[dict[str, float]]) -> tuple[dict[str, int], list[dict[str, float]]]:
        to_add, residual = get_nodes_for(
            config["available_node_types"],
            {},
            config["head_node_type"],
            config["max_workers"],
            demand,
            scorer,
        )
        return dict(to_add), residual

    to_add, residual = plan([{"GPU": 1, "CPU": 1}] * 16)  # e.g. dp=2 x tp=8 actors
    assert sum(to_add.values()) == 2 and residual == []
    assert config["head_node_type"] not in to_add
    # More whole-node demands than max_workers allows: the rest stays pending.
    to_add, residual = plan([{"GPU": 8}] * (config["max_workers"] + 1))
    assert sum(to_add.values()) == config["max_workers"] and len(residual) == 1


# Broken copies of cluster.yaml: each must be refused by Ray's own preparation and validation.
def _unknown_top_level_key(c: Config) -> None:
    c["max_wrokers"] = 3


def _unknown_node_type_key(c: Config) -> None:
    c["available_node_types"]["ray.worker.p5"]["gpus"] = 8


def _head_type_missing(c: Config) -> None:
    c["head_node_type"] = "ray.head.gone"


def _min_workers_above_global_max(c: Config) -> None:
    c["available_node_types"]["ray.worker.p5"]["min_workers"] = c["max_workers"] + 1


def _fractional_gpus(c: Config) -> None:
    c["available_node_types"]["ray.worker.g6"]["resources"]["GPU"] = 7.5


def _no_resources(c: Config) -> None:
    del c["available_node_types"]["ray.worker.g6"]["resources"]


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (_unknown_top_level_key, "'max_wrokers' was unexpected"),
        (_unknown_node_type_key, "'gpus' was unexpected"),
        (_head_type_missing, "`head_node_type` must be one of"),
        (_min_workers_above_global_max, "smaller than the sum of `min_workers`"),
        (_fractional_gpus, "7.5 is not of type 'integer'"),
        (_no_resources, "'resources' is a required property"),
    ],
)
def test_broken_copy_is_refused_by_ray(breakage: Callable[[Config], None], message: str) -> None:
    config = load(CLUSTER_YAML)
    breakage(config)
    with pytest.raises((jsonschema.ValidationError, ValueError), match=re.escape(message)):
        ray_prepare_and_validate(config)


def test_min_workers_above_max_workers_is_refused() -> None:
    config = load(CLUSTER_YAML)
    config["available_node_types"]["ray.worker.p5"].update(min_workers=3, max_workers=1)
    ray_prepare_and_validate(config)  # Ray accepts this...
    with pytest.raises(ValueError, match="ray.worker.p5"):
        check_worker_bounds(config)  # ...so the test checks it itself


# -- examples/cluster-local.yaml ----------------------------------------------------------------


def test_local_yaml_passes_rays_validation() -> None:
    config = ray_validate_fake(load(LOCAL_YAML))
    check_worker_bounds(config)
    provider = config["provider"]
    assert provider["type"] == "fake_multinode"
    for key in ("use_node_id_as_ip", "disable_node_updaters", "disable_launch_config_check"):
        assert provider[key] is True, key
    # The monitor reads these keys without defaults to fall back on.
    for key in ("file_mounts", "cluster_synced_files", "setup_commands", "head_setup_commands",
                "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands",
                "initialization_commands"):  # fmt: skip
        assert key in config, key
    # The fake provider registers its head under this type name.
    assert config["head_node_type"] == "ray.head.default"


def test_local_yaml_mirrors_cluster_yaml() -> None:
    real, fake = load(CLUSTER_YAML), load(LOCAL_YAML)
    assert worker_types(fake).keys() == worker_types(real).keys()
    for name, worker in worker_types(fake).items():
        assert worker["resources"]["GPU"] == worker_types(real)[name]["resources"]["GPU"] == 8
        assert worker["resources"]["CPU"] <= 2  # fake nodes are processes on one small machine
    assert fake["available_node_types"][fake["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert fake["max_workers"] <= 3


def test_broken_local_copy_is_refused_by_ray() -> None:
    config = load(LOCAL_YAML)
    del config["cluster_synced_files"]
    with pytest.raises(RuntimeError, match="cluster_synced_files"):
        ray_validate_fake(config)


# -- the fake cluster, for real -----------------------------------------------------------------


def live_processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes():
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(proc.name))
        except OSError:
            pass
    return found


DRIVER = """
import json, time, ray
ray.init()
before = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
pg = ray.util.placement_group([{"GPU": 1}])
t0 = time.monotonic()
ready = pg.wait(timeout_seconds=120)
print("RESULT", json.dumps({
    "ready": ready,
    "seconds": time.monotonic() - t0,
    "before": before,
    "after": [n["Resources"] for n in ray.nodes() if n["Alive"]],
}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FakeCluster finds its processes in /proc")
@pytest.mark.timeout(240)
def test_fake_cluster_adds_a_gpu_node_on_demand_and_stops_cleanly() -> None:
    started = time.monotonic()
    with FakeCluster(LOCAL_YAML) as cluster:
        assert cluster.pids()
        result = cluster.run_driver(DRIVER, timeout_s=180)
        assert result.returncode == 0, result.stderr[-3000:] + cluster.log_tail()
        # Autoscaler event lines interleave with the driver's stdout; take the marked line.
        (line,) = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
        report = json.loads(line.removeprefix("RESULT "))
        # The session bookkeeping covers every process that names the temp dir, fake node included.
        tracked = cluster.pids()
        mentioning = set(live_processes_mentioning(str(cluster.temp_dir)))
        assert len(mentioning) > 5 and mentioning <= tracked | cluster.pids()
        assert report["ready"], cluster.log_tail()  # monitor.log says why no node came
        assert len(report["before"]) == 1  # the head alone
        assert [r.get("GPU") for r in report["after"]].count(8.0) == 1  # one fake GPU node was added
        assert report["seconds"] < 120
    assert not cluster.pids()  # every process it started is gone (zombies count as gone)
    # Independently of the session bookkeeping: no live process still names the cluster's temp dir
    # (GCS, raylets, agents and the monitor all carry it in their command lines).
    assert not live_processes_mentioning(str(cluster.temp_dir))
    assert len(cluster.seen_pids) > 5
    print(f"fake node added after {report['seconds']:.1f} s; whole run {time.monotonic() - started:.1f} s")
