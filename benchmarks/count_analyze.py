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

**Routes and GPUs** (issue 49). ``--routes fused,block`` also counts both analyses with the
capture's route forced (SPEC §10). From the same counts, the time a GPU needs is *estimated* by
the roofline of each operator: ``max(FLOPs / peak FLOP/s of its dtype, bytes / bandwidth)``,
summed over operators (:data:`GPUS`: NVIDIA's published peaks of the H100 SXM and the H200;
``--gpu NAME=BF16_TFLOPS,FP32_TFLOPS,TB_PER_S`` adds another), beside the SDPA forward's on the
same GPU, with the number of kernel launches (each a few microseconds the roofline does not count).
It is a lower bound of each method's time, not a measurement; the ratios are the result. On the
fused route the source winner is counted as the Triton kernel a GPU runs
(:func:`attngeom.capture.fused_winner.source_winner`: ``2·d`` FLOPs per visible pair, its inputs and
outputs read and written once, as the SDPA kernel is counted), not as the CPU's torch pass. Run it
in the GPU's dtype and with its block budget for the estimate to be the GPU's::

    python benchmarks/count_analyze.py --T 2048 --dtype bfloat16 --block-elements 67108864 --routes fused,block
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu": "forward", "_scaled_dot_product_flash_attention": "forward",
             "_scaled_dot_product_efficient_attention": "forward",
             "_scaled_dot_product_flash_attention_for_cpu_backward": "backward",
             "_scaled_dot_product_efficient_attention_backward": "backward"}
"""The fused attention kernels (the CPU's, and CUDA's flash and memory-efficient ones) and their direction."""
PRODUCTS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", *ATTENTION, "source_winner (Triton)",
            "values_gradient (Triton)")
GPUS = {
    # NVIDIA's datasheets (H100 SXM5, H200 SXM): tensor-core bf16/fp16 without sparsity (the datasheets'
    # 1,979 TFLOP/s are "with sparsity"), fp32 on the CUDA cores (67 TFLOP/s; float32 products and
    # attention kernels do not use the tensor cores unless TF32 is allowed), HBM bandwidth
    "H100 SXM": {"bf16": 989e12, "fp32": 67e12, "bandwidth": 3.35e12},
    "H200 SXM": {"bf16": 989e12, "fp32": 67e12, "bandwidth": 4.8e12},
}
"""Peak FLOP/s by dtype and memory bandwidth (bytes/s) of the GPUs the estimate is made for."""
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
    if name in ATTENTION:
        backward = ATTENTION[name] == "backward"
        q, k, v = args[1:4] if backward else args[0:3]   # [B, H, Q, dk], [B, H|Hkv, S, dk], [B, H|Hkv, S, dv]
        B, H, Q, dk = q.shape
        S, dv = k.shape[2], v.shape[-1]
        causal = _is_causal(name, args, kwargs)
        pairs = Q * (Q + 1) // 2 + Q * (S - Q) if causal and S >= Q else Q * S
        # forward: q·k and a·v per visible (query, source) pair; backward: q·k again, dO·vᵀ, Pᵀ·dO, dS·k, dSᵀ·q
        return 2 * B * H * pairs * ((3 * dk + 2 * dv) if backward else (dk + dv))
    return 0


def _is_causal(name: str, args, kwargs) -> bool:
    """The ``is_causal`` argument of a fused attention kernel (its position differs by kernel)."""
    position = {"_scaled_dot_product_flash_attention_for_cpu": 4, "_scaled_dot_product_flash_attention": 4,
                "_scaled_dot_product_efficient_attention": 6, "_scaled_dot_product_flash_attention_for_cpu_backward": 7,
                "_scaled_dot_product_efficient_attention_backward": 11}[name]
    return bool(args[position]) if len(args) > position else bool(kwargs.get("is_causal", False))


def peak_key(dtype: torch.dtype) -> str:
    """Which peak of :data:`GPUS` a product in ``dtype`` runs at."""
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"


