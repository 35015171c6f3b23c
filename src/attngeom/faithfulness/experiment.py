"""The faithfulness experiment of SPEC §3: comprehensiveness and sufficiency of token rankings.

For every unit (a corpus window, or one option of a multiple-choice example) and every
:class:`~attngeom.capture.interventions.Variant` (metric x mode x ratio [x seed], plus the clean forward),
the unit is run with the variant's masking at the chosen layers and its summed next-token NLL is
recorded. Several variants of one unit run as ONE batched forward: row ``b`` of the batch holds the
same tokens and uses variant ``b`` (:class:`~attngeom.capture.interventions.RankIntervention`), up to
``rows`` rows per forward.

Resumable and shareable: the work is one stage of an :class:`attngeom.runs.run.Run` whose units are
the (unit, variant) pairs; every batched forward is a record in the run's checkpoint as soon as it
is done, a rerun with the same settings skips the pairs already there, and the pairs can be shared
out among processes.

Results (:func:`summarize`):

- perplexity: ``PPL = exp(Σ NLL / Σ tokens)`` over all windows (the first token of each window is
  never predicted), ``change = PPL' − PPL_clean`` (``ΔPPL``);
- tasks: accuracy by option log-likelihood, ``change = acc' − acc_clean``.

Only units on which every variant has finished enter the summary, so partial runs compare all
variants on the same units. ``comprehensiveness_aoc``/``sufficiency_aoc`` are the mean change over
the ratios (for ``random``: over ratios and seeds); for perplexity ``*_log_aoc`` is the mean of
``ln(PPL'/PPL)`` as well, a scale-free companion that large ratios do not dominate. Orderings list the most faithful metric first:
for perplexity the largest comprehensiveness ΔPPL and the smallest sufficiency ΔPPL; for accuracy
the most negative comprehensiveness change and the largest (least negative) sufficiency change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from attngeom.model.arguments import takes_handle
from attngeom.capture.session import Session
from attngeom.errors import InputError
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike, check_scorable, perplexity
from attngeom.capture.interventions import CLEAN, MODES, RANK_METRICS, RankIntervention, Variant
from attngeom.streaming.reducers import InputBatch
from attngeom.runs.run import fingerprint
from attngeom.faithfulness.settings import FaithfulnessSettings
from attngeom.streaming.passes import batch_nll
from attngeom.stats import resampling

DEFAULT_SEEDS = FaithfulnessSettings.seeds



# --------------------------------------------------------------------------------------------
# Variants and checks
# --------------------------------------------------------------------------------------------


def check_metrics(metrics: Iterable[str]) -> list[str]:
    metrics = [m.strip() for m in metrics if m.strip()]
    if not metrics:
        raise InputError("no metric given")
    bad = [m for m in metrics if m not in RANK_METRICS]
    if bad:
        raise InputError(f"unknown metric {bad[0]!r}; known: {', '.join(RANK_METRICS)}")
    if len(set(metrics)) != len(metrics):
        raise InputError("a metric is listed twice")
    return metrics


def check_mask_ratios(ratios: Iterable[float]) -> list[float]:
    ratios = [float(r) for r in ratios]
    if not ratios:
        raise InputError("no ratio given")
    bad = [r for r in ratios if not (0.0 < r < 1.0)]
    if bad:
        raise InputError(f"ratio {bad[0]:g} is outside (0, 1): ratios are the share of sources masked per query")
    if len(set(ratios)) != len(ratios):
        raise InputError("a ratio is listed twice")
    return sorted(ratios)


def build_variants(metrics: Sequence[str], ratios: Sequence[float], seeds: Sequence[int] = DEFAULT_SEEDS,
                   per_head: bool = False, absolute: bool = False) -> list[Variant]:
    """The clean forward, then every metric x mode x ratio (x seed for ``random``)."""
    metrics = check_metrics(metrics)
    ratios = check_mask_ratios(ratios)
    if "random" in metrics and not seeds:
        raise InputError("the random ranking needs at least one seed")
    out = [CLEAN]
    for m in metrics:
        for mode in MODES:
            for r in ratios:
                for s in (seeds if m == "random" else (0,)):
                    out.append(Variant(m, mode, float(r), int(s), per_head=per_head, absolute=absolute))
    return out


def variants_of(settings: FaithfulnessSettings) -> list[Variant]:
    """The variants ``settings`` runs (:func:`build_variants`; bad settings raise InputError)."""
    return build_variants(settings.metrics, settings.ratios, settings.seeds, per_head=settings.per_head,
                          absolute=settings.absolute)


# --------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """Token ids to run, the number of scored next-token predictions at the end (``len(ids)-1``
    for a perplexity window), and the salt of its random ranking."""

    ids: tuple[int, ...]
    n_scored: int
    salt: int

    @property
    def digest(self) -> int:
        return fingerprint(self.ids) ^ self.n_scored


def window_units(windows: Sequence[Sequence[int]]) -> list[Unit]:
    return [Unit(tuple(int(x) for x in w), len(w) - 1, i) for i, w in enumerate(windows)]


@takes_handle
def auto_rows(handle: ModelHandleLike, length: int, budget_bytes: float = 3e9, cap: int = 32) -> int:
    """Rows per batched forward so that the float32 logits (and their log-softmax) fit ``budget_bytes``."""
    vocab = int(handle.model.config.vocab_size)
    return int(max(1, min(cap, budget_bytes // (8.0 * length * vocab))))


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def pair_nll(handle: ModelHandleLike, unit: Unit, chunk: Sequence[Variant], layers, prepared: dict | None = None) -> list[float]:
    """Summed NLL of ``unit`` under each variant of ``chunk``, in one batched forward (row ``b``
    uses variant ``b``). ``prepared``: a cache of the unit's maps computed before the forward
    (:func:`attngeom.capture.prepared.prepare`: gradients, rollouts), keyed by the unit's digest and
    filled on first use; a new unit replaces the last one's."""
    from attngeom.capture.prepared import prepare
    from attngeom.metrics import registry

    T = len(unit.ids)
    ids = torch.tensor(unit.ids, dtype=torch.long)[None].repeat(len(chunk), 1)
    batch = InputBatch(ids=ids, lengths=torch.full((len(chunk),), T), index=list(range(len(chunk))))
    cache = {} if prepared is None else prepared          # {unit digest: {name: {layer: map}}}: this unit's only
    if unit.digest not in cache:
        cache.clear()
    done = cache.setdefault(unit.digest, {})
    wanted = registry.prepared_names(v.metric for v in chunk if v.metric is not None and not v.clean)
    missing = [n for n in wanted if n not in done]
    if missing:                                           # together: the rollouts share one forward
        done.update({name: {} for name in missing})
        for layer, by_name in prepare(handle, unit.ids, unit.n_scored, missing).items():
            for name, m in by_name.items():
                done[name][layer] = m
    maps: dict = {}
    for name in wanted:
        for layer, m in done[name].items():
            maps.setdefault(layer, {})[name] = m
    session = Session(intervention=RankIntervention(chunk, salts=[unit.salt] * len(chunk)), layers=layers,
                      prepared=maps)
    return [float(x) for x in batch_nll(handle, batch, session, last=unit.n_scored)]


