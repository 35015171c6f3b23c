"""Every intervention of attngeom: masking ranked sources (SPEC §3), removing a source (the sink or
its mass-matched control, SPEC §4) and removing heads (SPEC §6) inside the forward pass.

What belongs here: the edits of the mixing weights. The statistics measured under an edit belong to
the experiment that measures them (:class:`attngeom.sinks.removal.SourceRemoval` records head-output norms
and cone measures around :func:`remove_source`; :mod:`attngeom.heads.experiment` measures perplexity under
:class:`HeadRemoval`).

An intervention is a callable handed to :class:`attngeom.capture.session.Session`; for every block of
queries of every intervened layer it receives the :class:`~attngeom.capture.blocks.Block` and returns the
weights that mix the values, ``block.a * keep`` (masking source ``j`` at query ``i`` zeroes its
weight; the remaining weights are not renormalised). The ranking is computed from the block's own
quantities, i.e. from that layer's attention and values *after* the interventions at earlier layers,
so interventions propagate through the network.

Ranking (:class:`Variant`):

- ``metric``: a token-importance metric of SPEC §2 (``attention``, ``value_weighted``,
  ``output_normalized``, ``contribution``, ``contribution_inter``) or ``random`` (a seeded random
  ranking), or None for the clean forward (nothing masked).
- ``per_head=False`` (default): one ranking per query from the token-level score
  ``block.token_score(metric)`` (all heads of the layer), the same sources masked in every head.
  ``per_head=True``: every head ranks by its own map ``block.metric(metric)``
  (``contribution`` is then the intra-head ``c_ij^h``).
- ``absolute=False`` (default): rank by the signed score; ``True``: by its absolute value.
- ``mode="comprehensiveness"`` masks the ``k_i`` highest-ranked sources of query ``i``,
  ``mode="sufficiency"`` the ``k_i`` lowest-ranked.

How many sources: ``k_i = floor(r · (i+1))`` for query position ``i`` (the ``i+1`` sources
``0..i`` of a causal query), computed as ``floor(r·(i+1) + 1e-9)`` in float64 so that e.g.
``0.29 · 100`` gives 29. Ranking is done among the sources the query can *see*: under a causal mask
that is all of ``0..i``; under a sliding window (or any mask that hides sources), the hidden sources
carry zero weight already, are not ranked, and ``k_i`` is capped at the number ``n_i`` of visible
sources (so sufficiency masks the ``min(k_i, n_i)`` lowest-ranked visible sources).
Padding queries are left untouched.

Ties are broken deterministically by position: the order is "higher score first, and among equal
scores the earlier position first"; the top-``k`` are the first ``k`` in this order and the
bottom-``k`` the last ``k``, so top-``k`` and bottom-``(n-k)`` always partition the visible sources.

Random ranking: the score of (layer, [head,] query position, source position) is a hash of those
integers with the seed and a per-row salt (e.g. the window index), uniform in [0, 1). It does not
depend on the batch composition or on how queries are split into blocks, so a run is reproducible
exactly, and different seeds (or salts) give independent rankings.

Batching: :class:`RankIntervention` takes one variant per batch row (or one for all rows), so that
many variants of one window run as one batched forward; rows that share a metric are scored
together, and each row's scores are computed from its own (intervened) hidden states.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from attngeom.metrics import registry
from attngeom.capture.blocks import Block, LayerState
from attngeom.errors import InputError

MODES = ("comprehensiveness", "sufficiency")


class _RankNames(collections.abc.Sequence):
    """The ranking names, read from :mod:`attngeom.metrics.registry` on every use (so a metric registered
    later is a ranking too): every metric with ``rank=True``, then ``random``."""

    def _names(self) -> tuple[str, ...]:
        return registry.rank_names() + ("random",)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return repr(self._names())


RANK_METRICS: Sequence[str] = _RankNames()
"""Names a ranking may use: the metrics of :mod:`attngeom.metrics.registry` (SPEC §2) and ``random``."""

_EPS = 1e-9


@dataclass(frozen=True)
class Variant:
    """One intervention setting. ``metric=None`` is the clean (unmasked) forward."""

    metric: str | None
    mode: str = "comprehensiveness"
    ratio: float = 0.0
    seed: int = 0
    per_head: bool = False
    absolute: bool = False

    def __post_init__(self):
        if self.metric is None:
            return
        if self.metric not in RANK_METRICS:
            raise InputError(f"unknown metric {self.metric!r}; known: {', '.join(RANK_METRICS)}")
        if self.mode not in MODES:
            raise InputError(f"unknown mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.per_head and self.metric != "random" and registry.get(self.metric).layer_only:
            raise InputError(f"{self.metric} is defined on the layer: it ranks the sources of each query, "
                             "not per head (leave out the per-head ranking)")
        r = float(self.ratio)
        if not (0.0 <= r <= 1.0) or math.isnan(r):
            raise InputError(f"ratio must be in [0, 1], got {self.ratio}")

    @property
    def clean(self) -> bool:
        return self.metric is None or float(self.ratio) == 0.0

    @property
    def key(self) -> str:
        """A short stable name, e.g. ``contribution/comprehensiveness/0.3`` or ``random/sufficiency/0.5/s1``."""
        if self.metric is None:
            return "clean"
        k = f"{self.metric}/{self.mode}/{self.ratio:g}"
        if self.metric == "random":
            k += f"/s{self.seed}"
        return k


CLEAN = Variant(None)


def masked_count(ratio, positions: torch.Tensor) -> torch.Tensor:
    """``k_i = floor(r·(i+1))`` for query positions ``i``: ``ratio`` scalar or ``[R]`` -> ``[R, Q]`` (long)."""
    r = torch.as_tensor(ratio, dtype=torch.float64, device=positions.device).reshape(-1, 1)
    return torch.floor(r * (positions.to(torch.float64)[None, :] + 1) + _EPS).long()


def _hash_uniform(*parts: torch.Tensor) -> torch.Tensor:
    """A counter-based hash of broadcastable int64 tensors -> float64 uniform in [0, 1)."""
    mask = 0xFFFFFFFF
    x = torch.zeros((), dtype=torch.int64)
    for p in parts:
        x = (x * 0x27D4EB2D + p.to(torch.int64) + 0x9E3779B9) & mask
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & mask
        x = x ^ (x >> 12)
        x = (x * 0x297A2D39) & mask
        x = x ^ (x >> 15)
    return x.to(torch.float64) / float(1 << 32)


def random_scores(seed: int, salt: torch.Tensor, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  heads: int | None = None) -> torch.Tensor:
    """Seeded random scores: ``salt [R]`` -> ``[R, Q, S]`` (or ``[R, H, Q, S]`` with ``heads``)."""
    dev = q_pos.device
    s = torch.as_tensor(int(seed), dtype=torch.int64)
    lay = torch.as_tensor(int(layer) + 1, dtype=torch.int64)
    salt = salt.to(torch.int64).cpu()
    q = q_pos.cpu().to(torch.int64)
    k = k_pos.cpu().to(torch.int64)
    if heads is None:
        u = _hash_uniform(s, salt[:, None, None], lay, q[None, :, None], k[None, None, :])
    else:
        h = torch.arange(heads, dtype=torch.int64)
        u = _hash_uniform(s, salt[:, None, None, None], lay, h[None, :, None, None],
                          q[None, None, :, None], k[None, None, None, :])
    return u.to(torch.float32).to(dev)


_HIDDEN = torch.iinfo(torch.int64).min


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """Distinct int64 keys whose descending order is the ranking order "higher score first, earlier
    position first on ties" (NaN ranks as ``-inf``; ``-0.0`` ties with ``0.0``): ``scores [..., S]``
    -> long ``[..., S]``. Hiding sources is the caller's (:func:`select_mask` gives them the
    smallest key).

    The high 32 bits are the float32 score's bits mapped to an order-preserving integer, the low 32
    bits ``S-1-position``: no two sources of a row share a key, so any selection of the largest
    keys (``topk``) is the tie rule's selection, without a stable sort."""
    s = scores.float()
    s = torch.where(torch.isnan(s), float("-inf"), s) + 0.0                   # + 0.0 turns -0.0 into 0.0
    bits = s.view(torch.int32)
    high = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()              # negative floats: reversed
    S = s.shape[-1]
    low = (S - 1) - torch.arange(S, device=s.device)
    return (high << 32).bitwise_or_(low)


