"""``claims.md``: the claims table of :mod:`attngeom.claims.catalogue` as Markdown (cells escaped)."""

from __future__ import annotations

import re

from attngeom.reports.markdown import text as _text
from attngeom.stats.resampling import MIN_UNITS, TOO_FEW, format_number
from attngeom.claims.catalogue import PAPER_ABBREVIATIONS, claim_number, deciding, under_current_rules


def escape(value) -> str:
    """One inert, one-line Markdown cell (:func:`attngeom.reports.markdown.text`; None -> "")."""
    return "" if value is None else _text(value)


VERDICT_MARK = {"holds": "**holds**", "refuted": "**refuted**", "inconclusive": "inconclusive",
                TOO_FEW: "too few windows"}

TERMS = (
    ("ΔPPL", "the change in perplexity (exp of the mean next-token loss) when tokens, the sink or heads are removed"),
    ("AOC", "area over the curve: the mean ΔPPL over the removal ratios r (SPEC §3.3); comprehensiveness removes "
            "the top-ranked fraction r of the tokens (a more faithful metric raises ΔPPL more), sufficiency keeps "
            "only it (a more faithful metric raises ΔPPL less)"),
    ("sink", "the first token (position 0), which takes much of the attention; ṽ_0 its value vector projected by "
             "the head's output map"),
    ("semantic cone", "the cone of a head's non-sink (semantic) value vectors ṽ_j; how far a head output o_i has "
                      "collapsed into it is the cone measure κ_i = Σ_{j≠s} (a_ij / (1−ρ_i)) cos(o_i, ṽ_j), the "
                      "attention-weighted mean cosine of the output with each semantic value; a_ij is the attention "
                      "of query i on source j, ρ_i its share on the sink (s = 0), and κ_i = 1 when o_i points along "
                      "every semantic value the query attends to (SPEC §4)"),
    ("F_N", "how separable the N tokens a head selects (its top N by attention) are from the rest: the harmonic "
            "mean of precision P_N and recall R_N of the ball around their sum (SPEC §5)"),
    ("Retriever / Mixer / Reset", "the head types (SPEC §6), from the source that wins most queries "
                                  "(largest attention × value norm): Retriever the query itself, Mixer the sink, "
                                  "Reset neither"),
    ("z", "how far one head's single-removal ΔPPL lies above the other heads of its type, in standard deviations"),
)
"""The terms ``claims.md`` uses, defined at its end."""


