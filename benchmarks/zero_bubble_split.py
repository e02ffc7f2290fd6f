"""The zero-bubble backward split, B + W, against one plain backward: FLOPs and time, side by side.

    python benchmarks/zero_bubble_split.py            # small, microbatch 4 x 256, 1 thread
    python benchmarks/zero_bubble_split.py --quick    # tiny, a few repeats

One unit (the whole model as one stage, one microbatch) is run forward and then backward in three ways,
in alternating rounds on the same thread:
- `plain`: one `torch.autograd.backward` (what 1F1B does);
- `split`: raypar's backward_input then backward_weight (raypar.core.parallel.zb: B leaves the weight GEMMs
  to W);
- `rewalk`: the split as raypar did it before raypar.core.parallel.zb, W asking autograd for the parameter
  gradients again, which walks the graph a second time.
FLOPs come from `torch.utils.flop_counter`; times are the median over rounds of the backward ops alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from benchmarks import _common  # noqa: E402
from raypar.core.model import families  # noqa: E402
from raypar.core.pipeline.executor import ModelBackend  # noqa: E402
from raypar.core.pipeline.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Topology  # noqa: E402

UNIT = (0, 0)
SPLIT = [BACKWARD_INPUT, BACKWARD_WEIGHT]
WAYS = {"plain": [BACKWARD], "split": SPLIT, "rewalk": SPLIT}


class RewalkingW(ModelBackend):
    """The split before raypar.core.parallel.zb: B takes only the input gradient, W walks the whole graph
    again."""

    def split_backward(self) -> None:
        pass

    def compute(self, op: str, chunk: int, mb: int) -> None:
        unit = (chunk, mb)
        if op == BACKWARD_INPUT:
            roots, grads = self._roots(unit, pop=False)
            torch.autograd.grad(roots, self.inputs[unit], grads, retain_graph=True)
        elif op == BACKWARD_WEIGHT:
            torch.autograd.backward(*self._roots(unit, pop=True), inputs=self.model.chunk_parameters(chunk))
        else:
            super().compute(op, chunk, mb)


class NoTransport:
    """A one-stage model sends and receives nothing; the backend only gives buffers back."""

    def send_grad(self, chunk: int, mb: int, grad: torch.Tensor) -> None:
        raise AssertionError("a one-stage model sends no gradient")

    def release(self, kind: str, chunk: int, mb: int) -> None:
        pass


def one_stage_backend(preset: str, batch: int, way: str = "plain") -> ModelBackend:
    """A backend holding the whole `preset` model as one stage, fed one fixed microbatch of `batch` rows."""
    cfg = _common.make_config(preset)
    m = cfg.model
    model = families.build_stage(m, seed=0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.vocab_size, (batch, m.seq_len), generator=gen)
    targets = torch.randint(0, m.vocab_size, (batch, m.seq_len), generator=gen)
    like = torch.empty(batch, m.seq_len, m.d_model)
    backend_class = RewalkingW if way == "rewalk" else ModelBackend
    return backend_class(model, 0, Topology(1), NoTransport(), like, lambda mb: (ids, targets), 1)


def backward(backend: ModelBackend, ops: list[str], count: bool = False) -> tuple[float, int]:
    """Seconds (and FLOPs, if `count`) of one unit's backward `ops`, after its forward."""
    if BACKWARD_INPUT in ops:
        backend.split_backward()
    backend.model.zero_grad(set_to_none=True)
    backend.compute(FORWARD, *UNIT)
    counter = FlopCounterMode(display=False) if count else None
    start = time.perf_counter()
    if counter is not None:
        with counter:
            for op in ops:
                backend.compute(op, *UNIT)
    else:
        for op in ops:
            backend.compute(op, *UNIT)
    return time.perf_counter() - start, counter.get_total_flops() if counter is not None else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4, help="microbatch rows")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.rounds = "tiny", 3
    torch.set_num_threads(args.threads)
    backends = {way: one_stage_backend(args.preset, args.batch, way) for way in WAYS}
    flops = {way: backward(b, WAYS[way], count=True)[1] for way, b in backends.items()}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):  # alternating, so drift in the machine's load hits every way alike
        for way, b in backends.items():
            times[way].append(backward(b, WAYS[way])[0])
    title = f"zero-bubble split: {args.preset}, microbatch {args.batch}, {args.threads} thread(s)"
    print(_common.header(title))
    base_ms = 1e3 * statistics.median(times["plain"])
    rows = [
        {
            "backward": way,
            "GFLOP": f"{flops[way] / 1e9:.3f}",
            "FLOPs / plain": f"{flops[way] / flops['plain']:.3f}",
            "median ms": f"{1e3 * statistics.median(times[way]):.1f}",
            "time / plain": f"{1e3 * statistics.median(times[way]) / base_ms:.3f}",
        }
        for way in WAYS
    ]
    print(_common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
