"""``attngeom analyze``: per-token and per-head summaries of one text, with maps and sink figures.

With no ``--text``/``--file`` it analyses the built-in sample text (:data:`attngeom.data.SAMPLE_TEXT`)
with the bundled model: that is ``make demo``.

Order of work (bad input fails before any compute): arguments are checked, the output directory is
created and proved writable, the input file is read, the model is loaded, the text is encoded and its
length checked against the model's context (longer inputs need ``--window``), then

1. one streaming pass (:func:`attngeom.trace.stream` with :class:`~attngeom.reducers.HeadStats` and
   :class:`~attngeom.reducers.TokenStats`) over all requested layers, keeping only summaries, so long
   inputs fit in memory;
2. for the figure layers only, and only when the (first) input window is at most
   ``--max-map-tokens`` long, a full :func:`attngeom.trace.analyze` to draw the maps.

Outputs in ``--out``: ``tokens.parquet``, ``heads.parquet``, ``summary.json``, ``maps_layer{L}.png``,
``heads_layer{L}.png``, ``sinks_per_layer.png`` and ``report.md``.

**Generation** (``--generate N``, docs/generation.md): the text is a prompt; the answer is generated
with :class:`~attngeom.generate.AnswerSources` observing every step and the summaries of 1. seeing
prompt + answer as a text (one stage ``generate``), then 2. draws its maps, and the answer tables
are written beside
(``answer_shares``, ``answer_sources``, ``answer_summary``). ``--data`` answers every prompt of a
file instead (corpus mode: ``answers.parquet`` and the answer tables).

**Windowing** (``--window N [--stride S]``): the input's tokens (BOS excluded) are cut into windows
of ``N-1`` tokens starting every ``S`` tokens (default ``S = N-1``: no overlap), each window gets the
BOS token (the sink) in front and is analysed as a text of its own. The last window ends at the last
token (it may be shorter). ``tokens.parquet`` then has one row per (window, layer, position), with
``text`` = the window's index and ``input_position`` = the token's position in the whole input
(BOS = 0); ``heads.parquet`` averages over the queries of all windows; maps show the first window.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..analysis import TOP_K, add_input_positions, cut_windows, summarize
from ..errors import InputError
from . import common
from .common import (add_model_args, add_out_arg, add_text_args, already_complete, check_at_least, check_layer_list,
                     model_identity, open_run, text_identity, text_input, write_json, write_parquet)
from .generation_args import add_generation_args, decoding_of, prompt_of, settings_of

if TYPE_CHECKING:
    from ..experiment import ModelHandleLike, RunLike

DEFAULT_OUT = "out/analyze"


def add_parser(subparsers) -> None:
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
    p.add_argument("--window", type=int, default=None,
                   help="analyse an input longer than the model's context in windows of this many tokens "
                        "(BOS included); default: such inputs are refused")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts with --window (default: window-1, no overlap)")
    p.add_argument("--sink", type=int, default=0, help="position of the sink token (default 0)")
    p.add_argument("--max-map-tokens", type=int, default=2048,
                   help="draw maps only when the (first) input window has at most this many tokens (default 2048)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_generation_args(p)
    g = p.add_argument_group("corpus mode (with --generate: answer every prompt of a file)")
    g.add_argument("--data", default=None,
                   help="prompts: a .jsonl/.csv/.parquet file (with --fields), a text file or hf:NAME; each is "
                        "answered and analysed (answers.parquet and the answer tables, one row set per prompt)")
    g.add_argument("--fields", default=None, help="the prompt's field(s) of --data, e.g. prompt")
    g.add_argument("--max-prompts", type=int, default=None, help="answer only the first N prompts of --data")
    add_out_arg(p, default=DEFAULT_OUT)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _pick_figure_layers(layers: list[int]) -> list[int]:
    if len(layers) <= 3:
        return list(layers)
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]})


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def run(args) -> int:
    from ..data import parse_int_list

    t_start = time.perf_counter()
    # ---- everything that needs no model, before loading it ---------------------------------
    layers = check_layer_list(args.layers)
    fig_layers = check_layer_list(args.figure_layers, "--figure-layers") if args.figure_layers else None
    heads = parse_int_list(args.heads, "--heads")
    if heads is not None and not heads:
        raise InputError("--heads names no head")
    check_at_least(args, window=3, stride=1, sink=0, max_map_tokens=0)
    if args.stride is not None and args.window is None:
        raise InputError("--stride needs --window")
    if args.data is not None or args.fields is not None or args.max_prompts is not None:
        return _run_corpus(args, layers, t_start)
    text, source = text_input(args, "analyse")
    decoding = decoding_of(args)
    prompt = prompt_of(args, text) if decoding else text
    settings = {**model_identity(args), **text_identity(text, source), "layers": "all" if layers is None else sorted(set(layers)),
                "figure_layers": fig_layers, "heads": "all" if heads is None else sorted(set(heads)),
                "window": args.window, "stride": args.stride, "sink": args.sink,
                "max_map_tokens": args.max_map_tokens, **settings_of(decoding, args)}
    with open_run(args, "analyze", settings) as run:
        if already_complete(run, "analyze"):
            return 0
        return _run(args, run, settings, prompt, source, layers, fig_layers, heads, t_start, decoding)


def _run_corpus(args, layers, t_start) -> int:
    """Corpus mode: every prompt of ``--data`` answered with analysis, as stage ``generate`` of the
    run (one record per prompt: resumable, shared among ``torchrun`` processes)."""
    from ..data import check_layers, resolve_texts
    from .common import data_identity, fields_of

    if args.data is None:
        raise InputError("--fields and --max-prompts go with --data")
    if args.text is not None or args.file is not None:
        raise InputError("--data replaces --text/--file; give one of them")
    decoding = decoding_of(args)
    if decoding is None:
        raise InputError("--data needs --generate N (corpus mode answers every prompt)")
    check_at_least(args, max_prompts=1)
    fields = fields_of(args)
    settings = {**model_identity(args), **data_identity(args.data), "fields": fields, "max_prompts": args.max_prompts,
                "layers": "all" if layers is None else sorted(set(layers)), "sink": args.sink,
                **settings_of(decoding, args)}
    with open_run(args, "analyze", settings) as run:
        if already_complete(run, "analyze"):
            return 0
        texts = resolve_texts(args.data, fields)[: args.max_prompts]
        if not texts:
            raise InputError(f"{args.data} holds no prompt")
        handle = common.load(args)
        layers = sorted(set(check_layers(layers, handle.num_layers) or range(handle.num_layers)))
        tables = _answer_prompts(handle, run, args, texts, decoding, layers)

        def write(staging: Path) -> list[str]:
            files = []
            for name, df in tables.items():
                write_parquet(df, staging / f"{name}.parquet")
                files.append(f"{name}.parquet")
            answers = tables["answers"]
            summary = {"command": "analyze", "mode": "corpus", "settings": settings, "prompts": len(texts),
                       "answer_tokens": int(answers["answer_tokens"].sum()),
                       "stopped_on_stop_token": int(answers["stopped"].sum()),
                       "runtime_s": round(time.perf_counter() - t_start, 3), "files": files + ["summary.json"]}
            write_json(staging / "summary.json", summary)
            return summary["files"]

        files = run.finish(write)
    print(f"attngeom analyze: {len(texts)} prompt(s) answered -> {run.out}/ ({', '.join(files)})", file=sys.stderr)
    return 0


def _answer_prompts(handle: ModelHandleLike, run: RunLike, args, texts, decoding, layers) -> dict:
    """``answers`` (one row per prompt: its text, the answer's text and ids) and the answer tables
    of :class:`~attngeom.generate.AnswerSources` for every prompt (column ``text``: its index)."""
    from ..generate import AnswerSources, Answers, generation_stage, prompt_ids

    stop = decoding.stop_ids(handle)
    prompts = []
    for k, t in enumerate(texts):
        try:
            prompts.append(prompt_ids(handle, t, chat=args.chat, system=args.system, stop=stop))
        except InputError as e:
            raise InputError(f"prompt {k + 1} of {args.data}: {e}") from None
        if args.sink >= len(prompts[-1]):
            raise InputError(f"prompt {k + 1} of {args.data}: --sink {args.sink} is beyond it "
                             f"({len(prompts[-1])} tokens)")
    answers, sources = generation_stage(
        handle, run, "generate", prompts, decoding, layers=layers, desc="generate",
        make=lambda: [Answers(stop), AnswerSources(sink=args.sink)])
    answers = answers.result().sort_values("text", kind="stable").reset_index(drop=True)
    answers.insert(1, "prompt", [texts[k] for k in answers["text"]])
    answers["answer_text"] = [handle.tokenizer.decode([int(x) for x in str(a).split()]) for a in answers["answer_ids"]]
    tables = {"answers": answers, **{f"answer_{k}": v for k, v in sources.result().items()}}
    ids = {int(x) for p in prompts for x in p} | {int(x) for a in answers["answer_ids"] for x in str(a).split()}
    return _with_token_strings(handle, tables, ids)


def _with_token_strings(handle: ModelHandleLike, tables: dict, ids) -> dict:
    """Each table's ``token_id``/``source_id`` column followed by the token's string."""
    ids = sorted(set(ids))
    strings = dict(zip(ids, handle.tokens(ids)))
    for df in tables.values():
        for col, name in (("token_id", "token"), ("source_id", "source_token")):
            if col in df:
                df.insert(df.columns.get_loc(col) + 1, name, df[col].map(strings))
    return tables


def _run(args, run: RunLike, settings, text, source, layers, fig_layers, heads, t_start, decoding=None) -> int:
    from ..data import check_layers

    # ---- the model and the input ------------------------------------------------------------
    t0 = time.perf_counter()
    handle = common.load(args)
    t_load = time.perf_counter() - t0
    L, H = handle.num_layers, handle.num_heads
    layers = sorted(set(check_layers(layers, L) or range(L)))
    fig_layers = sorted(set(check_layers(fig_layers, L))) if fig_layers is not None else _pick_figure_layers(layers)
    if heads is not None:
        bad = [h for h in heads if not 0 <= h < H]
        if bad:
            raise InputError(f"head {bad[0]} does not exist: the model has heads 0..{H - 1}")
        heads = sorted(set(heads))
    answer = None
    if decoding is not None:
        answer = _generate(handle, run, args, text, decoding, layers)
        ids = answer["ids"]
    else:
        ids = handle.encode(text)
    limit = handle.max_positions
    if args.window is not None:
        if limit and args.window > limit:
            raise InputError(f"--window {args.window} is longer than the model's context ({limit} tokens)")
        windows, has_bos = cut_windows(ids, args.window, args.stride, handle.tokenizer.bos_token_id)
    else:
        if limit and len(ids) > limit:
            raise InputError(
                f"the input has {len(ids)} tokens but {handle.name} handles at most {limit}; "
                f"analyse it in windows with --window {limit} (and optionally --stride)")
        windows, has_bos = [(0, ids)], False
    if not windows or min(len(w) for _, w in windows) < 2:
        raise InputError(f"the input has {len(ids)} token(s) after encoding; give a text of at least 2 tokens "
                         "(a single token has no source to attend to but itself)")
    if args.sink >= min(len(w) for _, w in windows):
        raise InputError(f"--sink {args.sink} is beyond the input ({min(len(w) for _, w in windows)} tokens)")


    # ---- 1. streaming pass: per-head and per-token summaries ---------------------------------
    from ..stages import summaries

    if answer is not None:
        heads_df, tokens_df = answer["heads"], answer["tokens"]
    else:
        heads_df, tokens_df = summaries(handle, run, [w for _, w in windows], layers=layers, sink=args.sink)
    _with_token_strings(handle, {"tokens": tokens_df}, ids)
    add_input_positions(tokens_df, windows, has_bos)
    summary = build_summary(handle, args, source, ids, windows, layers, fig_layers, heads_df, tokens_df)
    summary["settings"] = settings
    if answer is not None:
        tokens_df["generated"] = tokens_df["position"] >= answer["prompt_length"]
        summary["generation"] = generation_summary(handle, answer, decoding, args.sink)
    first = windows[0][1]
    draw_maps = len(first) <= args.max_map_tokens and bool(fig_layers)
    summary["maps"] = (f"drawn for layers {fig_layers}" if draw_maps else
                       f"maps not drawn: the input window has {len(first)} tokens, more than --max-map-tokens "
                       f"{args.max_map_tokens}" if fig_layers else "no figure layers")
    if fig_layers and not draw_maps:
        print(f"attngeom analyze: {summary['maps']}", file=sys.stderr)

    def write(staging: Path) -> list[str]:
        from .. import trace as tr
        from ..reports import analyze as rep

        files = ["tokens.parquet", "heads.parquet"]
        write_parquet(tokens_df, staging / "tokens.parquet")
        write_parquet(heads_df, staging / "heads.parquet")
        if answer is not None:
            for name, df in answer["tables"].items():
                write_parquet(df, staging / f"answer_{name}.parquet")
                files.append(f"answer_{name}.parquet")
        # ---- 2. maps of the figure layers (full trace, first window only) -------------------------
        t0 = time.perf_counter()
        if draw_maps:
            trace = tr.analyze(handle, first, layers=fig_layers)
            title = f"{handle.name}" + (" (first window)" if len(windows) > 1 else "")
            for k, lt in enumerate(trace.layers):
                files.append(rep.draw_token_maps(lt, trace.tokens, staging / f"maps_layer{lt.index}.png", title=title))
                files.append(rep.draw_head_grid(lt, trace.tokens, staging / f"heads_layer{lt.index}.png",
                                                heads=heads, title=title))
                trace.layers[k] = None  # free this layer's maps before the next one
            del trace
        files.append(rep.draw_sinks(heads_df, staging / "sinks_per_layer.png", title=handle.name))
        files = [Path(f).name for f in files]
        summary["runtime_s"] = {"total": round(time.perf_counter() - t_start, 3), "load_model": round(t_load, 3),
                                "maps_and_figures": round(time.perf_counter() - t0, 3)}
        files += ["summary.json", "report.md"]
        summary["files"] = list(files)
        write_json(staging / "summary.json", summary)
        (staging / "report.md").write_text(rep.report_markdown(summary), encoding="utf-8")
        return files

    files = run.finish(write)
    print(f"attngeom analyze: {len(ids)} tokens, {len(layers)} layer(s) -> {run.out}/ ({', '.join(files)})",
          file=sys.stderr)
    return 0


def _generate(handle: ModelHandleLike, run: RunLike, args, prompt, decoding, layers) -> dict:
    """Generate the answer with the answer tables observing every step and the per-head and
    per-token summaries seeing prompt + answer as a text (text reducers of
    :func:`attngeom.generate.stream`: the same rows, one call for the answer instead of one per
    token), as stage ``generate`` of the run (one record, resumable). Returns the prompt + answer
    ids, the summaries and the answer tables (with token strings)."""
    from ..generate import AnswerSources, Answers, generation_stage, prompt_ids
    from ..reducers import HeadStats, TokenStats

    stop = decoding.stop_ids(handle)
    ids = prompt_ids(handle, prompt, chat=args.chat, system=args.system, stop=stop)
    if args.sink >= len(ids):
        raise InputError(f"--sink {args.sink} is beyond the prompt ({len(ids)} tokens)")
    tables, answers, heads, tokens = generation_stage(
        handle, run, "generate", [ids], decoding, layers=layers, desc="generate", text=2,
        make=lambda: [AnswerSources(sink=args.sink), Answers(stop),
                      HeadStats(sink=args.sink), TokenStats(sink=args.sink)])
    row = answers.result().iloc[0]
    answer_ids = [int(x) for x in str(row["answer_ids"]).split()]
    full = list(ids) + answer_ids
    tables = _with_token_strings(handle, tables.result(), full)
    return {"ids": full, "prompt_length": len(ids), "answer_ids": answer_ids, "stopped": bool(row["stopped"]),
            "heads": heads.result(), "tokens": tokens.result(), "tables": tables}


def generation_summary(handle: ModelHandleLike, answer: dict, decoding, sink: int = 0) -> dict:
    """summary.json's ``generation``: the answer, how it was decoded, and for the model (mean of the
    layers) where its tokens' contribution came from and the prompt tokens (the sink aside) the whole
    answer drew on."""
    tables = answer["tables"]
    shares = tables["shares"][tables["shares"]["layer"].isna()]
    summ = tables["summary"][tables["summary"]["layer"].isna()]
    summ = summ[summ["position"] != sink]                  # the sink has its own share
    top = summ.sort_values(["contribution", "position"], ascending=[False, True], kind="stable").head(TOP_K)
    return {
        "prompt_tokens": answer["prompt_length"], "answer_tokens": len(answer["answer_ids"]),
        "answer_text": handle.tokenizer.decode(answer["answer_ids"]), "stopped_on_stop_token": answer["stopped"],
        "decoding": {"max_new_tokens": decoding.max_new_tokens, "sample": decoding.sample,
                     "temperature": decoding.temperature, "top_p": decoding.top_p,
                     "seed": decoding.seed if decoding.seed is not None else (0 if decoding.sample else None),
                     "stop_ids": list(decoding.stop_ids(handle))},
        "mean_contribution_share": {part: float(shares[f"contribution_{part}"].mean())
                                    for part in ("sink", "prompt", "answer")},
        "prompt_tokens_the_answer_drew_on": [
            {"position": int(r.position), "token": r.token, "contribution": float(r.contribution),
             "attention": float(r.attention)} for r in top.itertuples()],
    }


def build_summary(handle: ModelHandleLike, args, source, ids, windows, layers, fig_layers, heads_df, tokens_df) -> dict:
    from .. import __version__

    return {
        "command": "analyze",
        "attngeom_version": __version__,
        "model": {"name": handle.name, "spec": args.model, "architecture": handle.architecture,
                  "layers": handle.num_layers, "heads": handle.num_heads, "kv_heads": handle.num_kv_heads,
                  # attention layer l is decoder layer decoder_layers[l] (they differ in hybrid models)
                  "decoder_layers": getattr(getattr(handle, "adapter", None), "decoder_index", None),
                  "head_dim": handle.head_dim, "dtype": str(handle.dtype).removeprefix("torch."),
                  "device": str(handle.device), "max_positions": handle.max_positions},
        "input": {"source": source, "tokens": len(ids),
                  "windows": len(windows), "window": args.window, "stride": args.stride if args.window else None,
                  "window_lengths": [len(w) for _, w in windows][:50]},
        "T": len(ids),
        "sink": args.sink,
        "layers": layers,
        "figure_layers": fig_layers,
        **summarize(heads_df, tokens_df, [len(w) for _, w in windows], layers),
        "definitions": {
            "sink_attention": "mean over heads of the per-head mean over queries i>0 of a_i0^h",
            "sink_contribution": "mean over heads of the per-head mean over queries i>0 of c_i0^h (intra-head)",
            "sink_contribution_to_layer_output": "sum over heads of the mean over queries i>0 of C_i0^h "
                                                 "(the sink's share of the layer output o_i)",
            "*_received": "token-level score of SPEC §2 a source receives, averaged over the queries that see it",
        },
    }
