"""Policies by the leave-one-out change of a head's output: DropKV (value space) and ``loo_head`` (head space)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.attention import SNAP_WINDOW
from attngeom.kvcache.policies.base import Policy, _tiers

if TYPE_CHECKING:  # pragma: no cover
    pass

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
