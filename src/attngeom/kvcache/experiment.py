"""The experiments of ``attngeom kvcache`` and ``attngeom kvtasks`` whole, as their commands call
them, and the ``summary.json`` each writes (one owner of its fields: :func:`run_summary` builds it,
:func:`headline` reads the report's numbers from it; likewise :func:`task_run_summary` and
:func:`task_headline`).

:func:`experiment` (``attngeom kvcache``): the taxonomy policy's head regimes calibrated on windows
beyond the evaluated ones (:func:`calibration_regimes`, stage ``calibration``: the head experiment's
:func:`~attngeom.heads.experiment.taxonomy_stage`), language modelling under every policy and budget
(:func:`attngeom.kvcache.evaluation.experiment`, stage ``read``) and, with (prompt, reference) texts,
the answers under a budget (:func:`attngeom.kvcache.evaluation.answers`, stage ``answers``). It
returns every table the command writes (with the model's name), the summary and the settings.

What belongs here: composing the kvcache package's evaluations into the commands' results and the
schema of their summaries. Not here: the evaluations (:mod:`attngeom.kvcache.evaluation`,
:mod:`attngeom.kvcache.tasks`), the figures (:mod:`attngeom.reports.kvcache`,
:mod:`attngeom.reports.kvtasks`), the options (:mod:`attngeom.commands.kvcache`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from attngeom.errors import InputError
from attngeom.kvcache.settings import KVCacheSettings
from attngeom.model.arguments import takes_handle
from attngeom.stats.resampling import MIN_UNITS, format_number

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike

GQA_POOLING = "mean over the query heads of a key/value head (tova: mean over the layer)"
"""How a per-query-head score becomes one per key/value head, as the summary says."""
CALIBRATION_STAGE = "calibration"


@takes_handle
def calibration_regimes(handle: ModelHandleLike, run: RunLike | None, windows: Sequence) -> pd.DataFrame:
    """The head taxonomy (``layer, head, regime``) of ``windows`` (stage ``calibration`` of
    ``run``, one window per record): what the ``taxonomy`` policy budgets by."""
    from attngeom.heads.experiment import taxonomy_of, taxonomy_stage

    records = taxonomy_stage(handle, run, CALIBRATION_STAGE, windows, batch_size=1)
    table, _ = taxonomy_of(records, range(len(windows)), sink=0, winner_norm="raw")
    return table[["layer", "head", "regime"]]


@takes_handle
def reference_examples(handle: ModelHandleLike, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(prompt, reference) texts as token ids: the prompt as the model reads a text (BOS first),
    the reference as its continuation (no special tokens)."""
    from attngeom.streaming.passes import to_ids

    return [(to_ids(handle, p), handle.tokenizer(r, add_special_tokens=False)["input_ids"]) for p, r in pairs]


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, windows: Sequence[Sequence[int]],
               settings: KVCacheSettings = KVCacheSettings(), *, calibration: Sequence = (),
               answers: Sequence[tuple[str, str]] | None = None, new_tokens: int = 16) -> ExperimentResult:
    """``attngeom kvcache``'s experiment: ``windows`` read under every policy and budget of
    ``settings``; the ``calibration`` windows give the head regimes when a policy needs them
    (:func:`calibration_regimes`; refused in one line when there is none); ``answers``, (prompt,
    reference) texts, are answered under every budget with ``new_tokens`` greedy tokens.

    Tables, as the command writes them (the model's name in a last column ``model``): ``reads``,
    ``summary``, ``pairs`` (:func:`attngeom.kvcache.evaluation.experiment`), with answers
    ``answers`` and ``answers-summary``, with regimes ``regimes`` (no model column). The summary
    holds ``results`` (the summary table's rows) and with answers ``examples`` and ``answers``."""
    from attngeom.kvcache import evaluation
    from attngeom.kvcache.policies import needs_regimes

    regimes = None
    if needs_regimes(settings.policies):
        if not calibration:
            raise InputError(f"the corpus gives {len(windows)} window(s): none is left beyond the evaluated ones "
                             "(--max-windows) to calibrate the taxonomy policy's head regimes")
        regimes = calibration_regimes(handle, run, calibration)
    result = evaluation.experiment(handle, run, windows, settings, regimes=regimes)
    name = getattr(handle, "name", "")
    tables = {k: result.tables[k].assign(model=name) for k in ("reads", "summary", "pairs")}
    if answers:
        rows = evaluation.answers(handle, run, reference_examples(handle, answers), settings.policies,
                                  settings.budgets, new_tokens, regimes)
        tables["answers"] = rows.assign(model=name)
        tables["answers-summary"] = evaluation.summarize_answers(rows).assign(model=name)
        result.summary.update({"examples": len(answers), "new_tokens": new_tokens,
                               "answers": tables["answers-summary"].drop(columns="model").to_dict(orient="records")})
    if regimes is not None:
        tables["regimes"] = regimes
    result.tables = tables
    return result


