"""Token-importance metrics of SPEC §2, computed in head space.

Pure functions on tensors; no model access here. The metrics' names, labels and needs (the table
every part of attngeom reads) are in :mod:`attngeom.metrics.registry`. Shapes use these letters:

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

import math

import torch

def head_blocks(w_o: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``W_O^h`` for every head: ``[D, H*d]`` -> ``[H, d, D]`` (row vectors map head space to model space)."""
    D, Hd = w_o.shape
    return w_o.t().reshape(num_heads, Hd // num_heads, D)


def full_gram(w_o: torch.Tensor) -> torch.Tensor:
    """``W_Oᵀ W_O`` over all heads: ``[D, H*d]`` -> ``[H*d, H*d]``; block ``(g, h)`` is ``W_O^g W_O^{hᵀ}``."""
    return w_o.t() @ w_o


def gram(w_o: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``G^h = W_O^h W_O^{hᵀ}`` (the diagonal blocks of :func:`full_gram`): -> ``[H, d, d]``."""
    W = head_blocks(w_o, num_heads)
    return W @ W.transpose(1, 2)


def quad(x: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``xᵀ G x`` per head: ``x [B, H, N, d]``, ``G [H, d, d]`` -> ``[B, H, N]`` (clamped at 0)."""
    return ((x @ G) * x).sum(-1).clamp_min(0.0)


def projected_value_norm(v: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``‖ṽ_j^h‖``: ``v [B, H, S, d]`` -> ``[B, H, S]``."""
    return quad(v, G).sqrt()


def head_output(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Head output in head space ``u_i^h = Σ_j a_ij^h v_j^h``: ``a [..., H, Q, S]``, ``v [..., Hg, S, d]``
    -> ``[..., H, Q, d]``. ``v`` holds one value per head (``Hg = H``) or per group of ``H / Hg``
    consecutive query heads sharing them (grouped-query attention): one product per group, the
    values never repeated."""
    *lead, H, Q, S = a.shape
    Hg, d = v.shape[-3], v.shape[-1]
    if Hg == H:
        return a @ v
    return torch.matmul(a.reshape(*lead, Hg, H // Hg * Q, S), v).reshape(*lead, H, Q, d)


def layer_output(u: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``o_i = Σ_h u_i^h W_O^h`` (before the output-projection bias): -> ``[B, Q, D]``."""
    B, H, Q, d = u.shape
    return u.transpose(1, 2).reshape(B, Q, H * d) @ w_o.t()


def projected_values(v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``ṽ_j^h = v_j^h W_O^h`` in model space: ``v [B, H, S, d]`` -> ``[B, H, S, D]``."""
    return torch.einsum("bhsd,hdD->bhsD", v, head_blocks(w_o, v.shape[1]))


def value_cross_products(v: torch.Tensor, w_o: torch.Tensor, chunk_elements: int = 1 << 22) -> torch.Tensor:
    """``⟨ṽ_j^g, ṽ_j^h⟩`` for every source and pair of heads: ``v [B, H, S, d]`` -> ``[B, S, H, H]``
    (the projected values formed for a chunk of sources at a time)."""
    B, H, S, _ = v.shape
    W = head_blocks(w_o, H)
    step = max(1, chunk_elements // max(1, B * H * W.shape[-1]))
    out = v.new_empty(B, S, H, H)
    for s0 in range(0, S, step):
        pv = torch.einsum("bhsd,hdD->bshD", v[:, :, s0:s0 + step], W)
        out[:, s0:s0 + step] = pv @ pv.transpose(-1, -2)
    return out


def pulled_back(u: torch.Tensor, G_full: torch.Tensor) -> torch.Tensor:
    """``p_i^h = o_i W_O^{hᵀ} = Σ_g u_i^g W_O^g W_O^{hᵀ}``, so that ``⟨o_i, ṽ_j^h⟩ = p_i^h·v_j^h``:
    ``u [B, H, Q, d]``, ``G_full [H*d, H*d]`` -> ``[B, H, Q, d]`` (no model-space vector formed)."""
    B, H, Q, d = u.shape
    return (u.transpose(1, 2).reshape(B, Q, H * d) @ G_full).reshape(B, Q, H, d).transpose(1, 2)


def output_sq_norm(u: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``‖o_i‖² = Σ_h ⟨o_i, o_i^h⟩ = Σ_h p_i^h·u_i^h``: -> ``[B, Q]``."""
    return (p * u).sum((1, 3)).clamp_min(0.0)


def safe_div(x: torch.Tensor, y: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x / y`` where ``y > 0``, else ``fill`` (default 0: a zero output has no direction; every
    weight on it is 0)."""
    return torch.where(y > 0, x / y, fill)   # where() selects: the x / 0 elements are never read


def value_weighted(a: torch.Tensor, value_norm: torch.Tensor) -> torch.Tensor:
    """``a_ij^h ‖ṽ_j^h‖``: ``a [B, H, Q, S]``, ``value_norm [B, H, S]`` -> ``[B, H, Q, S]``."""
    return a * value_norm.unsqueeze(-2)


def output_normalized(a: torch.Tensor, value_norm: torch.Tensor, out_norm: torch.Tensor) -> torch.Tensor:
    """``a_ij^h ‖ṽ_j^h‖ / ‖o_i^h‖``: ``out_norm [B, H, Q]`` -> ``[B, H, Q, S]``."""
    return safe_div(value_weighted(a, value_norm), out_norm.unsqueeze(-1))


def contribution_from(a: torch.Tensor, uG: torch.Tensor, v: torch.Tensor, head_out_sq: torch.Tensor) -> torch.Tensor:
    """Intra-head contribution ``c_ij^h = ⟨o_i^h, a_ij^h ṽ_j^h⟩ / ‖o_i^h‖²`` -> ``[B, H, Q, S]``.

    ``uG = u G [B, H, Q, d]`` (so ``⟨o_i^h, ṽ_j^h⟩ = uG_i·v_j``), ``head_out_sq = ‖o_i^h‖² [B, H, Q]``.
    Sums to 1 over sources for every head and query with a non-zero output."""
    return safe_div(a * (uG @ v.transpose(-1, -2)), head_out_sq.unsqueeze(-1))


def contribution_inter_from(a: torch.Tensor, p: torch.Tensor, v: torch.Tensor, out_sq: torch.Tensor) -> torch.Tensor:
    """Inter-head contribution ``C_ij^h = ⟨o_i, a_ij^h ṽ_j^h⟩ / ‖o_i‖²`` -> ``[B, H, Q, S]``.

    ``p`` from :func:`pulled_back`, ``out_sq = ‖o_i‖² [B, Q]``. Sums to 1 over heads and sources
    for every query with a non-zero layer output."""
    return safe_div(a * (p @ v.transpose(-1, -2)), out_sq[:, None, :, None])


def contribution_column(a_col: torch.Tensor, uG: torch.Tensor, v_col: torch.Tensor,
                        head_out_sq: torch.Tensor) -> torch.Tensor:
    """:func:`contribution` for one source ``j``: ``a_col [B, H, Q]``, ``v_col [B, H, d]`` -> ``[B, H, Q]``."""
    return safe_div(a_col * (uG * v_col.unsqueeze(-2)).sum(-1), head_out_sq)


def contribution_inter_column(a_col: torch.Tensor, p: torch.Tensor, v_col: torch.Tensor,
                              out_sq: torch.Tensor) -> torch.Tensor:
    """:func:`contribution_inter` for one source ``j``: -> ``[B, H, Q]``."""
    return safe_div(a_col * (p * v_col.unsqueeze(-2)).sum(-1), out_sq.unsqueeze(1))


def contribution_factors_from(a: torch.Tensor, uG: torch.Tensor, v: torch.Tensor, value_norm: torch.Tensor,
                         head_out_norm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three factors of ``c_ij^h = a_ij^h · (‖ṽ_j^h‖/‖o_i^h‖) · cos(o_i^h, ṽ_j^h)``.

    Returns ``{"attention", "relative_norm", "cosine"}``, each ``[B, H, Q, S]``; their product
    equals :func:`contribution_from`."""
    vn = value_norm.unsqueeze(-2).expand(a.shape)
    on = head_out_norm.unsqueeze(-1).expand(a.shape)
    rel = safe_div(vn, on)
    cos = safe_div(uG @ v.transpose(-1, -2), on * vn)
    return {"attention": a, "relative_norm": rel, "cosine": cos}


def head_share_from(u: torch.Tensor, p: torch.Tensor, out_sq: torch.Tensor) -> torch.Tensor:
    """``Σ_j C_ij^h = ⟨o_i, o_i^h⟩ / ‖o_i‖² = p_i^h·u_i^h / ‖o_i‖²``: -> ``[B, H, Q]`` (sums to 1 over heads)."""
    return safe_div((p * u).sum(-1), out_sq.unsqueeze(1))


# ---- the same metrics from the plain pieces (a, v, G, w_o), as the SPEC writes them -------------


def head_output_norm(u: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``‖o_i^h‖ = ‖u_i^h W_O^h‖``: ``u [B, H, Q, d]`` -> ``[B, H, Q]``."""
    return quad(u, G).sqrt()


def pulled_back_output(o: torch.Tensor, w_o: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``o_i W_O^{hᵀ}`` for every head from the model-space output: ``[B, Q, D]`` -> ``[B, H, Q, d]``."""
    B, Q, D = o.shape
    return (o @ w_o).reshape(B, Q, num_heads, -1).transpose(1, 2)


def contribution(a: torch.Tensor, u: torch.Tensor, v: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Intra-head contribution from ``a [B,H,Q,S]``, ``u = a v [B,H,Q,d]``, ``v [B,H,S,d]``, ``G [H,d,d]``."""
    return contribution_from(a, u @ G, v, quad(u, G))


def contribution_inter(a: torch.Tensor, o: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Inter-head contribution from the model-space layer output ``o [B, Q, D]`` and ``w_o [D, H*d]``."""
    return contribution_inter_from(a, pulled_back_output(o, w_o, a.shape[1]), v, (o * o).sum(-1))


def contribution_factors(a: torch.Tensor, u: torch.Tensor, v: torch.Tensor, G: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three factors of the intra-head contribution (see :func:`contribution_factors_from`)."""
    return contribution_factors_from(a, u @ G, v, projected_value_norm(v, G), head_output_norm(u, G))


def head_share(o: torch.Tensor, u: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``Σ_j C_ij^h = ⟨o_i, o_i^h⟩ / ‖o_i‖²`` from the model-space output: -> ``[B, H, Q]``."""
    return head_share_from(u, pulled_back_output(o, w_o, u.shape[1]), (o * o).sum(-1))


def received(a: torch.Tensor, weight: torch.Tensor, names, *, v: torch.Tensor | None = None,
             value_norm: torch.Tensor | None = None, head_out_norm: torch.Tensor | None = None,
             p: torch.Tensor | None = None, out_sq: torch.Tensor | None = None,
             v_t: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """What each source receives, ``Σ_i w_i s_ij`` for the token-level scores ``s`` of SPEC §2
    named in ``names`` (a subset of ``attention``, ``value_weighted``, ``output_normalized`` and
    ``contribution``: the metrics :mod:`attngeom.metrics.registry` flags ``received``), without forming any score map:
    -> ``{metric: [B, S]}``. Only the pieces those metrics use need be given.

    ``weight [B, Q]`` weighs the queries (e.g. 0 for padding). Every sum over queries is a row of one
    ``Xᵀa`` product: ``Σ_i w_i a_ij^h (p_i^h·v_j^h)/‖o_i‖² = v_j^h · (Xᵀ a)_j`` with
    ``X = w p/‖o‖²``, and likewise ``w`` (attention, value-weighted) and ``w/‖o_i^h‖``
    (output-normalised).

    ``v [B, Hg, S, d]``: one value per head (``Hg = H``) or per group of ``n_rep = H / Hg``
    consecutive query heads (grouped-query attention, never repeated). The heads of a group share
    ``v_j``, so their contribution rows are summed inside one product (``[X^{h1}ᵀ … X^{hr}ᵀ]
    [a^{h1}; …; a^{hr}]``, the heads stacked along the queries): the same arithmetic, an ``n_rep``
    times smaller ``[B, Hg, d, S]`` result. When a group has fewer stacked queries than dimensions
    (:func:`contribution_by_map`: a decoding step, or full multi-head attention in blocks of few
    queries), the ``[n_rep·Q, S]`` product ``X vᵀ`` per group is the smaller one and is used
    instead: ``Σ_i a_ij (X vᵀ)_ij``, the same sum in the other order. ``v_t``: optionally ``v``
    transposed and contiguous along the sources (``[B, Hg, d, S]``, e.g. a slice of one copy per
    layer), so that ``v_j · (Xᵀa)_j`` reads both operands in order: a strided ``vᵀ`` costs this
    last step about twice as much."""
    B, H, Q, S = a.shape
    names = tuple(names)
    rows = []                                                                # pieces of Xᵀ: [B, H, k, Q]
    plain = "attention" in names or "value_weighted" in names
    if plain:
        rows.append(weight[:, None, None, :].expand(B, H, 1, Q))
    if "output_normalized" in names:
        rows.append((weight[:, None, :] * safe_div(torch.ones_like(head_out_norm), head_out_norm)).unsqueeze(2))
    out: dict[str, torch.Tensor] = {}
    if rows:
        Rt = (rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)) @ a     # [B, H, k, S]
        if plain:
            att = Rt[:, :, 0]
            if "attention" in names:
                out["attention"] = att.mean(1)
            if "value_weighted" in names:
                out["value_weighted"] = (att * value_norm).sum(1)
        if "output_normalized" in names:
            out["output_normalized"] = (Rt[:, :, -1] * value_norm).sum(1)
    if "contribution" in names:
        n_groups, d = v.shape[1], p.shape[-1]
        n_rep = H // n_groups
        X = p * safe_div(weight, out_sq)[:, None, :, None]                  # [B, H, Q, d]
        Xg = X.reshape(B, n_groups, n_rep * Q, d)                            # a group's heads stacked
        if contribution_by_map(n_rep, Q, d):
            out["contribution"] = (a.reshape(B, n_groups, n_rep * Q, S) * (Xg @ v.transpose(-1, -2))).sum(2).sum(1)
        else:
            Rc = Xg.transpose(-1, -2) @ a.reshape(B, n_groups, n_rep * Q, S)       # [B, Hg, d, S]
            out["contribution"] = (Rc * (v.transpose(-1, -2) if v_t is None else v_t)).sum((1, 2))
    return {n: out[n] for n in names}


def received_row(a: torch.Tensor, p: torch.Tensor, out_sq: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What one query's row gives each source by the token-level ``attention`` and ``contribution``
    of SPEC §2 (:func:`received` with the weight 1 on that query alone, in a third of its
    operations: a decoding step's answer tables compute one such row per layer and token):
    ``a [H, S]``, ``p [H, d]`` the pulled-back output, ``out_sq`` ``‖o‖²`` (a 0-d tensor),
    ``v [Hg, S, d]`` (one value per head or per group of ``H / Hg`` consecutive heads) ->
    ``[2, S]``: ``(mean_h a_j^h, C_j = Σ_h a_j^h (p^h·v_j^h)/‖o‖²)``."""
    H, S = a.shape
    Hg, d = v.shape[0], p.shape[-1]
    X = safe_div(p, out_sq)                                                  # [H, d]
    pv = (X.view(Hg, H // Hg, d) @ v.transpose(-1, -2)).view(H, S)          # p^h·v_j^h / ‖o‖²
    return torch.stack([a.mean(0), (a * pv).sum(0)])


def contribution_by_map(n_rep: int, Q: int, d: int) -> bool:
    """Whether :func:`received` sums the contribution over queries by the per-head ``[Q, S]`` product
    ``X vᵀ`` (True) or by the grouped ``[d, S]`` product ``Xᵀa`` (False): the one with the smaller
    result, i.e. the map when the ``n_rep·Q`` queries of a group are fewer than the ``d`` dimensions.
    The per-block timings of both products that set this rule are in docs/benchmark-analyze.md
    ("Measurements behind constants of the code")."""
    return n_rep * Q < d


def token_scores(per_head: torch.Tensor, heads: str = "sum") -> torch.Tensor:
    """Token-level score of SPEC §2 from a per-head map ``[B, H, Q, S]`` -> ``[B, Q, S]``:
    the sum over heads, or the mean (``heads="mean"``, the ``attention`` score)."""
    return per_head.mean(1) if heads == "mean" else per_head.sum(1)


LSE_REFERENCE_MIN = 2.0 ** -24
"""The smallest probability :func:`entropy_from_logits` reads a row's ``lse`` from (``s_ij − log a_ij``):
below it a float32 ``a_ij`` has lost precision to its logit's rounding, and the row maximum is used."""


def entropy_from_logits(a: torch.Tensor, scores: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy (nats) of each row of ``a = softmax(scores)`` from the logits: ``[..., S]`` -> ``[...]``.

    ``log a_ij = s_ij − lse_i`` for every source ``j``, so ``−Σ_j a_ij log a_ij = lse_i Σ_j a_ij −
    Σ_j a_ij s_ij``: one fused product per row instead of a logarithm per element. ``lse_i = s_ij −
    log a_ij`` is read at one column ``j``: the larger of the candidate columns ``reference [..., k]``
    (e.g. a query's own column and the first source, where attention mostly sits: two gathers instead
    of two passes over the row), or the row maximum (``lse_i = max_j s_ij − log max_j a_ij``) when no
    reference is given or the best candidate holds less than :data:`LSE_REFERENCE_MIN`. Masked sources
    hold ``a = 0`` and a finite (very negative) logit. Clamped to ``[0, log S]``, the range of an
    entropy over ``S`` sources (a row with no visible source has no meaning)."""
    def lse_from_maxima():
        return scores.amax(-1) - torch.log(a.amax(-1))

    if reference is None:
        lse = lse_from_maxima()
    else:
        a_ref, s_ref = a.gather(-1, reference), scores.gather(-1, reference)
        best = a_ref.argmax(-1, keepdim=True)
        a_best = a_ref.gather(-1, best).squeeze(-1)
        lse = s_ref.gather(-1, best).squeeze(-1) - torch.log(a_best)
        low = a_best < LSE_REFERENCE_MIN
        if a.device.type != "cpu" or bool(low.any()):   # rare on the CPU; no host sync on an accelerator
            lse = torch.where(low, lse_from_maxima(), lse)
    h = lse * a.sum(-1) - torch.einsum("...j,...j->...", a, scores)  # einsum: no [..., S] product formed
    return h.clamp(0.0, math.log(a.shape[-1]))


def entropy(a: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each attention row: ``[..., S]`` -> ``[...]``."""
    return -(torch.special.xlogy(a, a)).sum(-1)
