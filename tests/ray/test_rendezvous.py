"""The run's rendezvous store (collectives/ray_store.py): c10d semantics; joining takes the run's
credentials.

The store is an actor; members reach it by actor calls, which are PushTask RPCs to the actor's worker, found
through the GCS. The session's Ray (a local `ray.init()`) uses token authentication, as the documented cluster
does. A client that can reach every port but lacks the token is refused on both paths, whatever it sends
(so it can neither read nor write a key); the same requests with the token are served (the control: the
refusal is about the credentials, not a malformed request).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import grpc
import pytest
import torch
from ray._private import state
from ray._raylet import AuthenticationTokenLoader
from ray.core.generated import core_worker_pb2, core_worker_pb2_grpc, gcs_service_pb2, gcs_service_pb2_grpc

from collectives import GroupSpec, create_group
from collectives.ray_store import RendezvousServer


@pytest.fixture(scope="module")
def server(ray_session):
    srv = RendezvousServer(timeout_s=30)
    yield srv
    srv.close()


def test_store_semantics(server):
    store = server.store
    store.set("sem/k", b"v")
    assert store.get("sem/k") == b"v" and store.check(["sem/k"]) and not store.check(["sem/none"])
    assert (store.add("sem/n", 2), store.add("sem/n", 3)) == (2, 5)
    assert store.compare_set("sem/c", b"", b"1") == b"1"  # absent + empty expectation: set
    assert store.compare_set("sem/c", b"0", b"2") == b"1"  # wrong expectation: unchanged
    assert store.compare_set("sem/c", b"1", b"3") == b"3"
    assert store.delete_key("sem/c") and not store.delete_key("sem/c")
    with pytest.raises(TimeoutError, match="sem/late"):
        store.wait(["sem/late"], timedelta(seconds=0.3))
    store.set("sem/late", b"x")
    store.wait(["sem/late"], timedelta(seconds=20))  # there now: returns (that a waiter is woken by the
    # write, not by polling, is tests/unit/test_store_wake.py's, on a stopped clock rather than a timer)


def test_gloo_group_forms_on_the_store(server):
    """Two thread members of one gloo group, through the actor store (what every actor of a run does)."""
    out: list[torch.Tensor | None] = [None, None]

    def member(rank: int) -> None:
        group = create_group(GroupSpec("sem.g", ("m0", "m1"), rank, server.address, timeout_s=30))
        out[rank] = group.all_reduce(torch.full((3,), float(rank + 1)))

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(o is not None and o.tolist() == [3.0, 3.0, 3.0] for o in out)


def _store_worker(server: RendezvousServer) -> str:
    address = state.actors(server.address.key)["Address"]
    return f"{address['IPAddress']}:{address['Port']}"


def _code(call, metadata) -> grpc.StatusCode:
    try:
        call(timeout=10, metadata=metadata)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_a_client_without_the_token_can_neither_read_nor_write(server, ray_session):
    store = server.store
    store.set("run/nccl_unique_id", b"secret")
    token = list(AuthenticationTokenLoader.instance().get_token_for_http_header().items())
    assert token, "the session's Ray runs without token auth: this test would prove nothing"
    wrong = [(token[0][0], "Bearer " + "0" * 32)]

    worker = core_worker_pb2_grpc.CoreWorkerServiceStub(grpc.insecure_channel(_store_worker(server)))
    gcs = gcs_service_pb2_grpc.ActorInfoGcsServiceStub(
        grpc.insecure_channel(ray_session.get_runtime_context().gcs_address)
    )

    def push_task(**kw):  # an actor call: how `get` and `set` reach the store
        return worker.PushTask(core_worker_pb2.PushTaskRequest(), **kw)

    def stats(**kw):
        return worker.GetCoreWorkerStats(core_worker_pb2.GetCoreWorkerStatsRequest(), **kw)

    def find_actors(**kw):  # how a client finds the store actor's worker
        return gcs.GetAllActorInfo(gcs_service_pb2.GetAllActorInfoRequest(), **kw)

    for metadata in ([], wrong):
        for call in (push_task, stats, find_actors):
            assert _code(call, metadata) == grpc.StatusCode.UNAUTHENTICATED, (call.__name__, metadata)
    # Control: the same requests with the token are served (PushTask is left out: an empty task with valid
    # credentials would reach the worker's task handler, which is not what this test is about).
    assert _code(stats, token) == grpc.StatusCode.OK
    assert _code(find_actors, token) == grpc.StatusCode.OK
    # The key is unchanged, and a client with the credentials (this driver) reads and writes it.
    assert store.get("run/nccl_unique_id") == b"secret"
    store.set("run/nccl_unique_id", b"new")
    assert store.get("run/nccl_unique_id") == b"new"


def test_group_formation_benchmark_quick(ray_session):
    """benchmarks/group_formation.py --quick runs and reports both stores (numbers: benchmarks/README.md)."""
    from benchmarks import group_formation

    rows = group_formation.main(["--quick"])
    assert sorted(r["store"] for r in rows) == ["ray", "tcp"]
    assert all(r["actors"] == 4 and 0 < r["min_s"] <= r["median_s"] for r in rows)
