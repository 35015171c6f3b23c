"""``attngeom claims``: every claim of the two papers scored on one model, with bootstrap intervals.

Reduced runs of the faithfulness, sinks, selection and heads experiments on the same windows
(:mod:`attngeom.claims.experiment`), one record per window so that a seeded bootstrap over windows (``--bootstrap``
resamples, default 1000) gives a 95 % interval for every number. Resumable from ``--out/checkpoint``.
Writes to ``--out``: ``claims.md`` (one row per claim: measured value, interval, verdict; the rules;
the numbers behind each verdict) and ``claims.json`` (the same rows and every interval).
"""

from __future__ import annotations

import sys
import time

from attngeom.errors import InputError
from attngeom.commands import common

ANALYSES = ("faithfulness", "rivals", "sinks", "selection", "heads")
"""The reduced experiments of ``attngeom claims``, in the order they run (``--skip``)."""


def add_parser(subparsers) -> None:
    from attngeom.claims.settings import ClaimsSettings

    DEFAULTS = ClaimsSettings()

    p = subparsers.add_parser(
        "claims", help="score every claim of the two papers on a model, with bootstrap intervals",
        description="Run reduced versions of all analyses (faithfulness, sinks, selection, head taxonomy and "
                    "removal) on the same windows and score each claim of the two papers: measured value, 95% "
                    "bootstrap interval over windows, and a verdict (holds / refuted / inconclusive; rules in "
                    "docs/claims.md).")
    common.add_model_args(p)
    common.add_data_args(p, window=DEFAULTS.window, max_windows=DEFAULTS.max_windows)
    p.add_argument("--calib-windows", type=int, default=DEFAULTS.calib_windows,
                   help="first windows used as the head-removal calibration split (default %(default)s); the "
                        "single-head removal reads each of them once per head (layers x heads passes per "
                        "window: 270 for SmolLM2-135M, most of a default run's time), and claim 16 rests on "
                        "these windows alone: below 10 of them (the default 2) its verdict is 'too few windows'; "
                        "--calib-windows 10 --max-windows 20 gives every claim a verdict (about 3x the default "
                        "run's time)")
    p.add_argument("--skip", default="",
                   help="analyses left out, comma-separated, from " + ", ".join(ANALYSES) + "; by default none is. "
                        "Cost per window: faithfulness 1 + 2 x 5 rankings x ratios forward passes (claims 1-4; "
                        "91 by default), rivals 2 x 6 rankings x ratios more (the head-to-head with leave-one-out, "
                        "value zeroing, ALTI, gradient x attention and the two rollouts, claims 17-28; 108 by "
                        "default, and a backward pass and two forwards per window), sinks 3 (claims 5-10), selection 1 (claims 11-12), heads the taxonomy "
                        "pass, a pass per removal order and retention, and the single-head removal on the "
                        "calibration windows (claims 13-16)")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in DEFAULTS.ratios),
                   help="faithfulness removal ratios (default %(default)s)")
    p.add_argument("--per-head", action="store_true",
                   help="rank the faithfulness interventions per head (each head masks its own top or bottom "
                        "sources) instead of per token; the head-to-head then leaves out the measures defined "
                        "on the layer only")
    p.add_argument("--rivals", default=None,
                   help="the published measures of the head-to-head rows, comma-separated (default: all, "
                        "from attngeom.metrics.registry.rivals)")
    p.add_argument("--seeds", default=",".join(str(s) for s in DEFAULTS.seeds),
                   help="seeds of the random ranking (default %(default)s)")
    p.add_argument("--ns", default=",".join(str(n) for n in DEFAULTS.ns),
                   help="selection sizes N (default %(default)s)")
    p.add_argument("--repeats", type=int, default=DEFAULTS.repeats,
                   help=f"random subsets per N (default {DEFAULTS.repeats})")
    p.add_argument("--retentions", default=",".join(f"{r:g}" for r in DEFAULTS.retentions),
                   help="percent of heads kept (default %(default)s)")
    p.add_argument("--fixed-order", default=",".join(DEFAULTS.fixed_order),
                   help="the a-priori regime removal order compared with the calibrated one (default %(default)s)")
    p.add_argument("--bootstrap", type=int, default=DEFAULTS.n_resamples,
                   help=f"bootstrap resamples (at least 100; default {DEFAULTS.n_resamples})")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of the bootstrap and the random controls")
    common.add_progress_arg(p)
    common.add_out_arg(p)
    p.set_defaults(func=run)


