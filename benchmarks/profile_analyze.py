#!/usr/bin/env python
"""Where the time of a streaming analysis goes, beside the SDPA forward, under the current CPU kernels.

One process, the bundled model in float32 at ``--T`` tokens: times the SDPA forward, the attngeom
forward with no observer (``capture``), only the matrix products all metrics need (``products``:
the floor under all metrics on this CPU), attention-level statistics and all metrics (as
``benchmarks/bench_analyze.py`` defines them), alternating, and prints their ratios to SDPA; then
profiles one all-metrics pass with ``torch.profiler`` and prints the operators by self CPU time,
beside the same table for the SDPA forward. Run it under several kernel settings to see which
operators grow when the kernels change::

    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/profile_analyze.py --T 2048 --threads 0
    ATEN_CPU_CAPABILITY=default python benchmarks/profile_analyze.py --T 2048

Two versions of attngeom side by side (times only, medians): run it alternately with
``PYTHONPATH=OTHER_CHECKOUT/src`` and without, ``--repeats 3 --median --top 0``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def analysis_methods(T: int, dtype: str = "float32", block_elements: int | None = None,
                     routes: tuple[str, ...] = ()) -> dict:
    """``{name: () -> None}``: one forward of ``T`` tokens of the bundled model (``dtype``, CPU) by the
    SDPA forward, the attngeom forward with no observer (``capture``), only the products all metrics need
    (``products``), attention-level statistics and all metrics (``analyze``), as
    ``bench_analyze.py`` defines them; for each of ``routes`` also the two analyses with the capture's
    route forced (``attention_stats[fused]``, ``analyze[fused]``, ...). ``block_elements``: the block
    budget (default the library's for the CPU)."""
    import torch

    from bench_analyze import ATTENTION_FIELDS, _bench_ids
    from attngeom.model import load_model
    from attngeom.streaming.reducers import HeadStats, Reducer, TokenStats
    from attngeom.streaming.passes import stream

    handle = load_model("smollm2-135m", dtype=dtype, device="cpu")
    model = handle.model
    ids = _bench_ids(handle, T)
    x = torch.tensor([ids])

    class ProductsOnly(Reducer):
        """Computes, per block, only the matrix products all metrics cannot do without (the floor
        under ``analyze``): the head outputs ``a·v`` (the module's own output, shared), their
        pull-back ``p = u·W_OᵀW_O`` and ``uG``, and the contribution each source receives (``Xᵀa``
        per group of heads); no other pass over a block map."""

        def observe(self, block) -> None:
            block.uG
            block.received(block.query_valid.float(), ("contribution",))

    def sdpa():
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            model(x, logits_to_keep=1)

    def streamed(observers, route=None):
        kw = {} if route is None else {"route": route}       # the capture's route (issue 49), when forced
        return lambda: stream(handle, [ids], observers(), progress=False, block_elements=block_elements, **kw)

    def attention_stats():
        return [HeadStats(fields=ATTENTION_FIELDS), TokenStats(metrics=("attention",), columns=("sink_rate", "entropy"))]

    routed = {}
    for route in routes:
        routed[f"attention_stats[{route}]"] = streamed(attention_stats, route)
        routed[f"analyze[{route}]"] = streamed(lambda: [HeadStats(), TokenStats()], route)
    return {
        "sdpa": sdpa,
        "capture": streamed(lambda: []),
        "products": streamed(lambda: [ProductsOnly()]),
        "attention_stats": streamed(attention_stats),
        "analyze": streamed(lambda: [HeadStats(), TokenStats()]),
        **routed,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--top", type=int, default=18, help="operators listed per profile (0: time only, no profiles)")
    ap.add_argument("--median", action="store_true", help="the median of the repeats (default: the fastest)")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import attngeom

    if args.threads:
        torch.set_num_threads(args.threads)
    methods = analysis_methods(args.T)
    for f in methods.values():  # warm-up
        f()
    times = {k: [] for k in methods}
    for r in range(args.repeats):
        order = list(methods)[r % len(methods):] + list(methods)[: r % len(methods)]
        for k in order:
            t0 = time.perf_counter()
            methods[k]()
            times[k].append(time.perf_counter() - t0)
    best = {k: (statistics.median(v) if args.median else min(v)) for k, v in times.items()}
    print(f"T={args.T} threads={torch.get_num_threads()} capability={torch.backends.cpu.get_cpu_capability()} "
          f"({'median' if args.median else 'fastest'} of {args.repeats}; attngeom from {Path(attngeom.__file__).parent})")
    for k, t in best.items():
        print(f"  {k:16s} {t:7.3f} s  {t / best['sdpa']:5.2f}x SDPA")
    for name in ("sdpa", "analyze") if args.top > 0 else ():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            methods[name]()
        print(f"\n== {name}: operators by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=40))


if __name__ == "__main__":
    main()
