"""Taxonomy-aware per-head budgets (SPEC §6): Retriever heads large and H2O-like, Mixer/Reset heads sinks + window."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.base import RECENT, SINKS, Policy, _recent_count, _tiers

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

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
