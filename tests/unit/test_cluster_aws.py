"""cluster.yaml's AWS parts beyond Ray's schema, checked offline: the workers' IAM instance profile and its
policy documents (S3 on the user's bucket only), EFA on the p5 nodes through Ray's own network-interface
rules, the security group EFA needs, and the NCCL settings for it. The commands docs/cluster.md gives for
them use these files (checked here too); the rest of the yaml: tests/unit/test_cluster_config.py."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces

from tests.unit.test_cluster_config import (
    CLUSTER_YAML,
    SET_ME,
    SG_TEMPLATE,
    configured,
    ray_prepare_and_validate,
    worker_types,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
WORKER_POLICY = EXAMPLES / "aws-worker-s3-policy.json"
TRUST_POLICY = EXAMPLES / "aws-ec2-trust-policy.json"
PASS_ROLE_POLICY = EXAMPLES / "aws-head-pass-role-policy.json"
NCCL_EFA = EXAMPLES / "nccl-efa.sh"
DOCS = (ROOT / "docs" / "cluster.md").read_text()
BUCKET = "my-raypar-bucket"
# The docs' shell variables, each holding the value of one SET-ME placeholder.
SHELL_VARS = {
    "SG": "sg-SET-ME-raypar-sg",
    "SUBNET": "subnet-SET-ME-efa",
    "HEAD_AMI": "ami-SET-ME-ubuntu-22.04",
    "GPU_AMI": "ami-SET-ME-dlami-base-ubuntu-22.04",
}

# What pyarrow's S3 filesystem does with checkpoints and datasets: list, read, write (multipart too, and
# abort a failed one), delete (`checkpoint.keep` prunes old checkpoints). Nothing else.
OBJECT_ACTIONS = {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}


def policy(path: Path, **values: str) -> dict[str, Any]:
    """A policy file with its SET-ME placeholders filled, as the docs' `sed` fills them."""
    text = path.read_text()
    for name, value in values.items():
        text = text.replace(f"SET-ME-{name}", value)
    return json.loads(text)


def statements(doc: dict[str, Any]) -> list[dict[str, Any]]:
    assert doc["Version"] == "2012-10-17"
    # A trust policy names a Principal and no Resource.
    return [{**s, "Action": _list(s["Action"]), "Resource": _list(s.get("Resource", []))}
            for s in doc["Statement"]]  # fmt: skip


def _list(x: str | list[str]) -> list[str]:
    return [x] if isinstance(x, str) else list(x)


def check_bucket_only(doc: dict[str, Any], bucket: str) -> None:
    """Least privilege: ListBucket on the bucket, object actions on its objects, nothing else anywhere."""
    bucket_arn = f"arn:aws:s3:::{bucket}"
    for s in statements(doc):
        if s["Effect"] != "Allow":
            continue
        for resource in s["Resource"]:
            if resource not in (bucket_arn, f"{bucket_arn}/*"):
                raise ValueError(f"resource {resource!r} is not bucket {bucket} or its objects")
        for action in s["Action"]:
            if "*" in action:
                raise ValueError(f"action {action!r} is a wildcard")
            on_bucket = action == "s3:ListBucket"
            if not on_bucket and action not in OBJECT_ACTIONS:
                raise ValueError(f"action {action!r} is not one the workers need")
            if s["Resource"] != [bucket_arn if on_bucket else f"{bucket_arn}/*"]:
                where = "the bucket" if on_bucket else "its objects"
                raise ValueError(f"action {action!r} on {s['Resource']}, not on {where}")


