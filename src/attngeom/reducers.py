"""Observers that reduce attention blocks as the forward pass goes.

A reducer sees every :class:`~attngeom.capture.Block` of the layers it is run on and keeps only
summaries, so that long inputs and whole corpora can be analysed in bounded memory. The later
analyses (interventions, sinks, selection geometry, head taxonomy) are reducers too.

Life cycle, driven by :func:`attngeom.trace.stream`::

    reducer.begin(batch)      # a new batch of texts (ids, lengths, corpus indices)
    reducer.observe(block)    # for every layer and block of queries
    reducer.end(batch)        # the batch's forward pass is over
    reducer.result()          # whatever the reducer summarises (tables, arrays, ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .capture import Block


@dataclass
class Batch:
    """Right-padded token ids of several texts. ``ids [B, T]``, ``lengths [B]``, ``index``: each
    text's position in the input stream."""

    ids: torch.Tensor
    lengths: torch.Tensor
    index: list[int]

    @property
    def attention_mask(self) -> torch.Tensor:
        T = self.ids.shape[1]
        return (torch.arange(T)[None, :] < self.lengths[:, None]).long()


class Reducer:
    """Base class: no-op hooks, and the mergeable state the experiment runner records.

    ``STATE`` names the attributes that hold everything :meth:`result` needs, all *additive*:
    dicts (keyed by layer, name, ...) of float64 tensors or numbers (sums, counts, histograms),
    numbers, and lists of DataFrames (rows, concatenated). :meth:`state` exports them as numpy /
    pandas (see :func:`attngeom.runner.merge_sums`, which adds states of several units), and
    :meth:`load_state` puts a (merged) state back, so ``result()`` of the merged state equals
    ``result()`` of one reducer that saw every unit."""

    STATE: tuple[str, ...] = ()

    def state(self) -> dict:
        return {name: _export(getattr(self, name)) for name in self.STATE}

    def load_state(self, state: dict) -> "Reducer":
        for name in self.STATE:
            setattr(self, name, _import(state[name]))
        return self

    def begin(self, batch: Batch) -> None:
        self.batch = batch

    def observe(self, block: Block) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def end(self, batch: Batch) -> None:
        pass

    def result(self):
        raise NotImplementedError


