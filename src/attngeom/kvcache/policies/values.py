"""Policies that weigh attention by the values: VATP (``‖v_j‖₁``) and CriticalKV (``‖W_O^h v_j‖₁``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.attention import SNAP_KERNEL, SNAP_WINDOW, _snap_priority
from attngeom.kvcache.policies.base import RECENT, EvictionContext, Policy, _recent_count, _tiers

if TYPE_CHECKING:  # pragma: no cover
    import torch

CRITICAL_FIRST_STAGE = 0.5
"""CriticalKV's share of the budget chosen by the attention score alone (its first stage)."""

CRITICAL_EPSILON = 1e-4
"""Added to the score before it is multiplied by the projected value norm (kvpress's ``epsilon``)."""


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
    projected value's ℓ1 norm, ``(s_j + ε) ‖W_O^h v_j‖₁`` (:func:`projected_value_l1`, ``ε`` =
    :data:`CRITICAL_EPSILON`), as kvpress's ``CriticalKVPress(SnapKVPress())``: the observation
    window is kept, and counts in the first stage's share (SnapKVPress scores it above every entry)."""

    import torch

    def priority(ctx):
        tier, score = _snap_priority(ctx, window, kernel)
        n_first = (ctx.budget.float() * first).long().to(ctx.pos.device).reshape(1, -1, 1)
        first_rank = torch.where(tier > 0, float("inf"), score).masked_fill(~ctx.valid, float("-inf"))
        rank = first_rank.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        stage_one = rank < n_first
        return tier * 2 + stage_one.long(), (score + CRITICAL_EPSILON) * projected_value_l1(ctx)

    return Policy("criticalkv", "SnapKV scores, then x |W_O v|_1 (two stages)", priority, needs="attention",
                  accumulate=False, last=window, params={"window": window, "kernel": kernel, "first": first},
                  prefill_only=True)
