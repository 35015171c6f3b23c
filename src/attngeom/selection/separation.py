"""Geometry of token selection (SPEC §5): precision, recall and F of top-N selections.

For one query ``t`` of one layer and every head ``h`` (vectorised over heads and over ``N``), with
``a [H, S]`` the attention row over the query's candidate sources and ``v [H, S, d]`` their value
states in head space: the attention-scaled values ``y_j = a_tj v_j``, the selections (top-``N``
by attention, ties to the earlier position; the same without the sink; seeded random subsets) and
``s_N``, ``D_j``, ``P_N``, ``R_N``, ``F_N``, ``GInv_N`` and their bounds are defined in SPEC §5.
``N`` runs over ``1, 2, 4, …, 256`` below the number of candidates.

Everything is computed from three quantities per selection: ``⟨s_N, y_j⟩``, ``‖s_N‖²`` and
``‖y_j‖²``. From vectors they come from prefix sums of the ``y``'s in selection order; from a Gram
matrix ``K_jk = ⟨y_j, y_k⟩`` (the sink-aware prediction, :mod:`attngeom.selection.prediction`) from
prefix sums of its rows. The same scoring code then serves measurement and prediction.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from attngeom.errors import InputError
from attngeom.selection.settings import DISTANCES, POWERS

SELECTION_KINDS = ("topn", "random", "topn_nosink", "random_nosink")
COSINE_GUARD = 1e-12
"""Added to the product of norms in the cosine distance, so that a zero vector is at distance 1, not NaN."""


def default_ns(count: int, ns: Sequence[int] = POWERS) -> list[int]:
    """The sizes of ``ns`` below ``count`` candidates."""
    return [int(n) for n in ns if 1 <= n < count]


def check_ns(ns: Iterable[int], window: int) -> list[int]:
    """Validate user sizes against the window length (before any compute)."""
    ns = sorted(set(int(n) for n in ns))
    if not ns:
        raise InputError("no selection size N given")
    bad = [n for n in ns if n < 1]
    if bad:
        raise InputError(f"N must be at least 1, got {bad[0]}")
    too_big = [n for n in ns if n >= window]
    if too_big:
        raise InputError(f"N={too_big[0]} is not below the window length {window}: a query sees at most "
                         f"{window} sources, and a selection must leave at least one out")
    return ns


# --------------------------------------------------------------------------------------------
# Selection orders
# --------------------------------------------------------------------------------------------


def topn_order(a: torch.Tensor) -> torch.Tensor:
    """Sources by decreasing attention, ties to the earlier position: ``[..., S]`` -> indices."""
    return torch.sort(a, dim=-1, descending=True, stable=True).indices


def random_orders(shape: tuple[int, ...], S: int, generator: torch.Generator) -> torch.Tensor:
    """Independent uniform random permutations of ``S`` sources: ``[*shape, S]``."""
    return torch.rand(*shape, S, generator=generator, dtype=torch.float64).argsort(-1)


def ranks_of(order: torch.Tensor) -> torch.Tensor:
    """Inverse permutation: ``rank[..., order[..., r]] = r``."""
    rank = torch.empty_like(order)
    ar = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank.scatter_(-1, order, ar)
    return rank


# --------------------------------------------------------------------------------------------
# The geometry of one batch of selections
# --------------------------------------------------------------------------------------------


def _distances(dots: torch.Tensor, ss: torch.Tensor, yy: torch.Tensor, distance: str) -> torch.Tensor:
    """``D [M, K, S]`` from ``dots = ⟨s_N, y_j⟩ [M, K, S]``, ``ss = ‖s_N‖² [M, K]``, ``yy = ‖y_j‖² [M, S]``."""
    if distance == "euclidean":
        return (yy[:, None, :] + ss[:, :, None] - 2 * dots).clamp_min(0).sqrt()
    if distance == "cosine":
        return 1 - dots / (yy.clamp_min(0).sqrt()[:, None, :] * ss.clamp_min(0).sqrt()[:, :, None] + COSINE_GUARD)
    raise InputError(f"unknown distance {distance!r}; choose from {', '.join(DISTANCES)}")


def scores(D: torch.Tensor, order: torch.Tensor, ns: Sequence[int]) -> dict[str, torch.Tensor]:
    """P, R, F, GInv, ρ_max, ρ_min for distances ``D [M, K, S]``; the selection of size ``ns[k]`` is
    the first ``ns[k]`` sources of ``order [M, S]``. Every result is ``[M, K]``, on ``D``'s device
    (the sizes are Python integers: nothing is read back from the device).

    Counting, not sorting all sources: with ``U`` the unselected distances, ``ρ_min = min U``,
    ``|{j∉S : D_j <= ρ_max}|`` is a comparison over ``U`` and ``R_N`` counts the selected ``i`` with
    ``D_i < ρ_min``. ``GInv_N = Σ_{j∉S} |{i∈S : D_i >= D_j}|`` (the same pairs ``D_j <= D_i``,
    counted from the other side) is one binary search of every ``D_j`` among the ``N`` sorted selected
    distances (a comparison with each of them, for ``N <=`` :data:`COMPARE_MAX_N`), so only ``max(N)``
    values per row are sorted."""
    M, K, S = D.shape
    ns = [int(n) for n in ns]
    top = max(ns)
    nt = torch.as_tensor(ns, device=D.device)
    N = nt.to(D.dtype)[None, :]
    idx = order[:, None, :top].expand(M, K, top)
    d_sel = D.gather(-1, idx)                                               # [M, K, top]
    valid = torch.arange(top, device=D.device)[None, None, :] < nt[None, :, None]
    unsel = D.scatter(-1, idx, torch.where(valid, torch.full_like(d_sel, math.inf), d_sel))  # selected -> +inf
    rho_min = unsel.amin(-1)
    sel_sorted = d_sel.masked_fill(~valid, -math.inf).sort(-1).values      # padding -> -inf, first
    rho_max = sel_sorted[..., -1]
    false_pos = (unsel <= rho_max[..., None]).sum(-1)
    true_pos = ((d_sel < rho_min[..., None]) & valid).sum(-1)
    ginv = torch.stack([_pairs_at_or_above(unsel[:, k], sel_sorted[:, k, top - n:])   # 0 at +inf
                        for k, n in enumerate(ns)], 1)
    P = N / (N + false_pos.to(D.dtype))
    R = true_pos.to(D.dtype) / N
    F = 2 * P * R / (P + R)  # P > 0 always
    return {"P": P, "R": R, "F": F, "ginv": ginv, "rho_max": rho_max, "rho_min": rho_min}


COMPARE_MAX_N = 32
"""Up to this many selected distances GInv compares every pair; beyond, it binary-searches."""
COMPARE_ELEMENTS = 1 << 20
"""Pairs compared per chunk: a larger boolean temporary leaves the cache (and, past a few MB, costs
fresh pages on every call); measured in docs/benchmark-analyze.md ("Measurements behind constants")."""


def _pairs_at_or_above(u: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``Σ_j |{i : sel_i >= u_j}|`` per row: ``u [M, S]`` the unselected distances, ``sel [M, n]`` the
    selected ones sorted ascending -> ``[M]`` int64. Few selected: every pair compared, in chunks of
    rows of at most :data:`COMPARE_ELEMENTS` pairs; more: one binary search of every ``u_j``."""
    M, S = u.shape
    n = sel.shape[1]
    if n > COMPARE_MAX_N:
        return (n - torch.searchsorted(sel.contiguous(), u.contiguous())).sum(-1)
    step = max(1, COMPARE_ELEMENTS // max(1, n * S))
    return torch.cat([(u[r:r + step, None, :] <= sel[r:r + step, :, None]).sum((-1, -2))
                      for r in range(0, M, step)])


def _selection_masks(order: torch.Tensor, ns: Sequence[int]) -> torch.Tensor:
    """``sel [M, K, S]``: source ``j`` is among the first ``N_k`` of ``order``."""
    return ranks_of(order)[:, None, :] < torch.as_tensor(ns, device=order.device)[None, :, None]


GEOMETRY_ELEMENTS = 1 << 16
"""Distances ``[rows, K, S]`` computed at a time by :func:`geometry` (whole sets of ``n_sets`` rows,
at least one): 512 KiB in float64, so that the dozen passes over them stay in the cache and no large
temporary is paged in afresh (all rows at once against one set at a time, measured in
docs/benchmark-analyze.md, "Measurements behind constants"). The chunks change only how the
``⟨s_N, y_j⟩`` products are batched, i.e. their last bits."""


def geometry(y: torch.Tensor, order: torch.Tensor, ns: Sequence[int],
             distances: Sequence[str] = DISTANCES) -> dict[str, dict[str, torch.Tensor]]:
    """Selection geometry from vectors. ``y [n_sets, S, d]`` attention-scaled values (``n_sets`` sets
    of values), ``order [M, S]`` with ``M`` a multiple of ``n_sets`` (row ``m`` orders the sources of
    ``y[m % n_sets]``; so several selections of the same heads, e.g. random repeats, share one
    ``y``): a permutation of the sources, a selection of size N being its first N entries; ``ns``
    sizes ``< S``.

    Returns ``{distance: {"P"|"R"|"F"|"ginv"|"rho_max"|"rho_min": [M, K]}}``. Every row is computed
    on its own, so the rows are taken a few whole sets of ``n_sets`` at a time
    (:data:`GEOMETRY_ELEMENTS`)."""
    n_sets, S, d = y.shape
    M = order.shape[0]
    if M % n_sets:
        raise ValueError(f"{M} orders for {n_sets} value sets: not a multiple")
    ns = [int(n) for n in ns]
    yy = (y * y).sum(-1)
    step = n_sets * max(1, GEOMETRY_ELEMENTS // (n_sets * len(ns) * S))
    parts = [_geometry_rows(y, yy, order[m0:m0 + step], ns, distances) for m0 in range(0, M, step)]
    if len(parts) == 1:
        return parts[0]
    return {dist: {k: torch.cat([p[dist][k] for p in parts]) for k in parts[0][dist]} for dist in distances}


def _geometry_rows(y: torch.Tensor, yy: torch.Tensor, order: torch.Tensor, ns: list[int],
                   distances: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`geometry` of ``order [C·n_sets, S]`` (whole sets of ``n_sets`` rows);
    ``yy [n_sets, S] = ‖y_j‖²``."""
    n_sets, S, d = y.shape
    M = order.shape[0]
    C = M // n_sets
    K, top = len(ns), max(ns)
    src = torch.arange(M, device=y.device) % n_sets
    ys = y[src[:, None], order[:, :top]]                          # only the first max(N) are ever summed
    s = ys.cumsum(1)[:, [n - 1 for n in ns]]                      # s_N: [M, K, d]
    dots = torch.matmul(s.reshape(C, n_sets, K, d), y.transpose(1, 2)).reshape(M, K, S)
    ss = (s * s).sum(-1)
    return _scores_per_distance(dots, ss, yy.repeat(C, 1), order, ns, distances)


def geometry_from_rows(rows: torch.Tensor, diag: torch.Tensor, order: torch.Tensor, ns: Sequence[int],
                       distances: Sequence[str] = DISTANCES) -> dict[str, dict[str, torch.Tensor]]:
    """Selection geometry from Gram rows in selection order: ``rows [M, n, S]`` with
    ``rows[m, r] = K[m, order[m, r]]`` for ``r < n`` (``n >= max(ns)``), ``diag [M, S] = K_jj``."""
    ns = [int(n) for n in ns]
    # Σ_{i∈S_N} K_ij: [M, K, S], as running sums of the segments between consecutive sizes (the
    # prefix sums at the K sizes only, never all max(N) of them)
    prefix, total, start = {}, torch.zeros_like(rows[:, 0]), 0
    for n in sorted(set(ns)):
        total = total + rows[:, start:n].sum(1)
        prefix[n], start = total, n
    dots = torch.stack([prefix[n] for n in ns], 1)
    sel = _selection_masks(order, ns)
    ss = (dots * sel).sum(-1)
    return _scores_per_distance(dots, ss, diag, order, ns, distances)


def _scores_per_distance(dots: torch.Tensor, ss: torch.Tensor, yy: torch.Tensor, order: torch.Tensor,
                         ns: list[int], distances: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`scores` for every distance from one ``(dots, ss, yy)`` (shapes of :func:`_distances`),
    in ONE call: the distances' ``D`` stacked along the rows (every score is per row, so the results
    are those of one call per distance, with half the small operations)."""
    M = order.shape[0]
    if not distances:
        return {}
    D = torch.cat([_distances(dots, ss, yy, dist) for dist in distances])
    r = scores(D, order.repeat(len(distances), 1), ns)
    return {dist: {k: x[i * M:(i + 1) * M] for k, x in r.items()} for i, dist in enumerate(distances)}


def geometry_from_gram(K: torch.Tensor, order: torch.Tensor, ns: Sequence[int],
                       distances: Sequence[str] = DISTANCES) -> dict[str, dict[str, torch.Tensor]]:
    """Selection geometry from a Gram matrix ``K [M, S, S]`` (``K_jk = ⟨y_j, y_k⟩``); otherwise as
    :func:`geometry` (equal to it for ``K = y yᵀ``)."""
    M, S, _ = K.shape
    top = max(ns)
    rows = K.gather(1, order[:, :top, None].expand(M, top, S))
    return geometry_from_rows(rows, K.diagonal(dim1=1, dim2=2), order, ns, distances)


def bound_violations(r: dict[str, torch.Tensor], ns: Sequence[int], tol: float = 1e-9) -> int:
    """How many selections break a bound of SPEC §5 (must be 0)."""
    return int(violated_bounds(r, ns, tol))


def violated_bounds(r: dict[str, torch.Tensor], ns: Sequence[int], tol: float = 1e-9) -> torch.Tensor:
    """:func:`bound_violations` as a 0-d tensor on the results' device (nothing read back)."""
    N = torch.as_tensor(list(ns), dtype=r["P"].dtype, device=r["P"].device)[None, :]
    g = r["ginv"].to(r["P"].dtype)
    bad_p = r["P"] < N / (N + g) - tol
    bad_r = r["R"] < (1 - g / N).clamp_min(0) - tol
    perfect = (r["P"] == 1) & (r["R"] == 1)
    bad_eq = (g == 0) != perfect
    return (bad_p | bad_r | bad_eq).sum()
