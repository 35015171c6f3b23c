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

from dataclasses import dataclass, field
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

SNAP_WINDOW = 32
SNAP_KERNEL = 7


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

    def recent(self, count: torch.Tensor | int) -> torch.Tensor:
        """``[B, Hkv, n]`` bool: the entry is among the last ``count`` positions (per head)."""
        import torch

        count = torch.as_tensor(count, device=self.pos.device).reshape(1, -1, 1)
        return self.pos >= self.seen - count

    def sinks(self, count: int) -> torch.Tensor:
        return self.pos < count


@dataclass
class Policy:
    """One eviction policy (module docstring). ``needs``: None, ``"attention"`` or
    ``"contribution"`` (what ``step`` reads from a block); ``last``: ``step`` reads only the last
    ``last`` queries of the forward pass (None: all)."""

    name: str
    doc: str
    priority: Callable[[EvictionContext], tuple[torch.Tensor, torch.Tensor]]
    needs: str | None = None
    accumulate: bool = True
    pool: str = "mean"
    last: int | None = None
    signed: bool = False
    per_head_budgets: bool = False
    params: dict = field(default_factory=dict)

    def step(self, block, n_queries: int) -> torch.Tensor | None:
        """``[B, H, S]``: this block's scores summed over the queries the policy reads
        (block query ``i`` is query ``q_start + i`` of a forward pass of ``n_queries`` queries)."""
        if self.needs is None:
            return None
        if self.needs == "contribution":
            m = block.contribution
            m = m if self.signed else m.abs()
        else:
            m = block.a
        if self.last is not None:
            first = max(0, n_queries - self.last) - block.q_start
            if first >= m.shape[2]:
                return None
            m = m[:, :, max(0, first):]
        return m.sum(2)


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


def _max_pool(score: torch.Tensor, valid: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D max pooling over the entries (kept in position order), padding excluded."""
    import torch

    x = score.masked_fill(~valid, float("-inf"))
    B, H, n = x.shape
    y = torch.nn.functional.max_pool1d(x.reshape(B * H, 1, n), kernel, stride=1, padding=kernel // 2)
    return y.reshape(B, H, n)


def snapkv(window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL) -> Policy:
    """SnapKV (Li et al., *SnapKV: LLM Knows What You are Looking for Before Generation*, NeurIPS
    2024): the attention of the last ``window`` queries (the observation window) summed, max-pooled
    over neighbouring entries (kernel ``kernel``), plus the observation window itself. Made for the
    prompt; when reading token by token the observation window is the last forward pass's queries
    (at most ``window``)."""
    return Policy("snapkv", f"observation window {window}, max-pool {kernel}",
                  lambda ctx: (_tiers(ctx.recent(window)), _max_pool(ctx.score, ctx.valid, kernel)),
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
                  needs="contribution", signed=signed, params={"recent": recent})


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


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise InputError(f"unknown KV-cache policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name]()


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
