"""AnDPro (Geng et al., *Accurate KV Cache Eviction via Anchor Direction Projection for Efficient
LLM Inference*, NeurIPS 2025, OpenReview ``Tdl89SZItB``): each entry scored by the projection of
its attention-weighted value onto the *anchor direction*, the output of the entries that may be
evicted; one selection over the heads of a layer.

Followed: the authors' code (github.com/MIRALab-USTC/LLM-AnDPro,
``andpro_snapkv/monkeypatch/snapkv_utils.py``, ``AnDProAdaptiveSnapKVCluster.update_kv_wo_gqa``,
the block its comment calls "the core code of AnDPro", and the defaults of its
``experiments/LongBench/pred.py`` and ``run.sh``); the paper's text could not be read here
(docs/kvcache.md says what was found). With ``a'_ij`` the attention of query ``i`` max-pooled
over the entries (kernel 7), ``E`` the entries that may be evicted (all but the first chunk and
the observation window) and the anchor ``o_i^E = Σ_{j∈E} a'_ij v_j`` (head space, per query head)::

    s_j = Σ_{i ∈ last w queries} a'_ij ⟨v_j, o_i^E⟩

summed over each chunk of ``c`` consecutive entries; the chunks with the highest sums over all
heads of the layer are kept (one cut per layer, no floor per head), after each head's first chunk
and its window. Not normalised by ``‖o_i^E‖``: the code compares the inner products across heads
as they are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attngeom.kvcache.policies.base import EvictionContext, Policy, _tiers

if TYPE_CHECKING:  # pragma: no cover
    import torch

ANDPRO_WINDOW = 32
"""AnDPro's observation window (its ``pred.py``'s ``window_size``): the last 32 queries."""


ANDPRO_KERNEL = 7
"""AnDPro's max-pooling kernel over the entries (its ``pred.py``'s ``kernel_size``, ``pooling="maxpool"``)."""


ANDPRO_CHUNK = 4
"""Entries scored and kept together (its ``run.sh``'s ``chunk_size``); the first chunk is always kept."""


class AnDPro(Policy):
    """AnDPro (Geng et al., NeurIPS 2025; module docstring): the last ``window`` queries' attention,
    max-pooled over ``kernel`` entries, times each value's inner product with the anchor (the
    pooled output of the evictable entries), summed per chunk of ``chunk`` entries; the first chunk
    and the window kept; one cut over the layer's heads.

    Choices the authors' code leaves open or that this cache makes differently (docs/kvcache.md):
    budgets count entries (the code's layer budget ``heads × (B − w)`` counts chunks, so it keeps up
    to ``chunk`` times the entries its budget names); a key/value head shared by several query
    heads (grouped-query attention, which the code's AnDPro path does not support) ranks its
    entries by the mean of its query heads' scores; entries of a chunk share the chunk's score, so
    the budget may split the last chunk it reaches; the window is, as in the code, the last
    ``window / chunk`` chunks of the sequence padded at its end to whole chunks (``w − p`` real
    entries, ``p`` the padding)."""

    name = "andpro"
    doc = "anchor direction projection (AnDPro): pooled a_ij <v_j, o_i^evictable>, chunks, one cut per layer"
    needs = "attention"
    accumulate = False
    prefill_only = True

    def __init__(self, window: int = ANDPRO_WINDOW, kernel: int = ANDPRO_KERNEL, chunk: int = ANDPRO_CHUNK):
        if chunk < 1 or window < chunk or window % chunk:
            raise ValueError(f"AnDPro's window ({window}) is a positive multiple of its chunk ({chunk})")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"AnDPro's pooling kernel is odd, got {kernel}")
        super().__init__(params={"window": window, "kernel": kernel, "chunk": chunk}, last=window,
                         allocator=self._layer_cut)

    def step(self, block, n_queries: int) -> torch.Tensor | None:
        """``[B, H, n − k_start]``: ``Σ_i a'_ij ⟨v_j, o_i^E⟩`` over this block's queries among the
        last ``window`` of the forward pass (module docstring), for every later source ``j``. A
        query's row is completed with zeros up to the last source before pooling (its masked
        future), so a block that holds only part of the window gives its share exactly."""
        import torch

        w, kernel, c = self.params["window"], self.params["kernel"], self.params["chunk"]
        first = max(0, max(0, n_queries - w) - block.q_start)
        if first >= block.a.shape[2]:
            return None
        n, k0 = block.state.num_sources, block.k_start
        a = block.a[:, :, first:].float()
        B, H, Q, S = a.shape
        a = torch.nn.functional.pad(a, (0, n - k0 - S))
        pooled = torch.nn.functional.max_pool1d(a.reshape(B * H, Q, n - k0), kernel, stride=1,
                                                padding=kernel // 2).reshape(B, H, Q, n - k0)
        pos = torch.arange(k0, n, device=a.device)
        evictable = (pos >= c) & (pos < n + (-n) % c - w)
        v = block.state.v_from(k0).float()                                       # [B, H, n - k0, d]
        anchor = torch.matmul(pooled * evictable, v)                             # o_i^E: [B, H, Q, d]
        return (pooled * torch.matmul(anchor, v.transpose(-1, -2))).sum(2)

    def priority(self, ctx: EvictionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The first chunk and the window first, then each entry's chunk sum of the scores."""
        import torch

        w, c = self.params["window"], self.params["chunk"]
        protected = ctx.sinks(c) | ctx.recent(w - (-ctx.seen) % c)
        chunk = torch.div(ctx.pos, c, rounding_mode="floor")
        score = ctx.score.float().masked_fill(~ctx.valid, 0.0)
        sums = score.new_zeros(*score.shape[:-1], int(chunk.max()) + 1).scatter_add_(-1, chunk, score)
        return _tiers(protected), sums.gather(-1, chunk)

    def _layer_cut(self, contexts: dict, ratio: float) -> dict:
        """The budgets (its ``allocator``): per layer, the ``Hkv × k`` entries of highest (tier,
        chunk score) over all its heads (:func:`~attngeom.kvcache.policies.budgets.adakv_budgets`
        without AdaKV's floor: the code's one ``topk`` over the layer's heads)."""
        from attngeom.kvcache.policies.budgets import adakv_budgets

        return adakv_budgets(contexts, ratio, self.priority, floor=0.0)
