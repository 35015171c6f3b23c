#!/usr/bin/env python
"""The analysis benchmark under several CPU kernel settings: ratios to the SDPA forward per setting.

Runs ``benchmarks/bench_analyze.py`` (each measurement in a fresh process, methods alternating
within every repeat) once per kernel setting, with the settings passed through the environment
(oneDNN and ATen choose their kernels at start-up), and prints one Markdown table: per setting,
the SDPA forward's median time and the median ratio to it of the attngeom forward with no observer
(``capture``), attention-level statistics and all metrics, beside the targets (attention-level
statistics <= 1.2x, all metrics <= 1.5x)::

    python benchmarks/bench_kernels.py [--T 2048] [--threads 0] [--repeats 3] [--json out/bench-kernels.json]

Settings: the machine's defaults, ``ONEDNN_MAX_CPU_ISA=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``,
``ATEN_CPU_CAPABILITY=avx2`` and ``ATEN_CPU_CAPABILITY=default`` (no vectorised ATen kernels: the
slowest setting a CPU without AVX2 would get). ``--settings`` picks some of them by index into
``benchmarks/kernel_settings.py``'s ``SETTINGS`` (the list the precision sweep uses too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_settings import SETTINGS, environ, file_stem, label  # noqa: E402

DEFAULT_SETTINGS = "0,1,2,4,3"   # indices into SETTINGS: every setting but ATEN_CPU_CAPABILITY=avx512
METHODS = ("sdpa", "capture", "attention_stats", "analyze")
TARGETS = {"attention_stats": 1.2, "analyze": 1.5}


def run_setting(env: dict, args, out: Path) -> dict:
    e = environ(env)
    js = out / (file_stem(label(env)) + ".json")
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_analyze.py"), "--sizes", str(args.T), "--threads",
           str(args.threads), "--repeats", str(args.repeats), "--methods", ",".join(METHODS), "--json", str(js)]
    subprocess.run(cmd, env=e, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    recs = json.loads(js.read_text())["records"]
    sec = {m: statistics.median(r["seconds"] for r in recs if r["method"] == m and r["T"] == args.T)
           for m in METHODS}
    return {"seconds": sec, "ratio": {m: sec[m] / sec["sdpa"] for m in METHODS}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: all cores)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", default=DEFAULT_SETTINGS,
                    help="indices into kernel_settings.SETTINGS (default %(default)s)")
    ap.add_argument("--json", default="out/bench-kernels.json")
    args = ap.parse_args(argv)
    out = Path(args.json).parent / "bench-kernels"
    out.mkdir(parents=True, exist_ok=True)
    chosen = [SETTINGS[int(i)] for i in args.settings.split(",")]
    rows = {}
    for env in chosen:
        print(f"measuring: {label(env)}", file=sys.stderr, flush=True)
        rows[label(env)] = run_setting(env, args, out)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    th = "all cores" if args.threads == 0 else f"{args.threads} thread(s)"
    print(f"T = {args.T}, {th}, medians of {args.repeats}")
    print("| kernel setting | SDPA forward | capture × SDPA | attention-level statistics × SDPA "
          f"(≤ {TARGETS['attention_stats']}) | all metrics × SDPA (≤ {TARGETS['analyze']}) |")
    print("|---|--:|--:|--:|--:|")
    for lab, r in rows.items():
        q = r["ratio"]
        cells = [f"{q['capture']:.2f}"] + [f"{q[m]:.2f}" + ("" if q[m] <= TARGETS[m] else " (missed)")
                                           for m in ("attention_stats", "analyze")]
        print(f"| {lab} | {r['seconds']['sdpa']:.2f} s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
