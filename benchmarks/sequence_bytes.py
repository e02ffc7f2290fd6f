"""Bytes per transformer layer under Megatron-SP, Ulysses and ring attention, against their formulas.

    python benchmarks/sequence_bytes.py            # P = 2, 4: d_model 512, 8 heads (4 kv), seq_len 256
    python benchmarks/sequence_bytes.py --quick    # P = 2, tiny shapes: a smoke run of a few seconds

No Ray and no timing: P thread ranks form one gloo group and run one raypar Block (raypar.core.model.llama)
forward and
backward, sequence-split the way each style splits it, through a Group wrapper that adds up what each rank
sends. So the numbers are exact counts of raypar's own calls, independent of load. What a rank sends, per
call: all_gather (P-1)·input, reduce_scatter and all_to_all (P-1)/P·input, send the tensor. With N = B·T
tokens, h = d_model, h_kv = kv heads·head_dim, fp32 (4 bytes), the formulas per rank and layer, forward:

    Megatron-SP   2 all-gathers + 2 reduce-scatters of N·h      4·N·h·(P-1)/P             (paper: 4·N·h)
    Ulysses       all-to-alls of q, o (N·h/P), k, v (N·h_kv/P)  (2h + 2h_kv)·N/P·(P-1)/P  (paper: 4·N·h/P)
    Ring          P-1 key/value blocks of N/P tokens            2·N·h_kv·(P-1)/P

The backward moves the same again for SP and Ulysses (the conjugate collectives), and for the ring P
block transfers, each carrying key, value and their gradients (twice the forward block), the last one
gradients only. The pipeline hop under SP carries N·h/P instead of N·h: measured in
tests/unit/test_sequence_parallel.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections import Counter
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from collectives import GroupSpec, LocalStoreRef, create_group  # noqa: E402
from raypar.core.config.schema import ModelConfig  # noqa: E402
from raypar.core.model.llama import Block, rope_tables  # noqa: E402
from raypar.core.parallel import cp  # noqa: E402
from raypar.core.run_config import load_config  # noqa: E402

FP32 = 4


class ByteCounter:
    """A Group that adds up the bytes this rank sends, per collective."""

    def __init__(self, group: Any):
        self.group, self.sent = group, Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.group, name)
        share = {
            "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: (p - 1) / p,
            "all_to_all": lambda p: (p - 1) / p, "send_recv": lambda p: 1,
            "all_reduce": lambda p: 2 * (p - 1) / p,
        }
        if name not in share:
            return attr

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.sent[name] += tensor.numel() * tensor.element_size() * share[name](self.group.size)
            return attr(tensor, *args, **kwargs)

        return counted


def layer_bytes(style: str, p: int, cfg: ModelConfig, batch: int) -> list[dict[str, float]]:
    """Per rank: bytes sent in forward and in backward by one Block under `style` on `p` thread ranks."""
    ref = LocalStoreRef()
    out: list[dict[str, float]] = [{} for _ in range(p)]
    errors: list[BaseException] = []

    def rank_fn(rank: int) -> None:
        try:
            spec = GroupSpec("bytes", tuple(f"r{i}" for i in range(p)), rank, ref, timeout_s=60)
            group = ByteCounter(create_group(spec, ref.store))
            torch.manual_seed(0)
            tokens = cfg.seq_len // p
            cos, sin = rope_tables(cfg)
            if style == "sp":
                block = Block(cfg, group, sequence_parallel=True)
                attend = None
            else:
                block = Block(cfg, None)
                pos = cp.positions(cfg.seq_len, p, rank, style)
                cos, sin = cos[pos], sin[pos]
                ring = cp.RingAttention(group, cfg.seq_len) if style == "ring" else None
                attend = ring or (lambda q, k, v: cp.ulysses_attention(q, k, v, group))  # noqa: E731
            with torch.no_grad():
                for param in block.parameters():
                    param.normal_(0.0, 0.02)
            x = torch.randn(batch, tokens, cfg.d_model, requires_grad=True)
            y = block(x, cos, sin, attend)
            forward = sum(group.sent.values())
            y.sum().backward()
            out[rank] = {"forward": forward, "backward": sum(group.sent.values()) - forward}
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    threads = [threading.Thread(target=rank_fn, args=(r,), daemon=True) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def formula(style: str, p: int, cfg: ModelConfig, batch: int) -> tuple[float, float]:
    """(exact forward bytes per rank, the paper's approximation) for one layer."""
    n, h, h_kv = batch * cfg.seq_len, cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    if style == "sp":
        return 4 * n * h * (p - 1) / p * FP32, 4 * n * h * FP32
    if style == "ulysses":
        kv = h_kv if cfg.n_kv_heads % p == 0 else h  # too few kv heads: repeated up to the q heads
        return (2 * h + 2 * kv) * n / p * (p - 1) / p * FP32, 4 * n * h / p * FP32
    return 2 * n * h_kv * (p - 1) / p * FP32, 2 * n * h_kv * (p - 1) / p * FP32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    # `small`'s 6 heads do not split 4 ways: its shape with 8 heads (4 kv), so P = 4 works for every style.
    shape = ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=4", "model.seq_len=256"]
    preset, ranks = ("tiny", [2]) if args.quick else ("small", [int(r) for r in args.ranks.split(",")])
    cfg = load_config(None, [f'model.preset="{preset}"', *([] if args.quick else shape)]).model
    print(f"{preset}: d_model={cfg.d_model}, heads={cfg.n_heads}/{cfg.n_kv_heads} kv, seq_len={cfg.seq_len}, "
          f"batch={args.batch}; bytes sent per rank for one layer (fp32)\n")
    print(f"{'style':8} {'P':>2} {'forward':>12} {'formula':>12} {'ratio':>6} {'paper':>12} {'backward':>12}")
    for p in ranks:
        for style in ("sp", "ulysses", "ring"):
            measured = layer_bytes(style, p, cfg, args.batch)
            fwd = max(m["forward"] for m in measured)
            bwd = max(m["backward"] for m in measured)
            exact, paper = formula(style, p, cfg, args.batch)
            print(f"{style:8} {p:>2} {fwd:>12,.0f} {exact:>12,.0f} {fwd / exact:>6.3f} {paper:>12,.0f} "
                  f"{bwd:>12,.0f}")


if __name__ == "__main__":
    main()
