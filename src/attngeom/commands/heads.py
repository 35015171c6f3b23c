"""``attngeom heads``: the Retriever / Mixer / Reset head taxonomy and head removal (SPEC §6).

The first ``--data`` corpus is cut into windows; the first ``--calib-windows`` are the calibration
split, the rest are held out. Work, in order:

1. one pass over every window of the first corpus with :class:`~attngeom.heads.taxonomy.TaxonomyStats`
   (source winners, regimes, alignments, attention entropy) that also gives the unedited
   perplexity of both splits; the same statistics on the second corpus when ``--data`` is given twice;
2. single-head sensitivity on the calibration split (ΔPPL of removing each head alone);
3. the taxonomy-guided regime order chosen on the calibration split (all six orders tried);
4. perplexity on the held-out windows for every removal order (taxonomy, weight, entropy, random,
   sensitivity; :mod:`attngeom.heads.experiment`) at every retention (default 100, 90, 75, 50, 25 %);
5. individually critical heads.

Writes to ``--out``: ``heads.parquet`` (one row per layer and head: winner shares, regime on the
whole first corpus, on its calibration split and on the second corpus, alignments, entropy, weight
norm, single-removal ΔPPL, critical flag), ``removal.parquet``, ``order_search.parquet``,
``regimes_by_layer.parquet``, ``summary.json`` and the figures of :mod:`attngeom.reports.heads`.
"""

from __future__ import annotations

import sys

from attngeom.errors import InputError
from attngeom.commands import common
from attngeom.stats.resampling import MIN_UNITS

def add_parser(subparsers) -> None:
    from attngeom.heads.settings import HeadsSettings

    d = HeadsSettings()
    p = subparsers.add_parser(
        "heads", help="head taxonomy (Retriever/Mixer/Reset), corpus agreement, head removal curves",
        description="Classify every head by its source winner (self -> Retriever, sink -> Mixer, other -> Reset), "
                    "compare regimes across two corpora (--data twice), and remove heads in five orders "
                    "(taxonomy-guided, weight magnitude, attention entropy, random, single-head sensitivity), "
                    "reporting held-out perplexity against retention and the individually critical heads.")
    common.add_model_args(p)
    common.add_data_args(p, repeat=True)
    p.add_argument("--calib-windows", type=int, default=d.calib_windows,
                   help=f"windows of the first corpus used for calibration (the rest are held out; default "
                        f"%(default)s, the fewest the critical-head rule and the regime order rest on; fewer "
                        f"only with --few-windows). Cost: the single-head removal runs one forward pass of "
                        f"every calibration window per head (270 per window on SmolLM2-135M), "
                        f"about 37 min for 4 windows of 128 tokens on 2 CPU cores; the order search and the "
                        f"held-out curves add a pass per order and retention")
    p.add_argument("--few-windows", action="store_true",
                   help=f"run with fewer than {MIN_UNITS} calibration windows anyway: the critical heads and the "
                        "regime order are then an example, not an estimate, and the report says so")
    p.add_argument("--retentions", default=",".join(f"{r:g}" for r in d.retentions),
                   help="percent of heads kept, comma-separated, each in (0, 100] (default %(default)s)")
    p.add_argument("--winner-norm", choices=("raw", "projected"), default=d.winner_norm,
                   help="source winner argmax a_ij*||v_j|| (raw, default) or a_ij*||v_j W_O|| (projected)")
    p.add_argument("--sink", type=int, default=d.sink, help="sink position (default %(default)s, the BOS token)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random order (default %(default)s)")
    p.add_argument("--critical-k", type=float, default=d.critical_k,
                   help="critical head: single-removal dPPL > mean + k*std of the other heads of its regime "
                        "(default %(default)g)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="windows per forward pass (default %(default)s)")
    common.add_figure_args(p)
    common.add_progress_arg(p)
    common.add_out_arg(p)
    p.set_defaults(func=run)


def check_args(args) -> list[float]:
    """Everything that needs no model; returns the retentions."""
    from attngeom.data.corpora import parse_float_list, read_texts
    from attngeom.heads.experiment import check_retentions

    data = args.data or []
    if len(data) > 2:
        raise InputError(f"--data may be given at most twice (two corpora to compare), got {len(data)}")
    common.figure_format(args)
    common.check_at_least(args, window=3, calib_windows=1, batch_size=1, stride=1, max_windows=2)
    if args.calib_windows < MIN_UNITS and not args.few_windows:
        raise InputError(f"--calib-windows {args.calib_windows}: the critical heads and the regime order need at least "
                         f"{MIN_UNITS} calibration windows; give --calib-windows {MIN_UNITS} (about "
                         f"{MIN_UNITS / args.calib_windows:g}x the single-head removal's cost), or --few-windows to run "
                         "it as an example")
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


def run(args) -> int:
    from attngeom.data.corpora import load_windows
    from attngeom.heads.experiment import TABLES, experiment, run_summary
    from attngeom.heads.settings import HeadsSettings
    from attngeom.heads.taxonomy import REGIMES

    retentions = check_args(args)
    fields = common.fields_of(args)
    options = HeadsSettings(calib_windows=args.calib_windows, retentions=tuple(retentions), winner_norm=args.winner_norm,
                            sink=args.sink, seed=args.seed, critical_k=args.critical_k, batch_size=args.batch_size)
    identity = common.run_identity(args, options, **common.corpus_identity(
        args, fields, {"data": [common.data_identity(d) for d in args.data]}))

    def work(run):
        handle = common.load(args)
        corpora = [load_windows(handle, spec, args.window, args.stride, args.max_windows, fields) for spec in args.data]
        res = experiment(handle, run, corpora, options, names=args.data)
        model_name = getattr(handle, "name", args.model)
        summary = run_summary(res, model=model_name, data=args.data, window=args.window, identity=identity)

        def write(staging) -> list[str]:
            return common.write_outputs(staging, res.tables, TABLES, model_name, summary,
                                        None if args.no_figures else "heads", args)

        def report(out, files) -> None:
            sh = summary["regime_share"][args.data[0]]
            msg = ", ".join(f"{r} {sh[r]:.0%}" for r in REGIMES)
            few = (f" from {summary['calibration_windows']} calibration windows (fewer than {MIN_UNITS}: an example, "
                   "not an estimate)" if summary["calibration_windows"] < MIN_UNITS else "")
            print(f"attngeom heads: {model_name}: {msg}; regime order {' > '.join(summary['taxonomy_regime_order'])}; "
                  f"{len(summary['critical_heads'])} critical head(s){few}; written to {out}", file=sys.stderr)

        return write, report

    return common.run_command(args, "heads", identity, work)
