"""The one table of token-importance metrics (SPEC §2), and the block quantities they need.

What belongs here: the *names* of things and what each is computed from. The mathematics lives
in :mod:`attngeom.metrics.formulas`; :class:`~attngeom.capture.blocks.Block` computes the quantities. Everything
that offers a metric by name reads this table:

- ``Block.metric(name)`` / ``block.<name>`` and ``Block.token_score(name)``;
- ``LayerTrace.metric(name)`` / ``layer_trace.<name>`` and ``LayerTrace.token_score(name)``;
- the rankings of the interventions (``interventions.RANK_METRICS``, SPEC §3) and so the CLI's
  ``--metrics`` choices;
- the reports' labels (:func:`label`);
- the lists of metrics other modules need, from flags on the entries: what
  ``Block.received`` sums in one product and :class:`~attngeom.streaming.reducers.TokenStats` reports
  (:func:`received_names`), the paper's faithfulness hierarchy (:func:`hierarchy`: the claims and
  the faithfulness experiment's default rankings).

Adding a metric is one :func:`register` call (``Metric(name, label, per_head, needs, ...)``) and its
test; see ``tests/unit/test_registry.py``, which registers a toy metric and finds it everywhere.

**Quantities and needs.** :data:`QUANTITIES` names every quantity a block can compute, with the
quantities it is computed from. A reducer (observer) declares what it reads as a class or instance
attribute ``needs`` (a set of quantity or metric names); :func:`closure` expands it. The capture
computes quantities lazily, so a reducer that asks only attention-level quantities (attention,
entropy, attention received) never triggers a head-space product (anything computed with the
output projection ``W_O``: projected value norms, ``u G``, ``p = o W_Oᵀ``, layer outputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from attngeom.metrics import alti, gradient, leave_one_out, rollout, value_zeroing

if TYPE_CHECKING:  # pragma: no cover
    import torch


# --------------------------------------------------------------------------------------------
# Quantities a block computes: name -> the quantities it is computed from
# --------------------------------------------------------------------------------------------

QUANTITIES: dict[str, tuple[str, ...]] = {
    # attention level: from the attention probabilities (and the logits) alone
    "attention": (),                                   # a_ij^h
    "entropy": ("attention",),                         # -Σ_j a_ij log a_ij
    "raw_value_norm": (),                              # ‖v_j^h‖ (head space, no W_O)
    "head_output": ("attention",),                     # u_i^h = Σ_j a_ij v_j (the module's own output)
    # head space: through the output projection W_O
    "value_norm": (),                                  # ‖ṽ_j^h‖ = sqrt(v G v)
    "uG": ("head_output",),                            # u_i^h G^h
    "head_output_sq": ("uG",),                         # ‖o_i^h‖²
    "head_output_norm": ("head_output_sq",),           # ‖o_i^h‖
    "pulled_back": ("head_output",),                   # p_i^h = o_i W_O^{hᵀ}
    "head_dot_output": ("pulled_back",),               # ⟨o_i, o_i^h⟩
    "output_sq": ("head_dot_output",),                 # ‖o_i‖²
    "output_norm": ("output_sq",),                     # ‖o_i‖
    "head_share": ("head_dot_output", "output_sq"),    # Σ_j C_ij^h
    "layer_output": ("head_output",),                  # o_i in model space
}

HEAD_SPACE = frozenset({"value_norm", "uG", "head_output_sq", "head_output_norm", "pulled_back",
                        "head_dot_output", "output_sq", "output_norm", "head_share", "layer_output"})
"""Quantities computed with the output projection ``W_O`` (the head-space products)."""

ATTENTION_LEVEL = frozenset(QUANTITIES) - HEAD_SPACE


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One per-head importance map ``[B, H, Q, S]`` of a block, and how it ranks at token level.

    ``per_head(block)`` computes the map from the block's quantities (``needs``); None for a
    measure defined on the layer only (it has a token-level score, ``token``, and no per-head map:
    per-head rankings refuse it). ``token(block)``: the token-level score ``[B, Q, S]`` computed
    directly, for measures whose layer form is not a sum or mean of their per-head maps (value
    zeroing of every head, ALTI); None: combined from ``token_map``'s per-head map.
    ``token_map`` names the metric whose per-head map gives the token-level score (default: this
    one; ``contribution`` ranks tokens by the inter-head map, ``C_ij = Σ_h C_ij^h``), and
    ``heads`` how the heads are combined: ``"sum"`` or ``"mean"``. ``rank``: offered as a ranking
    of the interventions (and the CLI). ``label`` is what reports print.

    Flags that place a metric in the lists other modules read (so no module spells them out):
    ``received``: :func:`attngeom.metrics.formulas.received` sums its token-level score over queries without
    a score map (the built-in one-product path; :func:`received_names`); ``hierarchy``: its place in
    the contribution-weights paper's faithfulness hierarchy, 0 = least faithful (:func:`hierarchy`:
    the claims' hierarchy and the faithfulness experiment's default rankings). ``token_latex``: the
    token-level score as the figures print it (matplotlib mathtext). ``rival``: the citation of a
    published measure that accounts for values, set against contribution in the faithfulness
    head-to-head (:func:`rivals`; the claims "contribution is more faithful than X").

    ``prepare``: a measure computed before the forward that ranks by it, from the clean forward of
    the same tokens, names the pass that computes it (``"gradient"``: a backward pass;
    ``"rollout:<metric>"``: that metric's token-level maps composed over the layers), run by
    :func:`attngeom.capture.prepared.prepare`; its maps (``[1, H, T, T]`` per head, ``[1, T, T]`` on the
    layer) are handed to that forward's session (``Session(prepared=...)``) and the block reads them by
    position (:meth:`~attngeom.capture.blocks.Block.prepared`); a forward without them refuses the
    measure in one line."""

    name: str
    label: str
    per_head: Callable[..., "torch.Tensor"] | None
    needs: frozenset[str]
    heads: str = "sum"
    token_map: str | None = None
    rank: bool = True
    formula: str = ""
    received: bool = False
    hierarchy: int | None = None
    token_latex: str = ""
    token: Callable[..., "torch.Tensor"] | None = None
    rival: str = ""
    prepare: str | None = None

    @property
    def layer_only(self) -> bool:
        """Defined on the layer: a token-level score and no per-head map."""
        return self.per_head is None

    def __post_init__(self):
        if self.per_head is None and self.token is None:
            raise ValueError(f"metric {self.name!r} needs a per-head map or a token-level function")
        if self.heads not in ("sum", "mean"):
            raise ValueError(f"heads must be 'sum' or 'mean', got {self.heads!r}")
        unknown = set(self.needs) - set(QUANTITIES) - set(METRICS)
        if unknown:
            raise ValueError(f"metric {self.name!r} needs unknown quantities {sorted(unknown)}")