def check_args(args) -> dict:
    """Everything that needs no model; returns the parsed lists."""
    from attngeom.data.corpora import parse_float_list, parse_int_list, read_texts
    from attngeom.faithfulness.experiment import check_mask_ratios
    from attngeom.heads.experiment import check_retentions
    from attngeom.heads.taxonomy import REGIMES

    common.check_at_least(args, window=8, max_windows=4, calib_windows=2, stride=1, repeats=1, bootstrap=100)
    if args.max_windows <= args.calib_windows + 1:
        raise InputError(f"--max-windows {args.max_windows} leaves fewer than 2 held-out windows after "
                         f"--calib-windows {args.calib_windows}")
    ratios = check_mask_ratios(parse_float_list(args.ratios, "--ratios"))
    seeds = parse_int_list(args.seeds, "--seeds")
    if not seeds:
        raise InputError("--seeds names no seed")
    ns = parse_int_list(args.ns, "--ns")
    if not ns or any(n < 1 or n >= args.window - 1 for n in ns):
        raise InputError(f"--ns must be sizes in 1..{args.window - 2}")
    retentions = check_retentions(parse_float_list(args.retentions, "--retentions"))
    order = [x.strip() for x in args.fixed_order.split(",") if x.strip()]
    if sorted(order) != sorted(REGIMES):
        raise InputError(f"--fixed-order must list {', '.join(REGIMES)} once each, got {args.fixed_order!r}")
    if not args.data.startswith("hf:"):
        read_texts(args.data, common.fields_of(args))
    skip = [x.strip() for x in args.skip.split(",") if x.strip()]
    unknown = sorted(set(skip) - set(ANALYSES))
    if unknown:
        raise InputError(f"--skip: unknown analysis {unknown[0]!r}; known: {', '.join(ANALYSES)}")
    if set(skip) >= set(ANALYSES):
        raise InputError("--skip leaves no analysis to run")
    rivals = None
    if args.rivals is not None:
        from attngeom.metrics import registry

        rivals = [x.strip() for x in args.rivals.split(",") if x.strip()]
        known = registry.rivals()
        if not rivals:
            raise InputError(f"--rivals names no measure; name one or more of {', '.join(known)}")
        bad = [x for x in rivals if x not in known]
        if bad or len(set(rivals)) != len(rivals):
            raise InputError(f"--rivals: {'unknown measure ' + repr(bad[0]) if bad else 'name each measure once'}; "
                             f"known: {', '.join(known)}")
        if "rivals" in skip:
            raise InputError("--rivals names the measures of the head-to-head, which --skip rivals leaves out")
        if getattr(args, "per_head", False) and all(registry.get(x).layer_only for x in rivals):
            raise InputError("--per-head: every measure of --rivals is defined on the layer only (no per-head ranking)")
    return {"skip": [a for a in ANALYSES if a in skip], "rivals": rivals, "ratios": ratios, "seeds": sorted(set(seeds)), "ns": sorted(set(ns)), "retentions": retentions,
            "fixed_order": order}


def run(args) -> int:
    from attngeom.claims.experiment import experiment
    from attngeom.claims.settings import ClaimsSettings as Settings
    from attngeom.data.corpora import load_windows
    from attngeom.runs.storage import clean_json
    from attngeom.reports.claims import rerender

    opts = check_args(args)
    fields = common.fields_of(args)
    options = Settings(window=args.window, max_windows=args.max_windows, calib_windows=args.calib_windows,
                       ratios=tuple(opts["ratios"]), seeds=tuple(opts["seeds"]), ns=tuple(opts["ns"]),
                       repeats=args.repeats, retentions=tuple(opts["retentions"]),
                       fixed_order=tuple(opts["fixed_order"]), n_resamples=args.bootstrap, seed=args.seed,
                       per_head=args.per_head, rivals=None if opts["rivals"] is None else tuple(opts["rivals"]))
    analyses = [a for a in ANALYSES if a not in opts["skip"]]
    settings = common.run_identity(args, options, **common.corpus_identity(args, fields), skip=opts["skip"])
    t0 = time.time()

    def work(run):
        handle = common.load(args)
        windows = load_windows(handle, args.data, args.window, args.stride, args.max_windows, fields)
        if len(windows) <= args.calib_windows + 1:
            raise InputError(f"{args.data} gives {len(windows)} window(s) of {args.window} tokens: not enough for "
                             f"{args.calib_windows} calibration and 2 held-out windows")
        res = experiment(handle, run, windows, options, analyses=analyses)
        model_name = getattr(handle, "name", args.model)
        seconds = time.time() - t0
        out = {"command": "claims", "model": model_name, "data": args.data, "window": args.window,
               "seconds_this_invocation": round(seconds, 1), **res.summary, "settings_run": settings}

        def write(staging) -> list[str]:
            stored = clean_json(out)
            files = common.Outputs(staging, args)
            files.text("claims.md", rerender(stored))      # claims.md from claims.json alone
            files.json("claims.json", stored)
            return files.report("claims", {**res.summary, "data": args.data, "window": args.window}, model_name)

        def report(out_dir, files) -> None:
            counts = {}
            for r in res.summary["rows"]:
                counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
            print(f"attngeom claims: {model_name}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
                  + f"; {seconds:.0f} s; written to {out_dir}", file=sys.stderr)

        return write, report

    return common.run_command(args, "claims", settings, work)
