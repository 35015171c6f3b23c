#!/usr/bin/env python
"""Markdown tables of an ``attngeom kvtasks`` run (its ``summary.json`` and ``pairs.parquet``): the
accuracy of every policy at every compression ratio over all tasks with 95 % intervals, each
geometry policy against the best baseline at each ratio (paired difference, interval, verdict),
the accuracy per task, the tasks whose full-cache accuracy is below the floor (marked †) and
RULER's average as kvpress computes it with and without them (:mod:`attngeom.kvcache.averages`,
computed from the summary's rows, so a run written before the field existed has it too): the
tables of docs/kvcache.md.

    python tools/kvtasks_tables.py docs/kvtasks-runs/smollm2-135m-2k-question-agnostic
    python tools/kvtasks_tables.py --readme RUN       # the README's short table
    python tools/kvtasks_tables.py RUN --pair contribution kvzip --tasks frequent_words
                                                      # one policy against another, paired

``--pair`` answers the findings' other questions from ``answers.parquet``: a policy against any
other (``full``, the full cache, included) at each ratio, over the chosen tasks, each task
weighing the same, as the run's own tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def missing(x) -> bool:
    """No value: ``null`` in the command's JSON, NaN in a table."""
    return x is None or x != x


def pct(x) -> str:
    return "—" if missing(x) else f"{100 * x:.0f}"


def with_interval(fmt, x, lo, hi) -> str:
    """``fmt(x)``, then ``[fmt(lo), fmt(hi)]`` when the interval exists."""
    return fmt(x) + ("" if missing(lo) or missing(hi) else f" [{fmt(lo)}, {fmt(hi)}]")


def iv(r: dict) -> str:
    """An accuracy in %, with its interval."""
    return with_interval(pct, r["accuracy"], r.get("low"), r.get("high"))


def signed(x: float) -> str:
    """Points with their sign; a difference that rounds to 0 is ``+0``, never ``-0``."""
    return "—" if missing(x) else f"{round(100 * x):+d}"


def difference(v: dict) -> str:
    """A verdict's paired difference in points, with its interval when there is one."""
    return with_interval(signed, v["delta"], v.get("low"), v.get("high"))


class Refused(Exception):
    """A folder whose tables cannot be printed: one line, exit 2."""


def checked(run: Path) -> Path:
    """``run`` when :func:`attngeom.runs.verify` finds it intact: a finished ``attngeom kvtasks`` run
    or a folder tools/kvtasks_merge.py wrote, its ``run.json`` sealed and every file it lists
    unchanged; else :class:`Refused` saying what is wrong."""
    from attngeom.runs import verify

    problems = verify(run)
    if problems:
        raise Refused(f"{run} is not an intact kvtasks run or merged folder ({problems[0]})")
    return run


