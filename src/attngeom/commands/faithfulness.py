"""``attngeom faithfulness``: comprehensiveness and sufficiency of token rankings (SPEC §3)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import InputError
from .common import add_data_args, add_model_args, add_out_arg, check_at_least, fields_of, load, prepare_out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "faithfulness",
        help="mask the top/bottom-ranked sources of every query and measure the change in perplexity "
             "(or multiple-choice accuracy)",
        description="Comprehensiveness (mask the k_i = floor(r(i+1)) highest-ranked sources of every query) "
                    "and sufficiency (mask the lowest-ranked) at every intervened layer, for each ranking "
                    "metric and removal ratio r; writes table.parquet, summary.json and faithfulness.png to "
                    "--out, and resumes from checkpoint.jsonl there when rerun.")
    add_model_args(p)
    add_data_args(p, required=True)
    p.add_argument("--task", choices=["mmlu", "winogrande", "boolq"], default=None,
                   help="score a multiple-choice JSONL file (--data) by option log-likelihood instead of perplexity")
    p.add_argument("--max-examples", type=int, default=None, help="task examples to use (default: all)")
    p.add_argument("--metrics", default="attention,value_weighted,output_normalized,contribution,random",
                   help="ranking metrics, comma-separated (also: contribution_inter)")
    p.add_argument("--ratios", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9",
                   help="removal ratios in (0, 1), comma-separated")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the random ranking (default 0,1,2)")
    p.add_argument("--layers", default="all", help="layers intervened on: all (default) or e.g. 0,3,5")
    p.add_argument("--per-head", action="store_true", help="rank per head (default: per token, all heads)")
    p.add_argument("--absolute", action="store_true", help="rank by absolute score (default: signed)")
    p.add_argument("--batch-rows", type=int, default=None,
                   help="variants of one window per batched forward (default: as many as fit ~3 GB of logits)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_out_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..data import check_layers, parse_float_list, parse_int_list, resolve_texts
    from ..faithfulness import DEFAULT_SEEDS, Checkpoint, build_variants, experiment, task_units, window_units

    # ---- everything that needs no model, before loading it ---------------------------------
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    ratios = parse_float_list(args.ratios, "--ratios")
    seeds = parse_int_list(args.seeds, "--seeds") or list(DEFAULT_SEEDS)
    variants = build_variants(metrics, ratios, seeds, per_head=args.per_head, absolute=args.absolute)
    layers = parse_int_list(args.layers, "--layers")
    check_at_least(args, window=2, max_windows=1, stride=1, batch_rows=1)
    fields = fields_of(args)
    examples = None
    if args.task:
        from ..tasks import load_task

        if args.max_examples is not None and args.max_examples < 1:
            raise InputError(f"--max-examples must be positive, got {args.max_examples}")
        examples = load_task(args.data, args.task, limit=args.max_examples)
    else:
        resolve_texts(args.data, fields)  # missing file / field / offline dataset: fail now
    data_id = args.data if args.data.startswith("hf:") else str(Path(args.data).resolve())
    meta = {"model": args.model, "dtype": args.dtype, "data": data_id, "fields": fields, "task": args.task,
            "window": None if args.task else args.window, "stride": None if args.task else args.stride,
            "layers": "all" if layers is None else sorted(set(layers)), "per_head": bool(args.per_head),
            "absolute": bool(args.absolute)}
    out = prepare_out(args.out)
    ckpt = Checkpoint(out)
    ckpt.check_meta(meta)

    # ---- the model --------------------------------------------------------------------------
    handle = load(args)
    layers = check_layers(layers, handle.num_layers)
    if examples is not None:
        units = task_units(handle, examples)
    else:
        from ..data import load_windows

        wins = load_windows(handle, args.data, window=args.window, stride=args.stride,
                            max_windows=args.max_windows, fields=fields)
        units = window_units(wins)
    info = {"model_name": getattr(handle, "name", args.model), "metrics": metrics,
            "ratios": sorted(ratios), "seeds": seeds, **meta}
    table, summary = experiment(handle, units=units, variants=variants, out=out, layers=layers,
                                rows=args.batch_rows, progress=not args.no_progress, examples=examples,
                                meta=info, partial_every=1 if examples is None else max(1, len(units) // 10),
                                figure_every=1 if examples is None else max(1, len(units) // 10))
    _print_summary(summary, out)
    return 0


def _print_summary(summary: dict, out: Path) -> None:
    measure = summary.get("measure", "ppl")
    what = "ΔPPL" if measure == "ppl" else "Δacc"
    print(f"clean {measure}: {summary.get('clean', float('nan')):.4f}  "
          f"({summary['units_done']}/{summary['units_total']} {summary['unit']}s)")
    print(f"{'metric':<20} {'comprehensiveness ' + what:>24} {'sufficiency ' + what:>20}")
    for m, d in summary["metrics"].items():
        print(f"{m:<20} {d['comprehensiveness_aoc']:>24.4f} {d['sufficiency_aoc']:>20.4f}")
    print("most faithful first — comprehensiveness:", ", ".join(summary.get("order_comprehensiveness", [])))
    print("most faithful first — sufficiency:     ", ", ".join(summary.get("order_sufficiency", [])))
    print(f"wrote {out / 'table.parquet'}, {out / 'summary.json'}, {out / 'faithfulness.png'}", file=sys.stderr)
