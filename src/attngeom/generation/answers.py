"""The answer tables (SPEC §7; docs/generation.md): which sources each generated token's producing row
draws on (:class:`AnswerSources`: shares of the sink, the prompt and the earlier answer, top sources,
the whole answer's summary) and the generated text itself (:class:`Answers`), reducers that observe a
generation (:func:`attngeom.generation.decoding.stream_generation`)."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from attngeom.capture.blocks import Block
from attngeom.generation.decoding import answer_prompt_length, producing_rows
from attngeom.generation.heads import of_text
from attngeom.metrics import formulas as metrics
from attngeom.streaming.reducers import InputBatch, Reducer

DEFAULT_TOP_K = 5
"""Prompt sources listed per generated token and metric in :class:`AnswerSources`."""
TABLE_METRICS = ("attention", "contribution")
"""Token-level scores (SPEC §2) of the answer tables: mean attention over heads, ``C_ij = Σ_h C_ij^h``."""


def rows_by_device(rows: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Rows ``[k, n_i]`` joined along their last dimension, one tensor per device (the layers of a
    model split by ``device_map`` live on several): ``[(indices of the rows, joined), ...]``, each
    joined tensor on its rows' device, so that each device's rows reach the host in one copy."""
    at: dict[torch.device, list[int]] = {}
    for i, row in enumerate(rows):
        at.setdefault(row.device, []).append(i)
    return [(idx, torch.cat([rows[i] for i in idx], dim=1)) for idx in at.values()]


