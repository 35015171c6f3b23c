"""Long-context tasks under KV-cache compression (docs/kvcache.md): every policy at every
compression ratio, scored the way the field scores it (RULER's string match, kvpress's protocol).

Each example (:mod:`attngeom.kvcache.ruler`) is one resumable unit of a
:class:`~attngeom.runs.run.Run`: its context is read once in a captured prefill that records every
policy's scores (:func:`attngeom.kvcache.prefill.prefill`); at each ratio every policy's kept
entries are gathered into a cache of its own (one batch row, its heads padded to its own largest
only), and the question and the greedy answers of the full cache (ratio 0) and of every ratio are
decoded as one batch (:func:`attngeom.kvcache.prefill.greedy_answers`: each row over its own cache, a
row that has finished leaves without copying the others; in as few batches as the memory allows).
:func:`summarize` gives the accuracy per (task, policy, ratio) and over all tasks with 95 % bootstrap
intervals over examples; :func:`paired` the paired differences against the best baseline at each
ratio (none below :data:`~attngeom.stats.resampling.MIN_UNITS` examples).

What belongs here: the examples for a model (made, encoded and checked against its positions and
the memory, before any prefill) and the experiment over them with its summaries. Not here: the
checks that need no model (:mod:`attngeom.kvcache.examples`), the protocol
(:mod:`attngeom.kvcache.prefill`), the scores (:mod:`attngeom.kvcache.policies`), the task
generator (:mod:`attngeom.kvcache.ruler`), argument parsing (:mod:`attngeom.commands.kvtasks`).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import pandas as pd

from attngeom.errors import InputError
from attngeom.kvcache import prefill as P
from attngeom.kvcache.cache import cache_bytes_estimate, check_memory, memory_limit
from attngeom.kvcache.examples import ALL_TASKS, check_examples, example_name  # noqa: F401  (ALL_TASKS: the summary's rows over every task)
from attngeom.kvcache.policies import get_policy
from attngeom.kvcache.settings import KVTaskSettings
from attngeom.model.arguments import takes_handle
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike


def check_policies(names: Sequence[str]) -> list[str]:
    """The policies of a task run: known, not ``full`` (the ratio-0 reference is always run) and
    not ``taxonomy`` (its per-head budgets need a calibration taxonomy)."""
    out = []
    for n in names:
        p = get_policy(n)
        if p.name in ("full", "taxonomy"):
            raise InputError(f"the {p.name} policy has no compression ratio "
                             + ("(the full cache is always run as the ratio-0 reference)" if p.name == "full"
                                else "(its budgets come from a head taxonomy; use attngeom kvcache)"))
        out.append(p.name)
    if not out:
        raise InputError("--policies names no policy")
    return out


def check_ratios(ratios: Sequence[float]) -> list[float]:
    out = [float(r) for r in ratios]
    if not out or any(not 0.0 < r < 1.0 for r in out):
        raise InputError(f"--ratios are shares of the cache removed, each in (0, 1); got {list(ratios)}")
    return out


# --------------------------------------------------------------------------------------------
# Examples for a model
# --------------------------------------------------------------------------------------------

EXAMPLE_HINT = "use a shorter --length, examples with fewer tokens, or fewer tokens to generate"
"""What an example too long for the model's positions is told to change."""


def prompt_tokens(tokenizer, ex) -> int:
    """An example's ``length`` as :mod:`~attngeom.kvcache.ruler` defines it, in ``tokenizer``'s tokens:
    the plain prompt's, special tokens (BOS) included, no chat template."""
    from attngeom.kvcache.ruler import count_tokens

    return count_tokens(tokenizer, ex.context + ex.question + ex.answer_prefix)


