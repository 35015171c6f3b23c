"""Observers that reduce attention blocks as the forward pass goes (the quantities of SPEC §2).

A reducer sees every :class:`~attngeom.capture.blocks.Block` of the layers it is run on and keeps only
summaries, so that long inputs and whole corpora can be analysed in bounded memory. The later
analyses (interventions, sinks, selection geometry, head taxonomy) are reducers too.

Life cycle, driven by :func:`attngeom.streaming.passes.stream`::

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

from attngeom.metrics import registry
from attngeom.capture.blocks import Block
from attngeom.capture.kernel import Workspace
from attngeom.capture.routes import FUSED_RECEIVED, FusedLayer


@dataclass
class InputBatch:
    """Right-padded token ids of several texts (a batch of *inputs*, what a reducer's ``begin`` and
    ``end`` see). ``ids [B, T]``, ``lengths [B]``, ``index``: each text's position in the input stream."""

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
    pandas (see :func:`attngeom.runs.run.merge_sums`, which adds states of several units), and
    :meth:`load_state` puts a (merged) state back, so ``result()`` of the merged state equals
    ``result()`` of one reducer that saw every unit."""

    STATE: tuple[str, ...] = ()
    READS_LAST_TOKEN = True
    """Whether, observing a generation's steps, the reducer reads the last generated token's row
    (which produces no token). When no step reducer does, :func:`attngeom.generation.decoding.stream_generation`
    does not run that token (text reducers see it in their own call of the whole answer). An
    observer without this attribute counts as reading it."""

    def state(self) -> dict:
        return {name: _export(getattr(self, name)) for name in self.STATE}

    def load_state(self, state: dict) -> "Reducer":
        for name in self.STATE:
            setattr(self, name, _import(state[name]))
        return self

    def begin(self, batch: InputBatch) -> None:
        self.batch = batch

    def observe(self, block: Block) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def end(self, batch: InputBatch) -> None:
        pass

    def result(self):
        raise NotImplementedError


def _export(x):
    if isinstance(x, dict):
        return {str(k): _export(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().copy()   # a snapshot: the reducer adds into its tensors in place
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


def sums_device(device: torch.device) -> torch.device:
    """Where a reducer keeps its float64 sums for blocks on ``device``: that device, so that a block
    adds into them without a copy to the host (one synchronisation per block on a GPU); the host
    for a device without float64 (Apple's ``mps``). They come to the host once per batch
    (``end``) or at ``result`` / ``state``."""
    return torch.device("cpu") if device.type == "mps" else device


def as_sums(x, device: torch.device) -> torch.Tensor:
    """``x`` (a tensor, or a number: a merged state's counts are numpy scalars) in float64 on
    ``device`` (:func:`sums_device`), moved before the cast (``mps`` has no float64)."""
    return torch.as_tensor(x).to(device).double()


def add_into(sums: dict, key, x: torch.Tensor) -> None:
    """Add ``x`` into ``sums[key]``, a float64 sum (zero when new) kept on :func:`sums_device` of
    ``x``'s device (moved there once when a loaded state put it on the host): no copy per block."""
    device = sums_device(x.device)
    s = sums.get(key)
    if s is None:
        s = sums[key] = torch.zeros(x.shape, dtype=torch.float64, device=device)
    elif s.device != device:
        s = sums[key] = s.to(device)
    s.add_(as_sums(x.detach(), device))


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


def _winner_is_self_or_sink(block: Block, norms: torch.Tensor, sink_col: int,
                            workspace: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether the winner ``argmax_j a_ij n_j`` (SPEC §6; the first maximum, as ``argmax`` breaks
    ties) is the query itself and whether it is the sink: two ``[B, H, Q]`` float 0/1 tensors.

    ``norms [B, H, T]`` the value norms ``n_j``; ``sink_col`` the sink's column in the block. No
    ``argmax`` pass: a source is the first maximum iff it equals the row maximum and every earlier
    source is below it. The columns before ``c0`` (the block's first query) precede every query, so
    their row maximum serves both the row maximum and "every source before the query"; only the
    columns from ``c0`` on are reduced twice, once as they are and once with the sources from the
    query on set to ``-inf``: one pass over the block and one over its ``[Q, Q]`` part, not two
    over the block. The ``[B, H, Q, S]`` product is written into ``workspace`` when one is given."""
    B, H, Q, S = block.shape
    out = None if workspace is None else workspace.take("winner", block.a.shape, block.a.dtype, block.a.device)
    x = torch.mul(block.a, norms[:, :, block.k_start:block.k_start + S].unsqueeze(-2), out=out)  # [B, H, Q, S]
    c0 = min(S, max(0, block.q_start - block.k_start))           # columns before c0 precede every query
    early = x[..., :c0].amax(-1) if c0 > 0 else None                                # [B, H, Q]
    late = x[..., c0:]
    top = late.amax(-1) if c0 < S else early
    if early is not None and c0 < S:
        top = torch.maximum(early, top)
    if 0 <= sink_col < S:
        w_sink = x[..., sink_col] == top
        if sink_col > 0:
            w_sink &= x[..., :sink_col].amax(-1) < top
    else:
        w_sink = torch.zeros_like(top, dtype=torch.bool)
    self_col = block.q_positions - block.k_start                                    # [Q]
    in_block = (self_col >= 0) & (self_col < S)
    x_self = x.gather(-1, self_col.clamp(0, S - 1).view(1, 1, Q, 1).expand(B, H, Q, 1)).squeeze(-1)
    before = early
    if c0 < S:
        late.masked_fill_(block.k_positions[None, c0:] >= block.q_positions[:, None], float("-inf"))
        before = late.amax(-1) if early is None else torch.maximum(early, late.amax(-1))
    w_self = (x_self == top) & (before < top) & in_block
    return w_self.float(), w_sink.float()


class HeadStats(Reducer):
    """Per-(layer, head) means over all real queries ``i > 0`` of the stream.

    Columns: ``sink_rate`` (``a_i0``), ``sink_contribution`` (intra ``c_i0``),
    ``sink_contribution_inter`` (``C_i0^h``), ``self_attention`` (``a_ii``), ``entropy`` (nats),
    ``head_output_norm`` (``‖o_i^h‖``), ``head_share`` (``Σ_j C_ij^h``), and the source-winner
    shares ``winner_self`` / ``winner_sink`` / ``winner_other`` of SPEC §6 (``argmax_j a_ij‖v_j‖``;
    ``winner_norm="projected"`` uses ``‖ṽ_j‖`` instead). ``fields`` picks some of the columns
    (default all); only what they need is computed (:attr:`needs`): e.g.
    ``HeadStats(fields=("sink_rate", "self_attention", "entropy"))`` reads attention only."""

    STATE = ("sums", "counts")
    FIELDS = ("sink_rate", "sink_contribution", "sink_contribution_inter", "self_attention", "entropy",
              "head_output_norm", "head_share", "winner_self", "winner_sink", "winner_other")

    FIELD_NEEDS = {"sink_rate": ("attention",), "self_attention": ("attention",), "entropy": ("entropy",),
                   "sink_contribution": ("uG", "head_output_sq"),
                   "sink_contribution_inter": ("pulled_back", "output_sq"),
                   "head_output_norm": ("head_output_norm",), "head_share": ("head_share",)}
    """Block quantities each column reads (the winner columns: the value norm of ``winner_norm``)."""

    def __init__(self, sink: int = 0, winner_norm: str = "raw", fields=None):
        if winner_norm not in ("raw", "projected"):
            raise ValueError(f"winner_norm must be 'raw' (‖v_j‖) or 'projected' (‖ṽ_j‖), got {winner_norm!r}")
        self.fields = self.FIELDS if fields is None else tuple(fields)
        bad = [f for f in self.fields if f not in self.FIELDS]
        if bad:
            raise ValueError(f"unknown HeadStats field {bad[0]!r}; known: {', '.join(self.FIELDS)}")
        self.sink = sink
        self.winner_norm = winner_norm
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self._acc: dict[int, torch.Tensor] = {}   # layer -> [fields, H] float64 (see _accumulator)
        self._workspace = Workspace()              # the winner product's buffer, reused block to block

    @property
    def needs(self) -> frozenset[str]:
        out = {q for f in self.fields for q in self.FIELD_NEEDS.get(f, ())}
        if any(f.startswith("winner_") for f in self.fields):
            out |= {"attention", "value_norm" if self.winner_norm == "projected" else "raw_value_norm"}
        return frozenset(out)

    fused = True
    """Every column has a fused route (:meth:`observe_layer`, SPEC §10)."""

    def observe(self, block: Block) -> None:
        self._add(block, self.per_query(block))

    def observe_layer(self, layer: FusedLayer) -> None:
        """A whole layer on the fused route (SPEC §10): the same sums as its blocks would add."""
        self._add(layer, self.per_query_fused(layer))

    def _add(self, part, per_query: dict) -> None:
        """Add the per-query values of ``part`` (a block, or a fused layer) over its real queries ``i > 0``."""
        w = _query_weights(part)                                   # [B, Q]
        H = part.shape[1]
        device = sums_device(w.device)
        acc = self._accumulator(part.layer, H, device)
        values = torch.stack([per_query[k]() for k in self.fields])             # [fields, B, H, Q]
        w = w[None, :, None, :]
        # a padded query whose row sees no source (a sliding window past the text's end) may hold NaN: left out
        acc += as_sums((torch.where(w > 0, values, 0.0) * w).sum((1, 3)), device)
        self.counts[part.layer] = as_sums(self.counts.get(part.layer, 0.0), device) + as_sums(w.sum(), device)

    def _accumulator(self, layer: int, H: int, device: torch.device) -> torch.Tensor:
        """The layer's ``[fields, H]`` float64 sums on ``device`` (:func:`sums_device`), one tensor
        (one addition per block), whose rows ``sums[layer][field]`` are views; rebuilt from ``sums``
        if those were replaced (``load_state``) or live elsewhere."""
        acc, sums = self._acc.get(layer), self.sums.get(layer)
        if (acc is None or sums is None or sums[self.fields[0]].data_ptr() != acc.data_ptr()
                or acc.device != device):
            acc = (torch.stack([sums[k] for k in self.fields]).to(device) if sums
                   else torch.zeros(len(self.fields), H, dtype=torch.float64, device=device))
            self._acc[layer] = acc
            self.sums[layer] = {k: acc[i] for i, k in enumerate(self.fields)}
        return acc

    def per_query(self, block: Block) -> dict:
        """``{field: () -> [B, H, Q] per-query value}``: each computed only when its field is asked."""
        B, H, Q, S = block.shape
        qpos = block.q_positions
        a = block.a
        sink_col = self.sink - block.k_start
        has_sink = 0 <= sink_col < S
        zeros = torch.zeros(B, H, Q, device=a.device)

        def self_attention():
            self_idx = (qpos - block.k_start).clamp(0, S - 1)
            return a.gather(-1, self_idx.view(1, 1, Q, 1).expand(B, H, Q, 1)).squeeze(-1)

        per_query = {
            # a learned sink logit (gpt-oss) parks attention too: its share counts as sink (SPEC §4)
            "sink_rate": lambda: (a[..., sink_col] if has_sink else zeros) + (
                0.0 if block.learned_sink is None else block.learned_sink),
            "sink_contribution": lambda: block.contribution_column(sink_col) if has_sink else zeros,
            "sink_contribution_inter": lambda: block.contribution_inter_column(sink_col) if has_sink else zeros,
            "self_attention": self_attention,
            "entropy": lambda: block.entropy,
            "head_output_norm": lambda: block.head_output_norm,
            "head_share": lambda: block.head_share,
        }
        if any(f.startswith("winner_") for f in self.fields):
            norms = block.state.value_norm if self.winner_norm == "projected" else block.state.raw_value_norm
            w_self, w_sink = _winner_is_self_or_sink(block, norms, sink_col, self._workspace)
            per_query.update(winner_self=lambda: w_self, winner_sink=lambda: w_sink,
                             winner_other=lambda: 1.0 - w_self - w_sink)
        return per_query

    def per_query_fused(self, layer: FusedLayer) -> dict:
        """:meth:`per_query` of a whole layer on the fused route: one column, the diagonal, the
        entropy from ``lse``, the outputs, and the source winners of D2's row-wise kernel."""
        B, H, T, _ = layer.shape
        s = self.sink
        has_sink = 0 <= s < T
        zeros = layer.q.new_zeros(B, H, T)
        per_query = {
            "sink_rate": lambda: (layer.attention_column(s) if has_sink else zeros) + (
                0.0 if layer.learned_sink is None else layer.learned_sink),
            "sink_contribution": lambda: layer.contribution_column(s) if has_sink else zeros,
            "sink_contribution_inter": lambda: layer.contribution_inter_column(s) if has_sink else zeros,
            "self_attention": lambda: layer.self_attention,
            "entropy": lambda: layer.entropy,
            "head_output_norm": lambda: layer.head_output_norm,
            "head_share": lambda: layer.head_share,
        }
        if any(f.startswith("winner_") for f in self.fields):
            winner = layer.winner(layer.value_norm if self.winner_norm == "projected" else layer.raw_value_norm)
            w_self = (winner == layer.q_positions).to(zeros.dtype)
            w_sink = (winner == s).to(zeros.dtype)
            per_query.update(winner_self=lambda: w_self, winner_sink=lambda: w_sink,
                             winner_other=lambda: 1.0 - w_self - w_sink)
        return per_query

    def result(self) -> pd.DataFrame:
        rows = []
        for layer in sorted(self.sums):
            n = float(self.counts[layer])
            sums = torch.stack([self.sums[layer][k] for k in self.fields]).cpu()    # one copy per layer
            for h in range(sums.shape[1]):
                row = {"layer": layer, "head": h, "queries": int(n)}
                for i, k in enumerate(self.fields):
                    row[k] = float(sums[i, h]) / n if n else float("nan")
                rows.append(row)
        return pd.DataFrame(rows)


class TokenStats(Reducer):
    """Per-(text, layer, position) summaries.

    Source side (what the token receives, averaged over the queries that can see it, token-level
    scores of SPEC §2): ``attention_received``, ``value_weighted_received``,
    ``output_normalized_received``, ``contribution_received``, and ``value_norm`` (mean over heads
    of ``‖ṽ_j^h‖``); by default the metrics :func:`attngeom.metrics.registry.received_names` lists. Query
    side: ``sink_rate`` (mean over heads of ``a_i0``), ``entropy`` (mean over heads),
    ``output_norm`` (``‖o_i‖``). ``metrics`` and ``columns`` pick some of them (default
    all); only what they need is computed (:attr:`needs`): e.g.
    ``TokenStats(metrics=("attention",), columns=("sink_rate", "entropy"))`` reads attention only."""

    COLUMNS = ("value_norm", "sink_rate", "entropy", "output_norm")
    COLUMN_NEEDS = {"value_norm": ("value_norm",), "sink_rate": ("attention",), "entropy": ("entropy",),
                    "output_norm": ("output_norm",)}
    STATE = ("frames",)

    def __init__(self, sink: int = 0, metrics=None, columns=None):
        self.metrics = registry.received_names() if metrics is None else tuple(metrics)
        self.columns = self.COLUMNS if columns is None else tuple(columns)
        bad = [c for c in self.columns if c not in self.COLUMNS]
        if bad:
            raise ValueError(f"unknown TokenStats column {bad[0]!r}; known: {', '.join(self.COLUMNS)}")
        registry.closure(self.metrics)                                    # unknown metric names raise here
        self.sink = sink
        self.frames: list[pd.DataFrame] = []
        self._acc: dict[int, dict[str, torch.Tensor]] = {}

    def begin(self, batch: InputBatch) -> None:
        super().begin(batch)
        self._acc = {}

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({"attention", *self.metrics, *(q for c in self.columns for q in self.COLUMN_NEEDS[c])})

    def observe(self, block: Block) -> None:
        B, H, Q, S = block.shape
        acc = self._acc.get(block.layer)
        if acc is None:
            acc = self._acc[block.layer] = self._accumulators(block.a.device, block.state.num_sources)
        device = acc["_source"].device
        if "value_norm" in acc and acc["_norms_known"] < block.state.num_sources:   # first block, or sources grew
            known, S_all = acc["_norms_known"], block.state.num_sources
            acc["value_norm"][:, known:S_all] = as_sums(block.state.value_norm[:, :, known:].mean(1), device)
            acc["_norms_known"] = S_all
        w = block.query_valid.float()                              # [B, Q]
        received = block.received(w, self.metrics) if self.metrics else {}
        ks = slice(block.k_start, block.k_start + S)
        acc["_source"][:, :, ks] += as_sums(torch.stack([_seen_by(block, w), *received.values()]), device)
        per_query = []                                             # [B, Q] each, in the order of _query
        sink_col = self.sink - block.k_start
        for c in self._query:
            if c == "sink_rate":
                per_query.append(block.a[..., sink_col].mean(1) if 0 <= sink_col < S else w.new_zeros(B, Q))
            elif c == "entropy":
                per_query.append(block.entropy.mean(1))
            else:
                per_query.append(block.output_norm)
        if per_query:
            acc["_query"][:, :, block.q_start:block.q_start + Q] = as_sums(torch.stack(per_query), device)

    @property
    def fused(self) -> bool:
        """Whether :meth:`observe_layer` serves every metric asked (SPEC §10: the built-in received ones)."""
        return set(self.metrics) <= set(FUSED_RECEIVED)

    def observe_layer(self, layer: FusedLayer) -> None:
        """A whole layer on the fused route (SPEC §10): the same columns as its blocks would give."""
        B, H, T, _ = layer.shape
        acc = self._acc.get(layer.layer)
        if acc is None:
            acc = self._acc[layer.layer] = self._accumulators(layer.q.device, T)
        device = acc["_source"].device
        if "value_norm" in acc:
            acc["value_norm"][:, :T] = as_sums(layer.value_norm.mean(1), device)
            acc["_norms_known"] = T
        w = layer.query_valid.to(layer.q.dtype)                    # [B, T]
        received = layer.received(w, self.metrics, value_norm=layer.value_norm) if self.metrics else {}
        acc["_source"][:, :, :T] += as_sums(torch.stack([layer.seen_by(w), *received.values()]), device)
        s = self.sink
        columns = {"sink_rate": lambda: layer.attention_column(s).mean(1) if 0 <= s < T else w.new_zeros(B, T),
                   "entropy": lambda: layer.entropy.mean(1), "output_norm": lambda: layer.output_norm}
        if self._query:
            acc["_query"][:, :, :T] = as_sums(torch.stack([columns[c]() for c in self._query]), device)

    @property
    def _query(self) -> tuple[str, ...]:
        return tuple(c for c in self.columns if c != "value_norm")

    def _accumulators(self, device: torch.device, num_sources: int) -> dict[str, torch.Tensor]:
        """A layer's float64 ``[B, T]`` sums and values by name on the layer's device
        (:func:`sums_device`), as views of two tensors (one addition and one copy per block):
        ``_source`` (``seen_by`` and each ``<metric>_received``) and ``_query`` (the query-side
        columns); brought to the host at :meth:`end` (:meth:`_views`)."""
        B, T = self.batch.ids.shape
        device = sums_device(device)
        source = torch.zeros(1 + len(self.metrics), B, T, dtype=torch.float64, device=device)
        query = torch.zeros(len(self._query), B, T, dtype=torch.float64, device=device)
        acc = self._views(source, query)
        if "value_norm" in self.columns:        # filled as the sources come (a generation's grow step by step)
            acc["value_norm"] = torch.zeros(B, max(T, num_sources), dtype=torch.float64, device=device)
            acc["_norms_known"] = 0
        return acc

    def _views(self, source: torch.Tensor, query: torch.Tensor) -> dict[str, torch.Tensor]:
        """The columns by name, as views of ``source`` and ``query``."""
        return {"_source": source, "_query": query, "seen_by": source[0],
                **{f"{m}_received": source[1 + i] for i, m in enumerate(self.metrics)},
                **{c: query[i] for i, c in enumerate(self._query)}}

    def end(self, batch: InputBatch) -> None:
        for layer, on_device in sorted(self._acc.items()):
            acc = self._views(on_device["_source"].cpu(), on_device["_query"].cpu())    # one copy each per layer
            if "value_norm" in on_device:
                acc["value_norm"] = on_device["value_norm"].cpu()
            seen = acc["seen_by"].clamp_min(1)
            for b, text in enumerate(batch.index):
                L = int(batch.lengths[b])
                cols = {"text": np.full(L, text), "layer": np.full(L, layer), "position": np.arange(L),
                        "token_id": batch.ids[b, :L].numpy()}
                for m in self.metrics:
                    cols[f"{m}_received"] = (acc[f"{m}_received"][b, :L] / seen[b, :L]).numpy()
                for k in self.columns:
                    cols[k] = acc[k][b, :L].numpy()
                self.frames.append(pd.DataFrame(cols))
        self._acc = {}

    def result(self) -> pd.DataFrame:
        if not self.frames:
            return pd.DataFrame()
        return pd.concat(self.frames, ignore_index=True)


class RouteRecord(Reducer):
    """The route each layer took (SPEC §10): ``{layer: "fused" | "fused: why" | "block" | "block: why"}``
    (why: a layer the session asked to fuse that took blocks, :func:`attngeom.capture.routes.layer_route`,
    or a fused layer handed its mask whole, :data:`attngeom.capture.routes.WHOLE_MASK_ROUTE`). Batches
    of one run may differ (a left-padded batch takes its mask whole, a right-padded one does not):
    a layer that took several routes lists each, in the order first seen, joined by ``"; "``. Its
    state counts the blocks (or fused calls) per layer and route, which records of several units add."""

    STATE = ("routes",)
    fused = True

    def __init__(self):
        self.routes: dict[int, dict[str, int]] = {}

    def _seen(self, layer: int, route: str) -> None:
        calls = self.routes.setdefault(layer, {})
        calls[route] = calls.get(route, 0) + 1

    def observe(self, block: Block) -> None:
        self._seen(block.layer, block.state.route)

    def observe_layer(self, layer: FusedLayer) -> None:
        self._seen(layer.layer, layer.route)

    def result(self) -> dict[int, str]:
        return {l: "; ".join(r) for l, r in sorted(self.routes.items())}


class FullCapture(Reducer):
    """Keeps each layer's full attention map and head-space pieces for :class:`attngeom.traces.trace.Trace`.

    Memory: one ``[B, H, T, T]`` float32 map per layer plus ``[B, H, T, d]`` values. ``length``: the
    maps' ``T`` when the sources grow from call to call (generation: prompt + new tokens; each call
    copies only the values of its new sources); default the first block's sources."""

    def __init__(self, length: int | None = None):
        self.length = length
        self.layers: dict[int, dict] = {}

    def begin(self, batch: InputBatch) -> None:
        super().begin(batch)
        self.layers = {}

    def observe(self, block: Block) -> None:
        B, H, Q, S = block.shape
        T = max(block.state.v.shape[2], self.length or 0)
        st = self.layers.get(block.layer)
        if st is None:
            value = block.state.value
            st = self.layers[block.layer] = {
                "a": torch.zeros(B, H, T, T, dtype=torch.float32),
                "v": torch.zeros(B, H, T, value.shape[-1], dtype=value.dtype),
                "v_known": 0,
                "w_o": block.state.w_o.cpu(),
                "G": block.state.G.cpu(),
                "kv_head": block.state.kv_head.cpu(),
            }
        st["a"][:, :, block.q_start:block.q_start + Q, block.k_start:block.k_start + S] = block.a.cpu()
        if block.learned_sink is not None:   # gpt-oss: the learned sink's share of each row (SPEC §1)
            if "sink" not in st:
                st["sink"] = torch.zeros(B, H, T)
            st["sink"][:, :, block.q_start:block.q_start + Q] = block.learned_sink.cpu()
        known, S_all = st["v_known"], block.state.num_sources
        if S_all > known:                    # the sources this call added (a cached token's values never change)
            st["v"][:, :, known:S_all] = block.state.v_from(known).cpu()
            st["v_known"] = S_all

    def result(self) -> dict[int, dict]:
        return self.layers
