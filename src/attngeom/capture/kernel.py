"""The blocked exact attention kernel: attention computed as the eager implementation does (softmax
in float32, then cast to the model dtype), in blocks of queries whose size the block budget sets
(:func:`default_block_elements`), each block handed to a session's observers and intervention
(:func:`exact_attention`). Blocks only ever hold ``[B, H, Q, S]`` maps; sources that no query of the
block can see are not computed at all. Also the buffers reused from block to block (:class:`Workspace`)
and from call to call (:class:`GrowingTensor`, a generation's growing keys and values)."""

from __future__ import annotations

import functools
import math
import weakref
from typing import Callable

import torch

from attngeom.capture.blocks import Block, LayerState
from attngeom.capture.routes import fused_attention, layer_route
from attngeom.metrics import formulas as metrics
from attngeom.model.adapter import attention_layer, attention_w_o, attention_w_o_version

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
def device_memory(device: torch.device) -> int | None:
    """Total memory of an accelerator in bytes, or None where torch cannot say."""
    try:
        return int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
    except Exception:   # noqa: BLE001 - no driver (fake devices in tests), or another kind of device
        return None


def default_block_elements(device: torch.device | str) -> int:
    """The block budget a :class:`~attngeom.capture.session.Session` without one uses for a layer on ``device``:
    :data:`DEFAULT_BLOCK_ELEMENTS` on the CPU; on an accelerator :data:`ACCELERATOR_BLOCK_ELEMENTS`,
    or less on a device with little memory (:data:`DEVICE_MEMORY_PER_ELEMENT`; a power of two, the
    same on every device of one kind, so a run's blocks do not depend on what else holds memory)."""
    device = torch.device(device)
    if device.type == "cpu":
        return DEFAULT_BLOCK_ELEMENTS
    total = device_memory(device)
    if total is None:
        return ACCELERATOR_BLOCK_ELEMENTS
    fits = 1 << max(0, (total // DEVICE_MEMORY_PER_ELEMENT).bit_length() - 1)
    return max(DEFAULT_BLOCK_ELEMENTS, min(ACCELERATOR_BLOCK_ELEMENTS, fits))


MIN_BLOCK_QUERIES = 64
"""With the default budget, a block holds at least this many queries: at long inputs the element
budget alone would give blocks of a few dozen queries, hundreds per layer, whose per-block overhead
and thin matrix products cost more than the larger maps (measured in docs/benchmark-analyze.md,
"Measurements behind constants")."""


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


def query_blocks(B: int, H: int, Tq: int, S: int, budget: int, min_queries: int = 1) -> list[tuple[int, int]]:
    """The ``(i0, i1)`` query ranges of one call's blocks: as many queries per block as ``budget``
    elements of ``[B, H, Q, S]`` allow, at least ``min_queries``."""
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
    session=None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Eager-equivalent attention in blocks of queries; returns ``[B, Tq, H, d]`` like transformers.

    ``session``: the active :class:`~attngeom.capture.session.Session` (its observers, intervention,
    layers and block budget), or None.
    ``query [B, H, Tq, d]``, ``key``/``value [B, Hkv, S, d]``; ``attention_mask`` is the boolean
    SDPA mask ``[B, 1, Tq, S]`` or None (causal). ``sinks [H]``: learned sink logits (gpt-oss), one
    extra logit per head with no value (SPEC §1). ``window``: the call's sliding window, if it says
    one. An observed layer whose session and attention allow it takes the fused route instead
    (:func:`attngeom.capture.routes.layer_route`, SPEC §10): no blocks."""
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
        route = session.routes[layer] = layer_route(session, query, key, attention_mask, softcap)
        if route == "fused":
            session.layers_seen.append(layer)
            out, session.routes[layer] = fused_attention(
                session.observers, layer, query, key, value, attention_mask, scaling, G, G_full,
                lengths.to(query.device), sinks=sinks, window=window)
            return out
        state = LayerState(layer=layer, module=module, value=value.detach().float(), w_o=w_o, G=G, G_full=G_full,
                           kv_head=torch.arange(H) // n_rep, lengths=lengths.to(query.device),
                           prepared=session.prepared.get(layer), route=route)
        state.__dict__["grouped"] = True     # repeat_kv's layout by construction: no comparison of kv_head's data
        session.layers_seen.append(layer)
    out = query.new_empty(B, Tq, H, value.shape[-1])
    budget = session.budget(query.device) if session else default_block_elements(query.device)
    for i0, i1 in query_blocks(B, H, Tq, S, budget, session.min_queries if session else MIN_BLOCK_QUERIES):
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