def encode_examples(handle, examples: Sequence, chat: bool | None = None) -> list[tuple[list[int], list[int], bool]]:
    """:func:`attngeom.kvcache.ruler.encode_example` of every example, after
    :func:`~attngeom.kvcache.examples.check_examples`: a context that cannot be split from its
    question, an empty context, or more positions than the model has (``context + question +
    max_new_tokens``) is one :class:`InputError` naming the example."""
    from attngeom.kvcache import ruler
    from attngeom.model.arguments import check_positions

    check_examples(examples)
    out = []
    for ex in examples:
        try:
            ctx, q, applied = ruler.encode_example(ex, handle.tokenizer, chat)
        except ValueError as e:
            raise InputError(f"{example_name(ex)}: {e}") from None
        if not ctx or not q:
            raise InputError(f"{example_name(ex)}: its {'context' if not ctx else 'question'} has no tokens")
        check_positions(handle, len(ctx) + len(q) + ex.max_new_tokens,
                        f"{example_name(ex)} ({len(ctx) + len(q)} prompt tokens, up to {ex.max_new_tokens} generated)", EXAMPLE_HINT)
        out.append((ctx, q, applied))
    return out


def check_length(handle, length: int, tasks: Sequence[str], rows: int) -> None:
    """A ``--length`` to make examples of ``tasks`` at, before any is made: its prompt and the longest
    answer of the tasks within the model's positions, and the caches of ``rows`` variants within the
    memory (:func:`check_memory`)."""
    from attngeom.kvcache.ruler import TASKS
    from attngeom.model.arguments import check_positions

    new = max(TASKS[t].max_new_tokens for t in tasks)
    check_positions(handle, length + new, f"--length {length} (and up to {new} tokens generated)",
                    "use a shorter --length")
    check_memory(handle, length + new, rows)


def make_examples(tokenizer, tasks: Sequence[str], length: int, n: int, seed: int, haystack, first: int = 0) -> list:
    """:func:`attngeom.kvcache.ruler.make_examples` of every task of ``tasks``; a length a task cannot
    be made at is one :class:`InputError`."""
    from attngeom.kvcache import ruler

    try:
        return [e for t in tasks for e in ruler.make_examples(tokenizer, t, length, n, seed, haystack, first=first)]
    except (ValueError, RuntimeError) as e:
        raise InputError(f"--length {length}: {e}") from None


# --------------------------------------------------------------------------------------------
# One example
# --------------------------------------------------------------------------------------------


