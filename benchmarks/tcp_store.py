"""The rendezvous raypar used before its store moved into a Ray actor: an open `torch.distributed.TCPStore`.

Kept for benchmarks only: `group_formation.py` measures group formation on it side by side with the run's
store actor, and `collectives.py --raypar-in-processes` forms groups in plain processes, outside Ray. It asks
no credentials and its server listens on every interface: never use it for a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class TcpStoreRef:
    host: str
    port: int

    @property
    def key(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def connect(self, timeout_s: float) -> dist.Store:
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout_s))


class TcpStoreServer:
    """The store's server, in this process for as long as this object lives."""

    def __init__(self, host: str, timeout_s: float = 300.0):
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.address = TcpStoreRef(host, self.store.port)
