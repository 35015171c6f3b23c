"""Exact capture of every attention layer through one plug-in in transformers' attention registry.

attngeom registers an attention function under the name ``"attngeom"`` in
``transformers.AttentionInterface`` and the matching mask builder (the boolean SDPA mask) in
``AttentionMaskInterface``. Every supported architecture's attention module calls it with its own
q, k, v (after RoPE, q/k norms, biases), its mask (causal, padding, sliding window as the model
defines them), its scaling and soft-capping; learned sink logits (the call's ``s_aux``: gpt-oss) are
honoured as a virtual source of zero value (SPEC §1).

With no :class:`Session` active the function is plain SDPA (or, where SDPA cannot express the
layer, the exact blocked computation below), so a model left on ``"attngeom"`` behaves as usual.
Inside :meth:`Session.active` it computes attention in blocks of queries, exactly as the eager
implementation does (softmax in float32, then cast to the model dtype), hands each block to the
session's *observers* (which reduce metrics as they go) and lets an optional *intervention* edit
the weights that mix the values (no renormalisation, SPEC §3). Blocks only ever hold
``[B, H, Q, S]`` maps; sources that no query of the block can see are not computed at all.
"""

from __future__ import annotations

import contextlib
import math
import functools
import weakref
import contextvars
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attngeom.errors import InputError
from attngeom.model.arguments import takes_model
from attngeom.metrics import formulas as metrics
from attngeom.metrics import registry
from attngeom.model.adapter import adapter_for, attention_implementation, attention_layer, attention_w_o, attention_w_o_version

ATTN_NAME = "attngeom"

_SESSION: contextvars.ContextVar["Session | None"] = contextvars.ContextVar("attngeom_session", default=None)

DEFAULT_BLOCK_ELEMENTS = 1 << 21
"""Upper bound on ``B*H*Q*S`` for one block of queries (8 MiB per float32 map): large enough to
amortise the per-block Python overhead, small enough that the element-wise passes over a block stay
in the cache (the sizes compared are in docs/benchmark-analyze.md, "Measurements behind constants")."""

ACCELERATOR_BLOCK_ELEMENTS = 1 << 26
"""The largest default budget on an accelerator (``cuda`` and any other non-CPU device): 256 MiB
per float32 map. A GPU runs each of a block's operators (about 250: docs/benchmark-analyze.md, "The
work itself") as its own kernel launch, so blocks of the CPU's size leave it waiting on the host: at
T = 8192 with 9 heads the CPU's budget makes 128 blocks per layer, this one 10. It is the budget the
H200 figures of docs/testing.md ("On a real GPU") were measured with; ``benchmarks/gpu_check.sh``
times it beside 2^24 and 2^28 on every GPU it runs on."""

DEVICE_MEMORY_PER_ELEMENT = 1024
"""On a device with less memory, the default budget is at most its memory divided by this (a float32
map at most 1/256 of it; the analysis holds about eight maps at its peak, 3 % of the device): 2^26
on GPUs of 64 GiB and more (the H200's 139 GiB, 80 GiB), 2^25 on 40 GiB, 2^24 on 24 GiB, 2^23 on a
T4's 15 GiB; never below the CPU's budget."""


@functools.lru_cache(maxsize=16)
def _device_memory(device: torch.device) -> int | None:
    """Total memory of an accelerator in bytes, or None where torch cannot say."""
    try:
        return int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
    except Exception:   # noqa: BLE001 - no driver (fake devices in tests), or another kind of device
        return None