@takes_handle
def answer_example(handle: ModelHandleLike, example, settings: KVTaskSettings, encoded=None) -> pd.DataFrame:
    """One example under every (policy, ratio) of ``settings`` and the full cache (``policy``
    ``"full"``, ``ratio`` 0): one row each with the ``answer`` text, its ``score`` (RULER's string
    match; an answer stops as soon as it holds every reference string, since its score can then no
    longer change: the text is cut there), ``kept`` (entries kept over the compressed layers and heads), ``kept_share`` (of the full
    cache's), ``bytes`` (the variant's cache storage, its heads padded to its largest) and
    ``seconds`` (its ratio's selections and caches, and the decoding, per variant; the prefill's in
    ``prefill_seconds``). The ratios' variants are decoded as one batch, or in as few batches as
    :func:`memory_limit` allows. ``encoded``: :func:`~attngeom.kvcache.ruler.encode_example`'s result, when
    already made."""
    from attngeom.kvcache import ruler

    ctx_ids, q_ids, chat = encoded or ruler.encode_example(example, handle.tokenizer, settings.chat)
    query_aware = settings.mode == P.QUERY_AWARE
    policies = [get_policy(n) for n in settings.policies]
    pre = P.prefill(handle, ctx_ids + q_ids if query_aware else ctx_ids, policies)
    question = None if query_aware else q_ids
    room = len(q_ids) + example.max_new_tokens
    base = {"example": example.index, "task": example.task, "mode": settings.mode, "chat": chat,
            "context_tokens": len(ctx_ids), "question_tokens": len(q_ids)}

    def settled(ids: list[int]) -> bool:                      # every reference found: the score is final
        return ruler.string_match_all(handle.tokenizer.decode(ids, skip_special_tokens=True), example.answers) == 1.0

    def answer(batch: list[dict]) -> list[dict]:              # several ratios' variants, decoded together
        t0 = time.perf_counter()
        answers = iter(P.greedy_answers(handle, [c for v in batch for c in v["caches"]], question, pre.logits,
                                        example.max_new_tokens, settled))
        decoding = (time.perf_counter() - t0) / sum(len(v["names"]) for v in batch)
        rows = []
        for v in batch:
            for name, sel, size in zip(v["names"], v["sels"], v["bytes"]):
                ids = next(answers)
                text = handle.tokenizer.decode(ids, skip_special_tokens=True)
                rows.append({**base, "policy": name, "ratio": v["ratio"], "answer": text,
                             "score": ruler.string_match_all(text, example.answers), "answer_tokens": len(ids),
                             "kept": sel.kept(), "bytes": size, "seconds": v["seconds"] / len(v["names"]) + decoding})
        return rows

    limit = memory_limit(handle.device)
    rows, batch, held = [], [], 0
    for names, ratio in [(["full"], 0.0)] + [(list(settings.policies), r) for r in settings.ratios]:
        t0 = time.perf_counter()
        sels = [P.selection_at_ratio(pre, n, ratio, handle.num_heads) for n in names]
        need = sum(cache_bytes_estimate(handle, _largest_head(s, pre.n) + room, 1) for s in sels)
        spent = time.perf_counter() - t0
        if batch and limit is not None and held + need > limit:      # decode the ratios held so far first
            rows += answer(batch)                                     # (their time is theirs, not this ratio's)
            batch, held = [], 0
        t0 = time.perf_counter()
        caches = [P.variant_cache(handle, pre, [s], room=room) for s in sels]    # each variant its own
        sizes = [P.row_bytes(handle, c) for c in caches]
        batch.append({"names": names, "ratio": ratio, "sels": sels, "caches": caches, "bytes": sizes,
                      "seconds": spent + time.perf_counter() - t0})
        held += sum(sizes)                                        # what is held (the estimate decided before)
    rows += answer(batch)
    df = pd.DataFrame(rows)
    df["kept_share"] = df["kept"] / float(df.loc[df["policy"] == "full", "kept"].iloc[0])
    df["prefill_seconds"] = pre.seconds
    return df


def _largest_head(sel, n: int) -> int:
    """Entries of the selection's largest head (its cache's size per head, padding included)."""
    return max((i.shape[-1] for i in sel.idx.values()), default=n)


