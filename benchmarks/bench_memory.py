#!/usr/bin/env python
"""Peak memory of ``analyze`` at long inputs: the fused route, the block path and the SDPA forward
side by side (issue 49, "long inputs": memory above the forward's must grow as O(T·H), not T²).

Every measurement is one fresh process of ``benchmarks/bench_analyze.py --worker`` (the bundled
SmolLM2-135M-Instruct, its 4-bit Q4_1 weights dequantised to float32, on the CPU, one torch thread,
the model cut to ``--layers`` decoder layers as that benchmark's long runs do; ``forward`` is called
directly, so lengths past the model's 8,192 trained positions run, for memory only, as there). The
worker loads the model, runs a short warm-up, resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``) and reads the peak resident set (``VmHWM``) after the measured call:
``added`` below is that peak less the process's RSS before the call (weights, warm-up and the
interpreter excluded), ``above forward`` the method's ``added`` less the SDPA forward's at the same
T. The methods:

``sdpa``           a plain forward (``attn_implementation="sdpa"``), logits of the last position only;
``analyze_fused``  HeadStats + TokenStats with every field, ``Session(route="fused")`` (SPEC §10);
``analyze_block``  the same on the block path (``route="block"``, the CPU's ``auto``).

The growth of ``above forward`` is fitted as ``c·T^p`` (least squares on the logs, sizes whose
figure is at least 1 MiB): ``p`` near 1 is O(T·H) (H fixed), near 2 is T². The fused route's time at
the longest size, scaled by (T'/T)² (its kernels are quadratic in compute), estimates a run at
``--estimate`` tokens; that size is run only with ``--run-estimate`` and when the estimate is under
``--max-minutes``.

``--window-sizes`` adds the same on the bundled Gemma 3 270M (Q4_K_M weights dequantised to
float32) cut to its first layer, a sliding-window layer (window 512): the fused route as it runs
(per band of the window, ``FusedLayer.bands``) beside ``fused_whole_mask``, the same route handed
the whole ``[T, T]`` float mask, and the SDPA forward (whose own mask, built by transformers, is
quadratic in both).

Usage::

    python benchmarks/bench_memory.py                          # 4k, 8k, 16k, 32k; 1 layer
    python benchmarks/bench_memory.py --sizes 1024,2048 --layers 1   # a quick check
    python benchmarks/bench_memory.py --json out/memory.json --run-estimate
    python benchmarks/bench_memory.py --sizes '' --window-sizes 4096,8192,16384   # Gemma 3, a window
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_analyze  # noqa: E402  (the worker and its process-per-measurement driver)

METHODS = ("sdpa", "analyze_fused", "analyze_block")
MiB = 1024**2


def added(res: dict) -> int:
    """What the measured call added to the process: peak RSS less the RSS before it."""
    return max(0, res["peak_bytes"] - res["base_bytes"])


def fit_power(points: list[tuple[int, float]]) -> float | None:
    """``p`` of ``y = c·T^p`` by least squares on ``log y`` against ``log T`` (points with ``y`` of
    at least 1 MiB; None with fewer than two)."""
    pts = [(math.log(T), math.log(y)) for T, y in points if y >= MiB]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def window_worker(method: str, T: int) -> None:
    """One measurement on Gemma 3's first (sliding-window) layer; prints one JSON line."""
    import time

    import torch

    from attngeom.capture import routes
    from attngeom.capture.session import Session
    from attngeom.model import load_model
    from attngeom.streaming.passes import forward
    from attngeom.streaming.reducers import HeadStats, InputBatch, TokenStats

    torch.set_num_threads(1)
    if method == "fused_whole_mask":            # the route as it was before the bands
        class Whole(routes.FusedLayer):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                if self.bands:
                    self.bands, self.mask = None, routes.additive_mask(self.allowed, self.kernel_dtype)
        routes.FusedLayer = Whole
    handle = load_model("gemma3-270m", dtype="float32", device="cpu")
    bench_analyze._truncate_layers(handle, 1)
    x = torch.tensor([bench_analyze._bench_ids(handle, T)])

    def run(ids):
        if method == "sdpa":
            handle.model.set_attn_implementation("sdpa")
            with torch.no_grad():
                handle.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            return None
        batch = InputBatch(ids=ids, lengths=torch.tensor([ids.shape[1]]), index=[0])
        reducers = [HeadStats(), TokenStats()]
        for r in reducers:
            r.begin(batch)
        session = Session(observers=reducers, route="fused")
        forward(handle, batch, session)
        return {str(k): v for k, v in session.routes.items()}

    run(x[:, :600])
    base = bench_analyze._rss_bytes("VmRSS")
    bench_analyze._reset_peak()
    t0 = time.perf_counter()
    taken = run(x)
    print(json.dumps(dict(method=method, T=T, seconds=time.perf_counter() - t0, routes_taken=taken,
                          base_bytes=base, peak_bytes=bench_analyze._peak_bytes())))


