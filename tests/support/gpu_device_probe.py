"""Run as a subprocess by test_placement.py: a `ray.cluster_utils.Cluster` with one node of 2 and one of
4 fake GPUs, an ActorMesh of model-free workers (tp=2, dp=3: six actors fill both nodes), and for
every actor the GPU Ray assigned it next to the device its groups were formed on, printed as JSON: under
"good", and under "broken" once the same mesh has formed its groups again without devices (the bug:
every communicator on cuda:0). The same actors serve both: a second mesh would start six more actor
processes, the probe's largest cost."""

from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster

from raypar.core.run_config import load_config
from tests.support.stub_worker import StubActorMesh


class _Switchable(StubActorMesh):
    """Forms its groups on each actor's GPU until `broken` is set, then without devices."""

    broken = False

    def devices(self) -> dict[str, int]:
        return {} if self.broken else super().devices()


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for gpus in (2, 4):
        cluster.add_node(num_cpus=gpus, num_gpus=gpus)
    cfg = load_config(
        "examples/configs/tiny.toml",
        ['parallel.device="gpu"', "parallel.dp=3", "parallel.tp=2", "parallel.pp=1", "train.global_batch=6"],
    )
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        mesh = _Switchable(cfg, "gpu-probe")
        mesh.start()
        placed = {c: (n.node_id, [int(g) for g in n.gpu_ids]) for c, n in mesh.nodes.items()}
        out = {}
        for name in ("good", "broken"):
            if name == "broken":
                mesh.broken = True
                mesh._regroup()  # every group formed anew (a new epoch replaces the held ones)
            devices = ray.get([a.group_devices.remote() for a in mesh.actors.values()])
            out[name] = {
                c.key: {"node": placed[c][0], "gpu": placed[c][1], "groups": d}
                for c, d in zip(mesh.actors, devices, strict=True)
            }
        mesh.shutdown()
        print(json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
