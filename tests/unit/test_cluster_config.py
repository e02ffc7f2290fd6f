"""cluster.yaml and examples/cluster-local.yaml, checked offline with Ray's own config code.

`ray up` runs `prepare_config` (merge the provider's defaults.yaml, fill per-type worker bounds) and
`validate_config` (ray-schema.json plus a few rules) before any cloud call; both are offline, and so
is the autoscaler's bin packing. What `ray up` does next for AWS (`fillout_available_node_types_resources`,
`bootstrap_config`: IAM, key pairs, subnets) needs an AWS account and is left out.

The fake cluster started for real: tests/cluster/test_fake_cluster_e2e.py. No test here calls `ray.init`
in this process or `ray stop`: other tests share a local Ray instance in this process, and other Ray
instances may run on the machine.
"""

from __future__ import annotations

import copy
import functools
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.specifiers import SpecifierSet
from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces
from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer, get_nodes_for
from ray.autoscaler._private.util import fill_node_type_min_max_workers, prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
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


# The values a user fills in before the first `ray up` (docs/cluster.md), and sample values for them.
SET_ME = {
    "ami-SET-ME-ubuntu-22.04": "ami-0123456789abcdef0",
    "ami-SET-ME-dlami-base-ubuntu-22.04": "ami-0fedcba9876543210",
    "sg-SET-ME-raypar-sg": "sg-0123456789abcdef0",
    "subnet-SET-ME-efa": "subnet-0123456789abcdef0",
}
SG_TEMPLATE = ROOT / "examples" / "aws-security-group.yaml"
PYPROJECT = ROOT / "pyproject.toml"


def configured(text: str) -> Config:
    for placeholder, value in SET_ME.items():
        text = text.replace(placeholder, value)
    return yaml.safe_load(text)


def test_only_the_documented_values_are_left_to_set() -> None:
    text = CLUSTER_YAML.read_text()
    values = "\n".join(line.split("#")[0] for line in text.splitlines())  # not the comments
    assert set(re.findall(r"[\w-]*SET-ME[\w.-]*", values)) == set(SET_ME)
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert all(placeholder in docs for placeholder in SET_ME)  # the docs say how to fill each one
    ray_prepare_and_validate(configured(text))


def test_every_node_pins_its_ami() -> None:
    # Without ImageId, `ray up` picks Ray's built-in Ubuntu 18.04 / CUDA 11 DLAMI, too old for H100. A
    # moving alias (an SSM "latest"/"current" parameter) would give nodes the autoscaler adds later
    # another image than the first ones.
    for name, node_type in configured(CLUSTER_YAML.read_text())["available_node_types"].items():
        assert re.fullmatch(r"ami-[0-9a-f]{8,17}", node_type["node_config"]["ImageId"]), name


def test_every_pip_install_is_pinned() -> None:
    config = ray_prepare_and_validate(configured(CLUSTER_YAML.read_text()))
    commands = config["head_setup_commands"] + config["worker_setup_commands"]
    installs = [c for c in commands if "pip install" in c]
    assert installs
    for command in installs:
        for arg in command.split("pip install", 1)[1].split():
            assert arg.startswith("-") or "==" in arg or arg == "'/home/ubuntu/raypar[gpu]'", command
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    for dep in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        assert "==" in dep, dep


def test_nodes_use_the_declared_security_group() -> None:
    """Ray's launcher makes a security group for every node type without SecurityGroupIds, with SSH from
    0.0.0.0/0 (ray/autoscaler/_private/aws/config.py: _configure_security_group, and
    _create_default_ssh_inbound_rules). Every type names the group of examples/aws-security-group.yaml."""
    config = configured(CLUSTER_YAML.read_text())
    # A type with NetworkInterfaces (p5, for EFA) names its groups in each interface; Ray collects them.
    nodes = [_configure_subnets_and_groups_from_network_interfaces(t["node_config"])
             if "NetworkInterfaces" in t["node_config"] else t["node_config"]
             for t in config["available_node_types"].values()]  # fmt: skip
    groups = [sorted(set(n.get("SecurityGroupIds", []))) for n in nodes]
    assert groups[0] == [SET_ME["sg-SET-ME-raypar-sg"]] and all(g == groups[0] for g in groups), groups
    assert "security_group" not in config["provider"]  # Ray's own would add SSH from 0.0.0.0/0


