#!/usr/bin/env python
"""One summary from several ``attngeom kvtasks`` runs of the same model, length, seed, mode,
policies and ratios, finished or stopped, or folders this tool wrote: the whole tasks of each
merged and summarised as the command summarises one run (:func:`attngeom.kvcache.tasks.summarize`,
``paired``, ``verdicts``). Writes ``answers.parquet``, ``summary.parquet``, ``pairs.parquet``,
``summary.json`` (with ``"settings"``, the inputs' common identity, and ``"merged"``: the example
numbers taken from each input, and those skipped), ``examples.jsonl`` (the merged examples, as the
command writes them, when every input that gives examples holds its ``examples.jsonl``; a stopped
run has none) and the command's figure ``kvtasks-accuracy.png``
(``--figure-format pdf`` or any format matplotlib writes; ``--no-figures`` leaves it out) to
``--out``, which must not exist; the folder appears whole or not at all, sealed by a ``run.json``
as a run's is (:func:`seal`), so :func:`attngeom.runs.verify` checks it. Inputs are read only
through the runs' own checks: a finished run or a merged folder once ``verify`` finds it intact, a
stopped run through its sealed checkpoint; anything changed since attngeom wrote it is refused.

    python tools/kvtasks_merge.py --out docs/kvtasks-runs/NAME INPUT [INPUT ...]

A task of a run is taken when it is whole in that run: every example ``first_example ..
first_example + examples - 1`` answered (a stopped run is read from its checkpoint). Its examples
add to those earlier inputs gave the task; an example number (task, example) already taken is
skipped, the first input wins. A folder this tool wrote counts as whole for every example it holds.
So a sample of 50 examples per task is gathered 10 at a time: runs of ``attngeom kvtasks
--examples 10 --first-example 0``, then ``10``, ``20``, ... each merged with the published folder
into a new one (never over it: ``--out`` must not exist)::

    python tools/kvtasks_merge.py --out docs/kvtasks-runs/NAME-20 docs/kvtasks-runs/NAME RUN10

Also used when a grid is split by tasks over processes or machines, or when a run had to stop: the
tables of docs/kvcache.md then say which tasks are whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

IDENTITY = ("model", "dtype", "device_type", "threads", "length", "seed", "haystack", "policies", "ratios",
            "mode", "chat", "allow_missing_weights")
DEFAULTS = {"allow_missing_weights": False}
"""Identity keys a run records only when they differ from their default: absent compares as the default."""


class Refused(Exception):
    """A run that cannot be merged: one line, exit 2."""


def identity(settings: dict) -> dict:
    """The keys of :data:`IDENTITY` in ``settings``, an absent one as its default."""
    return {k: settings.get(k, DEFAULTS.get(k)) for k in IDENTITY}


def settings_of(run: Path) -> tuple[dict, list | None]:
    """The input's settings, and, for a folder this tool wrote, its ``"merged"`` record (where its
    examples came from; None for a run). Read only through the runs' own checks: a finished run or a
    merged folder from its ``run.json`` once :func:`attngeom.runs.verify` finds it intact (its seal,
    and every file it lists with its checksum), a stopped run from its sealed
    ``checkpoint/settings.json``; anything changed since attngeom wrote it is refused."""
    from attngeom.runs.run import CHECKPOINT, MANIFEST, SETTINGS, read_manifest, unseal, verify

    if (run / MANIFEST).exists():
        problems = verify(run)
        if problems:
            raise Refused(f"{run} is not intact ({problems[0]}; attngeom.runs.verify): merge the run as it was written")
        doc = read_manifest(run)
        if "merged" in doc:
            if not isinstance(doc.get("settings"), dict) or not isinstance(doc["merged"], list):
                raise Refused(f"{run / MANIFEST} is not the record of a folder kvtasks_merge wrote")
            return doc["settings"], doc["merged"]
    elif (run / CHECKPOINT / SETTINGS).exists():
        doc = unseal(run / CHECKPOINT / SETTINGS)
        if not doc:
            raise Refused(f"{run / CHECKPOINT / SETTINGS} was not written by attngeom, or was changed since")
    elif (run / "summary.json").is_file():
        raise Refused(f"{run} has no run.json: a folder that kvtasks_merge wrote before it sealed its outputs, or "
                      "not one of its folders; merge the runs behind it again")
    else:
        raise Refused(f"{run} holds neither run.json nor checkpoint/settings.json (not an attngeom kvtasks run "
                      "nor a folder kvtasks_merge wrote)")
    if doc.get("command") != "kvtasks" or not isinstance(doc.get("settings"), dict):
        raise Refused(f"{run} is not the record of an attngeom kvtasks run")
    settings = doc["settings"]
    if not isinstance(settings.get("tasks"), list) or not isinstance(settings.get("examples"), int):
        raise Refused(f"{run} was made from an examples file (no task list): merge its tasks by running them again")
    return settings, None


COLUMNS = ("task", "example", "policy", "ratio", "score", "chat")
"""The columns of the answer rows the merge reads."""


def rows_of(run: Path):
    """The answer rows of an input: its ``answers.parquet`` when finished (verified by
    :func:`settings_of`), else its checkpoint's units."""
    import pandas as pd

    from attngeom.runs.storage import decode_record, parse_json

    if (run / "run.json").exists():
        try:
            df = pd.read_parquet(run / "answers.parquet")
        except Exception as e:                       # pyarrow's errors are of many types
            raise Refused(f"{run / 'answers.parquet'} cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    else:
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
        df = pd.concat(units.values(), ignore_index=True) if units else pd.DataFrame(columns=list(COLUMNS))
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise Refused(f"the answer rows of {run} have no column {', '.join(missing)}")
    return df


def examples_of(run: Path) -> dict | None:
    """``{(task, example number): Example}`` from the input's ``examples.jsonl`` when its run.json
    lists it (a finished run's, or a folder this tool wrote with one; verified by
    :func:`settings_of`); None when it has none."""
    from attngeom.errors import InputError
    from attngeom.kvcache import ruler
    from attngeom.runs.run import read_manifest

    listed = (read_manifest(run) or {}).get("files") or {}
    if "examples.jsonl" not in listed:
        return None
    try:
        return {(ex.task, ex.index): ex for ex in ruler.read_jsonl(run / "examples.jsonl")}
    except InputError as e:
        raise Refused(str(e)) from None


def whole_examples(settings: dict, merged: bool, df) -> dict[str, list[int]]:
    """The example numbers of each whole task: every one a merged folder holds; of a run, its tasks
    whose examples ``first_example .. first_example + examples - 1`` are all answered."""
    got = df.groupby("task")["example"].agg(set).to_dict() if len(df) else {}
    if merged:
        return {t: sorted(int(e) for e in got[t]) for t in sorted(got)}
    first = settings.get("first_example", 0)
    want = range(first, first + settings["examples"])
    return {t: list(want) for t in settings["tasks"] if set(want) <= got.get(t, set())}


def spans(numbers) -> str:
    """Example numbers as ranges: 0..9 and 20 are ``"0-9, 20"``."""
    from attngeom.reports.markdown import ranges

    return ranges(numbers, dash="-")


def collect(runs: list[Path]):
    """The rows of every whole task's examples (each (task, example) taken from the first input that
    has it), each input's contribution, their common identity, the number of examples skipped as
    taken already, and the examples taken (``(examples, None)``; ``(None, why)`` when an input gives
    examples without an ``examples.jsonl`` holding them); :class:`Refused` when
    inputs differ or nothing is whole."""
    import pandas as pd

    frames, merged, first, taken, dropped = [], [], None, set(), 0
    chosen_examples, without = [], None
    for run in runs:
        settings, inputs = settings_of(run)
        is_merged = inputs is not None
        ident = identity(settings)
        if first is None:
            first = ident
        elif ident != first:
            diff = [k for k in IDENTITY if ident[k] != first[k]]
            raise Refused(f"{run} differs from {runs[0]} in {', '.join(diff)}")
        df = rows_of(run)
        new, skipped = {}, {}
        for t, examples in whole_examples(settings, is_merged, df).items():
            for e in examples:
                (skipped if (t, e) in taken else new).setdefault(t, []).append(e)
        keep = {(t, e) for t, es in new.items() for e in es}
        taken |= keep
        if keep and without is None:
            held = examples_of(run)
            if held is None:
                without = f"{run} has no examples.jsonl"
            elif missing := keep - held.keys():
                without = f"the examples.jsonl of {run} lacks {len(missing)} of the examples taken from it"
            else:
                chosen_examples += [held[k] for k in sorted(keep)]
        dropped += sum(map(len, skipped.values()))
        if keep:
            frames.append(df[pd.MultiIndex.from_frame(df[["task", "example"]]).isin(list(keep))])
        if keep or skipped:
            merged.append({"run": run.name, "tasks": list(new), "examples": {t: spans(es) for t, es in new.items()},
                           **({"skipped": {t: spans(es) for t, es in skipped.items()}} if skipped else {}),
                           **({"from": inputs} if is_merged else {})})
    if not frames:
        raise Refused("no whole task in these runs (a task is merged once every one of its examples is answered)")
    chosen = (None, without) if without else (sorted(chosen_examples, key=lambda ex: (ex.task, ex.index)), None)
    return pd.concat(frames, ignore_index=True), merged, first, dropped, chosen


def seal(folder: Path, settings: dict, merged: list, files: list[str]) -> None:
    """``run.json`` of a folder this tool wrote: sealed as a run's manifest is
    (:func:`attngeom.runs.run.seal`), with the merged inputs and every file's checksum, so that
    :func:`attngeom.runs.verify` finds the folder intact, or says what changed."""
    from attngeom.runs.run import FORMAT, SEALED_KINDS, MANIFEST, seal as sealed
    from attngeom.runs.storage import sha256_file, write_json

    write_json(folder / MANIFEST, sealed({"format": FORMAT, "command": "kvtasks", "settings": settings, "complete": True,
                                          "merged": merged, "files": {f: sha256_file(folder / f) for f in files}},
                                         SEALED_KINDS[MANIFEST]))


def written(out: Path, write, settings: dict, merged: list) -> None:
    """Make the folder ``out`` whole or not at all: ``write(staging)`` fills a staging folder beside it
    and returns the file names, :func:`seal` adds ``run.json``, and the folder is renamed to ``out``;
    on any error the staging folder is removed (an OSError goes on to the caller)."""
    import os
    import shutil

    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        staging.mkdir(parents=True)
        seal(staging, settings, merged, write(staging))
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+", help="kvtasks runs (finished or stopped) or folders this tool wrote")
    from attngeom.commands.common import add_figure_args, figure_format

    add_figure_args(ap)                                      # the command's --figure-format and --no-figures
    a = ap.parse_args(argv)
    from attngeom.errors import InputError
    from attngeom.kvcache import tasks
    from attngeom.reports.kvtasks import render
    from attngeom.runs.storage import write_json

    try:
        fmt = figure_format(a)
    except InputError as e:
        print(f"kvtasks_merge: {e}", file=sys.stderr)
        return 2

    out = Path(a.out)
    if out.exists():
        print(f"kvtasks_merge: {out} exists; give a new folder", file=sys.stderr)
        return 2
    try:
        df, merged, first, skipped, (examples, without) = collect([Path(r) for r in a.runs])
    except Refused as e:
        print(f"kvtasks_merge: {e}", file=sys.stderr)
        return 2
    df = df.sort_values(["task", "example", "ratio", "policy"], kind="stable").reset_index(drop=True)
    model = first["model"]
    if "model" in df:           # a finished run's rows name the model as the command prints it; a stopped run's units do not
        named = df["model"].dropna()
        model = str(named.iloc[0]) if len(named) else model
        df["model"] = df["model"].fillna(model)
    from attngeom.kvcache import averages

    try:                         # a policy of one's own is known by the kind its runs recorded
        kinds = {}
        for run in a.runs:                   # the first input's record of a name wins, as its rows do
            kinds = {**tasks.recorded_geometry(run), **kinds}
        geometry = tasks.geometry_of(df["policy"], kinds)
        summary, pairs = tasks.summarize(df), tasks.paired(df, geometry=geometry)
        best = tasks.best_baselines(summary, geometry)
    except InputError as e:
        print(f"kvtasks_merge: {e}", file=sys.stderr)
        return 2
    per_task = df.groupby("task")["example"].nunique()
    doc = {"command": "kvtasks", "model": model, "examples": int(per_task.sum()),
           "examples_per_task": {t: int(n) for t, n in per_task.items()},
           "tasks": sorted(df["task"].unique()), "length": first["length"], "mode": first["mode"],
           "chat_template": bool(df["chat"].any()), "policies": list(first["policies"]), "ratios": list(first["ratios"]),
           "best_baselines": {str(k): v for k, v in best.items()},
           "results": summary.to_dict(orient="records"), "verdicts": tasks.verdicts(pairs),
           "ruler_average": averages.record(summary), "settings": first, "merged": merged}

    def write(staging: Path) -> list[str]:
        for name, t in (("answers", df), ("summary", summary), ("pairs", pairs)):
            t.to_parquet(staging / f"{name}.parquet")
        write_json(staging / "summary.json", doc)
        files = ["answers.parquet", "summary.parquet", "pairs.parquet", "summary.json"]
        if examples is not None:
            from attngeom.kvcache import ruler

            ruler.write_jsonl(examples, staging / "examples.jsonl")
            files.append("examples.jsonl")
        if not a.no_figures:
            files += [Path(f).name for f in render(staging, fmt)]   # the command's figure, from the merged summary
        return files

    try:
        written(out, write, first, merged)
    except OSError as e:
        print(f"kvtasks_merge: cannot write {out}: {e.strerror or e} (nothing was written)", file=sys.stderr)
        return 2
    print(f"kvtasks_merge: {doc['examples']} examples of {', '.join(doc['tasks'])} written to {out}"
          + (f" ({skipped} examples given again skipped: the first input wins)" if skipped else "")
          + (f"; no examples.jsonl ({without})" if without else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
