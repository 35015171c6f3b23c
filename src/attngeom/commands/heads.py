"""``attngeom heads``: the Retriever / Mixer / Reset head taxonomy and head removal (SPEC §6).

The first ``--data`` corpus is cut into windows; the first ``--calib-windows`` are the calibration
split, the rest are held out. Work, in order:

1. one pass over every window of the first corpus with :class:`~attngeom.taxonomy.TaxonomyStats`
   (source winners, regimes, alignments, attention entropy) that also gives the unedited
   perplexity of both splits; the same statistics on the second corpus when ``--data`` is given twice;
2. single-head sensitivity on the calibration split (ΔPPL of removing each head alone);
3. the taxonomy-guided regime order chosen on the calibration split (all six orders tried);
4. perplexity on the held-out windows for every removal order (taxonomy, weight, entropy, random,
   sensitivity; :mod:`attngeom.heads`) at every retention (default 100, 90, 75, 50, 25 %);
5. individually critical heads.

Writes to ``--out``: ``heads.parquet`` (one row per layer and head: winner shares, regime on the
whole first corpus, on its calibration split and on the second corpus, alignments, entropy, weight
norm, single-removal ΔPPL, critical flag), ``removal.parquet``, ``order_search.parquet``,
``regimes_by_layer.parquet``, ``summary.json`` and the figures of :mod:`attngeom.reports.heads`.
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import pandas as pd

from ..errors import InputError
from . import common


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "heads", help="head taxonomy (Retriever/Mixer/Reset), corpus agreement, head removal curves",
        description="Classify every head by its source winner (self -> Retriever, sink -> Mixer, other -> Reset), "
                    "compare regimes across two corpora (--data twice), and remove heads in five orders "
                    "(taxonomy-guided, weight magnitude, attention entropy, random, single-head sensitivity), "
                    "reporting held-out perplexity against retention and the individually critical heads.")
    common.add_model_args(p)
    common.add_data_args(p, repeat=True)
    p.add_argument("--calib-windows", type=int, default=4,
                   help="windows of the first corpus used for calibration (the rest are held out; default 4)")
    p.add_argument("--retentions", default="100,90,75,50,25",
                   help="percent of heads kept, comma-separated, each in (0, 100] (default 100,90,75,50,25)")
    p.add_argument("--winner-norm", choices=("raw", "projected"), default="raw",
                   help="source winner argmax a_ij*||v_j|| (raw, default) or a_ij*||v_j W_O|| (projected)")
    p.add_argument("--sink", type=int, default=0, help="sink position (default 0, the BOS token)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random order (default 0)")
    p.add_argument("--critical-k", type=float, default=3.0,
                   help="critical head: single-removal dPPL > mean + k*std of the other heads of its regime (default 3)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward pass (default 4)")
    p.add_argument("--no-figures", action="store_true", help="write tables and summary only")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    common.add_out_arg(p)
    p.set_defaults(func=run)


def check_args(args) -> list[float]:
    """Everything that needs no model; returns the retentions."""
    from ..data import parse_float_list, read_texts
    from ..heads import check_retentions

    data = args.data or []
    if len(data) > 2:
        raise InputError(f"--data may be given at most twice (two corpora to compare), got {len(data)}")
    common.check_at_least(args, window=3, calib_windows=1, batch_size=1)
    if args.max_windows is not None and args.max_windows <= args.calib_windows:
        raise InputError(f"--max-windows {args.max_windows} leaves no held-out window after "
                         f"--calib-windows {args.calib_windows}")
    if args.sink < 0 or args.sink >= args.window - 1:
        raise InputError(f"--sink must be a position in 0..{args.window - 2}, got {args.sink}")
    retentions = check_retentions(parse_float_list(args.retentions, "--retentions"))
    for spec in data:
        if not spec.startswith("hf:"):
            read_texts(spec, common.fields_of(args))
    return retentions


def _taxonomy_pass(handle, windows, reducer, batch_size, desc, progress):
    """Stream ``windows`` through ``reducer``; returns the summed NLL and token count."""
    from tqdm.auto import tqdm

    from ..capture import Session
    from ..trace import forward, make_batches, token_nll

    session = Session(observers=[reducer])
    total, count = 0.0, 0
    bar = tqdm(total=len(windows), desc=desc, unit="window", disable=not progress)
    for batch in make_batches(handle, windows, batch_size):
        reducer.begin(batch)
        logits = forward(handle, batch, session, logits=True)
        reducer.end(batch)
        total += float(token_nll(logits, batch).double().sum())
        count += int((batch.lengths - 1).clamp_min(0).sum())
        bar.update(len(batch.index))
    bar.close()
    return total, count


def run(args) -> int:
    from ..data import load_windows
    from ..heads import (ORDERS, build_orders, choose_regime_order, critical_heads, removal_curves,
                         single_head_sensitivity, weight_norms)
    from ..taxonomy import (REGIMES, TaxonomyStats, corpus_agreement, regime_alignment, regime_shares,
                            shares_by_depth, shares_by_layer)

    retentions = check_args(args)
    out = common.prepare_out(args.out)
    progress = not args.no_progress
    t0 = time.time()
    handle = common.load(args)
    fields = common.fields_of(args)
    corpora = [load_windows(handle, spec, args.window, args.stride, args.max_windows, fields) for spec in args.data]
    windows = corpora[0]
    if len(windows) <= args.calib_windows:
        raise InputError(f"{args.data[0]} gives {len(windows)} window(s) of {args.window} tokens: not enough for "
                         f"{args.calib_windows} calibration window(s) and at least one held-out window")
    calib, held = windows[: args.calib_windows], windows[args.calib_windows:]
    model_name = getattr(handle, "name", args.model)
    L, H = handle.num_layers, handle.num_heads

    # 1. taxonomy + unedited perplexity
    tax_cal = TaxonomyStats(sink=args.sink, winner_norm=args.winner_norm)
    tax_held = TaxonomyStats(sink=args.sink, winner_norm=args.winner_norm)
    nll_cal, n_cal = _taxonomy_pass(handle, calib, tax_cal, args.batch_size, "taxonomy: calibration", progress)
    nll_held, n_held = _taxonomy_pass(handle, held, tax_held, args.batch_size, "taxonomy: held-out", progress)
    cal_df = tax_cal.result()
    all_df = TaxonomyStats(sink=args.sink).merge(tax_cal).merge(tax_held).result()
    base_cal = math.exp(nll_cal / max(1, n_cal))
    base_held = math.exp(nll_held / max(1, n_held))
    second = None
    if len(corpora) > 1:
        tax2 = TaxonomyStats(sink=args.sink, winner_norm=args.winner_norm)
        _taxonomy_pass(handle, corpora[1], tax2, args.batch_size, "taxonomy: second corpus", progress)
        second = tax2.result()

    # 2-4. sensitivity, regime order, removal curves
    sens = single_head_sensitivity(handle, calib, batch_size=args.batch_size, base_ppl=base_cal, progress=progress)
    regime_order, search = choose_regime_order(handle, calib, cal_df, retentions, args.batch_size, progress)
    weights = weight_norms(handle)
    orders = build_orders(cal_df, weights, sens, regime_order, seed=args.seed)
    curves = removal_curves(handle, held, orders, retentions, args.batch_size, progress)
    crit = critical_heads(sens, cal_df, k=args.critical_k)

    # tables
    heads = all_df.copy()
    heads.insert(0, "model", model_name)
    heads["regime_calibration"] = cal_df["regime"].to_numpy()
    heads["entropy_calibration"] = cal_df["entropy"].to_numpy()
    if second is not None:
        heads["regime_corpus2"] = second["regime"].to_numpy()
        for c in ("winner_self", "winner_sink", "winner_other"):
            heads[f"{c}_corpus2"] = second[c].to_numpy()
    heads["weight_norm"] = [weights[l, h] for l, h in zip(heads["layer"], heads["head"])]
    heads["single_delta_ppl"] = [sens[l, h] for l, h in zip(heads["layer"], heads["head"])]
    crit_set = {(c["layer"], c["head"]) for c in crit}
    heads["critical"] = [(int(l), int(h)) in crit_set for l, h in zip(heads["layer"], heads["head"])]
    rank = {name: {lh: i for i, lh in enumerate(order)} for name, order in orders.items()}
    for name in ORDERS:
        heads[f"removal_rank_{name}"] = [rank[name][(int(l), int(h))] for l, h in zip(heads["layer"], heads["head"])]
    by_layer = shares_by_layer(all_df)
    by_layer.insert(0, "corpus", args.data[0])
    if second is not None:
        b2 = shares_by_layer(second)
        b2.insert(0, "corpus", args.data[1])
        by_layer = pd.concat([by_layer, b2], ignore_index=True)
    by_layer.insert(0, "model", model_name)
    curves.insert(0, "model", model_name)
    search.insert(0, "model", model_name)
    common.write_parquet(heads, out / "heads.parquet")
    common.write_parquet(curves, out / "removal.parquet")
    common.write_parquet(search, out / "order_search.parquet")
    common.write_parquet(by_layer, out / "regimes_by_layer.parquet")

    ppl = {name: {f"{r:g}": float(curves[(curves["order"] == name) & (curves["retention"] == r)]["ppl"].iloc[0])
                  for r in retentions} for name in orders}
    summary = {
        "command": "heads",
        "model": model_name,
        "data": args.data,
        "window": args.window,
        "windows": [len(c) for c in corpora],
        "calibration_windows": len(calib),
        "heldout_windows": len(held),
        "winner_norm": args.winner_norm,
        "sink_position": args.sink,
        "regime_share": {args.data[0]: regime_shares(all_df),
                         **({args.data[1]: regime_shares(second)} if second is not None else {})},
        "regime_share_calibration": regime_shares(cal_df),
        "regime_share_by_depth": shares_by_depth(all_df, L),
        "regime_share_by_layer": {int(r.layer): {g: float(getattr(r, g)) for g in REGIMES}
                                  for r in shares_by_layer(all_df).itertuples()},
        "corpus_agreement": corpus_agreement(all_df, second) if second is not None else None,
        "calibration_heldout_agreement": corpus_agreement(
            cal_df, tax_held.result() if tax_held.sums else cal_df),
        "regime_alignment": regime_alignment(all_df),
        "taxonomy_regime_order": regime_order,
        "perplexity_base": {"calibration": base_cal, "heldout": base_held},
        "perplexity": ppl,
        "retentions": retentions,
        "critical_rule": f"single-removal dPPL > mean + {args.critical_k:g} std of the other heads of the regime "
                         "(leave-one-out; calibration split)",
        "critical_heads": crit,
        "single_delta_ppl": {"mean": float(sens.mean()), "max": float(sens.max()),
                             "argmax": [int(x) for x in np.unravel_index(sens.argmax(), sens.shape)]},
        "seconds": None,
        "files": ["heads.parquet", "removal.parquet", "order_search.parquet", "regimes_by_layer.parquet"],
    }
    if not args.no_figures:
        from ..reports.heads import render

        summary["figures"] = [p.name for p in render(out, heads, curves, by_layer)]
    summary["seconds"] = round(time.time() - t0, 1)
    common.write_json(out / "summary.json", summary)
    sh = summary["regime_share"][args.data[0]]
    msg = ", ".join(f"{r} {sh[r]:.0%}" for r in REGIMES)
    print(f"attngeom heads: {model_name}: {msg}; regime order {' > '.join(regime_order)}; "
          f"{len(crit)} critical head(s); written to {out}", file=sys.stderr)
    return 0
