"""The floor and the score without attention: seeded random scores and the key norm (knorm)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.base import Policy

if TYPE_CHECKING:  # pragma: no cover
    pass

RANDOM_SEED = 0


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
