"""`per_step`: the mark of an actor method that runs every step, whose calls Ray should not list.

A module of its own, without torch, for the run's control actor (actors.control), whose process would
otherwise import torch through actors.telemetry.
"""

import ray

# For the methods called every step (or every pipeline message): Ray records each call's task events in
# the GCS (the dashboard's task list, 100,000 calls kept by default), which grew a local Ray's GCS by
# ~12 KB a step (63 to 288 MB over 20,000 steps). Set-up, checkpoint and recovery calls stay listed.
per_step = ray.method(enable_task_events=False)
