"""``attngeom explore``: one self-contained, offline HTML page to explore attention against
contribution for one text (``explore.html`` in ``--out``, with ``summary.json`` and a short
``report.md``; see docs/explore.md).

With no ``--text``/``--file`` it explores the built-in sample text (``make demo``). Bad input (empty
text, a missing or unreadable file, bad layers or options, an output directory holding another run)
fails with one line and exit status 2 before the model is loaded.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from attngeom.commands import common
from attngeom.commands.common import add_model_args, add_out_arg, add_text_args, check_at_least, check_layer_list, text_identity, text_input
from attngeom.commands.generation_args import add_generation_args, decoding_of, note_chat_template, prompt_of

DEFAULT_OUT = "out/explore"
PAGE = "explore.html"


def add_parser(subparsers) -> None:
    from attngeom.explorer.settings import ExploreSettings
    from attngeom.metrics import registry

    d = ExploreSettings()
    p = subparsers.add_parser(
        "explore",
        help="write an interactive, offline HTML explorer of attention vs contribution for one text",
        description="Run one text (default: the built-in sample) through the model and write explore.html "
                    "into --out: the text as tokens (hover or click one to see its sources by attention "
                    "beside contribution, and with --measure a third measure's, per head or for the whole layer), "
                    "a layers x heads grid, the "
                    "per-layer sink attention vs sink contribution and a contribution-flow graph. One file, "
                    "no network; open it from disk.")
    add_model_args(p)
    add_text_args(p, "explore")
    p.add_argument("--layers", default="all", help="layers to include: all (default) or a list, e.g. 0,5,29")
    p.add_argument("--top-k", type=int, default=d.top_k,
                   help="sources kept per (layer, head, query) beyond --exact-max-tokens (default %(default)s)")
    p.add_argument("--exact-max-tokens", type=int, default=d.exact_max_tokens,
                   help="keep every source (exact maps) up to this many tokens (default %(default)s)")
    p.add_argument("--sink", type=int, default=d.sink, help="position of the sink token (default %(default)s)")
    p.add_argument("--measure", default=d.measure, metavar="NAME",
                   help="a third list of sources beside attention and contribution: this measure's, per head or "
                        "for the whole layer (default: none); one of " + ", ".join(registry.names()) +
                        " (attngeom.metrics.registry; the layer-only ones have no per-head view)")
    add_generation_args(p)
    common.add_progress_arg(p)
    add_out_arg(p, default=DEFAULT_OUT)
    p.set_defaults(func=run)


def run(args) -> int:
    from attngeom.explorer.settings import ExploreSettings, check_measure

    t_start = time.perf_counter()
    # ---- everything that needs no model ----------------------------------------------------------
    layers = check_layer_list(args.layers)
    check_at_least(args, top_k=1, exact_max_tokens=0, sink=0)
    text, source = text_input(args, "explore")
    decoding = decoding_of(args)
    measure = check_measure(args.measure, generation=decoding is not None)
    prompt = prompt_of(args, text) if decoding else text
    options = ExploreSettings(top_k=args.top_k, exact_max_tokens=args.exact_max_tokens, sink=args.sink,
                              measure=measure, layers=None if layers is None else tuple(layers), decoding=decoding,
                              chat=args.chat, system=args.system)
    identity = common.run_identity(args, options, **text_identity(text, source))

    def work(run):
        from attngeom.explorer.data import build
        from attngeom.reports import explore as rep

        handle = common.load(args)
        note_chat_template(args, handle, "explore", prompt)
        # the input's checks against the model (layers, context length, sink position, a generation's
        # template and stop tokens) are the explorer's own
        data = build(handle, prompt, layers=options.layers, top_k=options.top_k,
                     exact_max_tokens=options.exact_max_tokens, sink=options.sink, decoding=decoding, chat=options.chat,
                     system=options.system, progress=decoding is not None and not args.no_progress, measure=measure)
        page = rep.render(data)

        def write(staging: Path) -> list[str]:
            out = common.Outputs(staging, args)
            out.text(PAGE, page)
            summary = rep.summary(data, identity, page_bytes=len(page.encode("utf-8")),
                                  runtime_s=round(time.perf_counter() - t_start, 3))
            summary["files"] = out.files + ["summary.json", "report.md"]
            out.json("summary.json", summary)
            return out.report("explore", summary, data.model_name)

        def report(out, files) -> None:
            size = len(page.encode("utf-8"))
            mode = ("exact maps" if data.exact else f"top-{data.top_k} sources") + \
                ("" if measure is None else f" (+ {measure})")
            print(f"attngeom explore: {data.T} tokens, {len(data.layers)} layer(s), {mode}, {size / 1e6:.1f} MB "
                  f"in {time.perf_counter() - t_start:.1f} s -> {out / PAGE}", file=sys.stderr)
            if data.exact and size > 50e6:
                print("attngeom explore: note: exact maps grow with layers x heads x T^2; for a smaller page use "
                      "--exact-max-tokens 0 (top-k sources) or fewer --layers", file=sys.stderr)

        return write, report

    return common.run_command(args, "explore", identity, work)
