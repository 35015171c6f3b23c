"""``attngeom kvcache``: language modelling under a KV-cache budget, policy by policy.

The experiment is :func:`attngeom.kvcache.experiment.experiment`: each window of ``--data`` is read (:mod:`attngeom.kvcache.evaluation`) with the compressed cache of :mod:`attngeom.kvcache.cache` under every
policy of ``--policies`` (:mod:`attngeom.kvcache.policies`) and every budget of ``--budgets`` (entries per
key/value head), ``--chunk`` tokens per forward pass (1: token by token, the reference); every
(window, policy, budget) is one resumable unit in ``--out/checkpoint``. The ``taxonomy`` policy's
per-head budgets come from the head taxonomy of ``--calibration-windows`` further windows of the
corpus (disjoint from the evaluated ones). Writes to ``--out``:

- ``reads.parquet`` — one row per (policy, budget, window): ``nll``, ``tokens``, ``ppl``, ``seconds``,
  ``seconds_per_token``, ``peak_bytes`` (largest cache storage measured after a forward pass);
  the full cache is read once per window and its row repeated for every budget;
- ``summary.parquet`` — per (policy, budget): perplexity with its 95 % bootstrap interval over
  windows, the difference to the full cache (paired resamples), memory saved, time per token ratio;
- with ``--answers`` (records with a prompt and a reference continuation): ``answers.parquet`` — one
  row per (policy, budget, example): the reference's NLL read after the compressed prompt, the
  greedy tokens and their agreement with the full cache's (``match``, ``first_divergence``);
  ``answers-summary.parquet`` — means with 95 % bootstrap intervals over examples;
- ``pairs.parquet`` — every pair of policies per budget on the same resamples: the perplexity
  difference with its 95 % interval and the share of resamples where the first is better;
- ``regimes.parquet`` (with ``taxonomy``) — the calibration taxonomy;
- ``summary.json`` and the figures of :mod:`attngeom.reports.kvcache`.
"""

from __future__ import annotations

import sys

from attngeom.errors import InputError
from attngeom.kvcache.settings import KVCacheInputs, KVCacheSettings
from attngeom.commands import common

DEFAULT_POLICIES = ",".join(KVCacheSettings().policies)
DEFAULT_BUDGETS = ",".join(map(str, KVCacheSettings().budgets))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "kvcache", help="KV-cache eviction policies (attention, value-aware, contribution, taxonomy) under budgets",
        description="Read long texts with a compressed KV cache (at most BUDGET entries per key/value head) "
                    "under each policy and report perplexity against the full cache, with bootstrap intervals, "
                    "the memory saved and the time per token.")
    common.add_model_args(p)
    d = KVCacheInputs()
    common.add_data_args(p, window=d.window, max_windows=d.max_windows)
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated policies, or module:Class for a policy of your own (default {DEFAULT_POLICIES})")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS,
                   help=f"entries per key/value head, e.g. 64,256 (default {DEFAULT_BUDGETS})")
    p.add_argument("--chunk", type=int, default=KVCacheSettings().chunk,
                   help="tokens per forward pass, eviction between passes (default 1: token by token)")
    p.add_argument("--calibration-windows", type=int, default=d.calibration_windows,
                   help="windows after the evaluated ones for the taxonomy policy's head regimes (default %(default)s)")
    p.add_argument("--answers", default=None,
                   help="also evaluate answers under a budget: a .jsonl/.csv/.parquet file of prompts with "
                        "reference continuations")
    p.add_argument("--prompt-field", default="prompt", help="the prompt's field in --answers (default prompt)")
    p.add_argument("--reference-field", default="reference",
                   help="the reference continuation's field in --answers (default reference)")
    p.add_argument("--max-examples", type=int, default=d.max_examples,
                   help="examples of --answers to use (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens,
                   help="greedy tokens generated per example (default %(default)s)")
    common.add_figure_args(p)
    common.add_progress_arg(p)
    common.add_out_arg(p)
    p.set_defaults(func=run)


def _policies(spec: str) -> list[str]:
    from attngeom.kvcache.policies import get_policy

    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise InputError("--policies names no policy")
    return list(dict.fromkeys(get_policy(n).name for n in names))     # module:Class: the name it registers


def run(args) -> int:
    from attngeom.data.corpora import load_windows, parse_int_list, read_texts
    from attngeom.kvcache.policies import needs_regimes

    common.figure_format(args)
    common.check_at_least(args, window=3, max_windows=1, stride=1, chunk=1, calibration_windows=1, max_examples=1,
                          new_tokens=1)
    policies = _policies(args.policies)
    budgets = sorted(set(parse_int_list(args.budgets, "--budgets") or []))
    if not budgets:
        raise InputError("--budgets names no budget")
    if min(budgets) < 1:
        raise InputError(f"--budgets: a budget is a number of cache entries, at least 1; got {min(budgets)}")
    if min(budgets) <= args.chunk:
        raise InputError(f"--chunk {args.chunk} must be smaller than every budget (smallest {min(budgets)})")
    fields = common.fields_of(args)
    if not args.data.startswith("hf:"):
        read_texts(args.data, fields)
    qa_pairs = _answer_texts(args) if args.answers else None
    calib_n = args.calibration_windows if needs_regimes(policies) else 0
    settings = KVCacheSettings(tuple(policies), tuple(budgets), args.chunk)
    inputs = {**common.corpus_identity(args, fields), "calibration_windows": calib_n}
    if args.answers:
        inputs.update({"answers": common.data_identity(args.answers), "prompt_field": args.prompt_field,
                       "reference_field": args.reference_field, "max_examples": args.max_examples,
                       "new_tokens": args.new_tokens})
    identity = common.run_identity(args, settings, **inputs)

    def work(run):
        from attngeom.kvcache.experiment import experiment, run_summary

        handle = common.load(args)
        windows = load_windows(handle, args.data, args.window, args.stride, args.max_windows + calib_n, fields)
        evaluated = windows[: args.max_windows]
        result = experiment(handle, run, evaluated, settings, calibration=windows[args.max_windows:], answers=qa_pairs,
                            new_tokens=args.new_tokens)
        model_name = getattr(handle, "name", args.model)
        summary = run_summary(result, evaluated, model=model_name, data=args.data, window=args.window,
                              identity=identity)

        def write(staging) -> list[str]:
            return common.write_outputs(staging, result.tables, None, None, summary,
                                        None if args.no_figures else "kvcache", args)

        def report(out, files) -> None:
            rows = result.tables["summary"]
            best = rows[rows["policy"] != "full"].sort_values("ppl").head(1)
            note = "" if best.empty else f"; lowest perplexity {best['policy'].iloc[0]} at budget {int(best['budget'].iloc[0])}"
            print(f"attngeom kvcache: {model_name}: {len(evaluated)} windows, {len(policies)} policies x "
                  f"{len(budgets)} budgets{note}; written to {out}", file=sys.stderr)

        return write, report

    return common.run_command(args, "kvcache", identity, work)


def _answer_texts(args) -> list[tuple[str, str]]:
    """(prompt, reference) texts of ``--answers`` (checked before the model loads)."""
    from attngeom.data.corpora import read_texts

    prompts = read_texts(args.answers, [args.prompt_field])
    refs = read_texts(args.answers, [args.reference_field])
    if len(prompts) != len(refs):
        raise InputError(f"{args.answers}: {len(prompts)} non-empty {args.prompt_field!r} but {len(refs)} non-empty "
                         f"{args.reference_field!r} fields; every record needs both")
    return list(zip(prompts, refs))[: args.max_examples]
