"""What observers and interventions see: one layer's :class:`LayerState` and each :class:`Block` of
queries the attention kernel (:mod:`attngeom.capture.kernel`) computes, with every quantity and metric
map of :mod:`attngeom.metrics.registry` computed on first access; the :class:`Observer` and
:class:`Intervention` protocols a :class:`~attngeom.capture.session.Session` holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Protocol

import torch

from attngeom.errors import InputError
from attngeom.metrics import formulas as metrics
from attngeom.metrics import registry


@dataclass
class LayerState:
    """Per-layer quantities shared by all query blocks of one forward call.

    ``value [B, Hkv, S, d]`` float32 value states as the model keeps them (one per key/value head;
    never repeated per query head unless an observer asks for :attr:`v`); ``w_o [D, H*d]`` float32
    output projection; ``G [H, d, d]`` per-head Gram matrices, ``G_full [H*d, H*d] = W_Oᵀ W_O``;
    ``kv_head [H]`` the key/value head of each query head."""

    layer: int
    module: torch.nn.Module | None
    value: torch.Tensor
    w_o: torch.Tensor
    G: torch.Tensor
    G_full: torch.Tensor
    kv_head: torch.Tensor
    lengths: torch.Tensor  # [B] valid tokens per text (right padding)
    prepared: dict | None = None  # {metric: map by absolute position} computed before this forward
    norms: object | None = field(default=None, repr=False)  # e.g. GrowingNorms: ``norms.of(state)`` gives both norms
    route: str = "block"  # the route this call took, and why (SPEC §10, attngeom.capture.routes.layer_route)

    @cached_property
    def grouped(self) -> bool:
        """Whether query head ``h`` uses value head ``h // (H / Hkv)``, as ``repeat_kv`` lays them out
        (every head its own value when ``Hkv = H``)."""
        H, Hkv = self.num_heads, self.value.shape[1]
        return H % Hkv == 0 and torch.equal(self.kv_head.cpu(), torch.arange(H) // (H // Hkv))

    @property
    def n_rep(self) -> int:
        """Query heads per value head of :attr:`group_values` (1 when the heads are not :attr:`grouped`)."""
        return self.num_heads // self.value.shape[1] if self.grouped else 1

    @cached_property
    def v(self) -> torch.Tensor:
        """Value states per query head: ``[B, H, S, d]`` (``value`` itself when every head has its own)."""
        if self.grouped and self.value.shape[1] == self.num_heads:
            return self.value
        return self.value[:, self.kv_head.to(self.value.device)]

    def v_from(self, start: int) -> torch.Tensor:
        """:attr:`v` of the sources from ``start`` on, ``[B, H, S - start, d]``, without :attr:`v` of
        all the others (what a decoding step adds to a growing copy)."""
        return self.value[:, :, start:][:, self.kv_head.to(self.value.device)]

    @property
    def group_values(self) -> torch.Tensor:
        """``[B, Hg, S, d]``: the values each group of ``H / Hg`` consecutive query heads shares
        (``value`` itself when :attr:`grouped`; else the per-head :attr:`v`, ``Hg = H``)."""
        return self.value if self.grouped else self.v

    @cached_property
    def group_values_t(self) -> torch.Tensor:
        """:attr:`group_values` transposed, contiguous along the sources: ``[B, Hg, d, S]`` (one copy
        per layer, read by the blocks' received contribution, :func:`attngeom.metrics.formulas.received`)."""
        return self.group_values.transpose(-1, -2).contiguous()

    @property
    def num_sources(self) -> int:
        """``S``: the sources of this call (with a cache, every cached token)."""
        return self.value.shape[2]

    @cached_property
    def _kept_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(‖ṽ_j^h‖, ‖v_j^h‖)`` from :attr:`norms` (both in one call of its ``of``)."""
        return self.norms.of(self)

    @cached_property
    def value_norm(self) -> torch.Tensor:
        """``‖ṽ_j^h‖``: ``[B, H, S]`` (from :attr:`norms` when an observer set it)."""
        if self.norms is not None:
            return self._kept_norms[0]
        return metrics.projected_value_norm(self.v, self.G)

    @cached_property
    def raw_value_norm(self) -> torch.Tensor:
        """``‖v_j^h‖`` in head space: ``[B, H, S]`` (one norm per key/value head, shared by its group)."""
        if self.norms is not None:
            return self._kept_norms[1]
        return self.value.norm(dim=-1)[:, self.kv_head.to(self.value.device)]

    @property
    def num_heads(self) -> int:
        return self.kv_head.shape[0]


@dataclass
class Block:
    """Queries ``q_start .. q_start+Q-1`` of one layer, with sources ``k_start .. k_start+S-1``.

    ``a [B, H, Q, S]`` holds the attention probabilities (float32) exactly as the model used them;
    ``scores`` the logits they came from, when the capture keeps them (float32 models). Every
    quantity (:data:`attngeom.metrics.registry.QUANTITIES`) and metric map (``block.metric(name)``, or
    ``block.<name>`` for any metric of :mod:`attngeom.metrics.registry`) is computed on first access and
    cached for the other observers, so a block computes only what its observers read."""

    state: LayerState
    a: torch.Tensor
    q_start: int
    k_start: int
    allowed: torch.Tensor | None = None  # [B, 1, Q, S] bool, None = causal
    scores: torch.Tensor | None = field(default=None, repr=False)  # [B, H, Q, S] float32 logits (masked), if kept
    learned_sink: torch.Tensor | None = field(default=None, repr=False)  # [B, H, Q] a_i∅, with learned sink logits
    _cache: dict = field(default_factory=dict, repr=False)

    # ---- geometry -------------------------------------------------------------------------
    @property
    def layer(self) -> int:
        return self.state.layer

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.a.shape)  # type: ignore[return-value]

    @property
    def q_positions(self) -> torch.Tensor:
        """Positions of the block's queries: ``[Q]``."""
        return self._memo("qpos", lambda: torch.arange(self.q_start, self.q_start + self.a.shape[2],
                                                       device=self.a.device))

    @property
    def k_positions(self) -> torch.Tensor:
        """Positions of the block's sources: ``[S]``."""
        return self._memo("kpos", lambda: torch.arange(self.k_start, self.k_start + self.a.shape[3],
                                                       device=self.a.device))

    @property
    def query_valid(self) -> torch.Tensor:
        """``[B, Q]`` bool: the query is a real token (not right padding)."""
        return self._memo("valid", lambda: self.q_positions[None, :] < self.state.lengths[:, None])

    @property
    def visible(self) -> torch.Tensor:
        """``[B|1, 1, Q, S]`` bool: query ``i`` may attend to source ``j`` (the model's mask, or causal)."""
        if self.allowed is not None:
            return self.allowed
        return (self.k_positions[None, :] <= self.q_positions[:, None])[None, None]

    @property
    def v(self) -> torch.Tensor:
        """Value states of the block's sources: ``[B, H, S, d]``."""
        return self.state.v[:, :, self.k_start : self.k_start + self.a.shape[3]]

    @property
    def group_values(self) -> torch.Tensor:
        """The block's sources in :attr:`LayerState.group_values`: ``[B, Hg, S, d]``."""
        return self.state.group_values[:, :, self.k_start : self.k_start + self.a.shape[3]]

    @property
    def group_values_t(self) -> torch.Tensor:
        """The block's sources in :attr:`LayerState.group_values_t`: ``[B, Hg, d, S]``."""
        return self.state.group_values_t[..., self.k_start : self.k_start + self.a.shape[3]]

    @property
    def value_norm(self) -> torch.Tensor:
        """``‖ṽ_j^h‖`` of the block's sources: ``[B, H, S]``."""
        return self.state.value_norm[:, :, self.k_start : self.k_start + self.a.shape[3]]

    def _memo(self, key: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    # ---- vectors ----------------------------------------------------------------------------
    @property
    def head_output(self) -> torch.Tensor:
        """``u_i^h`` in head space: ``[B, H, Q, d]``."""
        return self._memo("u", lambda: metrics.head_output(self.a, self.group_values))

    @property
    def uG(self) -> torch.Tensor:
        """``u_i^h G^h`` (``⟨o_i^h, ṽ_j^h⟩ = uG_i·v_j``): ``[B, H, Q, d]``."""
        return self._memo("uG", lambda: self.head_output @ self.state.G)

    @property
    def head_output_sq(self) -> torch.Tensor:
        """``‖o_i^h‖²``: ``[B, H, Q]``."""
        return self._memo("hon2", lambda: (self.uG * self.head_output).sum(-1).clamp_min(0.0))

    @property
    def head_output_norm(self) -> torch.Tensor:
        """``‖o_i^h‖``: ``[B, H, Q]``."""
        return self._memo("hon", lambda: self.head_output_sq.sqrt())

    @property
    def pulled_back(self) -> torch.Tensor:
        """``p_i^h = o_i W_O^{hᵀ}`` (``⟨o_i, ṽ_j^h⟩ = p_i^h·v_j``): ``[B, H, Q, d]``."""
        return self._memo("p", lambda: metrics.pulled_back(self.head_output, self.state.G_full))

    @property
    def head_dot_output(self) -> torch.Tensor:
        """``⟨o_i, o_i^h⟩ = p_i^h·u_i^h``: ``[B, H, Q]``."""
        return self._memo("pu", lambda: (self.pulled_back * self.head_output).sum(-1))

    @property
    def output_sq(self) -> torch.Tensor:
        """``‖o_i‖² = Σ_h ⟨o_i, o_i^h⟩``: ``[B, Q]``."""
        return self._memo("o2", lambda: self.head_dot_output.sum(1).clamp_min(0.0))

    @property
    def output_norm(self) -> torch.Tensor:
        """``‖o_i‖`` (layer attention output before the o_proj bias): ``[B, Q]``."""
        return self.output_sq.sqrt()

    @property
    def layer_output(self) -> torch.Tensor:
        """``o_i`` (model space, before the o_proj bias): ``[B, Q, D]``."""
        return self._memo("o", lambda: metrics.layer_output(self.head_output, self.state.w_o))

    @property
    def head_share(self) -> torch.Tensor:
        """``⟨o_i, o_i^h⟩/‖o_i‖²``: ``[B, H, Q]``."""
        return self._memo("share", lambda: metrics.safe_div(self.head_dot_output, self.output_sq.unsqueeze(1)))

    @property
    def entropy(self) -> torch.Tensor:
        """Entropy (nats) of each attention row: ``[B, H, Q]``. From the logits when the block has
        them (``lse·Σ_j a_ij − Σ_j a_ij s_ij`` with ``lse`` read at the query's own column or the
        block's first, :func:`attngeom.metrics.formulas.entropy_from_logits`: one fused product per
        row instead of a logarithm per element), else ``−Σ_j a_ij log a_ij``; with a learned sink its
        share ``a_i∅`` is one more outcome of the row (``− a_i∅ log a_i∅`` is added)."""
        if self.learned_sink is not None:
            return self._memo("entropy", lambda: metrics.entropy(self.a) + metrics.entropy(self.learned_sink.unsqueeze(-1)))
        if self.scores is not None:   # on an accelerator the row maxima cost little and need no host check
            reference = self._lse_reference() if self.a.device.type == "cpu" else None
            return self._memo("entropy", lambda: metrics.entropy_from_logits(self.a, self.scores, reference))
        return self._memo("entropy", lambda: metrics.entropy(self.a))

    def _lse_reference(self) -> torch.Tensor:
        """``[B, H, Q, 2]``: each query's candidate columns for its row's ``lse`` (the block's first
        source, often a sink, and the query's own position, clamped into the block)."""
        B, H, Q, S = self.shape
        own = (self.q_positions - self.k_start).clamp(0, S - 1)
        return torch.stack([torch.zeros_like(own), own], dim=-1).view(1, 1, Q, 2).expand(B, H, Q, 2)

    # ---- maps [B, H, Q, S]: the metrics of attngeom.metrics.registry ----------------------------------
    @property
    def attention(self) -> torch.Tensor:
        return self.a

    def map_value_weighted(self) -> torch.Tensor:
        return metrics.value_weighted(self.a, self.value_norm)

    def map_output_normalized(self) -> torch.Tensor:
        return metrics.output_normalized(self.a, self.value_norm, self.head_output_norm)

    def map_contribution(self) -> torch.Tensor:
        return metrics.contribution_from(self.a, self.uG, self.v, self.head_output_sq)

    def map_contribution_inter(self) -> torch.Tensor:
        return metrics.contribution_inter_from(self.a, self.pulled_back, self.v, self.output_sq)

    def __getattr__(self, name: str):
        """``block.<metric>`` for every metric of :mod:`attngeom.metrics.registry` (e.g. ``block.contribution``)."""
        if not name.startswith("_") and name in registry.METRICS:
            return self.metric(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def factors(self) -> dict[str, torch.Tensor]:
        """The three factors of the intra-head contribution, each ``[B, H, Q, S]``."""
        return metrics.contribution_factors_from(self.a, self.uG, self.v, self.value_norm, self.head_output_norm)

    def contribution_column(self, col: int) -> torch.Tensor:
        """``c_ij^h`` for the block's source column ``col`` (position ``k_start + col``): ``[B, H, Q]``."""
        if "contribution" in self._cache:
            return self._cache["contribution"][..., col]
        return metrics.contribution_column(self.a[..., col], self.uG, self.v[:, :, col], self.head_output_sq)

    def contribution_inter_column(self, col: int) -> torch.Tensor:
        """``C_ij^h`` for the block's source column ``col``: ``[B, H, Q]``."""
        if "contribution_inter" in self._cache:
            return self._cache["contribution_inter"][..., col]
        return metrics.contribution_inter_column(self.a[..., col], self.pulled_back, self.v[:, :, col], self.output_sq)

    def received(self, weight: torch.Tensor, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """``Σ_i weight_i s_ij`` for the token-level scores ``s`` of the metrics ``names`` (default:
        those :func:`attngeom.metrics.registry.received_names`, which :func:`attngeom.metrics.formulas.received` sums
        without maps): ``{name: [B, S]}``.

        ``weight [B, Q]``. The built-in metrics are one ``Xᵀa`` product for all of them, computing
        only the pieces they need (``attention`` alone: one ``wᵀa``); any other registered metric
        sums its token-level score map."""
        received = registry.received_names()
        names = tuple(received if names is None else names)
        fast = [n for n in names if n in received]
        out: dict[str, torch.Tensor] = {}
        if fast:
            need_norm = "value_weighted" in fast or "output_normalized" in fast
            v = self.group_values
            grouped_product = "contribution" in fast and not metrics.contribution_by_map(
                self.shape[1] // v.shape[1], self.shape[2], v.shape[-1])   # the rule received applies
            out.update(metrics.received(
                self.a, weight, fast,
                v=v if "contribution" in fast else None,
                v_t=self.group_values_t if grouped_product else None,
                value_norm=self.value_norm if need_norm else None,
                head_out_norm=self.head_output_norm if "output_normalized" in fast else None,
                p=self.pulled_back if "contribution" in fast else None,
                out_sq=self.output_sq if "contribution" in fast else None))
        for n in names:
            if n not in out:
                out[n] = (weight.unsqueeze(1) @ self.token_score(n)).squeeze(1)
        return {n: out[n] for n in names}

    def prepared(self, name: str) -> torch.Tensor:
        """The block's part of a map computed before this forward (a measure with ``prepare`` in
        :mod:`attngeom.metrics.registry`: ``[B, H, Q, S]`` per head, ``[B, Q, S]`` on the layer), the
        one text's map shared by every row of the batch."""
        maps = self.state.prepared or {}
        if name not in maps:
            raise InputError(f"{name} is computed from the clean forward before the one that ranks by it "
                             "(a backward pass or a composition of layers): faithfulness and claims compute it "
                             f"first; in Python, analyze(model, text, prepare=[{name!r}])")
        m = maps[name]
        Q, S = self.a.shape[2], self.a.shape[3]
        part = m[..., self.q_start:self.q_start + Q, self.k_start:self.k_start + S].to(self.a.device)
        return part.expand(self.a.shape[0], *part.shape[1:])

    def metric(self, name: str) -> torch.Tensor:
        """A per-head map of :mod:`attngeom.metrics.registry` (SPEC §2) by name: ``[B, H, Q, S]``."""
        m = registry.get(name)
        if m.layer_only:
            raise InputError(f"{name} is defined on the layer (all heads at once): it has a token-level "
                             "score and no per-head map")
        return self._memo(name, lambda: m.per_head(self))

    def token_score(self, name: str) -> torch.Tensor:
        """Token-level score of SPEC §2 (all heads of the layer): ``[B, Q, S]``.

        Each registry entry says which per-head map it combines and how (``contribution`` at token
        level is ``C_ij = Σ_h C_ij^h``, the inter-head map; ``attention`` is the mean over heads)."""
        m = registry.get(name)
        if m.token is not None:
            return self._memo("token:" + name, lambda: m.token(self))
        return metrics.token_scores(self.metric(m.token_map or name), m.heads)


class Observer(Protocol):
    """Something that reduces blocks as the forward pass goes (see :mod:`attngeom.streaming.reducers`)."""

    def observe(self, block: Block) -> None: ...


class Intervention(Protocol):
    """Returns the weights that mix the values for a block, ``[B, H, Q, S]``, or None to leave
    the block as the model computed it. Called after the observers."""

    def __call__(self, block: Block) -> torch.Tensor | None: ...