def winner_counts(q: torch.Tensor, k: torch.Tensor, v_norm: torch.Tensor, causal: bool = True,
                  window: int | None = None) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of the fused source winner's Triton kernel for these inputs: ``q·k`` per
    visible (query, source) pair (``2·d``), ``q``, ``k`` and the log-norms read once, index (int64),
    best and log-sum-exp (float32) written once per query and head."""
    B, H, Q, d = q.shape
    S = k.shape[2]
    seen = sum(min(p + 1 if causal else S, window or S) for p in range(S - Q, S))    # visible sources per query
    flops = 2 * B * H * d * seen
    moved = (addressed_bytes(q) + addressed_bytes(k) + 4 * v_norm.numel() + B * H * Q * (8 + 4 + 4))
    return flops, moved


def values_gradient_counts(q: torch.Tensor, k: torch.Tensor, F: torch.Tensor, causal: bool = True,
                           window: int | None = None) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of :func:`attngeom.capture.fused_winner.values_gradient`'s Triton kernel:
    ``q·k`` again (``2·d``) and ``Pᵀ F`` (``2·m``, ``m`` padded to the 16 columns a tensor-core
    product takes) per visible pair; ``q``, ``k``, ``lse``, ``F`` read and the float32 result written once."""
    B, H, Q, d = q.shape
    S, m = k.shape[2], F.shape[-1]
    seen = sum(min(p + 1 if causal else S, window or S) for p in range(S - Q, S))
    flops = 2 * B * H * (d + max(16, m)) * seen
    moved = addressed_bytes(q) + addressed_bytes(k) + 4 * B * H * Q + addressed_bytes(F) + 4 * B * H * S * m
    return flops, moved


