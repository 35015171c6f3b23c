"""``attngeom sinks``: attention sinks as active suppressors (SPEC §4).

The experiment is :func:`attngeom.sinks.experiment.experiment` (three passes per window: the unedited model
with :class:`~attngeom.sinks.reducer.SinkStats`, sink-norm removal, and the mass-matched control removal),
resumable from ``--out/checkpoint``. Writes to ``--out``:

- ``heads.parquet`` — one row per (layer, head): sink rate and contribution, factor decomposition
  sink vs tail, value-norm ratios, anti-alignment quantiles, quadratic fit of the sink-rate / output
  norm relation and its vertex, ``ρ*`` quantiles, semantic-drift measures, and the removal effects
  (``*_base``, ``*_removed``, ``*_control``).
- ``curve.parquet`` — queries binned by sink rate (mean output norm, ...); ``drift.parquet`` —
  queries binned by the normalised entropy of the non-sink attention; ``hist.parquet`` — histograms
  of ``cos(ṽ_0, m_i)``, ``cos(ṽ_0, ṽ_j)`` and ``ρ*``; ``removal.parquet`` — per (pass, layer, head)
  output norms and cone measures; ``ppl.parquet`` — perplexity of each pass.
- ``summary.json`` and the figures of :mod:`attngeom.reports.sinks`.
"""

from __future__ import annotations

import dataclasses
import sys

from attngeom.errors import InputError
from attngeom.commands import common

def add_parser(subparsers) -> None:
    from attngeom.sinks.settings import SinksSettings

    d = SinksSettings()
    p = subparsers.add_parser(
        "sinks", help="attention sinks: anti-alignment, convex sink-rate/output-norm relation, removal",
        description="Check the contribution-weights paper's claims about attention sinks on a model: "
                    "value-norm ratios, anti-alignment cos(v0, m_i), the convex sink-rate / output-norm "
                    "relation and its minimiser rho*, semantic drift, and sink-norm removal (output norms, "
                    "cone measure, delta PPL) beside a mass-matched control.")
    common.add_model_args(p)
    common.add_data_args(p)
    p.add_argument("--layers", default=None, help="layers analysed, e.g. 0,5,10 (default: all)")
    p.add_argument("--removal-layers", default=None,
                   help="layers where the sink (and the control source) is removed (default: all)")
    p.add_argument("--sink", type=int, default=d.sink, help="sink position (default %(default)s, the BOS token)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per forward pass (default %(default)s)")
    common.add_figure_args(p)
    common.add_progress_arg(p)
    common.add_out_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from attngeom.data.corpora import check_layers, load_windows, read_texts
    from attngeom.sinks.settings import SinksSettings
    from attngeom.sinks.experiment import TABLES, experiment, run_summary

    common.figure_format(args)
    common.check_at_least(args, window=3, max_windows=1, batch_size=1, sink=0, stride=1)
    if args.window is not None and args.sink >= args.window - 1:
        raise InputError(f"--sink {args.sink} leaves no query after it in windows of {args.window} tokens")
    layers = common.check_layer_list(args.layers)
    removal_layers = common.check_layer_list(args.removal_layers, "--removal-layers")
    fields = common.fields_of(args)
    if not args.data.startswith("hf:"):
        read_texts(args.data, fields)  # a missing, empty or malformed corpus fails before the model loads
    options = SinksSettings(sink=args.sink, layers=None if layers is None else tuple(layers),
                            removal_layers=None if removal_layers is None else tuple(removal_layers),
                            batch_size=args.batch_size)
    identity = common.run_identity(args, options, **common.corpus_identity(args, fields))

    def work(run):
        handle = common.load(args)
        checked = check_layers(layers, handle.num_layers)
        removal = check_layers(removal_layers, handle.num_layers)
        windows = load_windows(handle, args.data, args.window, args.stride, args.max_windows, fields)
        if all(len(w) <= args.sink + 1 for w in windows):
            raise InputError(f"no window is longer than the sink position {args.sink} + 1")
        res = experiment(handle, run, windows, dataclasses.replace(
            options, layers=None if checked is None else tuple(checked),
            removal_layers=None if removal is None else tuple(removal)))
        model_name = getattr(handle, "name", args.model)
        summary = run_summary(res, windows, model=model_name, data=args.data, window=args.window, identity=identity)

        def write(staging) -> list[str]:
            return common.write_outputs(staging, res.tables, TABLES, model_name, summary,
                                        None if args.no_figures else "sinks", args)

        def report(out, files) -> None:
            m = res.summary
            print(f"attngeom sinks: {model_name}: value-norm ratio (median) {_pct(m['value_norm_ratio'], '.3g')}, "
                  f"anti-aligned heads {_pct(m['anti_aligned_share'])}, interior rho* medians "
                  f"{_pct(m['interior_minimum_share'])}, delta PPL removal {_pct(m['removal_delta_ppl'], '+.3g')} / "
                  f"control {_pct(m['control_delta_ppl'], '+.3g')}; written to {out}", file=sys.stderr)

        return write, report

    return common.run_command(args, "sinks", identity, work)


def _pct(x, fmt: str = ".1%") -> str:
    return "n/a" if x is None else format(x, fmt)
