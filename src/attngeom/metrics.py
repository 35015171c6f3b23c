"""Token-importance metrics of SPEC §2, computed in head space.

Pure functions on tensors; no model access here. Shapes use these letters:

- ``B`` batch, ``H`` query heads, ``Q`` queries in a block, ``S`` sources (keys), ``d`` head size,
  ``D`` model width.
- ``a``    attention probabilities ``[B, H, Q, S]`` exactly as the model computed them.
- ``v``    value states per query head ``[B, H, S, d]`` (grouped-query heads already repeated).
- ``G``    per-head Gram matrix of the output projection ``W_O^h W_O^hᵀ``, ``[H, d, d]``.
- ``w_o``  the output projection's weight as stored by ``nn.Linear``: ``[D, H*d]``.

The identities used (SPEC §2): with ``u_i^h = Σ_j a_ij^h v_j^h`` (head output in head space),
``‖ṽ_j^h‖² = v_jᵀ G v_j``, ``‖o_i^h‖² = u_iᵀ G u_i``, ``⟨o_i^h, ṽ_j^h⟩ = (u_i G)·v_j`` and
``⟨o_i, ṽ_j^h⟩ = (o_i W_O^{hᵀ})·v_j``. Nothing of size ``Q x S x D`` is ever formed.
"""

from __future__ import annotations

import torch

METRICS = ("attention", "value_weighted", "output_normalized", "contribution", "contribution_inter")
"""Per-head importance maps of SPEC §2, in the order the papers rank them."""


def head_blocks(w_o: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``W_O^h`` for every head: ``[D, H*d]`` -> ``[H, d, D]`` (row vectors map head space to model space)."""
    D, Hd = w_o.shape
    d = Hd // num_heads
    return w_o.t().reshape(num_heads, d, D)


def gram(w_o: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``G^h = W_O^h W_O^hᵀ``: ``[D, H*d]`` -> ``[H, d, d]``."""
    W = head_blocks(w_o, num_heads)
    return W @ W.transpose(1, 2)


def quad(x: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``xᵀ G x`` per head: ``x [B, H, N, d]``, ``G [H, d, d]`` -> ``[B, H, N]`` (clamped at 0)."""
    return ((x @ G) * x).sum(-1).clamp_min(0.0)


def projected_value_norm(v: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``‖ṽ_j^h‖``: ``v [B, H, S, d]`` -> ``[B, H, S]``."""
    return quad(v, G).sqrt()


def head_output(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Head output in head space ``u_i^h = Σ_j a_ij^h v_j^h``: -> ``[B, H, Q, d]``."""
    return a @ v


def head_output_norm(u: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``‖o_i^h‖ = ‖u_i^h W_O^h‖``: ``u [B, H, Q, d]`` -> ``[B, H, Q]``."""
    return quad(u, G).sqrt()


def layer_output(u: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``o_i = Σ_h u_i^h W_O^h`` (before the output-projection bias): -> ``[B, Q, D]``."""
    B, H, Q, d = u.shape
    return u.transpose(1, 2).reshape(B, Q, H * d) @ w_o.t()


def pulled_back_output(o: torch.Tensor, w_o: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``o_i W_O^{hᵀ}`` for every head, so that ``⟨o_i, ṽ_j^h⟩ = pulled·v_j``: ``[B, Q, D]`` -> ``[B, H, Q, d]``."""
    B, Q, D = o.shape
    return (o @ w_o).reshape(B, Q, num_heads, -1).transpose(1, 2)


def _safe_div(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x / y`` where ``y > 0``, else 0 (a zero output has no direction; every weight on it is 0)."""
    return torch.where(y > 0, x / torch.where(y > 0, y, torch.ones_like(y)), torch.zeros_like(x))


def value_weighted(a: torch.Tensor, value_norm: torch.Tensor) -> torch.Tensor:
    """``a_ij^h ‖ṽ_j^h‖``: ``a [B, H, Q, S]``, ``value_norm [B, H, S]`` -> ``[B, H, Q, S]``."""
    return a * value_norm.unsqueeze(-2)


def output_normalized(a: torch.Tensor, value_norm: torch.Tensor, out_norm: torch.Tensor) -> torch.Tensor:
    """``a_ij^h ‖ṽ_j^h‖ / ‖o_i^h‖``: ``out_norm [B, H, Q]`` -> ``[B, H, Q, S]``."""
    return _safe_div(value_weighted(a, value_norm), out_norm.unsqueeze(-1))


def intra_dot(u: torch.Tensor, v: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``⟨o_i^h, ṽ_j^h⟩ = (u_i G)·v_j``: -> ``[B, H, Q, S]``."""
    return (u @ G) @ v.transpose(-1, -2)


def contribution(a: torch.Tensor, u: torch.Tensor, v: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Intra-head contribution ``c_ij^h = ⟨o_i^h, a_ij^h ṽ_j^h⟩ / ‖o_i^h‖²`` -> ``[B, H, Q, S]``.

    Sums to 1 over sources for every head and query with a non-zero output."""
    return _safe_div(a * intra_dot(u, v, G), quad(u, G).unsqueeze(-1))


def contribution_inter(a: torch.Tensor, o: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Inter-head contribution ``C_ij^h = ⟨o_i, a_ij^h ṽ_j^h⟩ / ‖o_i‖²``: ``o [B, Q, D]`` -> ``[B, H, Q, S]``.

    Sums to 1 over heads and sources for every query with a non-zero layer output."""
    H = a.shape[1]
    dots = pulled_back_output(o, w_o, H) @ v.transpose(-1, -2)
    o2 = (o * o).sum(-1)[:, None, :, None]
    return _safe_div(a * dots, o2)


def contribution_factors(a: torch.Tensor, u: torch.Tensor, v: torch.Tensor, G: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three factors of ``c_ij^h = a_ij^h · (‖ṽ_j^h‖/‖o_i^h‖) · cos(o_i^h, ṽ_j^h)``.

    Returns ``{"attention": [B,H,Q,S], "relative_norm": [B,H,Q,S], "cosine": [B,H,Q,S]}``;
    their product equals :func:`contribution`."""
    vn = projected_value_norm(v, G)                 # [B, H, S]
    on = head_output_norm(u, G)                      # [B, H, Q]
    rel = _safe_div(vn.unsqueeze(-2).expand(a.shape), on.unsqueeze(-1).expand(a.shape))
    cos = _safe_div(intra_dot(u, v, G), on.unsqueeze(-1) * vn.unsqueeze(-2))
    return {"attention": a, "relative_norm": rel, "cosine": cos}


def head_share(o: torch.Tensor, u: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``Σ_j C_ij^h = ⟨o_i, o_i^h⟩ / ‖o_i‖²``: -> ``[B, H, Q]`` (sums to 1 over heads)."""
    H = u.shape[1]
    dots = (pulled_back_output(o, w_o, H) * u).sum(-1)
    return _safe_div(dots, (o * o).sum(-1).unsqueeze(1))


def token_scores(name: str, per_head: torch.Tensor) -> torch.Tensor:
    """Token-level score of SPEC §2 from a per-head map ``[B, H, Q, S]`` -> ``[B, Q, S]``.

    ``attention`` is the mean over heads; the other metrics are summed over heads."""
    if name == "attention":
        return per_head.mean(1)
    return per_head.sum(1)


def entropy(a: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each attention row: ``[..., S]`` -> ``[...]``."""
    return -(torch.special.xlogy(a, a)).sum(-1)
