"""LaProx (Mai & Kim, *Reformulating KV Cache Eviction Problem for Long-Context LLM Inference*,
2026, arXiv:2605.07234), as its abstract describes it: eviction as the approximation of the
layer's output matrix product, an entry scored by the product of its attention and its
*projected* value with the terms between heads, scores comparable across heads and layers, and
one selection over the whole model.

The paper's equations and code could not be read here (only its abstract and summaries of it;
docs/kvcache.md says so), so this is one literal reading of that description, each choice said.
The layer's attention output at query ``i`` is the matrix product ``o_i = Σ_h Σ_j a_ij^h W_O^h v_j``
over the (head, entry) pairs; evicting entry ``j`` of key/value head ``g`` removes the terms of
every query head ``h`` that reads it, so over the last ``window`` queries::

    s_gj = Σ_i ‖Σ_{h∈g} a_ij^h W_O^h v_j‖² / ‖o_i‖²
         = Σ_{h,h'∈g} (Σ_i a_ij^h a_ij^{h'} / ‖o_i‖²) · v_jᵀ W_O^{hᵀ} W_O^{h'} v_j

the squared change of each window query's layer output, relative to that output, were the entry
zeroed with the attention held fixed (the cross terms ``h ≠ h'`` are the heads' interactions; relative to ``‖o_i‖`` so that
layers of different output scales compare). The window is kept (SnapKV's), then one cut over all
layers and heads (:func:`~attngeom.kvcache.policies.kvzip.global_budgets`). Not pooled over
neighbouring entries. A query whose layer output is 0 weighs 0. The global cut is made for one
sequence (a prefill of batch 1), so the window is that sequence's last queries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.attention import SNAP_WINDOW
from attngeom.kvcache.policies.base import EvictionContext, Policy

if TYPE_CHECKING:  # pragma: no cover
    import torch


class LaProx(Policy):
    """LaProx (Mai & Kim, 2026; module docstring): the relative change of the layer's output over
    the last ``window`` queries were the entry zeroed, with the terms between the query heads that
    share it; the window kept; one cut over all layers and heads."""

    name = "laprox"
    doc = "LaProx: sum over the window of |sum_h a_ij^h W_O^h v_j|^2 / |o_i|^2, one global cut"
    needs = "attention"
    accumulate = False
    prefill_only = True
    geometry = False

    def __init__(self, window: int = SNAP_WINDOW):
        super().__init__(params={"window": window}, last=window,
                         allocator=lambda cs, r: self._global(cs, r))

    def step(self, block, n_queries: int) -> torch.Tensor | None:
        """``[B, H, S]``: for query head ``h`` of key/value head ``g``, ``Σ_{h'∈g} Σ_i a_ij^h a_ij^{h'}
        / ‖o_i‖² · v_jᵀ W_O^{hᵀ} W_O^{h'} v_j`` over this block's queries among the last ``window``;
        the sum over the group's heads is ``s_gj`` (the mean pooling divides it by their number,
        the same in every layer)."""
        import torch

        from attngeom.metrics import formulas as metrics

        first = max(0, max(0, n_queries - self.params["window"]) - block.q_start)
        if first >= block.a.shape[2]:
            return None
        a = block.a[:, :, first:].float()                                          # [B, H, Q, S]
        B, H, _, S = a.shape
        # 1/‖o_i‖² of the window's real queries; a query whose layer output is 0 weighs 0 (nothing to keep)
        w = metrics.safe_div(block.query_valid[:, first:].float(), block.output_sq[:, first:])
        v = block.v.float()                                                         # [B, H, S, d]
        d = v.shape[-1]
        G = block.state.G_full.float().reshape(H, d, H, d)
        kv = block.state.kv_head.tolist()
        out = a.new_zeros(B, H, S)
        for g in dict.fromkeys(kv):                                 # each key/value head and its query heads
            hs = [h for h in range(H) if kv[h] == g]
            pair = torch.einsum("bhqs,bkqs,bq->bhks", a[:, hs], a[:, hs], w)      # Σ_i a^h a^h' / ‖o_i‖²
            vg = v[:, hs[0]]                                                       # the group's values [B, S, d]
            quad = torch.einsum("bsd,hdke,bse->bhks", vg, G[hs][:, :, hs], vg)    # v_jᵀ W_O^hᵀ W_O^h' v_j
            out[:, hs] = (pair * quad).sum(2)
        return out

    def priority(self, ctx: EvictionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The window first, then ``s_gj``."""
        return ctx.recent(self.params["window"]).long(), ctx.score

    def _global(self, contexts: dict, ratio: float) -> dict:
        from attngeom.kvcache.policies.kvzip import global_budgets

        return global_budgets(contexts, ratio, self.priority)
