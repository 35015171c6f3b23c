"""``report.md`` of the corpus commands (sinks, selection, heads, faithfulness, kvcache, corpus-mode
analyze) and of ``explore``: what was run, the headline numbers and what each file holds, for a reader of the
output directory. ``attngeom analyze`` on one text has its own (:mod:`attngeom.reports.analyze`);
``attngeom claims`` writes ``claims.md`` (:mod:`attngeom.reports.claims`) and this short report
beside it.

Each command's headline numbers come from its ``summary.json`` content through the function that
:data:`HEADLINES` names, beside the one that builds that summary (its fields have one owner); a
missing headline fails loudly. Numbers are written by :func:`attngeom.stats.resampling.format_number`,
and every string from the user, the model or the data is escaped (:mod:`attngeom.reports.markdown`).
"""

from __future__ import annotations

from attngeom.reports import markdown as md
from attngeom.stats.resampling import MIN_UNITS

FILE_NOTES = {
    "summary.json": "every number of this report, and the run's settings",
    "run.json": "the run's manifest (written last; checksums of every file)",
    "report.md": "this report",
    "explore.html": "the explorer: one self-contained offline page; open it in a browser (docs/explore.md)",
    "claims.md": "one row per claim: measured value, 95 % interval, verdict; the rules and the numbers behind them",
    "claims.json": "the rows of claims.md and every interval",
    "heads.parquet": "one row per (layer, head)",
    "table.parquet": "one row per intervened variant (metric, mode, ratio, seed): perplexity or accuracy",
    "selection.parquet": "per (layer, head, N, distance, subset kind): precision, recall, F, inversions",
    "summary.parquet": "per (policy, budget): perplexity with its interval, the difference to the full cache, "
                       "memory and time",
    "reads.parquet": "per (policy, budget, window): NLL, tokens, perplexity, peak cache bytes, seconds",
    "pairs.parquet": "every pair of policies at every budget: perplexity difference and how often one wins",
    "curve.parquet": "queries binned by sink rate per (layer, head): mean output norm and its spread",
    "drift.parquet": "queries binned by the normalised entropy of the non-sink attention",
    "hist.parquet": "histograms of cos(ṽ_0, m_i), cos(ṽ_0, ṽ_j) and ρ* per (layer, head)",
    "removal.parquet": "sinks: output norms and cone measures per (pass, layer, head); heads: perplexity per "
                       "removal order and retention",
    "ppl.parquet": "perplexity of the unedited model, with the sink removed and with the control removed",
    "regime.parquet": "the sink-aware regime per (layer, head): value norms, cosine decay, attention profile, "
                      "predicted F_N",
    "order_search.parquet": "the regime orders tried on the calibration windows and their perplexity",
    "regimes_by_layer.parquet": "regime shares per layer",
    "regimes.parquet": "the calibration taxonomy (layer, head, regime) the taxonomy policy budgets by",
    "answers.parquet": "one row per answer (analyze: prompt, answer text and ids; kvcache: per example, policy and "
                       "budget, the greedy answer and its agreement with the full cache; kvtasks: per example, policy "
                       "and ratio, the answer and its score)",
    "examples.jsonl": "the long-context examples (context, question, answer prefix, reference answers), one per line",
    "answers-summary.parquet": "per (policy, budget): agreement with the full cache and reference perplexity",
    "answer_shares.parquet": "per generated token and layer: contribution and attention from the sink, the prompt "
                             "and the earlier answer",
    "answer_sources.parquet": "per generated token, layer and metric: its top prompt sources",
    "answer_summary.parquet": "per layer and prompt token: mean attention and contribution over the answer",
}

COMMAND_FILE_NOTES = {
    "kvtasks": {"summary.parquet": "per (task, policy, ratio) and over all tasks: accuracy with its 95 % interval "
                                   "over examples, entries kept, cache bytes, seconds",
                "pairs.parquet": "every policy against the best baseline at each ratio: the paired accuracy "
                                 "difference, its interval, and how often the policy is ahead"},
}
"""Notes of the files a command writes under a name another command uses for something else."""


