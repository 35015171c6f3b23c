"""Attention rollout (SPEC §2.1), and the same rollout of contribution: the layers' token-level maps
composed from the input up, each with the residual connection as an identity of equal weight.

Paper: Abnar and Zuidema, *Quantifying Attention Flow in Transformers* (ACL 2020): with ``A^l`` the
layer's attention averaged over heads, ``Â^l = ½ A^l + ½ I`` and ``R^l = Â^l R^{l−1}`` (``R^{−1} = I``);
``R^l_ij`` is the share of token ``j`` of the input in position ``i``'s state after layer ``l``.
``contribution_rollout`` composes the inter-head contribution ``C^l`` (SPEC §2, rows summing to 1)
in place of ``A^l``, with the same ½ of residual (SPEC §8's transfer matrix uses the measured
residual share instead; the fixed ½ keeps the two rollouts alike).

Choices fixed here:

- The ranking at layer ``l`` is ``R^l``: sources (positions) ranked by how much of their input token
  the query's state holds after that layer, so every layer's intervention (SPEC §3) reads the
  composition of the layers up to it. Layer ``l``'s own map enters, so the last layer's ranking is
  the rollout papers report.
- Composed on the clean forward (:func:`attngeom.capture.prepared.rollout_maps`), once per text, through every attention layer (an intervened
  forward ranks by the clean composition, as the gradient does); layer only (no per-head form).
- Attention *flow* (the same paper's maximum flow through the layer graph) is not here: it is a
  maximum-flow problem per (query, source) pair on a graph of ``layers × T`` nodes, which the
  paper itself reports as far slower than rollout; nothing in it is cheaper at the windows the
  faithfulness runs use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

CITATION = "Abnar & Zuidema, ACL 2020 (attention rollout)"


def compose(maps: Sequence["torch.Tensor"]) -> list["torch.Tensor"]:
    """``R^l`` for every layer from the token-level maps ``maps[l]`` (``[B, T, T]``, rows of the
    attention or contribution), ``R^l = (½ M^l + ½ I) R^{l−1}``, ``R^{−1} = I``."""
    import torch

    out = []
    R = None
    for M in maps:
        M = M.double()
        A = 0.5 * M + 0.5 * torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
        R = A if R is None else A @ R
        out.append(R.float())
    return out
