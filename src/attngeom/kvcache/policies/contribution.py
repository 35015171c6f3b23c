"""Policies from the papers' geometry by contribution (SPEC §2): the accumulated contribution
(reading), SnapKV's window by contribution, sinks as suppressors (SPEC §4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.attention import SNAP_KERNEL, SNAP_WINDOW, _snap_priority
from attngeom.kvcache.policies.base import RECENT, Policy, _recent_count, _tiers

if TYPE_CHECKING:  # pragma: no cover
    pass

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


SUPPRESSORS = 4
"""Entries per head kept as suppressors by the ``suppressor`` policy (the most negative contributions)."""


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

    def priority(ctx):
        neg = ctx.score.masked_fill(~ctx.valid, float("inf"))
        rank = neg.argsort(dim=-1, stable=True).argsort(dim=-1)
        suppress = (rank < count) & (ctx.score < 0)
        tier = 2 * suppress.long() + ctx.recent(window).long()
        return tier, _snap_priority(ctx, window, kernel, ctx.score.abs())[1]

    return Policy("suppressor", f"{count} most negative contributions kept, then |signed contribution|", priority,
                  needs="contribution", signed=True, accumulate=False, last=window,
                  params={"window": window, "kernel": kernel, "count": count}, prefill_only=True, geometry=True)


def global_contribution(window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL) -> Policy:
    """Contribution with one selection over all layers and heads (this toolkit; the global
    selection is LaProx's idea: Mai & Kim, *Reformulating KV Cache Eviction Problem for
    Long-Context LLM Inference*, 2026): :func:`snap_contribution`'s scores (the last ``window``
    queries' ``|c_ij^h|`` summed, average-pooled), every head's window kept, then the highest
    scores of all layers and heads together (:func:`~attngeom.kvcache.policies.kvzip.global_budgets`).
    A contribution is a share of its head's output (a row sums to one), so the scores of
    different heads and layers are on one scale."""
    from attngeom.kvcache.policies.kvzip import global_budgets

    def priority(ctx):
        return _snap_priority(ctx, window, kernel)

    return Policy("global_contribution", f"last {window} queries' |contribution|, one cut over all layers and heads",
                  priority, needs="contribution", accumulate=False, last=window,
                  params={"window": window, "kernel": kernel}, prefill_only=True, geometry=True,
                  allocator=lambda cs, r: global_budgets(cs, r, priority))
