"""Throughput of data-parallel runs: 2 processes x 1 thread (torchrun, gloo) against 1 process x 1
thread, on ``sinks`` and ``faithfulness`` with the bundled model, measured side by side in one run
(alternating, each a fresh output directory; wall time of the whole command, model loading included
and reported apart).

    python benchmarks/bench_distributed.py [--windows 8] [--window 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2-raw-test.txt"


def command(name: str, data: Path, out: Path, windows: int, window: int) -> list[str]:
    base = ["--data", str(data), "--window", str(window), "--max-windows", str(windows), "--out", str(out),
            "--no-progress"]
    if name == "sinks":
        return ["sinks", *base, "--batch-size", "1", "--no-figures"]
    return ["faithfulness", *base, "--metrics", "attention,contribution,random", "--ratios", "0.2,0.5,0.8",
            "--seeds", "0"]


def timed(argv: list[str], nproc: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    bindir = Path(sys.executable).parent
    if nproc == 1:
        cmd = [sys.executable, "-m", "attngeom", *argv]
    else:
        cmd = [str(bindir / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), "-m", "attngeom", *argv]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args()
    data = Path(args.data)
    tmp = Path(tempfile.mkdtemp(prefix="bench-dist-"))
    # the load of a model process alone (import + load), to report the fixed cost apart
    load = [sys.executable, "-c", "from attngeom import load_model; load_model('smollm2-135m', progress=False)"]
    t0 = time.perf_counter()
    subprocess.run(load, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    t_load = time.perf_counter() - t0
    print(f"start-up + model load of one process: {t_load:.1f} s")
    print(f"{'command':<14} {'1 proc x 1 thr (s)':>20} {'2 procs x 1 thr (s)':>20} {'throughput x':>13} "
          f"{'excl. load x':>13}")
    for name in ("sinks", "faithfulness"):
        times = {1: [], 2: []}
        for k in range(args.repeats):
            for n in (1, 2) if k % 2 == 0 else (2, 1):
                out = tmp / f"{name}-{n}-{k}"
                times[n].append(timed(command(name, data, out, args.windows, args.window), n))
                shutil.rmtree(out, ignore_errors=True)
        one, two = statistics.median(times[1]), statistics.median(times[2])
        print(f"{name:<14} {one:>20.1f} {two:>20.1f} {one / two:>13.2f} {(one - t_load) / max(1e-9, two - t_load):>13.2f}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
