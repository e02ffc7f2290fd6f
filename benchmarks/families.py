"""Model families side by side at one CPU size: step time and tokens/s of each variant next to Llama's.

    python benchmarks/families.py            # the `small` shape (12.7M), microbatch 8 x 256 tokens, 1 thread
    python benchmarks/families.py --quick    # `tiny`, a few iterations (the test suite runs this)

One process, each variant's whole stage built through the family registry (`families.build_stage`) at the
same shape, differing only by its switches (raypar.core.model.llama): Llama 2 (none), Llama 3.x (`llama3`
RoPE scaling: only the tables differ, so no cost), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms and a
head twice as wide: more attention FLOPs and parameters), and the MoE families at the same shape: Mixtral
(8 experts as wide as the dense MLP, top 2 renormalised, dropless) and Qwen3-MoE (Qwen3's attention, 8
experts a quarter as wide, top 2). Each iteration is one microbatch's forward and backward (with the MoE
layers' aux loss, as training adds it); the variants run in alternating blocks of iterations (load from
other processes hits all alike).
Reported: parameters and FLOPs per token from the family's cost, the median iteration time, tokens/s, and
the time ratio to Llama's.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _alternating  # noqa: E402
from raypar.core.model import families  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS: dict[str, dict] = {
    "llama": {},
    "llama3": {"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_len": 64},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},  # head_dim_override set below: twice the preset's
    "mixtral": {"family": "mixtral", "moe_experts": 8, "moe_top_k": 2, "moe_renormalize": True,
                "moe_capacity_factor": 0.0},
    "qwen3_moe": {"family": "qwen3_moe", "qk_norm": True, "moe_experts": 8, "moe_top_k": 2,
                  "moe_renormalize": True, "moe_capacity_factor": 0.0},  # head_dim_override, moe_d_ff: below
}


def measure(preset: str, batch: int, blocks: int, per_block: int) -> list[dict]:
    cfg = load_config(ROOT / "examples/configs/tiny.toml", [f'model.preset="{preset}"'])
    base = cfg.model
    configs = {name: dataclasses.replace(base, **fields) for name, fields in VARIANTS.items()}
    for name in ("qwen3", "qwen3_moe"):
        configs[name] = dataclasses.replace(configs[name], head_dim_override=2 * base.head_dim)
    configs["qwen3_moe"] = dataclasses.replace(configs["qwen3_moe"], moe_d_ff=base.d_ff // 4)
    torch.manual_seed(0)
    stages = {name: families.build_stage(m, seed=cfg.train.seed) for name, m in configs.items()}
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, base.vocab_size, (batch, base.seq_len + 1), generator=gen)
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[float]] = {name: [] for name in stages}
    names = list(stages)
    for block in range(blocks + 1):  # block 0 warms up every variant
        for name in names if block % 2 == 0 else names[::-1]:
            for _ in range(per_block):
                start = time.perf_counter()
                loss, aux = stages[name](ids, targets), stages[name].take_aux_loss()
                (loss if aux is None else loss + aux).backward()
                stages[name].take_moe_stats()
                elapsed = time.perf_counter() - start
                stages[name].zero_grad(set_to_none=True)
                if block:
                    times[name].append(elapsed)
    llama = statistics.median(times["llama"])
    rows = []
    for name, m in configs.items():
        cost, median = families.family(m).cost, statistics.median(times[name])
        rows.append({
            "variant": name, "params": cost.count_params(m), "flops_per_token": cost.flops_per_token(m),
            "median_ms": median * 1e3, "tokens_per_s": batch * m.seq_len / median, "vs_llama": median / llama,
            "iterations": len(times[name]),
        })
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args, preset, blocks, per_block = _alternating.parse(__doc__.split("\n")[0], "variant", argv)
    rows = measure(preset, args.batch, blocks, per_block)
    print(_alternating.header(args, preset))
    print("| variant | parameters | GFLOPs/token | ms per forward+backward | tokens/s | vs llama |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['variant']} | {row['params']:,} | {row['flops_per_token'] / 1e9:.4f} | "
              f"{row['median_ms']:.1f} | {row['tokens_per_s']:,.0f} | {row['vs_llama']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
