"""``attngeom faithfulness``: comprehensiveness and sufficiency of token rankings (SPEC §3)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from attngeom.errors import InputError
from attngeom.faithfulness.settings import FaithfulnessSettings
from attngeom.commands import common
from attngeom.commands.common import add_data_args, add_model_args, add_out_arg, check_at_least, check_layer_list, data_identity, fields_of


def add_parser(subparsers) -> None:
    from attngeom.metrics import registry

    d = FaithfulnessSettings()
    p = subparsers.add_parser(
        "faithfulness",
        help="mask the top/bottom-ranked sources of every query and measure the change in perplexity "
             "(or multiple-choice accuracy)",
        description="Comprehensiveness (mask the k_i = floor(r(i+1)) highest-ranked sources of every query) "
                    "and sufficiency (mask the lowest-ranked) at every intervened layer, for each ranking "
                    "metric and removal ratio r; writes table.parquet, summary.json, report.md and the figure "
                    "faithfulness.png (--figure-format) to --out, and resumes from the records in --out/checkpoint when rerun.")
    add_model_args(p)
    add_data_args(p, required=True)
    p.add_argument("--task", choices=["mmlu", "winogrande", "boolq"], default=None,
                   help="score a multiple-choice JSONL file (--data) by option log-likelihood instead of perplexity")
    p.add_argument("--max-examples", type=int, default=None, help="task examples to use (default: all)")
    p.add_argument("--metrics", default=",".join(d.metrics),
                   help="ranking metrics, comma-separated (default %(default)s; known: "
                        f"{', '.join((*registry.rank_names(), 'random'))}; attngeom.metrics.registry)")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in d.ratios),
                   help="removal ratios in (0, 1), comma-separated (default %(default)s)")
    p.add_argument("--seeds", default=",".join(str(x) for x in d.seeds),
                   help="seeds of the random ranking (default %(default)s)")
    p.add_argument("--layers", default="all", help="layers intervened on: all (default) or e.g. 0,3,5")
    p.add_argument("--per-head", action="store_true", help="rank per head (default: per token, all heads)")
    p.add_argument("--absolute", action="store_true", help="rank by absolute score (default: signed)")
    p.add_argument("--batch-rows", type=int, default=None,
                   help="variants of one window per batched forward (default: as many as fit ~3 GB of logits)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    common.add_figure_args(p)
    add_out_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from attngeom.data.corpora import check_layers, parse_float_list, parse_int_list, resolve_texts
    from attngeom.faithfulness.experiment import experiment, task_units, variants_of, window_units

    # ---- everything that needs no model, before loading it ---------------------------------
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    ratios = parse_float_list(args.ratios, "--ratios")
    seeds = parse_int_list(args.seeds, "--seeds") or list(FaithfulnessSettings.seeds)
    layers = check_layer_list(args.layers)
    options = FaithfulnessSettings(metrics=tuple(metrics), ratios=tuple(sorted(ratios)), seeds=tuple(seeds),
                                   per_head=bool(args.per_head), absolute=bool(args.absolute),
                                   layers=None if layers is None else tuple(layers), rows=args.batch_rows)
    variants_of(options)  # bad metrics, ratios or seeds fail here, before the model loads
    check_at_least(args, window=2, max_windows=1, stride=1, batch_rows=1)
    common.figure_format(args)
    fields = fields_of(args)
    examples = None
    if args.task:
        from attngeom.faithfulness.tasks import load_task

        if args.max_examples is not None and args.max_examples < 1:
            raise InputError(f"--max-examples must be positive, got {args.max_examples}")
        examples = load_task(args.data, args.task, limit=args.max_examples)
    else:
        resolve_texts(args.data, fields)  # missing file / field / offline dataset: fail now
    settings = common.run_identity(
        args, options, **data_identity(args.data), fields=fields, task=args.task,
        max_examples=args.max_examples if args.task else None, window=None if args.task else args.window,
        stride=None if args.task else args.stride, max_windows=None if args.task else args.max_windows)

    def work(run):
        handle = common.load(args)
        checked = check_layers(layers, handle.num_layers)
        if examples is not None:
            units = task_units(handle, examples)
        else:
            from attngeom.data.corpora import load_windows

            wins = load_windows(handle, args.data, window=args.window, stride=args.stride,
                                max_windows=args.max_windows, fields=fields)
            units = window_units(wins)
        info = {"model_name": getattr(handle, "name", args.model), **settings}
        res = experiment(handle, run, units=units, progress=not args.no_progress, examples=examples, meta=info,
                         settings=dataclasses.replace(options, layers=None if checked is None else tuple(checked)))
        table, summary = res.tables["table"], res.summary

        def write(staging: Path) -> list[str]:
            out = common.Outputs(staging, args)
            out.table("table", table)
            out.json("summary.json", summary)
            if not table.empty and not args.no_figures:
                out.figures("faithfulness")
            return out.report("faithfulness", summary)

        return write, lambda out, files: _print_summary(summary, out, files)

    return common.run_command(args, "faithfulness", settings, work)


def _print_summary(summary: dict, out: Path, files) -> None:
    measure = summary.get("measure", "ppl")
    what = "ΔPPL" if measure == "ppl" else "Δacc"
    print(f"clean {measure}: {summary.get('clean', float('nan')):.4f}  "
          f"({summary['units_done']}/{summary['units_total']} {summary['unit']}s)")
    print(f"{'metric':<20} {'comprehensiveness ' + what:>24} {'sufficiency ' + what:>20}")
    for m, d in summary["metrics"].items():
        print(f"{m:<20} {d['comprehensiveness_aoc']:>24.4f} {d['sufficiency_aoc']:>20.4f}")
    print("most faithful first — comprehensiveness:", ", ".join(summary.get("order_comprehensiveness", [])))
    print("most faithful first — sufficiency:     ", ", ".join(summary.get("order_sufficiency", [])))
    print(f"wrote {', '.join(str(out / f) for f in files)} and {out / 'run.json'}", file=sys.stderr)