def test_workers_get_the_s3_instance_profile() -> None:
    """Ray's bootstrap gives an instance profile to the head only (aws/config.py: _configure_iam_role puts it
    in `head_node`); a worker without one has no credentials for s3://."""
    config = configured(CLUSTER_YAML.read_text())
    for name, worker in worker_types(config).items():
        assert worker["node_config"]["IamInstanceProfile"] == {"Name": "raypar-worker"}, name
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    assert "IamInstanceProfile" not in head  # Ray's ray-autoscaler-v1: EC2 to launch workers, and S3
    # The docs make the profile of that name from these files.
    for command in (
        "--assume-role-policy-document file://examples/aws-ec2-trust-policy.json",
        "--instance-profile-name raypar-worker",
        "--role-name raypar-worker",
        'sed "s/SET-ME-bucket/$BUCKET/g" examples/aws-worker-s3-policy.json',
        'sed "s/SET-ME-account/$ACCOUNT/g" examples/aws-head-pass-role-policy.json',
    ):
        assert command in DOCS, command


def test_worker_policy_reaches_the_named_bucket_only() -> None:
    doc = policy(WORKER_POLICY, bucket=BUCKET)
    check_bucket_only(doc, BUCKET)
    actions = {a for s in statements(doc) for a in s["Action"]}
    assert actions == OBJECT_ACTIONS | {"s3:ListBucket"}
    assert re.findall(r"SET-ME-\w+", WORKER_POLICY.read_text()) == ["SET-ME-bucket"] * 2


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda s: s[1].update(Resource="*"), "resource '\\*' is not bucket my-raypar-bucket or its objects"),
        (lambda s: s[1].update(Resource="arn:aws:s3:::other/*"), "resource 'arn:aws:s3:::other/\\*' is not"),
        (lambda s: s[1].update(Action="s3:*"), "action 's3:\\*' is a wildcard"),
        (lambda s: s[1]["Action"].append("s3:PutBucketPolicy"), "'s3:PutBucketPolicy' is not one the"),
        (lambda s: s[0].update(Resource=f"arn:aws:s3:::{BUCKET}/*"), "'s3:ListBucket' on .*, not on the b"),
    ],
)
def test_a_broader_policy_fails_the_check(breakage: Any, message: str) -> None:
    doc = policy(WORKER_POLICY, bucket=BUCKET)
    broken = copy.deepcopy(doc)
    breakage(broken["Statement"])
    with pytest.raises(ValueError, match=message):
        check_bucket_only(broken, BUCKET)


def test_trust_and_pass_role_policies() -> None:
    (trust,) = statements(json.loads(TRUST_POLICY.read_text()))
    assert trust["Principal"] == {"Service": "ec2.amazonaws.com"} and trust["Action"] == ["sts:AssumeRole"]
    # Launching a worker with a role needs iam:PassRole on that role, which Ray's default head role lacks.
    (pass_role,) = statements(policy(PASS_ROLE_POLICY, account="123456789012"))
    assert pass_role["Action"] == ["iam:PassRole"]
    assert pass_role["Resource"] == ["arn:aws:iam::123456789012:role/raypar-worker"]


def p5_node_config() -> dict[str, Any]:
    return configured(CLUSTER_YAML.read_text())["available_node_types"]["ray.worker.p5"]["node_config"]


def test_p5_has_an_efa_interface_on_every_network_card() -> None:
    node = p5_node_config()
    interfaces = node["NetworkInterfaces"]
    assert sorted(i["NetworkCardIndex"] for i in interfaces) == list(range(32))  # p5.48xlarge has 32
    primary = [i for i in interfaces if i["DeviceIndex"] == 0]
    assert primary == [i for i in interfaces if i["NetworkCardIndex"] == 0]
    assert primary[0]["InterfaceType"] == "efa"
    assert {i["InterfaceType"] for i in interfaces if i not in primary} == {"efa-only"}
    assert node["Placement"] == {"GroupName": "raypar-p5"}
    assert "create-placement-group --region us-west-2 --group-name raypar-p5 --strategy cluster" in DOCS
    # What Ray's launcher makes of it: subnets and groups gathered from the interfaces.
    launched = _configure_subnets_and_groups_from_network_interfaces(node)
    assert set(launched["SubnetIds"]) == {SET_ME["subnet-SET-ME-efa"]}
    assert set(launched["SecurityGroupIds"]) == {SET_ME["sg-SET-ME-raypar-sg"]}


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda n: n.update(SecurityGroupIds=["sg-1"]), "must ONLY be given in each NetworkInterface"),
        (lambda n: n["NetworkInterfaces"][5].pop("SubnetId"), "at least one is missing a subnet"),
        (lambda n: n["NetworkInterfaces"][0].pop("Groups"), "at least one is missing a security group"),
    ],
)
def test_broken_efa_interfaces_are_refused_by_ray(breakage: Any, message: str) -> None:
    node = copy.deepcopy(p5_node_config())
    breakage(node)
    with pytest.raises(ValueError, match=message):
        _configure_subnets_and_groups_from_network_interfaces(node)


