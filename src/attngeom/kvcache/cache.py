"""A compressed KV cache for transformers (per-head eviction under a budget, SPEC §9): the reusable cache.

**The cache.** :class:`CompressedCache` is a transformers ``DynamicCache`` whose full-attention
layers are :class:`CompressedLayer` s (sliding-window layers of hybrid models keep transformers' own
bounded layer). A compressed layer holds, per key/value head, at most ``budget`` entries: keys and
values ``[B, H_kv, n, d]`` gathered per head (heads keep different positions), their absolute
positions ``pos [B, H_kv, n]``, and — when heads have different budgets (the taxonomy policy) —
``valid [B, H_kv, n]`` marking the padding of the smaller heads. Cached keys are already
RoPE-rotated, so a kept entry is exactly what the full cache held; dropping entries is the only
change. Eviction re-allocates the tensors at the smaller size (:func:`cache_bytes` measures the
storages, so the memory saved is measured, not simulated by masking).

**When entries are evicted** (StreamingLLM's "evict for space"): when a forward pass brings ``C``
new tokens, each head first evicts down to ``budget − C`` entries, then appends the ``C`` new ones,
so every query attends to at most ``budget`` entries per head (a prompt longer than the budget is
read whole, then evicted at the next step: the prompt's own forward needs its keys). Which entries
go is the policy's choice (:mod:`attngeom.kvcache.policies`): entries are ranked by the policy's tier
(protections such as sinks and the recent window), then its score, then position
(:func:`kept_entries`).

**Scores** come from the exact capture (:mod:`attngeom.capture.session`): a policy that reads attention
or contributions runs the forward inside a :class:`~attngeom.capture.session.Session` whose observer
:class:`CacheScorer` adds each block's scores to the layer's per-query-head buffer; policies that
need none (full, window, StreamingLLM) run plain SDPA. Query heads sharing a key/value head are
pooled at eviction (``Policy.pool``: mean by default).

**The attention** of compressed layers goes through the plug-in ``"attngeom_kv"``: the model's
mask is replaced by the layer's own (cached entries visible where valid, new entries causal), then
the ``"attngeom"`` function runs (SDPA, or the exact capture inside a session).

**Use** (:func:`compressing`): run the model's forward or ``generate`` with ``cache=`` inside
``with compressing(model, cache):`` (the plug-in and the policy's scoring, restored after);
:func:`cached_forward` is one such forward pass.

What belongs here: the cache, its scoring, its attention and its memory (:func:`check_memory`). Not here: the policies' scores
(:mod:`attngeom.kvcache.policies`), the evaluation under a budget (:mod:`attngeom.kvcache.evaluation`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicLayer, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attngeom.errors import InputError
from attngeom.model.arguments import takes_handle, takes_model
from attngeom.capture.session import ATTN_NAME, Session, attngeom_attention, attngeom_attention_implementation, current_session
from attngeom.generation.decoding import BatchMappedLayer
from attngeom.runs.contract import ModelHandleLike
from attngeom.kvcache.policies import EvictionContext, Policy, get_policy

KV_ATTN = "attngeom_kv"

_ACTIVE: contextvars.ContextVar["Cache | None"] = contextvars.ContextVar("attngeom_kv_cache", default=None)


# --------------------------------------------------------------------------------------------
# Selection: which entries a head keeps
# --------------------------------------------------------------------------------------------


def pool_heads(score: torch.Tensor, n_kv: int, how: str = "mean") -> torch.Tensor:
    """Query-head scores ``[B, H, n]`` pooled per key/value head -> ``[B, H_kv, n]`` (heads
    ``g·r .. g·r+r−1`` share key/value head ``g``, as ``repeat_kv`` lays them out)."""
    B, H, n = score.shape
    if how == "layer":
        return score.mean(1, keepdim=True).expand(B, n_kv, n)
    g = score.reshape(B, n_kv, H // n_kv, n)
    if how == "max":
        return g.amax(2)
    if how == "mean":
        return g.mean(2)
    raise ValueError(f"unknown pooling {how!r}")


def kept_entries(policy: Policy, ctx: EvictionContext, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries each head keeps: ``(idx, ok)`` both ``[B, H_kv, K]`` — indices into the current
    entries in position order, ``ok`` False for padding (a head keeping fewer than ``K``).
    ``keep [H_kv]``: entries each head may keep. Ranking: tier, then score (both from
    ``policy.priority``), then the earlier position; padding entries always go first."""
    tier, score = policy.priority(ctx)
    tier = torch.where(ctx.valid, tier.long(), torch.full_like(tier, -1, dtype=torch.long))
    score = torch.nan_to_num(score.float(), nan=float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices       # entries are in position order
    by_tier = torch.sort(tier.gather(-1, order), dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, by_tier)
    kept = torch.minimum(ctx.valid.sum(-1), keep.to(ctx.pos.device).reshape(1, -1))   # [B, Hkv]
    K = int(kept.max()) if kept.numel() else 0
    idx = order[..., :K]
    ok = torch.arange(K, device=idx.device) < kept[..., None]
    key = torch.where(ok, ctx.pos.gather(-1, idx), torch.iinfo(torch.long).max)
    perm = key.argsort(dim=-1, stable=True)
    return idx.gather(-1, perm), ok.gather(-1, perm)


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class CompressedLayer(BatchMappedLayer):
    """One full-attention layer's compressed cache (module docstring). ``budgets``: entries per
    key/value head; ``streaming``: heads given sink + window only (taxonomy); ``num_heads``: query
    heads (for the per-query-head score buffers)."""

    def __init__(self, policy: Policy, budgets: Sequence[int], num_heads: int, streaming: Sequence[bool] | None = None):
        super().__init__()
        self.policy = policy
        self.budget = torch.as_tensor(list(budgets), dtype=torch.long)
        self.streaming = None if streaming is None else torch.as_tensor(list(streaming), dtype=torch.bool)
        self.num_heads = int(num_heads)
        self.pos: torch.Tensor | None = None      # [B, Hkv, n] absolute positions
        self.valid: torch.Tensor | None = None    # [B, Hkv, n] bool, None = all valid
        self.acc: torch.Tensor | None = None      # [B, H, n] recorded scores per query head
        self.step: torch.Tensor | None = None     # [B, H, n] scores of the current forward pass
        self.seen = 0
        self.n_new = 0
        self.evictions = 0

    @property
    def size(self) -> int:
        """Entries held per head (padding included)."""
        return 0 if self.pos is None else self.pos.shape[-1]

    def _valid(self) -> torch.Tensor:
        return self.valid if self.valid is not None else torch.ones_like(self.pos, dtype=torch.bool)

    def _fold(self) -> None:
        """Fold the last forward pass's scores into the recorded ones."""
        if self.step is not None:
            self.acc = self.acc + self.step if (self.policy.accumulate and self.acc is not None) else self.step
            self.step = None

    def _evict(self, room: int) -> None:
        """Evict down to ``budget − room`` entries per head (nothing when every head fits)."""
        keep = (self.budget - room).clamp_min(0).to(self.pos.device)
        valid = self._valid()
        if bool((valid.sum(-1) <= keep).all()):
            return
        B, n_kv, n = self.pos.shape
        if self.acc is None and self.policy.needs:
            raise RuntimeError(f"the {self.policy.name} policy evicts by scores that were never recorded: run the "
                               "model inside attngeom.kvcache.cache.compressing(model, cache)")
        acc = self.acc if self.acc is not None else torch.zeros(B, self.num_heads, n, device=self.pos.device)
        ctx = EvictionContext(pos=self.pos, valid=valid, score=pool_heads(acc, n_kv, self.policy.pool),
                              values=self.values, seen=self.seen, budget=self.budget.to(self.pos.device),
                              streaming=None if self.streaming is None else self.streaming.to(self.pos.device),
                              keys=self.keys, num_heads=self.num_heads)
        idx, ok = kept_entries(self.policy, ctx, keep)
        d_k, d_v = self.keys.shape[-1], self.values.shape[-1]
        self.keys = self.keys.gather(2, idx[..., None].expand(-1, -1, -1, d_k))      # new, smaller storages
        self.values = self.values.gather(2, idx[..., None].expand(-1, -1, -1, d_v))
        self.pos = self.pos.gather(-1, idx)
        self.valid = None if bool(ok.all()) else ok
        if self.acc is not None:
            self.acc = self.acc.gather(-1, idx.repeat_interleave(self.num_heads // n_kv, dim=1))
        self.evictions += 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, n_kv, C, _ = key_states.shape
        new_pos = torch.arange(self.seen, self.seen + C, device=key_states.device).expand(B, n_kv, C)
        if self.size:
            self._fold()
            self._evict(C)
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.pos = torch.cat([self.pos, new_pos], dim=-1)
            if self.valid is not None:
                self.valid = torch.cat([self.valid, torch.ones_like(new_pos, dtype=torch.bool)], dim=-1)
            if self.acc is not None:
                self.acc = torch.cat([self.acc, self.acc.new_zeros(B, self.num_heads, C)], dim=-1)
        else:  # a copy, not a view of the projection's output (its storage would be counted, and kept)
            self.keys, self.values = key_states.clone(), value_states.clone()
            self.pos = new_pos.clone()
        self.step = None
        self.seen += C
        self.n_new = C
        return self.keys, self.values

    def _map_batch(self, fn) -> None:
        for name in ("keys", "values", "pos", "valid", "acc", "step"):
            t = getattr(self, name)
            if isinstance(t, torch.Tensor) and t.dim() > 1:
                setattr(self, name, fn(t))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed KV cache cannot be cropped: evicted entries are gone")

    def get_seq_length(self) -> int:
        """Tokens read so far (the next token's position), not entries held."""
        return self.seen

    def _kept_after(self, room: int) -> int:
        """Entries per head left by :meth:`_evict` for ``room`` new tokens (padding included)."""
        if not self.size:
            return 0
        keep = (self.budget - room).clamp_min(0).to(self.pos.device)
        valid = self._valid().sum(-1)
        return self.size if bool((valid <= keep).all()) else int(torch.minimum(valid, keep).max())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The kept entries seen as the contiguous positions just before the new tokens: they are
        all in the past, so the model's own causal mask is right (without padding, any attention
        implementation works; "attngeom_kv" replaces the mask by :meth:`attention_mask` anyway)."""
        n = self._kept_after(query_length)
        return n + query_length, self.seen - n

    def attention_mask(self, n_rep: int) -> torch.Tensor | None:
        """The bool mask ``[B, H|1, C, n]`` of the forward pass just added (True = attend): cached
        entries where valid, the ``C`` new ones causal; None when that is SDPA's own default."""
        C, n = self.n_new, self.size
        if self.valid is None and (C == 1 or n == C):
            return None
        m = self._valid()[:, :, None, :].expand(-1, -1, C, -1).clone()
        m[..., n - C:] &= torch.ones(C, C, dtype=torch.bool, device=m.device).tril()
        return m.repeat_interleave(n_rep, dim=1) if self.valid is not None else m[:, :1]


class CompressedCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers are :class:`CompressedLayer` s under
    ``policy`` with ``budget`` entries per key/value head, or ``head_budgets[layer]`` (one per
    key/value head) with ``streaming[layer]`` flags."""

    def __init__(self, config, policy: Policy | str, budget: int, head_budgets: dict | None = None,
                 streaming: dict | None = None):
        policy = get_policy(policy) if isinstance(policy, str) else policy
        text = config.get_text_config(decoder=True)
        H = text.num_attention_heads
        n_kv = getattr(text, "num_key_value_heads", None) or H
        layer_types, kwargs = get_layer_types_and_kwargs(text)
        layers = []
        for l, (kind, kw) in enumerate(zip(layer_types, kwargs)):
            if kind == "full_attention":
                budgets = (head_budgets or {}).get(l, [budget] * n_kv)
                layers.append(CompressedLayer(policy, budgets, H, (streaming or {}).get(l)))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
        Cache.__init__(self, layers=layers)
        self.policy = policy
        self.budget = int(budget)


class StackedLayer(DynamicLayer):
    """One layer of several caches read as one batch (:func:`stacked`): the rows of ``parts[0]``,
    then those of ``parts[1]``, ... Each part keeps its own storages and attends over its own
    entries, with its own padding and mask (:func:`kv_attention`); the model's other operations see
    every row at once. Only inside :func:`compressing`."""

    def __init__(self, parts: Sequence):
        super().__init__()
        self.parts = list(parts)
        self.rows = [p.keys.shape[0] for p in self.parts]
        self.is_sliding = getattr(self.parts[0], "is_sliding", False)
        self.is_initialized = True
        self.returned: list[tuple[torch.Tensor, torch.Tensor]] = []   # each part's keys and values after an update

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.returned = [p.update(k, v, *args, **kwargs) for p, k, v in
                         zip(self.parts, key_states.split(self.rows), value_states.split(self.rows))]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.parts[0].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parts[0].get_mask_sizes(query_length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (ascending); a part left without rows is dropped."""
        keep, start, parts, rows = indices.tolist(), 0, [], []
        for part, n in zip(self.parts, self.rows):
            mine = [i - start for i in keep if start <= i < start + n]
            if 0 < len(mine) < n:
                part.batch_select_indices(torch.as_tensor(mine, device=indices.device))
            if mine:
                parts.append(part)
                rows.append(len(mine))
            start += n
        self.parts, self.rows = parts, rows


def stacked(caches: Sequence[Cache]) -> Cache:
    """One cache whose batch rows are those of ``caches``, in order (a :class:`StackedLayer` per
    layer): their rows are read together, each attending over its own cache's entries."""
    out = DynamicCache()
    out.layers = [StackedLayer(parts) for parts in zip(*(c.layers for c in caches))]
    return out


def cache_bytes(cache: Cache) -> int:
    """Bytes of the storages that hold the cache's keys and values (each storage once)."""
    seen, total = set(), 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
    return total


# --------------------------------------------------------------------------------------------
# Scores and attention during the forward pass
# --------------------------------------------------------------------------------------------


class CacheScorer:
    """Observer adding each block's policy scores to its compressed layer's ``step`` buffer."""

    def __init__(self, cache: Cache):
        self.cache = cache

    def observe(self, block) -> None:
        layer = self.cache.layers[block.layer] if 0 <= block.layer < len(self.cache.layers) else None
        if not isinstance(layer, CompressedLayer):
            return
        s = layer.policy.step(block, layer.n_new)
        if s is None:
            return
        if layer.step is None:
            layer.step = torch.zeros(s.shape[0], s.shape[1], layer.size, device=s.device)
        layer.step[..., block.k_start : block.k_start + s.shape[-1]] += s.float()


def kv_attention(module, query, key, value, attention_mask, **kwargs):
    """The ``"attngeom_kv"`` attention: a compressed layer's own mask, then ``"attngeom"``; a
    :class:`StackedLayer` attends part by part (each over its own entries, with its own mask)."""
    cache = _ACTIVE.get()
    layer_idx = int(getattr(module, "layer_idx", -1))
    layer = cache.layers[layer_idx] if cache is not None and 0 <= layer_idx < len(cache.layers) else None
    if not isinstance(layer, StackedLayer):
        return _attention(layer, module, query, key, value, attention_mask, **kwargs)
    out, start = [], 0
    for part, q, (k, v) in zip(layer.parts, query.split(layer.rows), layer.returned):
        mask = attention_mask if attention_mask is None or attention_mask.shape[0] == 1 else attention_mask[start:start + len(q)]
        out.append(_attention(part, module, q, k, v, mask, **kwargs)[0])
        start += len(q)
    return torch.cat(out), None


def _attention(layer, module, query, key, value, attention_mask, **kwargs):
    if isinstance(layer, CompressedLayer) and layer.size == key.shape[2]:
        attention_mask = layer.attention_mask(query.shape[1] // key.shape[1])
        if (attention_mask is not None and query.shape[2] > 1 and current_session() is None
                and kwargs.get("softcap") is None and kwargs.get("s_aux") is None and not kwargs.get("dropout")):
            # several queries, a mask: SDPA shares each key/value head among its query heads itself (the
            # same result as transformers' SDPA path, which first copies the keys and values per query head;
            # for one query transformers regroups the query heads per key/value head itself, faster here)
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                                   scale=kwargs.get("scaling"), enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
    return attngeom_attention(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(KV_ATTN, kv_attention)
AttentionMaskInterface.register(KV_ATTN, sdpa_mask)


@takes_model
@contextlib.contextmanager
def compressing(model, cache: Cache, session: Session | None = None):
    """Run ``model`` with ``cache`` (its forward or ``generate``, passing ``cache=cache``) inside
    this block: attention goes through ``"attngeom_kv"``, and the policy's scores are recorded when
    it needs any (``session``: the session to record them in; default one with :class:`CacheScorer`).
    The model's previous attention implementation is restored after."""
    policy = getattr(cache, "policy", None)
    if session is None and policy is not None and policy.needs:
        session = Session(observers=[CacheScorer(cache)])
    with attngeom_attention_implementation(model):  # checks the model, restores its own choice after
        model.set_attn_implementation(KV_ATTN)
        token = _ACTIVE.set(cache)
        try:
            with session.active(None) if session is not None else contextlib.nullcontext():
                yield
        finally:
            _ACTIVE.reset(token)
            model.set_attn_implementation(ATTN_NAME)


@takes_handle
def new_cache(handle: ModelHandleLike, policy: Policy, budget: int | None, head_budgets: dict | None = None,
              streaming: dict | None = None) -> Cache:
    """The full ``DynamicCache`` for the ``full`` policy (or no budget), else a :class:`CompressedCache`."""
    if policy.name == "full" or budget is None:
        return DynamicCache(config=handle.model.config)
    return CompressedCache(handle.model.config, policy, budget, head_budgets, streaming)


@takes_handle
def cached_forward(handle: ModelHandleLike, cache: Cache, ids: torch.Tensor, last: int = 0) -> torch.Tensor:
    """One forward pass of ``ids [B, C]`` with ``cache`` (inside :func:`compressing`): float32
    logits ``[B, C, V]``, or of the ``last`` positions only (``[B, last, V]``; 0: all)."""
    return handle.model(input_ids=ids.to(handle.device), cache=cache, use_cache=True, logits_to_keep=last).logits.float()


# --------------------------------------------------------------------------------------------
# Memory: what caches of a given size need, against what the machine has
# --------------------------------------------------------------------------------------------


@takes_handle
def cache_bytes_estimate(handle: ModelHandleLike, n: int, rows: int) -> int:
    """Bytes of ``rows`` full caches of ``n`` entries (float keys and values of every layer): the
    largest batch of variants a ratio can need."""
    cfg = handle.model.config.get_text_config(decoder=True)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = torch.finfo(handle.dtype).bits // 8
    return 2 * cfg.num_hidden_layers * handle.num_kv_heads * n * d * size * rows


MEMINFO = "/proc/meminfo"
"""Where Linux reports its memory (:func:`available_memory`)."""


def available_memory() -> int | None:
    """Bytes the system can give without swapping: Linux's ``MemAvailable`` (free memory and the
    page cache it can drop; a machine that has read large files holds most of its free memory
    there), else the free pages ``sysconf`` reports (None where neither is known)."""
    import os

    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - systems without sysconf
        return None


def memory_limit(device=None) -> int | None:
    """Bytes the variants' caches may use on ``device`` (default: the CPU): on a CUDA device half of
    its free memory (each ``torchrun`` process has a device of its own); on the CPU half of
    :func:`available_memory`, shared out between the processes ``torchrun`` started on this machine
    (``LOCAL_WORLD_SIZE``), which all read the same memory (None where the system reports none)."""
    from attngeom.runs.distributed import local_world_size

    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0] // 2
    available = available_memory()
    return None if available is None else available // 2 // local_world_size()


def check_memory(handle: ModelHandleLike, n: int, rows: int, limit: int | None = None) -> None:
    """Refuse, in one line, a grid whose largest batch of variants (``rows`` caches of ``n``
    entries) would not fit in the memory available (``limit`` bytes; default: :func:`memory_limit`)."""
    need = cache_bytes_estimate(handle, n, rows)
    limit = limit or memory_limit(handle.device)
    if limit is not None and need > limit:
        raise InputError(f"the grid needs {need / 2**30:.1f} GiB for the caches of {rows} variants of a "
                         f"{n}-token context, more than the {limit / 2**30:.1f} GiB it may use; use fewer "
                         "--policies or a shorter --length")
