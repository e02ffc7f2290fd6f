"""A run directory as a pipeline run writes it (metrics and a simulated timeline), for `raypar report`'s
tests."""

from __future__ import annotations

import json
from pathlib import Path

from raypar.core.config.load import from_dict
from raypar.core.config.schema import to_toml
from raypar.core.observe import timeline
from raypar.core.pipeline import schedules


def simulated_rows(
    schedule: str,
    p: int,
    m: int,
    step: int = 0,
    dp: int = 1,
    tp: int = 1,
    t_f: float = 0.010,
    t_b: float = 0.010,
    t_send: float = 0.0002,
    latency: float = 0.0003,
    tail: float = 0.002,
) -> list[timeline.Row]:
    """timeline.jsonl rows of one step: each stage walks its plan; a receive waits for its message, which
    arrives `latency` after the `t_send` its send takes. tp ranks of a stage run in lockstep."""
    plans = schedules.build(schedule, p, m)
    clock = [0.0] * p
    pc = [0] * p
    events: list[list[list]] = [[] for _ in range(p)]
    arrivals: dict[tuple[str, int, int], float] = {}  # (kind, receiving stage, mb) -> time
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while pc[s] < len(plans[s]):
                op, mb = plans[s][pc[s]].op, plans[s][pc[s]].mb
                start = clock[s]
                if op in ("recv_act", "recv_grad"):
                    key = (op[5:], s, mb)
                    if key not in arrivals:
                        break
                    clock[s] = max(clock[s], arrivals.pop(key))
                elif op in ("send_act", "send_grad"):
                    clock[s] += t_send
                    target = s + 1 if op == "send_act" else s - 1
                    arrivals[(op[5:], target, mb)] = clock[s] + latency
                else:
                    clock[s] += t_f if op == "forward" else t_b
                events[s].append([op, mb, start, clock[s]])
                pc[s] += 1
                progressed = True
    assert all(pc[s] == len(plans[s]) for s in range(p)), "the synthetic executor deadlocked"
    # Gradient clipping synchronises the replica's stages: every step ends after the slowest stage's tail.
    step_s = max(clock) + tail
    return [
        {
            "step": step,
            "actor": f"dp{d}.pp{s}.tp{t}",
            "dp": d,
            "pp": s,
            "tp": t,
            "step_s": step_s,
            "events": events[s],
        }
        for d in range(dp)
        for s in range(p)
        for t in range(tp)
    ]


def write_run(run_dir: Path, schedule: str, p: int, m: int, dp: int = 1, tp: int = 1, steps: int = 3) -> Path:
    """A run directory as the driver writes it, with a timeline simulated per step (slightly varying)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = from_dict(
        {
            "model": {"preset": "tiny"},
            "parallel": {"pp": p, "dp": dp, "tp": tp, "schedule": schedule, "microbatches": m},
            "train": {"global_batch": dp * m, "steps": steps},
        }
    )
    (run_dir / "config.toml").write_text(to_toml(cfg))
    with open(run_dir / "metrics.jsonl", "w") as metrics, open(run_dir / "timeline.jsonl", "w") as timeline:
        for step in range(steps):
            rows = simulated_rows(schedule, p, m, step, dp, tp, t_f=0.010 * (1 + 0.05 * step))
            timeline.writelines(json.dumps(row) + "\n" for row in rows)
            step_s = max(row["step_s"] for row in rows)
            record = {
                "step": step,
                "loss": 5.5 - 0.3 * step,
                "grad_norm": 1.0,
                "lr": 3e-4,
                "tokens": 256 * (step + 1),
                "step_time_s": step_s,
                "tokens_per_s": 256 / step_s,
                "dp": dp,
                "pp": p,
                "tp": tp,
            }
            metrics.write(json.dumps(record) + "\n")
    return run_dir
