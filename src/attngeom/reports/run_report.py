"""``report.md`` of the corpus commands (sinks, selection, heads, faithfulness, kvcache, corpus-mode
analyze) and of ``explore``: what was run, the headline numbers and what each file holds, for a reader of the
output directory. ``attngeom analyze`` on one text has its own (:mod:`attngeom.reports.analyze`);
``attngeom claims`` writes ``claims.md`` (:mod:`attngeom.reports.claims`) and this short report
beside it.

Each command's headline numbers come from its ``summary.json`` content through one function of
:data:`HEADLINES`; numbers are written by :func:`attngeom.stats.resampling.format_number`, and
every string from the user, the model or the data is escaped (:mod:`attngeom.reports.markdown`).
"""

from __future__ import annotations

from typing import Callable

from attngeom.metrics import registry
from attngeom.reports import markdown as md
from attngeom.stats.resampling import MIN_UNITS, format_number

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


def _f(x, signed: bool = False) -> str:
    return format_number(x, signed)


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _sinks(s: dict) -> list[tuple[str, str]]:
    m = next(iter(s["models"].values()))
    return [("median value-norm ratio, non-sink / sink", _f(m.get("value_norm_ratio"))),
            ("heads whose sink value is anti-aligned with the semantic tokens", _pct(m.get("anti_aligned_share"))),
            ("heads with an interior minimum of the output norm in the sink rate", _pct(m.get("interior_minimum_share"))),
            ("perplexity of the unedited model", _f(m.get("ppl"))),
            ("ΔPPL, sink removed", _f(m.get("removal_delta_ppl"), True)),
            ("ΔPPL, mass-matched control removed", _f(m.get("control_delta_ppl"), True))]


def _selection(s: dict) -> list[tuple[str, str]]:
    out = []
    for d in s.get("distances", []):
        ws = s.get(d, {}).get("with_sink", {})
        for n in s.get("ns", []):
            top, rnd = ws.get("f_topn", {}).get(n, ws.get("f_topn", {}).get(str(n))), \
                ws.get("f_random", {}).get(n, ws.get("f_random", {}).get(str(n)))
            out.append((f"F_N at N = {n} ({d}): top-N / random", f"{_f(top)} / {_f(rnd)}"))
    out.append(("bound violations", str(s.get("bound_violations"))))
    return out


def _heads(s: dict) -> list[tuple[str, str]]:
    out = [(f"regime shares, {corpus}", ", ".join(f"{r} {_pct(v)}" for r, v in shares.items()))
           for corpus, shares in s.get("regime_share", {}).items()]
    out.append(("regime order chosen on calibration (first removed first)", " > ".join(s.get("taxonomy_regime_order", []))))
    out.append(("individually critical heads", str(len(s.get("critical_heads", [])))))
    return out


def _faithfulness(s: dict) -> list[tuple[str, str]]:
    what = "ΔPPL" if s.get("measure", "ppl") == "ppl" else "Δaccuracy"
    out = [(f"clean {s.get('measure', 'ppl')}", _f(s.get("clean")))]
    out += [(f"{m}: comprehensiveness / sufficiency AOC ({what})",
             f"{_f(d.get('comprehensiveness_aoc'))} / {_f(d.get('sufficiency_aoc'))}") for m, d in s["metrics"].items()]
    out += [(f"most faithful first, {k}", ", ".join(s.get(f"order_{k}", []))) for k in ("comprehensiveness", "sufficiency")]
    return out


def _kvcache(s: dict) -> list[tuple[str, str]]:
    out = []
    seen_full = False
    for r in s.get("results", []):
        if r["policy"] == "full":          # read once per window: the same row at every budget
            if seen_full:
                continue
            seen_full = True
            r = {**r, "budget": "any"}
        iv = "" if r.get("ppl_low") is None else f" [{_f(r['ppl_low'])}, {_f(r['ppl_high'])}]"
        delta = "" if r.get("delta_ppl") is None or r["policy"] == "full" else \
            f"; vs full {_f(r['delta_ppl'], True)}" + ("" if r.get("delta_low") is None else
                                                       f" [{_f(r['delta_low'], True)}, {_f(r['delta_high'], True)}]")
        out.append((f"perplexity, {r['policy']}" + ("" if r["policy"] == "full" else f" at budget {r['budget']}"),
                    _f(r["ppl"]) + iv + delta))
    return out