def run_summary(result: ExperimentResult, windows: Sequence, *, model: str, data: str, window: int,
                identity: dict) -> dict:
    """``summary.json`` of ``attngeom kvcache`` from :func:`experiment`'s ``result`` on ``windows``:
    the input, the policies and budgets, ``results`` (per policy and budget), with answers their
    ``examples``, ``new_tokens`` and ``answers``, and the run's ``identity``. :func:`headline`
    reads the report's numbers from it."""
    s = result.settings
    return {"command": "kvcache", "model": model, "data": data, "window": window, "windows": len(windows),
            "tokens": int(sum(len(w) - 1 for w in windows)), "chunk": s["chunk"], "policies": list(s["policies"]),
            "budgets": list(s["budgets"]), "gqa_pooling": GQA_POOLING, **result.summary, "settings": identity}


def headline(summary: dict) -> list[tuple[str, str]]:
    """The headline numbers of ``attngeom kvcache``' report from its :func:`run_summary`: each
    policy's perplexity at each budget with its interval and its difference to the full cache."""
    f = format_number
    out = []
    seen_full = False
    for r in summary["results"]:
        if r["policy"] == "full":          # read once per window: the same row at every budget
            if seen_full:
                continue
            seen_full = True
            r = {**r, "budget": "any"}
        iv = "" if r.get("ppl_low") is None else f" [{f(r['ppl_low'])}, {f(r['ppl_high'])}]"
        delta = "" if r.get("delta_ppl") is None or r["policy"] == "full" else \
            f"; vs full {f(r['delta_ppl'], True)}" + ("" if r.get("delta_low") is None else
                                                     f" [{f(r['delta_low'], True)}, {f(r['delta_high'], True)}]")
        out.append((f"perplexity, {r['policy']}" + ("" if r["policy"] == "full" else f" at budget {r['budget']}"),
                    f(r["ppl"]) + iv + delta))
    return out


def task_run_summary(result: ExperimentResult, examples: Sequence, *, model: str, length: int,
                     identity: dict) -> dict:
    """``summary.json`` of ``attngeom kvtasks`` from :func:`attngeom.kvcache.tasks.experiment`'s
    ``result`` on ``examples``: the tasks, the mode, whether the chat template applied, the policies
    and ratios, the best baseline per ratio, ``results`` and ``verdicts``, ``ruler_average``
    (:func:`attngeom.kvcache.averages.record`: the tasks whose full-cache accuracy is below the
    floor, kvpress's RULER average with and without them), and the run's ``identity``.
    :func:`task_headline` reads the report's numbers from it."""
    from attngeom.kvcache import averages
    from attngeom.kvcache.tasks import best_baselines

    s = result.settings
    return {"command": "kvtasks", "model": model, "examples": len(examples),
            "tasks": sorted({e.task for e in examples}), "length": length, "mode": s["mode"],
            "chat_template": bool(result.tables["answers"]["chat"].any()), "policies": list(s["policies"]),
            "ratios": list(s["ratios"]),
            "best_baselines": {str(k): v for k, v in best_baselines(result.tables["summary"]).items()},
            **result.summary, "ruler_average": averages.record(result.tables["summary"]), "settings": identity}


def task_headline(summary: dict) -> list[tuple[str, str]]:
    """The headline numbers of ``attngeom kvtasks``' report from its :func:`task_run_summary`: the
    examples, the accuracy of every policy and ratio over all tasks with its interval, the verdicts
    against the best baseline."""
    f = format_number
    n = summary["examples"]
    out = [("examples", f"{n} ({', '.join(summary['tasks'])}); {summary['mode']}; "
                        + ("chat template" if summary["chat_template"] else "no chat template"))]
    if n < MIN_UNITS:
        out.append(("intervals", f"none: too few examples ({n}; intervals need at least {MIN_UNITS})"))
    rows = summary["results"]
    task = "all" if any(r["task"] == "all" for r in rows) else (rows[0]["task"] if rows else None)
    for r in rows:
        if r["task"] != task:
            continue
        iv = "" if r.get("low") is None or r["low"] != r["low"] else f" [{f(r['low'])}, {f(r['high'])}]"
        what = "full cache" if r["policy"] == "full" else f"{r['policy']} at ratio {f(r['ratio'])}"
        out.append((f"accuracy, {what}", f(r["accuracy"]) + iv))
    for v in summary["verdicts"]:
        out.append((f"{v['policy']} vs {v['baseline']} (best baseline) at ratio {f(v['ratio'])}",
                    f"{f(v['delta'], True)}: {v['verdict']}"))
    from attngeom.kvcache.averages import said

    rec = summary["ruler_average"]
    out.append((f"tasks below the floor (full-cache accuracy under {100 * rec['floor']:g} %: they cannot "
                "tell policies apart)", said(rec)))
    for r in rec["averages"]:
        what = "full cache" if r["policy"] == "full" else f"{r['policy']} at ratio {f(r['ratio'])}"
        kept = "—" if r["average_discriminating"] is None else f"{r['average_discriminating']:.2f}"
        out.append((f"RULER average as kvpress computes it, {what}",
                    f"{r['average']:.2f} over {r['tasks']} tasks; {kept} over the {r['discriminating_tasks']} "
                    "at or above the floor"))
    return out
