"""The planner's memory predictions against what raypar's actors measure, layout by layout.

    python benchmarks/plan_validation.py    # the table in benchmarks/results/plan_validation.md
                                            # (tests/unit/test_plan.py runs the same `measure()` and checks
                                            # its tolerances)
    python benchmarks/plan_validation.py --quick            # smoke run: one layout

For each layout the tiny model trains two steps on real actors; the second step's per-actor measurements
(model states: parameters + gradients + optimizer state; activations: bytes saved for backward through
saved-tensor hooks, summed over the (chunk, microbatch) units alive at once) are set against
`raypar.core.planner.search`'s
predictions for that actor's pipeline stage. Memory does not depend on load, so these numbers stand on a
busy machine; layouts sharing (dp, pp, tp, cp) reuse one set of actors.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from raypar.controller.actor_mesh import ActorMesh  # noqa: E402
from raypar.core import planner  # noqa: E402
from raypar.core.config.schema import Config  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402

TINY = os.path.join(os.path.dirname(_HERE), "examples", "configs", "tiny.toml")

# MoE: 4 experts, top 2, every second block; capacity_factor E/k drops nothing, so a rank receives as many
# rows as it sends on average (the planner's balanced count; a rank's own share depends on routing).
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=2.0", "model.moe_every=2"]

# (dp, pp, tp, cp) -> config overrides of each layout measured on that mesh.
LAYOUTS: dict[tuple[int, int, int, int], list[list[str]]] = {
    (1, 2, 2, 1): [
        ["parallel.microbatches=4"],
        ["parallel.microbatches=4", 'parallel.schedule="gpipe"'],
        ["parallel.microbatches=2", 'train.recompute="selective"'],
        ["parallel.microbatches=4", 'train.recompute="full"'],
        ["parallel.microbatches=8", 'train.recompute="full"', "train.recompute_every=2"],
        ["parallel.microbatches=4", 'train.precision="fp16"'],
        ["parallel.microbatches=4", "parallel.virtual_stages=2"],  # interleaved: 2 chunks per actor
        ["parallel.microbatches=4", 'parallel.schedule="zb-h1"'],  # graphs freed at W, not at B
        ["parallel.microbatches=4", "parallel.sequence_parallel=true"],  # norms at T/tp
    ],
    (1, 1, 1, 2): [
        ["parallel.microbatches=2", 'parallel.cp_style="ulysses"', "parallel.zero=2"],  # states over cp x dp
        ["parallel.microbatches=2", 'parallel.cp_style="ring"', 'train.recompute="selective"'],
    ],
    (2, 1, 1, 1): [
        ["parallel.microbatches=2"],
        ["parallel.microbatches=1", 'train.recompute="selective"', "model.dropout=0.1"],
        ["parallel.microbatches=4", 'train.recompute="full"'],
        ["parallel.microbatches=2", "parallel.zero=1"],
        ["parallel.microbatches=2", "parallel.zero=3"],
        ["parallel.microbatches=2", 'train.precision="bf16"', "parallel.zero=2"],
        ["parallel.microbatches=2", "parallel.ep=2", "parallel.zero=1", *MOE],  # experts over ep, states
    ],
}


@dataclass
class Row:
    layout: str
    actor: str
    states_measured: int
    states_predicted: float
    activations_measured: int
    activations_predicted: int
    activations_wrong: int  # the broken formula: not multiplied by the microbatches in flight

    @property
    def states_error(self) -> float:
        return self.states_predicted / self.states_measured - 1

    @property
    def activations_error(self) -> float:
        return self.activations_predicted / self.activations_measured - 1


def layout_cfg(mesh: tuple[int, int, int, int], overrides: list[str]) -> Config:
    dp, pp, tp, cp = mesh
    sizes = [f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.cp={cp}"]
    return load_config(TINY, [*sizes, *overrides])


def measure(layouts: dict[tuple[int, int, int, int], list[list[str]]] = LAYOUTS) -> list[Row]:
    """Train each layout two steps (inside an initialised Ray) and compare measured with predicted."""
    rows = []
    for mesh, variants in layouts.items():
        trainer = ActorMesh(layout_cfg(mesh, variants[0]), f"planval-{'-'.join(map(str, mesh))}")
        try:
            trainer.start()
            for overrides in variants:
                cfg = layout_cfg(mesh, overrides)
                trainer.reconfigure(cfg)
                trainer.step(0)
                measured = trainer.step(1).per_actor  # after one update: the optimizer state exists
                layout = planner.current_layout(cfg)
                right = planner.predict_memory(cfg, layout, "cpu")
                wrong = planner.predict_memory(cfg, layout, "cpu", wrong_in_flight=True)
                # (dp, pp, tp) as the rows measured before cp existed are named, then cp if any
                knobs = [o.split(".", 1)[1] for o in overrides if o not in MOE]
                name = " ".join([str(mesh[:3]), *([f"cp={mesh[3]}"] if mesh[3] > 1 else []), *knobs])
                name += " moe" if MOE[0] in overrides else ""
                for coord, result in sorted(measured.items()):
                    stage, bad = right[coord.pp], wrong[coord.pp]
                    rows.append(
                        Row(
                            name,
                            coord.key,
                            result.memory.model_state_bytes,
                            stage.model_states,
                            result.memory.activation_peak_bytes,
                            stage.activations,
                            bad.activations,
                        )
                    )
        finally:
            trainer.shutdown()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| layout | actor | model states measured | predicted | error | activations measured | predicted "
        "| error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if not r.actor.endswith(".tp0") or not r.actor.startswith("dp0.") and "moe" not in r.layout:
            # The other replicas, cp and tp ranks of a stage measure the same (tests check all); MoE
            # replicas do not (each receives the rows its routing sends it), so all are shown.
            continue
        lines.append(
            f"| {r.layout} | {r.actor} | {r.states_measured:,} | {r.states_predicted:,.0f} | "
            f"{r.states_error:+.1%} | {r.activations_measured:,} | {r.activations_predicted:,} | "
            f"{r.activations_error:+.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: one layout, (2, 1, 1, 1)")
    args = parser.parse_args()
    import ray

    from benchmarks import _common

    _common.start_ray(num_cpus=16)
    try:
        print(markdown(measure({(2, 1, 1, 1): LAYOUTS[(2, 1, 1, 1)][:1]} if args.quick else LAYOUTS)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
