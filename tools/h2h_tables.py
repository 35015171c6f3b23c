#!/usr/bin/env python
"""Markdown tables of the faithfulness head-to-head from ``attngeom claims`` runs (``claims.json``):
per run, each measure's AOC (mean ΔPPL over the ratios) and mean ln(PPL'/PPL) with 95 % intervals,
in both modes, and the verdict of contribution against each measure with its margin, at the AOC and
per ratio (the tables of docs/findings-faithfulness.md).

    python tools/h2h_tables.py docs/claims-runs/h2h-smollm2-135m-wikitext [more runs ...]
    python tools/h2h_tables.py --readme RUN[+RUN] [RUN[+RUN] ...]
        # the README's table: a column per model and corpus, its rows from one run or several
        # (joined with +: the runs of different measures on the same windows)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MEASURES = ("attention", "value_weighted", "output_normalized", "contribution", "leave_one_out", "value_zeroing", "alti",
            "grad_attention", "rollout", "contribution_rollout")
LABELS = {"leave_one_out": "leave-one-out", "value_zeroing": "value zeroing", "alti": "ALTI",
          "grad_attention": "gradient × attention", "rollout": "attention rollout",
          "contribution_rollout": "contribution rollout"}
MODES = ("comprehensiveness", "sufficiency")
MARK = {"holds": "✓", "refuted": "✗", "inconclusive": "·"}


def num(x: float) -> str:
    if x is None:
        return "—"
    a = abs(x)
    return f"{x:,.0f}" if a >= 1000 else f"{x:,.1f}" if a >= 10 else f"{x:.3g}" if a >= 0.01 else f"{x:.2g}"


def iv(d: dict) -> str:
    return f"{num(d['value'])} [{num(d['low'])}, {num(d['high'])}]"


def tables(run: Path) -> str:
    res = json.loads((run / "claims.json").read_text(encoding="utf-8"))
    f = res["detail"]["faithfulness"]
    out = [f"**{res['model']}**, {Path(res['data']).name}: {res['windows']['windows']} windows "
           f"({res['windows']['tokens_scored']} predicted tokens), clean PPL {iv(f['clean_ppl'])}", ""]
    out += ["| measure | comprehensiveness AOC ΔPPL (↑) | sufficiency AOC ΔPPL (↓) | comprehensiveness ln(PPL′/PPL) (↑) "
            "| sufficiency ln(PPL′/PPL) (↓) |", "|---|---:|---:|---:|---:|"]
    for m in MEASURES:
        if m in f["aoc"]["comprehensiveness"]:
            out.append(f"| {m} | " + " | ".join(iv(f[k][mode][m]) for k in ("aoc",) for mode in MODES) + " | "
                       + " | ".join(iv(f["log_aoc"][mode][m]) for mode in MODES) + " |")
    rows = {r["id"]: r for r in res["rows"]}
    out += ["", "| contribution vs | mode | AOC margin (+ = contribution better) | verdict | per ratio 0.1 … 0.9 |",
            "|---|---|---:|---|---|"]
    for m in MEASURES[4:]:
        for mode in MODES:
            r = rows.get(f"contribution_beats_{m}_{mode}")
            if r is None:
                continue
            d = next(iter(r["numbers"].values()))
            per = " ".join(MARK[v["verdict"]] for v in r["per_ratio"]["ratios"].values())
            out.append(f"| {m} | {mode} | {iv(d)} | {r['verdict']} | {per} |")
    return "\n".join(out) + "\n"


def readme(columns: list[list[Path]]) -> str:
    """One row per head-to-head claim, one column per model and corpus (the rows of its runs): the
    verdict and the AOC margin; rows numbered as ``attngeom claims`` numbers them by default."""
    from attngeom.claims.catalogue import CLAIMS

    res = [[json.loads((r / "claims.json").read_text(encoding="utf-8")) for r in runs] for runs in columns]
    names = {"SmolLM2-135M-Instruct": "SmolLM2-135M", "gemma-3-270m": "Gemma 3 270M"}
    head = [f"{names.get(x[0]['model'], x[0]['model'])}, {'WikiText-2' if 'wikitext' in x[0]['data'] else 'Handbook'}"
            for x in res]
    out = ["| # | contribution is more faithful than … | " + " | ".join(head) + " |",
           "|--:|---|" + "---|" * len(res)]
    rows = [{q["id"]: q for r in col for q in r["rows"]} for col in res]
    for k, claim in enumerate(CLAIMS, 1):
        cid = claim["id"]
        if not cid.startswith("contribution_beats_") or not any(cid in r for r in rows):
            continue
        x, mode = cid[len("contribution_beats_"):].rsplit("_", 1)
        cells = []
        for r in rows:
            row = r.get(cid)
            if row is None:
                cells.append("not run")
                continue
            d = next(iter(row["numbers"].values()))
            v = row["verdict"]
            cells.append(f"{'**' + v + '**' if v != 'inconclusive' else v} ({num(d['value'])} [{num(d['low'])}, {num(d['high'])}])")
        out.append(f"| {k} | {LABELS.get(x, x)}, {mode} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--readme":
        print(readme([[Path(q) for q in p.split("+")] for p in sys.argv[2:]]))
    else:
        print("\n".join(tables(Path(p)) for p in sys.argv[1:]))
