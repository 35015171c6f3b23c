#!/usr/bin/env python
"""One summary from several ``attngeom kvtasks`` runs of the same model, length, mode, policies and
ratios, finished or stopped: the whole tasks of each (every example of the task answered) merged
and summarised as the command summarises one run (:func:`attngeom.kvcache.tasks.summarize`,
``paired``, ``verdicts``). A stopped run is read from its checkpoint; a task found in several runs
is taken from the first. Writes ``answers.parquet``, ``summary.parquet``, ``pairs.parquet`` and
``summary.json`` (with ``"merged"``: the runs and the tasks taken from each) to ``--out``, which
must not exist.

    python tools/kvtasks_merge.py --out docs/kvtasks-runs/NAME RUN [RUN ...]

Used when a grid is split by tasks over processes or machines, or when a run had to stop: the
tables of docs/kvcache.md then say which tasks are whole.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

IDENTITY = ("model", "dtype", "device_type", "length", "seed", "haystack", "policies", "ratios", "mode", "chat", "threads")


def rows_of(run: Path):
    """The answer rows of a run: its ``answers.parquet`` when finished, else its checkpoint's units."""
    import pandas as pd

    from attngeom.runs.storage import decode_record, parse_json

    if (run / "answers.parquet").exists():
        return pd.read_parquet(run / "answers.parquet")
    units = {}
    for path in sorted((run / "checkpoint").glob("records-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = parse_json(line)
            except ValueError:
                continue                                        # a line cut short by a kill
            units.setdefault(tuple(rec["units"]), decode_record(rec["data"])["rows"])
    return pd.concat(units.values(), ignore_index=True) if units else pd.DataFrame()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args(argv)
    import pandas as pd

    from attngeom.kvcache import tasks

    out = Path(a.out)
    if out.exists():
        print(f"kvtasks_merge: {out} exists; give a new folder", file=sys.stderr)
        return 2
    frames, merged, first = [], [], None
    for run in map(Path, a.runs):
        settings = json.loads((run / "checkpoint" / "settings.json").read_text(encoding="utf-8"))["settings"]
        ident = {k: settings.get(k) for k in IDENTITY}
        if first is None:
            first = ident
        elif ident != first:
            diff = [k for k in IDENTITY if ident[k] != first[k]]
            print(f"kvtasks_merge: {run} differs from {a.runs[0]} in {', '.join(diff)}", file=sys.stderr)
            return 2
        df = rows_of(run)
        if not len(df):
            continue
        done = df.groupby("task")["example"].nunique()
        whole = [t for t in settings["tasks"] if done.get(t, 0) == settings["examples"]
                 and t not in {x for m in merged for x in m["tasks"]}]
        frames.append(df[df["task"].isin(whole)])
        merged.append({"run": run.name, "tasks": whole, "examples_per_task": settings["examples"]})
    df = pd.concat(frames, ignore_index=True)
    if not len(df):
        print("kvtasks_merge: no whole task in these runs", file=sys.stderr)
        return 2
    df = df.sort_values(["task", "example", "ratio", "policy"], kind="stable").reset_index(drop=True)
    summary, pairs = tasks.summarize(df), tasks.paired(df)
    out.mkdir(parents=True)
    for name, t in (("answers", df), ("summary", summary), ("pairs", pairs)):
        t.to_parquet(out / f"{name}.parquet")
    doc = {"command": "kvtasks", "model": first["model"], "examples": int(df.groupby(["task", "example"]).ngroups),
           "tasks": sorted(df["task"].unique()), "length": first["length"], "mode": first["mode"],
           "chat_template": bool(df["chat"].any()), "policies": list(first["policies"]), "ratios": list(first["ratios"]),
           "best_baselines": {str(k): v for k, v in tasks.best_baselines(summary).items()},
           "results": summary.to_dict(orient="records"), "verdicts": tasks.verdicts(pairs), "merged": merged}
    (out / "summary.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(f"kvtasks_merge: {doc['examples']} examples of {', '.join(doc['tasks'])} written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
