"""Seconds per (variant, window) of the faithfulness experiment, relative to a clean eager forward.

Both are timed side by side in one run, on the same window of the default model:

- clean: one plain forward of the window with transformers' ``eager`` attention (logits of every
  position), batch of one;
- variants: the experiment's own batched forward (``faithfulness.run_units``) over a mix of the
  default variants (every metric, both modes, several ratios), ``--rows`` variants per forward,
  all layers intervened; seconds per (variant, window) = wall time / number of variants.

    .venv/bin/python benchmarks/bench_faithfulness.py [--model smollm2-135m] [--window 256] [--variants 32]

Also times a clean SDPA forward (transformers' default), alternating with the eager one. Prints
wall and CPU times and the ratios to both (target: <= 1.0x SDPA per (variant, window)).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="/work/shared/data/wikitext-2-raw-test.txt")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--variants", type=int, default=32, help="variants timed (a mix of the default set)")
    ap.add_argument("--rows", type=int, default=None, help="variants per batched forward (default: auto)")
    ap.add_argument("--repeats", type=int, default=3, help="clean forwards timed (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default 0: all cores)")
    args = ap.parse_args()

    from attngeom.data import SAMPLE_TEXT, load_windows
    from attngeom.faithfulness import auto_rows, build_variants, run_units, window_units
    from attngeom.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    handle = load_model(args.model)
    try:
        win = load_windows(handle, args.data, window=args.window, max_windows=1)[0]
    except Exception:
        win = load_windows.__globals__["windows"](handle.encode(SAMPLE_TEXT * 8)[1:], args.window,
                                                  bos=handle.tokenizer.bos_token_id, max_windows=1)[0]
    ids = torch.tensor(win)[None]
    model = handle.model
    torch.set_grad_enabled(False)

    # ---- clean SDPA and eager forwards, alternating ---------------------------------------------
    previous = model.config._attn_implementation
    clean = {"sdpa": [], "eager": []}
    clean_cpu = {"sdpa": [], "eager": []}
    for impl in clean:
        model.set_attn_implementation(impl)
        model(input_ids=ids, use_cache=False)  # warm-up
    for _ in range(args.repeats):
        for impl in clean:
            model.set_attn_implementation(impl)
            t, c = time.perf_counter(), time.process_time()
            model(input_ids=ids, use_cache=False)
            clean[impl].append(time.perf_counter() - t)
            clean_cpu[impl].append(time.process_time() - c)
    model.set_attn_implementation(previous)
    clean_s, sdpa_s = statistics.median(clean["eager"]), statistics.median(clean["sdpa"])
    clean_c, sdpa_c = statistics.median(clean_cpu["eager"]), statistics.median(clean_cpu["sdpa"])

    # ---- intervention variants, batched -----------------------------------------------------
    every = build_variants(["attention", "value_weighted", "output_normalized", "contribution", "random"],
                           [round(0.1 * k, 1) for k in range(1, 10)], seeds=[0])[1:]
    step = max(1, len(every) // args.variants)
    variants = every[::step][: args.variants]
    rows = args.rows or auto_rows(handle, len(win))
    units = window_units([win])
    run_units(handle, units, variants[: min(2, len(variants))], rows=rows, progress=False)  # warm-up
    t, c = time.perf_counter(), time.process_time()
    run_units(handle, units, variants, rows=rows, progress=False)
    per_variant = (time.perf_counter() - t) / len(variants)
    per_variant_c = (time.process_time() - c) / len(variants)

    print(f"model {handle.name}, window {len(win)} tokens, {len(variants)} variants "
          f"({len({v.metric for v in variants})} metrics, both modes), {rows} rows per forward, all layers")
    print(f"torch threads {torch.get_num_threads()}; wall time, and CPU time (not inflated by waiting for a busy core)")
    print(f"clean SDPA forward:             {sdpa_s:8.3f} s  cpu {sdpa_c:8.3f} s per window (median of {args.repeats})")
    print(f"clean eager forward:            {clean_s:8.3f} s  cpu {clean_c:8.3f} s per window")
    print(f"intervention (batched):         {per_variant:8.3f} s  cpu {per_variant_c:8.3f} s per (variant, window)")
    print(f"ratio variant / clean SDPA:     {per_variant / sdpa_s:8.2f}x  cpu {per_variant_c / sdpa_c:6.2f}x  (target <= 1.0x)")
    print(f"ratio variant / clean eager:    {per_variant / clean_s:8.2f}x  cpu {per_variant_c / clean_c:6.2f}x")


if __name__ == "__main__":
    main()
