"""Compression once after the prefill, to a compression ratio: the protocol the field scores
KV-cache compression by (kvpress's pipeline, its RULER leaderboard; docs/kvcache.md).

**The protocol.** A long *context* is read in one forward pass (the prefill) with the full cache;
the cache is then compressed once, per layer and key/value head, to ``n − ⌊n·ratio⌋`` of its ``n``
entries (``ratio``: the share removed, kvpress's ``compression_ratio``); the *question*, which is not
compressed, and the greedy answer are then decoded with the compressed cache. In the *query-aware*
mode (:data:`QUERY_AWARE`) the question is part of the prefill and is compressed with the context;
the answer's first token then comes from the prefill itself. That mode favours scores read from the
last queries (SnapKV's observation window sees the question) and is reported separately.

**One captured prefill serves every policy.** Policies differ in their scores, not in the forward
pass: the prefill runs once inside a :class:`~attngeom.capture.Session` whose observer
:class:`PrefillScores` sums every policy's scores (:meth:`~attngeom.kvcache.policies.Policy.step`)
from the same blocks; each (policy, ratio) then costs only its selection
(:func:`~attngeom.kvcache.cache.kept_entries`), the question and the answer. Each variant gets a
cache of its own (:func:`variant_cache` of one selection; several selections can also share one
cache, a batch row each, padded to the largest head among them), and the variants' caches are
decoded as one batch (:func:`greedy_answers`: each row attends over its own cache, the model's other
operations read every row at once), so the grid's decoding is one batched pass per token instead of
one ``generate`` per variant.

**Memory is freed**, not masked: each variant's kept keys and values are gathered into new storages
of its kept size (:class:`~attngeom.kvcache.cache.CompressedLayer`); in a layer whose heads keep
different numbers of entries (AdaKV) they are padded to the largest (and, in a cache of several
rows, to the largest among the rows), and :func:`variant_cache` reports both the entries kept and
the bytes held.

What belongs here: the prefill, the selection at a ratio, the variants' cache and their greedy
answers. Not here: the scores (:mod:`attngeom.kvcache.policies`), the tasks (:mod:`attngeom.kvcache.ruler`),
the experiment over examples (:mod:`attngeom.kvcache.tasks`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache

from attngeom.capture import Session
from attngeom.generation.decoding import model_stop_ids
from attngeom.kvcache.cache import (CompressedLayer, cache_bytes, cached_forward, compressing, kept_entries, pool_heads,
                                    stacked)
from attngeom.kvcache.policies import EvictionContext, Policy, full, get_policy
from attngeom.metrics import formulas
from attngeom.model.arguments import takes_handle
from attngeom.runs.contract import ModelHandleLike

QUESTION_AGNOSTIC = "question-agnostic"
"""The context alone is compressed; the question is read after it with the compressed cache."""

QUERY_AWARE = "query-aware"
"""The question is read in the prefill and compressed with the context."""

MODES = (QUESTION_AGNOSTIC, QUERY_AWARE)

LOGIT_ROWS = 4
"""Positions whose logits a forward pass of several tokens computes, when only the last one is read:
4, not 1, so that the output layer's matrix product still has at least 4 rows, as over the whole
sequence (a BLAS may compute a lone row, a matrix-vector product, in another summation order: its
logits would then differ in their last bits from the whole sequence's)."""

NO_EVICTION = 1 << 62
"""The budget of a compressed layer after the compression: nothing more is evicted while the
question and the answer are read."""


def kept_count(n: int, ratio: float) -> int:
    """Entries a head keeps of ``n`` at compression ratio ``ratio`` (kvpress's rule): ``n − ⌊n·ratio⌋``."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"a compression ratio is in [0, 1), got {ratio}")
    return n - int(n * ratio)


# --------------------------------------------------------------------------------------------
# The prefill
# --------------------------------------------------------------------------------------------


class PrefillScores:
    """Observer summing every policy's scores of one forward pass: ``scores[name][layer]``
    ``[B, H, n]`` (policies whose ``needs`` is None record nothing). Policies whose
    :meth:`~attngeom.kvcache.policies.Policy.step` reads the same thing (the same ``needs``,
    ``signed`` and ``last``) share one sum."""

    def __init__(self, policies: Sequence[Policy], n_queries: int):
        self.policies = [p for p in policies if p.needs is not None]
        self.n_queries = int(n_queries)
        self.sums: dict[tuple, tuple[Policy, dict[int, torch.Tensor]]] = {}
        for p in self.policies:
            self.sums.setdefault(self.reads(p), (p, {}))
        self.w_o: dict[int, torch.Tensor] = {}

    @staticmethod
    def reads(p: Policy) -> tuple:
        """What ``p.step`` reads from a block (a policy with a ``step`` of its own: its own sum)."""
        if type(p).step is not Policy.step:
            return "own", p.name
        return p.needs, p.signed, p.last

    @property
    def scores(self) -> dict[str, dict[int, torch.Tensor]]:
        return {p.name: self.sums[self.reads(p)][1] for p in self.policies}

    def observe(self, block) -> None:
        self.w_o.setdefault(block.layer, block.state.w_o)
        for p, per_layer in self.sums.values():
            s = p.step(block, self.n_queries)
            if s is None:
                continue
            if block.layer not in per_layer:
                B, H = s.shape[:2]
                per_layer[block.layer] = torch.zeros(B, H, block.state.num_sources, device=s.device)
            per_layer[block.layer][..., block.k_start : block.k_start + s.shape[-1]] += s.float()


class ReconstructionScores:
    """Observer of one pass of KVzip's reconstruction (:func:`reconstruction_scores`): the pass's
    queries read the cache of the ``n`` context entries, then their own tokens; the attention of
    each query is renormalised over the entries kvpress's ``KVzipPress`` computes it over (the
    ``sink`` first entries, the chunk ``[start, end)`` being repeated and the pass's own tokens),
    and ``scores[kind][layer] [B, H, end − start]`` keeps, per entry of the chunk, the largest
    score any query gives it: for each ``kind`` of :data:`~attngeom.kvcache.policies.RECONSTRUCTION_SCORES`,
    the renormalised attention ``ã_ij^h``, ``ã_ij^h ‖W_O^h v_j‖₂ / ‖h_i‖₂`` (KVzip+; ``h_norms[layer]
    [B, T]`` the attention input's norms, from :func:`attention_input_norms`), or the contribution
    ``|⟨ã_ij^h W_O^h v_j, õ_i^h⟩| / ‖õ_i^h‖²`` of the renormalised head output
    ``õ_i^h = Σ_j ã_ij^h W_O^h v_j`` (SPEC §2)."""

    def __init__(self, n: int, start: int, end: int, sink: int, kinds: Sequence[str], h_norms: dict | None = None):
        self.n, self.start, self.end, self.sink = int(n), int(start), int(end), int(sink)
        self.kinds = tuple(kinds)
        self.h_norms = h_norms if h_norms is not None else {}
        self.scores: dict[str, dict[int, torch.Tensor]] = {k: {} for k in self.kinds}

    def observe(self, block) -> None:
        S = block.a.shape[-1]
        lo, hi = self.start - block.k_start, self.end - block.k_start        # the chunk in the block's sources
        if hi <= 0 or lo >= S:
            return
        lo, hi = max(lo, 0), min(hi, S)
        cols = self._inside(block.k_start, S)                             # the entries the softmax is over
        a = torch.cat([block.a[..., c0:c1] for c0, c1 in cols], dim=-1).float()
        a /= a.sum(-1, keepdim=True).clamp_min(1e-38)                     # the softmax over those entries
        at = sum(c1 - c0 for c0, c1 in cols if c1 <= lo)                  # where the chunk sits among them
        chunk = a[..., at : at + hi - lo]
        for kind in self.kinds:
            if kind == "attention":
                m = chunk
            elif kind == "kvzip_plus":
                wov = block.value_norm[..., lo:hi]                            # ‖W_O^h v_j‖ [B, H, S']
                q0 = block.q_start - self.n                                   # the pass's queries follow the context
                h = self.h_norms[block.layer][:, q0 : q0 + a.shape[2]]                    # [B, Q]
                m = chunk * wov[:, :, None, :] / h[:, None, :, None]
            else:      # |c̃_ij^h| of the renormalised head output, in head space: ⟨W_O^h v_j, õ_i^h⟩ = ũ_i^h G^h · v_j
                v = torch.cat([block.group_values[:, :, c0:c1] for c0, c1 in cols], dim=-2)
                u = formulas.head_output(a, v)                            # [B, H, Q, d]
                m = formulas.contribution(chunk, u, block.v[:, :, lo:hi], block.state.G).abs()
            m = m.amax(2)
            per_layer = self.scores[kind]
            if block.layer not in per_layer:
                per_layer[block.layer] = torch.zeros(m.shape[0], m.shape[1], self.end - self.start, device=m.device)
            seg = per_layer[block.layer][..., block.k_start + lo - self.start : block.k_start + hi - self.start]
            torch.maximum(seg, m, out=seg)

    def _inside(self, k_start: int, S: int) -> list[tuple[int, int]]:
        """The block's source columns ``[c0, c1)`` the renormalised softmax is over: the sinks, the
        chunk and the pass's own tokens (positions ``n`` on), those the block holds."""
        spans = [(0, self.sink), (self.start, self.end), (self.n, k_start + S)]
        return [(max(p0 - k_start, 0), min(p1 - k_start, S)) for p0, p1 in spans
                if min(p1 - k_start, S) > max(p0 - k_start, 0)]


def attention_input_norms(handle: ModelHandleLike):
    """A context manager recording ``‖h_i‖₂`` of every attention module's input (the normalised
    residual stream it reads, kvpress's ``hidden_states``): yields ``{layer: [B, T]}``, filled by the
    forward passes run inside."""
    import contextlib

    @contextlib.contextmanager
    def recording():
        norms: dict[int, torch.Tensor] = {}
        hooks = []

        def pre(layer):
            def hook(module, args, kwargs):
                h = kwargs.get("hidden_states", args[0] if args else None)
                norms[layer] = torch.linalg.vector_norm(h.float(), dim=-1)
            return hook

        try:
            for layer, module in handle.adapter.attention_modules.items():
                hooks.append(module.register_forward_pre_hook(pre(layer), with_kwargs=True))
            yield norms
        finally:
            for hk in hooks:
                hk.remove()

    return recording()


def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """``(prefix_ids, suffix_ids)``: what the chat template writes before a user message and after it
    up to the assistant's turn, found as kvpress's ``KVzipPress`` finds them (a dummy message);
    ``([], ids of "\\n")`` for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return [], tokenizer.encode("\n", add_special_tokens=False)
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    kwargs = {"enable_thinking": False}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], add_generation_prompt=True,
                                             tokenize=False, **kwargs)
    context, suffix = rendered.split(separator)
    prefix = context.split(dummy)[0]
    return tokenizer.encode(prefix, add_special_tokens=False), tokenizer.encode(suffix, add_special_tokens=False)


def reconstruction_requests(tokenizer, ids: Sequence[int]) -> tuple[int, list[tuple[int, int, list[int]]]]:
    """KVzip's reconstruction passes over the context ``ids``, as kvpress's ``KVzipPress.prepare``
    makes them: ``(prefix, [(start, end, request), ...])``. ``prefix``: the chat template's tokens
    before the user message when ``ids`` begins with them (else 0); the rest is cut into chunks of
    :data:`~attngeom.kvcache.policies.KVZIP_CHUNK` tokens; chunk ``[start, end)``'s request is
    :data:`~attngeom.kvcache.policies.KVZIP_PROMPT` (later chunks: :data:`~attngeom.kvcache.policies.KVZIP_PROMPT_NEXT`
    and the last :data:`~attngeom.kvcache.policies.KVZIP_OVERLAP` tokens of the chunk before), the
    template's turn suffix (``"\\n"`` without a template), then the chunk's tokens."""
    from attngeom.kvcache.policies import KVZIP_CHUNK, KVZIP_OVERLAP, KVZIP_PROMPT, KVZIP_PROMPT_NEXT

    ids = list(ids)
    prefix_ids, suffix_ids = chat_frame(tokenizer)
    prefix = len(prefix_ids) if prefix_ids and ids[: len(prefix_ids)] == prefix_ids else 0
    if not prefix:
        suffix_ids = tokenizer.encode("\n", add_special_tokens=False)
    first = tokenizer.encode(KVZIP_PROMPT, add_special_tokens=False)
    later = tokenizer.encode(KVZIP_PROMPT_NEXT, add_special_tokens=False)
    out = []
    for start in range(prefix, len(ids), KVZIP_CHUNK):
        end = min(start + KVZIP_CHUNK, len(ids))
        ask = first if start == prefix else later + ids[max(prefix, start - KVZIP_OVERLAP) : start]
        out.append((start, end, ask + suffix_ids + ids[start:end]))
    return prefix, out


@takes_handle
def reconstruction_scores(handle: ModelHandleLike, cache: DynamicCache, ids: Sequence[int],
                          kinds: Sequence[str] = ("attention",)) -> dict[str, dict[int, torch.Tensor]]:
    """KVzip's scores (:func:`~attngeom.kvcache.policies.kvzip`), per kind of
    :data:`~attngeom.kvcache.policies.RECONSTRUCTION_SCORES`: ``{kind: {layer: [B, H, n]}}``. Each
    request of :func:`reconstruction_requests` is read with (a copy of) the prefill's full
    ``cache`` of the context ``ids`` (:class:`ReconstructionScores`); the first
    :data:`~attngeom.kvcache.policies.KVZIP_SINKS` entries score 1 (kvpress's ``n_sink``; a
    context without a chat prefix repeats them with the first chunk, which scores them), the
    template's other prefix entries 0."""
    import copy

    from attngeom.kvcache.policies import KVZIP_SINKS

    n = len(ids)
    prefix, requests = reconstruction_requests(handle.tokenizer, ids)
    out = {k: {} for k in kinds}
    for start, end, request in requests:
        scorer = ReconstructionScores(n, start, end, min(KVZIP_SINKS, start), kinds)
        again = DynamicCache(config=handle.model.config)
        again.layers = [copy.copy(lay) for lay in cache.layers]
        norms = attention_input_norms(handle) if "kvzip_plus" in kinds else contextlib.nullcontext({})
        with norms as h_norms, compressing(handle.model, again, session=Session(observers=[scorer])):
            scorer.h_norms = h_norms
            cached_forward(handle, again, torch.as_tensor([request]), last=1)   # the scores are read, not the logits
        for kind, per_layer in scorer.scores.items():
            for layer, m in per_layer.items():
                if layer not in out[kind]:
                    out[kind][layer] = torch.zeros(m.shape[0], m.shape[1], n, device=m.device)
                    out[kind][layer][..., :KVZIP_SINKS] = 1.0
                out[kind][layer][..., start:end] = m
    return out


@dataclass
class Prefill:
    """One example's prefill: the full ``cache`` (batch 1), the last row's float32 ``logits [V]``,
    every policy's ``scores[name][layer] [1, H, n]``, each layer's output projection ``w_o[layer]``
    (when scores were recorded), ``n`` tokens read, and ``seconds``. ``value_l1[layer]``: CriticalKV's
    value norms (:func:`~attngeom.kvcache.policies.projected_value_l1`), once a selection computed them."""

    cache: DynamicCache
    logits: torch.Tensor
    scores: dict[str, dict[int, torch.Tensor]]
    w_o: dict[int, torch.Tensor]
    n: int
    seconds: float
    value_l1: dict[int, torch.Tensor] = field(default_factory=dict)


@takes_handle
@torch.no_grad()
def prefill(handle: ModelHandleLike, ids: Sequence[int], policies: Sequence[Policy]) -> Prefill:
    """Read ``ids`` in one forward pass with a full ``DynamicCache``; when any of ``policies`` reads
    scores, inside a session whose :class:`PrefillScores` records all of them at once."""
    import time

    scorer = PrefillScores(policies, len(ids))
    session = Session(observers=[scorer]) if any(p.needs or p.prefill_only for p in policies) else None
    cache = DynamicCache(config=handle.model.config)
    t0 = time.perf_counter()
    with compressing(handle.model, cache, session=session):
        logits = cached_forward(handle, cache, torch.as_tensor([list(ids)]), last=LOGIT_ROWS)[0, -1]
    scores = scorer.scores
    kinds = {p.params["score"] for p in policies if p.needs == "reconstruction"}
    if kinds:
        again = reconstruction_scores(handle, cache, ids, sorted(kinds))
        scores.update({p.name: again[p.params["score"]] for p in policies if p.needs == "reconstruction"})
    return Prefill(cache, logits, scores, scorer.w_o, len(ids), time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# Selection at a ratio
# --------------------------------------------------------------------------------------------


def eviction_context(pre: Prefill, policy: Policy, layer: int, num_heads: int) -> EvictionContext:
    """What ``policy`` sees when it compresses layer ``layer`` of the prefill's cache (every entry valid)."""
    lay = pre.cache.layers[layer]
    B, n_kv, n, _ = lay.keys.shape
    pos = torch.arange(n, device=lay.keys.device).expand(B, n_kv, n)
    rec = pre.scores.get(policy.name, {}).get(layer)
    score = pool_heads(rec, n_kv, policy.pool) if rec is not None else torch.zeros(B, n_kv, n, device=pos.device)
    return EvictionContext(pos=pos, valid=torch.ones_like(pos, dtype=torch.bool), score=score, values=lay.values,
                           seen=n, budget=torch.full((n_kv,), n, dtype=torch.long), keys=lay.keys, layer=layer,
                           num_heads=num_heads, w_o=pre.w_o.get(layer), value_l1=pre.value_l1.get(layer))


def compressible_layers(cache: DynamicCache) -> list[int]:
    """The layers a compression ratio applies to: full-attention layers (a sliding-window layer of a
    hybrid model already holds a bounded window)."""
    return [l for l, lay in enumerate(cache.layers) if not getattr(lay, "is_sliding", False)]


@dataclass
class Selection:
    """One variant's kept entries per compressible layer: ``idx[layer]``, ``ok[layer]`` ``[1, Hkv, K]``
    (indices into the prefill's entries in position order; ``ok`` False for padding)."""

    idx: dict[int, torch.Tensor]
    ok: dict[int, torch.Tensor]

    def kept(self) -> int:
        """Entries kept over all compressed layers and heads."""
        return int(sum(int(o.sum()) for o in self.ok.values()))


def selection_at_ratio(pre: Prefill, policy: Policy | str, ratio: float, num_heads: int) -> Selection:
    """The entries ``policy`` keeps at ``ratio``: per layer and key/value head, the budget of
    :meth:`~attngeom.kvcache.policies.Policy.allocate` (``n − ⌊n·ratio⌋`` each unless the policy
    allocates otherwise), ranked by the policy's tier and score (:func:`~attngeom.kvcache.cache.kept_entries`)."""
    policy = get_policy(policy) if isinstance(policy, str) else policy
    layers = compressible_layers(pre.cache)
    contexts = {l: eviction_context(pre, policy, l, num_heads) for l in layers}
    budgets = policy.allocate(contexts, ratio)
    idx, ok = {}, {}
    for l in layers:
        ctx = contexts[l]
        ctx.budget = budgets[l]
        idx[l], ok[l] = kept_entries(policy, ctx, budgets[l])
        if ctx.value_l1 is not None:                           # the same at every ratio: computed once
            pre.value_l1[l] = ctx.value_l1
    return Selection(idx, ok)


# --------------------------------------------------------------------------------------------
# The variants' cache
# --------------------------------------------------------------------------------------------


def _gathered(t: torch.Tensor, idx: torch.Tensor, room: int = 0) -> torch.Tensor:
    """The entries ``idx [R, Hkv, K]`` of ``t [1, Hkv, n, d]``, per row and head, in a storage with
    room for ``room`` more entries per head: ``[R, Hkv, K + room, d]``, whose last ``room`` entries
    are placeholders (copies of the head's first entry, ``K = 0`` included) for later tokens to overwrite. Each entry's ``d`` values
    are copied at once (``index_select`` over the entries, not ``gather``), straight into the storage
    the cache keeps (no second copy)."""
    _, H, n, d = t.shape
    start = torch.arange(H, device=idx.device).reshape(1, H, 1) * n           # each head's first entry
    entries = idx + start
    if room:
        entries = torch.cat([entries, start.expand(*entries.shape[:-1], room)], dim=-1)
    return t.reshape(H * n, d).index_select(0, entries.reshape(-1)).reshape(*entries.shape, d)


def _padded(ts: Sequence[torch.Tensor], K: int, fill) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(t, (0, K - t.shape[-1]), value=fill) for t in ts], dim=0)


class PrefilledLayer(CompressedLayer):
    """A full-attention layer after the compression: the kept entries at positions ``pos [B, Hkv, K]``
    (``valid`` False on padding), their keys and values the first ``K`` entries of the storages
    ``keys, values [B, Hkv, K + room, d]`` (:func:`_gathered`), then every later token appended in
    place (room for ``room`` more, doubling past it: :class:`~attngeom.capture.GrowingTensor`),
    nothing evicted. ``seen``: tokens read before (the next token's position)."""

    def __init__(self, keys, values, pos, valid, seen: int, num_heads: int, room: int = 0):
        from attngeom.capture import GrowingTensor

        K = pos.shape[2]
        if keys.shape[2] != K + int(room) or values.shape[2] != K + int(room):
            raise ValueError(f"keys and values need storages of {K} + {room} entries, got {keys.shape[2]} and {values.shape[2]}")
        if keys.untyped_storage().data_ptr() == values.untyped_storage().data_ptr():
            raise ValueError("keys and values need storages of their own: later tokens are appended into both in place")
        super().__init__(full(), [NO_EVICTION] * keys.shape[1], num_heads)
        self.lazy_initialization(keys, values)
        self._grow = {name: GrowingTensor.holding(2, t, K) for name, t in (("keys", keys), ("values", values))}
        self._grow.update({name: GrowingTensor(2, K + int(room)) for name in ("pos", "valid")})
        self._has_padding = valid is not None
        for name, t in (("pos", pos), ("valid", valid)):
            if t is not None:
                self._grow[name].append(t)
        self._views()
        self.seen = int(seen)

    def _views(self) -> None:
        self.keys, self.values, self.pos = (self._grow[n].tensor for n in ("keys", "values", "pos"))
        self.valid = self._grow["valid"].tensor if self._has_padding else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        B, n_kv, C, _ = key_states.shape
        new_pos = torch.arange(self.seen, self.seen + C, device=key_states.device).expand(B, n_kv, C)
        self._grow["keys"].append(key_states)
        self._grow["values"].append(value_states)
        self._grow["pos"].append(new_pos)
        if self._has_padding:
            self._grow["valid"].append(torch.ones_like(new_pos, dtype=torch.bool))
        self._views()
        self.seen += C
        self.n_new = C
        return self.keys, self.values

    def _map_batch(self, fn) -> None:
        for g in self._grow.values():
            g.map_storage(fn)
        self._views()


@takes_handle
def variant_cache(handle: ModelHandleLike, pre: Prefill, selections: Sequence[Selection], room: int = 0) -> DynamicCache:
    """A cache of ``len(selections)`` batch rows, row ``r`` holding the prefill's entries that
    ``selections[r]`` keeps in each compressible layer (new storages, :class:`PrefilledLayer`; heads
    padded to the batch's largest, padding masked), and a copy of the prefill's other layers per
    row. Nothing more is evicted while it is used; ``room``: tokens it expects to read after (the
    question and the answer), preallocated."""
    R = len(selections)
    cache = DynamicCache(config=handle.model.config)
    layers = []
    for l, lay in enumerate(pre.cache.layers):
        if l not in selections[0].idx:
            copy = type(lay).__new__(type(lay))
            copy.__dict__.update(lay.__dict__)
            copy.keys, copy.values = lay.keys.repeat(R, 1, 1, 1), lay.values.repeat(R, 1, 1, 1)
            layers.append(copy)
            continue
        K = max(s.idx[l].shape[-1] for s in selections)
        idx = _padded([s.idx[l] for s in selections], K, 0)
        ok = _padded([s.ok[l] for s in selections], K, False)
        layers.append(PrefilledLayer(_gathered(lay.keys, idx, room), _gathered(lay.values, idx, room), idx,
                                     None if bool(ok.all()) else ok, pre.n, handle.num_heads, room))
    cache.layers = layers
    return cache


@takes_handle
def row_bytes(handle: ModelHandleLike, cache: DynamicCache) -> float:
    """Bytes of the cache's storages per batch row (padding included)."""
    return cache_bytes(cache) / _rows(cache)


def _rows(cache: DynamicCache) -> int:
    """The cache's batch rows."""
    return next(lay.keys.shape[0] for lay in cache.layers if lay.keys is not None)


# --------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------


@takes_handle
@torch.no_grad()
def greedy_answers(handle: ModelHandleLike, caches: DynamicCache | Sequence[DynamicCache], question: Sequence[int] | None,
                   first: torch.Tensor | None, max_new_tokens: int, settled=None) -> list[list[int]]:
    """Greedy answers of every batch row of ``caches`` (one cache, or several whose rows are read as
    one batch, each over its own cache: :func:`~attngeom.kvcache.cache.stacked`), in order: the
    ``question`` ids (the same for every row) are read first and the answer follows; or, with
    ``question=None`` (query-aware), the answer starts from ``first`` ``[V]`` logits (the prefill's
    last row). Each row stops at its first end-of-text token
    (:func:`~attngeom.generation.decoding.model_stop_ids`, not included), after ``max_new_tokens``,
    or once ``settled(tokens)`` says its answer so far is final for its use (a score that can no
    longer change)."""
    caches = [caches] if isinstance(caches, DynamicCache) else list(caches)
    R = sum(_rows(c) for c in caches)
    cache = stacked(caches)
    stops = set(model_stop_ids(handle))
    out: list[list[int]] = [[] for _ in range(R)]
    rows = list(range(R))                                   # the cache's rows still answering
    with compressing(handle.model, cache):
        if question is not None:
            ids = torch.as_tensor([list(question)]).expand(R, -1)
            logits = cached_forward(handle, cache, ids, last=LOGIT_ROWS)[:, -1]
        else:
            logits = first.reshape(1, -1).expand(R, -1)
        for t in range(max_new_tokens):
            nxt = logits.argmax(-1).tolist()
            going = [k for k, tok in enumerate(nxt) if tok not in stops]
            for k in going:
                out[rows[k]].append(nxt[k])
            if settled is not None:
                going = [k for k in going if not settled(out[rows[k]])]
            if not going or t + 1 == max_new_tokens:
                break
            if len(going) < len(rows):                      # finished rows leave the batch
                cache.batch_select_indices(torch.as_tensor(going, device=logits.device))
                rows = [rows[k] for k in going]
            ids = torch.as_tensor([[nxt[k]] for k in going], device=logits.device)
            logits = cached_forward(handle, cache, ids)[:, -1]
    return out
