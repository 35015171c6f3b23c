#!/usr/bin/env python
"""Benchmark of generation with the compressed KV cache (:mod:`attngeom.kvcache.cache`) on the bundled
model (``load_model("smollm2-135m")``, float32, CPU unless ``--device``).

For a prompt of ``P`` tokens (seeded random ids after BOS, read in one forward pass) and ``N`` new
greedy tokens, the time per generated token (prompt excluded) of:

``full``
    transformers' ``DynamicCache`` (the reference), attention through SDPA.
``<policy>`` at ``--budget``
    the compressed cache under that policy. Policies that need no scores (window, StreamingLLM)
    run SDPA; scored policies (H2O, TOVA, SnapKV, VATP, contribution, ...) run the exact capture
    and record their scores at every step.
``<policy>-noscore``
    the same compressed cache and eviction mechanics without recording scores (SDPA, the policy
    sees zero scores): the difference to ``<policy>`` is the scoring overhead per token.

The methods alternate within each repeat (the order rotates between repeats) and the median is
reported with the ratio to ``full``, and the peak cache bytes of each.

Usage::

    python benchmarks/bench_kvcache.py                                   # P=8192, N=64, budget 256
    python benchmarks/bench_kvcache.py --prompt 512 --new 8 --repeats 1  # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens (default 8192)")
    ap.add_argument("--new", type=int, default=64, help="generated tokens (default 64)")
    ap.add_argument("--budget", type=int, default=256, help="entries per key/value head (default 256)")
    ap.add_argument("--policies", default="streamingllm,h2o,contribution")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    import torch

    from attngeom import load_model
    from attngeom.kvcache.cache import cache_bytes, compressing, new_cache, cached_forward
    from attngeom.kvcache.policies import get_policy

    if args.threads:
        torch.set_num_threads(args.threads)
    handle = load_model(args.model, device=args.device)
    g = torch.Generator().manual_seed(0)
    bos = handle.tokenizer.bos_token_id or 1
    prompt = torch.cat([torch.tensor([[bos]]), torch.randint(100, 20000, (1, args.prompt - 1), generator=g)], 1)

    methods = [("full", get_policy("full"), True)]
    for name in args.policies.split(","):
        p = get_policy(name)
        methods.append((name, p, True))
        if p.needs:  # the same cache and eviction without recording scores (plain SDPA, zero scores)
            methods.append((f"{name}-noscore", dataclasses.replace(p, needs=None), False))

    @torch.no_grad()
    def run(policy) -> tuple[float, int]:
        cache = new_cache(handle, policy, None if policy.name == "full" else args.budget)
        with compressing(handle.model, cache):
            last = cached_forward(handle, cache, prompt)[0, -1]
            t0 = time.perf_counter()
            for _ in range(args.new):
                last = cached_forward(handle, cache, last.argmax().reshape(1, 1))[0, -1]
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            return (time.perf_counter() - t0) / args.new, cache_bytes(cache)

    times: dict[str, list[float]] = {m[0]: [] for m in methods}
    peak: dict[str, int] = {}
    for r in range(args.repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for name, policy, _ in order:
            t, b = run(policy)
            times[name].append(t)
            peak[name] = b
    base = statistics.median(times["full"])
    print(f"{handle.name}: prompt {args.prompt}, {args.new} new tokens, budget {args.budget}, "
          f"{args.repeats} repeats, {args.threads or 'default'} threads")
    print(f"{'method':24s} {'ms/token':>9s} {'x full':>7s} {'cache MB':>9s}")
    for name, _, _ in methods:
        m = statistics.median(times[name])
        print(f"{name:24s} {m * 1000:9.1f} {m / base:7.2f} {peak[name] / 2**20:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
