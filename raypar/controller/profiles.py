"""train.profile_steps on the driver: once the range's last step is logged, every actor's profile is
collected and written as one Chrome/Perfetto trace, `profile.json` in the run directory
(raypar.core.observe.profile); `raypar report` adds it to timeline.json beside the step timeline.

A profile is something to look at, not state: an actor that cannot hand its profile over (it died since,
or was replaced mid-range and so never ran the range's last step) is left out and named; the run goes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray

from actors.endpoints import WorkerEndpoints, call
from raypar.controller.actor_calls import cause_of
from raypar.core.observe.profile import profile_trace

PROFILE = "profile.json"
COLLECT_TIMEOUT_S = 120.0  # a profile of a big model's steps is large; the copy takes its time


def write(actor_mesh: Any, run_dir: Path) -> str:
    """Collect every actor's profile and write profile.json; returns the line the run's events get."""
    actors = sorted(actor_mesh.actors.items())
    refs = {call(actor, WorkerEndpoints.take_profile): coord for coord, actor in actors}
    profiles, missing = {}, []
    for ref, coord in refs.items():
        try:
            answer = ray.get(ref, timeout=COLLECT_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as err:
            missing.append(f"{actor_mesh.name(coord)} ({cause_of(err)})")
            continue
        if answer is None:
            missing.append(f"{actor_mesh.name(coord)} (did not run the whole range)")
        else:
            profiles[coord.key] = (actor_mesh.name(coord), answer)
    path = Path(run_dir) / PROFILE
    path.write_text(json.dumps(profile_trace(profiles)))
    lacking = f"; without {', '.join(missing)}" if missing else ""
    return (
        f"profile of steps {actor_mesh.cfg.train.profile_steps} from {len(profiles)} actors: {path} "
        f"(`raypar report` adds it to timeline.json){lacking}"
    )
