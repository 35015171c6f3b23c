"""bf16 drift under every CPU kernel and thread setting: the measurements the bounds of
``tests/models/test_precision.py`` and ``docs/precision.md`` come from.

Runs ``tests/precision_check.py`` (the same measurement the tests make: the built-in sample text,
2 windows of 128 tokens for the maps, 1 for faithfulness) once per setting, each in a fresh
process because oneDNN and ATen pick their kernels at start-up, and prints one table with the
worst value of each tested quantity per setting and over all settings::

    .venv/bin/python benchmarks/precision_sweep.py [--json out/precision-sweep.json] [--jobs 2]

Settings (``kernel_settings.SETTINGS``): ``ONEDNN_MAX_CPU_ISA`` in (default, AVX2, AVX512_CORE)
with ``ATEN_CPU_CAPABILITY`` default, ``ATEN_CPU_CAPABILITY`` in (default, avx2, avx512) with
oneDNN's default, and the two together at AVX2 with ATen's avx2 (an AVX2-only machine) and
default; each with 1 and 2 threads (``--threads``). A setting the CPU cannot honour (AVX-512 on an AVX2-only CPU) falls back silently
inside torch; the table prints ``torch.backends.cpu.get_cpu_capability()`` so it is visible.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_settings import SETTINGS, environ, file_stem  # noqa: E402
from kernel_settings import label as kernel_label  # noqa: E402


THREADS = (1, 2)

# the quantities tests/models/test_precision.py bounds: (path in the report, larger is worse)
QUANTITIES = {
    "map row_rel_median (max over maps)": ("maps", "row_rel_median", True),
    "map row_rel_p99 (max over maps)": ("maps", "row_rel_p99", True),
    "map top1 (min over maps)": ("maps", "top1_agreement", False),
    "map top5 (min over maps)": ("maps", "top5_overlap", False),
    "head_output_norm rel_median": ("hon", "rel_median", True),
    "head_output_norm rel_p99": ("hon", "rel_p99", True),
    "clean PPL rel": ("faith_clean", "rel", True),
    "comprehensiveness dPPL rel (max)": ("faith_comp", "rel", True),
    "comprehensiveness |d ln PPL ratio| (max)": ("faith_comp", "log_ratio_dev", True),
    "sufficiency |d ln PPL ratio| (max)": ("faith_suff", "log_ratio_dev", True),
}
MAPS = ("attention", "value_weighted", "output_normalized", "contribution", "contribution_inter")


def label(env: dict, threads: int) -> str:
    return kernel_label(env) + f", {threads} thread" + ("s" if threads > 1 else "")


def run_one(env: dict, threads: int, out: Path) -> dict:
    e = environ(env, OMP_NUM_THREADS=str(threads))
    js = out / (file_stem(label(env, threads)) + ".json")
    cmd = [sys.executable, str(ROOT / "tests/precision_check.py"), "--data", "", "--window", "128",
           "--windows", "2", "--faith-windows", "1", "--threads", str(threads), "--json", str(js)]
    subprocess.run(cmd, env=e, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    cap = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=e, capture_output=True, text=True).stdout.strip()
    rep = json.loads(js.read_text())
    rep["cpu_capability"] = cap
    return rep


def extract(rep: dict) -> dict:
    m, f = rep["metrics"], rep["faithfulness"]
    groups = {
        "maps": [m[k] for k in MAPS],
        "hon": [m["head_output_norm"]],
        "faith_clean": [f["clean"]],
        "faith_comp": [v for k, v in f.items() if "/comprehensiveness/" in k],
        "faith_suff": [v for k, v in f.items() if "/sufficiency/" in k],
    }
    row = {}
    for name, (g, key, worse_up) in QUANTITIES.items():
        vals = [d[key] for d in groups[g]]
        row[name] = max(vals) if worse_up else min(vals)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="out/precision-sweep.json")
    ap.add_argument("--jobs", type=int, default=1, help="settings measured at once (numbers do not depend on it)")
    ap.add_argument("--threads", default=",".join(map(str, THREADS)),
                    help="thread counts per setting (default 1,2; the numbers have never depended on them)")
    args = ap.parse_args(argv)
    out = Path(args.json).parent / "precision-sweep"
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(env, int(t)) for env in SETTINGS for t in args.threads.split(",")]
    with ThreadPoolExecutor(args.jobs) as ex:
        reps = list(ex.map(lambda j: run_one(j[0], j[1], out), jobs))
    rows = {label(env, t): {**extract(r), "cpu_capability": r["cpu_capability"]} for (env, t), r in zip(jobs, reps)}
    worst = {name: (max if QUANTITIES[name][2] else min)(r[name] for r in rows.values()) for name in QUANTITIES}
    Path(args.json).write_text(json.dumps({"settings": rows, "worst": worst,
                                           "raw": {label(e, t): r for (e, t), r in zip(jobs, reps)}}, indent=1))
    names = list(QUANTITIES)
    print("| setting | ATen capability | " + " | ".join(names) + " |")
    print("|---|---|" + "--:|" * len(names))
    for lab, r in rows.items():
        print(f"| {lab} | {r['cpu_capability']} | " + " | ".join(f"{r[n]:.4g}" for n in names) + " |")
    print("| **worst** | | " + " | ".join(f"**{worst[n]:.4g}**" for n in names) + " |")


if __name__ == "__main__":
    main()
