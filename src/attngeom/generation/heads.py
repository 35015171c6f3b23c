"""Which heads carry a token's sources: per-head attribution of a target token to its sources.

For a target token ``t`` explained by query row ``i`` (its *producing row* ``i = t - 1``, SPEC §7,
or the token's own row) and one analysed layer ``l``, each triple (head ``h``, source ``j <= i``) has
a **share** of that layer's attention output at row ``i``:

- ``by="contribution"``: the inter-head contribution ``C_ij^h = ⟨o_i, a_ij^h ṽ_j^h⟩ / ‖o_i‖²``
  (SPEC §2); the shares of one layer sum to 1 over ``(h, j)`` (they can be negative);
- ``by="attention"``: ``a_ij^h / H``; the shares of one layer sum to 1 (less a learned sink's share).

Several targets (e.g. the whole answer): the mean of their rows' shares per (layer, head, source),
a source a row cannot see counting 0 (as SPEC §7 averages the token-level scores over the answer), so
each layer's shares still sum to 1. Layers are not composed: a share is always within its layer (a
cross-layer attribution would need the residual stream, which SPEC §2 does not use). The table ranks
triples within their layer (``rank_in_layer``) and lists them by share across layers.

Sources are every visible position: the prompt, earlier answer tokens and the query itself. Each row
says what its source is (``part``: ``prompt``/``answer``, or ``text`` for a text analysed as given;
``is_special``: a tokenizer special token such as BOS or ``<|im_start|>``; ``is_template``: put there
by the chat template, not the user's text); ``exclude_special`` leaves special and template tokens
out of the ranking (their shares are not given to anyone else: the remaining shares are unchanged).

- :func:`row_shares` — one row's shares ``[H, i + 1]`` per measure from a :class:`~attngeom.capture.blocks.Block`.
- :func:`head_table` — the ranked table from per-layer shares.
- :class:`AnswerHeads` — the table for every generated token and for the whole answer, observing a
  generation (:func:`attngeom.generation.decoding.stream_generation`); ``Trace.heads_for`` gives the same from a trace.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

import numpy as np
import pandas as pd

from attngeom.capture.blocks import Block
from attngeom.errors import InputError
from attngeom.generation.decoding import answer_prompt_length, producing_rows
from attngeom.metrics import formulas as metrics
from attngeom.streaming.reducers import InputBatch, Reducer

BY = ("contribution", "attention")
"""The measures of a share: the inter-head contribution ``C_ij^h`` and the attention ``a_ij^h / H``."""
DEFAULT_TOP = 10
"""Rows of a heads table (the largest shares across layers)."""


def row_shares(block: Block, r: int) -> dict[str, np.ndarray]:
    """Query ``i = q_start + r`` of ``block`` (batch item 0): ``{by: float64 [H, i + 1]}``, source ``j``
    in column ``j`` (:data:`BY`; module docstring; sources before the block's ``k_start``, which the
    query cannot see, are 0)."""
    q, k0 = block.q_start + r, block.k_start
    n = q + 1 - k0
    a = block.a[:, :, r:r + 1, :n]
    if "contribution_inter" in block._cache:
        C = block._cache["contribution_inter"][:, :, r:r + 1, :n]
    else:
        C = metrics.contribution_inter_from(a, block.pulled_back[:, :, r:r + 1], block.v[:, :, :n],
                                            block.output_sq[:, r:r + 1])
    H = a.shape[1]
    out = {}
    for by, x in (("contribution", C[0, :, 0]), ("attention", a[0, :, 0] / H)):
        out[by] = np.zeros((H, q + 1))
        out[by][:, k0:] = x.double().cpu().numpy()
    return out


def token_marks(ids: Sequence[int], special_ids: Collection[int], template: Collection[int] = (),
                prompt_length: int | None = None, tokens: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per position: ``source_id``, (``source_token``), ``part`` (``prompt``/``answer``; ``text``
    without a prompt length), ``is_special``, ``is_template``."""
    T = len(ids)
    pos = np.arange(T)
    part = (np.full(T, "text", dtype=object) if prompt_length is None
            else np.where(pos < prompt_length, "prompt", "answer").astype(object))
    special = set(int(i) for i in special_ids)
    out = {"source_id": [int(i) for i in ids]}
    if tokens is not None:
        out["source_token"] = list(tokens)
    out.update({"part": part, "is_special": np.array([int(i) in special for i in ids], dtype=bool),
                "is_template": np.isin(pos, list(template))})
    return pd.DataFrame(out)


