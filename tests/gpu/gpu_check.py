"""`make gpu-check`: raypar's GPU path, checked on a machine with one GPU (two device calls on the lent one).

Prints one JSON line per row, `{"check": ..., "ok": ..., ...}`, then a summary row; exits 1 if any row failed.
`ok` is true only where the row saw the behaviour it names, false where it saw otherwise (or its section
raised: the section prints a failed row and the run goes on), and null where the row cannot tell on this
machine (it says why). Sections, in order:

1. `nccl`: every op (all_reduce sum/max, reduce_scatter sum/max, all_gather, all_to_all even and
   uneven, broadcast, grouped send/recv, barrier) in every dtype (fp32, bf16, fp16, int64), straight on
   `collectives.nccl.NcclBackend`, each writing OUT OF PLACE into an output filled with a sentinel (-7): at
   world size 1 every op is an identity, so only an overwritten sentinel shows NCCL wrote the result. NCCL
   refuses two ranks on one GPU, so these are world-size-1 checks; reductions over several ranks need
   several GPUs. The backend's all_reduce and broadcast are called with their `out` tensor (NCCL's separate
   send and receive buffers). Through `Group` only send_recv: Group answers its collectives at world size 1
   itself (and `create_group` builds no communicator for a group of one), so a Group row for them could
   not fail because of NCCL.
   `handoff`: a CPU tensor and a non-contiguous one are refused with an error, not read as device memory.
2. `stream_order`: a delayed producer (`torch.cuda._sleep`, then an in-place fill on the current stream);
   NCCL's output must hold the filled value (it waited for the producer), and a consumer queued on the
   current stream after `wait()` must see NCCL's result. `host_not_blocked`: a synchronous Group op returns
   to the host before the GPU has drained (the host goes on launching kernels).
3. `send_recv_self`: `Group.send_recv` to and from rank 0 (a grouped send + recv on one communicator; an
   ungrouped one deadlocks), 64 MiB.
4. `create_destroy`: 50 create/op/destroy cycles of an NCCL group leave device memory, threads and file
   descriptors where they were (bounds below, with what one leaked communicator would cost).
5. `abort`: a synchronous and an async op pending behind a delayed producer, then `Group.abort`: the
   hang report (`Group.state().pending`) lists both before the abort and still after it (without
   raising), the pending op and a later one raise `GroupError`; the group re-formed under a new epoch
   works.
6. `step`: `llama-1b` in bf16 at (dp, pp, tp) = (1, 1, 1): raypar's losses against a plain PyTorch loop's
   on the same batches, its step time and MFU against the loop's (alternating blocks of steps).
   `fp8`: the same step with `train.precision = "fp8"` (torchao's float8 GEMMs on the tensor cores), each
   recipe in its own mesh: its losses within FP8_RTOL of the bf16 run's, its step time against bf16's. GPU
   only (on a CPU torchao emulates float8, so a time says nothing): null without one.
7. `pp2`: pp = 2 with two actors sharing the GPU (`parallel.gpus_per_actor = 0.5`), activations over the
   object store (device -> host -> plasma -> host -> device): losses equal the pp = 1 run's.
8. `dp_shared`: dp = 2 on one GPU (two actors at 0.5 GPU each, so their groups are gloo over host memory)
   without ZeRO, with ZeRO 1, 2, 3 and with ZeRO 2 + CPU offload: losses equal the dp = 1 run's, and each
   ZeRO variant holds less model state per rank than plain DP (else it did not take effect).
9. `checkpoint`: a pp = 2 run with dropout saved (parameters, Adam moments and step count, RNG), loaded
   into fresh actors: parameters, optimizer counters and RNG states equal, and the next two steps' losses
   equal the ones the saved run went on to compute (the second depends on the restored Adam moments).

Sections 1-5 run in a child process (a broken CUDA context or a hang there spares the rest), 6-9 over a
local Ray. On the lent GPU machine they are two device calls (docs/gpu.md): `--nccl-only` (1-5 in this
process, Ray never imported) and `--skip-nccl` (6-9). `--require-gpu` exits 1 at once (one line) when
torch sees no CUDA device. Without a GPU, `--quick` runs the sections that need none (6-9 on the CPU at
the `tiny` preset; the NCCL rows are null): the test suite does that so the script cannot rot. A section
that hangs past its budget ends the run with a failed row; `--deadline-s` ends the call in time with the
running section null. Either way every section left prints a null row saying why, then the summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # the repository root, two levels up

import torch  # noqa: E402 - after the path fix above, as every import of the project

from collectives import GroupError, LocalStoreRef  # noqa: E402
from collectives.group import Group, GroupInfo  # noqa: E402

if TYPE_CHECKING:
    from raypar.controller.actor_mesh import ActorMesh


def _import_ray_side() -> None:
    """Ray and what the mesh sections use, imported only for them: `--nccl-only` runs where Ray is not
    installed (the lent GPU machine's first call carries no wheels)."""
    global ray, _common, ActorMesh, checkpoint, FP8_RECIPES, flops
    try:  # on the lent GPU machine a missing wheel is the likely failure: say so in one line
        import ray

        from benchmarks import _common
        from raypar.controller.actor_mesh import ActorMesh
        from raypar.core import checkpoint
        from raypar.core.config.options import FP8_RECIPES
        from raypar.core.observe import flops
    except ImportError as err:
        sys.exit(f"gpu_check: {err} (on the lent GPU machine Ray travels as wheels: docs/gpu.md)")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int64": torch.int64}
SENTINEL = -7  # exact in every dtype above, and never one of the values an op should write
NCCL_TIMEOUT_S = 60.0
MESH_TIMEOUT_S = 120.0  # placement and collectives of the meshes: a missing GPU fails a row, not the run
# pp=1 vs pp=2 and dp=1 vs dp=2 in fp32: the same model and samples; what differs is the order of fp32
# sums (the DP reduction, the grad-norm partial sums per stage or rank, GEMMs over 4 rows instead of 8 that
# cuBLAS may split differently), each a relative ~1e-7..1e-6 effect that three Adam steps do not grow
# past 1e-5 (tests/ray/test_equivalence.py measures the same on the CPU); 1e-4: a margin for GPU GEMMs.
LAYOUT_RTOL = 1e-4
# The llama-1b step: raypar and the plain loop run the same bf16 kernels on the same weights and batches,
# so their step-0 losses agree to fp32 rounding. Afterwards their fp32 master weights differ by an ulp or
# so (2^-24 relative: the optimizer and the gradient norm sum in other orders); that flips the bf16
# rounding of about one weight in 2^16, each by one bf16 ulp (2^-8 relative), and the loss, a mean over
# 8k tokens of those perturbations' small, mixed-sign effects, moves by orders of magnitude less than one
# bf16 rounding of the loss itself. 2^-8 relative is therefore loose for a correct step, and a step not
# taken or taken twice (Adam's first updates move this loss by percents; see `min_step_change`) fails it.
BF16_RTOL = 2.0**-8
# fp8 against bf16 over the first steps from one initialisation: tests/unit/test_float8.py derives 2^-7 for
# a loss averaged over >= 256 tokens (here 4 sequences of llama-1b's); the same bound here. The tensor cores'
# fast accumulation in the output GEMM (torchao's tensorwise recipe) adds per-element errors that are, like
# the operands' rounding, zero-mean and independent, so the loss's average shrinks them alike (not yet run).
FP8_RTOL = 2.0**-7
# 50 cycles of create/op/destroy: CUDA hands out device memory in 2 MiB pages and torch's cache is warm
# after the warm-up cycles (every cycle allocates the same sizes), so a correct destroy leaves free memory
# within a few pages of where it was; 16 MiB allows 8. One communicator leaked per cycle would take 50
# times what a live one holds (`per_comm_mib`, measured in the same row), and NCCL's proxy thread per
# communicator would add 50 threads (`per_comm_threads`).
CYCLES = 50
LEAK_MIB, LEAK_THREADS, LEAK_FDS = 16.0, 2, 4

results: list[dict[str, Any]] = []


def emit(check: str, ok: bool | None, **fields: Any) -> None:
    row = {"check": check, "ok": ok, **fields}
    results.append(row)
    print(json.dumps(row, default=str), flush=True)


def summary() -> dict[str, Any]:
    failed = [r["check"] for r in results if r["ok"] is False]
    unverified = [r["check"] for r in results if r["ok"] is None]
    return {
        "check": "summary",
        "ok": not failed,
        "failed": failed,
        "unverified": len(unverified),
        "total": len(results),
    }


class Budget:
    """A section that hangs (a collective that never returns, a placement that waits on a GPU) would eat the
    whole device call: past its budget, print a failed row. Past the call's deadline (`deadline_s`, set
    under the device call's timeout_s so that the rows come back), print the running section as null. Either
    way every section still planned is printed as null with the reason, then the summary, and the process
    ends. Budgets are for one H200; `scale` stretches them on a shared CPU machine (`--quick`)."""

    def __init__(
        self, scale: float = 1.0, deadline_s: float | None = None, planned: Sequence[str] = ()
    ) -> None:
        self.scale, self.deadline_s = scale, deadline_s
        self._end = None if deadline_s is None else time.monotonic() + deadline_s
        self.planned = list(planned)  # sections not yet entered, in order
        self._lock = threading.Lock()
        self._section: tuple[str, float, float] | None = None
        threading.Thread(target=self._watch, name="gpu-check-budget", daemon=True).start()

    def enter(self, name: str, seconds: float) -> None:
        with self._lock:
            if name in self.planned:
                self.planned.remove(name)
            self._section = (name, time.monotonic() + seconds * self.scale, seconds * self.scale)

    def leave(self) -> None:
        with self._lock:
            self._section = None

    def skip(self, name: str) -> None:
        """`name` will not run (its null row says why): not among the rows a cut prints."""
        with self._lock:
            if name in self.planned:
                self.planned.remove(name)

    def left_s(self) -> float | None:
        return None if self._end is None else self._end - time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)  # a polling period, not a synchronisation
            now = time.monotonic()
            with self._lock:
                late = self._section if self._section and now > self._section[1] else None
                cut = self._end is not None and now > self._end
                if late is None and not cut:
                    continue
                running, rest = self._section, list(self.planned)
            if late is not None:
                emit(late[0], False, error=f"did not finish within its budget of {late[2]:g}s; run ended")
                reason = f"not run: section {late[0]!r} hung past its budget and ended the run"
            else:
                reason = f"not run: the call's deadline of {self.deadline_s:g}s passed"
                if running is not None:
                    emit(running[0], None, unverified=f"cut at the call's deadline of {self.deadline_s:g}s")
            for name in rest:
                emit(name, None, unverified=reason)
            print(json.dumps({**summary(), "cut": reason}), flush=True)
            os._exit(1)


