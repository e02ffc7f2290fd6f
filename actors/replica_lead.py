"""Few driver calls per step: a replica's leader fans an all-actor call out to its members.

Submitting an actor call and reading its answer costs the driver hundreds of µs of CPU (benchmarks/README.md,
`controller_scale.py`). With one call per actor per step, the driver's work grows with the actor count
and cannot stay under 1 % of a step at a thousand actors. So, beyond a few actors, the driver calls each
replica's leader (its first actor) once; the leader calls every actor of its replica, itself included,
and answers for all of them. Where even one call per replica would be too many, the driver calls one
leader per group of replicas, which relays the call to the other leaders of its group (`MeshBuilder.lead`
builds this tree): the driver makes at most `ActorMesh.driver_calls` calls, each leader a replica's worth
plus its group's, in parallel with the other leaders.

The leader answers with each member's result or error, and returns at the first error, so the driver
still contains a failure at once (ending the broken replica, calling off the others' waits) and names the
actor that failed, not the leader. The leader only waits: its own part runs in another of its threads,
through its own handle, so a member that dies never leaves the leader stuck in a collective with it.
No torch or model here: the controller's light test and benchmark actors lead the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from actors.endpoints import ReplicaAnswer, WorkerEndpoints, call
from actors.task_events import per_step
from raypar.core.parallel.mesh import Coord

RELAY_MARGIN_S = 5.0


class MemberTimeout(TimeoutError):
    """A member did not answer its leader within the call's deadline."""


class ReplicaLead:
    """Mixin of an actor class: `lead` hands it its replica's actors, and the leaders of other replicas it
    relays to (so that the driver's calls stay few however many replicas there are); `fan_out` calls them."""

    members: dict[Coord, Any]
    relays: dict[Coord, Any]

    def lead(self, members: dict[tuple[int, ...], Any], relays: dict[tuple[int, ...], Any]) -> None:
        """`members`: the actors of this actor's replica, itself included; `relays`: other replicas' leaders,
        each leading its own replica (sent once per membership, not per step)."""
        self.members = {Coord(*c): handle for c, handle in members.items()}
        self.relays = {Coord(*c): handle for c, handle in relays.items()}

    @per_step
    def fan_out(self, endpoint: Callable[..., Any], args: tuple, timeout_s: float) -> ReplicaAnswer:
        """Call `endpoint(*args)` (a method of actors.endpoints.WorkerEndpoints) on every member and
        through every relay; wait for all answers, or for the first error."""
        refs = {call(handle, endpoint, *args): coord for coord, handle in self.members.items()}
        relayed = {  # a relay answers before this one's deadline, so that it can name its late members
            call(handle, WorkerEndpoints.fan_out, endpoint, args, timeout_s - RELAY_MARGIN_S): coord
            for coord, handle in self.relays.items()
        }
        refs.update(relayed)
        answer = ReplicaAnswer()
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending and not answer.errors:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not done:
                late = MemberTimeout(f"no answer to {endpoint.__name__} within {timeout_s:g}s")
                answer.errors.update(dict.fromkeys((refs[ref] for ref in pending), late))
                break
            if pending:  # take every other answer already in with the same wait
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                done += more
            for ref in done:
                try:
                    value = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - the driver reports it, naming the member
                    answer.errors[refs[ref]] = err
                    continue
                if ref in relayed:
                    answer.results.update(value.results)
                    answer.errors.update(value.errors)
                else:
                    answer.results[refs[ref]] = value
        return answer
