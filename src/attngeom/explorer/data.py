"""Data of the interactive explorer (``attngeom explore``, :meth:`attngeom.traces.trace.Trace.to_html`).

Pure data building, no HTML: which sources each query draws from, per-head statistics, per-layer
sink figures and the contribution-flow graph. :mod:`attngeom.reports.explore` renders it.

**Views and their numbers** (SPEC §2). For a layer ``l`` and a query ``i``, the sources ``j <= i``:

- one head ``h``: attention ``a_ij^h`` beside the intra-head contribution ``c_ij^h``;
- the whole layer (``head = None``, stored as view ``H``): attention = mean over heads of ``a_ij^h``
  (the token-level attention score) beside the inter-head contribution ``C_ij = Σ_h C_ij^h``;
- the heads behind a token: each head's ``C_ij^h`` (metric ``contribution_inter``), whose sum over
  heads and sources is 1 per layer, beside ``a_ij^h / H`` (as :meth:`attngeom.traces.trace.Trace.heads_for`);
- a third measure of :mod:`attngeom.metrics.registry` on request (``measure``): its per-head map for one
  head, its token-level score (``Block.token_score``) for the whole layer. A layer-only measure (ALTI,
  the rollouts) keeps the layer's view only: it has no per-head form.

Every row is the registry's: view ``v < H`` is ``Block.metric(name)`` of head ``v``, view ``H``
``Block.token_score(name)`` (:func:`views`).

**Exact or top-k.** Up to ``exact_max_tokens`` (default 512) every visible source of every
(layer, view, query) row is kept (*exact maps*). Beyond, each row keeps its ``k`` (default 8)
largest sources: by value for attention, by absolute value for contribution and the measure (so
strong negative contributions stay visible). Values are stored as float16 (top-k: rounded to 7 significant bits).

**Contribution flow** (SPEC §8): the residual shares ``r_i^l`` (:class:`ResidualShares`), the
transfer matrix ``A^l`` (:meth:`ExploreData.transfer_rows`) and the flow ``f`` back from one token
(:func:`flow`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from attngeom.model.arguments import takes_handle
from attngeom.metrics import formulas as metrics
from attngeom.metrics import registry
from attngeom.capture.blocks import Block
from attngeom.errors import InputError
from attngeom.runs.contract import ModelHandleLike
from attngeom.streaming.reducers import Reducer
from attngeom.explorer.settings import PAD, ExploreSettings, check_measure

DEFAULT_TOP_K = ExploreSettings.top_k
DEFAULT_EXACT_MAX_TOKENS = ExploreSettings.exact_max_tokens
METRICS = ("attention", "contribution", "contribution_inter")
"""Stored rows: attention (view H: mean over heads), the intra-head contribution ``c_ij^h`` (view H:
``C_ij``) and the inter-head contribution ``C_ij^h`` (view H: ``C_ij``), which splits a layer's
``C_ij`` by head (the page's heads behind a token; exact maps only, so that top-k pages stay small)."""
SHOWN = ("attention", "contribution")
"""The two metrics of the page's Sources panel, side by side (a measure, when asked, is the third)."""
HEAD_STATS = ("sink_rate", "sink_contribution", "head_share", "regime")
RESIDUAL_DECIMALS = 4  # residual shares are kept to 4 decimals (the page gets the same numbers)
TOPK_MANTISSA_BITS = 6
"""Top-k values keep 6 of float16's 10 mantissa bits (7 significant bits, relative rounding error
at most 2^-7 < 0.8%): what keeps T = 2048 on the bundled model under 25 MB. Exact maps keep float16."""


# --------------------------------------------------------------------------------------------
# The data
# --------------------------------------------------------------------------------------------


@dataclass
class ExploreData:
    """Everything the explorer shows for one text.

    ``rows[metric][k]`` for the analysed layer ``layers[k]`` (:func:`stored`: the metrics kept):

    - exact (``top_k is None``): float16 ``[V, T, T]``, entry ``[v, i, j]`` for ``j <= i`` (zero above
      the diagonal); ``V = H+1``: view ``v < H`` is head ``v``, view ``H`` the whole layer (a layer-only
      ``measure``: ``V = 1``, the whole layer);
    - top-k: ``(idx uint16 [V, T, k], val float16 [V, T, k])``, ``idx`` the source position
      (nearest first; ``PAD`` where a query sees fewer than ``k`` sources), ``val`` rounded to
      :data:`TOPK_MANTISSA_BITS` mantissa bits.

    ``measure``: the registry measure shown beside attention and contribution (None: none).

    ``head_stats[name]``: float ``[len(layers), H]`` (``regime``: 0 Retriever, 1 Mixer, 2 Reset;
    ``direct_effect``, from :func:`build` only: each head's direct effect on the logit of the token
    after the page's first query row, :func:`direct_effect_grid`).
    ``layer_sink``: ``{"sink_attention", "sink_contribution", "sink_share"}`` each ``[len(layers)]``.
    ``residual_share``: ``[len(layers), T]`` (``r_i^l``), or None when unknown (a saved Trace).
    ``answer``: for a generation (:func:`build` with ``decoding``), ``{"prompt_length": P, "layers":
    {metric: [len(layers), P]}, "model": {metric: [P]}}``: each prompt token's mean token-level score
    over the answer's producing rows (:class:`attngeom.generation.answers.AnswerSources`' summary); else None.
    ``special``, ``template``: the positions of special tokens and of the chat template's own tokens
    (marked on the page, and optionally left out of its rankings)."""

    tokens: list[str]
    ids: list[int]
    layers: list[int]
    num_heads: int
    rows: dict[str, list]
    head_stats: dict[str, np.ndarray]
    layer_sink: dict[str, np.ndarray]
    residual_share: np.ndarray | None
    top_k: int | None = None
    sink: int = 0
    model_name: str = ""
    meta: dict = field(default_factory=dict)
    answer: dict | None = None
    special: list[int] = field(default_factory=list)
    template: list[int] = field(default_factory=list)
    measure: str | None = None

    @property
    def T(self) -> int:
        return len(self.ids)

    def to_html(self, path: str | Path) -> Path:
        """Write the explorer page (one offline HTML file, docs/explore.md) to ``path``; returns it."""
        from attngeom.reports.explore import write

        return write(self, path)

    @property
    def exact(self) -> bool:
        return self.top_k is None

    def _k(self, layer: int) -> int:
        try:
            return self.layers.index(int(layer))
        except ValueError:
            raise InputError(f"layer {layer} was not analysed; analysed: {self.layers}") from None

    def _view(self, metric: str, head: int | None) -> int:
        """The stored view of ``metric`` for ``head`` (None: the whole layer); a layer-only measure has
        no per-head view and refuses one in one line."""
        known = METRICS + ((self.measure,) if self.measure not in (None, *METRICS) else ())
        if metric not in known:
            raise InputError(f"unknown metric {metric!r}; known: {', '.join(known)} "
                             "(build(..., measure=NAME) adds a measure of attngeom.metrics.registry)")
        if metric not in self.rows:
            raise InputError(f"{metric} rows are kept with exact maps only (up to exact_max_tokens tokens)")
        if not registry.get(metric).layer_only:
            return self.num_heads if head is None else int(head)
        if head is not None:
            raise InputError(f"{metric} is defined on the layer (all heads at once): it has a token-level score "
                             "and no per-head form")
        return 0

    def sources(self, layer: int, head: int | None, query: int, metric: str) -> list[tuple[int, float]]:
        """``[(source position, value), ...]`` of one row, by value (largest first), as stored."""
        v = self._view(metric, head)
        entry = self.rows[metric][self._k(layer)]
        if self.exact:
            vals = entry[v, query, : query + 1].astype(np.float32)
            pairs = [(j, float(vals[j])) for j in range(query + 1)]
        else:
            idx, val = entry
            pairs = [(int(j), float(x)) for j, x in zip(idx[v, query], val[v, query].astype(np.float32)) if j != PAD]
        return sorted(pairs, key=lambda p: (-p[1], p[0]))

    def top_source(self, layer: int, head: int | None, query: int, metric: str) -> int:
        """The source with the largest value (ties: the earlier position) — what the page lists first."""
        return self.sources(layer, head, query, metric)[0][0]

    def transfer_rows(self, layer: int) -> list[dict[int, float]]:
        """The transfer matrix ``A^l`` of SPEC §8 as sparse rows ``[{j: A_ij}]`` (what :func:`flow` composes);
        residual share 0 when unknown."""
        k = self._k(layer)
        r = self.residual_share[k] if self.residual_share is not None else np.zeros(self.T)
        out = []
        for i in range(self.T):
            row = {j: (1.0 - float(r[i])) * c for j, c in self.sources(layer, None, i, "contribution")}
            row[i] = row.get(i, 0.0) + float(r[i])
            out.append(row)
        return out


def flow(transfers: list[list[dict[int, float]]], token: int, T: int) -> np.ndarray:
    """Contribution flow from ``token`` back through the layers.

    ``transfers[k]``: the sparse rows of ``A`` of the ``k``-th analysed layer (lowest first), each
    ``[{source: weight}]`` of length ``T``. Returns ``f [len(transfers)+1, T]`` float64: ``f[K] = e_token``
    (after the last layer) and ``f[k] = f[k+1] A^{(k)}`` (entering layer ``k``)."""
    K = len(transfers)
    f = np.zeros((K + 1, T))
    f[K, token] = 1.0
    for k in range(K - 1, -1, -1):
        rows = transfers[k]
        for i in np.nonzero(f[k + 1])[0]:
            w = f[k + 1, i]
            for j, a in rows[i].items():
                f[k, j] += w * a
    return f


# --------------------------------------------------------------------------------------------
# Collecting the rows while the forward pass runs
# --------------------------------------------------------------------------------------------


def _topk_rows(x: torch.Tensor, k: int, q_pos: torch.Tensor, k_pos: torch.Tensor, by_abs: bool):
    """``x [V, Q, S]`` -> (idx uint16-able int64 ``[V, Q, k]`` absolute positions, PAD where invisible;
    values ``[V, Q, k]``), the ``k`` largest per row (by ``|x|`` when ``by_abs``)."""
    V, Q, S = x.shape
    kk = min(k, S)
    visible = k_pos[None, None, :] <= q_pos[None, :, None]
    key = x.abs() if by_abs else x
    key = torch.where(visible, key, torch.full_like(key, -float("inf")))
    _, top = key.topk(kk, dim=-1)
    vals = x.gather(-1, top)
    pos = k_pos[top]
    ok = visible.expand(V, Q, S).gather(-1, top)
    pos = torch.where(ok, pos, torch.full_like(pos, PAD))
    vals = torch.where(ok, vals, torch.zeros_like(vals))
    if kk < k:
        pos = torch.cat([pos, torch.full((V, Q, k - kk), PAD, dtype=pos.dtype, device=pos.device)], -1)
        vals = torch.cat([vals, vals.new_zeros(V, Q, k - kk)], -1)
    order = torch.where(pos == PAD, -1, pos).argsort(dim=-1, descending=True, stable=True)  # nearest first
    return pos.gather(-1, order), vals.gather(-1, order)


def round_float16(x: np.ndarray, bits: int = 7) -> np.ndarray:
    """float16 rounded to nearest with ``bits`` explicit mantissa bits (of 10): relative error at most
    ``2^-(bits+1)``; the dropped low bits are zero, which compresses far better."""
    drop = 10 - int(bits)
    if drop <= 0:
        return x.astype(np.float16)
    u = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    u = (u + (1 << (drop - 1))) & (0xFFFF ^ ((1 << drop) - 1))
    return u.astype(np.uint16).view(np.float16)


def stored(top_k: int | None, measure: str | None = None) -> tuple[str, ...]:
    """The metrics whose rows a page keeps: :data:`METRICS` with exact maps, :data:`SHOWN` with top-k
    rows, then ``measure`` (when not one of them)."""
    kept = METRICS if top_k is None else SHOWN
    return kept + ((measure,) if measure is not None and measure not in kept else ())


def views(block: Block, name: str) -> torch.Tensor:
    """The rows of registry metric ``name`` in one block (batch of one), float32: ``[H+1, Q, S]``, each
    head's map (``Block.metric``) then the whole layer's token-level score (``Block.token_score``);
    ``[1, Q, S]``, the layer's alone, for a layer-only measure."""
    layer = block.token_score(name)[0].float()[None]
    if registry.get(name).layer_only:
        return layer
    return torch.cat([block.metric(name)[0].float(), layer])


class RowCollector(Reducer):
    """Keeps, per analysed layer, the explorer rows (module docstring) of one text (batch of one):
    those of :func:`stored` (``measure``: a registry measure besides). ``T``: the rows' length (a
    generation: the longest possible; :meth:`crop` to what it became)."""

    def __init__(self, T: int, num_heads: int, top_k: int | None, measure: str | None = None):
        self.T, self.H, self.top_k = T, num_heads, top_k
        self.rows: dict[str, dict[int, object]] = {m: {} for m in stored(top_k, measure)}

    def crop(self, T: int) -> None:
        """Keep the first ``T`` queries (and, for exact maps, sources)."""
        for store in self.rows.values():
            for layer, x in store.items():
                store[layer] = x[:, :T, :T] if self.top_k is None else tuple(y[:, :T] for y in x)
        self.T = T

    def observe(self, block: Block) -> None:
        for m in self.rows:
            self._keep(block, m, views(block, m))

    def _keep(self, block: Block, m: str, x: torch.Tensor) -> None:
        """Store one metric's rows ``x [V, Q, S]`` of ``block``: exact, or the top-k sources of each
        row (by value for attention, by absolute value for the others)."""
        V, Q, S = x.shape
        T, q0, k0, store = self.T, block.q_start, block.k_start, self.rows[m]
        if self.top_k is None:
            if block.layer not in store:
                store[block.layer] = np.zeros((V, T, T), dtype=np.float16)
            vis = (block.k_positions[None, :] <= block.q_positions[:, None])[None]
            x = torch.where(vis, x, torch.zeros_like(x))
            store[block.layer][:, q0:q0 + Q, k0:k0 + S] = x.cpu().numpy().astype(np.float16)
        else:
            if block.layer not in store:
                store[block.layer] = (np.full((V, T, self.top_k), PAD, dtype=np.uint16),
                                      np.zeros((V, T, self.top_k), dtype=np.float16))
            pos, vals = _topk_rows(x, self.top_k, block.q_positions, block.k_positions,
                                   by_abs=(m != "attention"))
            idx, val = store[block.layer]
            idx[:, q0:q0 + Q] = pos.cpu().numpy().astype(np.uint16)
            val[:, q0:q0 + Q] = round_float16(vals.cpu().numpy(), TOPK_MANTISSA_BITS)


class ResidualShares:
    """Forward hooks that record ``r_i^l = ⟨y_i, x_i⟩/‖y_i‖²`` per decoder layer (SPEC §8).

    ``x`` is the input of the decoder layer that holds the attention layer; ``Δ`` is what the attention
    adds to it: the attention module's output, or, where a norm follows attention before the residual
    add (Gemma 2/3, OLMo 2), that norm's output (``adapter.attention_delta_module``)."""

    @takes_handle
    def __init__(self, handle: ModelHandleLike, layers):
        self.shares: dict[int, np.ndarray] = {}
        self._x: dict[int, torch.Tensor] = {}
        self._hooks = []
        adapter = getattr(handle, "adapter", None)
        if adapter is None:
            return
        for l in layers:
            layer = adapter.decoder_layer(l)
            if layer is None:
                continue
            self._hooks.append(layer.register_forward_pre_hook(self._pre(l), with_kwargs=True))
            self._hooks.append(adapter.attention_delta_module(l).register_forward_hook(self._post(l)))

    def _pre(self, l):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self._x[l] = x.detach()
        return hook

    def _post(self, l):
        def hook(module, args, output):
            delta = output[0] if isinstance(output, tuple) else output
            x = self._x.pop(l, None)
            if x is None:
                return
            x, delta = x[0].double(), delta[0].double()                   # [T, D]
            y = x + delta
            yy = (y * y).sum(-1)
            r = metrics.safe_div((y * x).sum(-1), yy, fill=1.0).float().cpu().numpy()
            prev = self.shares.get(l)                 # generation: one call per step, positions in order
            self.shares[l] = r if prev is None else np.concatenate([prev, r])
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


def _head_tables(stats_df, layers: list[int], H: int) -> tuple[dict, dict]:
    from attngeom.heads.taxonomy import REGIMES, regimes_of

    stats_df = stats_df.copy()
    stats_df["regime"] = regimes_of(stats_df)
    head = {k: np.zeros((len(layers), H)) for k in HEAD_STATS}
    for k, l in enumerate(layers):
        g = stats_df[stats_df["layer"] == l].sort_values("head")
        for name in ("sink_rate", "sink_contribution", "head_share"):
            head[name][k] = g[name].to_numpy()
        head["regime"][k] = [REGIMES.index(r) for r in g["regime"]]
    by_layer = stats_df.groupby("layer", sort=True)
    sink = {
        "sink_attention": np.array([by_layer.get_group(l)["sink_rate"].mean() for l in layers]),
        "sink_contribution": np.array([by_layer.get_group(l)["sink_contribution"].mean() for l in layers]),
        "sink_share": np.array([by_layer.get_group(l)["sink_contribution_inter"].sum() for l in layers]),
    }
    return head, sink


def direct_effect_grid(handle, ids, layers: list[int], row: int) -> np.ndarray | None:
    """Each head's direct effect (:func:`attngeom.generation.effects.direct_effects`) at ``row`` on the
    logit of the token that follows it (the model's top prediction at the last position): the heads
    panel's ``direct_effect`` grid ``[len(layers), H]``; None where the model's norms are not RMS norms."""
    from attngeom.errors import UnsupportedArchitectureError
    from attngeom.generation.effects import Answer, direct_effects, head_inputs

    prefix = list(ids[:row + 1])
    try:
        nxt = int(ids[row + 1]) if row + 1 < len(ids) else int(head_inputs(handle, prefix)[1][-1].argmax())
        effects, _ = direct_effects(handle, prefix, Answer(handle, nxt))
    except (InputError, UnsupportedArchitectureError):
        return None
    return effects[layers]


def resolve_mode(T: int, top_k: int | None, exact_max_tokens: int) -> int | None:
    """``None`` (exact maps) when ``T <= exact_max_tokens``, else the top-k size."""
    k = DEFAULT_TOP_K if top_k is None else int(top_k)
    if k < 1:
        raise InputError(f"--top-k must be at least 1, got {k}")
    return None if T <= exact_max_tokens else k


@takes_handle
def build(handle: ModelHandleLike, text, *, layers=None, top_k: int | None = None,
          exact_max_tokens: int = DEFAULT_EXACT_MAX_TOKENS, sink: int = 0, decoding=None,
          chat: bool = False, system: str | None = None, progress: bool = False,
          measure: str | None = None) -> ExploreData:
    """Run one text (a string or token ids) through the model and collect the explorer's data
    (``progress``: a bar on stderr, counting the generated tokens with ``decoding``).

    One streaming pass over ``layers`` (default all) keeps only the rows (exact or top-k), the
    per-head statistics (:class:`attngeom.streaming.reducers.HeadStats`, regimes by
    :func:`attngeom.heads.taxonomy.regimes_of`) and the residual shares.

    ``measure``: a measure of :mod:`attngeom.metrics.registry` whose rows the page shows beside
    attention and contribution. One computed before the forward (``prepare``: gradient × attention,
    the rollouts) gets its pass here first (:func:`prepared_maps`), for a text as given only.

    ``decoding`` (an :class:`attngeom.generation.decoding.Decoding`): ``text`` is a prompt (``chat``/``system``
    as in :func:`attngeom.generation.prompts.prompt_ids`); the same collectors observe the generation step by
    step, the page covers prompt + answer and :attr:`ExploreData.answer` is filled."""
    from attngeom.streaming.passes import check_length, stream, to_ids
    from attngeom.data.corpora import check_layers
    from attngeom.model.handle import special_positions
    from attngeom.streaming.reducers import HeadStats

    measure = check_measure(measure, generation=decoding is not None)
    template = ()
    if decoding is not None:
        from attngeom.generation.prompts import prompt_ids, template_positions

        ids = prompt_ids(handle, text, chat=chat, system=system, stop=decoding.stop_ids(handle))
        template = template_positions(handle, text, chat=chat, system=system)
        T = len(ids) + decoding.max_new_tokens                     # at most; the answer may stop early
    else:
        ids = to_ids(handle, text)
        check_length(handle, len(ids))
        T = len(ids)
    H, L = handle.num_heads, handle.num_layers
    if T < 2:
        raise InputError(f"the input has {T} token(s) after encoding; the explorer needs at least 2")
    layers = sorted(set(check_layers(range(L) if layers is None else [int(l) for l in layers], L)))
    if not 0 <= sink < len(ids):
        raise InputError(f"sink position {sink} is beyond the input ({len(ids)} tokens)")
    k = resolve_mode(T, top_k, exact_max_tokens)
    rows = RowCollector(T, H, k, measure)
    stats = HeadStats(sink=sink)
    prepared = prepared_maps(handle, ids, measure, layers) if decoding is None else None
    res = ResidualShares(handle, layers)
    answer = None
    try:
        if decoding is None:
            stream(handle, [ids], [rows, stats], layers=layers, progress=progress, prepared=prepared)
        else:
            from attngeom.generation.answers import AnswerSources
            from attngeom.generation.decoding import stream_generation_ids

            sources = AnswerSources(sink=sink)
            P = len(ids)
            ids = stream_generation_ids(handle, ids, [rows, stats, sources], decoding, layers=layers, progress=progress)
            answer = _answer_summary(sources.result()["summary"], layers, P)
            rows.crop(len(ids))
    finally:
        res.close()
    head, sink_fig = _head_tables(stats.result(), layers, H)
    effect = direct_effect_grid(handle, ids, layers, len(ids) - 1 if answer is None else P - 1)
    if effect is not None:
        head["direct_effect"] = effect
    share = (np.round(np.stack([res.shares[l] for l in layers]).astype(np.float64), RESIDUAL_DECIMALS)
             if all(l in res.shares for l in layers) else None)
    return ExploreData(
        tokens=handle.tokens(ids), ids=list(ids), layers=layers, num_heads=H,
        rows={m: [rows.rows[m][l] for l in layers] for m in rows.rows},
        head_stats=head, layer_sink=sink_fig, residual_share=share, top_k=k, sink=sink,
        model_name=getattr(handle, "name", ""), meta={"num_layers": L}, answer=answer,
        special=list(special_positions(handle, ids)), template=list(template), measure=measure)


def prepared_maps(handle: ModelHandleLike, ids, measure: str | None, layers: list[int]) -> dict | None:
    """The maps of ``measure`` computed before the forward of one text as given
    (:func:`attngeom.capture.prepared.prepare_text`), at ``layers``, as ``Session(prepared=...)`` takes
    them; None for a measure that needs no such pass."""
    if measure is None or not registry.prepared_names([measure]):
        return None
    from attngeom.capture.prepared import prepare_text

    maps = prepare_text(handle, ids, [measure])
    return {l: maps[l] for l in layers if l in maps}


def check_trace_measure(trace, measure: str | None) -> None:
    """Refuse, in one line, a measure computed before the forward that ``trace`` does not hold (it
    was analysed without ``prepare=[measure]``, or saved and loaded: those maps are not saved)."""
    if measure is None or registry.get(measure).prepare is None:
        return
    if not all(lt.prepared and measure in lt.prepared for lt in trace.layers):
        raise InputError(f"{measure} is computed before the forward and this trace does not hold it (a saved "
                         f"trace never does): analyze(model, text, prepare=[{measure!r}]) gives a trace that has it")


def _answer_summary(summary, layers: list[int], P: int) -> dict:
    """:attr:`ExploreData.answer` from :class:`attngeom.generation.answers.AnswerSources`' summary table."""
    out = {"prompt_length": P, "layers": {}, "model": {}}
    model = summary[summary["layer"].isna()].sort_values("position")
    for m in ("attention", "contribution"):
        out["model"][m] = model[m].to_numpy(np.float64)
        out["layers"][m] = np.stack([summary[summary["layer"] == l].sort_values("position")[m].to_numpy(np.float64)
                                     for l in layers])
    return out


def from_trace(trace, *, top_k: int | None = None, exact_max_tokens: int = DEFAULT_EXACT_MAX_TOKENS,
               sink: int = 0, measure: str | None = None) -> ExploreData:
    """The explorer's data from a :class:`attngeom.traces.trace.Trace` (no residual stream: the flow graph
    is not available). A generation's trace (``trace.prompt_length``) gets its answer view. ``measure``
    as in :func:`build`; one computed before the forward needs a trace that holds it
    (:func:`check_trace_measure`)."""
    from attngeom.generation.answers import AnswerSources
    from attngeom.generation.decoding import GenerationBatch
    from attngeom.streaming.reducers import HeadStats

    T = len(trace.ids)
    if T < 2:
        raise InputError(f"the trace has {T} token(s); the explorer needs at least 2")
    layers = [lt.index for lt in trace.layers]
    if not layers:
        raise InputError("the trace holds no layers")
    H = next(iter(trace.layers)).num_heads
    measure = check_measure(measure)
    check_trace_measure(trace, measure)
    k = resolve_mode(T, top_k, exact_max_tokens)
    rows = RowCollector(T, H, k, measure)
    stats = HeadStats(sink=sink)
    P = trace.prompt_length
    sources = AnswerSources(sink=sink) if P is not None and 0 < P < T else None
    observers = [rows, stats] + ([sources] if sources else [])
    batch = GenerationBatch(ids=torch.tensor([trace.ids]), lengths=torch.tensor([T]), index=[0],
                            prompt_length=P or 0)
    for r in observers:
        r.begin(batch)
    for lt in trace.layers:
        block = lt.block
        for r in observers:
            r.observe(block)
    answer = None
    if sources is not None:
        sources.end(batch)
        answer = _answer_summary(sources.result()["summary"], layers, P)
    head, sink_fig = _head_tables(stats.result(), layers, H)
    return ExploreData(
        tokens=list(trace.tokens), ids=list(trace.ids), layers=layers, num_heads=H,
        rows={m: [rows.rows[m][l] for l in layers] for m in rows.rows},
        head_stats=head, layer_sink=sink_fig, residual_share=None, top_k=k, sink=sink,
        model_name=trace.model_name, meta={}, answer=answer, special=list(trace.special), template=list(trace.template),
        measure=measure)