class AnswerSources(Reducer):
    """Where each generated token's producing row (module docstring) draws from, per layer and
    for the model (the mean of the analysed layers' rows), from the token-level scores of SPEC §2
    (``attention``: mean over heads of ``a_ij^h``; ``contribution``: ``C_ij = Σ_h C_ij^h``, which
    sums to 1 over ``j``). Only producing rows are computed (:func:`~attngeom.metrics.formulas.received_row`, no map).

    :meth:`result` gives three tables (one row per generated token unless said):

    - ``shares``: ``step``, ``position``, ``token_id``, ``layer`` (null: the model), ``query``
      (the producing row), and per metric ``{metric}_sink`` (the sink), ``{metric}_prompt`` (the
      other prompt tokens) and ``{metric}_answer`` (earlier answer tokens, the query included when
      it is one); the three sum to the row's total (1 for contribution and attention).
    - ``sources``: the ``top_k`` sources by each metric, prompt and earlier answer tokens alike (the
      sink left out: it has its own share; so are the positions ``exclude`` (or ``{text: positions}``)
      and the tokens ``exclude_ids``, e.g. chat-template and special tokens): ``metric``, ``rank`` (0 first),
      ``source``, ``source_id``, ``score``; ties: the earlier position first. Each row is ranked
      when the next forward call (or block) begins; an answer token in ``exclude_ids`` (known only at the end) is then left out of the
      lists, which keeps the order of the rest but may leave such a row fewer than ``top_k`` sources.
    - ``summary``: per layer (null: the model) and prompt position, each metric's mean over the
      answer's producing rows: which prompt tokens the whole answer drew on."""

    STATE = ("shares", "sources", "summary")
    READS_LAST_TOKEN = False                                  # the last token's row produces nothing

    def __init__(self, sink: int = 0, top_k: int = DEFAULT_TOP_K, exclude=(), exclude_ids: Iterable[int] = ()):
        self.sink, self.top_k = int(sink), int(top_k)
        self.exclude, self.exclude_ids = exclude, set(int(i) for i in exclude_ids)
        self.shares: list[pd.DataFrame] = []
        self.sources: list[pd.DataFrame] = []
        self.summary: list[pd.DataFrame] = []

    def begin(self, batch: InputBatch) -> None:
        super().begin(batch)
        self.P = answer_prompt_length(batch, type(self).__name__)
        prompt_ids = batch.ids[0, :self.P].tolist()
        # left out of the rankings: the sink (it has its share), the excluded positions, prompt tokens in exclude_ids
        left_out = {self.sink, *of_text(self.exclude, batch.index[0]),
                    *(j for j, t in enumerate(prompt_ids) if t in self.exclude_ids)}
        self._left_out_at = np.array(sorted(left_out), dtype=np.int64)
        self._reset()

    def _reset(self) -> None:
        # Each producing row [metrics, q + 1] (float64) is reduced soon after it is observed, so the
        # state grows by a few numbers per row, not by the row: the per-layer shares and top sources,
        # the running sum over layers that becomes the model's row, and per layer the sum of the
        # prompt columns over the rows known to be producing (the rows of the latest query wait in
        # _pending: only the end says whether it is the last token's, which produces nothing).
        # The rows of one forward call wait on the device in _step and are reduced together, all
        # layers at once: one copy to the host and a few array operations per decoding step.
        self._step: list[tuple[int, int, int, torch.Tensor]] = []           # (layer, query, first source, row)
        self._tables: dict[tuple[int, int], tuple] = {}                     # (layer, query) -> shares, top sources
        self._layer_sum: dict[int, np.ndarray] = {}                        # query -> Σ_layers row
        self._layer_count: dict[int, int] = {}
        self._summary: dict[tuple, list] = {}                              # layers -> [Σ_queries rows[:, :, :P], count]
        self._pending: dict[int, list[tuple[tuple, np.ndarray]]] = {}      # query -> [(layers, rows)]

    def observe(self, block: Block) -> None:
        B, H, Q, S = block.shape
        if self._step and block.layer <= self._step[-1][0]:                # a new forward call (or block)
            self._flush()
        for r, q in producing_rows(block, self.P):
            got = metrics.received_row(block.a[0, :, r], block.pulled_back[0, :, r], block.output_sq[0, r],
                                       block.group_values[0])        # [TABLE_METRICS, S]
            n = min(S, q + 1 - block.k_start)                        # sources up to the query
            self._step.append((block.layer, q, block.k_start, got[:, :n]))

    def _flush(self) -> None:
        """Reduce the waiting rows: one copy to the host per device, then per query all its layers'
        rows at once."""
        step, self._step = self._step, []
        if not step:
            return
        host: list = [None] * len(step)
        for at, joined in rows_by_device([got for *_, got in step]):
            parts = np.split(joined.cpu().numpy(), np.cumsum([step[i][3].shape[1] for i in at])[:-1], axis=1)
            for i, part in zip(at, parts):
                host[i] = part                                               # [TABLE_METRICS, n]
        by_query: dict[int, list[tuple[int, int, np.ndarray]]] = {}
        for (layer, q, k0, _), row in zip(step, host):
            by_query.setdefault(q, []).append((layer, k0, row))
        for q, items in by_query.items():
            rows = np.zeros((len(items), len(TABLE_METRICS), q + 1))
            for i, (_, k0, row) in enumerate(items):
                rows[i, :, k0:k0 + row.shape[1]] = row
            self._add_rows(q, tuple(layer for layer, *_ in items), rows)

    def _add_rows(self, q: int, layers: tuple, rows: np.ndarray) -> None:
        """The rows ``[len(layers), metrics, q + 1]`` of query ``q``: their tables now, their sums."""
        shares, top, m = self._shares(rows, q), self._top(rows.reshape(-1, q + 1)), len(TABLE_METRICS)
        for i, layer in enumerate(layers):
            self._tables[(layer, q)] = (shares[i], top[i * m:(i + 1) * m])
        self._layer_sum[q] = rows.sum(0) + self._layer_sum.get(q, 0.0)
        self._layer_count[q] = self._layer_count.get(q, 0) + len(layers)
        for earlier in [k for k in self._pending if k < q]:               # a later query came: producing rows
            self._commit(earlier)
        self._pending.setdefault(q, []).append((layers, rows))

    def _commit(self, q: int) -> None:
        """Add the query's pending rows to their layers' summary sums."""
        for layers, rows in self._pending.pop(q):
            have = self._summary.setdefault(layers, [0.0, 0])
            have[0] = have[0] + rows[:, :, :self.P]
            have[1] += 1

    def _summary_means(self) -> dict[int, np.ndarray]:
        """Per layer the mean of its committed rows' prompt columns: ``{layer: [metrics, P]}``."""
        sums: dict[int, list] = {}
        for layers, (total, count) in self._summary.items():
            for i, layer in enumerate(layers):
                have = sums.setdefault(layer, [0.0, 0])
                have[0], have[1] = have[0] + total[i], have[1] + count
        return {layer: total / count for layer, (total, count) in sums.items()}

    def end(self, batch: InputBatch) -> None:
        T, P, index = int(batch.lengths[0]), self.P, batch.index[0]
        ids = batch.ids[0, :T].tolist()
        answer_left_out = {j for j in range(P, T) if ids[j] in self.exclude_ids}
        self._flush()
        layers = sorted({l for l, _ in self._tables})
        queries = range(P - 1, T - 1)                             # the last token produced nothing
        for q in [k for k in self._pending if k < T - 1]:
            self._commit(q)
        if layers and len(queries):
            model_rows = {q: self._layer_sum[q] / self._layer_count[q] for q in queries}
            means = self._summary_means()
            means[None] = np.mean([model_rows[q][:, :P] for q in queries], axis=0)
            shares, sources, summary = [], [], []
            for layer in [*layers, None]:
                for q in queries:
                    step = q + 1 - P
                    base = {"text": index, "step": step, "position": q + 1, "token_id": ids[q + 1], "layer": layer,
                            "query": q}
                    row_shares, top = (self._tables[(layer, q)] if layer is not None
                                       else (self._shares(model_rows[q], q), self._top(model_rows[q])))
                    shares.append({**base, **self._shares_dict(row_shares)})
                    for m, (at, score) in zip(TABLE_METRICS, top):
                        ranked = [(int(j), float(x)) for j, x in zip(at, score) if j not in answer_left_out]
                        sources += [{**base, "metric": m, "rank": r, "source": j, "source_id": ids[j], "score": x}
                                    for r, (j, x) in enumerate(ranked)]
                mean = means[layer]                                                # [metrics, P]
                summary.append(pd.DataFrame({"text": index, "layer": layer, "position": np.arange(P),
                                             "token_id": ids[:P], **{m: mean[k] for k, m in enumerate(TABLE_METRICS)}}))
            self.shares.append(_nullable_layer(pd.DataFrame(shares)))
            self.sources.append(_nullable_layer(pd.DataFrame(sources)))
            self.summary.append(_nullable_layer(pd.concat(summary, ignore_index=True)))
        self._reset()

    def _shares(self, rows: np.ndarray, q: int) -> np.ndarray:
        """Each metric's ``(sink, prompt, answer)`` shares of rows ``[..., metrics, q + 1]``: ``[..., metrics, 3]``."""
        P, sink = self.P, self.sink
        s = rows[..., sink] if sink <= q else np.zeros(rows.shape[:-1])
        out = np.stack([s, rows[..., :P].sum(-1), rows[..., P:].sum(-1)], axis=-1)
        if sink <= q:
            out[..., 1 if sink < P else 2] -= s                 # the sink is neither prompt nor answer
        return out

    def _shares_dict(self, shares: np.ndarray) -> dict:
        return {f"{m}_{part}": float(shares[k, i]) for k, m in enumerate(TABLE_METRICS)
                for i, part in enumerate(("sink", "prompt", "answer"))}

    def _top(self, rows: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per row of ``rows [R, n]`` (one metric each) its ``top_k`` sources (not left out) and their
        scores, the highest first, ties the earlier position first: ``[(positions, scores)] * R``.
        All rows at once: only what can rank is sorted (each row's k-th largest and above; a row
        with a NaN, all of it), by row, score and position."""
        keep = np.ones(rows.shape[1], dtype=bool)
        keep[self._left_out_at[self._left_out_at < rows.shape[1]]] = False
        cand, k_top = np.flatnonzero(keep), self.top_k
        scores = rows[:, cand]                                               # [R, m]
        if len(cand) > k_top:
            kth = np.partition(scores, len(cand) - k_top, axis=1)[:, len(cand) - k_top]
            can_rank = (scores >= kth[:, None]) | np.isnan(scores).any(1, keepdims=True)
        else:
            can_rank = np.ones(scores.shape, dtype=bool)
        r, c = np.nonzero(can_rank)
        order = np.lexsort((c, -scores[r, c], r))
        r, c = r[order], c[order]
        rank = np.arange(len(r)) - np.searchsorted(r, r)                     # place within its row
        r, c = r[rank < k_top], c[rank < k_top]
        bounds = np.searchsorted(r, np.arange(len(rows) + 1))
        return [(cand[c[b0:b1]], scores[r[b0:b1], c[b0:b1]]) for b0, b1 in zip(bounds[:-1], bounds[1:])]

    def result(self) -> dict[str, pd.DataFrame]:
        """The three tables; ``layer`` is a nullable integer (null: the model) however the state travelled."""
        return {name: (_nullable_layer(pd.concat(getattr(self, name), ignore_index=True)) if getattr(self, name)
                       else pd.DataFrame()) for name in self.STATE}


def _nullable_layer(df: pd.DataFrame) -> pd.DataFrame:
    if "layer" in df:
        df["layer"] = pd.array([None if pd.isna(x) else int(x) for x in df["layer"]], dtype="Int64")
    return df


class Answers(Reducer):
    """The generated text of each prompt (``answers`` table: ``text``, ``prompt_tokens``,
    ``answer_tokens``, ``stopped`` (ended on a stop token), ``answer_ids`` (space-separated))."""

    STATE = ("answers",)
    READS_LAST_TOKEN = False

    def __init__(self, stop: Iterable[int] = ()):
        self.stop = set(int(s) for s in stop)
        self.answers: list[pd.DataFrame] = []

    def observe(self, block: Block) -> None:
        pass

    def end(self, batch: InputBatch) -> None:
        T, P = int(batch.lengths[0]), int(batch.prompt_length)
        answer = batch.ids[0, P:T].tolist()
        self.answers.append(pd.DataFrame([{
            "text": batch.index[0], "prompt_tokens": P, "answer_tokens": len(answer),
            "stopped": bool(answer) and answer[-1] in self.stop, "answer_ids": " ".join(map(str, answer))}]))

    def result(self) -> pd.DataFrame:
        return pd.concat(self.answers, ignore_index=True) if self.answers else pd.DataFrame()
