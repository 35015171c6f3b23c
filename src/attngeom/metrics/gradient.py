"""Gradient-weighted attention (SPEC §2.1): each attention weight times the gradient of the text's
log-likelihood with respect to it, ``g_ij^h = a_ij^h · ∂ℓ/∂a_ij^h``.

Papers: Chefer, Gur and Wolf, *Generic Attention-model Explainability for Interpreting Bi-Modal and
Encoder-Decoder Transformers* (ICCV 2021: the attention map weighted by its gradient, ``A ⊙ ∇A``);
Qiang et al., *AttCAT: Explaining Transformers via Attentive Class Activation Tokens* (NeurIPS 2022);
Hao et al., *Self-Attention Attribution* (AAAI 2021: attention times the integrated gradient, of
which this is the one-step form).

Choices fixed here:

- ``ℓ`` is the log-likelihood of the text's scored tokens (the predictions whose perplexity the
  interventions measure; for a multiple-choice option, its continuation). ``g_ij^h`` is then the
  first-order change of ``ℓ`` when the term ``a_ij^h ṽ_j^h`` is masked, with the sign turned:
  masking it changes ``ℓ`` by ``≈ −g_ij^h``, so the highest-ranked sources are those whose removal
  is predicted to cost the most likelihood (SPEC §3's comprehensiveness masks them).
- The gradient is taken once, on the clean forward, with respect to the weights that mix the
  values (after the softmax, in the model's dtype); an intervened forward ranks by the clean
  forward's map at every layer (recomputing it under the intervention would need a backward pass
  per variant, and masks at later layers would feed back into earlier rankings).
- Token level: ``Σ_h g_ij^h``, the first-order change when ``j`` is masked in every head.

Cost: one forward and one backward pass per text with every layer's ``[H, T, T]`` weights kept
for the backward (eager attention's memory, not the plug-in's bounded blocks), before the
intervened forwards; the benchmark (``benchmarks/bench_measures.py``) says what it costs.

The backward pass (:func:`attngeom.capture.prepared.gradient_maps`) runs through its own attention
function, registered in transformers' ``AttentionInterface`` as ``"attngeom_gradient"``: eager
attention written with differentiable operations (GQA, masks, soft-capping and learned sinks as the
plug-in honours them), recording each layer's mixing weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

CITATION = ("Chefer et al., ICCV 2021 (attention ⊙ gradient); Qiang et al., AttCAT, NeurIPS 2022; "
            "Hao et al., AAAI 2021")


def gradient_weighted(a: "torch.Tensor", grad: "torch.Tensor") -> "torch.Tensor":
    """``g = a ⊙ ∂ℓ/∂a``: ``a [B, H, Q, S]`` the mixing weights, ``grad`` the gradient of ``ℓ`` with
    respect to them (same shape; None-free), in float32."""
    return a.float() * grad.float()
