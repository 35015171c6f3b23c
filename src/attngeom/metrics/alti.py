"""ALTI, the causal-LM form (SPEC §2.1): each source's share of a query's attention output by the L1
proximity of its decomposed term to that output.

Papers: Ferrando, Gállego and Costa-jussà, *Measuring the Mixing of Contextual Information in the
Transformer* (EMNLP 2022), in the form Ferrando and Voita use for decoder LMs (*Information Flow
Routes*, 2024; what the LM Transparency Tool draws): with ``o_i = Σ_j z_ij`` and
``z_ij = Σ_h a_ij^h ṽ_j^h``, ``prox_ij = max(‖o_i‖₁ − ‖o_i − z_ij‖₁, 0)``, renormalised over the
sources, ``ALTI_ij = prox_ij / Σ_k prox_ik``.

Choices fixed here: the decomposition is that of the attention output before the output
projection's bias (the plug-in sees the attention module, not the residual stream, so the
residual term and the layer norm of the original are not among the terms; the ranking of the
sources of one query is what the interventions read); the score is defined on the layer, with no
per-head form (the L1 norm does not split over heads), so per-head rankings refuse it. Its cost is
``Q × S × H × D`` per layer, model width ``D`` in place of head size ``d`` (formed in query chunks of
bounded memory): the most expensive measure of the registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

CITATION = "Ferrando et al., EMNLP 2022 (ALTI); Ferrando & Voita, Information Flow Routes, 2024 (causal form)"

CHUNK_ELEMENTS = 1 << 22
"""Elements of one query chunk's ``[B, Qc, S, D]`` terms (16 MB in float32)."""


def alti(a: torch.Tensor, projected: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``[B, Q, S]``: ``a [B, H, Q, S]``, the projected values ``ṽ [B, H, S, D]``, the outputs
    ``o [B, Q, D]`` (``Σ_j z_ij``)."""
    import torch

    from attngeom.metrics import formulas

    B, H, Q, S = a.shape
    D = projected.shape[-1]
    step = max(1, CHUNK_ELEMENTS // max(1, B * S * D))
    out = a.new_zeros(B, Q, S)
    for q0 in range(0, Q, step):
        q1 = min(Q, q0 + step)
        z = torch.einsum("bhqs,bhsD->bqsD", a[:, :, q0:q1], projected)      # z_ij
        oq = o[:, q0:q1, None, :]
        out[:, q0:q1] = (oq.abs().sum(-1) - (oq - z).abs().sum(-1)).clamp_min(0)
    return formulas.safe_div(out, out.sum(-1, keepdim=True))


def alti_layer(block) -> torch.Tensor:
    from attngeom.metrics import formulas

    return alti(block.a, formulas.projected_values(block.v, block.state.w_o), block.layer_output)
