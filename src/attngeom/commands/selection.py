"""``attngeom selection``: geometry of token selection (SPEC §5).

For every layer and head, at the last query of each window (``--queries all`` or a sample of ``K``
queries per window instead), the precision, recall and F of the top-N sources by attention in the
space of attention-scaled values ``y_j = a_tj v_j``, for ``N = 1, 2, 4, …, 256`` below the query's
candidate count, Euclidean and cosine; the same with the sink excluded from the candidates; seeded
random subsets (``--repeats``, default 8) with and without the sink; inversions ``GInv_N`` and the
bounds of SPEC §5 checked on every selection; the sink-aware regime and the prediction of ``P, R, F``
from its fitted parameters (see :mod:`attngeom.selection.prediction`).

Writes to ``--out``: ``selection.parquet`` (one row per window, layer, query, kind, distance, head,
N: measured P, R, F, GInv, ρ_max, ρ_min; random kinds as means over repeats with ``F_std``; the
top-N kinds with the predicted ``P_pred, R_pred, F_pred``), ``regime.parquet`` (one row per window,
layer, query and head: the sink-aware parameters and the measured and predicted best small N),
``summary.json`` and the figures of :mod:`attngeom.reports.selection`.
"""

from __future__ import annotations

import dataclasses
import sys

from attngeom.errors import InputError
from attngeom.commands import common

def add_parser(subparsers) -> None:
    from attngeom.selection.settings import SelectionSettings

    d = SelectionSettings()
    p = subparsers.add_parser(
        "selection", help="geometry of token selection: precision/recall/F of top-N vs random, sink-aware prediction",
        description="Treat each head as a classifier of its top-N sources in the space of attention-scaled "
                    "values: geometric precision, recall and F for N = 1, 2, 4, ..., 256 (Euclidean and cosine), "
                    "with and without the sink, against seeded random subsets, with the inversion bounds checked "
                    "and the sink-aware regime's prediction beside the measurement.")
    common.add_model_args(p)
    common.add_data_args(p)
    p.add_argument("--ns", default=None,
                   help="selection sizes N, comma-separated (default 1,2,4,...,256 below the window length); "
                        "every N must be below --window")
    p.add_argument("--distances", default=",".join(d.distances),
                   help="euclidean, cosine or both (default %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="random subsets per N (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random subsets (default %(default)s)")
    p.add_argument("--no-random-nosink", action="store_true",
                   help="draw the random control only from all candidates, not also from the non-sink ones")
    p.add_argument("--queries", default=d.queries,
                   help="queries analysed per window: last (default), all, or a number K (a seeded sample of K, "
                        "the last included)")
    p.add_argument("--layers", default=None, help="layers analysed, e.g. 0,5,10 (default: all)")
    p.add_argument("--sink", type=int, default=d.sink, help="sink position (default %(default)s, the BOS token)")
    p.add_argument("--no-predict", action="store_true", help="skip the sink-aware prediction")
    p.add_argument("--max-lag", type=int, default=d.max_lag,
                   help="largest position distance of the cosine-decay fit (default %(default)s)")
    p.add_argument("--small-n-max", type=int, default=d.small_n_max,
                   help="largest N considered for the best small N (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per forward pass (default %(default)s)")
    common.add_figure_args(p)
    common.add_progress_arg(p)
    common.add_out_arg(p)
    p.set_defaults(func=run)


def parse_args_checked(args):
    """Validate everything that does not need the model; returns (ns, distances, queries, layers)."""
    from attngeom.data.corpora import parse_int_list
    from attngeom.selection.separation import check_ns
    from attngeom.selection.settings import DISTANCES, POWERS

    common.figure_format(args)
    common.check_at_least(args, window=3, max_windows=1, batch_size=1, repeats=0, max_lag=1, stride=1,
                          small_n_max=1)
    if args.sink < 0 or args.sink >= args.window - 1:
        raise InputError(f"--sink must be a position in 0..{args.window - 2}, got {args.sink}")
    if args.ns is None:
        ns = [n for n in POWERS if n < args.window]
    else:
        ns = check_ns(parse_int_list(args.ns, "--ns") or [], args.window)
    distances = [d.strip() for d in args.distances.split(",") if d.strip()]
    bad = [d for d in distances if d not in DISTANCES]
    if bad or not distances:
        raise InputError(f"--distances takes {', '.join(DISTANCES)}; got {args.distances!r}")
    q = args.queries.strip().lower()
    if q in ("last", "all"):
        queries = q
    else:
        try:
            queries = int(q)
        except ValueError:
            raise InputError(f"--queries must be last, all or a number, got {args.queries!r}") from None
        if queries < 1:
            raise InputError(f"--queries must be at least 1, got {queries}")
    layers = common.check_layer_list(args.layers)
    check_corpus(args.data, args)
    return ns, distances, queries, layers


def check_corpus(spec: str, args) -> None:
    """Refuse a missing or empty local corpus before the model is loaded (``hf:`` specs are checked
    when they are read)."""
    from attngeom.data.corpora import read_texts

    if not spec.startswith("hf:"):
        read_texts(spec, common.fields_of(args))


def run(args) -> int:
    from attngeom.data.corpora import check_layers, load_windows
    from attngeom.selection.experiment import TABLES, experiment, run_summary
    from attngeom.selection.settings import SelectionSettings

    ns, distances, queries, layers = parse_args_checked(args)
    fields = common.fields_of(args)
    options = SelectionSettings(ns=tuple(ns), distances=tuple(distances), repeats=args.repeats, seed=args.seed,
                                queries=queries, sink=args.sink, predict=not args.no_predict, max_lag=args.max_lag,
                                small_n_max=args.small_n_max, random_without_sink=not args.no_random_nosink,
                                layers=None if layers is None else tuple(layers), batch_size=args.batch_size)
    identity = common.run_identity(args, options, **common.corpus_identity(args, fields))

    def work(run):
        handle = common.load(args)
        checked = check_layers(layers, handle.num_layers)
        windows = load_windows(handle, args.data, args.window, args.stride, args.max_windows, fields)
        res = experiment(handle, run, windows,
                         dataclasses.replace(options, layers=None if checked is None else tuple(checked)))
        model_name = getattr(handle, "name", args.model)
        summary = run_summary(res, windows, model=model_name, data=args.data, window=args.window, identity=identity)

        def write(staging) -> list[str]:
            return common.write_outputs(staging, res.tables, TABLES, model_name, summary,
                                        None if args.no_figures else "selection", args)

        def report(out, files) -> None:
            d0 = distances[0]
            parts = []
            for n in [n for n in ns if n <= 4]:
                ft = summary[d0]["with_sink"]["f_topn"].get(n)
                fr = summary[d0]["with_sink"]["f_random"].get(n)
                if ft is not None and fr is not None:
                    parts.append(f"N={n}: top {ft:.3f} / random {fr:.3f}")
            print(f"attngeom selection: {model_name}: F ({d0}, with sink) " + "; ".join(parts)
                  + f"; bound violations {summary['bound_violations']}; written to {out}", file=sys.stderr)

        return write, report

    return common.run_command(args, "selection", identity, work)
