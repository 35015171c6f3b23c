#!/usr/bin/env python
"""Where a streaming analysis's work goes, in counts that no CPU changes, beside the SDPA forward.

Wall-clock ratios move with the CPU's kernels (AVX2, AVX-512, AMX), its memory and its core count
(``benchmarks/profile_analyze.py`` and ``bench_kernels.py`` measure them on one machine). What the
work *is* does not: this script runs the SDPA forward, attngeom's forward with no observer
(``capture``), attention-level statistics and all metrics (as ``bench_analyze.py`` defines them) on
the bundled model in float32 at ``--T`` tokens, under a dispatch mode that counts, per ATen operator:

- **calls** (each costs the same dispatch and Python work on any CPU, and runs on one thread);
- **floating-point operations** of the matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, and
  the SDPA kernel: two products per query and visible source);
- **bytes addressed**: the memory span of every tensor an operator reads or writes (views and
  metadata operators address none). For the products this is what they stream; for element-wise
  operators and reductions, which are bound by memory bandwidth on every CPU, it is their cost.

A CPU whose matrix products are faster (AVX-512 FMA, AMX, a GPU) shrinks the products' share and
leaves the bytes and the calls: the ratio to SDPA then grows by the share those two have here::

    python benchmarks/count_analyze.py --T 2048
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PRODUCTS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "_scaled_dot_product_flash_attention_for_cpu")
NO_DATA = {"_unsafe_view", "empty", "empty_strided", "empty_like", "detach", "lift_fresh", "_local_scalar_dense",
           "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "size", "stride",
           "dim", "numel", "resize_", "set_"}
GATHERS = {"gather", "index", "index_select", "take_along_dim", "embedding"}


def addressed_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory span a tensor's elements occupy (an expanded or strided view addresses
    less than ``numel`` elements' worth; a contiguous tensor exactly that)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return min(span, t.numel()) * t.element_size()


def product_flops(name: str, args, kwargs) -> int:
    """Floating-point operations (a multiply and an add each count) of one matrix product."""
    name = name.rstrip("_") if name in ("addmm_", "baddbmm_") else name
    if name == "mm":
        (m, k), n = args[0].shape, args[1].shape[-1]
        return 2 * m * k * n
    if name == "addmm":
        (m, k), n = args[1].shape, args[2].shape[-1]
        return 2 * m * k * n
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        q, k = args[0], args[1]                      # [B, H, Q, d], [B, Hkv, S, d]
        B, H, Q, d = q.shape
        S = k.shape[2]
        causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("is_causal", False))
        pairs = Q * (Q + 1) // 2 + Q * (S - Q) if causal and S >= Q else Q * S
        return 4 * B * H * d * pairs                 # q·k and a·v per visible (query, source) pair
    return 0


class OpCounts(TorchDispatchMode):
    """``rows[op] = [calls, flops, bytes]`` of every ATen operator run while the mode is active (and
    ``by_shape[(op, output shape)]`` the same per shape, flops left 0)."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.by_shape: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])   # (op, output shape) -> same

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self:                                   # a composite (linear, matmul): count what it runs
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        row = self.rows[name]
        row[0] += 1
        if func.is_view or name in NO_DATA:
            return out
        if name in PRODUCTS:
            row[1] += product_flops(name, args, kwargs)
        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        if name in GATHERS:     # reads as many elements of its source (args[0]) as it writes, plus the index
            moved = 2 * sum(addressed_bytes(t) for t in outs) + sum(
                addressed_bytes(x) for x in tree_leaves((args[1:], kwargs)) if isinstance(x, torch.Tensor))
        else:
            ins = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            moved = sum(addressed_bytes(t) for t in ins + outs)
        row[2] += moved
        shaped = self.by_shape[(name, tuple(outs[0].shape) if outs else ())]
        shaped[0] += 1
        shaped[2] += moved
        return out

    def totals(self) -> dict[str, float]:
        calls = sum(r[0] for r in self.rows.values())
        flops = sum(r[1] for r in self.rows.values())
        product_bytes = sum(r[2] for k, r in self.rows.items() if k in PRODUCTS)
        other_bytes = sum(r[2] for k, r in self.rows.items() if k not in PRODUCTS)
        return {"calls": calls, "gflop": flops / 1e9, "product_gb": product_bytes / 1e9, "other_gb": other_bytes / 1e9}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--top", type=int, default=12, help="operators listed for all metrics (by bytes, then by calls)")
    args = ap.parse_args(argv)

    from profile_analyze import analysis_methods

    methods = analysis_methods(args.T)
    methods["analyze"]()        # per-model work done once (each layer's output Gram matrices, cached) is not counted
    counts = {}
    for name, run in methods.items():
        with OpCounts() as c:
            run()
        counts[name] = c
    base = counts["sdpa"].totals()
    print(f"T={args.T}, SmolLM2-135M float32, one forward after a warm-up; ratios to the SDPA forward in brackets")
    print(f"{'method':16s} {'ATen calls':>18s} {'product GFLOP':>20s} {'product GB':>18s} {'other GB':>18s}")
    for name, c in counts.items():
        t = c.totals()
        cells = [f"{t[k]:,.0f} ({t[k] / base[k]:.1f}x)" if k == "calls" else f"{t[k]:.2f} ({t[k] / base[k]:.2f}x)"
                 for k in ("calls", "gflop", "product_gb", "other_gb")]
        print(f"{name:16s} " + " ".join(f"{s:>18s}" for s in cells))
    rows = counts["analyze"].rows
    print("\nall metrics: operators by bytes addressed (products marked *)")
    print(f"{'operator':34s} {'calls':>8s} {'GFLOP':>8s} {'GB':>8s}")
    for k, (n, f, b) in sorted(rows.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"{k + (' *' if k in PRODUCTS else ''):34s} {n:8d} {f / 1e9:8.2f} {b / 1e9:8.2f}")
    print("\nall metrics: operators and output shapes by bytes addressed")
    for (k, shape), (n, _, b) in sorted(counts["analyze"].by_shape.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"{k:20s} {str(list(shape)):22s} {n:8d} {b / 1e9:8.2f} GB")
    print("\nall metrics: operators by calls")
    for k, (n, f, b) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{k:34s} {n:8d} {f / 1e9:8.2f} {b / 1e9:8.2f}")


if __name__ == "__main__":
    main()
