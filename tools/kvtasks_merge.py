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
import sys
from pathlib import Path

IDENTITY = ("model", "dtype", "device_type", "threads", "length", "examples", "seed", "haystack", "policies", "ratios",
            "mode", "chat", "allow_missing_weights")


class Refused(Exception):
    """A run that cannot be merged: one line, exit 2."""


def settings_of(run: Path) -> dict:
    """The run's settings: from ``run.json`` when finished, else from its checkpoint."""
    from attngeom.runs.storage import parse_json

    for path in (run / "run.json", run / "checkpoint" / "settings.json"):
        if path.is_file():
            try:
                doc = parse_json(path.read_text(encoding="utf-8"))
            except ValueError as e:
                raise Refused(f"{path} is not valid JSON ({e})") from None
            if not isinstance(doc, dict) or doc.get("command") != "kvtasks" or not isinstance(doc.get("settings"), dict):
                raise Refused(f"{path} is not the record of an attngeom kvtasks run")
            settings = doc["settings"]
            if not isinstance(settings.get("tasks"), list) or not isinstance(settings.get("examples"), int):
                raise Refused(f"{run} was made from an examples file (no task list): merge its tasks by running them again")
            return settings
    raise Refused(f"{run} holds neither run.json nor checkpoint/settings.json (not an attngeom kvtasks run)")


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
            try:
                units.setdefault(tuple(rec["units"]), decode_record(rec["data"])["rows"])
            except (KeyError, TypeError, ValueError) as e:
                raise Refused(f"{path} holds a record that is not a kvtasks unit ({type(e).__name__}: {e})") from None
    return pd.concat(units.values(), ignore_index=True) if units else pd.DataFrame()


def collect(runs: list[Path]):
    """The rows of every whole task (each taken from the first run that has it whole), the runs'
    contributions and their common settings; :class:`Refused` when runs differ or nothing is whole."""
    import pandas as pd

    frames, merged, first = [], [], None
    for run in runs:
        settings = settings_of(run)
        ident = {k: settings.get(k) for k in IDENTITY}
        if first is None:
            first = ident
        elif ident != first:
            diff = [k for k in IDENTITY if ident[k] != first[k]]
            raise Refused(f"{run} differs from {runs[0]} in {', '.join(diff)}")
        df = rows_of(run)
        if not len(df):
            continue
        done = df.groupby("task")["example"].nunique()
        taken = {x for m in merged for x in m["tasks"]}
        whole = [t for t in settings["tasks"] if done.get(t, 0) == settings["examples"] and t not in taken]
        if whole:
            frames.append(df[df["task"].isin(whole)])
            merged.append({"run": run.name, "tasks": whole, "examples_per_task": settings["examples"]})
    if not frames:
        raise Refused("no whole task in these runs (a task is merged once every one of its examples is answered)")
    return pd.concat(frames, ignore_index=True), merged, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args(argv)
    from attngeom.kvcache import tasks
    from attngeom.runs.storage import write_json

    out = Path(a.out)
    if out.exists():
        print(f"kvtasks_merge: {out} exists; give a new folder", file=sys.stderr)
        return 2
    try:
        df, merged, first = collect([Path(r) for r in a.runs])
    except Refused as e:
        print(f"kvtasks_merge: {e}", file=sys.stderr)
        return 2
    df = df.sort_values(["task", "example", "ratio", "policy"], kind="stable").reset_index(drop=True)
    model = first["model"]
    if "model" in df:           # a finished run's rows name the model as the command prints it; a stopped run's units do not
        named = df["model"].dropna()
        model = str(named.iloc[0]) if len(named) else model
        df["model"] = df["model"].fillna(model)
    summary, pairs = tasks.summarize(df), tasks.paired(df)
    out.mkdir(parents=True)
    for name, t in (("answers", df), ("summary", summary), ("pairs", pairs)):
        t.to_parquet(out / f"{name}.parquet")
    doc = {"command": "kvtasks", "model": model, "examples": int(df.groupby(["task", "example"]).ngroups),
           "tasks": sorted(df["task"].unique()), "length": first["length"], "mode": first["mode"],
           "chat_template": bool(df["chat"].any()), "policies": list(first["policies"]), "ratios": list(first["ratios"]),
           "best_baselines": {str(k): v for k, v in tasks.best_baselines(summary).items()},
           "results": summary.to_dict(orient="records"), "verdicts": tasks.verdicts(pairs), "merged": merged}
    write_json(out / "summary.json", doc)
    print(f"kvtasks_merge: {doc['examples']} examples of {', '.join(doc['tasks'])} written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