def _ingress(template: Config) -> list[Config]:
    resources = template["Resources"]
    rules = list(resources["ClusterGroup"]["Properties"]["SecurityGroupIngress"])
    rules += [r["Properties"] for r in resources.values() if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
    return rules


def test_security_group_opens_ssh_to_the_users_cidr_and_ports_only_inside() -> None:
    template = yaml.safe_load(SG_TEMPLATE.read_text())
    member = {"Fn::GetAtt": ["ClusterGroup", "GroupId"]}
    by_cidr = [r for r in _ingress(template) if "CidrIp" in r or "CidrIpv6" in r]
    assert by_cidr == [{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "CidrIp": {"Ref": "SshCidr"}}]
    others = [r for r in _ingress(template) if r not in by_cidr]
    assert others and all(r["SourceSecurityGroupId"] == member for r in others), others
    cidr = template["Parameters"]["SshCidr"]
    assert "Default" not in cidr  # the user sets it
    pattern = re.compile(cidr["AllowedPattern"])
    for good in ("203.0.113.7/32", "10.0.0.0/8"):
        assert pattern.search(good), good
    for bad in ("0.0.0.0/0", "::/0", "203.0.113.7", "me"):  # control: the pattern does reject
        assert not pattern.search(bad), bad


def _cluster_python(config: Config) -> str:
    """The Python version of the venv every node runs raypar in: from `pythonX.Y -m venv ~/venv`."""
    (command,) = [c for c in config["setup_commands"] if "-m venv ~/venv" in c]
    match = re.search(r"python(3\.\d+) -m venv ~/venv", command)
    assert match, f"the venv is not made from a versioned python: {command}"
    return match.group(1)


def test_the_cluster_runs_a_python_raypar_supports() -> None:
    config = load(CLUSTER_YAML)
    version = _cluster_python(config)
    requires = SpecifierSet(tomllib.loads(PYPROJECT.read_text())["project"]["requires-python"])
    assert f"{version}.0" in requires, (version, str(requires))
    # The setup installs that interpreter where the image lacks it.
    apt = f"apt-get install -y python{version} python{version}-venv"
    assert any(apt in c for c in config["setup_commands"])
    # Control: the images' own Python (3.10) fails the same check, and so does the old setup.
    assert "3.10.12" not in requires
    old = copy.deepcopy(config)
    old["setup_commands"] = ["test -x ~/venv/bin/python || python3 -m venv ~/venv"]
    with pytest.raises(AssertionError, match="not made from a versioned python"):
        _cluster_python(old)


def test_auth_token_is_never_readable_by_others() -> None:
    config = load(CLUSTER_YAML)
    # On the nodes, ~/.ray is closed before the launcher copies the token in (initialization_commands run
    # before file_mounts), and the token itself is made private.
    first = config["initialization_commands"][0]
    assert first.startswith("umask 077") and "chmod 700 ~/.ray" in first
    assert "chmod 600 ~/.ray/auth_token" in config["setup_commands"]
    # Locally, the token is created under umask 077 (Ray writes it with the process's umask).
    for text in (CLUSTER_YAML.read_text(), (ROOT / "docs" / "cluster.md").read_text()):
        generates = [line for line in text.splitlines() if "ray get-auth-token --generate" in line]
        assert generates and all("umask 077" in line for line in generates), generates


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
        # The custom resource `parallel.node_type` asks for: the same name on the same type.
        custom = [{k: v for k, v in w["resources"].items() if k not in ("CPU", "GPU")}
                  for w in (worker, worker_types(real)[name])]  # fmt: skip
        assert custom[0] == custom[1] == {name.removeprefix("ray.worker."): 1}, custom
        assert worker["resources"]["CPU"] <= 2  # fake nodes are processes on one small machine
    assert fake["available_node_types"][fake["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert fake["max_workers"] <= 3


def test_broken_local_copy_is_refused_by_ray() -> None:
    config = load(LOCAL_YAML)
    del config["cluster_synced_files"]
    with pytest.raises(RuntimeError, match="cluster_synced_files"):
        ray_validate_fake(config)


# -- the fake cluster, for real -----------------------------------------------------------------
