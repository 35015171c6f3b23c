"""Policies by attention: H2O's accumulated attention, TOVA's current query and SnapKV's
observation window (average-pooled, as kvpress's ``SnapKVPress``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.base import RECENT, Policy, _recent_count, _tiers

if TYPE_CHECKING:  # pragma: no cover
    import torch

SNAP_WINDOW = 64
"""SnapKV's observation window: kvpress's ``SnapKVPress.window_size`` (the last 64 queries)."""


SNAP_KERNEL = 5
"""SnapKV's pooling kernel: kvpress's ``SnapKVPress.kernel_size`` (average pooling over 5 entries)."""


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


def _snap_priority(ctx, window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL, score=None):
    """SnapKV's ranking: the observation window first, then the average-pooled ``score`` (default ``ctx.score``)."""
    recent = ctx.recent(window)
    return _tiers(recent), _avg_pool(ctx.score if score is None else score, ctx.valid, kernel, recent)


def snapkv(window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL) -> Policy:
    """SnapKV (Li et al., *SnapKV: LLM Knows What You are Looking for Before Generation*, NeurIPS
    2024), as kvpress's ``SnapKVPress``: the attention of the last ``window`` queries (the
    observation window) summed, average-pooled over neighbouring entries (kernel ``kernel``,
    :func:`_avg_pool`), plus the observation window itself. Made for the prompt; when reading token
    by token the observation window is the last forward pass's queries (at most ``window``)."""
    return Policy("snapkv", f"observation window {window}, average pool {kernel}",
                  lambda ctx: _snap_priority(ctx, window, kernel),
                  needs="attention", accumulate=False, last=window, params={"window": window, "kernel": kernel})
