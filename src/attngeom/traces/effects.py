"""Heads ranked by what they do to the next token, their share beside them (docs/generation.md, "A
share is not a cause"): :func:`head_effects`, from the direct and total effects of
:mod:`attngeom.generation.effects` and the shares of a trace (:meth:`attngeom.traces.trace.Trace.heads_for`'s
measure, ``C_ij^h`` at the predicting row)."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

from attngeom.errors import InputError
from attngeom.generation.effects import ABLATIONS, DEFAULT_BATCH, Answer, ablated_scores, direct_effects
from attngeom.model.arguments import check_count, takes_handle

RANKS = ("total", "direct", "share")
"""What :func:`head_effects` ranks by (absolute value, largest first)."""


def _shares(handle, ids: list[int], layers) -> tuple[dict, "pd.DataFrame"]:
    """Per analysed layer ``[H, T]`` contribution shares ``C_ij^h`` of the last row, and the marks."""
    from attngeom.generation.heads import row_shares
    from attngeom.traces.trace import analyze

    trace = analyze(handle, ids, layers=layers)
    T = len(ids)
    return {lt.index: row_shares(lt.block, T - 1)["contribution"] for lt in trace.layers}, trace.marks()


@takes_handle
def head_effects(handle, text, target, *, contrast=None, ablation: str = "zero", rank: str = "total",
                 top: int | None = None, layers: Iterable[int] | None = None,
                 batch_size: int = DEFAULT_BATCH) -> pd.DataFrame:
    """Every head's effect on the next token after ``text`` (a string or ids), ranked by effect, with
    its share beside it (module docstring).

    ``target``: the token (``" Paris"`` or an id); ``contrast``: a token to compare it with
    (``" Berlin"``: the metric is the logit difference, else ``log P(target)``). ``ablation``: ``zero``
    or ``mean``. ``rank``: ``total``, ``direct`` or ``share`` (by absolute value, largest first).
    ``top``: rows kept (None: all). ``layers``: a subset of layers (default all).

    Columns: ``layer``, ``head``, ``share`` (the head's share ``Σ_j C_ij^h`` of its layer's attention
    output at the predicting row), ``top_source``/``top_source_token``/``top_source_share`` (its largest
    ``C_ij^h`` among the non-special sources), ``direct_effect`` (logit units), ``total_effect``
    (``m(clean) − m(ablated)``), ``rank`` (0 first), ``rank_by_share``. ``df.attrs``: ``metric``,
    ``clean`` (``m`` of the clean run), ``p_target`` (``p_contrast``, ``logit_diff``), ``logit`` and
    ``direct_sum`` (the direct effects' sum), ``ablation``, ``target``/``contrast`` (ids and tokens)."""
    from attngeom.data.corpora import check_layers
    from attngeom.streaming.passes import to_ids

    if ablation not in ABLATIONS:
        raise InputError(f"ablation must be one of {', '.join(ABLATIONS)}, not {ablation!r}"[:200])
    if rank not in RANKS:
        raise InputError(f"rank must be one of {', '.join(RANKS)}, not {rank!r}"[:200])
    top = None if top is None else check_count(top, "top")
    batch_size = check_count(batch_size, "batch_size")
    chosen = list(range(handle.num_layers)) if layers is None else sorted(set(check_layers(layers, handle.num_layers)))
    answer = Answer(handle, target, contrast)
    ids = to_ids(handle, text)
    direct, parts = direct_effects(handle, ids, answer)
    clean = float(answer.score(parts["logits"]))
    shares, marks = _shares(handle, ids, chosen)
    H = handle.num_heads
    heads = [(l, h) for l in chosen for h in range(H)]
    ablated = ablated_scores(handle, ids, heads, answer, ablation, batch_size)
    ordinary = ~(marks["is_special"] | marks["is_template"]).to_numpy()
    rows = []
    for (l, h), m in zip(heads, ablated):
        c = shares[l][h]
        cand = np.where(ordinary[:len(c)], c, -np.inf)
        j = int(np.argmax(cand)) if np.isfinite(cand).any() else int(np.argmax(c))
        rows.append({"layer": l, "head": h, "share": float(c.sum()), "top_source": j,
                     "top_source_token": marks["source_token"].iloc[j], "top_source_share": float(c[j]),
                     "direct_effect": float(direct[l, h]), "total_effect": clean - float(m)})
    df = pd.DataFrame(rows)
    df["rank_by_share"] = _ranks(df["share"].abs())
    key = {"total": "total_effect", "direct": "direct_effect", "share": "share"}[rank]
    df["rank"] = _ranks(df[key].abs())
    df = df.sort_values("rank", kind="stable").reset_index(drop=True)
    df = df[["layer", "head", "share", "top_source", "top_source_token", "top_source_share", "direct_effect",
             "total_effect", "rank", "rank_by_share"]]
    if top is not None:
        df = df.head(top).reset_index(drop=True)
    tok = handle.tokens([answer.target] + ([] if answer.contrast is None else [answer.contrast]))
    df.attrs.update({"metric": answer.name, "clean": clean, "logit": parts["logit"], "direct_sum": parts["heads"],
                     "ablation": ablation, "target": answer.target, "target_token": tok[0],
                     "contrast": answer.contrast, "contrast_token": tok[1] if len(tok) > 1 else None,
                     **answer.probabilities(parts["logits"])})
    return df


def _ranks(values: pd.Series) -> np.ndarray:
    """0 for the largest value, ties by order."""
    order = np.argsort(-values.to_numpy(), kind="stable")
    out = np.empty(len(order), dtype=np.int64)
    out[order] = np.arange(len(order))
    return out