def default_block_elements(device: torch.device | str) -> int:
    """The block budget a :class:`Session` without one uses for a layer on ``device``:
    :data:`DEFAULT_BLOCK_ELEMENTS` on the CPU; on an accelerator :data:`ACCELERATOR_BLOCK_ELEMENTS`,
    or less on a device with little memory (:data:`DEVICE_MEMORY_PER_ELEMENT`; a power of two, the
    same on every device of one kind, so a run's blocks do not depend on what else holds memory)."""
    device = torch.device(device)
    if device.type == "cpu":
        return DEFAULT_BLOCK_ELEMENTS
    total = _device_memory(device)
    if total is None:
        return ACCELERATOR_BLOCK_ELEMENTS
    fits = 1 << max(0, (total // DEVICE_MEMORY_PER_ELEMENT).bit_length() - 1)
    return max(DEFAULT_BLOCK_ELEMENTS, min(ACCELERATOR_BLOCK_ELEMENTS, fits))


MIN_BLOCK_QUERIES = 64
"""With the default budget, a block holds at least this many queries: at long inputs the element
budget alone would give blocks of a few dozen queries, hundreds per layer, whose per-block overhead
and thin matrix products cost more than the larger maps (measured in docs/benchmark-analyze.md,
"Measurements behind constants")."""


# --------------------------------------------------------------------------------------------
# The block handed to observers and interventions
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The session: what is active during one forward pass
# --------------------------------------------------------------------------------------------


class Workspace:
    """Reusable buffers for the ``[B, H, Q, S]`` maps of successive blocks (logits, weights).

    Every block of every layer takes its maps from here instead of allocating them: fresh 8 MiB
    maps for each of the hundreds of blocks of a forward cost the kernel a page fault per 4 KiB
    (the count is in docs/benchmark-analyze.md, "Measurements behind constants").
    A map is valid until the next block of the session; observers and interventions only read it
    while their block is current (a reducer that keeps a map copies it, as ``FullCapture`` does)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A tensor of ``shape`` (uninitialised) backed by the buffer ``name``, grown when too small
        (to at least twice its size: the maps of decoding steps grow by one source per step, and
        must not cost an allocation each)."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.device != torch.device(device):
            buf = self._buffers[name] = torch.empty(n, dtype=dtype, device=device)
        elif buf.numel() < n:
            buf = self._buffers[name] = torch.empty(max(n, 2 * buf.numel()), dtype=dtype, device=device)
        return buf[:n].view(shape)


class GrowingTensor:
    """A tensor that grows along ``dim`` call after call (a generation's cached keys, values and value
    norms: one more token per decoding step) without being reallocated at every call: its storage
    has room for ``capacity`` entries and doubles when full, so ``n`` entries cost ``O(log n)``
    allocations instead of ``n`` copies of the whole tensor, and the heap does not fragment.
    :attr:`tensor` is a view of the filled part; its contents equal ``torch.cat`` of the appended
    pieces. A view handed out stays valid until :meth:`truncate` lets later entries overwrite it."""

    def __init__(self, dim: int, capacity: int = 0):
        self.dim, self.capacity, self.length = dim, int(capacity), 0
        self._storage: torch.Tensor | None = None

    @classmethod
    def holding(cls, dim: int, storage: torch.Tensor, length: int) -> "GrowingTensor":
        """A growing tensor whose storage is ``storage``, its first ``length`` entries along ``dim``
        filled and the rest room for later appends (nothing copied)."""
        g = cls(dim, storage.shape[dim])
        g._storage, g.length = storage, int(length)
        return g

    @property
    def tensor(self) -> torch.Tensor | None:
        return None if self._storage is None else self._storage.narrow(self.dim, 0, self.length)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """Append ``x`` (same shape but along ``dim``, same dtype and device) and return :attr:`tensor`."""
        n = self.length + x.shape[self.dim]
        buf = self._storage
        if buf is None or n > buf.shape[self.dim]:
            shape = list(x.shape)
            shape[self.dim] = max(n, self.capacity, 0 if buf is None else 2 * buf.shape[self.dim])
            grown = x.new_empty(shape)
            if self.length:
                grown.narrow(self.dim, 0, self.length).copy_(self.tensor)
            self._storage = buf = grown
        buf.narrow(self.dim, self.length, x.shape[self.dim]).copy_(x)
        self.length = n
        return self.tensor

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` entries (the storage stays)."""
        self.length = min(self.length, int(length))

    def map_storage(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the storage by ``fn(storage)`` (an operation along other dimensions: batch selection)."""
        if self._storage is not None:
            self._storage = fn(self._storage)


class Session:
    """Observers and an intervention active for the forward passes run inside :meth:`active`.

    ``layers``: the attention layers (``attngeom.model.adapter.attention_layer``) observed and intervened on;
    None means all. Layers outside it still run through the exact blocked path, unobserved.
    ``block_elements`` bounds ``B*H*Q*S`` per block of queries (None: :func:`default_block_elements`
    of each layer's device, so a model split over devices gets each device's own).
    ``prepared``: ``{layer: {metric: map}}`` of the measures computed before this forward
    (:func:`attngeom.capture.prepared.prepare`), read by :meth:`Block.prepared`."""

    def __init__(
        self,
        observers: Iterable[Observer] = (),
        intervention: Intervention | None = None,
        layers: Iterable[int] | None = None,
        block_elements: int | None = None,
        prepared: dict[int, dict[str, torch.Tensor]] | None = None,
    ):
        from attngeom.data.corpora import check_layers

        self.prepared = prepared or {}
        self.observers = list(observers)
        self.intervention = intervention
        layers = check_layers(layers)       # whole numbers from 0; the model's range: check
        self.layers = None if layers is None else set(layers)
        self.block_elements = None if block_elements is None else int(block_elements)
        # the default budget keeps at least MIN_BLOCK_QUERIES queries per block: at long inputs a
        # fixed budget would leave a handful of queries per block and per-block overhead would dominate
        self.min_queries = MIN_BLOCK_QUERIES if block_elements is None else 1
        self.lengths: torch.Tensor | None = None
        self.layers_seen: list[int] = []
        self.workspace = Workspace()

    def budget(self, device: torch.device | str) -> int:
        """``B*H*Q*S`` per block for a layer on ``device``: the session's ``block_elements``, or
        :func:`default_block_elements`."""
        return default_block_elements(device) if self.block_elements is None else self.block_elements

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def check(self, num_layers: int) -> None:
        """Refuse, before a forward pass of a model with ``num_layers`` attention layers, layers it
        does not have (:func:`attngeom.data.corpora.check_layers`, the command line's check)."""
        from attngeom.data.corpora import check_layers

        check_layers(None if self.layers is None else sorted(self.layers), num_layers)

    @contextlib.contextmanager
    def active(self, lengths: torch.Tensor):
        """Make this session the one the attention function reports to."""
        self.lengths = lengths
        self.layers_seen = []
        token = _SESSION.set(self)
        try:
            yield self
        finally:
            _SESSION.reset(token)


# --------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------


_GRAMS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def output_grams(module: torch.nn.Module, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w_o [D, H*d], G [H, d, d], G_full [H*d, H*d])`` in float32 for an attention module's
    output projection (found by the architecture adapter); cached per module until its weights change."""
    key = attention_w_o_version(module)
    hit = _GRAMS.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    w_o = attention_w_o(module).detach().float()
    value = (w_o, metrics.gram(w_o, num_heads), metrics.full_gram(w_o))
    _GRAMS[module] = (key, value)
    return value


def _query_blocks(B: int, H: int, Tq: int, S: int, budget: int, min_queries: int = 1) -> list[tuple[int, int]]:
    step = max(1, min(Tq, max(min_queries, budget // max(1, B * H * S))))
    return [(i, min(Tq, i + step)) for i in range(0, Tq, step)]


def _block_allowed(mask: torch.Tensor | None, i0: int, i1: int) -> torch.Tensor | None:
    """Boolean ``[B|1, 1, Q, S]`` mask for queries ``i0..i1`` (True = may attend), or None for causal."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return mask[:, :, i0:i1]
    return mask[:, :, i0:i1] > torch.finfo(mask.dtype).min / 2  # additive float mask


def _source_range(allowed: torch.Tensor | None, i1: int, S: int, Tq: int) -> tuple[int, int]:
    """Smallest range of sources any query in the block may see."""
    if allowed is None:
        if Tq == 1:  # a single query sees everything (SDPA's lower-right alignment)
            return 0, S
        return 0, min(S, i1)  # upper-left causal, as SDPA's is_causal
    cols = allowed.any(dim=(0, 1, 2)).nonzero()
    if cols.numel() == 0:
        return 0, 1
    return int(cols.min()), int(cols.max()) + 1


def _additive_mask(allowed, k0: int, k1: int, dtype, device) -> torch.Tensor | None:
    """``0`` where a query may attend, the dtype's minimum elsewhere (eager's convention):
    ``[B|1, 1, Q, S]``, or None for causal blocks (:func:`_scores` masks their diagonal part)."""
    if allowed is None:
        return None
    return torch.zeros(allowed[..., k0:k1].shape, dtype=dtype, device=device).masked_fill_(
        ~allowed[..., k0:k1], torch.finfo(dtype).min)


@functools.lru_cache(maxsize=64)
def _future(Q: int, S: int, device: str) -> torch.Tensor:
    """``[Q, S]`` bool, True where source ``c`` lies after query ``r`` (``c > r``); cached: the same
    block shapes recur in every layer."""
    return torch.ones(Q, S, dtype=torch.bool, device=device).triu_(1)


def _scores(q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None,
            mask: torch.Tensor | None, diagonal: int | None = None,
            workspace: Workspace | None = None) -> torch.Tensor:
    """Attention logits as eager computes them: ``(q kᵀ)·scaling``, soft-capped, plus the mask.

    ``q [B, H, Q, d]``, ``k [B, Hkv, S, d]`` -> ``[B, H, Q, S]``; with grouped-query attention the
    ``H / Hkv`` query heads of a key head are one product (the keys are never repeated). ``mask`` is
    additive (``[B|1, 1, Q, S]``);
    a causal block passes ``diagonal`` instead, the block column of its first query: only the
    sources after each query in the ``[Q, Q]`` part from there on are masked (set to the dtype's
    minimum, which is what eager's ``+ min`` gives in floating point), so no ``[Q, S]`` mask is
    read or copied. Without soft-capping the scaling is fused into the product (``alpha``), written
    into the ``workspace``'s buffer when one is given."""
    B, H, Q, d = q.shape
    Hk, S = k.shape[1], k.shape[2]
    qg = q.reshape(B * Hk, H // Hk * Q, d)                  # the query rows of each key head's group
    kt = k.reshape(B * Hk, S, d).transpose(1, 2)
    if softcap is None:
        out = (q.new_empty(B * Hk, H // Hk * Q, S) if workspace is None
               else workspace.take("scores", (B * Hk, H // Hk * Q, S), q.dtype, q.device))
        scores = out.baddbmm_(qg, kt, beta=0, alpha=scaling).view(B, H, Q, S)
    else:
        scores = (torch.bmm(qg, kt) * scaling).view(B, H, Q, S)
        scores = torch.tanh(scores / softcap) * softcap
    if diagonal is not None and diagonal < S:
        scores[..., diagonal:].masked_fill_(_future(Q, S - diagonal, str(q.device)), torch.finfo(scores.dtype).min)
    return scores if mask is None else scores + mask


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
    session: Session | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager-equivalent attention in blocks of queries; returns ``[B, Tq, H, d]`` like transformers.

    ``query [B, H, Tq, d]``, ``key``/``value [B, Hkv, S, d]``; ``attention_mask`` is the boolean
    SDPA mask ``[B, 1, Tq, S]`` or None (causal). ``sinks [H]``: learned sink logits (gpt-oss), one
    extra logit per head with no value (SPEC §1)."""
    B, H, Tq, d = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    n_rep = H // Hkv
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = attention_layer(module)
    observing = session is not None and session.wants(layer)
    state = None
    if observing:
        w_o, G, G_full = output_grams(module, H)
        lengths = session.lengths if session.lengths is not None else torch.full((B,), S)
        state = LayerState(layer=layer, module=module, value=value.detach().float(), w_o=w_o, G=G, G_full=G_full,
                           kv_head=torch.arange(H) // n_rep, lengths=lengths.to(query.device),
                           prepared=session.prepared.get(layer))
        state.__dict__["grouped"] = True     # repeat_kv's layout by construction: no comparison of kv_head's data
        session.layers_seen.append(layer)
    out = query.new_empty(B, Tq, H, value.shape[-1])
    budget = session.budget(query.device) if session else default_block_elements(query.device)
    for i0, i1 in _query_blocks(B, H, Tq, S, budget, session.min_queries if session else MIN_BLOCK_QUERIES):
        allowed = _block_allowed(attention_mask, i0, i1)
        k0, k1 = _source_range(allowed, i1, S, Tq)
        scores = _scores(query[:, :, i0:i1], key[:, :, k0:k1], scaling, softcap,
                         _additive_mask(allowed, k0, k1, query.dtype, query.device),
                         diagonal=i0 - k0 if allowed is None and Tq > 1 else None,
                         workspace=session.workspace if session else None)
        if sinks is not None:
            sink_logits = sinks.reshape(1, -1, 1, 1).expand(B, -1, i1 - i0, 1).to(scores.dtype)
            scores = torch.cat([scores, sink_logits], dim=-1)
            scores = scores - scores.max(dim=-1, keepdim=True).values
            full = torch.softmax(scores, dim=-1, dtype=torch.float32)
            probs, sink_share = full[..., :-1], full[..., -1]
        else:
            buf = session.workspace.take("probs", scores.shape, torch.float32, scores.device) if session else None
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32, out=buf)
        probs = probs.to(query.dtype)
        mixed = None
        if observing:
            # float32 logits let the block compute row entropies without a logarithm per element
            keep = sinks is None and scores.dtype == torch.float32
            # the call's queries are the last Tq of its S sources: positions from 0 without a cache,
            # from the cached length in a decoding step (generation keeps every earlier token cached)
            block = Block(state=state, a=probs.float(), q_start=S - Tq + i0, k_start=k0,
                          allowed=None if allowed is None else allowed[..., k0:k1],
                          scores=scores if keep else None,
                          learned_sink=None if sinks is None else sink_share)
            for obs in session.observers:
                obs.observe(block)
            if session.intervention is not None:
                edited = session.intervention(block)
                if edited is not None:
                    mixed = metrics.head_output(edited.to(query.dtype), value[:, :, k0:k1])
            if mixed is None and query.dtype == torch.float32:
                # in float32 the head outputs the metrics use are the module's own output: share
                # them (computed here only when no observer asked for them first)
                mixed = block.head_output
        if mixed is None:
            mixed = metrics.head_output(probs, value[:, :, k0:k1])
        out[:, i0:i1] = mixed.transpose(1, 2)
    return out


def attngeom_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """The function registered as ``"attngeom"`` in ``transformers.AttentionInterface``."""
    session = _SESSION.get()
    sinks = kwargs.pop("s_aux", None)
    if session is None and softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout and module.training:
        raise RuntimeError("attngeom computes attention in eval mode only (dropout > 0 while training)")
    return exact_attention(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap,
                           session=session, sinks=sinks), None


AttentionInterface.register(ATTN_NAME, attngeom_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


# --------------------------------------------------------------------------------------------
# Switching a model onto the plug-in
# --------------------------------------------------------------------------------------------


@takes_model
@contextlib.contextmanager
def attngeom_attention_implementation(model):
    """Route ``model``'s attention through the plug-in for the duration of the block, then restore.
    The model's attention is discovered first (once per model: :func:`attngeom.model.adapter.adapter_for`),
    so a model attngeom cannot capture is refused before anything runs. A model in training mode
    (dropout active) is put in eval mode, with one line on stderr (:func:`in_eval_mode`)."""
    in_eval_mode(model)
    adapter_for(model)
    with attention_implementation(model, ATTN_NAME):
        yield model


def in_eval_mode(model) -> None:
    """Put ``model`` in eval mode when it, or any of its modules, is in training mode, and say so in
    one line on stderr: attngeom's metrics are those of the model as it predicts (no dropout), and it
    stays in eval mode afterwards, as ``load_model`` and ``wrap`` leave it."""
    import sys

    if any(m.training for m in model.modules()):
        model.eval()
        sys.stderr.write("attngeom: the model was in training mode (dropout active); it is now in eval mode "
                         "(model.eval()) for the analysis\n")
        sys.stderr.flush()
