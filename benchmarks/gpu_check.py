"""`make gpu-check`: raypar's GPU path, checked in one command on a machine with one GPU (< 8 minutes).

Prints one JSON line per result, `{"check": ..., "ok": ..., ...}`, and exits 1 if any check failed:

1. `nccl`: every NCCL op (all_reduce sum/avg/max, reduce_scatter, all_gather, all_to_all, broadcast,
   barrier) and dtype (fp32, bf16, fp16, int64) at world size 1: through `Group` (raypar's API, CUDA
   tensors in and out) and straight on the NCCL backend (the `Group` answers some ops at world size 1
   without a collective, the backend never does). NCCL refuses two ranks on one GPU, so multi-rank NCCL
   needs a machine with several GPUs: the output says so instead of failing.
2. `step`: `llama-1b` in bf16 at (dp, pp, tp) = (1, 1, 1): raypar's step time and MFU against a plain
   PyTorch loop on the same GPU (same model, batches, optimizer settings), in alternating blocks.
3. `pp2`: pp = 2 with two actors sharing the GPU (`parallel.gpus_per_actor = 0.5`), activations over the
   object store (device -> host -> plasma -> host -> device): losses equal the pp = 1 run's.
4. `checkpoint`: the pp = 2 state saved from GPU memory, loaded into fresh actors, equal bit for bit.

`--quick` runs the same code at the `tiny` preset (on the CPU when there is no GPU: the NCCL part then
says why it is skipped); the test suite runs it so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from benchmarks import _common  # noqa: E402
from raypar import checkpoint, flops  # noqa: E402
from raypar.controller.actor_mesh import ActorMesh  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int64": torch.int64}
results: list[dict[str, Any]] = []


def emit(check: str, ok: bool, **fields: Any) -> None:
    row = {"check": check, "ok": ok, **fields}
    results.append(row)
    print(json.dumps(row, default=str), flush=True)


# -- 1. NCCL ------------------------------------------------------------------------------------------------
def nccl_ops() -> None:
    if not torch.cuda.is_available():
        emit("nccl", True, skipped="no CUDA device on this machine")
        return
    from collectives import GroupSpec, LocalStoreRef, create_group
    from collectives.nccl import BackendUnavailable, NcclBackend

    local = LocalStoreRef()  # one member, in this process
    try:
        group = create_group(GroupSpec("check", ("me",), 0, local, 0, "nccl", 60.0, 0))
        raw = NcclBackend(local.store, "raw/0", 0, 1, 60.0, 0)
    except BackendUnavailable as err:
        emit("nccl", False, error=f"NCCL unavailable: {err}")
        return
    dev = torch.device("cuda", 0)
    for name, dtype in DTYPES.items():
        x = (torch.arange(12, device=dev) % 7).to(dtype).reshape(6, 2)
        for op, run in _cases(group, raw, x).items():
            start = time.perf_counter()
            try:
                out = run()
                torch.cuda.synchronize()
                ok = out.device == dev and torch.equal(out.cpu(), x.cpu())
                emit("nccl", ok, op=op, dtype=name, ms=(time.perf_counter() - start) * 1e3)
            except Exception as err:  # noqa: BLE001 - every op is reported, the rest still run
                emit("nccl", False, op=op, dtype=name, error=f"{type(err).__name__}: {err}")
    start = time.perf_counter()
    group.barrier()
    emit("nccl", True, op="barrier", ms=(time.perf_counter() - start) * 1e3)
    emit(
        "nccl",
        True,
        note=f"world size 1 only: this machine has {torch.cuda.device_count()} GPU(s), and NCCL refuses "
        "two ranks on one GPU; multi-rank NCCL (send/recv, real reductions) needs several GPUs",
    )
    group.destroy()


def _cases(group: Any, raw: Any, x: torch.Tensor) -> dict[str, Any]:
    """op name -> a call whose result must equal `x` (at world size 1 every op is the identity)."""
    cases = {
        "all_reduce_sum": lambda: group.all_reduce(x.clone(), "sum"),
        "all_reduce_max": lambda: group.all_reduce(x.clone(), "max"),
        "reduce_scatter": lambda: group.reduce_scatter(x.clone(), "sum"),
        "all_gather": lambda: group.all_gather(x.clone()),
        "all_to_all": lambda: group.all_to_all(x.clone()),
        "broadcast": lambda: group.broadcast(x.clone(), 0),
        "raw_all_reduce": lambda: _raw(raw.all_reduce, x.clone(), "sum"),
        "raw_reduce_scatter": lambda: _raw_into(raw.reduce_scatter, x, "sum"),
        "raw_all_gather": lambda: _raw_into(raw.all_gather, x),
        "raw_all_to_all": lambda: _raw_into(raw.all_to_all, x),
        "raw_broadcast": lambda: _raw(raw.broadcast, x.clone(), 0),
    }
    if x.dtype.is_floating_point:  # an average of integers is no integer
        cases["all_reduce_avg"] = lambda: group.all_reduce(x.clone(), "avg")
    return cases


def _raw(op: Any, tensor: torch.Tensor, *args: Any) -> torch.Tensor:
    op(tensor, *args).wait(60.0)
    return tensor


def _raw_into(op: Any, tensor: torch.Tensor, *args: Any) -> torch.Tensor:
    out = torch.empty_like(tensor)
    if op.__name__ == "all_to_all":
        op(out, tensor, [tensor.shape[0]], [tensor.shape[0]]).wait(60.0)
    else:
        op(out, tensor, *args).wait(60.0)
    return out


# -- 2. a bf16 step loop against plain PyTorch ---------------------------------------------------------------
def step_loop(preset: str, device: str, rounds: int, steps: int, batch: int) -> None:
    cfg = _common.make_config(
        preset,
        [
            f'parallel.device="{device}"',
            "parallel.microbatches=1",
            f"train.global_batch={batch}",
            'train.precision="bf16"',
            f"train.steps={rounds * steps + 1}",
        ],
    )
    mesh = ActorMesh(cfg, "gpu-check-step")
    mesh.start()
    plain = _common.PlainLoop(cfg, device="cuda" if device == "gpu" else "cpu")
    try:
        mesh.step(0)  # warm-up: first kernels, allocator, autotuning
        plain.step(0)
        sides: dict[str, list[float]] = {"raypar": [], "plain": []}
        for r in range(rounds):  # alternating blocks: drift in clocks or load hits both sides alike
            for s in range(steps):
                sides["raypar"].append(mesh.step(1 + r * steps + s).step_time_s)
            for s in range(steps):
                if device == "gpu":
                    torch.cuda.synchronize()
                sides["plain"].append(plain.step(1 + r * steps + s)[0])
        tokens = cfg.train.global_batch * cfg.model.seq_len
        peak = mesh.peak_flops or 0.0
        row: dict[str, Any] = {"preset": preset, "device": device, "tokens_per_step": tokens}
        for side, times in sides.items():
            t = _common.median(times)
            row[f"{side}_ms"] = t * 1e3
            row[f"{side}_mfu"] = flops.mfu(tokens / t, cfg.model, peak) if peak else None
        row["ratio"] = row["plain_ms"] / row["raypar_ms"]  # raypar throughput / plain throughput
        emit("step", True, **row)
    finally:
        mesh.shutdown()


# -- 3 and 4. two stages on one GPU, then a checkpoint round trip -------------------------------------------
def shared_pipeline(preset: str, device: str, steps: int) -> None:
    base = [f'parallel.device="{device}"', "parallel.microbatches=4", "train.global_batch=8"]
    base += [f"train.steps={steps}", 'parallel.transport="object_store"']
    if device == "gpu":
        base.append("parallel.gpus_per_actor=0.5")
    losses = {}
    for pp in (1, 2):
        mesh = ActorMesh(_common.make_config(preset, [*base, f"parallel.pp={pp}"]), f"gpu-check-pp{pp}")
        mesh.start()
        try:
            losses[pp] = [mesh.step(s).loss for s in range(steps)]
            if pp == 2:
                checkpoint_round_trip(mesh)
        finally:
            mesh.shutdown()
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[2], losses[1], strict=True))
    emit("pp2", worst < 1e-4, losses_pp1=losses[1], losses_pp2=losses[2], max_rel_diff=worst)


def checkpoint_round_trip(mesh: ActorMesh) -> None:
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        staging, writers = mesh.begin_checkpoint(root, 1)
        entries = mesh.collect(mesh.checkpoint_writes(writers), "writing checkpoint shards")
        uri = checkpoint.publish(root, staging, 1, entries, {"optimizer_steps": 1}, keep=1)
        saved = mesh.parameters()
        written_s = time.perf_counter() - start
        fresh = ActorMesh(mesh.cfg, "gpu-check-load")
        fresh.start()
        try:
            fresh.load(uri)
            loaded = fresh.parameters()
        finally:
            fresh.shutdown()
    same = saved.keys() == loaded.keys() and all(torch.equal(saved[n], loaded[n]) for n in saved)
    emit("checkpoint", same, tensors=len(saved), save_s=written_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (CPU without a GPU)")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = "gpu" if gpu else "cpu"
    _common.start_ray(num_cpus=max(os.cpu_count() or 1, 4))
    nccl_ops()
    if args.quick:
        step_loop("tiny", device, rounds=1, steps=2, batch=4)
        shared_pipeline("tiny", device, steps=2)
    else:
        step_loop("llama-1b", device, rounds=3, steps=5, batch=8)
        shared_pipeline("small", device, steps=3)
    failed = [r for r in results if not r["ok"]]
    print(json.dumps({"check": "summary", "ok": not failed, "failed": len(failed), "total": len(results)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