def head_table(shares: Mapping[int, np.ndarray], marks: pd.DataFrame, *, top: int | None = DEFAULT_TOP,
               exclude_special: bool = True, source: int | None = None) -> pd.DataFrame:
    """The ranked (layer, head, source) table from ``shares`` ``{layer: [H, S]}`` (source ``j`` in
    column ``j``) and the per-position ``marks`` of :func:`token_marks`.

    Columns: ``layer``, ``head``, ``source``, the marks' columns, ``share`` and ``rank_in_layer`` (0
    first, among the rows kept). Rows: by share, largest first (ties: layer, head, source), the first
    ``top`` (None: all). ``source``: only that source's rows (the link source -> target split by head
    at each layer); ``exclude_special``: no special or template sources."""
    frames = []
    for layer, x in sorted(shares.items()):
        H, S = x.shape
        h, j = np.divmod(np.arange(H * S), S)
        frames.append(pd.DataFrame({"layer": int(layer), "head": h, "source": j, "share": x.reshape(-1)}))
    if not frames:
        raise InputError("no analysed layer to rank heads in")
    df = pd.concat(frames, ignore_index=True)
    df = df.join(marks, on="source")
    if source is not None:
        df = df[df["source"] == int(source)]
    if exclude_special:
        df = df[~(df["is_special"] | df["is_template"])]
    df = df.sort_values(["layer", "share", "head", "source"], ascending=[True, False, True, True], kind="stable")
    df["rank_in_layer"] = df.groupby("layer").cumcount()
    df = df.sort_values(["share", "layer", "head", "source"], ascending=[False, True, True, True], kind="stable")
    cols = ["layer", "head", "source", *marks.columns, "share", "rank_in_layer"]
    df = df[cols].reset_index(drop=True)
    return df if top is None else df.head(int(top)).reset_index(drop=True)


def mean_shares(rows: Sequence[Mapping[int, np.ndarray]], width: int) -> dict[int, np.ndarray]:
    """The mean over several rows' ``{layer: [H, n]}`` shares, each padded with zeros to ``width``
    sources (what a row cannot see counts 0)."""
    out = {}
    for layer in rows[0]:
        acc = np.zeros((rows[0][layer].shape[0], width))
        for r in rows:
            acc[:, :r[layer].shape[1]] += r[layer]
        out[layer] = acc / len(rows)
    return out


class AnswerHeads(Reducer):
    """The heads table (:func:`head_table`) of each generated token's producing row and of the whole
    answer (the mean of those rows), by each measure of :data:`BY`, observing a generation.

    :meth:`result`: one table with ``text``, ``step`` (null: the whole answer), ``position`` (the
    generated token; null for the whole answer), ``token_id``, ``by``, ``rank`` (0 first, across
    layers) and :func:`head_table`'s columns; ``top`` rows per (step, measure). ``special_ids``: the
    tokenizer's special tokens, ``template``: the prompt's template positions (marked, and with
    ``exclude_special`` left out of the ranking)."""

    STATE = ("heads",)
    READS_LAST_TOKEN = False                                  # the last token's row produces nothing

    def __init__(self, special_ids: Collection[int] = (), template: Collection[int] | Mapping = (), *,
                 top: int = DEFAULT_TOP, exclude_special: bool = True):
        self.special_ids, self.template = set(int(i) for i in special_ids), template
        self.top, self.exclude_special = int(top), bool(exclude_special)
        self.heads: list[pd.DataFrame] = []

    def begin(self, batch: InputBatch) -> None:
        super().begin(batch)
        self.P = answer_prompt_length(batch, type(self).__name__)
        self._rows: dict[int, dict[int, dict[str, np.ndarray]]] = {}      # query -> layer -> by -> [H, q+1]

    def observe(self, block: Block) -> None:
        for r, q in producing_rows(block, self.P):
            self._rows.setdefault(q, {})[block.layer] = row_shares(block, r)

    def end(self, batch: InputBatch) -> None:
        T, P, index = int(batch.lengths[0]), self.P, batch.index[0]
        ids = batch.ids[0, :T].tolist()
        queries = [q for q in range(P - 1, T - 1) if q in self._rows]
        marks = token_marks(ids[:T - 1], self.special_ids, of_text(self.template, index), prompt_length=P)
        frames = []
        for by in BY:
            per_row = {q: {l: x[by] for l, x in self._rows[q].items()} for q in queries}
            targets = [(q + 1 - P, q + 1, per_row[q]) for q in queries]
            if queries:
                targets.append((None, None, mean_shares(list(per_row.values()), T - 1)))
            for step, position, shares in targets:
                df = head_table(shares, marks, top=self.top, exclude_special=self.exclude_special)
                df.insert(0, "rank", np.arange(len(df)))
                df.insert(0, "by", by)
                df.insert(0, "token_id", ids[position] if position is not None else None)
                df.insert(0, "position", position)
                df.insert(0, "step", step)
                df.insert(0, "text", index)
                frames.append(df)
        if frames:
            self.heads.append(pd.concat(frames, ignore_index=True))
        self._rows = {}

    def result(self) -> pd.DataFrame:
        """The table; ``step``, ``position`` and ``token_id`` are nullable integers (null: the whole
        answer) however the state travelled."""
        if not self.heads:
            return pd.DataFrame()
        out = pd.concat(self.heads, ignore_index=True)
        for col in ("step", "position", "token_id"):
            out[col] = pd.array([None if pd.isna(x) else int(x) for x in out[col]], dtype="Int64")
        return out


def of_text(positions: Collection[int] | Mapping, index: int) -> tuple[int, ...]:
    """Positions given for every text, or ``{text: positions}``: those of text ``index``."""
    if isinstance(positions, Mapping):
        positions = positions.get(index, ())
    return tuple(int(p) for p in positions)


def with_marks(df: pd.DataFrame, marks: pd.DataFrame, column: str = "source") -> pd.DataFrame:
    """``df`` with the ``part``, ``is_special`` and ``is_template`` of the position in ``column``
    (from :func:`token_marks`) after its last column; ``df`` unchanged when empty."""
    if not len(df):
        return df
    m = marks[["part", "is_special", "is_template"]]
    return df.join(m, on=column)
