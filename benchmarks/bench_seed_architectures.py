#!/usr/bin/env python
"""Streaming analysis against the SDPA forward on the papers' seed architectures at full width.

For each configuration of ``tests/seed_configs.py`` (LLaMA-3.1-8B, Mistral-7B-v0.1, Qwen3-8B,
DeepSeek-LLM-7B, Gemma-7B, Gemma-2-9B: random weights, cut to 2 decoder layers, vocabulary reduced to
8192 rows, bf16, CPU), three methods are measured side by side in one run:

``sdpa``
    a plain forward pass with ``attn_implementation="sdpa"``; for Gemma-2, which transformers does
    not run on SDPA (soft-capping), its eager attention (the JSON records which);
``eager``
    the same forward with ``attn_implementation="eager"``;
``analyze``
    :func:`attngeom.streaming.passes.stream` with :class:`~attngeom.streaming.reducers.HeadStats` and
    :class:`~attngeom.streaming.reducers.TokenStats` on both layers (all five metric maps of SPEC §2 on every
    block), exact attention including soft-capping and windows.

Both compute the last position's logits only (``logits_to_keep=1``), as ``stream`` does. Every
measurement runs in a fresh process (``--worker``): it builds the model, runs a short warm-up, resets
the peak-RSS mark (``/proc/self/clear_refs``), runs the measured call and reads ``VmHWM`` (the whole
process, weights included) and the RSS before the call (the baseline: weights + runtime). The three
methods alternate within every repeat (the order reversed every other repeat), so load from other
jobs hits them alike. Every length of ``--sizes`` is run with every setting of ``--threads``
(``0``: torch's default, all cores; ``1``: one thread), and one table prints the ratios of analysis
to SDPA and to eager.

The longest input analysable in 16 GiB: the analysis peaks measured at ``--sizes`` (first thread
setting), plus any ``--memory-sizes`` measured for memory only, fitted with ``peak(T) = a + b·T``
(streaming keeps no T x T map: blocks of queries are bounded, the rest is linear in T); the fit is
solved for 16 GiB and printed as an extrapolation.

At T=8192 the eager forward materialises every ``[H, T, T]`` map (tens of GiB for a full-width cut;
measured in docs/benchmark-analyze.md), so the long size is run on one configuration at a time, on a
machine with the memory for it.

Usage::

    python benchmarks/bench_seed_architectures.py --sizes 512,2048 --threads 0,1   # all six
    python benchmarks/bench_seed_architectures.py --configs llama3.1-8b --sizes 8192 --threads 0,1
    python benchmarks/bench_seed_architectures.py --configs llama3.1-8b --sizes 512 --threads 1 --json out/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_analyze import _reset_peak, _rss_bytes  # noqa: E402  (same folder: the one reading of /proc)

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
METHODS = ("sdpa", "eager", "analyze")


def _rss(field: str) -> int:
    return _rss_bytes(field) or 0


def worker(args) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from attngeom.streaming.reducers import HeadStats, TokenStats
    from attngeom.streaming import stream
    from seed_configs import random_ids, seed_config, seed_model

    device = args.device
    t0 = time.perf_counter()
    # the reference forward: SDPA; Gemma-2 (soft-capping), which transformers refuses to run on SDPA,
    # gets its own eager attention
    impl = "eager" if args.method == "eager" or seed_config(args.config).model_type == "gemma2" else "sdpa"
    handle = seed_model(args.config, attn_implementation=impl, device=device)
    build_s = time.perf_counter() - t0
    model = handle.model
    ids = random_ids(model.config.vocab_size, args.T).to(device)

    def run(x):
        if args.method in ("sdpa", "eager"):
            model(input_ids=x[None], use_cache=False, logits_to_keep=1)
        else:
            stream(handle, [x.cpu()], [HeadStats(), TokenStats()], progress=False)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    run(ids[:64])  # warm-up: kernels, caches, the plug-in's output Grams
    sync()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak()
        base = _rss("VmRSS")
    t = time.perf_counter()
    run(ids)
    sync()
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else _rss("VmHWM")
    print(json.dumps({"config": args.config, "method": args.method, "T": args.T, "seconds": seconds,
                      "peak_bytes": peak, "base_bytes": base, "build_s": build_s, "device": device,
                      "reference": impl}))


def measure(config: str, method: str, T: int, threads: int, device: str) -> dict:
    """One measurement in a fresh process; ``threads`` 0 is torch's default (all cores)."""
    cmd = [sys.executable, __file__, "--worker", "--config", config, "--method", method, "--T", str(T),
           "--threads", str(threads), "--device", device]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    else:
        env.pop("OMP_NUM_THREADS", None)
        env.pop("MKL_NUM_THREADS", None)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{config} {method} T={T} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares ``peak = a + b·T``."""
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(p for _, p in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    b = sum((t - mx) * (p - my) for t, p in points) / sxx if sxx else 0.0
    return my - b * mx, b


def _names() -> tuple[str, ...]:
    sys.path.insert(0, str(ROOT / "tests"))
    from seed_configs import SEED_NAMES

    return SEED_NAMES


def _threads_name(t: int) -> str:
    return "all cores" if t == 0 else f"{t} thread" + ("s" if t > 1 else "")


def time_one(c: str, T: int, threads: int, args) -> dict:
    """SDPA, eager and analysis of configuration ``c`` at length ``T``, alternating over the repeats
    (the order reversed every other repeat): medians of the times, the largest peaks."""
    runs = {m: [] for m in METHODS}
    for r in range(args.repeats):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        for m in order:
            res = measure(c, m, T, threads, args.device)
            runs[m].append(res)
            print(f"  {c:16s} {_threads_name(threads):>9s} {m:8s} T={T:5d}: {res['seconds']:8.2f} s"
                  f"  peak {res['peak_bytes'] / GiB:6.2f} GiB  (base {res['base_bytes'] / GiB:5.2f} GiB)", flush=True)
    med = {m: statistics.median(x["seconds"] for x in runs[m]) for m in METHODS}
    peak = {m: max(x["peak_bytes"] for x in runs[m]) for m in METHODS}
    base = {m: min(x["base_bytes"] for x in runs[m]) for m in METHODS}
    return {"config": c, "T": T, "threads": threads, "seconds": med, "peak_bytes": peak, "base_bytes": base,
            "reference": runs["sdpa"][0]["reference"],
            "all_seconds": {m: [x["seconds"] for x in runs[m]] for m in METHODS},
            "time_ratio": med["analyze"] / med["sdpa"], "eager_ratio": med["analyze"] / med["eager"],
            "peak_ratio": peak["analyze"] / peak["sdpa"],
            "above_base_ratio": (peak["analyze"] - base["analyze"]) / max(1, peak["sdpa"] - base["sdpa"])}


def run_all(args) -> dict:
    configs = args.configs.split(",") if args.configs else list(_names())
    results: dict = {"sizes": args.sizes, "threads": args.threads, "repeats": args.repeats, "device": args.device,
                     "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.python_version()}",
                     "rows": [], "configs": {}}

    def save():  # after every measurement, so a failure later keeps what was measured
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1))

    for c in configs:
        for threads in args.threads:
            for T in args.sizes:
                row = time_one(c, T, threads, args)
                results["rows"].append(row)
                save()
                print(f"{c} T={T} {_threads_name(threads)}: analyze {row['time_ratio']:.2f}x SDPA, "
                      f"{row['eager_ratio']:.2f}x eager; peak {row['peak_ratio']:.2f}x SDPA "
                      f"(above baseline {row['above_base_ratio']:.2f}x)", flush=True)
        # longest T in 16 GiB: the analysis peaks measured above (first thread setting), plus
        # further sizes measured for memory only, fitted with a + b·T
        ours = [r for r in results["rows"] if r["config"] == c and r["threads"] == args.threads[0]]
        points = [(r["T"], r["peak_bytes"]["analyze"]) for r in ours]
        for T in args.memory_sizes:
            if T not in args.sizes:
                res = measure(c, "analyze", T, args.threads[0], args.device)
                points.append((T, res["peak_bytes"]))
                print(f"  {c:16s} analyze  T={T}: peak {res['peak_bytes'] / GiB:6.2f} GiB (memory point)", flush=True)
        entry: dict = {"memory_points": sorted(points)}
        if len(points) > 1:
            a, b = fit_line(points)
            entry["fit_bytes"] = {"a": a, "b_per_token": b}
            entry["longest_T_16GiB"] = int((16 * GiB - a) / b) if b > 0 else None
            print(f"{c}: longest T in 16 GiB ~{entry['longest_T_16GiB']} (extrapolated from {len(points)} "
                  f"measured sizes)", flush=True)
        results["configs"][c] = entry
        save()
    print_table(results["rows"])
    return results


def print_table(rows: list[dict]) -> None:
    print(f"\n{'configuration':16s} {'threads':>9s} {'T':>6s} {'sdpa s':>8s} {'eager s':>8s} {'analyze s':>9s} "
          f"{'xSDPA':>6s} {'xeager':>6s} {'peak xSDPA':>10s}")
    for r in rows:
        s = r["seconds"]
        print(f"{r['config']:16s} {_threads_name(r['threads']):>9s} {r['T']:6d} {s['sdpa']:8.2f} {s['eager']:8.2f} "
              f"{s['analyze']:9.2f} {r['time_ratio']:6.2f} {r['eager_ratio']:6.2f} {r['peak_ratio']:10.2f}")


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="llama3.1-8b", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="sdpa", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--configs", default=None, help="comma-separated names (default: all six)")
    ap.add_argument("--T", type=int, default=2048, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="512,2048,8192", help="input lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", default="0,1",
                    help="torch threads per measurement, comma-separated; 0 = torch's default, all cores")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--memory-sizes", default="", help="further sizes for the memory fit (comma-separated, '' for none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        worker(args)
        return
    args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    args.threads = [int(x) for x in args.threads.split(",") if x.strip()]
    args.memory_sizes = [int(x) for x in args.memory_sizes.split(",") if x.strip()]
    run_all(args)


if __name__ == "__main__":
    cli()