METRICS: dict[str, Metric] = {}
"""Every metric by name, in the order the papers rank them (registration order)."""


def register(metric: Metric) -> Metric:
    """Add ``metric`` to the table (replacing one of the same name). Returns it."""
    if not metric.name.isidentifier() or metric.name.startswith("_"):
        raise ValueError(f"a metric name must be a public Python identifier, got {metric.name!r}")
    METRICS[metric.name] = metric
    return metric


def unregister(name: str) -> None:
    """Remove a metric (tests that register toy metrics clean up with this)."""
    METRICS.pop(name, None)


def get(name: str) -> Metric:
    """The metric called ``name``; ``KeyError`` naming the known ones otherwise."""
    try:
        return METRICS[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(METRICS)}") from None


def names() -> tuple[str, ...]:
    return tuple(METRICS)


def rank_names() -> tuple[str, ...]:
    """Metrics an intervention may rank by (the ``random`` ranking is added by the interventions)."""
    return tuple(n for n, m in METRICS.items() if m.rank)


def received_names() -> tuple[str, ...]:
    """Metrics whose sums over queries :func:`attngeom.metrics.formulas.received` computes without a score map
    (the token-level scores of SPEC §2 a :class:`~attngeom.streaming.reducers.TokenStats` reports by default)."""
    return tuple(n for n, m in METRICS.items() if m.received)


def hierarchy() -> tuple[str, ...]:
    """The contribution-weights paper's faithfulness hierarchy, least faithful first (the metrics
    with a ``hierarchy`` place, in that order)."""
    ranked = [(m.hierarchy, n) for n, m in METRICS.items() if m.hierarchy is not None]
    return tuple(n for _, n in sorted(ranked))


def rivals() -> tuple[str, ...]:
    """The published value-aware measures set against contribution in the faithfulness head-to-head
    (the metrics with a ``rival`` citation, in registration order)."""
    return tuple(n for n, m in METRICS.items() if m.rival)


def prepared_names(names: Iterable[str]) -> tuple[str, ...]:
    """Those of ``names`` that are registry metrics computed before the forward (``prepare``)."""
    return tuple(n for n in dict.fromkeys(names) if n in METRICS and METRICS[n].prepare is not None)


def per_head_names() -> tuple[str, ...]:
    """Metrics with a per-head map (every one but the layer-only measures)."""
    return tuple(n for n, m in METRICS.items() if not m.layer_only)


def label(name: str) -> str:
    """What reports print for a metric (the name itself for anything not in the table)."""
    m = METRICS.get(name)
    return m.label if m is not None else name


def closure(needs: Iterable[str]) -> frozenset[str]:
    """Every quantity ``needs`` (quantity or metric names) is computed from, itself included."""
    out: set[str] = set()
    todo = list(needs)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        if n in QUANTITIES:
            todo.extend(QUANTITIES[n])
        elif n in METRICS:
            m = METRICS[n]
            todo.extend(m.needs)
            if m.token_map and m.token_map != n:
                todo.append(m.token_map)
        else:
            raise KeyError(f"unknown quantity or metric {n!r}")
    return frozenset(out)


