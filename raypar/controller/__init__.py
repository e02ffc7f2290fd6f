"""The controller: the only code that creates actors and placement groups.

cli (input checked before Ray is imported) -> training (the step loop, `TrainingLoop`) -> actor_mesh
(`ActorMesh`: the run's actors; its parts build them, mesh_builder, run the steps, actor_calls, and recover
and scale, mesh_recovery) -> placement (placement groups); connection joins
Ray and talks to running runs. Everything below it (raypar core, collectives) never imports Ray.
"""