def _export(x):
    if isinstance(x, dict):
        return {str(k): _export(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, list):
        return pd.concat(x, ignore_index=True) if x else pd.DataFrame()
    return x


def _import(x):
    if isinstance(x, dict):
        return {(int(k) if k.lstrip("-").isdigit() else k): _import(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x))
    if isinstance(x, pd.DataFrame):
        return [x] if len(x) else []
    return x


def _query_weights(block: Block, skip_first: bool = True) -> torch.Tensor:
    """``[B, Q]`` float: 1 for real queries (query 0 skipped: it can only attend to itself)."""
    w = block.query_valid.float()
    if skip_first:
        w = w * (block.q_positions[None, :] > 0).float()
    return w


def _seen_by(block: Block, w: torch.Tensor) -> torch.Tensor:
    """``Σ_i w_i [query i may attend to source j]``: ``[B, S]``, without a ``[Q, S]`` pass when causal."""
    B, H, Q, S = block.shape
    if block.allowed is not None:
        return (w[:, None, :] @ block.allowed[:, 0].expand(B, Q, S).to(w.dtype)).squeeze(1)
    suffix = w.flip(-1).cumsum(-1).flip(-1)                         # [B, Q]: Σ_{i' >= i} w_i'
    first = (block.k_positions - block.q_start).clamp_min(0)        # first query that sees j
    padded = torch.cat([suffix, suffix.new_zeros(B, 1)], dim=-1)
    return padded[:, first.clamp_max(Q)]


class HeadStats(Reducer):
    """Per-(layer, head) means over all real queries ``i > 0`` of the stream.

    Columns: ``sink_rate`` (``a_i0``), ``sink_contribution`` (intra ``c_i0``),
    ``sink_contribution_inter`` (``C_i0^h``), ``self_attention`` (``a_ii``), ``entropy`` (nats),
    ``head_output_norm`` (``‖o_i^h‖``), ``head_share`` (``Σ_j C_ij^h``), and the source-winner
    shares ``winner_self`` / ``winner_sink`` / ``winner_other`` of SPEC §6 (``argmax_j a_ij‖v_j‖``;
    ``winner_norm="projected"`` uses ``‖ṽ_j‖`` instead)."""

    STATE = ("sums", "counts")
    FIELDS = ("sink_rate", "sink_contribution", "sink_contribution_inter", "self_attention", "entropy",
              "head_output_norm", "head_share", "winner_self", "winner_sink", "winner_other")

    def __init__(self, sink: int = 0, winner_norm: str = "raw"):
        if winner_norm not in ("raw", "projected"):
            raise ValueError(f"winner_norm must be 'raw' (‖v_j‖) or 'projected' (‖ṽ_j‖), got {winner_norm!r}")
        self.sink = sink
        self.winner_norm = winner_norm
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.counts: dict[int, torch.Tensor] = {}

    def observe(self, block: Block) -> None:
        w = _query_weights(block)                                  # [B, Q]
        B, H, Q, S = block.shape
        qpos, kpos = block.q_positions, block.k_positions
        a = block.a
        sink_col = self.sink - block.k_start
        has_sink = 0 <= sink_col < S
        zeros = torch.zeros(B, H, Q, device=a.device)
        self_idx = (qpos - block.k_start).clamp(0, S - 1)
        self_att = a.gather(-1, self_idx.view(1, 1, Q, 1).expand(B, H, Q, 1)).squeeze(-1)
        norms = block.state.value_norm if self.winner_norm == "projected" else block.state.raw_value_norm
        winner = (a * norms[:, :, block.k_start:block.k_start + S].unsqueeze(-2)).argmax(-1)
        winner = kpos[winner]                                      # [B, H, Q] absolute positions
        per_query = {
            "sink_rate": a[..., sink_col] if has_sink else zeros,
            "sink_contribution": block.contribution_column(sink_col) if has_sink else zeros,
            "sink_contribution_inter": block.contribution_inter_column(sink_col) if has_sink else zeros,
            "self_attention": self_att,
            "entropy": block.entropy,
            "head_output_norm": block.head_output_norm,
            "head_share": block.head_share,
            "winner_self": (winner == qpos.view(1, 1, Q)).float(),
            "winner_sink": (winner == self.sink).float(),
        }
        per_query["winner_other"] = 1.0 - per_query["winner_self"] - per_query["winner_sink"]
        sums = self.sums.setdefault(block.layer, {k: torch.zeros(H, dtype=torch.float64) for k in self.FIELDS})
        for k, x in per_query.items():
            sums[k] += (x * w[:, None, :]).sum((0, 2)).double().cpu()
        self.counts[block.layer] = self.counts.get(block.layer, torch.zeros((), dtype=torch.float64)) + w.sum().double().cpu()

    def result(self) -> pd.DataFrame:
        rows = []
        for layer in sorted(self.sums):
            n = float(self.counts[layer])
            H = len(next(iter(self.sums[layer].values())))
            for h in range(H):
                row = {"layer": layer, "head": h, "queries": int(n)}
                for k in self.FIELDS:
                    row[k] = float(self.sums[layer][k][h]) / n if n else float("nan")
                rows.append(row)
        return pd.DataFrame(rows)


class TokenStats(Reducer):
    """Per-(text, layer, position) summaries.

    Source side (what the token receives, averaged over the queries that can see it, token-level
    scores of SPEC §2): ``attention_received``, ``value_weighted_received``,
    ``output_normalized_received``, ``contribution_received``, and ``value_norm`` (mean over heads
    of ``‖ṽ_j^h‖``). Query side: ``sink_rate`` (mean over heads of ``a_i0``), ``entropy`` (mean over
    heads), ``output_norm`` (``‖o_i‖``)."""

    SOURCE = ("attention", "value_weighted", "output_normalized", "contribution")
    STATE = ("frames",)

    def __init__(self, sink: int = 0):
        self.sink = sink
        self.frames: list[pd.DataFrame] = []
        self._acc: dict[int, dict[str, torch.Tensor]] = {}

    def begin(self, batch: Batch) -> None:
        super().begin(batch)
        self._acc = {}

    def observe(self, block: Block) -> None:
        B, H, Q, S = block.shape
        T = self.batch.ids.shape[1]
        acc = self._acc.setdefault(block.layer, {
            **{f"{m}_received": torch.zeros(B, T, dtype=torch.float64) for m in self.SOURCE},
            "seen_by": torch.zeros(B, T, dtype=torch.float64),
            "value_norm": block.state.value_norm.mean(1).double().cpu(),
            "sink_rate": torch.zeros(B, T, dtype=torch.float64),
            "entropy": torch.zeros(B, T, dtype=torch.float64),
            "output_norm": torch.zeros(B, T, dtype=torch.float64),
        })
        w = block.query_valid.float()                              # [B, Q]
        ks = slice(block.k_start, block.k_start + S)
        qs = slice(block.q_start, block.q_start + Q)
        acc["seen_by"][:, ks] += _seen_by(block, w).double().cpu()
        for m, x in block.received(w).items():
            acc[f"{m}_received"][:, ks] += x.double().cpu()
        sink_col = self.sink - block.k_start
        if 0 <= sink_col < S:
            acc["sink_rate"][:, qs] = block.a[..., sink_col].mean(1).double().cpu()
        acc["entropy"][:, qs] = block.entropy.mean(1).double().cpu()
        acc["output_norm"][:, qs] = block.layer_output.norm(dim=-1).double().cpu()

    def end(self, batch: Batch) -> None:
        for layer, acc in sorted(self._acc.items()):
            seen = acc["seen_by"].clamp_min(1)
            for b, text in enumerate(batch.index):
                L = int(batch.lengths[b])
                cols = {"text": np.full(L, text), "layer": np.full(L, layer), "position": np.arange(L),
                        "token_id": batch.ids[b, :L].numpy()}
                for m in self.SOURCE:
                    cols[f"{m}_received"] = (acc[f"{m}_received"][b, :L] / seen[b, :L]).numpy()
                for k in ("value_norm", "sink_rate", "entropy", "output_norm"):
                    cols[k] = acc[k][b, :L].numpy()
                self.frames.append(pd.DataFrame(cols))
        self._acc = {}

    def result(self) -> pd.DataFrame:
        if not self.frames:
            return pd.DataFrame()
        return pd.concat(self.frames, ignore_index=True)


class FullCapture(Reducer):
    """Keeps each layer's full attention map and head-space pieces for :class:`attngeom.trace.Trace`.

    Memory: one ``[B, H, T, T]`` float32 map per layer plus ``[B, H, T, d]`` values."""

    def __init__(self):
        self.layers: dict[int, dict] = {}

    def begin(self, batch: Batch) -> None:
        super().begin(batch)
        self.layers = {}

    def observe(self, block: Block) -> None:
        B, H, Q, S = block.shape
        T = block.state.v.shape[2]
        st = self.layers.get(block.layer)
        if st is None:
            st = self.layers[block.layer] = {
                "a": torch.zeros(B, H, T, T, dtype=torch.float32),
                "v": block.state.v.cpu(),
                "w_o": block.state.w_o.cpu(),
                "G": block.state.G.cpu(),
                "kv_head": block.state.kv_head.cpu(),
            }
        st["a"][:, :, block.q_start:block.q_start + Q, block.k_start:block.k_start + S] = block.a.cpu()

    def result(self) -> dict[int, dict]:
        return self.layers
