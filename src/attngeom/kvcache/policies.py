"""KV-cache eviction policies (their scores: SPEC §9): one registry entry each, one uniform signature.

A policy answers two questions for the compressed cache of :mod:`attngeom.kvcache.cache`:

1. **What to record while the model runs** (``step``): from each attention :class:`~attngeom.capture.plugin.Block`
   of a forward pass, a score per query head and cached entry ``[B, H, S]`` summed over the
   queries the policy reads (all of them, or the last few). ``needs`` says whether the forward
   must run through the exact capture at all (``None``: no scores, plain SDPA), and whether the
   scores are accumulated over forward passes (``accumulate``, H2O-style) or replaced by the
   latest one (TOVA, SnapKV).
2. **Which entries to keep** (``priority(ctx) -> (tier, score)``, both ``[B, H_kv, n]``): the
   cache keeps, per key/value head, the entries with the highest ``tier`` first and, inside a
   tier, the highest ``score`` (ties: the earlier entry). Protected entries (attention sinks, the
   recent window) get a higher tier, so they count against the budget like any other entry.

Query heads sharing a key/value head (grouped-query attention) are pooled before ``priority``:
``pool = "mean"`` (the default: the mean of the group's query-head scores), ``"max"``, or
``"layer"`` (the mean over all heads of the layer: the same choice in every head, as TOVA does).

Every policy's docstring names its source; ``docs/kvcache.md`` lists the scores side by side.
torch is imported inside the functions that use it, so that the registry's names (the settings'
and ``--help``'s default policies) need no torch.
What belongs here: scores, protections and the taxonomy policy's per-head budgets
(:func:`taxonomy_budgets`). Not here: storage and eviction mechanics (:mod:`attngeom.kvcache.cache`),
evaluation (:mod:`attngeom.kvcache.evaluation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from attngeom.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    import torch

SINKS = 4
"""Protected attention-sink entries of StreamingLLM (its paper keeps 4 initial tokens)."""

RECENT = 0.5
"""Share of a head's budget kept as the recent window by H2O-style policies (H2O's equal split of
heavy hitters and recent tokens); the same split is used for VATP and the contribution policies
so that they differ from H2O only in the score."""

SNAP_WINDOW = 64
"""SnapKV's observation window: kvpress's ``SnapKVPress.window_size`` (the last 64 queries)."""

SNAP_KERNEL = 5
"""SnapKV's pooling kernel: kvpress's ``SnapKVPress.kernel_size`` (average pooling over 5 entries)."""


@dataclass
class EvictionContext:
    """What a policy sees at an eviction, per key/value head: ``pos [B, Hkv, n]`` absolute
    positions of the entries, ``valid [B, Hkv, n]`` bool (False: padding of a head with a smaller
    budget), ``score [B, Hkv, n]`` the recorded scores pooled over the query heads of each group,
    ``values [B, Hkv, n, d]``, ``seen`` tokens read so far, ``budget [Hkv]`` each head's budget."""

    pos: torch.Tensor
    valid: torch.Tensor
    score: torch.Tensor
    values: torch.Tensor
    seen: int
    budget: torch.Tensor
    streaming: torch.Tensor | None = None  # [Hkv] bool: heads given sink + window only (taxonomy)
    keys: torch.Tensor | None = None       # [B, Hkv, n, d] cached (RoPE-rotated) keys
    layer: int = -1                        # the cache layer
    num_heads: int = 0                     # query heads H
    w_o: torch.Tensor | None = None        # [D, H*d] the layer's output projection (float32), when recorded
    value_l1: torch.Tensor | None = None   # [B, Hkv, n] projected_value_l1 of these values, once computed

    def recent(self, count: torch.Tensor | int) -> torch.Tensor:
        """``[B, Hkv, n]`` bool: the entry is among the last ``count`` positions (per head)."""
        import torch

        count = torch.as_tensor(count, device=self.pos.device).reshape(1, -1, 1)
        return self.pos >= self.seen - count

    def sinks(self, count: int) -> torch.Tensor:
        return self.pos < count


POLICY_OPTIONS = ("needs", "accumulate", "pool", "last", "signed", "per_head_budgets", "prefill_only", "geometry")
"""What a policy may set besides its name, its ranking and its budget rule (class attributes of :class:`Policy`)."""