def test_security_group_passes_all_traffic_between_members() -> None:
    """EFA needs every protocol in from and out to the group itself (AWS's EFA guide): the members' rule
    opens all protocols, and no egress rule narrows CloudFormation's default of all traffic out."""
    template = yaml.safe_load(SG_TEMPLATE.read_text())
    resources = template["Resources"]
    members = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
    assert [m["IpProtocol"] for m in members] == ["-1"]
    assert "SecurityGroupEgress" not in resources["ClusterGroup"]["Properties"]
    assert not [r for r in resources.values() if r["Type"] == "AWS::EC2::SecurityGroupEgress"]


def test_nccl_efa_settings_reach_ray_start_only_where_efa_is() -> None:
    setup = yaml.safe_load(CLUSTER_YAML.read_text())["setup_commands"]
    assert any("echo 'source ~/raypar/examples/nccl-efa.sh' >> ~/.bashrc" in c for c in setup)
    text = NCCL_EFA.read_text()
    for setting in ("export FI_PROVIDER=efa", "export FI_EFA_USE_DEVICE_RDMA=1", "libnccl-net*.so"):
        assert setting in text, setting
    subprocess.run(["bash", "-n", str(NCCL_EFA)], check=True)
    # On a node without EFA (this machine, a g6, the head) it sets nothing: NCCL keeps to sockets.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FI_")}
    shown = subprocess.run(
        ["bash", "-c", f'source {NCCL_EFA}; echo "FI_PROVIDER=${{FI_PROVIDER-unset}}"'],
        env=env, capture_output=True, text=True, check=True,
    ).stdout
    has_efa = Path("/opt/amazon/efa/bin/fi_info").exists()
    assert shown.strip() == ("FI_PROVIDER=efa" if has_efa else "FI_PROVIDER=unset")


def test_the_docs_fill_in_commands_give_what_ray_validates(tmp_path: Path) -> None:
    """docs/cluster.md's own `sed` lines, run on copies: cluster.yaml with every SET-ME filled passes Ray's
    preparation and validation, and the bucket policy they write passes the least-privilege check."""
    (fill,) = re.findall(r'^   (sed -i "s/sg-SET-ME-raypar-sg/.*? cluster\.yaml)$', DOCS, re.S | re.M)
    (policy_sed,) = re.findall(r'^   (sed "s/SET-ME-bucket/\$BUCKET/g" .*)$', DOCS, re.M)
    (tmp_path / "examples").mkdir()
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML.read_text())
    (tmp_path / "examples" / WORKER_POLICY.name).write_text(WORKER_POLICY.read_text())
    values = {**{var: SET_ME[placeholder] for var, placeholder in SHELL_VARS.items()}, "BUCKET": BUCKET}
    for command in (fill, policy_sed.replace("/tmp/", f"{tmp_path}/")):
        subprocess.run(["bash", "-c", command], cwd=tmp_path, env={**os.environ, **values}, check=True)
    text = (tmp_path / "cluster.yaml").read_text()
    assert "SET-ME" not in "\n".join(line.split("#")[0] for line in text.splitlines())
    ray_prepare_and_validate(yaml.safe_load(text))
    check_bucket_only(json.loads((tmp_path / "raypar-worker-s3.json").read_text()), BUCKET)
    # Control: the yaml as shipped, not filled in, is what the sed lines change.
    assert "SET-ME" in CLUSTER_YAML.read_text()
