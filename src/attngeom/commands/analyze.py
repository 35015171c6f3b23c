"""``attngeom analyze``: per-token and per-head summaries of one text, with maps and sink figures.

With no ``--text``/``--file``: the built-in sample text (:data:`attngeom.data.corpora.SAMPLE_TEXT`), ``make
demo``. The analysis (windows, ``--generate N``: docs/generation.md) is
:func:`attngeom.analysis.experiment.experiment`, corpus mode (``--data``)
:func:`attngeom.analysis.experiment.answer_experiment`. Bad input fails before any compute: the arguments, the
output directory (claimed, proved writable) and the input file are checked before the model loads,
the input against the model before the experiment's stage (resumable) runs. The write step draws
the maps of the figure layers (:func:`attngeom.analysis.experiment.figure_maps`: the first window, when it
has at most ``--max-map-tokens`` tokens) and writes, in ``--out``: ``tokens.parquet``,
``heads.parquet`` (generating also ``answer_shares``, ``answer_sources``, ``answer_summary``, ``answer_heads``),
``maps_layer{L}.png``, ``heads_layer{L}.png``, ``sinks_per_layer.png``, ``summary.json`` and
``report.md``; corpus mode ``answers.parquet``, the answer tables and ``summary.json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from attngeom.errors import InputError
from attngeom.analysis.settings import AnalyzeSettings
from attngeom.commands import common
from attngeom.commands.common import add_model_args, add_out_arg, add_text_args, check_at_least, check_layer_list, text_identity, text_input
from attngeom.commands.generation_args import add_generation_args, decoding_of, note_chat_template, prompt_of

DEFAULT_OUT = "out/analyze"


def add_parser(subparsers) -> None:
    d = AnalyzeSettings()
    p = subparsers.add_parser(
        "analyze",
        help="analyse one text: per-token and per-head tables, attention vs contribution maps, sink figures",
        description="Run one text (default: the built-in sample) through the model, reduce every analysed "
                    "layer to per-token summaries (tokens.parquet) and per-head statistics (heads.parquet), "
                    "and draw attention beside contribution maps for a few layers and the per-layer sink "
                    "attention vs sink contribution. Writes summary.json and report.md too, all in --out "
                    f"(default {DEFAULT_OUT}). With no --text/--file: the built-in sample text (make demo).")
    add_model_args(p)
    add_text_args(p, "analyse")
    p.add_argument("--layers", default="all",
                   help="layers to analyse: all (default) or a comma-separated list, e.g. 0,5,29")
    p.add_argument("--figure-layers", default=None,
                   help="layers drawn as maps (default: the first, a middle and the last analysed layer)")
    p.add_argument("--heads", default="all",
                   help="heads shown in the per-head grids heads_layer{L}.png: all (default) or a list; "
                        "maps_layer{L}.png always shows the token level (all heads)")
    p.add_argument("--window", type=int, default=d.window,
                   help="analyse an input longer than the model's context in windows of this many tokens "
                        "(BOS included); default: such inputs are refused")
    p.add_argument("--stride", type=int, default=d.stride,
                   help="tokens between window starts with --window (default: window-1, no overlap)")
    p.add_argument("--sink", type=int, default=d.sink, help="position of the sink token (default %(default)s)")
    p.add_argument("--max-map-tokens", type=int, default=d.max_map_tokens,
                   help="draw maps only when the (first) input window has at most this many tokens "
                        "(default %(default)s)")
    p.add_argument("--route", default=d.route,
                   help="how the summaries are computed (SPEC §10): auto (default: fused attention kernels on "
                        "CUDA, blocks of queries on the CPU), fused (the fused kernels wherever they reproduce the "
                        "layer exactly) or block; heads.parquet's route column says what each layer took")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    common.add_figure_args(p, no_figures=False)
    add_generation_args(p)
    p.add_argument("--rank-special", action="store_true",
                   help="rank special and chat-template tokens as sources in the answer tables (answer_sources, "
                        "answer_heads); by default they are marked there but left out of the rankings")
    g = p.add_argument_group("corpus mode (with --generate: answer every prompt of a file)")
    g.add_argument("--data", default=None,
                   help="prompts: a .jsonl/.csv/.parquet file (with --fields), a text file or hf:NAME; each is "
                        "answered and analysed (answers.parquet and the answer tables, one row set per prompt)")
    g.add_argument("--fields", default=None, help="the prompt's field(s) of --data, e.g. prompt")
    g.add_argument("--max-prompts", type=int, default=None, help="answer only the first N prompts of --data")
    add_out_arg(p, default=DEFAULT_OUT)
    p.set_defaults(func=run)


def _checked(args) -> dict:
    """The options that need no model, checked: layers, figure layers and heads as tuples (None: default)."""
    from attngeom.capture.routes import check_route
    from attngeom.data.corpora import parse_int_list

    layers = check_layer_list(args.layers)
    fig_layers = check_layer_list(args.figure_layers, "--figure-layers") if args.figure_layers else None
    heads = parse_int_list(args.heads, "--heads")
    if heads is not None and not heads:
        raise InputError("--heads names no head")
    check_at_least(args, window=3, stride=1, sink=0, max_map_tokens=0)
    check_route(args.route)
    common.figure_format(args)
    if args.stride is not None and args.window is None:
        raise InputError("--stride needs --window")
    return {k: None if v is None else tuple(v) for k, v in
            (("layers", layers), ("figure_layers", fig_layers), ("heads", heads))}


def run(args) -> int:
    from attngeom.analysis.experiment import experiment, map_window

    t_start = time.perf_counter()
    lists = _checked(args)
    if args.data is not None or args.fields is not None or args.max_prompts is not None:
        return _run_corpus(args, lists["layers"], t_start)
    text, source = text_input(args, "analyse")
    settings = AnalyzeSettings(**lists, window=args.window, stride=args.stride, sink=args.sink,
                               max_map_tokens=args.max_map_tokens, decoding=decoding_of(args), chat=args.chat,
                               system=args.system, rank_special=args.rank_special, route=args.route)
    prompt = prompt_of(args, text) if settings.decoding else text
    identity = common.run_identity(args, settings, **text_identity(text, source))

    def work(run):
        t0 = time.perf_counter()
        handle = common.load(args)
        t_load = time.perf_counter() - t0
        note_chat_template(args, handle, "analyze", prompt)
        res = experiment(handle, run, prompt, settings, source=source)
        res.summary["settings"] = identity
        if res.summary["figure_layers"] and map_window(res) is None:
            print(f"attngeom analyze: {res.summary['maps']}", file=sys.stderr)

        def write(staging: Path) -> list[str]:
            from attngeom.reports import analyze as rep

            out = common.Outputs(staging, args)
            out.tables(res.tables)
            t0 = time.perf_counter()
            _draw(out, handle, res, args)
            res.summary["runtime_s"] = {"total": round(time.perf_counter() - t_start, 3), "load_model": round(t_load, 3),
                                        "maps_and_figures": round(time.perf_counter() - t0, 3)}
            res.summary["files"] = out.files + ["summary.json", "report.md"]
            out.json("summary.json", res.summary)
            return out.report("analyze", res.summary, markdown=rep.report_markdown(res.summary))

        def report(out, files) -> None:
            print(f"attngeom analyze: {res.summary['T']} tokens, {len(res.summary['layers'])} layer(s) -> {out}/ "
                  f"({', '.join(files)})", file=sys.stderr)

        return write, report

    return common.run_command(args, "analyze", identity, work)


def _run_corpus(args, layers, t_start) -> int:
    """Corpus mode: every prompt of ``--data`` answered with analysis (stage ``generate`` of the run)."""
    from attngeom.analysis.experiment import answer_experiment
    from attngeom.data.corpora import resolve_texts
    from attngeom.commands.common import data_identity, fields_of

    if args.data is None:
        raise InputError("--fields and --max-prompts go with --data")
    if args.text is not None or args.file is not None:
        raise InputError("--data replaces --text/--file; give one of them")
    settings = AnalyzeSettings(layers=layers, sink=args.sink, decoding=decoding_of(args), chat=args.chat,
                               system=args.system, rank_special=args.rank_special)
    if settings.decoding is None:
        raise InputError("--data needs --generate N (corpus mode answers every prompt)")
    check_at_least(args, max_prompts=1)
    fields = fields_of(args)
    identity = common.run_identity(args, None, **data_identity(args.data), fields=fields, max_prompts=args.max_prompts,
                                   **settings.identity(corpus=True))

    def work(run):
        texts = resolve_texts(args.data, fields)[: args.max_prompts]
        if not texts:
            raise InputError(f"{args.data} holds no prompt")
        handle = common.load(args)
        note_chat_template(args, handle, "analyze")
        res = answer_experiment(handle, run, texts, settings, source=args.data)
        res.summary["settings"] = identity

        def write(staging: Path) -> list[str]:
            res.summary["runtime_s"] = round(time.perf_counter() - t_start, 3)
            out = common.Outputs(staging, args)
            out.tables(res.tables)
            res.summary["files"] = out.files + ["summary.json", "report.md"]
            out.json("summary.json", res.summary)
            return out.report("analyze", res.summary)

        def report(out, files) -> None:
            print(f"attngeom analyze: {len(texts)} prompt(s) answered -> {out}/ ({', '.join(files)})", file=sys.stderr)

        return write, report

    return common.run_command(args, "analyze", identity, work)


def _draw(out: common.Outputs, handle, res, args) -> None:
    """The maps and per-head grids of the figure layers (first window;
    :func:`attngeom.analysis.experiment.figure_maps`) and the per-layer sink figure, in
    ``--figure-format``, with a progress bar (a layer's maps take a few seconds)."""
    from tqdm.auto import tqdm

    from attngeom.analysis.experiment import figure_maps, map_window
    from attngeom.reports import analyze as rep

    fmt = common.figure_format(args)
    s = res.summary
    gen = s.get("generation")
    divider = gen["prompt_tokens"] if gen else None
    layers = s["figure_layers"] if map_window(res) is not None else []
    title = f"{handle.name}" + (" (first window)" if s["input"]["windows"] > 1 else "")
    heads = None if res.settings["heads"] == "all" else res.settings["heads"]
    with tqdm(total=len(layers) + 1, desc="figures", unit="figure", disable=args.no_progress, file=sys.stderr) as bar:
        for lt, tokens in figure_maps(handle, res):
            out.written(f"maps_layer{lt.index}.{fmt}",
                        lambda path: rep.draw_token_maps(lt, tokens, path, title=title, divider=divider))
            out.written(f"heads_layer{lt.index}.{fmt}",
                        lambda path: rep.draw_head_grid(lt, tokens, path, heads=heads, title=title, divider=divider))
            bar.update(1)
        out.written(f"sinks_per_layer.{fmt}", lambda path: rep.draw_sinks(res.tables["heads"], path, title=handle.name))
        bar.update(1)