def section(budget: Budget, name: str, seconds: float, run: Callable[[], None]) -> None:
    """Run one section; an exception becomes a failed row and the run goes on."""
    budget.enter(name, seconds)
    try:
        run()
    except Exception as err:  # noqa: BLE001 - every section is reported, the next ones still run
        emit(name, False, error=f"{type(err).__name__}: {' '.join(str(err).split())[:500]}")
    finally:
        budget.leave()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next section (an actor on the same GPU) gets the memory back


# -- 1. NCCL ops, out of place ------------------------------------------------------------------------------
def _values(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, device=device) % 13 + 1).to(dtype).reshape(shape)  # 1..13: exact everywhere


def _sentinel(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, SENTINEL)


def _group(name: str, store: LocalStoreRef, epoch: int, device: int) -> Group:
    """A Group over an NCCL communicator of one member. Formed on the backend directly: `create_group` builds
    no communicator for a group of one (Group answers its collectives itself), so only the ops Group hands
    to the backend at any size (send/recv) reach NCCL through it here."""
    from collectives.nccl import NcclBackend

    info = GroupInfo(name, epoch, 0, ("gpu-check",), "nccl", NCCL_TIMEOUT_S)
    return Group(info, NcclBackend(store.store, f"{name}/{epoch}/", 0, 1, NCCL_TIMEOUT_S, device))


