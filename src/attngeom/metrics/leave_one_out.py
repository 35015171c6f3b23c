"""Leave-one-out change of a head's output (SPEC §2.1): how far ``o_i^h`` moves when source ``j``
alone is dropped from the row and the rest renormalised.

Papers: the closed form of CAOTE (Goel et al., *CAOTE: KV Caching through Attention Output Error
based Token Eviction*, 2025), the score DropKV ranks cache entries by; as a token-importance
measure it is the attention-level "leave-one-out" of the interpretability literature, made exact for
one head. Choices fixed here: the change is measured in head space (through ``W_O^h``, the norm the
head's output has in the residual stream, SPEC §2); the token-level score sums it over the layer's
heads (each head's change, as ``value_weighted`` sums ``a_ij^h ‖ṽ_j^h‖``; the exact change of the
layer output when ``j`` is dropped from every head needs every pair of heads, ``Q × S × H²``).

The **unrenormalised** leave-one-out (drop ``j``, keep the other weights) moves ``o_i^h`` by exactly
``a_ij^h ṽ_j^h``: its norm is Kobayashi's value-weighted attention ``a_ij^h ‖ṽ_j^h‖``, the registry's
``value_weighted`` (tested in ``tests/unit/test_rival_metrics.py``), so it is not a separate entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

CITATION = "Goel et al., CAOTE: KV Caching through Attention Output Error based Token Eviction, 2025 (DropKV's score)"


def leave_one_out(block, head_space: bool = True, first: int = 0) -> torch.Tensor:
    """``[B, H, Q, S]``: ``‖o_i^{(−j)} − o_i‖`` for every head, query and source.

    ``o^{(−j)} − o = a_ij (o_i − v_j) / (1 − a_ij)``, so its norm is ``a_ij / (1 − a_ij) · ‖u_i − v_j‖``,
    in value space (``head_space=False``) or through ``W_O^h`` (``‖·‖_G``). For the row's largest
    weight, where that form cancels (``a_ij`` near 1), the same change is computed from the other
    sources directly: ``a_ij (Σ_{k≠j} a_ik v_k / Σ_{k≠j} a_ik − v_j)`` (a learned sink's share
    ``a_i∅`` counted in the denominator: it stays in the renormalised row, with a zero value); a
    query's only source takes the whole output with it (``‖u_i‖``). ``first``: the block's queries from this one on
    (``[B, H, Q − first, S]``)."""
    import torch

    a, v = block.a[:, :, first:], block.v
    u = block.head_output[:, :, first:]
    G = block.state.G if head_space else None

    def sq(x):                                                    # ‖x‖² [B, H, Q] of x [B, H, Q, d]
        return torch.einsum("bhqd,hde,bhqe->bhq", x, G, x) if head_space else (x * x).sum(-1)

    if head_space:
        uu, uv, vv = block.head_output_sq[:, :, first:], block.uG[:, :, first:] @ v.transpose(-1, -2), block.value_norm ** 2
    else:
        uu, uv, vv = (u * u).sum(-1), u @ v.transpose(-1, -2), (v * v).sum(-1)
    dist = (uu[..., None] - 2 * uv + vv[:, :, None, :]).clamp_min(0).sqrt()
    change = a / (1 - a).clamp_min(1e-30) * dist
    # the largest weight of each row, from the other sources
    top, j = a.max(-1)                                           # [B, H, Q]
    others = a.scatter(-1, j[..., None], 0.0)
    rest = others.sum(-1, keepdim=True)                          # [B, H, Q, 1]
    if getattr(block, "learned_sink", None) is not None:         # a learned sink keeps its share of the row
        rest = rest + block.learned_sink[:, :, first:, None]
    v_top = v.gather(2, j[..., None].expand(-1, -1, -1, v.shape[-1]))
    moved = top[..., None] * ((others @ v) / rest.clamp_min(1e-38) - v_top)
    at_top = torch.where(rest[..., 0] > 0, sq(moved).clamp_min(0).sqrt(), uu.clamp_min(0).sqrt())
    out = torch.where(a > 0, change, torch.zeros_like(a))
    return out.scatter(-1, j[..., None], at_top[..., None])
