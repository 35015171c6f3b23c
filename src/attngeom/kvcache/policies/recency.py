"""Policies by position alone: the full cache, the recent window and StreamingLLM's sinks + window."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.base import SINKS, Policy, _tiers

if TYPE_CHECKING:  # pragma: no cover
    pass

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