# --------------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------------


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, examples: Sequence, settings: KVTaskSettings = KVTaskSettings()
               ) -> ExperimentResult:
    """Every example of ``examples`` (:class:`~attngeom.kvcache.ruler.Example`) under every policy and
    ratio of ``settings``, each example a unit of stage ``"tasks"`` of ``run`` (resumable; shared
    among processes under torchrun). Tables: ``answers`` (:func:`answer_example`'s rows),
    ``summary`` (:func:`summarize`), ``pairs`` (:func:`paired`)."""
    from attngeom.runs.run import fingerprint, run_or_in_memory

    check_policies(settings.policies)
    check_ratios(settings.ratios)
    if not examples:
        raise InputError("no examples to evaluate")
    encoded = encode_examples(handle, examples, settings.chat)      # checked: fields, tokens, the model's positions
    check_memory(handle, max(len(c) + len(q) + e.max_new_tokens for (c, q, _), e in zip(encoded, examples)),
                 len(settings.policies))
    fps = [fingerprint([len(c)] + c + q) for c, q, _ in encoded]        # what the model reads, and the split

    def work(units: list[int]) -> dict:
        return {"rows": pd.concat([answer_example(handle, examples[u], settings, encoded[u]) for u in units],
                                  ignore_index=True)}

    recs = run_or_in_memory(run).stage("tasks", len(examples), work, fingerprints=fps, desc="kvtasks", unit="example")
    df = pd.concat([d["rows"] for d in recs.values()], ignore_index=True)
    df = df.sort_values(["task", "example", "ratio", "policy"], kind="stable").reset_index(drop=True)
    summary = summarize(df, settings.n_resamples)
    pairs = paired(df, settings.n_resamples)
    return ExperimentResult("kvtasks", {"answers": df, "summary": summary, "pairs": pairs},
                            {"results": summary.to_dict(orient="records"), "verdicts": verdicts(pairs)}, {},
                            settings.record())


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def overall(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of a summary or pairs table over every task (:data:`ALL_TASKS`; the one task's rows
    when there is one task)."""
    if not len(df):
        return df
    return df[df["task"] == (ALL_TASKS if (df["task"] == ALL_TASKS).any() else df["task"].iloc[0])]


def _units(df: pd.DataFrame) -> pd.Series:
    return df["task"].astype(str) + "/" + df["example"].astype(str)


def _with_all(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    tasks = sorted(df["task"].unique())
    return [(t, df[df["task"] == t]) for t in tasks] + ([(ALL_TASKS, df)] if len(tasks) > 1 else [])


def _task_weights(units: list[str]) -> np.ndarray:
    """One weight per unit (``task/example``), inversely proportional to the examples of its task,
    so that over all tasks each task weighs the same whatever its number of examples (RULER's
    average over tasks). With as many examples per task every weight is exactly 1: the plain mean."""
    tasks = [u.rsplit("/", 1)[0] for u in units]
    n = pd.Series(tasks).value_counts()
    return np.array([n.max() / n[t] for t in tasks], dtype=float)


def summarize(df: pd.DataFrame, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per (task, policy, ratio), and over all tasks: ``accuracy`` (mean score, 0–1) with its 95 %
    bootstrap interval over examples (NaN below :data:`~attngeom.stats.resampling.MIN_UNITS`),
    ``examples``, the mean ``kept_share`` and ``bytes``, and ``seconds`` per variant. Over all tasks
    every mean is the mean over tasks (:func:`_task_weights`: a sample gathered in parts may hold
    more examples of some tasks); the interval resamples the examples."""
    from attngeom.stats.resampling import percentile_interval, ratio_of_sums, resample_counts

    rows = []
    for task, g in _with_all(df):
        units = sorted(_units(g).unique())
        counts, w = resample_counts(len(units), n_resamples, seed), _task_weights(units)
        for (policy, ratio), h in g.groupby(["policy", "ratio"], sort=True):
            by_unit = h.assign(u=_units(h)).set_index("u").loc[units]

            def mean(col):
                return float((w * by_unit[col].to_numpy(float)).sum() / w.sum())

            x = by_unit["score"].to_numpy(float)
            lo, hi = percentile_interval(ratio_of_sums(counts, w * x, w), units=len(units))
            rows.append({"task": task, "policy": policy, "ratio": float(ratio), "examples": len(units),
                         "accuracy": mean("score"), "low": float(lo), "high": float(hi),
                         "kept_share": mean("kept_share"), "bytes": mean("bytes"), "seconds": mean("seconds")})
    return pd.DataFrame(rows)


def geometry_of(policies, known: dict[str, bool] | None = None) -> dict[str, bool]:
    """Whether each policy derives from the papers' geometry: ``known`` (what a run recorded, e.g.
    its ``pairs.parquet``'s ``geometry`` column), else the policy of that name in this process's
    registry (a policy of one's own is registered when a run loads it). A name known to neither is
    refused in one line."""
    known = dict(known or {})
    out = {}
    for p in dict.fromkeys(policies):
        recorded = known.get(p)                  # a flag read from a table: no tensor, nothing on a device
        if recorded is not None:
            out[p] = bool(recorded)
            continue
        try:
            out[p] = bool(get_policy(p).geometry)
        except InputError:
            raise InputError(f"policy {p!r} is neither attngeom's nor recorded with its kind in these rows "
                             "(a stopped run of a policy of one's own): finish the run, then merge it") from None
    return out


def recorded_geometry(folder) -> dict[str, bool]:
    """Each policy's kind as a finished run or a merged folder recorded it (the ``geometry`` column
    of its ``pairs.parquet``; empty where there is none): how a policy of one's own, which this
    process has not loaded, is told apart from a baseline (:func:`geometry_of`)."""
    from pathlib import Path

    pairs = Path(folder) / "pairs.parquet"
    if not pairs.is_file():
        return {}
    kinds = pd.read_parquet(pairs, columns=["policy", "geometry"]).drop_duplicates("policy")
    return {str(p): bool(g) for p, g in zip(kinds["policy"], kinds["geometry"])}


def best_baselines(summary: pd.DataFrame, geometry: dict[str, bool] | None = None) -> dict[float, str]:
    """Per ratio, the baseline (a policy not derived from the papers' geometry, :func:`geometry_of`)
    with the highest accuracy over all tasks (ties: the first by name)."""
    rows = overall(summary)
    flags = geometry_of(rows["policy"], geometry)
    out = {}
    for ratio, g in rows[rows["ratio"] > 0].groupby("ratio"):
        base = g[[not flags[p] for p in g["policy"]]]
        if len(base):
            out[float(ratio)] = str(base.sort_values(["accuracy", "policy"], ascending=[False, True])["policy"].iloc[0])
    return out


def paired(df: pd.DataFrame, n_resamples: int = 1000, seed: int = 0,
           baselines: dict[float, str] | None = None, geometry: dict[str, bool] | None = None) -> pd.DataFrame:
    """Every policy against the best baseline at each ratio (:func:`best_baselines`, or the policy
    ``baselines`` names at each ratio), per task and over all tasks (each task weighing the same, as
    in :func:`summarize`), on the same resamples of the examples: the accuracy difference ``delta``
    with its 95 % interval and ``better_share``, the share of resamples where the policy is ahead.
    ``geometry``: each policy's kind where the registry may not know it (:func:`geometry_of`)."""
    from attngeom.stats.resampling import percentile_interval, ratio_of_sums, resample_counts

    flags = geometry_of(df["policy"], geometry)
    best = best_baselines(summarize(df, n_resamples=1, seed=seed), flags) if baselines is None else baselines
    rows = []
    for task, g in _with_all(df):
        units = sorted(_units(g).unique())
        counts, w = resample_counts(len(units), n_resamples, seed), _task_weights(units)
        for ratio, ref in best.items():
            h = g[g["ratio"] == ratio].assign(u=lambda x: _units(x))
            wide = h.pivot(index="u", columns="policy", values="score").loc[units]
            for policy in wide.columns:
                d = (wide[policy] - wide[ref]).to_numpy(float)
                boot = ratio_of_sums(counts, w * d, w)
                lo, hi = percentile_interval(boot, units=len(units))
                rows.append({"task": task, "ratio": ratio, "policy": policy, "baseline": ref,
                             "geometry": flags[policy], "examples": len(units),
                             "delta": float((w * d).sum() / w.sum()), "low": float(lo), "high": float(hi),
                             "better_share": float(np.mean(boot > 0))})
    return pd.DataFrame(rows)


def verdicts(pairs: pd.DataFrame) -> list[dict]:
    """The question the field asks, per ratio (over all tasks): does a geometry-derived policy beat
    the best value-aware or attention baseline at equal memory? ``beats`` when its interval lies
    above 0, ``loses`` below, ``tie`` across it, ``too few examples`` without an interval."""
    from attngeom.stats.resampling import TOO_FEW

    rows = overall(pairs)
    if not len(rows):
        return []
    out = []
    for _, r in rows[rows["geometry"]].iterrows():
        if np.isnan(r["low"]):
            v = TOO_FEW.replace("windows", "examples")
        else:
            v = "beats" if r["low"] > 0 else "loses" if r["high"] < 0 else "tie"
        out.append({"ratio": float(r["ratio"]), "policy": r["policy"], "baseline": r["baseline"],
                    "delta": float(r["delta"]), "low": float(r["low"]), "high": float(r["high"]), "verdict": v})
    return out