def load(run: Path) -> tuple[dict, list[dict]]:
    """The run's summary and pair rows, read once :func:`checked` has verified the folder."""
    from attngeom.runs.storage import parse_json

    checked(run)
    try:
        s = parse_json((run / "summary.json").read_bytes())
        pairs = []
        if (run / "pairs.parquet").exists():
            import pandas as pd

            pairs = pd.read_parquet(run / "pairs.parquet").to_dict(orient="records")
    except Exception as e:                           # not JSON, nested too deeply, a parquet file pyarrow refuses
        raise Refused(f"{run}: cannot read its tables ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(s, dict) or s.get("command") != "kvtasks" or not isinstance(s.get("results"), list):
        raise Refused(f"{run}/summary.json is not the summary of a kvtasks run")
    return s, pairs


def _geometry(pairs: list[dict]) -> set[str]:
    return {p["policy"] for p in pairs if p["geometry"]}


def overall(s: dict) -> str:
    """The task of the summary rows over every task: ``all``, or the one task of a run of one."""
    return "all" if any(r["task"] == "all" for r in s["results"]) else s["tasks"][0]


def accuracy_table(s: dict, pairs: list[dict]) -> str:
    """Policies (rows) by ratio (columns): accuracy in % with its 95 % interval; geometry policies in bold."""
    rows = [r for r in s["results"] if r["task"] == overall(s)]
    ratios = sorted({r["ratio"] for r in rows if r["policy"] != "full"})
    geo = _geometry(pairs)
    by = {(r["policy"], r["ratio"]): r for r in rows}
    full = by.get(("full", 0.0))
    out = ["| policy | " + " | ".join(f"ratio {r:g}" for r in ratios) + " |", "|---|" + "---:|" * len(ratios)]
    if full:
        out.append("| full cache | " + " | ".join([iv(full)] * len(ratios)) + " |")
    best = {float(k): v for k, v in s.get("best_baselines", {}).items()}
    for p in s["policies"]:
        name = f"**{p}**" if p in geo else p
        cells = []
        for r in ratios:
            c = iv(by[(p, r)]) if (p, r) in by else "—"
            cells.append(f"*{c}*" if best.get(r) == p else c)
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def verdict_table(s: dict) -> str:
    """Each geometry policy against the best baseline at each ratio (over all tasks)."""
    out = ["| ratio | best baseline | geometry policy | difference (points) [95 %] | verdict |", "|---:|---|---|---:|---|"]
    for v in sorted(s.get("verdicts", []), key=lambda v: (v["ratio"], -v["delta"])):
        out.append(f"| {v['ratio']:g} | {v['baseline']} | {v['policy']} | {difference(v)} | {v['verdict']} |")
    return "\n".join(out)


def floor_record(s: dict) -> dict:
    """:func:`attngeom.kvcache.averages.from_results` of the run's rows: the floor, the tasks below
    it, kvpress's average with and without them."""
    from attngeom.kvcache.averages import from_results

    return from_results(s["results"])


def task_table(s: dict, ratio: float) -> str:
    """Tasks (columns) by policy (rows) at one ratio: accuracy in %, the full cache's first; a task
    whose full-cache accuracy is below the floor is marked †."""
    tasks = list(s["tasks"]) + (["all"] if len(s["tasks"]) > 1 else [])
    below = set(floor_record(s)["below_floor"])
    by = {(r["task"], r["policy"], r["ratio"]): r for r in s["results"]}
    out = ["| policy | " + " | ".join(t.replace("_", " ") + ("†" if t in below else "") for t in tasks) + " |",
           "|---|" + "---:|" * len(tasks)]
    for p, r in [("full", 0.0)] + [(p, ratio) for p in s["policies"]]:
        cells = [pct(by[(t, p, r)]["accuracy"]) if (t, p, r) in by else "—" for t in tasks]
        out.append(f"| {'full cache' if p == 'full' else p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def floor_said(s: dict) -> str:
    """The sentence naming the tasks below the floor, or saying there are none."""
    from attngeom.kvcache.averages import said

    rec = floor_record(s)
    floor = f"{100 * rec['floor']:g} %"
    if not rec["below_floor"]:
        return f"No task's full-cache accuracy is below the floor ({floor})."
    return (f"† Tasks whose full-cache accuracy is below the floor ({floor}), which cannot tell policies apart: "
            f"{said(rec)}.")


def average_table(s: dict) -> str:
    """Policies (rows) by ratio (columns): RULER's average as kvpress computes it (each task's
    accuracy × 100 rounded to two decimals, then their mean), over every task / over the tasks at or
    above the floor (— when none is)."""
    rec = floor_record(s)
    rows = {(r["policy"], r["ratio"]): r for r in rec["averages"]}
    ratios = sorted({r["ratio"] for r in rec["averages"] if r["policy"] != "full"})

    def cell(r):
        kept = "—" if r["average_discriminating"] is None else f"{r['average_discriminating']:.2f}"
        return f"{r['average']:.2f} / {kept}"

    out = ["| policy | " + " | ".join(f"ratio {r:g}" for r in ratios) + " |", "|---|" + "---:|" * len(ratios)]
    if ("full", 0.0) in rows:
        out.append("| full cache | " + " | ".join([cell(rows[("full", 0.0)])] * len(ratios)) + " |")
    for p in s["policies"]:
        out.append(f"| {p} | " + " | ".join(cell(rows[(p, r)]) if (p, r) in rows else "—" for r in ratios) + " |")
    return "\n".join(out)


def average_heading(s: dict) -> str:
    rec = floor_record(s)
    n = len(rec["full_accuracy"])
    kept = n - len(rec["below_floor"])
    return ("RULER's average as kvpress computes it (each task's accuracy × 100 rounded to two decimals, then "
            f"their mean, each task weighing the same), over all {n} task{'s' if n > 1 else ''} / over the "
            f"{kept} at or above the floor:")


def readme_table(s: dict, pairs: list[dict]) -> str:
    """Per ratio: the full cache, the best baseline, the best geometry policy (the highest accuracy,
    then the highest paired difference; every policy tied on both is named) and its paired
    difference."""
    geo = _geometry(pairs)
    allrows = {(r["policy"], r["ratio"]): r for r in s["results"] if r["task"] == overall(s)}
    full = allrows[("full", 0.0)]
    out = ["| ratio | full cache | best baseline | best geometry policy | difference [95 %] |", "|---:|---:|---|---|---:|"]
    for ratio, base in sorted((float(k), v) for k, v in s.get("best_baselines", {}).items()):
        cands = [v for v in s.get("verdicts", []) if v["ratio"] == ratio and v["policy"] in geo]
        if not cands:
            continue
        rank = {v["policy"]: (-allrows[(v["policy"], ratio)]["accuracy"], -v["delta"]) for v in cands}
        top = min(cands, key=lambda v: (rank[v["policy"]], v["policy"]))
        tied = sorted(p for p in rank if rank[p] == rank[top["policy"]])   # the same accuracy and difference
        out.append(f"| {ratio:g} | {pct(full['accuracy'])} | {base} {iv(allrows[(base, ratio)])} | "
                   f"{' / '.join(tied)} {iv(allrows[(top['policy'], ratio)])} | {difference(top)} ({top['verdict']}) |")
    return "\n".join(out)


def haystack_said(s: dict) -> str:
    """The needle tasks' haystack, from the run's settings: ``"needle tasks in the noise"``, ``"RULER's
    haystacks (the shipped essays)"`` or the prose file's name; ``""`` for a run of an examples file."""
    h = (s.get("settings") or {}).get("haystack")
    if h is None:
        return ""
    if h == "noise":
        return ", needle tasks in the noise"
    if isinstance(h, dict) and "ruler" in h:
        return ", RULER's haystacks (the essay tasks in the shipped essays)"
    return f", needle tasks in {Path(str(h.get('data', h) if isinstance(h, dict) else h)).name}"


def tasks_said(s: dict) -> str:
    """``"6 tasks"``, or with the examples per task when they differ (a merged sample gathered in
    parts): ``"6 tasks: frequent_words 20, the others 10"``."""
    n = len(s["tasks"])
    said = f"{n} task{'s' if n > 1 else ''}"
    per = s.get("examples_per_task") or {}
    counts = sorted(set(per.values()))
    if len(counts) < 2:
        return said
    common = max(counts, key=lambda c: sum(v == c for v in per.values()))
    odd = ", ".join(f"{t} {v}" for t, v in sorted(per.items()) if v != common)
    return f"{said}: {odd}, the others {common}"


def pair_table(run: Path, policy: str, baseline: str, tasks: list[str] | None = None) -> str:
    """``policy`` against ``baseline`` at each ratio over ``tasks`` (all the run's by default):
    both accuracies with intervals, the paired difference with its interval, and the example cells
    where their scores differ (policy ahead / behind)."""
    import pandas as pd

    from attngeom.kvcache.tasks import overall as over_tasks, paired, summarize

    df = pd.read_parquet(run / "answers.parquet")
    chosen = tasks or sorted(df["task"].unique())
    unknown = sorted(set(chosen) - set(df["task"])) + sorted({policy, baseline} - set(df["policy"]))
    if unknown:
        raise ValueError(f"{run} has no {', '.join(unknown)}")
    ratios = sorted(r for r in df["ratio"].unique() if r > 0)
    df = df[df["task"].isin(chosen) & df["policy"].isin([policy, baseline])]   # the two compared, nothing else
    full = df[df["policy"] == "full"]                        # the full cache stands at every ratio
    df = pd.concat([df[df["policy"] != "full"]] + [full.assign(ratio=r) for r in ratios])
    acc = {(r["policy"], r["ratio"]): r for r in over_tasks(summarize(df)).to_dict(orient="records")}
    rows = over_tasks(paired(df, baselines={float(r): baseline for r in ratios}))
    wide = df.pivot_table(index=["task", "example", "ratio"], columns="policy", values="score")
    said = ", ".join(chosen) if tasks else "all tasks"
    out = [f"{policy} against {baseline}, {said} ({df[['task', 'example']].drop_duplicates().shape[0]} examples, "
           "each task weighing the same), paired over examples:", "",
           f"| ratio | {policy} | {baseline} | difference (points) [95 %] | cells differing (ahead / behind) |",
           "|---:|---:|---:|---:|---|"]
    for r in ratios:
        v = rows[(rows["ratio"] == r) & (rows["policy"] == policy)].iloc[0].to_dict()
        d = wide.xs(r, level="ratio")
        ahead, behind = int((d[policy] > d[baseline]).sum()), int((d[policy] < d[baseline]).sum())
        out.append(f"| {r:g} | {iv(acc[(policy, r)])} | {iv(acc[(baseline, r)])} | {difference(v)} | "
                   f"{ahead + behind} of {len(d)} ({ahead} / {behind}) |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="folders written by attngeom kvtasks (or tools/kvtasks_merge.py)")
    ap.add_argument("--readme", action="store_true", help="only the README's short table")
    ap.add_argument("--pair", nargs=2, metavar=("POLICY", "BASELINE"),
                    help="only POLICY against BASELINE (full: the full cache), paired over examples")
    ap.add_argument("--tasks", help="with --pair: these tasks only, comma-separated (default: all)")
    a = ap.parse_args(argv)
    if a.tasks and not a.pair:
        print("kvtasks_tables: --tasks goes with --pair", file=sys.stderr)
        return 2
    try:
        return tables(a)
    except Refused as e:
        print(f"kvtasks_tables: {e}", file=sys.stderr)
        return 2


def tables(a) -> int:
    """Print the tables ``main``'s options ask for; :class:`Refused` before anything is printed when a
    folder is not intact or its files cannot be read."""
    if a.pair:
        for run in a.runs:
            if not (run / "answers.parquet").is_file():
                raise Refused(f"{run} holds no answers.parquet")
            checked(run)
        out = []
        for run in a.runs:
            try:
                out.append(pair_table(run, *a.pair, a.tasks.split(",") if a.tasks else None) + "\n")
            except ValueError as e:
                raise Refused(str(e)) from None
        print("\n".join(out))
        return 0
    for run in a.runs:
        if not (run / "summary.json").is_file():
            raise Refused(f"{run} holds no summary.json (not a finished kvtasks run)")
    loaded = [load(run) for run in a.runs]
    for s, pairs in loaded:
        head = (f"{s['model']}, {s['length']} tokens, {s['mode']}, {s['examples']} examples "
                f"({tasks_said(s)}), {'chat template' if s.get('chat_template') else 'no chat template'}{haystack_said(s)}")
        if a.readme:
            full = next((r for r in floor_record(s)["averages"] if r["policy"] == "full"), None)
            kvpress = "" if full is None else (
                f" kvpress's RULER average of the full cache: {full['average']:.2f} over all tasks, "
                + ("—" if full["average_discriminating"] is None else f"{full['average_discriminating']:.2f}")
                + " over the tasks at or above the floor.")
            print(f"{head}\n\n{readme_table(s, pairs)}\n\n{floor_said(s)}{kvpress}\n")
            continue
        print(f"### {head}\n\nAccuracy (%) over all tasks, 95 % intervals over examples "
              "(geometry policies in bold; the best baseline at each ratio in italics):\n")
        print(accuracy_table(s, pairs) + "\n")
        print("Each geometry policy against the best baseline at each ratio, paired over examples:\n")
        print(verdict_table(s) + "\n")
        for ratio in sorted({r["ratio"] for r in s["results"] if r["ratio"] > 0}):
            print(f"Accuracy (%) per task at ratio {ratio:g}:\n\n{task_table(s, ratio)}\n")
        print(f"{floor_said(s)}\n")
        print(f"{average_heading(s)}\n\n{average_table(s)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