def _kvtasks(s: dict) -> list[tuple[str, str]]:
    out = [("examples", f"{s.get('examples')} ({', '.join(s.get('tasks', []))}); {s.get('mode')}; "
                        + ("chat template" if s.get("chat_template") else "no chat template"))]
    if (s.get("examples") or 0) < MIN_UNITS:
        out.append(("intervals", f"none: too few examples ({s.get('examples')}; intervals need at least {MIN_UNITS})"))
    rows = s.get("results", [])
    task = "all" if any(r["task"] == "all" for r in rows) else (rows[0]["task"] if rows else None)
    for r in rows:
        if r["task"] != task:
            continue
        iv = "" if r.get("low") is None or r["low"] != r["low"] else f" [{_f(r['low'])}, {_f(r['high'])}]"
        what = "full cache" if r["policy"] == "full" else f"{r['policy']} at ratio {_f(r['ratio'])}"
        out.append((f"accuracy, {what}", _f(r["accuracy"]) + iv))
    for v in s.get("verdicts", []):
        out.append((f"{v['policy']} vs {v['baseline']} (best baseline) at ratio {_f(v['ratio'])}",
                    f"{_f(v['delta'], True)}: {v['verdict']}"))
    return out


def _answers(s: dict) -> list[tuple[str, str]]:
    n = s.get("prompts") or 0
    return [("prompts answered", str(n)),
            ("answer tokens (mean per prompt)", _f(s["answer_tokens"] / n if n else None)),
            ("answers ended on a stop token", str(s.get("stopped_on_stop_token")))]


def _explore(s: dict) -> list[tuple[str, str]]:
    layers = s.get("layers", [])
    out = [("tokens", str(s.get("tokens"))), ("layers analysed", _layer_list(layers)),
           ("heads per layer", str(s.get("heads"))),
           ("maps", "exact" if s.get("exact") else f"top-{s.get('top_k')} sources per (layer, head, query)")]
    if s.get("answer_tokens") is not None:
        out.append(("prompt + answer tokens", f"{s['prompt_tokens']} + {s['answer_tokens']}"))
    if s.get("measure"):
        out.append(("third list of sources", registry.label(s["measure"])))
    sink = s.get("layer_sink", {})
    for key, what in (("sink_attention", "attention"), ("sink_contribution", "contribution")):
        v = sink.get(key, [])
        if v:
            hi = max(range(len(v)), key=v.__getitem__)
            out.append((f"sink (position {s.get('sink')}) {what}: mean over layers; highest (layer)",
                        f"{_f(sum(v) / len(v))}; {_f(v[hi])} (layer {layers[hi]})"))
    size = s.get("page_bytes", 0)
    out.append(("page size", f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"))
    return out


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 12 else f"{layers[0]}–{layers[-1]} ({len(layers)} layers)"


def _claims(s: dict) -> list[tuple[str, str]]:
    counts: dict[str, int] = {}
    for r in s.get("rows", []):
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return [("verdicts", ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "—")]


WITH_INTERVALS = ("kvcache", "kvtasks", "claims")
"""The commands whose reports give bootstrap intervals (and say when there are too few windows)."""

HEADLINES: dict[str, Callable[[dict], list[tuple[str, str]]]] = {
    "sinks": _sinks, "selection": _selection, "heads": _heads, "faithfulness": _faithfulness,
    "kvcache": _kvcache, "kvtasks": _kvtasks, "analyze": _answers, "claims": _claims, "explore": _explore}
"""The headline numbers of each command's report, from its summary."""


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
    lines += ["", "## Results", ""]
    try:
        headline = HEADLINES[command](summary)
    except (KeyError, TypeError, StopIteration, AttributeError):
        headline = []
    lines += md.table(["measure", "value"], headline, align="lr") if headline else ["(no results)"]
    lines += ["", "## Files", ""]
    notes = {**FILE_NOTES, **COMMAND_FILE_NOTES.get(command, {})}
    for f in files:
        lines.append(f"- {md.link(f, f)}" + (f" — {t(notes[f])}" if f in notes else
                                            " — figure" if f.rsplit(".", 1)[-1] in ("png", "pdf", "svg") else ""))
    return "\n".join(lines) + "\n"
