"""Activation recomputation: step time and saved activation bytes, none / selective / full, side by side.

    python benchmarks/recompute.py            # `small` (12.8M), microbatch 8 x 128 tokens, 1 thread
    python benchmarks/recompute.py --quick    # `tiny`, a few iterations (the test suite runs this)

One process, raypar's stage (the whole model as one) with `set_recompute(mode)`; each
iteration is one microbatch's forward and backward. The three modes run in alternating blocks of
iterations (so load from other processes hits all alike); reported: the median iteration time, its ratio
to `none`, and the bytes autograd saved for backward in the forward
(`raypar.core.observe.memory.SavedActivations`).
The literature's expectation for `full` is about +1/3 compute (one more forward, with backward = 2
forwards: 4/3); `selective` recomputes only the attention core and the SwiGLU activation (Korthikanti et
al. 2022), a few percent of the FLOPs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _alternating  # noqa: E402
from raypar.core.model import families  # noqa: E402
from raypar.core.observe.memory import SavedActivations  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402

MODES = ("none", "selective", "full")
ROOT = Path(__file__).resolve().parents[1]


def measure(preset: str, batch: int, blocks: int, per_block: int) -> list[dict[str, float]]:
    cfg = load_config(ROOT / "examples/configs/tiny.toml", [f'model.preset="{preset}"'])
    m = cfg.model
    torch.manual_seed(0)
    stages = {mode: families.build_stage(m, seed=cfg.train.seed) for mode in MODES}
    for mode, stage in stages.items():
        stage.set_recompute(mode, 1)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), generator=gen)
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    saved: dict[str, int] = {}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for block in range(blocks + 1):  # block 0 warms up every mode
        order = MODES if block % 2 == 0 else MODES[::-1]
        for mode in order:
            stage = stages[mode]
            for _ in range(per_block):
                meter = SavedActivations([*stage.parameters(), *stage.buffers()])
                start = time.perf_counter()
                with meter:
                    loss = stage(ids, targets)
                loss.backward()
                elapsed = time.perf_counter() - start
                stage.zero_grad(set_to_none=True)
                saved[mode] = meter.bytes
                if block:
                    times[mode].append(elapsed)
    base = statistics.median(times["none"])
    return [
        {
            "mode": mode,
            "median_ms": statistics.median(times[mode]) * 1e3,
            "vs_none": statistics.median(times[mode]) / base,
            "saved_mib": saved[mode] / 2**20,
            "saved_vs_none": saved[mode] / saved["none"],
            "iterations": len(times[mode]),
        }
        for mode in MODES
    ]


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    args, preset, blocks, per_block = _alternating.parse(__doc__.split("\n")[0], "mode", argv)
    rows = measure(preset, args.batch, blocks, per_block)
    print(_alternating.header(args, preset))
    print("| recompute | ms per forward+backward | vs none | saved activations MiB | vs none |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['mode']} | {row['median_ms']:.1f} | {row['vs_none']:.3f} | {row['saved_mib']:.2f} | "
              f"{row['saved_vs_none']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
