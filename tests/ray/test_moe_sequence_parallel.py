"""MoE under sequence parallelism on Ray actors: dp=2 x ep=2 x tp=2 with SP against one process (the
thread-rank equivalences and the negative control: tests/unit/test_moe_sequence_parallel.py)."""

from __future__ import annotations

import pytest

from actors.endpoints import WorkerEndpoints
from raypar.core.config.schema import Config
from raypar.core.parallel.mesh import Mesh

TOL = 1e-5


def test_actors_dp2_ep2_tp2_sp_match_one_process(ray_session):
    """The worker itself (actors/worker.py: its tp, ep and expert-dp groups, the tp rebinding of the
    MoE
    layers, T/tp tokens per rank) on 4 Ray actors, two steps with their updates, through
    tests/ray/test_moe_training.py's per-step checks (loss, nothing dropped, router and expert gradients, grad
    norm). Parameters: within 1e-4 of one process (AdamW's first steps move an entry by ~lr whatever its
    gradient's size, so tiny gradients summed in another order at tp=2 move some by ~2e-5 with or without
    SP: measured 1.8e-5 in layers.1.attn.wo) and within 1e-5 of the same layout without SP (measured 0).
    Its control is the summed gather above, injected into the workers."""
    from tests.support.faults import FaultyActorMesh
    from tests.support.moe_runs import gather, train
    from tests.support.moe_runs import make_cfg as moe_cfg
    from tests.support.reference import reference_run

    steps = 2
    ref = reference_run(moe_cfg(1, 1, 1, 8), steps, microbatch_size=1)

    def cfg(sp: bool) -> Config:
        return moe_cfg(2, 1, 2, 4, "parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}")

    mesh = FaultyActorMesh(cfg(True), "moe-sp", {})
    try:
        mesh.start()
        params = {}
        for sp in (True, False):
            if sp != mesh.cfg.parallel.sequence_parallel:  # rebuilt from the seed
                mesh.reconfigure(cfg(sp))
            train(mesh, range(steps), ref)
            mesh.commit()
            params[sp] = gather(mesh, WorkerEndpoints.parameters)
        for name, want in ref.params.items():
            err = (params[True][name] - want).abs().max().item()
            assert err <= 1e-4, f"parameter {name} differs by {err:.3g}"
            err = (params[True][name] - params[False][name]).abs().max().item()
            assert err <= TOL, f"parameter {name} differs from the layout without SP by {err:.3g}"
        mesh.set_faults({c: ["moe_sp_summed_gather"] for c in Mesh(2, 1, 2).coords()})
        mesh.reconfigure(cfg(True))
        # layer 3's MoE sends tp times its input gradient down: the first gradient checked below it fails
        symptom = r"^gradient of layers\.1\.mlp\.experts\.\d\.w_\w+\.weight at step 0"
        with pytest.raises(AssertionError, match=symptom):
            train(mesh, range(1), ref)
    finally:
        mesh.shutdown()