def window_table(sizes: list[int], timeout: float) -> None:
    import subprocess

    print("\nGemma 3 270M (Q4_K_M weights dequantised to float32), its first layer (sliding window 512): "
          "MiB the call added; above = less the SDPA forward's")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    for T in sizes:
        got = {}
        for m in ("sdpa", "fused", "fused_whole_mask"):
            proc = subprocess.run([sys.executable, __file__, "--window-worker", m, str(T)], capture_output=True,
                                  text=True, env=env, timeout=timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                print(f"  T={T} {m}: failed ({(proc.stderr.strip().splitlines() or ['?'])[-1]})")
                continue
            got[m] = json.loads(lines[-1])
        f = added(got["sdpa"]) if "sdpa" in got else None
        print(f"  T={T:6d} " + "  ".join(
            f"{m} {added(r) / MiB:7.1f}" + ("" if f is None or m == "sdpa" else f" (above {(added(r) - f) / MiB:+.1f})")
            + f" {r['seconds']:.1f} s" for m, r in got.items()), flush=True)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--window-worker"]:
        window_worker(sys.argv[2], int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,8192,16384,32768", help="input lengths (comma-separated)")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers kept (default 1)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    ap.add_argument("--estimate", type=int, default=131072, help="the length whose fused run time is estimated")
    ap.add_argument("--run-estimate", action="store_true", help="also run that length when the estimate allows")
    ap.add_argument("--max-minutes", type=float, default=10.0, help="longest estimated run that --run-estimate starts")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    ap.add_argument("--window-sizes", default="", help="also Gemma 3's sliding-window layer at these lengths")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or (sizes and min(sizes) < 16) or "sdpa" not in methods:
        print(f"--methods must include sdpa and be among {', '.join(METHODS)}, --sizes at least 16 tokens",
              file=sys.stderr)
        return 2
    print(f"# {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at start; "
          f"SmolLM2-135M-Instruct (4-bit Q4_1 weights dequantised to float32), {args.layers} layer(s), "
          f"1 thread, a fresh process per measurement", flush=True)

    rows: list[dict] = []

    def run(T: int) -> dict:
        got = {}
        for m in methods:
            try:
                res = bench_analyze.measure(m, T, layers=args.layers, timeout=args.timeout)
            except Exception as e:          # one failure (memory, timeout) ends nothing else
                print(f"  T={T} {m}: failed ({str(e).splitlines()[0]})", flush=True)
                continue
            got[m] = res
            rows.append(dict(res, added_bytes=added(res)))
            print(f"  T={T:6d} {m:14s} {res['seconds']:8.1f} s  added {added(res) / MiB:9.1f} MiB  "
                  f"peak {res['peak_bytes'] / MiB:8.1f} MiB  routes {res.get('routes_taken', '-')}", flush=True)
        return got

    table = {T: run(T) for T in sizes}

    print("\nMemory each call added (peak RSS less the RSS before it), MiB; above = less the SDPA forward's")
    head = f"{'T':>7} {'sdpa':>9}" + "".join(f" {m:>14} {'above':>9} {'x fwd':>6}" for m in methods if m != "sdpa")
    print(head)
    above: dict[str, list[tuple[int, float]]] = {m: [] for m in methods if m != "sdpa"}
    for T, got in table.items():
        if "sdpa" not in got:
            continue
        f = added(got["sdpa"])
        line = f"{T:>7} {f / MiB:>9.1f}"
        for m in above:
            if m in got:
                a = added(got[m])
                above[m].append((T, a - f))
                line += f" {a / MiB:>14.1f} {(a - f) / MiB:>9.1f} {a / max(f, 1):>6.2f}"
            else:
                line += f" {'-':>14} {'-':>9} {'-':>6}"
        print(line)
    print("\nGrowth of the memory above the forward's, fitted as c*T^p (p ~ 1: O(T*H); p ~ 2: T^2):")
    for m, pts in above.items():
        p = fit_power(pts)
        per = [f"{y / (T * 9):.0f}" for T, y in pts if y > 0]
        print(f"  {m:14s} p = {'n/a' if p is None else f'{p:.2f}'}; bytes per token and head "
              f"(9 heads): {', '.join(per) or '-'}")

    fused = [(T, got["analyze_fused"]["seconds"]) for T, got in table.items() if "analyze_fused" in got]
    if fused:
        T0, s0 = fused[-1]
        est = s0 * (args.estimate / T0) ** 2
        print(f"\nEstimated fused run at T={args.estimate}: {est / 60:.1f} min ({s0:.0f} s at T={T0} times "
              f"({args.estimate}/{T0})^2, {args.layers} layer(s)); ", end="")
        if args.run_estimate and est <= args.max_minutes * 60:
            print("running it")
            run(args.estimate)
        else:
            print("not run" + ("" if args.run_estimate else " (--run-estimate not given)")
                  + (f" (over --max-minutes {args.max_minutes:g})" if est > args.max_minutes * 60 else ""))
    if args.window_sizes:
        window_table([int(s) for s in args.window_sizes.split(",") if s], args.timeout)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
