"""A spot interruption watcher: one small actor per node a run uses (`parallel.spot_notice = "aws"`).

AWS posts a two-minute interruption notice in the instance metadata (`/latest/meta-data/spot/
instance-action`: 404 while there is none, then `{"action": "terminate", "time": "<UTC ISO 8601>"}`),
reached through an IMDSv2 session token. `check` reads it once; on a notice it asks Ray's GCS to drain
this node (reason preemption) with the notice's time as the deadline, which raypar.controller.drain then
handles as any drain: the run's replicas leave before the instance goes. Anything else (no answer, an
answer that is not a notice) is ignored, said once per kind so that a silent or broken endpoint never
ends the run. Torch-free: it starts in a fraction of a second and holds no CPU (num_cpus=0).
"""

from __future__ import annotations

import datetime
import json
import urllib.error
import urllib.request

import ray

TOKEN_PATH = "/latest/api/token"  # IMDSv2: PUT, answered with a session token
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_S = 300
HTTP_TIMEOUT_S = 2.0  # the metadata service answers in milliseconds; a slower one counts as silent


def parse_notice(body: bytes) -> float:
    """The deadline (Unix seconds) of an instance-action notice; ValueError for anything else."""
    notice = json.loads(body)
    if not isinstance(notice, dict) or notice.get("action") not in ("terminate", "stop", "hibernate"):
        raise ValueError(f"not an instance-action notice: {body[:80]!r}")
    when = datetime.datetime.fromisoformat(str(notice["time"]).replace("Z", "+00:00"))
    if when.tzinfo is None:
        raise ValueError(f"the notice's time has no time zone: {notice['time']!r}")
    return when.timestamp()


class SpotWatch:
    """The watcher's logic, without Ray's decorator (tests run it in-process against a stub)."""

    def __init__(self, endpoint: str, node_id: str):
        self.endpoint, self.node_id = endpoint.rstrip("/"), node_id
        self.said: set[str] = set()  # the kinds of trouble reported once already
        self.drained = False

    def _get(self, path: str, headers: dict[str, str], method: str = "GET") -> bytes:
        request = urllib.request.Request(self.endpoint + path, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
            return answer.read()

    def _once(self, kind: str, line: str) -> str | None:
        if kind in self.said:
            return None
        self.said.add(kind)
        return line

    def check(self) -> str | None:
        """Read the notice once; returns a line for the driver to say (a notice acted on, or a first
        failure of its kind), else None."""
        if self.drained:
            return None
        where = f"spot notice endpoint {self.endpoint} (node {self.node_id[:12]})"
        try:
            token = self._get(TOKEN_PATH, {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)}, "PUT")
            body = self._get(NOTICE_PATH, {"X-aws-ec2-metadata-token": token.decode()})
        except urllib.error.HTTPError as err:
            if err.code == 404:  # no notice: the instance stays
                return None
            return self._once(f"http {err.code}", f"{where} answered HTTP {err.code}; ignored")
        except (OSError, UnicodeDecodeError) as err:  # refused, timed out, reset
            return self._once("silent", f"{where} did not answer ({err}); ignored")
        try:
            deadline = parse_notice(body)
        except (ValueError, KeyError, TypeError) as err:
            return self._once("garbage", f"{where} answered something that is no notice ({err}); ignored")
        self.drained = True
        return self.drain(deadline)

    def drain(self, deadline: float) -> str:
        from ray.core.generated import autoscaler_pb2

        gcs = ray._private.worker.global_worker.gcs_client
        accepted, why = gcs.drain_node(
            self.node_id,
            autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "spot interruption notice",
            int(deadline * 1000),
        )
        if not accepted:
            return f"spot notice on node {self.node_id[:12]}: Ray refused to drain it ({why})"
        return f"spot notice on node {self.node_id[:12]}: asked Ray to drain it by {deadline:.0f} (Unix s)"


@ray.remote(num_cpus=0)
class SpotWatcher(SpotWatch):
    """One per node: placed there by the controller (node affinity), it drains that node."""

    def __init__(self, endpoint: str):
        super().__init__(endpoint, ray.get_runtime_context().get_node_id())