@takes_handle
def run_units(handle: ModelHandleLike, units: Sequence[Unit], variants: Sequence[Variant], *,
              layers: Iterable[int] | None = None, rows: int | None = None, progress: bool | str = True,
              run: RunLike | None = None) -> dict[tuple[int, str], dict]:
    """NLL of every (unit, variant): ``{(unit_index, variant.key): {"nll": Σ NLL, "tokens": n}}``.

    The work is one runner stage (:meth:`attngeom.runs.run.Run.stage`) whose units are the (unit,
    variant) pairs, pair ``p = u·V + k`` for variant ``k``; the pairs of one unit run together,
    ``rows`` per batched forward (default :func:`auto_rows`). With ``run`` every finished forward is
    a record (resume, sharding); without (:class:`~attngeom.runs.run.InMemoryRun`), in memory."""
    keys = [v.key for v in variants]
    if len(set(keys)) != len(keys):
        raise InputError("two variants have the same name")
    layers = None if layers is None else sorted(set(int(x) for x in layers))
    V = len(variants)
    R = rows or (auto_rows(handle, max(len(u.ids) for u in units)) if units else 1)

    prepared: dict = {}     # the current unit's gradients and rollouts, shared by its batched forwards

    def work(pairs: list[int]) -> dict:
        unit = units[pairs[0] // V]
        return {"nll": pair_nll(handle, unit, [variants[p % V] for p in pairs], layers, prepared)}

    from attngeom.runs.run import run_or_in_memory

    records = run_or_in_memory(run).stage(
        "faithfulness", len(units) * V, work, group=R, group_key=lambda p: p // V,
        fingerprints=[units[p // V].digest for p in range(len(units) * V)],
        desc=progress if isinstance(progress, str) else "faithfulness", unit="fwd")
    results: dict[tuple[int, str], dict] = {}
    for pairs, data in records.items():
        for p, x in zip(pairs, data["nll"]):
            u = p // V
            results[(u, keys[p % V])] = {"nll": float(x), "tokens": units[u].n_scored}
    return results


# --------------------------------------------------------------------------------------------
# Tables and summaries
# --------------------------------------------------------------------------------------------


def complete_units(results: dict, n_units: int, variants: Sequence[Variant]) -> list[int]:
    keys = [v.key for v in variants]
    return [u for u in range(n_units) if all((u, k) in results for k in keys)]


def ppl_table(results: dict, units: Sequence[int], variants: Sequence[Variant]) -> pd.DataFrame:
    """One row per variant: ``ppl``, ``clean``, ``change`` (ΔPPL), ``tokens``, ``units``."""
    def ppl(key):
        nll = sum(results[(u, key)]["nll"] for u in units)
        tok = sum(results[(u, key)]["tokens"] for u in units)
        return perplexity(nll, tok), tok

    return _variant_rows(variants, ppl, "ppl", len(units))


def task_table(results: dict, units: Sequence["TaskUnit"], examples: Sequence, variants: Sequence[Variant],
               done_examples: Sequence[int]) -> pd.DataFrame:
    """One row per variant: ``accuracy``, ``clean``, ``change``, ``tokens`` (scored), ``units`` (examples)."""
    from attngeom.faithfulness.tasks import accuracy

    by_ex: dict[int, list[int]] = {}
    for i, tu in enumerate(units):
        by_ex.setdefault(tu.example, []).append(i)
    exs = [examples[e] for e in done_examples]

    def acc(key):
        scores = {}
        tok = 0
        for new_e, e in enumerate(done_examples):
            for i in by_ex[e]:
                scores[(new_e, units[i].option)] = -results[(i, key)]["nll"]
                tok += results[(i, key)]["tokens"]
        return accuracy(scores, exs) if exs else float("nan"), tok

    return _variant_rows(variants, acc, "accuracy", len(done_examples))


def _variant_rows(variants: Sequence[Variant], measure, column: str, units: int) -> pd.DataFrame:
    """One row per intervened variant: ``measure(key) -> (value, tokens)`` beside the clean value."""
    clean, _ = measure(CLEAN.key)
    rows = []
    for v in variants:
        if v.metric is None:
            continue
        value, tokens = measure(v.key)
        rows.append({"metric": v.metric, "mode": v.mode, "ratio": v.ratio,
                     "seed": v.seed if v.metric == "random" else None, column: value, "clean": clean,
                     "change": value - clean, "tokens": tokens, "units": units})
    return pd.DataFrame(rows, columns=["metric", "mode", "ratio", "seed", column, "clean", "change", "tokens", "units"])


def resampled_statistics(change: np.ndarray, keys: Sequence[tuple], ratio: np.ndarray | None = None) -> dict:
    """The curve statistics, written once for :func:`summarize` (one sample, ``R = 1``) and
    :func:`resampled` (``R`` resamples): ``change [R, K]`` the change of the measure (ΔPPL, or the
    change of accuracy) under each of the ``K`` intervened variants, ``keys[k] = (metric, mode,
    ratio)`` that of column ``k``, and for perplexity ``ratio [R, K]`` = ``PPL'/PPL``. Returns arrays
    ``[R]``: ``aoc[(metric, mode)]`` (the mean change over the ratios, and the seeds for random),
    ``log_aoc[(metric, mode)]`` (given ``ratio``: the mean ``ln(PPL'/PPL)``) and
    ``delta[(metric, mode, ratio)]`` (the mean change at one ratio)."""
    groups: dict = {}
    for k, (metric, mode, _) in enumerate(keys):
        groups.setdefault((metric, mode), []).append(k)
    out: dict = {"aoc": {}, "log_aoc": {}, "delta": {}}
    for key, cols in groups.items():
        out["aoc"][key] = change[:, cols].mean(1)
        if ratio is not None:
            out["log_aoc"][key] = np.log(ratio[:, cols]).mean(1)
        by_ratio: dict = {}
        for c in cols:
            by_ratio.setdefault(keys[c][2], []).append(c)
        for r, cs in by_ratio.items():
            out["delta"][key + (r,)] = change[:, cs].mean(1)
    return out


def summarize(table: pd.DataFrame, measure: str = "ppl") -> dict:
    """AOC (mean change over ratios, and seeds for random; :func:`resampled_statistics` of the table's rows)
    per metric and mode, the spread over seeds of random, and the orderings."""
    out: dict = {"measure": measure, "metrics": {}}
    if table.empty:
        return out
    out["clean"] = float(table["clean"].iloc[0])
    ratio = (table["ppl"] / table["clean"]).to_numpy(dtype=np.float64)[None] if measure == "ppl" else None
    stats = resampled_statistics(table["change"].to_numpy(dtype=np.float64)[None],
                       list(zip(table["metric"], table["mode"], table["ratio"])), ratio)
    for m, g in table.groupby("metric", sort=False):
        d = {}
        for mode in MODES:
            d[f"{mode}_aoc"] = float(stats["aoc"].get((m, mode), [np.nan])[0])
            if measure == "ppl":  # a scale-free companion: mean log(PPL'/PPL) over the ratios
                d[f"{mode}_log_aoc"] = float(stats["log_aoc"].get((m, mode), [np.nan])[0])
            gm = g[g["mode"] == mode]
            if m == "random" and gm["seed"].notna().any():
                per_seed = gm.groupby("seed")["change"].mean()
                d[f"{mode}_aoc_per_seed"] = {str(int(s)): float(x) for s, x in per_seed.items()}
                d[f"{mode}_aoc_seed_std"] = float(per_seed.std(ddof=0))
        out["metrics"][m] = d
    names = list(out["metrics"])
    sign = 1.0 if measure == "ppl" else -1.0  # ppl: larger comprehensiveness change is more faithful
    out["order_comprehensiveness"] = sorted(names, key=lambda m: -sign * out["metrics"][m]["comprehensiveness_aoc"])
    out["order_sufficiency"] = sorted(names, key=lambda m: sign * out["metrics"][m]["sufficiency_aoc"])
    out["order_note"] = ("most faithful first: " + (
        "largest comprehensiveness ΔPPL, smallest sufficiency ΔPPL" if measure == "ppl" else
        "largest accuracy drop under comprehensiveness, smallest drop under sufficiency"))
    return out


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskUnit(Unit):
    example: int = 0
    option: int = 0


@takes_handle
def task_units(handle: ModelHandleLike, examples) -> list[TaskUnit]:
    from attngeom.faithfulness.tasks import encode_options

    return [TaskUnit(s.ids, s.n_cont, s.example, example=s.example, option=s.option)
            for s in encode_options(handle, examples)]


def complete_examples(results: dict, units: Sequence[TaskUnit], variants: Sequence[Variant]) -> list[int]:
    done = set(complete_units(results, len(units), variants))
    by_ex: dict[int, list[int]] = {}
    for i, tu in enumerate(units):
        by_ex.setdefault(tu.example, []).append(i)
    return [e for e in sorted(by_ex) if all(i in done for i in by_ex[e])]


# --------------------------------------------------------------------------------------------
# The whole experiment
# --------------------------------------------------------------------------------------------


def resampled(per_window: dict, weights: np.ndarray | None = None) -> dict:
    """The perplexity experiment's curves under resampling ``weights`` (bootstrap counts per window
    ``[R, W]``, :func:`attngeom.stats.resampling.resample_counts`; None: every window once, ``R = 1``),
    from its ``per_window`` (``nll [W, V]`` summed NLL per window and variant, column 0 the clean
    forward, ``tokens [W]``, ``variants``). Returns arrays ``[R]``: ``clean`` (its perplexity) and
    the :func:`resampled_statistics` of the resampled perplexities (``aoc``, ``log_aoc``, ``delta``)."""
    nll, tokens, variants = per_window["nll"], per_window["tokens"], per_window["variants"]
    counts = resampling.counts_or_once(weights, len(tokens))
    ppl = resampling.resampled_perplexity(counts, nll, tokens)                      # [R, V]
    cols = [k for k, v in enumerate(variants) if v.metric is not None]
    keys = [(variants[k].metric, variants[k].mode, variants[k].ratio) for k in cols]
    clean = ppl[:, :1]
    return {"clean": ppl[:, 0], **resampled_statistics(ppl[:, cols] - clean, keys, ppl[:, cols] / clean)}


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, units: Sequence[Unit],
               settings: FaithfulnessSettings = FaithfulnessSettings(), *, progress: bool | str = True, examples=None,
               meta: dict | None = None) -> ExperimentResult:
    """Run (or, with a ``run`` holding records, resume) the experiment on ``units`` with ``settings``
    (:class:`~attngeom.faithfulness.settings.FaithfulnessSettings`; ``examples``: score a multiple-choice task).

    Returns an :class:`~attngeom.runs.contract.ExperimentResult`: ``tables["table"]``, one row per
    intervened variant (:func:`ppl_table` or :func:`task_table`); ``summary``, :func:`summarize` plus
    units done/total and ``settings`` (``meta``); ``per_window["variants"]`` (:func:`variants_of`)
    and, for perplexity, ``nll`` (summed NLL ``[W, V]`` per finished window and variant, columns in
    the order of the variants), ``tokens [W]`` and ``windows`` (their indices). Only units on which
    every variant has finished enter the result."""
    variants = variants_of(settings)
    measure = "accuracy" if examples is not None else "ppl"
    if examples is None:
        check_scorable(sum(u.n_scored for u in units), "the input")
    results = run_units(handle, units, variants, layers=settings.layers, rows=settings.rows, progress=progress,
                        run=run)
    per_window: dict = {"variants": variants}
    if examples is None:
        done = complete_units(results, len(units), variants)
        table = ppl_table(results, done, variants)
        n_done, n_all = len(done), len(units)
        per_window |= {"windows": done,
                      "nll": np.array([[results[(u, v.key)]["nll"] for v in variants] for u in done],
                                      dtype=np.float64).reshape(len(done), len(variants)),
                      "tokens": np.array([units[u].n_scored for u in done], dtype=np.float64)}
    else:
        done = complete_examples(results, units, variants)
        table = task_table(results, units, examples, variants, done)
        n_done, n_all = len(done), len(examples)
    summary = summarize(table, measure)
    summary.update({"units_done": n_done, "units_total": n_all, "complete": n_done == n_all,
                    "unit": "example" if examples is not None else "window",
                    "variants": len(variants), "settings": dict(meta or {})})
    return ExperimentResult("faithfulness", tables={"table": table}, summary=summary, per_window=per_window,
                            settings=settings.record())


# --------------------------------------------------------------------------------------------
# The command's summary.json: built here, and read back here for the report's headline
# --------------------------------------------------------------------------------------------


def headline(summary: dict) -> list[tuple[str, str]]:
    """The headline numbers of ``attngeom faithfulness``' report from the summary :func:`experiment`
    returns (its ``summary.json``): the clean perplexity or accuracy, each ranking's AOCs and the
    orders (a missing field raises)."""
    from attngeom.stats.resampling import format_number as f

    measure = summary["measure"]
    what = "ΔPPL" if measure == "ppl" else "Δaccuracy"
    out = [(f"clean {measure}", f(summary["clean"]))]
    if measure == "ppl":      # the raw ΔPPL grows without bound where a removal breaks the model: ΔNLL beside it
        out += [(f"{m}: comprehensiveness / sufficiency AOC, ΔNLL (mean ln PPL′/PPL, nats); ΔPPL",
                 f"{f(d['comprehensiveness_log_aoc'])} / {f(d['sufficiency_log_aoc'])}; "
                 f"{f(d['comprehensiveness_aoc'])} / {f(d['sufficiency_aoc'])}") for m, d in summary["metrics"].items()]
    else:
        out += [(f"{m}: comprehensiveness / sufficiency AOC ({what})",
                 f"{f(d['comprehensiveness_aoc'])} / {f(d['sufficiency_aoc'])}") for m, d in summary["metrics"].items()]
    out += [(f"most faithful first, {k}", ", ".join(summary[f"order_{k}"])) for k in ("comprehensiveness", "sufficiency")]
    return out
