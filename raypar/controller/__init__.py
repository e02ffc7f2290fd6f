"""The controller: the only code that creates actors and placement groups.

cli (input checked before Ray is imported) -> training (the step loop, `TrainingLoop`) -> actor_mesh
(`ActorMesh`: the run's actors, steps, recovery, scaling) -> placement (placement groups); connection joins
Ray and talks to running runs. Everything below it (raypar core, collectives) never imports Ray.
"""