def needs_of(observers: Iterable[object]) -> frozenset[str] | None:
    """The union of the observers' ``needs`` (expanded), or None when one of them declares none
    (it may read anything; the block still computes only what is read)."""
    out: set[str] = set()
    for obs in observers:
        n = getattr(obs, "needs", None)
        if n is None:
            return None
        out |= closure(n)
    return frozenset(out)


# --------------------------------------------------------------------------------------------
# The five metrics of SPEC §2
# --------------------------------------------------------------------------------------------

register(Metric("attention", "attention", lambda b: b.a, frozenset({"attention"}), heads="mean",
                formula="a_ij^h", received=True, hierarchy=0, token_latex=r"mean over heads of $a_{ij}^h$"))
register(Metric("value_weighted", "value-weighted", lambda b: b.map_value_weighted(),
                frozenset({"attention", "value_norm"}), formula="a_ij^h ‖ṽ_j^h‖", received=True, hierarchy=1,
                token_latex=r"$\Sigma_h a_{ij}^h\,\|\tilde v_j^h\|$"))
register(Metric("output_normalized", "output-normalised", lambda b: b.map_output_normalized(),
                frozenset({"attention", "value_norm", "head_output_norm"}),
                formula="a_ij^h ‖ṽ_j^h‖ / ‖o_i^h‖", received=True, hierarchy=2,
                token_latex=r"$\Sigma_h a_{ij}^h\,\|\tilde v_j^h\|/\|o_i^h\|$"))
register(Metric("contribution", "contribution", lambda b: b.map_contribution(),
                frozenset({"attention", "uG", "head_output_sq"}), token_map="contribution_inter",
                formula="c_ij^h = ⟨o_i^h, a_ij^h ṽ_j^h⟩ / ‖o_i^h‖²", received=True, hierarchy=3,
                token_latex=r"$C_{ij}=\Sigma_h \langle o_i, a_{ij}^h\tilde v_j^h\rangle/\|o_i\|^2$"))
register(Metric("contribution_inter", "contribution (inter-head)", lambda b: b.map_contribution_inter(),
                frozenset({"attention", "pulled_back", "output_sq"}),
                formula="C_ij^h = ⟨o_i, a_ij^h ṽ_j^h⟩ / ‖o_i‖²"))

# The published value-aware measures of the faithfulness head-to-head (SPEC §2.1): the math of each
# family is its own module (imported above), its entries are here.
register(Metric("leave_one_out", "leave-one-out", lambda b: leave_one_out.leave_one_out(b, head_space=True),
                frozenset({"attention", "uG", "head_output_sq", "value_norm"}),
                formula="a_ij^h/(1 − a_ij^h) ‖ṽ_j^h − o_i^h‖ (renormalised drop of j, head space)",
                token_latex=r"$\Sigma_h \|o_i^{h} - o_i^{h,(-j)}\|$", rival=leave_one_out.CITATION))
register(Metric("value_zeroing", "value zeroing", value_zeroing.value_zeroing_per_head,
                frozenset({"attention", "pulled_back", "output_sq", "value_norm"}), token=value_zeroing.value_zeroing_layer,
                formula="1 − cos(o_i, o_i − a_ij^h ṽ_j^h); token level: j zeroed in every head",
                token_latex=r"$1-\cos(o_i,\, o_i-\Sigma_h a_{ij}^h\tilde v_j^h)$", rival=value_zeroing.CITATION))
register(Metric("alti", "ALTI", None, frozenset({"attention", "layer_output"}), token=alti.alti_layer,
                formula="max(‖o_i‖₁ − ‖o_i − Σ_h a_ij^h ṽ_j^h‖₁, 0), renormalised over j (layer only)",
                token_latex=r"ALTI$_{ij}$ (L1 proximity, renormalised)", rival=alti.CITATION))
register(Metric("grad_attention", "gradient × attention", lambda b: b.prepared("grad_attention"),
                frozenset({"attention"}), prepare="gradient",
                formula="g_ij^h = a_ij^h ∂ℓ/∂a_ij^h (ℓ: the text's log-likelihood; clean forward)",
                token_latex=r"$\Sigma_h a_{ij}^h\,\partial\ell/\partial a_{ij}^h$", rival=gradient.CITATION))
register(Metric("rollout", "attention rollout", None, frozenset({"attention"}),
                token=lambda b: b.prepared("rollout"), prepare="rollout:attention",
                formula="R^l = (½ A^l + ½ I) R^{l−1}, A^l the mean over heads (clean forward; layer only)",
                token_latex=r"$R^l_{ij}$, attention rollout", rival=rollout.CITATION))
register(Metric("contribution_rollout", "contribution rollout", None, frozenset({"attention"}),
                token=lambda b: b.prepared("contribution_rollout"), prepare="rollout:contribution",
                formula="R^l = (½ C^l + ½ I) R^{l−1}, C^l the inter-head contribution (clean forward; layer only)",
                token_latex=r"$R^l_{ij}$, contribution rollout", rival=rollout.CITATION + ", of contribution"))