def render(result: dict, model: str, data: str, seconds: float | None = None) -> str:
    """The whole ``claims.md``: a header (model, data, windows, bootstrap), one table row per claim
    (claim, measured value, 95 % interval, verdict), then the rules and the numbers behind each
    verdict."""
    s = result.get("settings", {})
    w = result.get("windows", {})
    lines = [f"# Claims of the papers on {escape(model)}", ""]
    lines.append(f"Data: {escape(data)}; {w.get('windows', '?')} windows ({w.get('tokens_scored', '?')} predicted "
                 f"tokens)" + (f", head removal: {w['calibration_windows']} calibration / {w['heldout_windows']} "
                               "held-out windows" if "calibration_windows" in w else "") + ".")
    if s.get("per_head"):
        lines.append("Faithfulness rankings: **per head** (each head masks its own top or bottom sources; "
                     "SPEC §3's option), not per token.")
    lines.append(f"Intervals: 95 % percentile bootstrap over windows, {s.get('bootstrap')} resamples, seed "
                 f"{s.get('seed')}." + (f" Run time {seconds:.0f} s." if seconds is not None else ""))
    lines.append("Verdict: **holds** when the whole interval is on the claim's side, **refuted** when it is "
                 "all on the other side, otherwise inconclusive (rules below and in docs/claims.md); "
                 f"**too few windows** when the claim rests on fewer than {MIN_UNITS} windows, where no "
                 "interval is given. Terms are defined at the end.")
    lines += ["", "| # | claim | paper | measured | 95 % interval | verdict |", "|--:|---|---|---|---|---|"]
    for r in result["rows"]:
        paper = PAPER_ABBREVIATIONS.get(r["paper"], r["paper"])
        lines.append(f"| {claim_number(r['id'])} | {escape(r['claim'])} | {paper} | {escape(r['value'])} | "
                     f"{escape(_interval_cell(r))} | {VERDICT_MARK.get(r['verdict'], escape(r['verdict']))} |")
    h2h = any(PAPER_ABBREVIATIONS.get(r["paper"]) == "H2H" for r in result["rows"])
    lines += ["", "CW: *Contribution Weights* (Cunningham & Muca Cirone); TS: *Geometric Analysis of Token "
              "Selection in Multi-Head Attention* (Mudarisov et al.)" + ("; H2H: the head-to-head of contribution "
              "with published value-aware measures (docs/findings-faithfulness.md)." if h2h else "."),
              "", "## Measures, rules and numbers", ""]
    for r in result["rows"]:
        lines.append(f"**{claim_number(r['id'])}. {escape(r['id'])}** — measured: {escape(r['measure'])}. "
                     f"Rule: {escape(r['rule'])}." + (f" Windows: {r['windows']}." if r.get("windows") is not None else ""))
        if r.get("note"):
            lines.append(f"Note: {escape(r['note'])}.")
        pr = r.get("per_ratio")
        if pr:
            cross = "; ".join(pr["crossover"]) or "none (the same verdict at every ratio)"
            lines.append(f"Per removal ratio: {escape(pr['summary'])}. Crossover: {escape(cross)}.")
        for name, d in (r.get("numbers") or {}).items():
            if isinstance(d, dict) and "value" in d:
                extra = f", beats in {100 * d['beats_share']:.1f} % of resamples" if "beats_share" in d else ""
                lines.append(f"- {escape(name)}: {_num(d['value'])} [{_num(d['low'])}, {_num(d['high'])}]{extra}")
        lines.append("")
    heads = result.get("detail", {}).get("heads")
    if heads:
        lines += ["## Head removal: held-out perplexity (95 % intervals)", ""]
        curves = heads["removal_curves"]
        rets = list(next(iter(curves.values())))
        lines.append("| order | " + " | ".join(f"{escape(r)} %" for r in rets) + " |")
        lines.append("|---|" + "---:|" * len(rets))
        for name, c in curves.items():
            lines.append(f"| {escape(name)} | " + " | ".join(f"{_num(c[r]['value'])} [{_num(c[r]['low'])}, "
                                                             f"{_num(c[r]['high'])}]" for r in rets) + " |")
        lines.append("")
    faith = result.get("detail", {}).get("faithfulness")
    if faith:
        logs = faith.get("log_aoc") or {}
        lines += ["## Faithfulness AOC (95 % intervals)", "",
                  f"Clean PPL {_num(faith['clean_ppl']['value'])}. Raw: the mean ΔPPL over the removal ratios, "
                  "which grows without bound where a removal breaks the model; ΔNLL: the mean over the ratios of "
                  "ln(PPL′ / PPL), the rise in the mean next-token loss in nats, on a scale that reads alike "
                  "across models.", "",
                  "| metric | comprehensiveness ΔNLL (↑) | sufficiency ΔNLL (↓) | comprehensiveness ΔPPL (↑) | "
                  "sufficiency ΔPPL (↓) |", "|---|---:|---:|---:|---:|"]
        for m in faith["aoc"].get("comprehensiveness", {}):
            cells = [_interval(logs.get(mode, {}).get(m)) for mode in ("comprehensiveness", "sufficiency")]
            cells += [_interval(faith["aoc"].get(mode, {}).get(m)) for mode in ("comprehensiveness", "sufficiency")]
            lines.append(f"| {escape(m)} | " + " | ".join(cells) + " |")
        lines.append("")
        for mode, arrow in (("comprehensiveness", "↑"), ("sufficiency", "↓")):
            per = faith.get("delta_ppl", {}).get(mode)
            if not per:
                continue
            ratios = list(next(iter(per.values())))
            lines += [f"### {mode.capitalize()} ΔPPL per removal ratio ({arrow}; 95 % intervals)", "",
                      "| metric | " + " | ".join(f"r = {escape(r)}" for r in ratios) + " |",
                      "|---|" + "---:|" * len(ratios)]
            for m, by in per.items():
                lines.append(f"| {escape(m)} | " + " | ".join(
                    f"{_num(by[r]['value'])} [{_num(by[r]['low'])}, {_num(by[r]['high'])}]" if r in by else ""
                    for r in ratios) + " |")
            lines.append("")
    lines += ["## Terms", ""] + [f"- **{escape(term)}**: {escape(meaning)}." for term, meaning in TERMS]
    lines.append(f"- Numbers: 4 significant digits, thousands separated by commas; — where there is no value "
                 f"or interval.")
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return format_number(x)


def _interval(d) -> str:
    """``value [low, high]`` of an interval dict; "" without one."""
    return f"{_num(d['value'])} [{_num(d['low'])}, {_num(d['high'])}]" if d else ""


def _interval_cell(row: dict) -> str:
    """A row's interval cell; a hierarchy row (its value the order) names the step its verdict rests on
    (:func:`~attngeom.claims.catalogue.deciding`) before the shares of resamples."""
    numbers = {k: d for k, d in (row.get("numbers") or {}).items() if isinstance(d, dict) and "value" in d}
    if not row["id"].startswith("hierarchy_") or not numbers:
        return row["interval"]
    name, d = next((k, d) for k, d in numbers.items() if d is deciding(numbers))
    return f"weakest step, {name.replace(' vs ', ' over ')}: {_interval(d)}; {row['interval']}"


_OLD_NUMBER = re.compile(r"(?<![\w.,])([-+−]?)(\d+(?:\.\d+)?e[-+]\d+|\d{4,}(?:\.\d+)?)(?!\w|,\d|\.\d)")
"""A number in a stored text cell written the way earlier versions did (``1.168e+04``, ``1840``)."""


def one_number_format(cell):
    """A stored text cell (a row's measured value, interval or note) with every number in
    :func:`~attngeom.stats.resampling.format_number`'s one format (``11,680``, not ``1.168e+04``);
    other text unchanged."""
    if not isinstance(cell, str):
        return cell

    def fix(m):
        sign = m.group(1).replace("−", "-")
        return format_number(float(sign.replace("+", "") + m.group(2)), signed=sign == "+")

    return _OLD_NUMBER.sub(fix, cell)


def rerender(stored: dict) -> str:
    """``claims.md`` from a run's ``claims.json`` content alone, nothing recomputed: what the command
    writes, and how a run's ``claims.md`` written by an earlier version is brought to the current rules
    (:func:`~attngeom.claims.catalogue.under_current_rules`: too few windows, the deciding margin) and
    format (terms, one number format)."""
    stored = under_current_rules(stored)
    rows = [{**r, **{k: one_number_format(r.get(k)) for k in ("value", "interval", "note")}} for r in stored["rows"]]
    return render({**stored, "rows": rows}, stored.get("model", ""), stored.get("data", ""),
                  stored.get("seconds_this_invocation"))
