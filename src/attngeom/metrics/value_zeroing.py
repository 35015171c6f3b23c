"""Value zeroing (SPEC §2.1): how far a query's attention output turns when source ``j``'s values
are zeroed.

Paper: Mohebbi, Zuidema, Chrupała and Alishahi, *Quantifying Context Mixing in Transformers*
(EACL 2023): zero token ``j``'s value vectors in a layer, rerun the layer, and score ``j`` for
query ``i`` by the cosine distance between ``i``'s original and altered output representation.
Choices fixed here (the paper's encoder-layer output includes the residual, the feed-forward block
and the layer norms, which an attention plug-in does not see): the representation is the layer's
attention output ``o_i`` (before the output projection's bias), so the score is exact and needs no
extra forward pass; the attention weights are kept (zeroing a value does not change them).

- per head (``value_zeroing``): ``j`` zeroed in head ``h`` alone:
  ``1 − cos(o_i, o_i − a_ij^h ṽ_j^h)``;
- token level (the paper's form): ``j`` zeroed in every head of the layer:
  ``1 − cos(o_i, o_i − Σ_h a_ij^h ṽ_j^h)``, computed from ``⟨o_i, ṽ_j^h⟩`` and the values'
  cross-head products ``⟨ṽ_j^g, ṽ_j^h⟩`` (no ``Q × S × D`` tensor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

CITATION = "Mohebbi et al., Quantifying Context Mixing in Transformers, EACL 2023"


ILL_CONDITIONED = 1e-2
"""Where ``‖o − x‖² < ILL_CONDITIONED · ‖o‖²`` (a source carrying most of the output), the closed form
cancels; there ``o − x`` is formed in model space and the cosine taken directly."""


def cosine_distance(oo: torch.Tensor, o_dot_part: torch.Tensor, part_sq: torch.Tensor) -> torch.Tensor:
    """``1 − cos(o, o − x)`` from ``‖o‖²``, ``⟨o, x⟩`` and ``‖x‖²`` (broadcast): 0 where ``x = 0`` or
    ``o = 0``; 1 where ``o − x = 0`` (the output is gone); within [0, 2]."""
    import torch

    from attngeom.metrics import formulas

    rest_sq = (oo - 2 * o_dot_part + part_sq).clamp_min(0)
    den = (oo.clamp_min(0) * rest_sq).sqrt()
    dist = 1 - formulas.safe_div(oo - o_dot_part, den, fill=0.0)
    dist = torch.where((den > 0) | (oo <= 0), dist, torch.ones_like(dist))
    # a cosine distance lies in [0, 2]; rounding of the closed form can step just outside
    return torch.where((part_sq > 0) & (oo > 0), dist, torch.zeros_like(dist)).clamp_(0, 2)


def _refine(dist: torch.Tensor, ill: torch.Tensor, o: torch.Tensor, rest) -> torch.Tensor:
    """``dist`` with the entries ``ill`` recomputed from vectors: ``o [B, Q, D]`` and
    ``rest(index) -> [N, D]``, ``o_i − x`` summed from the terms that remain (no cancellation), for the
    index tuple of those entries (batch first, query and source last). Which entries those are is
    decided on the host (one read per block; a boundary of the GPU path)."""
    import torch

    if not bool(ill.any()):
        return dist
    idx = ill.nonzero(as_tuple=True)
    ob = o[idx[0], idx[-2]]
    r = rest(idx)
    cos = torch.nn.functional.cosine_similarity(ob, r, dim=-1, eps=1e-30)
    out = dist.clone()
    out[idx] = (1 - torch.where(r.abs().amax(-1) > 0, cos, torch.zeros_like(cos))).clamp(0, 2)
    return out


def _chunks(n: int, each: int):
    step = max(1, (1 << 22) // max(1, each))
    return [slice(k, min(n, k + step)) for k in range(0, n, step)]


def _ill(oo, o_dot_part, part_sq):
    return ((oo - 2 * o_dot_part + part_sq) < ILL_CONDITIONED * oo) & (part_sq > 0) & (oo > 0)


def value_zeroing_per_head(block) -> torch.Tensor:
    """``[B, H, Q, S]``: ``1 − cos(o_i, o_i − a_ij^h ṽ_j^h)`` (``j`` zeroed in head ``h`` only)."""
    import torch

    from attngeom.metrics import formulas

    a = block.a
    x = a * (block.pulled_back @ block.v.transpose(-1, -2))              # ⟨o_i, a_ij^h ṽ_j^h⟩
    part_sq = a * a * (block.value_norm ** 2).unsqueeze(-2)
    oo = block.output_sq[:, None, :, None]
    dist = cosine_distance(oo, x, part_sq)
    ill = _ill(oo, x, part_sq)

    def rest(i):                   # the other heads' outputs, and head h's other sources
        b, h, q, j = i
        pv = formulas.projected_values(block.v, block.state.w_o)        # [B, H, S, D]
        heads = formulas.head_blocks(block.state.w_o, a.shape[1])        # [H, d, D]
        u = block.head_output
        out = []
        for c in _chunks(len(b), a.shape[1] * heads.shape[-1] + a.shape[-1] * pv.shape[-1]):
            o_heads = torch.einsum("nhd,hdD->nhD", u[b[c], :, q[c]], heads)
            o_heads[torch.arange(len(b[c])), h[c]] = 0
            row = a[b[c], h[c], q[c]].clone()
            row[torch.arange(len(b[c])), j[c]] = 0
            out.append(o_heads.sum(1) + torch.einsum("ns,nsD->nD", row, pv[b[c], h[c]]))
        return torch.cat(out)

    return _refine(dist, ill, block.layer_output, rest)


def value_zeroing_layer(block) -> torch.Tensor:
    """``[B, Q, S]``: ``1 − cos(o_i, o_i − Σ_h a_ij^h ṽ_j^h)`` (``j`` zeroed in every head)."""
    import torch

    from attngeom.metrics import formulas

    a = block.a
    x = (a * (block.pulled_back @ block.v.transpose(-1, -2))).sum(1)     # ⟨o_i, Σ_h a_ij^h ṽ_j^h⟩
    cross = formulas.value_cross_products(block.v, block.state.w_o)      # [B, S, H, H]
    part_sq = torch.einsum("bgqs,bsgh,bhqs->bqs", a, cross, a)
    oo = block.output_sq[:, :, None]
    dist = cosine_distance(oo, x, part_sq)
    ill = _ill(oo, x, part_sq)

    def rest(i):                   # every head's other sources
        b, q, j = i
        pv = formulas.projected_values(block.v, block.state.w_o)        # [B, H, S, D]
        out = []
        for c in _chunks(len(b), a.shape[1] * a.shape[-1] * pv.shape[-1]):
            rows = a[b[c], :, q[c]].clone()                               # [N, H, S]
            rows[torch.arange(len(b[c])), :, j[c]] = 0
            out.append(torch.einsum("nhs,nhsD->nD", rows, pv[b[c]]))
        return torch.cat(out)

    return _refine(dist, ill, block.layer_output, rest)