class OpCounts(TorchDispatchMode):
    """``rows[op] = [calls, flops, bytes]`` of every ATen operator run while the mode is active (and
    ``by_shape[(op, output shape)]`` the same per shape, flops left 0); ``gpu_seconds[gpu]`` the
    roofline estimate on each of ``gpus`` (:data:`GPUS`) and ``launches`` the operators that move data
    (the kernels a GPU would launch)."""

    def __init__(self, gpus: dict | None = None):
        super().__init__()
        self.rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.by_shape: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])   # (op, output shape) -> same
        self.gpus = GPUS if gpus is None else gpus
        self.gpu_seconds: dict[str, float] = {g: 0.0 for g in self.gpus}
        self.launches = 0

    def charge(self, flops: int, moved: int, dtype: torch.dtype) -> None:
        """Add one kernel's roofline time on every GPU: ``max(flops / peak of dtype, bytes / bandwidth)``."""
        self.launches += 1
        for g, spec in self.gpus.items():
            self.gpu_seconds[g] += max(flops / spec[peak_key(dtype)], moved / spec["bandwidth"])

    def add_kernel(self, name: str, flops: int, moved: int, dtype: torch.dtype) -> None:
        """Count a kernel that runs outside ATen (the fused winner's Triton kernel) as one call."""
        row = self.rows[name]
        row[0] += 1
        row[1] += flops
        row[2] += moved
        self.charge(flops, moved, dtype)

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
        flops = product_flops(name, args, kwargs) if name in PRODUCTS else 0
        row[1] += flops
        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        if name in GATHERS:     # reads as many elements of its source (args[0]) as it writes, plus the index
            moved = 2 * sum(addressed_bytes(t) for t in outs) + sum(
                addressed_bytes(x) for x in tree_leaves((args[1:], kwargs)) if isinstance(x, torch.Tensor))
        else:
            ins = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            moved = sum(addressed_bytes(t) for t in ins + outs)
        row[2] += moved
        floats = [x.dtype for x in tree_leaves(args) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        self.charge(flops, moved, floats[0] if floats else torch.float32)
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


@contextlib.contextmanager
def triton_winner(counts: OpCounts):
    """While active, :func:`attngeom.capture.fused_winner.source_winner` and ``values_gradient`` are
    counted as the Triton kernels a GPU runs (:func:`winner_counts`, :func:`values_gradient_counts`,
    one call each), and the CPU's torch passes that compute them here are not counted."""
    from attngeom.capture import fused_winner

    def counted(real, name, count):
        def run(q, k, *args, **kw):
            with _disable_current_modes():
                out = real(q, k, *args, **kw)
            counts.add_kernel(name, *count(q, k, args[-1], kw.get("causal", True), kw.get("window")), q.dtype)
            return out
        return run

    swaps = {fused_winner.source_winner: counted(fused_winner.source_winner, "source_winner (Triton)", winner_counts),
             fused_winner.values_gradient: counted(fused_winner.values_gradient, "values_gradient (Triton)",
                                                   values_gradient_counts)}
    holders = [(m, name, getattr(m, name)) for mod_name, m in list(sys.modules.items()) if mod_name.startswith("attngeom")
               for name in ("source_winner", "values_gradient") if getattr(m, name, None) in swaps]
    for m, name, real in holders:                # every attngeom module that imported them by name
        setattr(m, name, swaps[real])
    try:
        yield
    finally:
        for m, name, real in holders:
            setattr(m, name, real)


def parse_gpu(text: str) -> tuple[str, dict]:
    """``NAME=BF16_TFLOPS,FP32_TFLOPS,TB_PER_S`` -> ``(NAME, {"bf16", "fp32", "bandwidth"})``."""
    try:
        name, nums = text.split("=")
        bf16, fp32, bw = (float(x) for x in nums.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu takes NAME=BF16_TFLOPS,FP32_TFLOPS,TB_PER_S, got {text!r}") from None
    return name, {"bf16": bf16 * 1e12, "fp32": fp32 * 1e12, "bandwidth": bw * 1e12}


LAYER_SHAPES = {"smollm2": (9, 3, 64, 576, 1536), "llama8b": (32, 8, 128, 4096, 14336)}
"""Query heads, key/value heads, head size, model width and MLP width of one decoder layer
(SmolLM2-135M's, LLaMA-3.1-8B's)."""


def linear_flops(shape: str, T: int) -> int:
    """FLOPs of one decoder layer's matrix products outside attention at ``T`` tokens: the q, k, v
    and output projections and the gated MLP (``2·T`` per weight)."""
    H, Hkv, d, D, inner = LAYER_SHAPES[shape]
    return 2 * T * (D * (H + 2 * Hkv) * d + H * d * D + 3 * D * inner)


def layer_counts(shape: str, T: int, dtype: torch.dtype, fused_dtype: torch.dtype, gpus: dict,
                 block_elements: int = 1 << 26) -> dict[str, OpCounts]:
    """One attention layer's kernels at ``T`` tokens, counted on meta tensors (shapes only, any
    length at once): the SDPA forward (CUDA's flash kernel, ``dtype``), the fused route's forward
    with ``[v | k]`` as values (``attend``; ``attend_v``: with ``v`` only, the entropy then from the
    winner's pass) and its values' gradient ``PᵀF`` (4 columns) in ``fused_dtype`` (``transpose``: the
    attention's backward; ``values_gradient``: the Triton kernel of ``fused_winner``, ``dtype``)
    (:mod:`attngeom.capture.routes`, CUDA's memory-efficient kernels), the fused winner (the Triton
    kernel, ``dtype``), and the block path's winner alone (blocks of ``block_elements``: scores,
    softmax, ``a·n``, row maximum), as ``benchmarks/bench_routes.py`` times them."""
    from bench_routes import winner_blocks
    from attngeom.capture import routes

    H, Hkv, d = LAYER_SHAPES[shape][:3]
    scale = d ** -0.5
    with torch.device("meta"):
        q, k, v = (torch.empty(1, h, T, d, dtype=dtype) for h in (H, Hkv, Hkv))
        kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        qf, kf, xf = q.to(fused_dtype), kr.to(fused_dtype), torch.cat([vr, kr], -1).to(fused_dtype)
        F = torch.empty(1, H, T, 4, dtype=fused_dtype)
        v_norm = torch.empty(1, Hkv, T)
    out = {name: OpCounts(gpus) for name in ("sdpa", "attend", "attend_v", "transpose", "values_gradient", "winner",
                                             "winner_block")}
    with out["sdpa"]:
        torch.ops.aten._scaled_dot_product_flash_attention(q, kr, vr, 0.0, True, scale=scale)
    with out["attend"]:
        saved = routes.attend(qf, kf, xf, scale, None)[2]
    with out["attend_v"]:                           # values only: the entropy from the winner's pass instead
        routes.attend(qf, kf, vr.to(fused_dtype), scale, None)
    with out["transpose"]:
        routes.transpose(qf, kf, saved, F, scale, None)
    out["winner"].add_kernel("source_winner (Triton)", *winner_counts(q, k, v_norm), dtype)
    out["values_gradient"].add_kernel("values_gradient (Triton)", *values_gradient_counts(q, k, F.to(dtype)), dtype)
    with out["winner_block"]:
        winner_blocks(q, k, v_norm.repeat_interleave(H // Hkv, 1), scale, block_elements)
    return out


def print_layers(shape: str, sizes, dtype: torch.dtype, fused_dtype: torch.dtype, gpus: dict) -> None:
    """The table of :func:`layer_counts` per length: GFLOP, GB and each GPU's ESTIMATED time beside
    the SDPA forward's."""
    H, Hkv, d = LAYER_SHAPES[shape][:3]
    print(f"one attention layer of {shape}'s shape ({H} query heads, {Hkv} key/value heads, head size {d}); "
          f"the forward and the winner in {str(dtype)[6:]}, the fused identities in {str(fused_dtype)[6:]}; "
          "ESTIMATED GPU times (roofline, not measured)")
    print(f"{'T':>6s} {'kernel':24s} {'GFLOP':>9s} {'GB':>8s} " + " ".join(f"{g:>22s}" for g in gpus))
    for T in sizes:
        c = layer_counts(shape, T, dtype, fused_dtype, gpus)
        rows = {**c, "fused route (all three)": [c["attend"], c["transpose"], c["winner"]],
                "... entropy in winner": [c["attend_v"], c["transpose"], c["winner"]],
                "... and values_gradient": [c["attend_v"], c["values_gradient"], c["winner"]]}
        base = c["sdpa"].gpu_seconds
        for name, parts in rows.items():
            parts = parts if isinstance(parts, list) else [parts]
            flops = sum(sum(r[1] for r in p.rows.values()) for p in parts)
            moved = sum(sum(r[2] for r in p.rows.values()) for p in parts)
            secs = {g: sum(p.gpu_seconds[g] for p in parts) for g in gpus}
            cells = [f"{secs[g] * 1e3:8.3f} ms ({secs[g] / base[g]:6.2f}x)" for g in gpus]
            print(f"{T:6d} {name:24s} {flops / 1e9:9.1f} {moved / 1e9:8.3f} " + " ".join(f"{x:>22s}" for x in cells))
        # the whole decoder layer: its linear products (compute-bound at these lengths) on both sides;
        # the route's [v | k] forward gives the layer's attention output, so it stands in for the SDPA forward
        lin = linear_flops(shape, T)
        linear = {g: lin / gpus[g][peak_key(dtype)] for g in gpus}
        for label, kernels in (("layer on the fused route", ("attend", "transpose", "winner")),
                               ("... with values_gradient", ("attend_v", "values_gradient", "winner"))):
            fused = {g: sum(c[k].gpu_seconds[g] for k in kernels) for g in gpus}
            cells = [f"{(linear[g] + fused[g]) * 1e3:8.3f} ms ({(linear[g] + fused[g]) / (linear[g] + base[g]):6.2f}x)"
                     for g in gpus]
            flops = lin + sum(sum(r[1] for r in c[k].rows.values()) for k in kernels)
            print(f"{T:6d} {label:24s} {flops / 1e9:9.1f} {'':>8s} " + " ".join(f"{x:>22s}" for x in cells)
                  + "   (x: the layer's forward, linear + SDPA)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--top", type=int, default=12, help="operators listed for all metrics (by bytes, then by calls)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the model's dtype (default float32; bfloat16 for a GPU's bytes)")
    ap.add_argument("--block-elements", type=int, default=None,
                    help="the block budget B*H*Q*S (default the library's for the CPU; 67108864 is a GPU's)")
    ap.add_argument("--routes", default="", help="also count the analyses with these routes forced (e.g. fused,block)")
    ap.add_argument("--gpu", action="append", type=parse_gpu, default=[],
                    help="another GPU for the estimate: NAME=BF16_TFLOPS,FP32_TFLOPS,TB_PER_S (repeatable)")
    ap.add_argument("--layer", default=None, choices=sorted(LAYER_SHAPES),
                    help="instead: one attention layer's kernels of this shape at --sizes, on meta tensors")
    ap.add_argument("--sizes", default="8192,32768", help="lengths for --layer (default 8192,32768)")
    ap.add_argument("--fused-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype of the fused identities for --layer (default float32, what attngeom.capture.routes computes in)")
    args = ap.parse_args(argv)
    gpus = {**GPUS, **dict(args.gpu)}
    if args.layer:
        print_layers(args.layer, [int(x) for x in args.sizes.split(",") if x], getattr(torch, args.dtype),
                     getattr(torch, args.fused_dtype), gpus)
        return

    from profile_analyze import analysis_methods

    routes = tuple(r for r in args.routes.split(",") if r)
    methods = analysis_methods(args.T, dtype=args.dtype, block_elements=args.block_elements, routes=routes)
    methods["analyze"]()        # per-model work done once (each layer's output Gram matrices, cached) is not counted
    counts = {}
    for name, run in methods.items():
        with OpCounts(gpus) as c, triton_winner(c):
            try:
                run()
            except TypeError as e:          # a route this attngeom does not have
                print(f"{name}: not counted ({e})")
                continue
        counts[name] = c
    base = counts["sdpa"].totals()
    print(f"T={args.T}, SmolLM2-135M {args.dtype}, one forward after a warm-up; ratios to the SDPA forward in brackets")
    print(f"{'method':22s} {'ATen calls':>18s} {'product GFLOP':>20s} {'product GB':>18s} {'other GB':>18s}")
    for name, c in counts.items():
        t = c.totals()
        cells = [f"{t[k]:,.0f} ({t[k] / base[k]:.1f}x)" if k == "calls" else f"{t[k]:.2f} ({t[k] / base[k]:.2f}x)"
                 for k in ("calls", "gflop", "product_gb", "other_gb")]
        print(f"{name:22s} " + " ".join(f"{s:>18s}" for s in cells))
    print(f"\nESTIMATED GPU time (not measured): the roofline of every operator, max(FLOPs / peak of its dtype, "
          f"bytes / bandwidth), summed; a lower bound, without the launches' own cost (kernel launches counted)")
    print(f"{'method':22s} " + " ".join(f"{g:>22s}" for g in gpus) + f" {'launches':>16s}")
    sd = counts["sdpa"]
    for name, c in counts.items():
        cells = [f"{c.gpu_seconds[g] * 1e3:8.2f} ms ({c.gpu_seconds[g] / sd.gpu_seconds[g]:5.2f}x)" for g in gpus]
        print(f"{name:22s} " + " ".join(f"{x:>22s}" for x in cells) + f" {c.launches:>8,d} ({c.launches / sd.launches:4.1f}x)")
    print("peaks: " + "; ".join(f"{g}: {v['bf16'] / 1e12:.0f} TFLOP/s bf16, {v['fp32'] / 1e12:.0f} TFLOP/s fp32, "
                                f"{v['bandwidth'] / 1e12:.2f} TB/s" for g, v in gpus.items()))
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
