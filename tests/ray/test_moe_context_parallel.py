"""MoE under context parallelism on Ray actors: dp=2 x ep=2 x cp=2 against one process (the thread-rank
equivalences and negative controls: tests/unit/test_moe_context_parallel.py)."""

from __future__ import annotations

import pytest

from raypar.core.parallel.mesh import Coord, Mesh


def test_actors_dp2_ep2_cp2_match_one_process(ray_session, tmp_path):
    """The worker itself (actors/worker.py: its per-cp-rank EP groups, the expert-dp group spanning cp
    and
    the dp x cp divisor, the grad norm's expert part) on 4 Ray actors, two steps with their updates, through
    tests/ray/test_moe_training.py's checks (loss, nothing dropped, router and expert gradients, grad norm).
    A checkpoint written there (cp rank 0 of each replica writes: each holds the EP group's other experts)
    resumes at ep=1 (every replica reads every expert) on the reference curve."""
    from raypar.core.checkpoint import format as checkpoint
    from tests.support.faults import FaultyActorMesh
    from tests.support.moe_runs import assert_params, train
    from tests.support.moe_runs import make_cfg as moe_cfg
    from tests.support.reference import reference_run

    ref = reference_run(moe_cfg(1, 1, 1, 8), 3, microbatch_size=1)
    cfg = moe_cfg(2, 1, 2, 4, "parallel.cp=2", 'parallel.cp_style="ulysses"')
    mesh = FaultyActorMesh(cfg, "moe-cp", {})
    try:
        mesh.start()
        train(mesh, range(2), ref)
        staging, writers = mesh.begin_checkpoint(str(tmp_path), 2)
        assert sorted(writers) == [Coord(0, 0, 0), Coord(1, 0, 0)]
        entries = mesh.collect(mesh.checkpoint_writes(writers), "writing")
        uri = checkpoint.publish(str(tmp_path), staging, 2, entries, {"optimizer_steps": 2})
        mesh.reconfigure(moe_cfg(2, 1, 1, 4, "parallel.cp=2", 'parallel.cp_style="ulysses"'))
        assert mesh.load(uri) == 2
        train(mesh, range(2, 3), ref)
        assert_params(mesh, ref)
        # Negative control: expert gradients divided by the expert-dp group's size, here 2 = dp (the divisor
        # before cp composed with MoE), not dp x cp = 4: twice too large, and the expert check says so.
        mesh.set_faults({c: ["ep_divisor_edp"] for c in Mesh(2, 1, 1, cp=2).coords()})
        mesh.reconfigure(cfg)
        with pytest.raises(AssertionError, match=r"gradient of layers\.\d\.mlp\.experts"):
            train(mesh, range(1), ref)
    finally:
        mesh.shutdown()
