"""Attention memory with packed documents: raypar.core.model.attention_masks's paths (one call per document;
query chunks under a sliding window) against a dense T x T boolean mask handed to SDPA, and plain causal
attention (no documents) as the floor.

    python benchmarks/attention_masks.py            # seq 4,096, 8 heads of 64, 8 documents of uneven length
    python benchmarks/attention_masks.py --quick    # seq 1,024 (the test suite runs this)

Each variant runs forward and backward in a fresh subprocess; reported: the process's peak resident memory
above what it held with q, k, v allocated (ru_maxrss, per process, so other processes' load does not enter),
the bytes autograd saved for backward (raypar.core.observe.memory.SavedActivations), and the median time of a
few iterations (noise on a shared machine: take timing rows on an idle one). On CPU in torch 2.13 SDPA takes a
boolean mask into its flash kernel (no O(T^2) scores), so the dense path's cost is the mask itself plus
what SDPA derives from it; on GPUs a dense mask rules out the flash kernel.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raypar.core.model.attention_masks import AttentionMask, masked_attention  # noqa: E402
from raypar.core.observe.memory import SavedActivations  # noqa: E402

VARIANTS = ("causal", "dense-mask", "per-document", "window-512")
HEADS, HEAD_DIM = 8, 64


def documents(seq: int) -> torch.Tensor:
    """8 documents of uneven lengths (cut points drawn once, seeded)."""
    gen = torch.Generator().manual_seed(0)
    cuts = torch.randperm(seq - 1, generator=gen)[:7].add(1).sort().values
    ids = torch.zeros(1, seq, dtype=torch.long)
    for cut in cuts:
        ids[0, cut:] += 1
    return ids


def attend(variant: str, q, k, v, mask: AttentionMask) -> torch.Tensor:
    if variant == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if variant == "dense-mask":
        index = torch.arange(q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.visible(index, index))
    if variant == "window-512":  # documents and a sliding window: the chunked path
        return masked_attention(q, k, v, AttentionMask(mask.documents, 512))
    return masked_attention(q, k, v, mask)


def child(variant: str, seq: int, iters: int) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(3))
    mask = AttentionMask(documents(seq))
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for i in range(iters):
        start = time.perf_counter()
        with SavedActivations() as saved:
            y = attend(variant, q, k, v, mask)
        y.sum().backward()
        times.append(time.perf_counter() - start)
        if i == 0:
            saved_bytes = saved.bytes
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "variant": variant,
        "seq": seq,
        "peak_mib": (peak_kib - base_kib) / 1024,
        "saved_mib": saved_bytes / 2**20,
        "median_s": statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seq 1,024, 2 iterations")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    seq, iters = (1024, 2) if args.quick else (args.seq, args.iters)
    if args.child:
        print(json.dumps(child(args.child, seq, iters)))
        return
    rows = []
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--child", variant, "--seq", str(seq), "--iters", str(iters)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"attention over {seq:,} tokens, 8 documents, {HEADS} heads of {HEAD_DIM}, forward + backward, "
        "fp32 CPU"
    )
    print(f"{'variant':<12}{'peak MiB':>10}{'saved MiB':>11}{'median s':>10}")
    for r in rows:
        print(f"{r['variant']:<12}{r['peak_mib']:>10.1f}{r['saved_mib']:>11.1f}{r['median_s']:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
