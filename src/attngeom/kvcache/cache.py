"""A compressed KV cache for transformers (per-head eviction under a budget), and reading under it.

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
(protections such as sinks and the recent window), then its score, then position.

**Scores** come from the exact capture (:mod:`attngeom.capture.plugin`): a policy that reads attention
or contributions runs the forward inside a :class:`~attngeom.capture.plugin.Session` whose observer
:class:`CacheScorer` adds each block's scores to the layer's per-query-head buffer; policies that
need none (full, window, StreamingLLM) run plain SDPA. Query heads sharing a key/value head are
pooled at eviction (``Policy.pool``: mean by default).

**The attention** of compressed layers goes through the plug-in ``"attngeom_kv"``: the model's
mask is replaced by the layer's own (cached entries visible where valid, new entries causal), then
the ``"attngeom"`` function runs (SDPA, or the exact capture inside a session).

**Use** (:func:`compressing`): run the model's forward or ``generate`` with ``cache=`` inside
``with compressing(model, cache):`` (the plug-in and the policy's scoring, restored after).

**Reading under a budget** (:func:`read`): a text is read token by token (``chunk = 1``, the
reference) or ``chunk`` tokens per forward with eviction between chunks, and the next-token NLL,
the peak cache bytes and the time are recorded. **Answers under a budget** (:func:`answer`): a
prompt is read whole, then the reference continuation's NLL and greedy tokens follow from the
compressed cache. :func:`experiment` and :func:`answers` run every (window or example, policy,
budget) as a resumable unit of a :class:`~attngeom.runs.run.Run`; :func:`summarize`,
:func:`summarize_answers` and :func:`pairwise` give 95 % bootstrap intervals over windows/examples.

What belongs here: the cache, its scoring and the evaluations. Not here: the policies' scores
(:mod:`attngeom.kvcache.policies`), figures (:mod:`attngeom.reports.kvcache`), argument parsing
(:mod:`attngeom.commands.kvcache`).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attngeom.capture.plugin import ATTN_NAME, Session, attngeom_attention, attngeom_attention_implementation
from attngeom.errors import InputError
from attngeom.generation.decoding import BatchMappedLayer
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike, perplexity
from attngeom.kvcache.policies import SINKS, EvictionContext, Policy, get_policy
from attngeom.kvcache.settings import KVCacheSettings

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


def select(policy: Policy, ctx: EvictionContext, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
                              streaming=None if self.streaming is None else self.streaming.to(self.pos.device))
        idx, ok = select(self.policy, ctx, keep)
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
    """The ``"attngeom_kv"`` attention: a compressed layer's own mask, then ``"attngeom"``."""
    cache = _ACTIVE.get()
    layer_idx = int(getattr(module, "layer_idx", -1))
    layer = cache.layers[layer_idx] if cache is not None and 0 <= layer_idx < len(cache.layers) else None
    if isinstance(layer, CompressedLayer) and layer.size == key.shape[2]:
        attention_mask = layer.attention_mask(query.shape[1] // key.shape[1])
    return attngeom_attention(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(KV_ATTN, kv_attention)
AttentionMaskInterface.register(KV_ATTN, sdpa_mask)


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


def new_cache(handle: ModelHandleLike, policy: Policy, budget: int | None, head_budgets: dict | None = None,
              streaming: dict | None = None) -> Cache:
    """The full ``DynamicCache`` for the ``full`` policy (or no budget), else a :class:`CompressedCache`."""
    if policy.name == "full" or budget is None:
        return DynamicCache(config=handle.model.config)
    return CompressedCache(handle.model.config, policy, budget, head_budgets, streaming)


def step(handle: ModelHandleLike, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward pass of ``ids [B, C]`` with ``cache`` (inside :func:`compressing`): float32
    logits ``[B, C, V]``."""
    return handle.model(input_ids=ids.to(handle.device), cache=cache, use_cache=True).logits.float()


# --------------------------------------------------------------------------------------------
# Language modelling under a budget
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def read(handle: ModelHandleLike, ids: Sequence[int], policy: Policy | str, budget: int | None, chunk: int = 1,
         head_budgets: dict | None = None, streaming: dict | None = None) -> dict:
    """Read ``ids`` with a compressed cache, ``chunk`` tokens per forward pass: ``{"nll": Σ NLL of
    tokens 1..T−1, "tokens": T−1, "seconds", "peak_bytes": largest cache storage after a pass,
    "final_bytes"}``."""
    policy = get_policy(policy) if isinstance(policy, str) else policy
    if budget is not None and policy.name != "full" and chunk >= min(
            [budget] + [min(b) for b in (head_budgets or {}).values()]):
        raise InputError(f"--chunk {chunk} must be smaller than every budget (got budget {budget})")
    x = torch.as_tensor(list(ids), dtype=torch.long)[None]
    T = x.shape[1]
    cache = new_cache(handle, policy, budget, head_budgets, streaming)
    nll, peak = 0.0, 0
    t0 = time.perf_counter()
    with compressing(handle.model, cache):
        for s in range(0, T - 1, chunk):
            e = min(s + chunk, T - 1)
            logits = step(handle, cache, x[:, s:e])
            nll += float(torch.nn.functional.cross_entropy(logits[0], x[0, s + 1 : e + 1].to(logits.device),
                                                           reduction="sum"))
            peak = max(peak, cache_bytes(cache))
    seconds = time.perf_counter() - t0
    return {"nll": nll, "tokens": T - 1, "seconds": seconds, "peak_bytes": peak, "final_bytes": cache_bytes(cache)}


# --------------------------------------------------------------------------------------------
# Taxonomy-aware budgets
# --------------------------------------------------------------------------------------------


def taxonomy_budgets(regimes: pd.DataFrame, num_heads: int, num_kv_heads: int, budget: int,
                     small: int | None = None, chunk: int = 1) -> tuple[dict, dict]:
    """Per-layer budgets per key/value head from a taxonomy table (``layer, head, regime``):
    ``(budgets {layer: [Hkv]}, streaming {layer: [Hkv]})``. A key/value head with a Retriever
    query head keeps a large budget; the others (Mixer/Reset only) keep ``small`` entries
    (default ``max(SINKS + 4, budget // 4, SINKS + chunk)``, never more than ``budget``) as sink +
    window; the Retriever heads share the rest,
    so each layer holds ``H_kv × budget`` entries in all. A layer without Retriever heads gives
    every head ``budget`` as sink + window; a layer of Retrievers only gives each ``budget``."""
    small = min(budget, max(SINKS + 4, budget // 4, SINKS + chunk)) if small is None else int(small)
    n_rep = num_heads // num_kv_heads
    budgets, streaming = {}, {}
    for layer, g in regimes.groupby("layer"):
        is_retr = {int(h): r == "Retriever" for h, r in zip(g["head"], g["regime"])}
        retr = [any(is_retr.get(k * n_rep + i, False) for i in range(n_rep)) for k in range(num_kv_heads)]
        n_r = sum(retr)
        if n_r in (0, num_kv_heads):
            budgets[int(layer)] = [budget] * num_kv_heads
        else:
            large = (num_kv_heads * budget - (num_kv_heads - n_r) * small) // n_r
            budgets[int(layer)] = [large if r else small for r in retr]
        streaming[int(layer)] = [not r for r in retr]
    return budgets, streaming


# --------------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------------


def configurations(policies: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, int | None]]:
    """(policy, budget) pairs to run: ``full`` once (budget None), every other policy per budget."""
    out: list[tuple[str, int | None]] = []
    for p in policies:
        get_policy(p)
        out += [(p, None)] if p == "full" else [(p, int(b)) for b in budgets]
    return out


def _budgets_for(handle: ModelHandleLike, name: str, budget: int | None, regimes: pd.DataFrame | None,
                 chunk: int = 1) -> tuple[dict | None, dict | None]:
    """Per-head budgets and streaming flags of a policy with per-head budgets (else None, None)."""
    if budget is None or not get_policy(name).per_head_budgets:
        return None, None
    if regimes is None:
        raise InputError(f"the {name} policy needs head regimes (a taxonomy table)")
    return taxonomy_budgets(regimes, handle.num_heads, handle.num_kv_heads, budget, chunk=chunk)


def _config_stage(handle: ModelHandleLike, run: RunLike, name: str, items: Sequence[Sequence[int]], configs, one, column: str,
                  regimes: pd.DataFrame | None, chunk: int = 1) -> pd.DataFrame:
    """Rows of ``one(i, policy, budget, head_budgets, streaming) -> dict`` for every (item ``i``,
    configuration), each a unit of stage ``name`` of ``run`` (resumable); ``full`` rows repeated
    for every budget of the other configurations."""
    from attngeom.runs.run import Memory, fingerprint

    n_cfg = len(configs)
    fps = [fingerprint(items[u // n_cfg]) for u in range(len(items) * n_cfg)]

    def work(units: list[int]) -> dict:
        rows = []
        for u in units:
            i, (policy, budget) = u // n_cfg, configs[u % n_cfg]
            hb, st = _budgets_for(handle, policy, budget, regimes, chunk)
            rows.append({column: i, "policy": policy, "budget": -1 if budget is None else budget,
                         **one(i, policy, budget, hb, st)})
        return {"rows": pd.DataFrame(rows)}

    recs = (run or Memory()).stage(name, len(items) * n_cfg, work, fingerprints=fps, desc=f"kvcache {name}",
                                   unit="read")
    df = pd.concat([d["rows"] for d in recs.values()], ignore_index=True)
    budgets = sorted({b for _, b in configs if b is not None})
    full, rest = df[df["policy"] == "full"], df[df["policy"] != "full"]
    if len(full) and budgets:
        full = pd.concat([full.assign(budget=b) for b in budgets], ignore_index=True)
    return pd.concat([rest, full], ignore_index=True).sort_values(["policy", "budget", column]).reset_index(drop=True)


def experiment(handle: ModelHandleLike, run: RunLike, windows: Sequence[Sequence[int]],
               settings: KVCacheSettings = KVCacheSettings(), regimes: pd.DataFrame | None = None) -> ExperimentResult:
    """Language modelling under a budget, with ``settings`` (:class:`~attngeom.kvcache.settings.KVCacheSettings`).
    Each (window, configuration) is a unit of stage ``"read"`` of ``run`` (resumable); ``full`` is
    read once per window and its row repeated for every budget (``budget`` is then the budget it is
    compared at). ``regimes``: the taxonomy table the ``taxonomy`` policy's budgets come from.

    Returns an :class:`~attngeom.runs.contract.ExperimentResult` with tables ``reads`` (one row per
    (window, policy, budget): ``nll, tokens, ppl, seconds, seconds_per_token, peak_bytes,
    final_bytes``), ``summary`` (:func:`summarize`) and ``pairs`` (:func:`pairwise`); ``per_window``:
    ``nll [windows, configurations]`` (summed NLL, columns ``keys`` = (policy, budget)) and
    ``tokens [windows]``, in window order."""
    configs = configurations(settings.policies, settings.budgets)
    chunk = settings.chunk
    df = _config_stage(handle, run, "read", windows, configs,
                       lambda i, p, b, hb, st: read(handle, windows[i], p, b, chunk, hb, st), "window", regimes,
                       chunk)
    df["ppl"] = perplexity(df["nll"].to_numpy(), df["tokens"].to_numpy())
    df["seconds_per_token"] = df["seconds"] / df["tokens"]
    summary_df = summarize(df, settings.n_resamples)
    tables = {"reads": df, "summary": summary_df, "pairs": pairwise(df, settings.n_resamples)}
    wide = df.pivot(index="window", columns=["policy", "budget"], values="nll").sort_index()
    per_window = {"keys": [(p, int(b)) for p, b in wide.columns], "nll": wide.to_numpy(),
                  "tokens": df.groupby("window")["tokens"].first().sort_index().to_numpy()}
    return ExperimentResult("kvcache", tables, {"results": summary_df.to_dict(orient="records")}, per_window,
                            settings.record())


# --------------------------------------------------------------------------------------------
# Answers under a budget
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def answer(handle: ModelHandleLike, prompt: Sequence[int], reference: Sequence[int], policy: Policy | str, budget: int | None,
           new_tokens: int = 16, head_budgets: dict | None = None, streaming: dict | None = None) -> dict:
    """Read ``prompt`` in one forward pass (the compressed cache evicts it down to the budget at the
    next step, with the scores of the prompt's queries: SnapKV's setting), then (1) the reference
    continuation's summed NLL, token by token, and (2) ``new_tokens`` greedy tokens, each from a
    fresh read of the prompt: ``{"ref_nll", "ref_tokens", "generated": "id id ...", "seconds"}``."""
    policy = get_policy(policy) if isinstance(policy, str) else policy
    t0 = time.perf_counter()

    nll = 0.0
    cache = new_cache(handle, policy, budget, head_budgets, streaming)
    with compressing(handle.model, cache):
        last = step(handle, cache, torch.as_tensor([list(prompt)]))[0, -1]
        for t, tok in enumerate(reference):
            nll -= float(torch.log_softmax(last, -1)[tok])
            if t + 1 < len(reference):
                last = step(handle, cache, torch.tensor([[tok]]))[0, -1]
    out: list[int] = []
    cache = new_cache(handle, policy, budget, head_budgets, streaming)
    with compressing(handle.model, cache):
        last = step(handle, cache, torch.as_tensor([list(prompt)]))[0, -1]
        for t in range(new_tokens):
            out.append(int(last.argmax()))
            if t + 1 < new_tokens:
                last = step(handle, cache, torch.tensor([[out[-1]]]))[0, -1]
    return {"ref_nll": nll, "ref_tokens": len(reference), "generated": " ".join(map(str, out)),
            "seconds": time.perf_counter() - t0}


def answers(handle: ModelHandleLike, run: RunLike, examples: Sequence[tuple[Sequence[int], Sequence[int]]], policies: Sequence[str],
            budgets: Sequence[int], new_tokens: int = 16, regimes: pd.DataFrame | None = None) -> pd.DataFrame:
    """Answers under a budget: one row per (example, policy, budget) with the reference's ``ref_nll``
    and ``ref_tokens``, and the greedy tokens' agreement with the full cache's: ``match`` (share of
    the ``new_tokens`` positions with the same token) and ``first_divergence`` (index of the first
    different token; ``new_tokens`` when none). ``full`` is always run (it is the reference)."""
    configs = configurations(["full"] + [p for p in policies if p != "full"], budgets)
    items = [[len(p)] + list(p) + list(r) for p, r in examples]      # the fingerprint sees the split too
    df = _config_stage(handle, run, "answers", items, configs,
                       lambda i, p, b, hb, st: answer(handle, examples[i][0], examples[i][1], p, b, new_tokens, hb, st),
                       "example", regimes)
    ref = df[df["policy"] == "full"].drop_duplicates("example").set_index("example")["generated"]
    match, first = [], []
    for ex, gen in zip(df["example"], df["generated"]):
        a, b = gen.split(), ref.loc[ex].split()
        same = [x == y for x, y in zip(a, b)]
        match.append(float(np.mean(same)) if same else 1.0)
        first.append(same.index(False) if False in same else len(same))
    df["match"], df["first_divergence"] = match, first
    return df


# --------------------------------------------------------------------------------------------
# Summaries with bootstrap intervals
# --------------------------------------------------------------------------------------------


def summarize(df: pd.DataFrame, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per (policy, budget): perplexity over windows (``exp(Σ NLL / Σ tokens)``) with its 95 %
    bootstrap interval; when ``full`` was run, the difference to the full cache's perplexity on the
    same resamples (``delta_ppl``, ``delta_low``, ``delta_high``), ``memory_saved`` (1 − peak cache
    bytes / the full cache's) and ``time_ratio`` (time per token / the full cache's)."""
    from attngeom.stats.resampling import percentile_interval, resample_counts
    from attngeom.stats.resampling import perplexity as resampled

    windows = sorted(df["window"].unique())
    counts = resample_counts(len(windows), n_resamples, seed)
    pos = {w: i for i, w in enumerate(windows)}

    def per_window(g, col):
        out = np.full(len(windows), np.nan)
        out[[pos[w] for w in g["window"]]] = g[col].to_numpy()
        return out

    rows = []
    for (policy, budget), g in df.groupby(["policy", "budget"], sort=True):
        nll, tok = per_window(g, "nll"), per_window(g, "tokens")
        boot = resampled(counts, nll, tok)
        lo, hi = percentile_interval(boot)
        row = {"policy": policy, "budget": int(budget), "windows": int(len(g)),
               "ppl": float(perplexity(np.nansum(nll), np.nansum(tok))), "ppl_low": float(lo), "ppl_high": float(hi),
               "peak_bytes": float(g["peak_bytes"].mean()), "seconds_per_token": float(g["seconds"].sum() / g["tokens"].sum())}
        f = df[(df["policy"] == "full") & (df["budget"] == budget)]
        if len(f):
            fb = resampled(counts, per_window(f, "nll"), per_window(f, "tokens"))
            dlo, dhi = percentile_interval(boot - fb)
            row.update({"delta_ppl": row["ppl"] - perplexity(f["nll"].sum(), f["tokens"].sum()),
                        "delta_low": float(dlo), "delta_high": float(dhi),
                        "memory_saved": 1.0 - row["peak_bytes"] / float(f["peak_bytes"].mean()),
                        "time_ratio": row["seconds_per_token"] / float(f["seconds"].sum() / f["tokens"].sum())})
        rows.append(row)
    return pd.DataFrame(rows)


def summarize_answers(df: pd.DataFrame, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per (policy, budget): mean greedy agreement with the full cache (``match``) and mean first
    divergence, each with a 95 % bootstrap interval over examples, and the reference's perplexity
    (``exp(Σ NLL / Σ tokens)``) with its interval and its difference to the full cache's."""
    from attngeom.stats.resampling import percentile_interval, ratio_of_sums, resample_counts
    from attngeom.stats.resampling import perplexity as resampled

    examples = sorted(df["example"].unique())
    counts = resample_counts(len(examples), n_resamples, seed)
    rows = []
    for (policy, budget), g in df.groupby(["policy", "budget"], sort=True):
        g = g.set_index("example").loc[examples]
        ones = np.ones(len(g))
        row = {"policy": policy, "budget": int(budget), "examples": int(len(g))}
        for col in ("match", "first_divergence"):
            lo, hi = percentile_interval(ratio_of_sums(counts, g[col].to_numpy(float), ones))
            row.update({col: float(g[col].mean()), f"{col}_low": float(lo), f"{col}_high": float(hi)})
        boot = resampled(counts, g["ref_nll"].to_numpy(), g["ref_tokens"].to_numpy())
        lo, hi = percentile_interval(boot)
        row.update({"ref_ppl": perplexity(g["ref_nll"].sum(), g["ref_tokens"].sum()),
                    "ref_ppl_low": float(lo), "ref_ppl_high": float(hi)})
        f = df[(df["policy"] == "full") & (df["budget"] == budget)].set_index("example").loc[examples]
        fb = resampled(counts, f["ref_nll"].to_numpy(), f["ref_tokens"].to_numpy())
        dlo, dhi = percentile_interval(boot - fb)
        row.update({"ref_delta_ppl": row["ref_ppl"] - perplexity(f["ref_nll"].sum(), f["ref_tokens"].sum()),
                    "ref_delta_low": float(dlo), "ref_delta_high": float(dhi)})
        rows.append(row)
    return pd.DataFrame(rows)


def pairwise(df: pd.DataFrame, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Every pair of policies at every budget, on the same bootstrap resamples of the windows:
    ``ppl_a − ppl_b`` (pooled perplexities) with its 95 % interval, and ``a_better``, the share of
    resamples where ``a`` has the lower perplexity (``full`` included)."""
    from attngeom.stats.resampling import percentile_interval, resample_counts
    from attngeom.stats.resampling import perplexity as resampled

    windows = sorted(df["window"].unique())
    counts = resample_counts(len(windows), n_resamples, seed)
    rows = []
    for budget, g in df.groupby("budget", sort=True):
        boots, ppl = {}, {}
        for policy, h in g.groupby("policy"):
            h = h.set_index("window").loc[windows]
            boots[policy] = resampled(counts, h["nll"].to_numpy(), h["tokens"].to_numpy())
            ppl[policy] = perplexity(h["nll"].sum(), h["tokens"].sum())
        for a in sorted(boots):
            for b in sorted(boots):
                if a != b:
                    lo, hi = percentile_interval(boots[a] - boots[b])
                    rows.append({"budget": int(budget), "a": a, "b": b, "delta_ppl": ppl[a] - ppl[b],
                                 "delta_low": float(lo), "delta_high": float(hi),
                                 "a_better": float(np.mean(boots[a] < boots[b]))})
    return pd.DataFrame(rows)
