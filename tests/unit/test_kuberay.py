"""examples/kuberay/: the manifests parse, their worker groups (read by Ray's own KubeRay converter, what
the capacity check reads in a KubeRay pod) declare the custom resources the example config's
`parallel.node_type` asks for, every worker pod drains its Ray node within its grace period, and the
RayJob's entrypoint is the resumable one (`--resume latest` starts at step 0 with no checkpoint yet)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from raypar.controller import capacity
from raypar.core.config.errors import ConfigError
from raypar.core.run_config import load_config
from tests.support.kuberay import IMAGE_REPO, KUBERAY, entrypoint, manifest


def raycluster() -> dict[str, Any]:
    cr = manifest("raycluster.yaml")
    cr["metadata"].setdefault("namespace", "default")  # kubectl fills it in
    return cr


def test_manifests_parse():
    kinds = {p.name: [d["kind"] for d in yaml.safe_load_all(p.read_text())] for p in KUBERAY.glob("*.yaml")}
    assert kinds == {
        "raycluster.yaml": ["RayCluster"],
        "rayjob.yaml": ["RayJob"],
        "storage.yaml": ["PersistentVolumeClaim"],
    }
    assert (
        manifest("rayjob.yaml")["spec"]["clusterSelector"]["ray.io/cluster"]
        == raycluster()["metadata"]["name"]
    )


def test_worker_groups_hold_the_example_run():
    """The capacity check, on the groups as KubeRay's autoscaler sees them: the RayJob's config (CPU group)
    and its GPU variant wait for the autoscaler (no node yet), and a group without the custom resource is
    refused (the negative control: the same check, the resource renamed)."""
    types = {t.name: t for t in capacity.node_types_from_raycluster(raycluster())}
    gib = 2.0**30  # the containers' memory limits
    assert types["cpu"].resources == {"CPU": 8.0, "memory": 32 * gib, "raypar-cpu": 1.0}
    assert types["cpu"].max_workers == 4
    assert types["gpu"].resources == {"CPU": 32.0, "GPU": 8.0, "memory": 480 * gib, "raypar-gpu": 1.0}
    assert types["gpu"].max_workers == 2
    config = entrypoint()[2].replace(IMAGE_REPO, str(KUBERAY.parents[1]))
    for overrides, group in (([], "cpu"), (["parallel.node_type=raypar-gpu", "parallel.device=gpu"], "gpu")):
        cfg = load_config(config, overrides)
        verdict = capacity.decide(capacity.need_for(cfg, cfg.dp_fixed), [], True, list(types.values()))
        assert verdict.nodes == f"1 x {group}", verdict  # both replicas on one node of the group
    cfg = load_config(config, [])
    renamed = [capacity.NodeType(t.name, {k.replace("raypar-", "x-"): v for k, v in t.resources.items()},
                                 t.max_workers) for t in types.values()]  # fmt: skip
    with pytest.raises(ConfigError, match="parallel.node_type: no node of the cluster and no node type"):
        capacity.decide(capacity.need_for(cfg, cfg.dp_fixed), [], True, renamed)


def test_worker_pods_drain_within_their_grace_period_and_carry_the_token():
    for group in raycluster()["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        command = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
        assert "ray drain-node" in command and "DRAIN_NODE_REASON_PREEMPTION" in command, command
        deadline = int(re.search(r"--deadline-remaining-seconds (\d+)", command)[1])
        assert deadline < pod["terminationGracePeriodSeconds"], (
            deadline,
            pod["terminationGracePeriodSeconds"],
        )
    heads = raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    workers = [
        c for g in raycluster()["spec"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]
    ]
    for container in heads + workers:
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "raypar-ray-token"
        assert {"mountPath": "/mnt/checkpoints", "name": "checkpoints"} in container["volumeMounts"]


def test_rayjob_resumes_on_the_shared_claim():
    args = entrypoint()
    assert (
        args[:2] == ["raypar", "train"]
        and "--address" in args
        and args[args.index("--address") + 1] == "auto"
    )
    assert args[args.index("--resume") + 1] == "latest"
    cfg = load_config(args[2].replace(IMAGE_REPO, str(KUBERAY.parents[1])), [])
    assert cfg.checkpoint.dir.startswith("/mnt/checkpoints/") and args[
        args.index("--run-dir") + 1
    ].startswith("/mnt/checkpoints/")


def test_resume_latest_starts_fresh_only_where_no_checkpoint_was_ever_written(tmp_path, capsys):
    """The RayJob's `--resume latest` on its first submission (an empty checkpoint.dir, or none yet):
    step 0, said on one line. A checkpoint.dir holding only damaged step directories is still refused
    (the control: starting over there would silently throw a run away)."""
    from raypar.controller import preflight
    from tests.support.runs import tiny

    root = tmp_path / "ckpt"
    assert preflight.resolve_resume(tiny(f"checkpoint.dir='{root}'"), "latest") is None
    root.mkdir()
    assert preflight.resolve_resume(tiny(f"checkpoint.dir='{root}'"), "latest") is None
    assert "--resume latest: no checkpoint under" in capsys.readouterr().err
    (root / "step_00000004").mkdir()  # a step directory without its manifest
    with pytest.raises(ConfigError, match="no intact checkpoint"):
        preflight.resolve_resume(tiny(f"checkpoint.dir='{root}'"), "latest")
