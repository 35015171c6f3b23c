"""The numbers of the single-text analysis (``attngeom analyze``): windows that cover a long input,
per-layer sink aggregates and the top tokens by what they receive.

What belongs here: the analysis logic behind the ``analyze`` command's summary, on the tables of
:func:`attngeom.trace.summaries` (:class:`~attngeom.reducers.HeadStats` rows per layer and head,
:class:`~attngeom.reducers.TokenStats` rows per text, layer and position). The forward passes are in
:mod:`attngeom.trace`; the command (:mod:`attngeom.commands.analyze`) parses, runs and writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

TOP_K = 5
"""Tokens listed per ranking."""
MIN_SEEN_BY = 8
"""The top-k rankings leave out the sources seen by fewer than ``max(8, T/4)`` queries (at most
``T/2``; :func:`top_tokens`): a late token's 'received' mean averages over a few nearby queries
only, which mostly attend locally, and would fill the ranking with the last positions."""


def cut_windows(ids: list[int], window: int, stride: int | None,
                bos: int | None) -> tuple[list[tuple[int, list[int]]], bool]:
    """Windows covering every token of ``ids`` (:func:`attngeom.data.windows` with ``keep_last``)
    and whether they start with BOS: ``([(offset, window_ids), ...], has_bos)``; window position
    ``p`` is input position ``offset + p`` (the BOS of a window is input position 0)."""
    from .data import windows as cut

    has_bos = bool(bos is not None and ids and ids[0] == bos)
    body = ids[1:] if has_bos else list(ids)
    step = stride or (window - 1 if has_bos else window)
    wins = cut(body, window, step, bos=bos if has_bos else None, keep_last=True)
    return [(k * step, w) for k, w in enumerate(wins)], has_bos


def add_input_positions(tokens: "pd.DataFrame", windows: Sequence[tuple[int, list[int]]], has_bos: bool) -> None:
    """Insert ``input_position`` after ``position`` in a ``TokenStats`` table of the windows of
    :func:`cut_windows`: the token's position in the whole input (``offset + position``; a window's
    repeated BOS is input position 0)."""
    offsets = {i: off for i, (off, _) in enumerate(windows)}
    pos = tokens["position"].to_numpy()
    off = tokens["text"].map(offsets).to_numpy()
    tokens.insert(tokens.columns.get_loc("position") + 1, "input_position",
                  ((pos + off) * (pos > 0)) if has_bos else (pos + off))


def per_layer_sinks(heads: "pd.DataFrame") -> list[dict]:
    """Per layer: the sink's attention and intra-head contribution (mean, min and max over heads of
    the per-head means over queries ``i > 0``) and its share of the layer output (the sum over heads
    of the inter-head contribution ``C_i0^h``), from the ``HeadStats`` table."""
    out = []
    for layer, g in heads.groupby("layer", sort=True):
        out.append({
            "layer": int(layer),
            "sink_attention": float(g["sink_rate"].mean()),
            "sink_attention_min": float(g["sink_rate"].min()),
            "sink_attention_max": float(g["sink_rate"].max()),
            "sink_contribution": float(g["sink_contribution"].mean()),
            "sink_contribution_min": float(g["sink_contribution"].min()),
            "sink_contribution_max": float(g["sink_contribution"].max()),
            "sink_contribution_to_layer_output": float(g["sink_contribution_inter"].sum()),
        })
    return out


def top_tokens(tokens: "pd.DataFrame", window_lengths: Sequence[int], layer: int, *, top_k: int = TOP_K,
               min_seen_by: int = MIN_SEEN_BY,
               columns: Sequence[str] = ("contribution_received", "attention_received")) -> dict:
    """The ``top_k`` tokens of ``layer`` by each of ``columns`` (what a source receives, averaged over
    the queries that see it), from the ``TokenStats`` table with ``input_position`` and ``token``
    columns. Only positions seen by at least ``max(1, min(min_seen_by, span // 2), span // 4)``
    queries are ranked (``span``: the most queries any position is seen by); ties keep the table's
    order. With several windows each row names its ``window``."""
    t = tokens[tokens["layer"] == layer].copy()
    lengths = dict(enumerate(window_lengths))
    t["seen_by"] = t["text"].map(lengths) - t["position"]
    span = int(t["seen_by"].max()) if len(t) else 1
    need = max(1, min(min_seen_by, span // 2), span // 4)
    t = t[t["seen_by"] >= need]

    def top(col):
        rows = t.sort_values(col, ascending=False, kind="stable").head(top_k)
        return [{"position": int(r.input_position), "token": r.token, "score": float(r[col]),
                 **({"window": int(r.text)} if len(window_lengths) > 1 else {})}
                for _, r in rows.iterrows()]

    return {"layer": int(layer), "ranked_over": f"positions seen by at least {need} queries",
            "min_seen_by": int(need), **{f"by_{c}": top(c) for c in columns}}


def summarize(heads: "pd.DataFrame", tokens: "pd.DataFrame", window_lengths: Sequence[int],
              layers: Sequence[int]) -> dict:
    """The analysis numbers of a text's summary: ``per_layer`` (:func:`per_layer_sinks`), their means
    over layers, and ``top_tokens`` (:func:`top_tokens`) at the middle analysed layer."""
    import numpy as np

    per_layer = per_layer_sinks(heads)
    mid = layers[len(layers) // 2]
    return {"per_layer": per_layer,
            "mean_sink_attention": float(np.mean([r["sink_attention"] for r in per_layer])),
            "mean_sink_contribution": float(np.mean([r["sink_contribution"] for r in per_layer])),
            "top_tokens": top_tokens(tokens, window_lengths, mid)}
