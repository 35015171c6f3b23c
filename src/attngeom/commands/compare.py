"""``attngeom compare``: two traces side by side, a counterfactual pair of texts (``--text`` and
``--text-b``) or two models on one text (``--model`` and ``--model-b``), aligned and compared by
:func:`attngeom.traces.compare.compare_texts` (docs/explore.md#comparing-two-traces).

Writes into ``--out``: ``alignment.parquet``, ``layers.parquet``, ``heads.parquet``, ``sources.parquet``,
``compare.html`` (the two explorers side by side), ``summary.json`` and ``report.md``. Bad input (no
second text or model, an empty text, an unknown layer, texts that do not align, a target without
counterpart) fails with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from attngeom.errors import InputError
from attngeom.commands import common
from attngeom.commands.common import add_model_args, add_out_arg, check_layer_list, model_identity, text_identity

DEFAULT_OUT = "out/compare"
PAGE = "compare.html"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="compare two traces: a counterfactual pair of texts, or two models on one text",
        description="Analyse --text (or --file) and --text-b (or --file-b) with --model, or one text with --model "
                    "and --model-b, align the two token sequences (longest matching blocks) and compare attention "
                    "and contribution at the target token per layer, head and source. Writes the tables, "
                    f"{PAGE} (the two explorers side by side), summary.json and report.md into --out "
                    f"(default {DEFAULT_OUT}).")
    add_model_args(p)
    p.add_argument("--model-b", default=None, help="a second model for the same text (default: --model)")
    for suffix, what in (("", "the first text (a)"), ("-b", "the second text (b; default: the first)")):
        g = p.add_mutually_exclusive_group()
        g.add_argument(f"--text{suffix}", default=None, help=what)
        g.add_argument(f"--file{suffix}", default=None, help=f"read {what} from this UTF-8 file")
    p.add_argument("--layers", default="all", help="layers to compare: all or a list, e.g. 0,5,29 (default %(default)s)")
    p.add_argument("--target", type=int, default=None,
                   help="the position of text a whose rows are compared (an aligned token; negative counts from "
                        "the end; default: the last aligned token)")
    p.add_argument("--answer", default=None,
                   help="a token whose next-token prediction each text reports (e.g. ' Paris', leading space "
                        "included); with one model and texts of equal token counts, each head's output is also "
                        "patched from b into a (prediction.parquet, patching.parquet)")
    p.add_argument("--contrast", default=None,
                   help="a token to compare --answer with (e.g. ' Berlin'): the logit difference is the metric")
    add_out_arg(p, default=DEFAULT_OUT)
    p.set_defaults(func=run)


def _texts(args) -> tuple[tuple[str, str], tuple[str, str] | None]:
    a = common.text_input(argparse.Namespace(text=args.text, file=args.file), "compare")
    if args.text is None and args.file is None:
        raise InputError("give the text to compare: --text or --file")
    if args.text_b is None and args.file_b is None:
        return a, None
    b = common.text_input(argparse.Namespace(text=args.text_b, file=args.file_b), "compare")
    return a, (b[0], "--text-b" if args.text_b is not None else b[1])


def run(args) -> int:
    from attngeom.reports import compare as rep

    t_start = time.perf_counter()
    layers = check_layer_list(args.layers)
    (text_a, source_a), b = _texts(args)
    if args.model_b is not None and not args.model_b.strip():
        raise InputError("--model-b is empty; name the second model (or leave --model-b out to compare two texts)")
    if b is None and args.model_b is None:
        raise InputError("nothing to compare: give a second text (--text-b or --file-b) or a second model (--model-b)")
    text_b, source_b = b if b is not None else (text_a, source_a)
    model_b = args.model_b or args.model
    settings = common.run_identity(args, None, model_b=model_identity(argparse.Namespace(**{**vars(args), "model": model_b})),
                                   a=text_identity(text_a, source_a), b=text_identity(text_b, source_b),
                                   layers=common.layers_identity(layers), target=args.target,
                                   **({"answer": args.answer, "contrast": args.contrast} if args.answer is not None
                                      or args.contrast is not None else {}))
    if args.contrast is not None and args.answer is None:
        raise InputError("--contrast needs --answer (e.g. --answer ' Paris' --contrast ' Berlin')")

    def work(run):
        from attngeom.explorer.data import from_trace
        from attngeom.reports import explore
        from attngeom.traces.compare import compare_texts, tables

        handle = common.load(args)
        handle_b = handle if args.model_b is None else common.load(argparse.Namespace(**{**vars(args), "model": model_b}))
        trace_a, trace_b, diff = compare_texts(handle, text_a, text_b=None if b is None else text_b,
                                               handle_b=None if args.model_b is None else handle_b,
                                               layers=layers, target=args.target, answer=args.answer,
                                               contrast=args.contrast)
        summary = {"command": "compare", **diff.summary(), "source_a": source_a, "source_b": source_b,
                   "settings": settings}
        worst = summary["most_different_layer"]["contribution"]["layer"]
        pages = [explore.render(from_trace(t), initial_layer=worst) for t in (trace_a, trace_b)]

        def write(staging: Path) -> list[str]:
            out = common.Outputs(staging, args)
            out.tables(tables(diff))
            out.text(PAGE, rep.page(*pages, summary, diff))
            summary["runtime_s"] = round(time.perf_counter() - t_start, 3)
            summary["files"] = out.files + ["summary.json", "report.md"]
            out.json("summary.json", summary)
            return out.report("compare", summary, markdown=rep.report_markdown(summary, diff))

        def report(out, files) -> None:
            print(f"attngeom compare: {summary['aligned']} aligned tokens, {len(summary['layers'])} layer(s) -> {out}/ "
                  f"({', '.join(files)})", file=sys.stderr)

        return write, report

    return common.run_command(args, "compare", settings, work)