def nccl_ops(device: int) -> None:
    from collectives.nccl import NcclBackend

    dev = torch.device("cuda", device)
    store = LocalStoreRef()
    raw = NcclBackend(store.store, "gpu-check-raw/0/", 0, 1, NCCL_TIMEOUT_S, device)
    group = _group("gpu-check-ops", store, 0, device)
    T = NCCL_TIMEOUT_S

    def backend(op: str) -> Callable[[torch.dtype], tuple[torch.Tensor, torch.Tensor]]:
        """op -> a call that runs it on the backend for one dtype and returns (output, expected)."""

        def run(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            x = _values((6, 2), dtype, dev)
            if op in ("all_reduce_sum", "all_reduce_max"):  # out of place: NCCL's own send/recv buffers
                out = _sentinel(x)
                raw.all_reduce(x, op.rsplit("_", 1)[1], out=out).wait(T)
                return out, x
            if op == "broadcast":
                out = _sentinel(x)
                raw.broadcast(x, 0, out=out).wait(T)
                return out, x
            if op == "all_to_all_uneven":  # 7 rows of 3: at world size 1 the one peer takes them all
                x = _values((7, 3), dtype, dev)
            out = _sentinel(x)
            if op.startswith("reduce_scatter"):
                raw.reduce_scatter(out, x, op.rsplit("_", 1)[1]).wait(T)
            elif op == "all_gather":
                raw.all_gather(out, x).wait(T)
            elif op.startswith("all_to_all"):
                raw.all_to_all(out, x, [x.shape[0]], [x.shape[0]]).wait(T)
            elif op == "send_recv":
                raw.send_recv(x, 0, out, 0).wait(T)
            return out, x

        return run

    def via_group(op: str) -> Callable[[torch.dtype], tuple[torch.Tensor, torch.Tensor]]:
        def run(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            x = _values((6, 2), dtype, dev)
            out = _sentinel(x)  # send_recv: what Group hands to NCCL at world size 1
            return group.send_recv(x, 0, out, 0), x

        return run

    cases: dict[tuple[str, str], Callable[[torch.dtype], tuple[torch.Tensor, torch.Tensor]]] = {}
    for op in (
        "all_reduce_sum",
        "all_reduce_max",
        "reduce_scatter_sum",
        "reduce_scatter_max",
        "all_gather",
        "all_to_all_even",
        "all_to_all_uneven",
        "broadcast",
        "send_recv",
    ):
        cases[("backend", op)] = backend(op)
    cases[("group", "send_recv")] = via_group("send_recv")
    for (path, op), run in cases.items():
        failed: dict[str, str] = {}
        start = time.perf_counter()
        for name, dtype in DTYPES.items():
            if op.endswith("_avg") and not dtype.is_floating_point:
                continue  # an average of integers is refused by design
            try:
                out, want = run(dtype)
                torch.cuda.synchronize(dev)
                (raw.check if path == "backend" else group.check)()
                if not torch.equal(out.cpu(), want.cpu()):
                    failed[name] = f"got {out.flatten()[:6].tolist()}, want {want.flatten()[:6].tolist()}"
            except Exception as err:  # noqa: BLE001 - every dtype is reported, the rest still run
                failed[name] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        ms = (time.perf_counter() - start) * 1e3
        if failed:
            emit("nccl", False, path=path, op=op, failed=failed, ms=ms)
        else:
            emit("nccl", True, path=path, op=op, dtypes=list(DTYPES), ms=ms)
    start = time.perf_counter()
    raw.barrier().wait(T)
    torch.cuda.synchronize(dev)
    raw.check()
    emit("nccl", True, path="backend", op="barrier", ms=(time.perf_counter() - start) * 1e3)

    refused = {}
    x = _values((6, 2), torch.float32, dev)
    for what, call in {
        "cpu tensor": lambda: raw.all_gather(torch.empty(6, 2), x.cpu()),
        "non-contiguous tensor": lambda: raw.all_gather(_sentinel(x).t(), x.t()),
    }.items():
        try:
            call()
            refused[what] = None
        except (ValueError, TypeError) as err:
            refused[what] = str(err)[:200]
    emit("handoff", all(refused.values()), refused=refused)
    group.destroy()
    raw.abort("gpu-check: done")


# -- 2-4. stream order, self send/recv, abort ----------------------------------------------------------------
def sleep_cycles(device: torch.device, ms: float) -> int:
    """Cycles of `torch.cuda._sleep` that keep the current stream busy ~`ms` (the clock is measured, since it
    idles low and boosts under load)."""
    cycles = 10_000_000
    for _ in range(2):  # the first run pays the launch and the clock's ramp
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    torch.cuda.synchronize(device)
    return int(per_ms * ms)


def stream_order(device: int) -> None:
    from collectives.nccl import NcclBackend

    dev = torch.device("cuda", device)
    store = LocalStoreRef()
    raw = NcclBackend(store.store, "gpu-check-order/0/", 0, 1, NCCL_TIMEOUT_S, device)
    group = _group("gpu-check-order", store, 1, device)
    sleep_ms = 200.0
    cycles = sleep_cycles(dev, sleep_ms)
    # NCCL connects a communicator's peers at their first op, on the host: done here, untimed, so that it
    # neither delays the producer check nor counts as the host waiting for the GPU below.
    warm = _values((1 << 20,), torch.float32, dev)
    raw.all_gather(_sentinel(warm), warm).wait(NCCL_TIMEOUT_S)
    group.send_recv(warm, 0, _sentinel(warm), 0)
    torch.cuda.synchronize(dev)

    # The producer: the fill runs only after the sleep on the current stream. NCCL must wait for it, and the
    # consumer (a clone queued on the current stream after wait()) must wait for NCCL.
    x = torch.full((1 << 20,), float(SENTINEL), device=dev)
    out = _sentinel(x)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(cycles)
    x.fill_(3.0)
    raw.all_gather(out, x).wait(NCCL_TIMEOUT_S)
    seen = out.clone()
    torch.cuda.synchronize(dev)
    raw.check()
    emit(
        "stream_order",
        bool((out == 3).all() and (seen == 3).all()),
        path="backend",
        op="all_gather",
        producer_seen=bool((out == 3).all()),
        consumer_seen=bool((seen == 3).all()),
        sleep_ms=sleep_ms,
    )

    # The same through a synchronous Group op, timed on the host: it must return before the GPU drains.
    y = torch.full((1 << 20,), float(SENTINEL), device=dev)
    got = _sentinel(y)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(cycles)
    y.fill_(5.0)
    start = time.perf_counter()
    group.send_recv(y, 0, got, 0)
    host_ms = (time.perf_counter() - start) * 1e3
    seen = got.clone()
    torch.cuda.synchronize(dev)
    group.check()
    ordered = bool((got == 5).all() and (seen == 5).all())
    emit(
        "stream_order",
        ordered,
        path="group",
        op="send_recv",
        producer_seen=bool((got == 5).all()),
        consumer_seen=bool((seen == 5).all()),
        sleep_ms=sleep_ms,
    )
    emit("host_not_blocked", host_ms < sleep_ms / 2, host_ms=host_ms, gpu_busy_ms=sleep_ms)
    group.destroy()
    raw.abort("gpu-check: done")


def send_recv_self(device: int) -> None:
    dev = torch.device("cuda", device)
    group = _group("gpu-check-self", LocalStoreRef(), 0, device)
    x = _values((16 << 20,), torch.float32, dev)  # 64 MiB: several of NCCL's chunks
    group.send_recv(x[:1024], 0, _sentinel(x[:1024]), 0)  # untimed: NCCL connects the peers at a first op
    out = _sentinel(x)
    torch.cuda.synchronize(dev)
    start = time.perf_counter()
    group.send_recv(x, 0, out, 0)
    torch.cuda.synchronize(dev)
    group.check()
    ms = (time.perf_counter() - start) * 1e3
    emit("send_recv_self", torch.equal(out, x), bytes=x.numel() * 4, ms=ms, gb_per_s=x.numel() * 4 / ms / 1e6)
    group.destroy()


def abort_and_reform(device: int) -> None:
    dev = torch.device("cuda", device)
    store = LocalStoreRef()
    x = _values((1 << 20,), torch.float32, dev)
    first = _group("gpu-check-abort", store, 1, device)
    out = _sentinel(x)
    first.send_recv(x, 0, out, 0)
    torch.cuda.synchronize(dev)
    worked = torch.equal(out, x)

    torch.cuda._sleep(sleep_cycles(dev, 200.0))  # keeps the ops below pending when the abort comes
    first.send_recv(x, 0, _sentinel(x), 0)  # synchronous: returns to the host while it waits on the GPU
    pending = first.send_recv(x, 0, _sentinel(x), 0, async_op=True)
    # a hang report's view: both ops listed while they run, and still after the abort (it must not raise)
    listed_before = [p.op for p in first.state().pending]
    first.abort("gpu-check: abort test")
    try:
        listed_after: list[str] | str = [p.op for p in first.state().pending]
    except Exception as err:  # noqa: BLE001 - the row reports it
        listed_after = f"{type(err).__name__}: {err}"
    raised: dict[str, str | None] = {}
    for what, call in {
        "pending": pending.wait,
        "later": lambda: first.send_recv(x, 0, _sentinel(x), 0),
    }.items():
        try:
            call()
            raised[what] = None
        except GroupError as err:
            raised[what] = str(err)[:200]
    torch.cuda.synchronize(dev)  # the aborted communicator's work ends: nothing is left spinning

    second = _group("gpu-check-abort", store, 2, device)
    again = _sentinel(x)
    second.send_recv(x, 0, again, 0)
    torch.cuda.synchronize(dev)
    second.check()
    reformed = torch.equal(again, x)
    second.destroy()
    both = ["send to 0 / recv from 0"] * 2
    emit(
        "abort",
        worked and all(raised.values()) and reformed and listed_before == both and listed_after == both,
        before_abort=worked,
        raised=raised,
        reformed_epoch_2=reformed,
        pending_before_abort=listed_before,
        pending_after_abort=listed_after,
    )


# -- 5. create/destroy cycles ---------------------------------------------------------------------------
def _process_counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def create_destroy(device: int, cycles: int) -> None:
    dev = torch.device("cuda", device)
    store = LocalStoreRef()
    x = _values((1 << 16,), torch.float32, dev)
    out = _sentinel(x)
    epoch = itertools.count()

    def formed(name: str) -> Any:
        group = _group(name, store, next(epoch), device)
        group.send_recv(x, 0, out, 0)
        torch.cuda.synchronize(dev)
        group.check()
        return group

    for _ in range(3):  # warm-up: NCCL's and CUDA's one-time allocations and threads, torch's cache
        formed("gpu-check-cycle").destroy()
    torch.cuda.synchronize(dev)
    free0, (threads0, fds0) = torch.cuda.mem_get_info(dev)[0], _process_counts()
    start = time.perf_counter()
    for _ in range(cycles):
        formed("gpu-check-cycle").destroy()
    torch.cuda.synchronize(dev)
    cycle_s = (time.perf_counter() - start) / cycles
    free1, (threads1, fds1) = torch.cuda.mem_get_info(dev)[0], _process_counts()

    live = [formed(f"gpu-check-live{i}") for i in range(4)]  # what one communicator holds while alive
    free2, (threads2, _) = torch.cuda.mem_get_info(dev)[0], _process_counts()
    for group in live:
        group.destroy()
    per_comm_mib = (free1 - free2) / 4 / 2**20
    per_comm_threads = (threads2 - threads1) / 4
    leak_mib = (free0 - free1) / 2**20
    bounded = leak_mib <= LEAK_MIB and threads1 - threads0 <= LEAK_THREADS and fds1 - fds0 <= LEAK_FDS
    # The row proves nothing unless a communicator left behind in every cycle would break a bound.
    sensitive = per_comm_mib * cycles > LEAK_MIB or per_comm_threads * cycles > LEAK_THREADS
    emit(
        "create_destroy",
        bounded and sensitive,
        cycles=cycles,
        leak_mib=leak_mib,
        bound_mib=LEAK_MIB,
        threads=[threads0, threads1],
        fds=[fds0, fds1],
        per_comm_mib=per_comm_mib,
        per_comm_threads=per_comm_threads,
        sensitive=sensitive,
        cycle_ms=cycle_s * 1e3,
    )


# -- 6. a bf16 step against plain PyTorch --------------------------------------------------------------------
def _rel_diffs(ref: list[float], got: list[float]) -> list[float]:
    return [abs(g - r) / abs(r) for r, g in zip(ref, got, strict=True)]


def step_loop(preset: str, device: str, rounds: int, steps: int, batch: int) -> None:
    cfg = _common.make_config(
        preset,
        [
            f'parallel.device="{device}"',
            "parallel.microbatches=1",
            f"parallel.timeout_s={MESH_TIMEOUT_S}",
            f"train.global_batch={batch}",
            'train.precision="bf16"',
            f"train.steps={rounds * steps + 1}",
        ],
    )
    mesh = ActorMesh(cfg, "gpu-check-step")
    mesh.start()
    plain: _common.PlainLoop | None = None
    try:
        plain = _common.PlainLoop(cfg, device="cuda" if device == "gpu" else "cpu")
        losses: dict[str, list[float]] = {"raypar": [mesh.step(0).loss], "plain": [plain.step(0)[1]]}
        times: dict[str, list[float]] = {"raypar": [], "plain": []}  # step 0 (warm-up) is not timed
        for r in range(rounds):  # alternating blocks: drift in clocks or load hits both sides alike
            for s in range(steps):
                result = mesh.step(1 + r * steps + s)
                times["raypar"].append(result.step_time_s)
                losses["raypar"].append(result.loss)
            for s in range(steps):
                if device == "gpu":
                    torch.cuda.synchronize()
                seconds, loss = plain.step(1 + r * steps + s)
                times["plain"].append(seconds)
                losses["plain"].append(loss)
        tokens = cfg.train.global_batch * cfg.model.seq_len
        peak = mesh.peak_flops or 0.0
        diffs = _rel_diffs(losses["plain"], losses["raypar"])
        changes = _rel_diffs(losses["plain"][:-1], losses["plain"][1:])
        row: dict[str, Any] = {
            "preset": preset,
            "device": device,
            "tokens_per_step": tokens,
            "max_rel_diff": max(diffs),
            "rtol": BF16_RTOL,
            "min_step_change": min(changes),
            "losses": losses,
            "peak_tflops": peak / 1e12 if peak else None,
        }
        for side, ts in times.items():
            t = _common.median(ts)
            row[f"{side}_ms"] = t * 1e3
            row[f"{side}_mfu"] = flops.mfu(tokens / t, cfg.model, peak) if peak else None
        row["ratio"] = row["plain_ms"] / row["raypar_ms"]  # raypar throughput / plain throughput
        emit("step", max(diffs) <= BF16_RTOL, **row)
    finally:
        mesh.shutdown()
        del plain  # its model and optimizer state leave the GPU before the next section's actors need it


def float8_steps(preset: str, device: str, steps: int) -> None:
    """bf16, then fp8 with each recipe, at (1, 1, 1) on the same batches: losses and median step times."""
    base = [f'parallel.device="{device}"', "parallel.microbatches=1", f"parallel.timeout_s={MESH_TIMEOUT_S}",
            "train.global_batch=4", f"train.steps={steps}"]
    runs: dict[str, tuple[list[float], float]] = {}
    for name, extra in (("bf16", ['train.precision="bf16"']),
                        *((r, ['train.precision="fp8"', f'train.fp8_recipe="{r}"']) for r in FP8_RECIPES)):
        mesh = ActorMesh(_common.make_config(preset, [*base, *extra]), f"gpu-check-{name}")
        mesh.start()
        try:
            results = [mesh.step(s) for s in range(steps)]
        finally:
            mesh.shutdown()  # before the next mesh: it needs the same GPU
        runs[name] = [r.loss for r in results], _common.median([r.step_time_s for r in results[1:]])
    bf16_losses, bf16_s = runs.pop("bf16")
    worst = max(max(_rel_diffs(bf16_losses, losses)) for losses, _ in runs.values())
    emit(
        "fp8", worst <= FP8_RTOL, preset=preset, max_rel_diff=worst, rtol=FP8_RTOL, bf16_losses=bf16_losses,
        bf16_ms=bf16_s * 1e3, **{f"{r}_losses": losses for r, (losses, _) in runs.items()},
        **{f"{r}_speedup": bf16_s / t for r, (_, t) in runs.items()},
    )


# -- 7-9. meshes sharing one GPU -------------------------------------------------------------------------
def _losses(cfg_overrides: list[str], preset: str, run: str, steps: int) -> list[float]:
    mesh = ActorMesh(_common.make_config(preset, cfg_overrides), run)
    mesh.start()
    try:
        return [mesh.step(s).loss for s in range(steps)]
    finally:
        mesh.shutdown()  # before the next mesh: it needs the same GPU


def _shared(device: str) -> list[str]:
    base = [f'parallel.device="{device}"', f"parallel.timeout_s={MESH_TIMEOUT_S}", "train.global_batch=8"]
    base.append('parallel.transport="object_store"')
    return base + (["parallel.gpus_per_actor=0.5"] if device == "gpu" else [])


_SINGLE: dict[tuple[str, str, int], list[float]] = {}  # (preset, device, steps) -> the one actor's losses


def single_actor(preset: str, device: str, steps: int) -> list[float]:
    """The reference of pp = 2 and of every dp = 2 variant: one actor, 4 microbatches of 2 rows (a dp = 2
    replica's at 2 microbatches, a pp = 2 run's at 4). Run once; a section that needs it after a failure runs
    it again."""
    key = (preset, device, steps)
    if key not in _SINGLE:
        base = [*_shared(device), "parallel.microbatches=4", f"train.steps={steps}"]
        _SINGLE[key] = _losses(base, preset, "gpu-check-single", steps)
    return _SINGLE[key]


def pipeline(preset: str, device: str, steps: int) -> None:
    base = [*_shared(device), "parallel.microbatches=4", f"train.steps={steps}"]
    one = single_actor(preset, device, steps)
    two = _losses([*base, "parallel.pp=2"], preset, "gpu-check-pp2", steps)
    worst = max(_rel_diffs(one, two))
    emit("pp2", worst <= LAYOUT_RTOL, losses_pp1=one, losses_pp2=two, max_rel_diff=worst, rtol=LAYOUT_RTOL)


DP_VARIANTS = {  # name -> overrides on top of dp=2
    "plain": ["parallel.zero=0"],
    "zero1": ["parallel.zero=1"],
    "zero2": ["parallel.zero=2"],
    "zero3": ["parallel.zero=3"],
    "zero2+offload": ["parallel.zero=2", 'train.offload="cpu"'],
}


def dp_shared(budget: Budget, preset: str, device: str, steps: int) -> None:
    """The single actor's losses (`single_actor`, which pp2 ran already), then each dp=2 variant as a section
    of its own (one failing does not hide the others).
    The variants share one dp=2 mesh: `reconfigure` rebuilds every actor's state from the seed under the
    variant's config in the same processes (a mesh start costs more than the steps); after a failure the
    next variant starts a fresh mesh."""
    base = [*_shared(device), "parallel.microbatches=2", f"train.steps={steps}"]
    ref: list[float] = []
    section(
        budget,
        "dp_shared",
        120.0,
        lambda: ref.extend(single_actor(preset, device, steps)),
    )
    if not ref:
        return  # its failed row is out; without the reference no variant can be judged
    held: list[ActorMesh] = []

    plain_bytes: list[int] = []  # the unsharded variant's model state per rank, once it ran

    def variant(name: str, extra: list[str]) -> None:
        cfg = _common.make_config(preset, [*base, "parallel.dp=2", *extra])
        try:
            if held:
                held[0].reconfigure(cfg)
            else:
                held.append(ActorMesh(cfg, "gpu-check-dp2"))
                held[0].start()
            stepped = [held[0].step(s) for s in range(steps)]
        except Exception:
            held.pop().shutdown()
            raise
        got = [r.loss for r in stepped]
        # Model state (parameters, gradients, master weights, moments) of each rank: a ZeRO variant must hold
        # less than the plain one, or it did not take effect and the loss comparison says nothing about it.
        per_rank = [a.memory.model_state_bytes for a in stepped[-1].per_actor.values()]
        if name == "plain":
            plain_bytes.append(max(per_rank))
        sharded = name == "plain" or (bool(plain_bytes) and max(per_rank) < plain_bytes[0])
        worst = max(_rel_diffs(ref, got))
        emit(
            "dp_shared",
            worst <= LAYOUT_RTOL and sharded,
            variant=name,
            losses_dp1=ref,
            losses_dp2=got,
            max_rel_diff=worst,
            rtol=LAYOUT_RTOL,
            state_bytes_per_rank=per_rank,
            plain_state_bytes=plain_bytes[0] if plain_bytes else None,
        )

    try:
        for name, extra in DP_VARIANTS.items():
            section(budget, "dp_shared", 90.0, lambda name=name, extra=extra: variant(name, extra))
    finally:
        for mesh in held:
            mesh.shutdown()


def checkpoint_round_trip(preset: str, device: str) -> None:
    """Steps 0-1, save, steps 2-3; then fresh actors load the save and run steps 2-3 again."""
    cfg = _common.make_config(
        preset,
        [
            *_shared(device),
            "parallel.pp=2",
            "parallel.microbatches=2",
            "train.steps=4",
            "model.dropout=0.1",
        ],  # dropout: the losses after the load depend on the RNG state too
    )
    with tempfile.TemporaryDirectory() as root:
        saved = ActorMesh(cfg, "gpu-check-save")
        saved.start()
        try:
            for s in range(2):
                saved.step(s)
            start = time.perf_counter()
            staging, writers = saved.begin_checkpoint(root, 2)
            entries = saved.collect(saved.checkpoint_writes(writers), "writing checkpoint shards")
            meta = {**saved.optimizer_state(), "rng": saved.rng_states()}  # as training.Trainer writes them
            uri = checkpoint.publish(root, staging, 2, entries, meta, keep=1)
            save_s = time.perf_counter() - start
            params = saved.parameters()
            went_on = [saved.step(s).loss for s in (2, 3)]
        finally:
            saved.shutdown()  # before the fresh mesh: its actors need the GPU this one holds
        fresh = ActorMesh(cfg, "gpu-check-load")
        fresh.start()
        try:
            seeded_rng = fresh.rng_states()
            fresh.load(uri)
            loaded = fresh.parameters()
            loaded_opt, loaded_rng = fresh.optimizer_state(), fresh.rng_states()
            again = [fresh.step(s).loss for s in (2, 3)]
        finally:
            fresh.shutdown()
    same_params = params.keys() == loaded.keys() and all(torch.equal(params[n], loaded[n]) for n in params)
    opt = {k: meta[k] for k in loaded_opt}
    # The first step after the load is a forward and backward from the loaded weights and RNG: bit for bit.
    # The second also depends on the first's gradients, which GPU kernels with atomics (attention's
    # backward) sum in varying order (~1e-7 relative): one Adam step later that is far below 1e-5.
    second = abs(again[1] - went_on[1]) / abs(went_on[1])
    checks = {
        "parameters": same_params,
        "optimizer_counters": loaded_opt == opt and opt.get("optimizer_steps", 0) > 0,
        "rng": loaded_rng == meta["rng"] and seeded_rng != meta["rng"],  # else the RNG check proves nothing
        "first_step_loss": again[0] == went_on[0],
        "second_step_loss": second <= 1e-5,
    }
    emit(
        "checkpoint",
        all(checks.values()),
        checks=checks,
        tensors=len(params),
        losses_saved_run=went_on,
        losses_loaded_run=again,
        save_s=save_s,
    )


NCCL_SECTIONS = ("nccl", "stream_order", "send_recv_self", "create_destroy", "abort")
RAY_SECTIONS = ("ray", "step", "fp8", "pp2", *["dp_shared"] * (1 + len(DP_VARIANTS)), "checkpoint")


def nccl_sections(quick: bool, deadline_s: float | None) -> None:
    """Sections 1-5 (`--nccl-only`: the first device call, or the child process of a whole run). Abort comes
    last: an aborted communicator is the one thing here that could leave the CUDA context broken."""
    budget = Budget(deadline_s=deadline_s, planned=NCCL_SECTIONS)
    section(budget, "nccl", 60.0, lambda: nccl_ops(0))
    section(budget, "stream_order", 30.0, lambda: stream_order(0))
    section(budget, "send_recv_self", 30.0, lambda: send_recv_self(0))
    section(budget, "create_destroy", 120.0, lambda: create_destroy(0, 10 if quick else CYCLES))
    section(budget, "abort", 45.0, lambda: abort_and_reform(0))


NCCL_CHILD_S = 300.0  # the budgets above and the start; past it the child is stuck in a call no budget ends


def nccl_child(quick: bool, deadline_s: float | None) -> None:
    """Sections 1-5 in a child process, its rows relayed: a sticky CUDA error or a hang there leaves this
    process's CUDA context and the later sections alone, and its GPU memory is gone before the llama-1b step.
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--nccl-only", *(["--quick"] if quick else []),
           *(["--deadline-s", str(deadline_s)] if deadline_s is not None else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    seen: list[str] = []

    def relay() -> None:
        for line in proc.stdout:
            row = json.loads(line) if line.startswith("{") else None
            if row is not None and row.get("check") not in (None, "summary"):
                results.append(row)
            if row is None or row.get("check") != "summary":
                print(line, end="", flush=True)
            seen.append(line)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=NCCL_CHILD_S if deadline_s is None else min(NCCL_CHILD_S, deadline_s + 10))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        emit("nccl_process", False, error=f"stuck past {NCCL_CHILD_S:g}s (in a call no budget could end)")
    reader.join(timeout=10)
    if rc not in (0, 1) or not any(ln.startswith('{"check": "summary"') for ln in seen):
        emit("nccl_process", False, error=f"the child process ended with status {rc} before its summary")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps (CPU without a GPU)")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 at once if torch sees no GPU")
    parser.add_argument("--nccl-only", action="store_true",
                        help="sections 1-5 alone, in this process, without importing Ray (device call 1)")
    parser.add_argument("--skip-nccl", action="store_true", help="sections 6-9 alone (device call 2)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="end by then: the running and every later section print null rows, saying why")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if args.require_gpu and not gpu:
        print(f"gpu_check: --require-gpu, and torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 1
    if args.nccl_only:
        if gpu:
            nccl_sections(args.quick, args.deadline_s)
        else:
            for check in NCCL_SECTIONS:
                emit(check, None, unverified="no CUDA device on this machine")
        final = summary()
        print(json.dumps(final), flush=True)
        return 0 if final["ok"] else 1

    _import_ray_side()
    device = "gpu" if gpu else "cpu"
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "ray": ray.__version__,
        "python": sys.version.split()[0],
    }
    if gpu:
        info["gpu"], info["cuda"] = torch.cuda.get_device_name(0), torch.version.cuda
        try:
            import cupy
            from cupy.cuda import nccl

            info["cupy"], info["nccl"] = cupy.__version__, nccl.get_version()
        except ImportError as err:
            info["cupy"] = f"missing: {err}"
    print(json.dumps({"info": info}), flush=True)

    start = time.perf_counter()
    budget = Budget(scale=1.0 if gpu else 5.0, deadline_s=args.deadline_s, planned=RAY_SECTIONS)
    if args.skip_nccl:
        pass  # the first device call's rows
    elif gpu:
        nccl_child(args.quick, budget.left_s())
    else:
        for check in NCCL_SECTIONS:
            emit(check, None, unverified="no CUDA device on this machine")

    # A private local Ray: that it starts is this section's check on a device machine. The suite's CPU run
    # joins its shared Ray instead (RAYPAR_BENCH_RAY_ADDRESS); the sections after this one run the same there.
    section(budget, "ray", 120.0, lambda: _common.start_ray(num_cpus=max(os.cpu_count() or 1, 4)))
    ray_gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    if ray.is_initialized() and gpu and not ray_gpus:  # the meshes would wait for a GPU that never comes
        emit("ray", False, error=f"torch sees a GPU, Ray does not: {ray.cluster_resources()}")
    elif ray.is_initialized():  # else its failed row is out, and every later section needs Ray
        small, big = ("tiny", "tiny") if args.quick else ("small", "llama-1b")
        if args.quick:
            section(budget, "step", 120.0, lambda: step_loop(big, device, rounds=1, steps=2, batch=4))
        else:
            section(budget, "step", 240.0, lambda: step_loop(big, device, rounds=3, steps=3, batch=4))
        if not gpu:
            budget.skip("fp8")
            emit("fp8", None, unverified="no CUDA device on this machine (torchao would only emulate float8)")
        elif importlib.util.find_spec("torchao") is None:
            budget.skip("fp8")
            emit("fp8", None, unverified="torchao is not installed (tests/gpu/gpu_wheels.sh carries it)")
        else:  # at the quick run's preset too: `tiny`'s dims are multiples of 16, as float8 GEMMs need
            section(budget, "fp8", 240.0, lambda: float8_steps(big, device, steps=5))
        steps = 2 if args.quick else 3  # two: the second step's loss already depends on the first's update
        section(budget, "pp2", 120.0, lambda: pipeline(small, device, steps=steps))
        dp_shared(budget, small, device, steps=steps)
        section(budget, "checkpoint", 150.0, lambda: checkpoint_round_trip(small, device))
    ray.shutdown()
    final = {**summary(), "seconds": time.perf_counter() - start}
    print(json.dumps(final), flush=True)
    return 0 if final["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
