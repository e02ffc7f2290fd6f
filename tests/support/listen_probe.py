"""Start a local Ray as `raypar train` does, form a gloo group in two actors, print every TCP listener and
what became of Ray's token file.

    python -m tests.support.listen_probe    # one JSON line: {"listeners": [[pid, "ip", port], ...],
                                            #                 "token": ["0o600", true]}

The listeners are those of this process and all its descendants: ray.init starts Ray's processes (GCS,
raylet, agents, dashboard) as children, and the raylet starts the workers. Sockets are matched to processes
through /proc (no `ss` needed). The token: the mode of `$HOME/.ray/auth_token`, created under a typical
umask (022), and whether Ray runs with the token in that file (not one of its own).
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(raw[raw.rindex(")") + 2 :].split()[1])
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid and p not in found]
        found.update(children)
        frontier.extend(children)
    return found


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    listening: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                host, port = fields[1].split(":")
                listening[fields[9]] = (_address(host), int(port, 16))
    out = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            inode = target[len("socket:[") : -1] if target.startswith("socket:[") else None
            if inode in listening:
                out.append((pid, *listening[inode]))
    return sorted(set(out))


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


def main() -> None:
    import ray

    from collectives.host import GroupHost, create_groups
    from collectives.ray_store import RendezvousServer
    from raypar.controller.connection import connect

    os.umask(0o022)  # a file written with the umask's mode would be readable by anyone
    connect(None, num_cpus=2)
    from ray._raylet import AuthenticationTokenLoader

    path = Path(os.environ["HOME"]) / ".ray" / "auth_token"
    used = AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True)
    token = [oct(path.stat().st_mode & 0o777), used == path.read_text().strip()]

    @ray.remote(num_cpus=0.5)
    class Member(GroupHost):
        pass

    server = RendezvousServer(timeout_s=60)
    members = {"a": Member.remote(), "b": Member.remote()}
    create_groups(members, {"g": ["a", "b"]}, server.address, timeout_s=60)
    print(json.dumps({"listeners": listeners(_descendants(os.getpid())), "token": token}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