class Policy:
    """One eviction policy: its scores, its ranking and its budget rule (module docstring).

    A policy is a small class (kvpress's presses are): subclass it, give it a ``name``, say what
    :meth:`step` reads from a block (``needs``: ``"attention"``, ``"contribution"``, or your own
    word when you override :meth:`step`), and rank the entries in :meth:`priority`; override
    :meth:`allocate` for budgets other than the same ``n − ⌊n·ratio⌋`` in every head::

        class LastQueries(Policy):
            name, needs, last, accumulate = "last16", "attention", 16, False
            def priority(self, ctx):
                return ctx.sinks(4).long(), ctx.score

    ``attngeom kvtasks --policies mymodule:LastQueries`` and
    :func:`~attngeom.kvcache.tasks.compressed_generate` take it as it is (:func:`get_policy`).
    The toolkit's own policies are instances of this class made by the factories of
    :data:`POLICIES` (``Policy(name, doc, priority, allocator=..., params=..., **options)``).

    Attributes: ``needs`` None (no scores: plain SDPA), ``"attention"``, ``"contribution"``,
    ``"leave_one_out[_head]"`` or ``"reconstruction"`` (KVzip's pass); ``last``: :meth:`step`
    reads only the last ``last`` queries of the forward pass (None: all); ``accumulate``: scores
    summed over forward passes (H2O) or replaced by the latest (SnapKV); ``pool``: query heads of a
    key/value head pooled by ``"mean"``, ``"max"`` or ``"layer"``; ``signed``: contributions with
    their sign; ``per_head_budgets``: budgets from a head taxonomy; ``prefill_only``: defined only
    for compression once after a prefill; ``geometry``: derived from the papers' geometry."""

    name: str = ""
    doc: str = ""
    needs: str | None = None
    accumulate: bool = True
    pool: str = "mean"
    last: int | None = None
    signed: bool = False
    per_head_budgets: bool = False
    prefill_only: bool = False
    geometry: bool = False
    allocator: Callable[[dict, float], dict] | None = None

    def __init__(self, name: str | None = None, doc: str | None = None,
                 priority: Callable[[EvictionContext], tuple] | None = None, *,
                 allocator: Callable[[dict, float], dict] | None = None, params: dict | None = None, **options):
        if name is not None:
            self.name = name
        if doc is not None:
            self.doc = doc
        elif not self.doc:
            self.doc = (type(self).__doc__ or "").strip().split("\n")[0]
        if priority is not None:
            self._priority = priority
        if allocator is not None:
            self.allocator = allocator
        self.params = dict(params or {})
        for key, value in options.items():
            if key not in POLICY_OPTIONS:
                raise TypeError(f"unknown policy option {key!r}; a policy sets {', '.join(POLICY_OPTIONS)}")
            setattr(self, key, value)
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"{type(self).__name__}: a policy needs a name (a non-empty string)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def priority(self, ctx: EvictionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tier, score)``, both ``[B, Hkv, n]``: each head keeps its entries of highest tier first,
        then of highest score (ties: the earlier entry)."""
        fn = getattr(self, "_priority", None)
        if fn is None:
            raise NotImplementedError(f"{type(self).__name__} ranks no entries: define priority(self, ctx)")
        return fn(ctx)

    def allocate(self, contexts: dict[int, EvictionContext], ratio: float) -> dict:
        """Entries each key/value head keeps at compression ratio ``ratio``, per layer:
        ``{layer: [Hkv] long}``. Default: ``n − ⌊n·ratio⌋`` in every head (kvpress's rule);
        ``allocator`` (PyramidKV's layers, AdaKV's heads, KVzip's global cut) shares the same total otherwise."""
        if self.allocator is not None:
            return self.allocator(contexts, ratio)
        return {l: uniform_keep(ctx, ratio) for l, ctx in contexts.items()}

    def step(self, block, n_queries: int) -> torch.Tensor | None:
        """``[B, H, S]``: this block's scores summed over the queries the policy reads
        (block query ``i`` is query ``q_start + i`` of a forward pass of ``n_queries`` queries)."""
        if self.needs is None or self.needs == "reconstruction":  # reconstruction: recorded by its own pass
            return None
        first = 0 if self.last is None else max(0, max(0, n_queries - self.last) - block.q_start)
        if first >= block.a.shape[2]:
            return None
        if self.needs == "contribution":
            m = block.contribution[:, :, first:]
            m = m if self.signed else m.abs()
        elif self.needs in ("leave_one_out", "leave_one_out_head"):
            from attngeom.metrics.leave_one_out import leave_one_out

            m = leave_one_out(block, head_space=self.needs == "leave_one_out_head", first=first) ** 2
        elif self.needs == "attention":
            m = block.a[:, :, first:]
        else:
            raise NotImplementedError(f"{type(self).__name__} needs {self.needs!r}: define step(self, block, n_queries)")
        return m.sum(2)


def uniform_keep(ctx: EvictionContext, ratio: float) -> "torch.Tensor":
    """``[Hkv]``: ``n − ⌊n·ratio⌋`` entries in every key/value head (kvpress's rule)."""
    import torch

    n = int(ctx.valid.sum(-1).max())
    return torch.full((ctx.valid.shape[1],), n - int(n * ratio), dtype=torch.long)


def _tiers(*levels: torch.Tensor) -> torch.Tensor:
    """Tier per entry: the number of protections it has (``levels`` bool maps)."""
    import torch

    out = torch.zeros_like(levels[0], dtype=torch.int64)
    for lv in levels:
        out = out + lv.long()
    return out


def _recent_count(ctx: EvictionContext, share: float) -> torch.Tensor:
    return (ctx.budget.float() * share).long()


# --------------------------------------------------------------------------------------------
# The policies
# --------------------------------------------------------------------------------------------


def full() -> Policy:
    """The full cache: nothing is evicted (the reference)."""
    import torch

    return Policy("full", "full cache (no eviction)", lambda ctx: (torch.zeros_like(ctx.pos), ctx.pos.float()))


def window() -> Policy:
    """Recent window: keep the last ``budget`` tokens (the sliding-window baseline of StreamingLLM:
    Xiao et al., *Efficient Streaming Language Models with Attention Sinks*, ICLR 2024)."""
    import torch

    return Policy("window", "the most recent tokens", lambda ctx: (torch.zeros_like(ctx.pos), ctx.pos.float()))


def streamingllm(sinks: int = SINKS) -> Policy:
    """StreamingLLM (Xiao et al., *Efficient Streaming Language Models with Attention Sinks*, ICLR
    2024): the first ``sinks`` tokens (attention sinks) plus the most recent tokens."""
    return Policy("streamingllm", f"{sinks} sink tokens + recent window",
                  lambda ctx: (_tiers(ctx.sinks(sinks)), ctx.pos.float()), params={"sinks": sinks})


def h2o(recent: float = RECENT) -> Policy:
    """H2O (Zhang et al., *H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models*, NeurIPS 2023): heavy hitters by attention accumulated over every query that
    saw the entry, plus a recent window (``recent`` of the budget)."""
    return Policy("h2o", "accumulated attention + recent window",
                  lambda ctx: (_tiers(ctx.recent(_recent_count(ctx, recent))), ctx.score),
                  needs="attention", params={"recent": recent})


def tova() -> Policy:
    """TOVA (Oren et al., *Transformers are Multi-State RNNs*, EMNLP 2024): the current query's
    attention (the last query of the forward pass), averaged over the layer's heads as the paper
    does (the same entries are kept in every head of a layer); no protected entries."""
    import torch

    return Policy("tova", "current query's attention (layer mean)", lambda ctx: (torch.zeros_like(ctx.pos), ctx.score),
                  needs="attention", accumulate=False, pool="layer", last=1)


def _avg_pool(score: torch.Tensor, valid: torch.Tensor, kernel: int, window: torch.Tensor | None = None) -> torch.Tensor:
    """1-D average pooling over the entries (kept in position order), as SnapKV's code and kvpress's
    ``SnapKVPress`` pool: each entry gets the mean of the ``kernel`` scores centred on it, the
    observation ``window`` (bool ``[B, H, n]``), padding and the ends counted as zeros (the
    window's own entries are kept whatever their score; kvpress pools the scores with the window
    cut off and zero padding, ``avg_pool1d`` counting the padding)."""
    import torch

    drop = ~valid if window is None else ~valid | window
    x = score.float().masked_fill(drop, 0.0)
    B, H, n = x.shape
    y = torch.nn.functional.avg_pool1d(x.reshape(B * H, 1, n), kernel, stride=1, padding=kernel // 2,
                                       count_include_pad=True)
    return y.reshape(B, H, -1)[..., :n]


def snapkv(window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL) -> Policy:
    """SnapKV (Li et al., *SnapKV: LLM Knows What You are Looking for Before Generation*, NeurIPS
    2024), as kvpress's ``SnapKVPress``: the attention of the last ``window`` queries (the
    observation window) summed, average-pooled over neighbouring entries (kernel ``kernel``,
    :func:`_avg_pool`), plus the observation window itself. Made for the prompt; when reading token
    by token the observation window is the last forward pass's queries (at most ``window``)."""
    return Policy("snapkv", f"observation window {window}, average pool {kernel}",
                  lambda ctx: _snap_priority(ctx, window, kernel),
                  needs="attention", accumulate=False, last=window, params={"window": window, "kernel": kernel})


def vatp(recent: float = RECENT, sinks: int = 1) -> Policy:
    """VATP (Guo et al., *Attention Score is not All You Need for Token Importance Indicator in KV
    Cache Reduction: Value Also Matters*, EMNLP 2024): accumulated attention times the value's
    ℓ1 norm ``‖v_j‖₁`` of the key/value head, on top of H2O's recent window; the first ``sinks``
    tokens are kept (the paper leaves attention-sink tokens out of the value-norm weighting)."""

    def priority(ctx):
        score = ctx.score * ctx.values.float().abs().sum(-1)
        return _tiers(ctx.recent(_recent_count(ctx, recent)), ctx.sinks(sinks)), score

    return Policy("vatp", "accumulated attention x |v|_1 + recent window", priority, needs="attention",
                  params={"recent": recent, "sinks": sinks})


def contribution(recent: float = RECENT, signed: bool = False) -> Policy:
    """Contribution (this toolkit; Cunningham & Muca Cirone, *Contribution Weights*): the intra-head
    contribution ``c_ij^h = ⟨a_ij ṽ_j^h, o_i^h⟩ / ‖o_i^h‖²`` (SPEC §2) accumulated over the queries
    that saw the entry, with H2O's recent window. ``signed=False`` (``contribution``) accumulates
    ``|c_ij^h|``: dropping an entry changes the head output along its direction by ``c_ij^h`` either
    way, so a suppressor (negative contribution, e.g. a sink) matters as much as an adder.
    ``signed=True`` (``contribution_signed``) accumulates ``c_ij^h`` itself, so suppressors rank
    last — shown for comparison."""
    name = "contribution_signed" if signed else "contribution"
    return Policy(name, ("accumulated signed" if signed else "accumulated |") + " intra-head contribution + recent window",
                  lambda ctx: (_tiers(ctx.recent(_recent_count(ctx, recent))), ctx.score),
                  needs="contribution", signed=signed, params={"recent": recent}, geometry=True)


def taxonomy(recent: float = RECENT, sinks: int = SINKS) -> Policy:
    """Taxonomy-aware per-head budgets (this toolkit's head taxonomy, SPEC §6, after Mudarisov et
    al.; the idea of per-head streaming/retrieval choices is DuoAttention's: Xiao et al.,
    *DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads*, ICLR
    2025). Key/value heads with a Retriever query head keep a large budget and evict like H2O;
    Mixer/Reset heads keep ``sinks`` sink tokens + a recent window in a small budget
    (:func:`taxonomy_budgets`: the layer's total equals ``H_kv × budget``)."""
    import torch


    def priority(ctx):
        streaming = ctx.streaming if ctx.streaming is not None else torch.zeros_like(ctx.budget, dtype=torch.bool)
        s = streaming.reshape(1, -1, 1)
        # streaming heads: sinks first, then the most recent; the others: H2O's window, then the score
        tier = torch.where(s, 2 * ctx.sinks(sinks).long(), _tiers(ctx.recent(_recent_count(ctx, recent))))
        return tier, torch.where(s, ctx.pos.float(), ctx.score)

    return Policy("taxonomy", "Retriever heads large (H2O), Mixer/Reset sink + window", priority, needs="attention",
                  per_head_budgets=True, params={"recent": recent, "sinks": sinks})


# --------------------------------------------------------------------------------------------
# Baselines of compression once after the prefill (kvpress's presses; docs/kvcache.md)
# --------------------------------------------------------------------------------------------

RANDOM_SEED = 0
PYRAMID_BETA = 20
"""PyramidKV's β (kvpress's ``beta``): the last compressed layer keeps ``1/β`` of the mean budget."""
CRITICAL_FIRST_STAGE = 0.5
"""CriticalKV's share of the budget chosen by the attention score alone (its first stage)."""
ADAKV_FLOOR = 0.2
"""AdaKV's safeguard: every head keeps at least this share of the uniform budget."""


def random_policy(seed: int = RANDOM_SEED) -> Policy:
    """Random: each entry a seeded uniform score (per layer; the floor every policy must beat)."""
    import torch

    def priority(ctx):
        g = torch.Generator().manual_seed(seed * 100_003 + ctx.layer)
        return torch.zeros_like(ctx.pos), torch.rand(ctx.pos.shape, generator=g).to(ctx.pos.device)

    return Policy("random", "seeded random scores", priority, params={"seed": seed})


def knorm() -> Policy:
    """Key norm (Devoto et al., *A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression*, EMNLP 2024): keep the entries whose keys have the smallest ℓ2 norm (RoPE keeps the
    norm, so the cached key's norm is the key's). Needs no attention."""
    import torch

    return Policy("knorm", "smallest key norm", lambda ctx: (torch.zeros_like(ctx.pos), -ctx.keys.float().norm(dim=-1)))


def _snap_priority(ctx, window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL, score=None):
    """SnapKV's ranking: the observation window first, then the average-pooled ``score`` (default ``ctx.score``)."""
    recent = ctx.recent(window)
    return _tiers(recent), _avg_pool(ctx.score if score is None else score, ctx.valid, kernel, recent)


def pyramid_budgets(contexts: dict, ratio: float, beta: float = PYRAMID_BETA, window: int = SNAP_WINDOW) -> dict:
    """PyramidKV's layer budgets (Cai et al., *PyramidKV: Dynamic KV Cache Compression based on
    Pyramidal Information Funneling*, 2024), as kvpress's ``PyramidKVPress.get_layer_budget``
    computes them: with ``k = n·(1 − ratio)`` (a float), the budgets fall linearly from
    ``2k − k/β`` (the first compressed layer) to ``k/β`` (the last), so their mean is ``k``, each
    rounded; where the first would exceed ``n − w`` (``w`` the observation window), it is
    ``n − w`` and the last ``2k − (n − w)``. When the budgets would not satisfy
    ``n ≥ first ≥ last ≥ w`` (a budget smaller than the window: ``k/β < w``), every layer keeps
    ``round(k)``: uniform SnapKV (kvpress's fallback)."""
    import torch

    layers = sorted(contexts)
    ctx0 = contexts[layers[0]]
    n = int(ctx0.valid.sum(-1).max())
    k = n * (1 - ratio)
    lo = k / beta
    hi = 2 * k - lo
    if hi >= n - window:
        hi = n - window
        lo = 2 * k - hi
    if len(layers) == 1 or not n >= hi >= lo >= window:
        return {l: torch.full((contexts[l].valid.shape[1],), round(k), dtype=torch.long) for l in layers}
    step = (hi - lo) / (len(layers) - 1)
    return {l: torch.full((contexts[l].valid.shape[1],), round(hi - m * step), dtype=torch.long)
            for m, l in enumerate(layers)}


def pyramidkv(window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL, beta: float = PYRAMID_BETA) -> Policy:
    """PyramidKV (Cai et al., 2024): SnapKV's scores with layer budgets falling with depth
    (:func:`pyramid_budgets`: the same total memory as a uniform budget)."""
    return Policy("pyramidkv", f"SnapKV scores, layer budgets falling linearly (beta {beta})",
                  lambda ctx: _snap_priority(ctx, window, kernel), needs="attention", accumulate=False, last=window,
                  params={"window": window, "kernel": kernel, "beta": beta}, prefill_only=True,
                  allocator=lambda cs, r: pyramid_budgets(cs, r, beta, window))


VALUE_L1_CHUNK = 64
"""Entries whose projected values :func:`projected_value_l1` computes at once (their ``W_O^h v`` of
every query head stays in the CPU's cache: twice as fast as one product over all entries, measured)."""


def projected_value_l1(ctx: EvictionContext) -> "torch.Tensor":
    """``[B, Hkv, n]``: ``‖W_O^h v_j‖₁`` of each entry, averaged over the query heads ``h`` of its
    key/value head (CriticalKV's value term; ``W_O^h`` the columns of head ``h``); kept in ``ctx.value_l1``."""
    import torch

    if ctx.value_l1 is None:
        D = ctx.w_o.shape[0]
        B, n_kv, n, d = ctx.values.shape
        H = ctx.num_heads
        w = ctx.w_o.reshape(D, H, d).permute(1, 2, 0).reshape(n_kv, H // n_kv, d, D).to(ctx.values.device, torch.float32).contiguous()
        l1 = ctx.values.new_empty(B, n_kv, H // n_kv, n, dtype=torch.float32)
        for s in range(0, n, VALUE_L1_CHUNK):         # W_O v of a chunk of entries stays in the CPU's cache
            proj = torch.matmul(ctx.values[:, :, None, s : s + VALUE_L1_CHUNK].float(), w)   # [B, Hkv, H/Hkv, c, D]
            l1[..., s : s + VALUE_L1_CHUNK] = torch.linalg.vector_norm(proj, ord=1, dim=-1)
        ctx.value_l1 = l1.mean(2)
    return ctx.value_l1


def criticalkv(window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL, first: float = CRITICAL_FIRST_STAGE) -> Policy:
    """CriticalKV (Feng et al., *Identify Critical KV Cache in LLM Inference from an Output
    Perturbation Perspective*, 2025) on SnapKV's scores: a first stage keeps the ``first`` share of
    the budget by the attention score alone; the rest of the budget goes by the score times the
    projected value's ℓ1 norm ``‖W_O^h v_j‖₁`` (:func:`projected_value_l1`). The observation window
    is kept, as SnapKV keeps it."""
    import torch

    def priority(ctx):
        tier, score = _snap_priority(ctx, window, kernel)
        n_first = (ctx.budget.float() * first).long().to(ctx.pos.device).reshape(1, -1, 1)
        rank = score.masked_fill(~ctx.valid, float("-inf")).argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        stage_one = rank < n_first
        return tier * 2 + stage_one.long(), score * projected_value_l1(ctx)

    return Policy("criticalkv", "SnapKV scores, then x |W_O v|_1 (two stages)", priority, needs="attention",
                  accumulate=False, last=window, params={"window": window, "kernel": kernel, "first": first},
                  prefill_only=True)


def dropkv(window: int = SNAP_WINDOW, head_space: bool = False) -> Policy:
    """Leave-one-out (DropKV; the closed form of CAOTE, Goel et al., 2025): for each query of the
    observation window, the squared distance its head output moves when the entry alone is dropped
    and the rest renormalised (:func:`attngeom.metrics.leave_one_out.leave_one_out`, squared as the
    method's output error is), summed over the window; the window is kept. ``head_space``
    (``loo_head``, this toolkit's geometry): the change measured through ``W_O^h``, the norm the
    head's output has in the residual stream (SPEC §2), instead of in value space."""
    name = "loo_head" if head_space else "dropkv"
    return Policy(name, "squared leave-one-out change of the head output" + (" (head space)" if head_space else ""),
                  lambda ctx: (_tiers(ctx.recent(window)), ctx.score),
                  needs="leave_one_out_head" if head_space else "leave_one_out", accumulate=False, last=window,
                  params={"window": window}, geometry=head_space)


KVZIP_SINKS = 4
"""Entries at the start of the context KVzip keeps whatever their score (kvpress's ``n_sink``): their score is 1."""

KVZIP_CHUNK = 2048
"""Context tokens repeated per reconstruction pass (kvpress's ``chunk_size``)."""

KVZIP_OVERLAP = 8
"""Tokens of the previous chunk quoted in the request of the next (kvpress's ``prev_postfix_size``)."""

KVZIP_PROMPT = "\n\nRepeat the previous context exactly."
"""The request before the first chunk is repeated (kvpress's, in plain text)."""

KVZIP_PROMPT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
"""The request before every later chunk, followed by the last :data:`KVZIP_OVERLAP` tokens of the chunk before."""

RECONSTRUCTION_SCORES = ("attention", "kvzip_plus", "contribution")
"""What a reconstruction pass scores (``Policy.params["score"]``): attention (KVzip), attention
normalised by ``‖W_O^h v_j‖ / ‖h_i‖`` (KVzip+), or the intra-head contribution ``|c_ij^h|``."""


def global_budgets(contexts: dict, ratio: float, priority) -> dict:
    """One cut over every compressed layer and head together, as kvpress's ``KVzipPress`` makes
    it (``layerwise=False``): of the ``N`` entries of all of them, the ``N − ⌊N·ratio⌋`` with the
    highest ``priority`` (tier, then score; ties: the earlier layer, head and entry) are kept;
    each head's budget is the number of them it holds (a head may keep none). Scores must be
    comparable across heads and layers."""
    import torch

    tiers, scores, shapes = [], [], {}
    for l, ctx in contexts.items():
        if ctx.pos.shape[0] != 1:
            raise ValueError("a global cut is made for one sequence (a prefill of batch 1)")
        ctx.budget = ctx.valid.sum(-1).max(0).values
        tier, score = priority(ctx)
        tiers.append(torch.where(ctx.valid, tier.long(), -1)[0].reshape(-1).cpu())
        scores.append(torch.nan_to_num(score.float(), nan=float("-inf")).masked_fill(~ctx.valid, float("-inf"))[0].reshape(-1).cpu())
        shapes[l] = ctx.pos.shape[1:]
    tier, score = torch.cat(tiers), torch.cat(scores)
    total = int(sum(int(c.valid.sum()) for c in contexts.values()))
    keep = total - int(total * ratio)
    order = torch.sort(score, descending=True, stable=True).indices
    order = order[torch.sort(tier[order], descending=True, stable=True).indices]
    won = torch.zeros(score.numel(), dtype=torch.long)
    won[order[:keep]] = 1
    out, start = {}, 0
    for l, (h, n) in shapes.items():
        out[l] = won[start : start + h * n].reshape(h, n).sum(-1)
        start += h * n
    return out


def _reconstruction(name: str, doc: str, score: str, geometry: bool = False) -> Policy:
    """A policy scored by KVzip's reconstruction pass (:func:`attngeom.kvcache.prefill.reconstruction_scores`):
    the largest ``score`` any query of the pass gives an entry, the maximum also over the query
    heads of a key/value head, the first :data:`KVZIP_SINKS` entries scored 1, one global cut
    (:func:`global_budgets`)."""
    import torch

    def priority(ctx):
        return torch.zeros_like(ctx.pos), ctx.score

    return Policy(name, doc, priority, needs="reconstruction", accumulate=False, pool="max", prefill_only=True,
                  params={"score": score, "sinks": KVZIP_SINKS, "chunk": KVZIP_CHUNK}, geometry=geometry,
                  allocator=lambda cs, r: global_budgets(cs, r, priority))


def kvzip() -> Policy:
    """KVzip (Kim et al., *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction*,
    NeurIPS 2025), as kvpress's ``KVzipPress`` by default: after the prefill the model is asked to
    repeat its context, chunk by chunk (:data:`KVZIP_PROMPT`, the chat template's assistant turn,
    then the chunk's own tokens, read with the full cache); an entry's score is the largest
    attention any query of its chunk's pass pays it (the softmax over the sinks, the chunk and the
    pass's own tokens, as kvpress computes it), the maximum also over the query heads of a
    key/value head; the first :data:`KVZIP_SINKS` entries score 1; one cut over all layers and
    heads (:func:`global_budgets`). Costs one more forward pass over the whole context."""
    return _reconstruction("kvzip", "max attention while the model repeats its context, one global cut", "attention")


def kvzip_plus() -> Policy:
    """KVzip+ (kvpress's ``KVzipPress(kvzip_plus_normalization=True)``; Kim et al., KVzip, and its
    maintainers' normalisation): KVzip with each attention weight ``a_ij^h`` of the reconstruction
    pass multiplied by ``‖W_O^h v_j‖₂ / ‖h_i‖₂`` (``h_i`` the attention's input at the query: what
    the entry adds to the residual stream, relative to the stream), then the maximum; one global cut."""
    return _reconstruction("kvzip_plus", "KVzip's max of a_ij |W_O v_j| / |h_i|, one global cut", "kvzip_plus")


def adakv_budgets(contexts: dict, ratio: float, priority, floor: float = ADAKV_FLOOR) -> dict:
    """AdaKV's head-wise budgets (Feng et al., *Ada-KV: Optimizing KV Cache Eviction by Adaptive
    Budget Allocation for Efficient LLM Inference*, 2024): per layer, the ``Hkv × k`` entries with
    the highest scores over all its heads together (``k`` the uniform budget; protected tiers first),
    each head keeping at least ``floor·k`` (the safeguard). Scores must be comparable across heads
    (attention probabilities, contributions)."""
    import torch

    out = {}
    for l, ctx in contexts.items():
        B, n_kv, n = ctx.pos.shape
        k = n - int(n * ratio)
        ctx.budget = torch.full((n_kv,), k, dtype=torch.long)
        tier, score = priority(ctx)
        base = int(floor * k)
        if B != 1:
            raise ValueError("AdaKV's budgets are allocated for one sequence (a prefill of batch 1)")
        # each head's first `base` entries (tier, then score) are safe; the rest compete across heads
        order = torch.sort(score.masked_fill(~ctx.valid, float("-inf")), dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, torch.sort(tier.gather(-1, order), dim=-1, descending=True, stable=True).indices)
        flat_t = tier.gather(-1, order)[0, :, base:].reshape(-1)
        flat_s = score.gather(-1, order)[0, :, base:].reshape(-1).float()
        by_score = torch.sort(flat_s, descending=True, stable=True).indices
        ranked = by_score[torch.sort(flat_t[by_score], descending=True, stable=True).indices]
        won = torch.zeros(flat_t.numel(), dtype=torch.long)
        won[ranked[: n_kv * (k - base)].cpu()] = 1
        extra = won.reshape(n_kv, n - base).sum(-1)
        out[l] = (base + extra).clamp_max(n).long()
    return out


def adakv(inner: str = "snapkv", name: str = "adakv") -> Policy:
    """AdaKV on top of any score: the ``inner`` policy's scores and protections, with head-wise
    budgets from :func:`adakv_budgets` (the layer keeps the same total)."""
    base = get_policy(inner)
    return Policy(name, f"{inner} scores, head-wise budgets (AdaKV)",
                  base.priority, needs=base.needs, accumulate=base.accumulate, pool=base.pool, last=base.last,
                  signed=base.signed, params={"inner": inner, "floor": ADAKV_FLOOR}, prefill_only=True,
                  geometry=base.geometry,
                  allocator=lambda cs, r: adakv_budgets(cs, r, base.priority))


# --------------------------------------------------------------------------------------------
# Policies from the papers' geometry for compression once after the prefill (docs/kvcache.md)
# --------------------------------------------------------------------------------------------

SUPPRESSORS = 4
"""Entries per head kept as suppressors by the ``suppressor`` policy (the most negative contributions)."""


def kvzip_contribution() -> Policy:
    """KVzip's reconstruction pass scored by contribution (this toolkit; SPEC §2): the pass of
    :func:`kvzip` (chunks, sinks, its renormalised attention), each entry scored by the largest
    ``|c_ij^h| = |⟨ã_ij^h W_O^h v_j, õ_i^h⟩| / ‖õ_i^h‖²`` any query of the pass gives it (``õ_i^h``
    the head output over the entries the pass attends to), one global cut over all layers and
    heads. A contribution is a share of the head's output, comparable across heads and layers
    as attention is."""
    return _reconstruction("kvzip_contribution", "KVzip's pass scored by max |contribution|, one global cut",
                           "contribution", geometry=True)


def snap_contribution(window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL) -> Policy:
    """SnapKV's setting with contribution instead of attention: what the last ``window`` queries
    take from each entry by ``|c_ij^h|`` (SPEC §2), summed, average-pooled over neighbouring entries
    (kernel ``kernel``), the window kept."""
    return Policy("snap_contribution", f"last {window} queries' |contribution|, average pool {kernel}",
                  lambda ctx: _snap_priority(ctx, window, kernel), needs="contribution", accumulate=False,
                  last=window, params={"window": window, "kernel": kernel}, prefill_only=True, geometry=True)


def suppressor(window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL, count: int = SUPPRESSORS) -> Policy:
    """Sinks as suppressors (SPEC §4): the last ``window`` queries' *signed* contributions summed;
    the ``count`` entries of each head with the most negative sums (suppressors, such as an
    attention sink anti-aligned with the output) are kept first, then the window, then the entries
    by ``|Σ_i c_ij^h|`` (average-pooled): dropping a suppressor moves the output as far as dropping an
    adder of the same size."""
    import torch

    def priority(ctx):
        neg = ctx.score.masked_fill(~ctx.valid, float("inf"))
        rank = neg.argsort(dim=-1, stable=True).argsort(dim=-1)
        suppress = (rank < count) & (ctx.score < 0)
        tier = 2 * suppress.long() + ctx.recent(window).long()
        return tier, _snap_priority(ctx, window, kernel, ctx.score.abs())[1]

    return Policy("suppressor", f"{count} most negative contributions kept, then |signed contribution|", priority,
                  needs="contribution", signed=True, accumulate=False, last=window,
                  params={"window": window, "kernel": kernel, "count": count}, prefill_only=True, geometry=True)


POLICIES: dict[str, Callable[[], Policy]] = {
    "full": full,
    "window": window,
    "streamingllm": streamingllm,
    "h2o": h2o,
    "tova": tova,
    "snapkv": snapkv,
    "vatp": vatp,
    "contribution": contribution,
    "contribution_signed": lambda: contribution(signed=True),
    "taxonomy": taxonomy,
}
"""Every policy. The first ten also read with eviction (:data:`READING_POLICIES`); the rest are
baselines of compression once after the prefill."""

POLICIES.update({
    "random": random_policy,
    "knorm": knorm,
    "pyramidkv": pyramidkv,
    "criticalkv": criticalkv,
    "dropkv": dropkv,
    "adakv": adakv,
    "loo_head": lambda: dropkv(head_space=True),
    "kvzip": kvzip,
    "kvzip_plus": kvzip_plus,
    "snap_contribution": snap_contribution,
    "kvzip_contribution": kvzip_contribution,
    "adakv_contribution": lambda: adakv("snap_contribution", "adakv_contribution"),
    "suppressor": suppressor,
})

READING_POLICIES = ("full", "window", "streamingllm", "h2o", "tova", "snapkv", "vatp", "contribution",
                    "contribution_signed", "taxonomy")
"""The policies of ``attngeom kvcache``'s reading with eviction (its default)."""


def get_policy(name: "str | Policy") -> Policy:
    """The policy ``name``: a name of :data:`POLICIES`, a :class:`Policy` itself, or
    ``"module:Class"`` (``"path/file.py:Class"``): a policy class (or a function returning a
    policy) of your own module, imported and registered under its ``name`` (so that the tables'
    rows find it again)."""
    if isinstance(name, Policy):
        return name
    if isinstance(name, str) and ":" in name:
        return register(load_policy(name))
    if name not in POLICIES:
        raise InputError(f"unknown KV-cache policy {name!r}; choose from {', '.join(POLICIES)}, or give module:Class")
    return POLICIES[name]()


def load_policy(spec: str) -> Policy:
    """The policy of ``"module:Class"`` or ``"path/file.py:Class"``: ``Class()`` (a class) or
    ``Class()``'s result (a function), checked to be a :class:`Policy`; refused in one line otherwise."""
    import importlib
    import importlib.util
    from pathlib import Path

    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise InputError(f"a policy of your own is module:Class, got {spec!r}")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise InputError(f"{spec}: no file {where}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except InputError:
        raise
    except Exception as e:                      # the user's module: its own error, in one line
        raise InputError(f"{spec}: cannot import {where}: {type(e).__name__}: {e}") from None
    made = getattr(module, attr, None)
    if made is None:
        raise InputError(f"{spec}: {where} has no {attr}")
    try:
        policy = made() if callable(made) else made
    except Exception as e:
        raise InputError(f"{spec}: {attr}() failed: {type(e).__name__}: {e}") from None
    if not isinstance(policy, Policy):
        raise InputError(f"{spec}: {attr} is not a KV-cache policy (subclass attngeom.kvcache.policies.Policy)")
    return policy


def register(policy: Policy) -> Policy:
    """Add ``policy`` to :data:`POLICIES` under its name (a name of the toolkit's own is refused)."""
    known = POLICIES.get(policy.name)
    if known is not None and getattr(known, "registered", None) is None:
        raise InputError(f"a policy of your own is named {policy.name!r}, a name the toolkit's own policy has")

    def again() -> Policy:
        return policy

    again.registered = policy
    POLICIES[policy.name] = again
    return policy


def needs_regimes(names) -> bool:
    """Whether any of the policies ``names`` takes per-head budgets from a head taxonomy."""
    return any(get_policy(n).per_head_budgets for n in names)


# --------------------------------------------------------------------------------------------
# Taxonomy-aware budgets
# --------------------------------------------------------------------------------------------


def taxonomy_budgets(regimes: "pd.DataFrame", num_heads: int, num_kv_heads: int, budget: int,
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