def select_mask(scores: torch.Tensor, visible: torch.Tensor, k: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Which sources to mask: the ``k`` top-ranked (where ``top``) or bottom-ranked visible sources.

    ``scores [R, (H,) Q, S]``, ``visible [R, 1|H.., Q, S]`` bool (broadcastable), ``k [R, Q]`` long,
    ``top [R]`` bool -> bool mask like ``scores``.

    With ``n`` visible sources and ``kk = min(k, n)``, the top ``kk`` are the complement (among the
    visible) of the bottom ``n - kk``, and vice versa; each row selects whichever set is smaller, as
    the largest keys of :func:`order_keys` (keys negated where the bottom set is selected), with one
    partial sort (``topk``) instead of a full one."""
    vis = visible.expand_as(scores)
    n = vis.sum(-1)                                           # [R, (H,) Q]
    extra = scores.dim() - 3                                  # 1 when per head
    kk = torch.minimum(k.view(k.shape[0], *([1] * extra), k.shape[1]), n)
    invert = kk.amax(-1) > (n - kk).amax(-1)                  # [R, (H,)]: select the complement instead
    need = torch.where(invert[..., None], n - kk, kk)         # how many keys each query selects
    largest = top.view(-1, *([1] * extra)) != invert          # top-kk directly, or bottom-(n-kk) reversed
    keys = order_keys(scores)
    if not bool(largest.all()):
        keys = keys.bitwise_not_() if not bool(largest.any()) else torch.where(largest[..., None, None], keys, ~keys)
    keys.masked_fill_(~vis, _HIDDEN)
    K = int(need.max()) if need.numel() else 0
    idx = keys.topk(K, dim=-1, largest=True, sorted=True).indices
    take = torch.arange(K, device=scores.device) < need.unsqueeze(-1)
    chosen = torch.zeros_like(vis).scatter_(-1, idx, take)
    if not bool(invert.any()):
        return chosen
    rest = vis & ~chosen
    return rest if bool(invert.all()) else torch.where(invert[..., None, None], rest, chosen)


def _sub_state(state: LayerState, rows: torch.Tensor) -> LayerState:
    return dataclasses.replace(state, value=state.value[rows], lengths=state.lengths[rows])


class RankIntervention:
    """Masks, per query, the ``k_i`` top- or bottom-ranked sources (SPEC §3).

    ``variants``: one :class:`Variant` for every row of the batch, or a single one for all rows.
    ``salts``: per-row integers mixed into the random ranking (e.g. the window index); default 0.
    Returns ``block.a * keep``, or None when no row masks anything (clean/ratio-0 variants)."""

    def __init__(self, variants: Variant | Sequence[Variant], salts: Sequence[int] | None = None):
        self.variants = [variants] if isinstance(variants, Variant) else list(variants)
        if not self.variants:
            raise ValueError("RankIntervention needs at least one variant")
        self.salts = None if salts is None else [int(s) for s in salts]
        if self.salts is not None and len(self.salts) != len(self.variants) and len(self.variants) > 1:
            raise ValueError("salts must have one entry per variant")
        self._sub_cache: tuple[object, dict] | None = None

    def _row_variants(self, B: int) -> list[Variant]:
        if len(self.variants) == 1:
            return self.variants * B
        if len(self.variants) != B:
            raise ValueError(f"RankIntervention has {len(self.variants)} variants for a batch of {B} rows")
        return self.variants

    def _row_salts(self, B: int) -> list[int]:
        if self.salts is None:
            return [0] * B
        return self.salts * B if len(self.salts) == 1 else self.salts

    def _sub_block(self, block: Block, rows: list[int]) -> Block:
        """The block restricted to some batch rows (state shared across the layer's query blocks)."""
        if len(rows) == block.a.shape[0]:
            return block
        if self._sub_cache is None or self._sub_cache[0] is not block.state:
            self._sub_cache = (block.state, {})
        cache = self._sub_cache[1]
        key = tuple(rows)
        idx = torch.tensor(rows, device=block.a.device)
        if key not in cache:
            cache[key] = _sub_state(block.state, idx)
        allowed = block.allowed
        if allowed is not None and allowed.shape[0] > 1:
            allowed = allowed[idx]
        return Block(state=cache[key], a=block.a[idx], q_start=block.q_start, k_start=block.k_start, allowed=allowed)

    def scores(self, block: Block, v: Variant, salts: torch.Tensor) -> torch.Tensor:
        """Ranking scores of ``block`` (already restricted to the variant's rows)."""
        if v.metric == "random":
            s = random_scores(v.seed, salts, block.layer, block.q_positions, block.k_positions,
                              heads=block.a.shape[1] if v.per_head else None)
        elif v.per_head:
            s = block.metric(v.metric)
        else:
            s = block.token_score(v.metric)
        return s.abs() if v.absolute else s

    def mask(self, block: Block) -> torch.Tensor | None:
        """Bool ``[B, H|1, Q, S]``: True where a source is masked; None when nothing is."""
        B, H, Q, S = block.a.shape
        rows_v = self._row_variants(B)
        salts = self._row_salts(B)
        groups: dict[tuple, list[int]] = {}
        for b, v in enumerate(rows_v):
            if v.clean:
                continue
            groups.setdefault((v.metric, v.per_head, v.absolute, v.seed if v.metric == "random" else 0), []).append(b)
        if not groups:
            return None
        any_per_head = any(g[1] for g in groups)
        out = torch.zeros(B, H if any_per_head else 1, Q, S, dtype=torch.bool, device=block.a.device)
        vis_all = block.visible
        qvalid = block.query_valid
        qpos = block.q_positions
        for (metric, per_head, absolute, seed), rows in groups.items():
            idx = torch.tensor(rows, device=block.a.device)
            sub = self._sub_block(block, rows)
            v0 = rows_v[rows[0]]
            sc = self.scores(sub, v0, torch.tensor([salts[b] for b in rows]))
            vis = vis_all[idx] if vis_all.shape[0] > 1 else vis_all.expand(len(rows), -1, -1, -1)
            if not per_head:
                vis = vis[:, 0]
            k = masked_count([float(rows_v[b].ratio) for b in rows], qpos)
            k = k * qvalid[idx].long()                      # padding queries: nothing masked
            top = torch.tensor([rows_v[b].mode == "comprehensiveness" for b in rows], device=block.a.device)
            m = select_mask(sc, vis, k, top)
            if not per_head:
                m = m[:, None]
            out[idx] = m.expand(-1, out.shape[1], -1, -1) if m.shape[1] != out.shape[1] else m
        return out

    def __call__(self, block: Block) -> torch.Tensor | None:
        m = self.mask(block)
        if m is None:
            return None
        return block.a * ~m   # = masked_fill(m, 0) for weights >= 0, several times faster with a broadcast mask


class SourceMask:
    """Masks exactly the given (query, source) pairs: ``mask [T, T]``, ``[B|1, T, T]`` or
    ``[B|1, H, T, T]`` bool over absolute positions (True = masked). ``layers``: where it applies
    (None = every layer the session intervenes on)."""

    def __init__(self, mask: torch.Tensor, layers: Sequence[int] | None = None):
        if mask.dim() == 2:
            mask = mask[None]
        if mask.dim() == 3:
            mask = mask[:, None]
        self.mask = mask.bool()
        self.layers = None if layers is None else set(int(x) for x in layers)

    def __call__(self, block: Block) -> torch.Tensor | None:
        if self.layers is not None and block.layer not in self.layers:
            return None
        B, H, Q, S = block.a.shape
        m = self.mask[:, :, block.q_start:block.q_start + Q, block.k_start:block.k_start + S].to(block.a.device)
        return block.a.masked_fill(m, 0.0)


# --------------------------------------------------------------------------------------------
# Removing sources and heads (SPEC §4 sink removal, SPEC §6 head removal)
# --------------------------------------------------------------------------------------------

SOURCE_REMOVALS = ("sink", "control")
"""What :func:`remove_source` removes: the sink's column, or the mass-matched control source."""


def control_columns(a: torch.Tensor, visible: torch.Tensor, sink_col: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query and head the visible non-sink source whose attention is closest to the sink's.

    Returns ``(col [B,H,Q] long, ok [B,H,Q] bool)``; ``ok`` is False where there is no candidate."""
    B, H, Q, S = a.shape
    cand = visible.expand(B, H, Q, S).clone()
    if sink_col is not None:
        cand[..., sink_col] = False
        rho = a[..., sink_col:sink_col + 1]
    else:
        rho = torch.zeros(B, H, Q, 1, dtype=a.dtype, device=a.device)
    gap = torch.where(cand, (a - rho).abs(), torch.full_like(a, float("inf")))
    col = gap.argmin(-1)
    ok = cand.any(-1)
    return col, ok


def remove_source(a: torch.Tensor, visible: torch.Tensor, sink_col: int | None, qsel: torch.Tensor, mode: str,
                  removed: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The mixing weights with one source per query removed (SPEC §4), no renormalisation:
    ``mode="sink"`` zeroes the sink's column ``sink_col`` (nothing when the block does not hold it),
    ``mode="control"`` the visible non-sink source whose weight is closest to the sink's
    (:func:`control_columns`), at the queries ``qsel [B, Q]``. Returns ``(edited a or None, removed
    weight [B, H, Q])`` (``removed`` is returned as given where nothing is edited)."""
    if mode not in SOURCE_REMOVALS:
        raise ValueError(f"mode must be one of {SOURCE_REMOVALS}, got {mode!r}")
    if mode == "sink":
        if sink_col is None:
            return None, removed
        edited = a.clone()
        col = edited[..., sink_col]
        removed = torch.where(qsel[:, None, :], col, torch.zeros_like(col))
        edited[..., sink_col] = torch.where(qsel[:, None, :], torch.zeros_like(col), col)
        return edited, removed
    col, ok = control_columns(a, visible, sink_col)
    ok = ok & qsel[:, None, :]
    edited = a.clone()
    vals = edited.gather(-1, col.unsqueeze(-1)).squeeze(-1)
    removed = torch.where(ok, vals, torch.zeros_like(vals))
    edited.scatter_(-1, col.unsqueeze(-1), torch.where(ok, torch.zeros_like(vals), vals).unsqueeze(-1))
    return edited, removed


def _by_layer(removed) -> dict[int, list[int]]:
    pairs = ([(int(l), int(h)) for l, hs in removed.items() for h in hs] if isinstance(removed, dict)
             else [(int(l), int(h)) for l, h in removed])
    out: dict[int, list[int]] = {}
    for l, h in pairs:
        out.setdefault(l, []).append(h)
    return out


class HeadRemoval:
    """Intervention zeroing the mixing weights of removed heads (SPEC §6): ``removed`` (``{layer:
    heads}`` or ``[(layer, head), ...]``) in every row of the batch, or with ``rows`` one such
    removal per batch row (several removals measured in one batched forward over copies of the same
    windows). A removed head's output ``Σ_j a_ij v_j`` becomes 0, which *is* its slice of the
    ``o_proj`` input (:mod:`attngeom.heads.experiment`)."""

    def __init__(self, removed: dict[int, Iterable[int]] | Iterable[tuple[int, int]] = (),
                 rows: Sequence[dict | Iterable[tuple[int, int]]] | None = None):
        self.by_layer = _by_layer(removed)
        self.by_row = None if rows is None else [_by_layer(r) for r in rows]

    def hits(self, block: Block) -> list[tuple]:
        """The (batch rows, head) pairs removed in ``block``'s layer."""
        if self.by_row is None:
            return [(slice(None), h) for h in self.by_layer.get(block.layer, ())]
        return [(b, h) for b, r in enumerate(self.by_row) for h in r.get(block.layer, ())]

    def __call__(self, block: Block) -> torch.Tensor | None:
        hits = self.hits(block)
        if not hits:
            return None
        w = block.a.clone()
        for b, h in hits:
            w[b, h] = 0
        return w


class HeadMeanRemoval(HeadRemoval):
    """Mean ablation of heads (the removals of :class:`HeadRemoval`): a removed head's output at
    query ``i`` becomes the mean of its outputs at queries ``0..i`` of the same forward,
    ``Σ_j ā_ij v_j`` with ``ā_ij = (1/(i+1)) Σ_{t<=i} a_tj`` (causal: no later token enters; at the
    last query, the mean over the whole text). Needs each layer's queries in one block from position
    0 (a forward without a cache, ``Session(block_elements=...)`` large enough)."""

    def __call__(self, block: Block) -> torch.Tensor | None:
        hits = self.hits(block)
        if not hits:
            return None
        if block.q_start != 0 or block.k_start != 0:
            raise InputError("mean ablation needs each layer's queries in one block from position 0 "
                             "(no cache; a larger block_elements)")
        Q = block.a.shape[2]
        count = torch.arange(1, Q + 1, device=block.a.device, dtype=block.a.dtype)[:, None]
        w = block.a.clone()
        for b, h in hits:
            w[b, h] = block.a[b, h].cumsum(-2) / count
        return w
