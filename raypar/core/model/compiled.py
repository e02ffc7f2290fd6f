"""`train.compile`: each block's local math through `torch.compile` (inductor), its communication eager.

What is compiled. A block alternates local math with tensor-parallel communication (Megatron's f and g,
the SP all-gather and reduce-scatter, the cp ring or all-to-all, the MoE dispatch) and with linears whose
backward zero-bubble splits (raypar.core.parallel.zb). The compiled regions are the math between those
points: RMSNorm, RoPE on q and k, and the SwiGLU activation (`REGIONS`), forward and backward (AOTAutograd
compiles the backward too). They are pure functions of their tensor arguments (weights passed in, no module
captured), so one graph serves every block of a process.

Why the collectives stay outside rather than being registered as custom ops: raypar's groups are Python
objects (gloo process groups, CuPy communicators with their own streams, deadlines and abort) that a graph
cannot hold, and a region free of them
- is the same graph at every layout, schedule and recompute mode: nothing about tp, sp, cp or ep is baked
  into it, and no graph breaks (`fullgraph=True` asserts it);
- keeps zero-bubble's B/W split as it is: the linears stay `zb._Linear`, whose backward leaves its weight
  GEMM to the store (Python state no graph may capture), and B's `autograd.grad` and W's flush walk compiled
  nodes like any other;
- replays bit for bit under recomputation and draws no random numbers (dropout stays eager), so the RNG
  stream, and with it every dropout mask, is eager's;
- compiles in one process without its peers (no collective inside to wait on them).
What it leaves: the GEMMs run as in eager (inductor gains nothing on a plain GEMM), and the MoE experts'
SwiGLU stays eager too (their rows per expert change every step: a static graph would recompile).

Graphs are static (`dynamic=False`): a process sees a few shapes (training microbatches, evaluation, SP's
T/tp tokens), each compiled once. Inductor caches them on disk (`inductor_env`): every actor of a node, and
every later run there, loads what the first one compiled.
"""

from __future__ import annotations

import fcntl
import getpass
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from raypar.core.plain_files import kind

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 even for 16-bit activations: the mean of squares loses too much in bf16.
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).type_as(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (first half, second half) pair of x [B, H, T, hd] by its position's angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on queries and keys: one region, so one graph reads the tables once for both."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


REGIONS = (rms_norm, rotate, swiglu)


class Region:
    """One region compiled for this process. A call with inputs of a kind it has not run yet compiles (or
    loads from the node's cache); such calls take the node's compile lock, so the node's actors compile a
    graph one at a time and all but the first load it from the cache. The lock cannot deadlock: a region
    waits for nothing but the lock (no collective inside), and its holder finishes on its own."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.graph = fn, None
        self.seen: set[tuple] = set()  # what dynamo guards on, roughly: coarser would only lock more often

    def __call__(self, *args: torch.Tensor | float) -> torch.Tensor | tuple[torch.Tensor, ...]:
        kind = (torch.is_grad_enabled(), *map(_kind, args))
        if kind in self.seen:
            return self._run(args)
        with compile_lock():
            out = self._run(args)
        self.seen.add(kind)
        return out

    def _run(self, args: tuple) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.graph is None:  # on first use: importing the core must not import dynamo and inductor
            self.graph = torch.compile(self.fn, dynamic=False, fullgraph=True)
        # No donated buffers: they forbid a backward that keeps the graph, and ZB-H1's B does (until its
        # W). Set on every call: torch's config settings are per thread, and any thread may compile.
        torch._functorch.config.donated_buffer = False
        return self.graph(*args)


def _kind(arg: torch.Tensor | float) -> tuple:
    if isinstance(arg, torch.Tensor):
        return arg.shape, arg.stride(), arg.dtype, arg.device, arg.requires_grad
    return (arg,)


@contextmanager
def compile_lock() -> Iterator[None]:
    """Held by one process (or thread) of the node at a time: a file lock in inductor's cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    own_cache_dir(os.path.abspath(os.environ.get(CACHE_ENV) or default_cache_dir()))  # before any kernel
    with open(os.path.join(cache_dir(), "raypar-compile.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


_REGIONS = {fn: Region(fn) for fn in REGIONS}


class Compilable:
    """A module whose local math runs through `region(fn)`: `fn` compiled when `compiled` is set
    (a stage's `set_compile`), `fn` itself otherwise."""

    compiled: bool = False

    def region(self, fn: Callable) -> Callable:
        return _REGIONS[fn] if self.compiled else fn


def inductor_env(compile_: bool, threads: int) -> dict[str, str]:
    """Environment variables of every worker process of a run with `train.compile` = `compile_`, on
    `threads` cores each (parallel.threads_per_actor).

    The inductor cache directory: node-local, shared by the node's actors and by later runs there. Not
    under the run directory: that is on the driver's node only (or on shared storage, where nodes with
    other CPUs or GPUs would share kernels), and every run would start cold. The driver's own setting wins
    where it has one. Compile threads: the actor's cores, not inductor's default of one per core of the
    node (a pool of compile processes per actor, competing with the node's other actors)."""
    if not compile_:
        return {}
    return {CACHE_ENV: inductor_cache_dir(), THREADS_ENV: str(threads)}


def inductor_cache_dir() -> str:
    """The driver's TORCHINDUCTOR_CACHE_DIR, else /tmp/raypar_inductor_<user>: predictable, hence
    `own_cache_dir`."""
    default = os.path.join(tempfile.gettempdir(), f"raypar_inductor_{getpass.getuser()}")
    return os.environ.get(CACHE_ENV, default)


def own_cache_dir(path: str) -> None:
    """Make `path` a directory of this user's alone (0700): created so, or tightened where this user made it
    with the umask's mode (importing torch._inductor makes it already); PermissionError if it is not a
    directory, belongs to another user or may be written by others. Inductor loads compiled code from it:
    in a shared /tmp, another local account that made the (predictable) directory first, or may write
    into it, could plant code there."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: said below
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{path}: the compile cache is {kind(info.st_mode)}, not a directory; refused")
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"{path}: the compile cache belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); "
            f"refused (it could hold planted code): remove it or set {CACHE_ENV} to a directory of yours"
        )
    if info.st_mode & 0o022:
        raise PermissionError(
            f"{path}: the compile cache is writable by others (mode {stat.S_IMODE(info.st_mode):o}); refused "
            f"(it could hold planted code): chmod 700 it"
        )
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
