"""``attngeom kvtasks``: long-context tasks under KV-cache compression, the field's way
(docs/kvcache.md, "Long-context tasks at compression ratios").

RULER's synthetic tasks (:mod:`attngeom.kvcache.ruler`) are made offline in the model's own tokens
(``--tasks``, ``--length``, ``--examples`` per task, ``--seed``, ``--haystack``), or read from a
JSONL file that an earlier run (or another tool) wrote (``--examples-file``). Each example's
context is compressed once after its prefill by every policy of ``--policies`` at every ratio of
``--ratios`` (:mod:`attngeom.kvcache.prefill`); the question and the greedy answer follow, and the
answer is scored by RULER's string match. Every example is one resumable unit in
``--out/checkpoint``. Writes to ``--out``:

- ``examples.jsonl`` — the examples, scorable by any other tool;
- ``answers.parquet`` — one row per (example, policy, ratio): the answer, its score, entries kept,
  cache bytes, seconds; the full cache as ``policy = full``, ``ratio = 0``;
- ``summary.parquet`` — accuracy per (task, policy, ratio) and over all tasks, with 95 % bootstrap
  intervals over examples;
- ``pairs.parquet`` — every policy against the best baseline at each ratio, paired;
- ``summary.json``, ``report.md`` and the figure of :mod:`attngeom.reports.kvtasks`.
"""

from __future__ import annotations

import sys

from attngeom.commands import common
from attngeom.errors import InputError
from attngeom.kvcache.settings import KVTaskInputs, KVTaskSettings


def add_parser(subparsers) -> None:
    s, d = KVTaskSettings(), KVTaskInputs()
    p = subparsers.add_parser(
        "kvtasks", help="long-context tasks (RULER) with the KV cache compressed once after the prefill, per ratio",
        description="Make RULER's synthetic long-context tasks in the model's tokens, compress each context's "
                    "KV cache once after its prefill under every policy at every compression ratio, decode the "
                    "question and the greedy answer, and report string-match accuracy with bootstrap intervals "
                    "over examples and paired differences against the best baseline.")
    common.add_model_args(p)
    p.add_argument("--tasks", default=",".join(d.tasks), help=f"comma-separated tasks (default {','.join(d.tasks)})")
    p.add_argument("--length", type=int, default=d.length, help=f"prompt tokens per example (default {d.length})")
    p.add_argument("--examples", type=int, default=d.examples, help=f"examples per task (default {d.examples})")
    p.add_argument("--first-example", type=int, default=d.first_example,
                   help="number of the first example of each task (default 0): runs from 0, 10, 20, ... answer "
                        "different examples, which tools/kvtasks_merge.py joins into one sample")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the examples (default {d.seed})")
    p.add_argument("--haystack", default=d.haystack,
                   help="the needle tasks' haystack: 'ruler' (RULER's for each task: the shipped essays, from "
                        "the Debian Administrator's Handbook, CC BY-SA 3.0, for niah_single_2/3, niah_multikey, "
                        "niah_multivalue and niah_multiquery, the noise for niah_single and variable_tracking), "
                        "'noise' (RULER's repeated sentences for every task) or a corpus file of real prose for "
                        f"every task (.txt/.jsonl/.csv/.parquet; default {d.haystack})")
    p.add_argument("--examples-file", default=None,
                   help="read the examples from this JSONL file (as written in examples.jsonl) instead of making them")
    p.add_argument("--policies", default=",".join(s.policies), help=f"comma-separated policies, or module:Class for a policy of your own (default {','.join(s.policies)})")
    p.add_argument("--ratios", default=",".join(map(str, s.ratios)),
                   help=f"compression ratios, shares of the cache removed (default {','.join(map(str, s.ratios))})")
    p.add_argument("--mode", choices=("question-agnostic", "query-aware"), default=s.mode,
                   help="question-agnostic: only the context is compressed (default); query-aware: the question too")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the chat template (default: when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="never apply a chat template")
    common.add_figure_args(p)
    common.add_progress_arg(p)
    common.add_out_arg(p)
    p.set_defaults(func=run)


def _names(spec: str, what: str) -> list[str]:
    names = list(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    if not names:
        raise InputError(f"--{what} names nothing")
    return names


def run(args) -> int:
    from attngeom.data.corpora import parse_float_list
    from attngeom.kvcache import ruler, tasks

    common.figure_format(args)
    common.check_at_least(args, length=64, examples=1, first_example=0)
    policies = tasks.check_policies(_names(args.policies, "policies"))
    ratios = tasks.check_ratios(sorted(set(parse_float_list(args.ratios, "--ratios"))))
    task_names = _names(args.tasks, "tasks")
    for t in task_names:
        if t not in ruler.TASKS:
            raise InputError(f"unknown task {t!r}; choose from {', '.join(ruler.TASKS)}")
    if args.examples_file is not None and args.first_example:
        raise InputError("--first-example numbers the examples kvtasks makes; an --examples-file brings its own")
    given = ruler.read_jsonl(args.examples_file) if args.examples_file is not None else None  # checked before the model loads
    haystack = args.haystack
    if haystack not in ("noise", ruler.RULER_HAYSTACK):
        from attngeom.data.corpora import read_texts

        haystack = read_texts(haystack)
    settings = KVTaskSettings(tuple(policies), tuple(ratios), args.mode, args.chat)
    source = common.data_identity(args.examples_file) if args.examples_file else \
        {"tasks": task_names, "length": args.length, "examples": args.examples, "seed": args.seed,
         **({"first_example": args.first_example} if args.first_example else {}),
         "haystack": "noise" if args.haystack == "noise" else
         {"ruler": "essays", "essay_sha256": ruler.essay_sha256()} if args.haystack == ruler.RULER_HAYSTACK else
         common.data_identity(args.haystack)}
    identity = common.run_identity(args, settings, **source)

    def work(run):
        from attngeom.kvcache.experiment import task_run_summary

        handle = common.load(args)
        if given is not None:
            examples = given
            length = max(tasks.prompt_tokens(handle.tokenizer, e) for e in examples)    # in this model's tokens
        else:
            tasks.check_length(handle, args.length, task_names, len(policies))           # before any is made
            examples = tasks.make_examples(handle.tokenizer, task_names, args.length, args.examples, args.seed,
                                           haystack, first=args.first_example)
            length = args.length
        result = tasks.experiment(handle, run, examples, settings)
        model_name = getattr(handle, "name", args.model)
        summary = task_run_summary(result, examples, model=model_name, length=length, identity=identity)
        chat = summary["chat_template"]

        def write(staging) -> list[str]:
            return common.write_outputs(staging, result.tables, ("answers", "summary", "pairs"), model_name, summary,
                                        None if args.no_figures else "kvtasks", args,
                                        before=lambda out: out.written("examples.jsonl",
                                                                       lambda path: ruler.write_jsonl(examples, path)))

        def report(out, files) -> None:
            rows = tasks.overall(result.tables["summary"])
            full = rows[rows["policy"] == "full"]["accuracy"]
            print(f"attngeom kvtasks: {model_name}: {len(examples)} examples ({'chat template' if chat else 'no chat template'}), "
                  f"{len(policies)} policies x {len(ratios)} ratios; full-cache accuracy "
                  f"{float(full.iloc[0]) if len(full) else float('nan'):.2f}; written to {out}", file=sys.stderr)

        return write, report

    return common.run_command(args, "kvtasks", identity, work)
