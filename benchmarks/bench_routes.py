#!/usr/bin/env python
"""The fused route's kernels alone, one attention layer, beside that layer's SDPA forward.

What ``route="fused"`` runs per layer in place of the block path (docs/SPEC.md §10, issue 49),
timed on random ``q, k, v`` of one layer's shapes, each against the layer's own SDPA forward
(``F.scaled_dot_product_attention``, causal, grouped-query), side by side, alternating:

``sdpa``
    the forward itself (the unit of every ratio).
``attend``
    the fused forward with ``[v | k]`` as values and its log-sum-exp
    (:func:`attngeom.capture.routes.attend`): head outputs, entropy, sink column, diagonal.
``transpose``
    ``PᵀF`` with four columns (:func:`attngeom.capture.routes.transpose`, the attention's backward
    for the values): what every token receives (attention, value-weighted, output-normalised,
    contribution).
``winner``
    the source winner ``argmax_j a_ij‖v_j‖`` (:func:`attngeom.capture.fused_winner.source_winner`:
    the Triton kernel on CUDA, the torch pass on the CPU).
``winner_block``
    the winner as the block path computes it: blocks of queries, softmax, ``a·n`` and row maxima
    (``[Q, S]`` maps of at most the device's block budget).

Shapes: ``smollm2`` (9 query heads, 3 key/value heads, head size 64: the bundled model's) or
``llama8b`` (32, 8, 128: LLaMA-3.1-8B's); ``--groups`` keeps fewer key/value groups (a cut for a
quick CPU run). The figures are per layer; a model's analysis adds its linear layers to both sides::

    python benchmarks/bench_routes.py --sizes 2048 --threads 1
    python benchmarks/bench_routes.py --sizes 32768 --groups 1 --methods sdpa,winner --repeats 1   # quick 32k check
    python benchmarks/bench_routes.py --device cuda --dtype bfloat16 --sizes 8192,32768 --shape llama8b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
METHODS = ("sdpa", "attend", "transpose", "winner", "winner_block")


def winner_blocks(q, k, v_norm, scale: float, budget: int):
    """The block path's winner: per block of queries, the exact softmax of the causal scores, the
    products ``a_ij n_j`` and their first row maximum (what ``HeadStats`` reduces from a block)."""
    import torch

    B, H, T, d = q.shape
    n_rep = H // k.shape[1]
    step = max(1, budget // max(1, B * H * T))
    index = torch.empty(B, H, T, dtype=torch.long, device=q.device)
    for i0 in range(0, T, step):
        i1 = min(T, i0 + step)
        qb = q[:, :, i0:i1].reshape(B, k.shape[1], n_rep * (i1 - i0), d)
        s = (qb @ k[:, :, :i1].transpose(-1, -2)).view(B, H, i1 - i0, i1) * scale
        s.masked_fill_(torch.ones(i1 - i0, i1, dtype=torch.bool, device=q.device).triu_(i0 + 1), float("-inf"))
        a = torch.softmax(s, dim=-1, dtype=torch.float32)
        index[:, :, i0:i1] = (a * v_norm[:, :, None, :i1]).argmax(-1)
    return index


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="2048", help="comma-separated lengths (default 2048)")
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--groups", type=int, default=None, help="key/value groups kept (default all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--methods", default=",".join(METHODS), help=f"default {','.join(METHODS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown method {bad[0]!r}; known: {', '.join(METHODS)}")
    if "sdpa" not in methods:
        methods.insert(0, "sdpa")

    import torch
    import torch.nn.functional as F

    from attngeom.capture import fused_winner
    from attngeom.capture.kernel import default_block_elements

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    H, Hkv, d = SHAPES[args.shape]
    if args.groups:
        H, Hkv = H // Hkv * args.groups, args.groups
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    winner_impl = "Triton kernel" if fused_winner.uses_triton(dev, dtype) else "torch pass"
    print(f"one attention layer: {H} query heads, {Hkv} key/value heads, head size {d}, {args.dtype} on {dev}; "
          f"winner: {winner_impl}; medians of {args.repeats} after a warm-up; times per layer")
    for T in [int(x) for x in args.sizes.split(",") if x]:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, H, T, d, generator=g, device=dev, dtype=dtype)
        k = torch.randn(1, Hkv, T, d, generator=g, device=dev, dtype=dtype)
        v = torch.randn(1, Hkv, T, d, generator=g, device=dev, dtype=dtype)
        v_norm = v.float().norm(dim=-1)
        scale = d ** -0.5
        run = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
               "winner": lambda: fused_winner.source_winner(q, k, v_norm, scale=scale),
               "winner_block": lambda: winner_blocks(q, k, v_norm.repeat_interleave(H // Hkv, 1), scale,
                                                     default_block_elements(dev))}
        if "attend" in methods or "transpose" in methods:
            from attngeom.capture import routes

            kr, vr = k.repeat_interleave(H // Hkv, 1).float(), v.repeat_interleave(H // Hkv, 1).float()
            qf = q.float()
            saved = routes.attend(qf, kr, torch.cat([vr, kr], -1), scale, None)[2]     # what the backward reads
            Fm = torch.randn(1, H, T, 4, generator=g, device=dev)
            run["attend"] = lambda: routes.attend(qf, kr, torch.cat([vr, kr], -1), scale, None)
            run["transpose"] = lambda: routes.transpose(qf, kr, saved, Fm, scale, None)
        times = {m: [] for m in methods}
        for m in methods:                        # warm-up (first launches, Triton's compile)
            run[m]()
        sync()
        for r in range(args.repeats):
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                t0 = time.perf_counter()
                run[m]()
                sync()
                times[m].append(time.perf_counter() - t0)
        base = statistics.median(times["sdpa"])
        for m in methods:
            t = statistics.median(times[m])
            print(f"  T={T:6d} {m:13s} {t * 1e3:10.1f} ms  x{t / base:6.2f} the SDPA forward", flush=True)
        fused = [m for m in ("attend", "transpose", "winner") if m in methods]
        if len(fused) == 3:
            t = sum(statistics.median(times[m]) for m in fused)
            print(f"  T={T:6d} {'fused route':13s} {t * 1e3:10.1f} ms  x{t / base:6.2f} the SDPA forward "
                  "(attend + transpose + winner)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
