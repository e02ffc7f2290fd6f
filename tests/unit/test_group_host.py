"""collectives.host.GroupHost in one process: groups left behind by a membership change are destroyed,
and
`abort_groups` / `Worker.abort` abort the right ones. Two members are two threads (gloo, LocalStoreRef)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from actors.transport import StepAborted, TransportTimeout
from actors.worker import Worker
from collectives import GroupError, GroupInfo, GroupSpec, GroupTimeout, LocalStoreRef
from collectives.host import GroupHost
from tests.support.threads import run_threads

MEMBERS = ("m0", "m1")


class _Member(GroupHost):
    pass


def _both(fn: Callable[[int], Any]) -> list[Any]:
    """fn(rank) for both members at once (joining a group blocks until every member joins)."""
    return run_threads(2, fn)


def _join(hosts: list[_Member], ref: LocalStoreRef, names: list[str], epoch: int) -> None:
    _both(lambda r: hosts[r].join_groups([GroupSpec(n, MEMBERS, r, ref, epoch, timeout_s=10) for n in names]))


def _works(hosts: list[_Member], name: str) -> bool:
    total = _both(lambda r: hosts[r].group(name).all_reduce(torch.ones(3), "sum"))
    return all(torch.equal(t, torch.full((3,), 2.0)) for t in total)


def _fails(group: Any) -> bool:
    """The group's communicator is gone: an op fails at once (a live one alone waits out its timeout)."""
    try:
        group.all_reduce(torch.ones(3), "sum")
    except GroupTimeout:
        return False
    except GroupError:
        return True
    return False


def test_a_newer_epoch_destroys_the_groups_it_leaves_out():
    ref, hosts = LocalStoreRef(), [_Member(), _Member()]
    _join(hosts, ref, ["a", "b"], epoch=0)
    _join(hosts, ref, ["c"], epoch=0)  # control: a join at the same epoch adds, destroying nothing
    assert all(_works(hosts, name) for name in ("a", "b", "c"))
    old = {name: [h.group(name) for h in hosts] for name in ("a", "b", "c")}

    _join(hosts, ref, ["a"], epoch=1)  # the membership changed: "a" is all these members share now
    assert _works(hosts, "a")
    for name, groups in old.items():  # "a" replaced, "b" and "c" left behind: every old one is gone
        assert all(_fails(g) for g in groups), name
    for host in hosts:
        assert set(host.group_devices()) == {"a"}
        with pytest.raises(GroupError, match="not a member of group 'b'"):
            host.group("b")


def test_abort_groups_aborts_what_it_names():
    ref, hosts = LocalStoreRef(), [_Member(), _Member()]
    _join(hosts, ref, ["a"], epoch=3)
    _join(hosts, ref, ["b"], epoch=3)
    for host in hosts:  # other backends, or a newer membership than the one named: not touched
        host.abort_groups("a peer died", backend="nccl")
        host.abort_groups("a peer died", epoch=2)
    assert _works(hosts, "a") and _works(hosts, "b")
    for host in hosts:
        host.abort_groups("a peer died", backend="gloo", epoch=3)
    assert all(_fails(h.group(name)) for h in hosts for name in ("a", "b"))


class _Recorder:
    """A held group that records its abort and whether the worker's mailbox was called off by then."""

    def __init__(self, worker: Worker, backend: str, epoch: int, abortable: bool = True):
        self.info = GroupInfo("g", epoch, 0, MEMBERS, backend, 10.0)
        self.worker, self.reason, self.mailbox_done = worker, None, None
        if abortable:
            self.abort = self._abort

    def _abort(self, reason: str) -> None:
        self.reason = reason
        try:
            self.worker.mailbox.take(("act", 2, 7, 0, 0), 0.0, "a hop of the aborted step")
        except StepAborted:
            self.mailbox_done = True
        except TransportTimeout:
            self.mailbox_done = False

    def destroy(self) -> None:
        self._abort("destroyed")


def test_worker_abort_aborts_its_nccl_groups_of_that_membership_after_the_mailbox():
    worker = Worker("r", (0, 0, 0))
    held = {
        "nccl": _Recorder(worker, "nccl", epoch=2),
        "gloo": _Recorder(worker, "gloo", epoch=2),  # ends by the dead peer's sockets; the redo keeps it
        "newer": _Recorder(worker, "nccl", epoch=3),  # formed after the failure: a late abort spares it
        "old_api": _Recorder(worker, "nccl", epoch=2, abortable=False),  # a Group without abort(reason)
    }
    worker.__dict__["_raypar_groups"] = held
    worker.abort(2, 7)
    assert "step 7" in held["nccl"].reason and held["nccl"].mailbox_done
    assert held["old_api"].reason == "destroyed" and held["old_api"].mailbox_done
    assert held["gloo"].reason is None and held["newer"].reason is None