WITH_INTERVALS = ("kvcache", "kvtasks", "claims")
"""The commands whose reports give bootstrap intervals (and say when there are too few windows)."""

HEADLINES: dict[str, str] = {
    "sinks": "attngeom.sinks.experiment:headline", "selection": "attngeom.selection.experiment:headline",
    "heads": "attngeom.heads.experiment:headline", "faithfulness": "attngeom.faithfulness.experiment:headline",
    "kvcache": "attngeom.kvcache.experiment:headline", "kvtasks": "attngeom.kvcache.experiment:task_headline",
    "analyze": "attngeom.analysis.experiment:headline", "claims": "attngeom.claims.experiment:headline",
    "explore": "attngeom.reports.explore:headline"}
"""Where each command's headline numbers are read from its summary: the function beside the one
that builds the summary (``module:function``), so that the summary's fields have one owner."""


def headline(command: str, summary: dict) -> list[tuple[str, str]]:
    """The headline rows ``(measure, value)`` of ``command``'s report from its ``summary``. Fails
    loudly, never a silent "(no results)": a command without a headline (``KeyError``), a
    summary without a field its headline reads (the error of the lookup) or a headline with no row
    (``ValueError``)."""
    import importlib

    if command not in HEADLINES:
        raise KeyError(f"no headline is known for the command {command!r} (attngeom.reports.run_report.HEADLINES)")
    module, name = HEADLINES[command].split(":")
    rows = getattr(importlib.import_module(module), name)(summary)
    if not rows:
        raise ValueError(f"the {command} summary gives no headline number")
    return rows


def render(command: str, summary: dict, files: list[str], model: str | None = None) -> str:
    """The ``report.md`` of ``command`` from its ``summary`` (``summary.json``'s content) and the
    files it wrote."""
    t = md.text
    model = model or summary.get("model") or summary.get("model_name") or next(iter(summary.get("models", {})), "")
    lines = [f"# attngeom {t(command)} — {t(model)}", ""]
    data = summary.get("data", summary.get("source"))
    if data is not None:
        lines.append(f"- data: {t(data if isinstance(data, str) else ', '.join(map(str, data)))}")
    windows = summary.get("windows")
    if isinstance(windows, dict):
        windows = windows.get("windows")
    if isinstance(windows, list):
        windows = " + ".join(map(str, windows))
    if windows is not None:
        size = f" of {summary['window']} tokens" if summary.get("window") else ""
        lines.append(f"- windows: {windows}{size}" + (f", {summary['tokens']} tokens" if "tokens" in summary else ""))
        if command in WITH_INTERVALS and isinstance(windows, int) and windows < MIN_UNITS:
            lines.append(f"- too few windows for an interval ({windows}; intervals need at least {MIN_UNITS}): "
                         "none is given")
        elif isinstance(windows, int) and windows < MIN_UNITS:
            lines.append(f"- fewer than {MIN_UNITS} windows ({windows}): the numbers below are an example, "
                         "not an estimate")
    calibration = summary.get("calibration_windows")
    if isinstance(calibration, int) and calibration < MIN_UNITS:        # heads: what its critical heads rest on
        lines.append(f"- {calibration} calibration window(s), fewer than {MIN_UNITS}: the critical heads and the "
                     "regime order are an example, not an estimate")
    lines += ["", "## Results", ""]
    lines += md.table(["measure", "value"], headline(command, summary), align="lr")
    lines += ["", "## Files", ""]
    notes = {**FILE_NOTES, **COMMAND_FILE_NOTES.get(command, {})}
    for f in files:
        lines.append(f"- {md.link(f, f)}" + (f" — {t(notes[f])}" if f in notes else
                                            " — figure" if f.rsplit(".", 1)[-1] in ("png", "pdf", "svg") else ""))
    return "\n".join(lines) + "\n"
