"""`raypar status` on a cluster whose state API does not answer (started without a dashboard, or `auto`
finding another one): the live runs come from the GCS's named actors, so it lists them (issue 45, item 10;
it was a 60-line ServerUnavailable traceback)."""

from __future__ import annotations

import pytest
import ray
from ray.util.state import api as state_api
from ray.util.state.exception import ServerUnavailable

from raypar.controller import connection
from raypar.controller.connection import NAMESPACE


@ray.remote(num_cpus=0)
class PostedStatus:
    """Stands in for a run's control actor (actors.control.RunControl): what `status` returns."""

    def status(self) -> dict:
        return {"run": "no-dashboard", "step": None}


@pytest.fixture
def state_api_down(monkeypatch):
    def unavailable(*args, **kwargs):
        raise ServerUnavailable("no dashboard on this cluster")

    monkeypatch.setattr(state_api, "list_actors", unavailable)
    monkeypatch.setattr(ray.util.state, "list_actors", unavailable)


def test_status_lists_runs_without_the_state_api(ray_session, state_api_down):
    # the control: the state API is down for this test
    with pytest.raises(ServerUnavailable, match="no dashboard on this cluster"):
        ray.util.state.list_actors()
    control = PostedStatus.options(name="raypar:no-dashboard:control", namespace=NAMESPACE).remote()
    try:
        ray.get(control.__ray_ready__.remote(), timeout=60)
        assert {"run": "no-dashboard", "step": None} in connection.runs()
    finally:
        ray.kill(control)
