"""Policies that move budgets: PyramidKV between layers (as kvpress's ``PyramidKVPress``) and
AdaKV between the heads of a layer, on SnapKV's (or any policy's) scores."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.attention import SNAP_KERNEL, SNAP_WINDOW, _snap_priority, snapkv
from attngeom.kvcache.policies.base import Policy

if TYPE_CHECKING:  # pragma: no cover
    pass

PYRAMID_BETA = 20
"""PyramidKV's β (kvpress's ``beta``): the last compressed layer keeps ``1/β`` of the mean budget."""


ADAKV_FLOOR = 0.2
"""AdaKV's safeguard: every head keeps at least this share of the uniform budget."""


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


def adakv(inner: Policy | None = None, name: str = "adakv") -> Policy:
    """AdaKV on top of any score: the ``inner`` policy's (default :func:`snapkv`) scores and
    protections, with head-wise budgets from :func:`adakv_budgets` (the layer keeps the same total)."""
    base = inner if inner is not None else snapkv()
    return Policy(name, f"{base.name} scores, head-wise budgets (AdaKV)",
                  base.priority, needs=base.needs, accumulate=base.accumulate, pool=base.pool, last=base.last,
                  signed=base.signed, params={"inner": base.name, "floor": ADAKV_FLOOR}, prefill_only=True,
                  geometry=base.geometry,
                  allocator=lambda cs, r: adakv_budgets(cs, r, base.priority))
