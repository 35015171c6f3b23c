"""Seconds per (variant, window) of the faithfulness experiment, relative to a clean forward.

For every thread setting and window length, timed side by side in one run, on one WikiText window
of the default model:

- clean: a plain forward of the window, batch of one, logits of every position, with transformers'
  ``sdpa`` attention (its default: the forward users run anyway) and with ``eager``, alternating
  (median of ``--repeats``);
- floor: the experiment's own forward with nothing masked (the clean variant, one row): the
  explicit attention weights every ranking needs, without the ranking, alternating with the two
  clean forwards;
- variants: the experiment's own batched forward (``faithfulness.run_units``) over a mix of the
  default variants (every metric, both modes, several ratios), ``rows`` variants per forward (the
  command's automatic choice unless ``--rows``), all layers intervened, the summed NLL included;
  seconds per (variant, window) = wall time / number of variants.

    .venv/bin/python benchmarks/bench_faithfulness.py [--sizes 512,2048,8192] [--threads 0,1]
        [--variants 32] [--model smollm2-135m]

``--threads 0`` is all cores. Longer windows time fewer variants (``--variants`` at 256 tokens,
scaled down with the length, at least 4; the table says how many). Prints wall and CPU-time ratios
to both clean forwards (target: <= 1.0x SDPA per (variant, window)).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

DATA = "/work/shared/data/wikitext-2-raw-test.txt"


def window_of(handle, data: str, T: int) -> list[int]:
    from attngeom.data.corpora import SAMPLE_TEXT, load_windows, windows

    if os.path.exists(data):
        got = load_windows(handle, data, window=T, max_windows=1)
        if got and len(got[0]) == T:
            return got[0]
    ids = handle.encode(SAMPLE_TEXT)[1:]
    return windows((ids * (T // max(1, len(ids)) + 2))[: 2 * T], T, bos=handle.tokenizer.bos_token_id,
                   max_windows=1)[0]


def timed(fn) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def measure(handle, win: list[int], n_variants: int, rows: int | None, repeats: int) -> dict:
    from attngeom.faithfulness.experiment import auto_rows, build_variants, run_units, window_units

    model = handle.model
    ids = torch.tensor(win)[None]
    previous = model.config._attn_implementation
    clean = {"sdpa": [], "eager": []}
    for impl in clean:
        model.set_attn_implementation(impl)
        model(input_ids=ids[:, :64], use_cache=False)  # warm-up
    from attngeom.capture.interventions import CLEAN

    units = window_units([win])
    floor = []   # attngeom's own forward with nothing masked: the explicit attention and the NLL
    run_units(handle, window_units([win[:64]]), [CLEAN], rows=1, progress=False)  # warm-up
    for _ in range(repeats):
        for impl in clean:
            model.set_attn_implementation(impl)
            clean[impl].append(timed(lambda: model(input_ids=ids, use_cache=False)))
        model.set_attn_implementation(previous)
        floor.append(timed(lambda: run_units(handle, units, [CLEAN], rows=1, progress=False)))
    model.set_attn_implementation(previous)

    every = build_variants(["attention", "value_weighted", "output_normalized", "contribution", "random"],
                           [round(0.1 * k, 1) for k in range(1, 10)], seeds=[0])[1:]
    step = max(1, len(every) // n_variants)
    variants = every[::step][:n_variants]
    rows = rows or auto_rows(handle, len(win))
    run_units(handle, window_units([win[:64]]), variants[:2], rows=2, progress=False)  # warm-up
    wall, cpu = timed(lambda: run_units(handle, units, variants, rows=rows, progress=False))
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in clean.items()}
    return {"T": len(win), "threads": torch.get_num_threads(), "variants": len(variants), "rows": rows,
            "metrics": len({v.metric for v in variants}), "modes": len({v.mode for v in variants}),
            "sdpa": med["sdpa"], "eager": med["eager"], "variant": (wall / len(variants), cpu / len(variants)),
            "floor": (statistics.median(x[0] for x in floor), statistics.median(x[1] for x in floor))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--sizes", default="512,2048,8192", help="window lengths (default 512,2048,8192)")
    ap.add_argument("--threads", default="0,1", help="torch threads per setting; 0 = all cores (default 0,1)")
    ap.add_argument("--variants", type=int, default=32, help="variants timed at 256 tokens (fewer when longer)")
    ap.add_argument("--rows", type=int, default=None, help="variants per batched forward (default: auto)")
    ap.add_argument("--repeats", type=int, default=3, help="clean forwards timed (median)")
    args = ap.parse_args()

    from attngeom.model import load_model

    cores = os.cpu_count() or 1
    handle = load_model(args.model)
    torch.set_grad_enabled(False)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    threads = [int(x) for x in args.threads.split(",") if x.strip()]
    wins = {T: window_of(handle, args.data, T) for T in sizes}
    results = []
    for th in threads:
        torch.set_num_threads(th or cores)
        for T in sizes:
            n = max(4, min(args.variants, args.variants * 256 // T))
            r = measure(handle, wins[T], n, args.rows, args.repeats if T < 8192 else 1)
            results.append(r)
            print(f"threads {r['threads']} T={T}: {r['variants']} variants, {r['rows']} rows per forward: "
                  f"{r['variant'][0]:.3f} s per (variant, window); SDPA {r['sdpa'][0]:.3f} s, "
                  f"eager {r['eager'][0]:.3f} s", flush=True)

    print(f"\nmodel {handle.name}; all layers intervened; wall time, and CPU time (not inflated by waiting "
          f"for a busy core); ratios per (variant, window) to one clean forward of the window")
    head = (f"{'threads':>7} {'T':>6} {'variants':>8} {'rows':>4} {'variant s':>10} {'SDPA s':>8} {'eager s':>8} "
            f"{'xSDPA':>6} {'xeager':>6} {'cpu xSDPA':>9} {'cpu xeager':>10} {'floor xSDPA':>11}")
    print(head)
    print("-" * len(head))
    for r in results:
        v, s, e = r["variant"], r["sdpa"], r["eager"]
        print(f"{r['threads']:>7} {r['T']:>6} {r['variants']:>8} {r['rows']:>4} {v[0]:>10.3f} {s[0]:>8.3f} "
              f"{e[0]:>8.3f} {v[0] / s[0]:>5.2f}x {v[0] / e[0]:>5.2f}x {v[1] / s[1]:>8.2f}x {v[1] / e[1]:>9.2f}x"
              f" {r['floor'][0] / s[0]:>10.2f}x")
    print("target: <= 1.0x SDPA per (variant, window)")
    print("floor: attngeom's forward of the window with nothing masked (explicit attention weights, the "
          "summed NLL; batch of 1), which every variant runs plus its ranking and masking")


if __name__ == "__main__":
    main()
