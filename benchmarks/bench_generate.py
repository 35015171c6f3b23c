#!/usr/bin/env python
"""Benchmark of analysis during generation against plain ``model.generate`` (the target: at
most 1.5x), on the bundled model (``load_model("smollm2-135m")``, float32, CPU unless ``--device``).

For each prompt length ``P`` and number of new tokens ``N`` the same prompt (seeded random token
ids after BOS) is answered with exactly ``N`` tokens (stop tokens off) by:

``generate``
    ``model.generate(do_sample=False)`` with ``attn_implementation="sdpa"`` and its KV cache
    (``N`` forward calls: the prompt, then ``N - 1`` steps).
``capture``
    :func:`attngeom.generation.decoding.generate` with no observer: every call through the capture plug-in
    (``N + 1`` calls: attngeom also runs the last token, so the trace has its row).
``answer``
    the same with :class:`~attngeom.generation.answers.AnswerSources` on all layers (the answer tables).
``analyze``
    what ``attngeom analyze --generate N`` runs: ``answer``, and :class:`~attngeom.streaming.reducers.HeadStats`
    and :class:`~attngeom.streaming.reducers.TokenStats` (all five metrics of SPEC §2) as text reducers: the
    prompt's call, then the answer in one call against the cached prompt (the same rows as the steps).
``stepwise``
    ``HeadStats``, ``TokenStats`` and ``AnswerSources`` all observing every step.

The methods alternate within each repeat (the order rotates from one repeat to the next), so load
from other jobs hits them alike; the median of the repeats is reported with the ratio to
``generate``. All methods produce the same tokens (checked).

Resident memory (``/proc/self/statm``) is read after every forward call: ``rss1`` after the first
decoding step, ``rss_peak`` the largest after any call, and their ratio ``growth``. With ``--fresh``
every (prompt, tokens, method, repeat) runs in a process of its own, so no method inherits the
heap another one grew (memory then compares alike; the timing too, at the cost of loading the
model each time).

Usage::

    python benchmarks/bench_generate.py                          # P=128,2048 x N=64,512; 1 thread
    python benchmarks/bench_generate.py --prompts 16 --new 8 --repeats 1   # smoke run
    python benchmarks/bench_generate.py --device cuda --json out/bench_generate.json
    python benchmarks/bench_generate.py --fresh --repeats 1        # each run in its own process
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

METHODS = ("generate", "capture", "answer", "analyze", "stepwise")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def rss_mb() -> float:
    """Resident memory of this process in MB (Linux)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _child(args, P: int, n: int, method: str) -> dict:
    """One run of ``method`` in a fresh process: ``{"seconds", "answer", "rss1", "rss_peak"}``."""
    import subprocess

    cmd = [sys.executable, __file__, "--model", args.model, "--prompts", str(P), "--new", str(n), "--repeats", "1",
           "--threads", str(args.threads), "--device", args.device, "--methods", method, "--child"]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=_ints, default=[128, 2048], help="prompt lengths (default 128,2048)")
    ap.add_argument("--new", type=_ints, default=[64, 512], help="new tokens (default 64,512)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: load_model's, float32 on CPU)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--fresh", action="store_true", help="every run in a process of its own")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)   # one run, as JSON (--fresh)
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown method {bad[0]}; known: {', '.join(METHODS)}")

    import torch

    from attngeom import load_model
    from attngeom.capture.session import Session
    from attngeom.generation.answers import AnswerSources
    from attngeom.generation.decoding import Decoding, generate, stream_generation_ids
    from attngeom.streaming.reducers import HeadStats, TokenStats

    if args.threads:
        torch.set_num_threads(args.threads)
    handle = load_model(args.model, device=args.device, dtype=args.dtype)
    model = handle.model
    model.set_attn_implementation("sdpa")
    rss: list[float] = []
    model.register_forward_hook(lambda *_: rss.append(rss_mb()))

    def sync():
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    def run(method: str, ids: list[int], n: int) -> tuple[float, list[int]]:
        dec = Decoding(n, stop=())
        sync()
        rss.clear()
        t0 = time.perf_counter()
        if method == "generate":
            with torch.no_grad():
                out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                                device=model.device))
            answer = out[0, len(ids):].tolist()
        elif method == "capture":
            answer = generate(handle, ids, dec, Session())
        else:
            reducers = [HeadStats(), TokenStats(), AnswerSources()] if method == "stepwise" else [AnswerSources()]
            text = [HeadStats(), TokenStats()] if method == "analyze" else []
            answer = stream_generation_ids(handle, ids, reducers, dec, text_reducers=text)[len(ids):]
        sync()
        return time.perf_counter() - t0, answer

    bos = handle.tokenizer.bos_token_id
    results = []
    run("capture", [bos or 0, 1, 2, 3], 2)          # warm-up
    run("generate", [bos or 0, 1, 2, 3], 2)

    def measure(P: int, n: int, method: str, ids: list[int]) -> dict:
        if args.fresh:
            return _child(args, P, n, method)
        t, a = run(method, ids, n)
        return {"seconds": t, "answer": a, "rss1": rss[1] if len(rss) > 1 else None, "rss_peak": max(rss)}

    for P in args.prompts:
        g = torch.Generator().manual_seed(P)        # the prompt depends on its length only (--fresh children)
        ids = torch.randint(100, handle.model.config.vocab_size, (P,), generator=g).tolist()
        if bos is not None:
            ids[0] = bos
        for n in args.new:
            if args.child:
                print(json.dumps(measure(P, n, methods[0], ids)))
                return 0
            times = {m: [] for m in methods}
            memory = {m: [] for m in methods}
            answers = {}
            for r in range(args.repeats):
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                for m in order:
                    got = measure(P, n, m, ids)
                    times[m].append(got["seconds"])
                    memory[m].append((got["rss1"], got["rss_peak"]))
                    answers[m] = got["answer"]
            same = len({tuple(a) for a in answers.values()}) == 1
            med = {m: statistics.median(v) for m, v in times.items()}
            rss1 = {m: max(x[0] or 0 for x in v) for m, v in memory.items()}
            peak = {m: max(x[1] for x in v) for m, v in memory.items()}
            base = med.get("generate")
            row = {"prompt": P, "new_tokens": n, "seconds": med, "same_tokens": same,
                   "ratio_to_generate": {m: (med[m] / base if base else None) for m in methods},
                   "rss1_mb": rss1, "rss_peak_mb": peak}
            results.append(row)
            print(f"P={P:5d} N={n:4d}  " + "  ".join(
                f"{m} {med[m]:7.2f}s" + (f" ({med[m] / base:.2f}x)" if base and m != "generate" else "")
                for m in methods) + ("" if same else "  TOKENS DIFFER"), flush=True)
            print("             resident MB after step 1 -> peak (growth):  " + "  ".join(
                f"{m} {rss1[m]:.0f} -> {peak[m]:.0f} ({peak[m] / rss1[m]:.2f}x)" if rss1[m] else f"{m} -"
                for m in methods), flush=True)
    meta = {"model": handle.name, "device": args.device, "dtype": str(model.dtype), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "repeats": args.repeats,
            "machine": platform.machine(), "fresh": args.fresh, "load": _load()}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if all(r["same_tokens"] for r in results) else 1


def _load() -> list[float] | None:
    """The machine's load averages (1, 5, 15 minutes), to say how busy it was."""
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
