"""The passes that compute a measure before the forward that ranks by it (SPEC §2.1): the backward
pass of gradient-weighted attention and the composition of rollouts, each on the clean forward of
one text. Their maps go to ``Session(prepared=...)``; :meth:`~attngeom.capture.blocks.Block.prepared`
reads them by position. Which pass a measure needs is its registry entry's ``prepare``.
"""

from __future__ import annotations

import contextvars
from typing import Iterable, Sequence

import torch

from attngeom.metrics import registry
from attngeom.metrics.gradient import gradient_weighted
from attngeom.metrics.rollout import compose
from attngeom.model.adapter import adapter_for, attention_implementation, attention_layer

GRADIENT_ATTENTION = "attngeom_gradient"
"""The attention function of the backward pass in transformers' ``AttentionInterface``."""

_RECORDED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("attngeom_gradient", default=None)


def differentiable_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, softcap: float | None = None, **kwargs):
    """Eager attention in differentiable operations (grouped-query heads as ``repeat_kv`` lays them
    out, the boolean or additive mask, soft-capping, learned sink logits as the plug-in honours
    them), recording each layer's mixing weights ``[B, H, Q, S]`` for the backward pass."""
    sinks = kwargs.pop("s_aux", None)
    B, H, Tq, d = query.shape
    S = key.shape[2]
    rep = H // key.shape[1]
    k, v = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scores = (query @ k.transpose(-1, -2)) * (d ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:   # causal, the queries being the last Tq of the S sources
        allowed = (torch.arange(S, device=query.device)[None, :]
                   <= torch.arange(S - Tq, S, device=query.device)[:, None])[None, None]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, -1, Tq, 1).to(scores.dtype)], dim=-1)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = probs.to(query.dtype)
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded[attention_layer(module)] = probs
    return (probs @ v).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GRADIENT_ATTENTION, differentiable_attention)
    AttentionMaskInterface.register(GRADIENT_ATTENTION, sdpa_mask)


_register()


def _check_text(handle, ids: Sequence[int]) -> torch.Tensor:
    from attngeom.capture.session import in_eval_mode

    model = handle.model
    in_eval_mode(model)
    adapter_for(model)
    if len(ids) < 2:
        from attngeom.errors import InputError

        raise InputError("a gradient or rollout needs a text of at least 2 tokens")
    return torch.tensor([list(ids)], dtype=torch.long, device=model.device)


def gradient_maps(handle, ids: Sequence[int], n_scored: int) -> dict[int, torch.Tensor]:
    """``{layer: a ⊙ ∂ℓ/∂a [1, H, T, T]}`` (float32) of one text ``ids``, ``ℓ`` the summed
    log-likelihood of its last ``n_scored`` predictions, through every attention layer
    (:func:`attngeom.metrics.gradient.gradient_weighted`)."""
    x = _check_text(handle, ids)
    model, T = handle.model, x.shape[1]
    n = max(1, min(int(n_scored), T - 1))
    recorded: dict = {}
    token = _RECORDED.set(recorded)
    try:
        with torch.enable_grad(), attention_implementation(model, GRADIENT_ATTENTION):
            logits = model(input_ids=x, use_cache=False).logits
            lp = torch.log_softmax(logits[0, T - 1 - n:T - 1].float(), dim=-1)
            ll = lp.gather(-1, x[0, T - n:, None]).sum()
            layers = sorted(recorded)
            grads = torch.autograd.grad(ll, [recorded[l] for l in layers], allow_unused=True)
    finally:
        _RECORDED.reset(token)
    return {l: gradient_weighted(recorded[l].detach(), torch.zeros_like(recorded[l]) if g is None else g)
            for l, g in zip(layers, grads)}


class _TokenMaps:
    """Records the token-level maps ``[B, T, T]`` of ``metrics``, per metric and layer, in one forward."""

    def __init__(self, metrics: Sequence[str]):
        self.maps: dict[str, dict[int, torch.Tensor]] = {m: {} for m in metrics}

    def observe(self, block) -> None:
        T = block.state.num_sources                       # one text, no cache: every position
        Q, S = block.a.shape[2], block.a.shape[3]
        for metric, maps in self.maps.items():
            if block.layer not in maps:                   # a layer's first block: its [B, T, T] map, once
                maps[block.layer] = block.a.new_zeros(block.a.shape[0], T, T)
            m = maps[block.layer]
            m[:, block.q_start:block.q_start + Q, block.k_start:block.k_start + S] = block.token_score(metric)


def rollouts(handle, ids: Sequence[int], metrics: Sequence[str]) -> dict[str, dict[int, torch.Tensor]]:
    """``{metric: {layer: R^l [1, T, T]}}`` of one text: each metric's token-level maps of its clean
    forward composed from the first layer up (:func:`attngeom.metrics.rollout.compose`); one
    forward records every metric's maps."""
    from attngeom.capture.session import attngeom_attention_implementation, Session

    x = _check_text(handle, ids)
    rec = _TokenMaps(metrics)
    session = Session(observers=[rec])
    with torch.no_grad(), attngeom_attention_implementation(handle.model), \
            session.active(torch.tensor([x.shape[1]], device=x.device)):
        handle.model(input_ids=x, use_cache=False, logits_to_keep=1)
    out = {}
    for metric, maps in rec.maps.items():
        layers = sorted(maps)
        out[metric] = dict(zip(layers, compose([maps[l] for l in layers])))
    return out


def rollout_maps(handle, ids: Sequence[int], metric: str = "attention") -> dict[int, torch.Tensor]:
    """``{layer: R^l [1, T, T]}`` of one text for one ``metric`` (:func:`rollouts`)."""
    return rollouts(handle, ids, [metric])[metric]


def prepare(handle, ids: Sequence[int], n_scored: int, names: Iterable[str]) -> dict[int, dict[str, torch.Tensor]]:
    """The maps of the measures of ``names`` computed before the forward
    (:func:`attngeom.metrics.registry.prepared_names`), from the clean forward of ``ids``:
    ``{layer: {name: map}}``, what ``Session(prepared=...)`` takes (empty when none is). The
    gradient has its own forward and backward pass; every rollout shares one forward."""
    out: dict[int, dict] = {}
    composed: dict[str, str] = {}                          # measure -> the metric its rollout composes
    for name in registry.prepared_names(names):
        kind = registry.get(name).prepare
        if kind == "gradient":
            maps = gradient_maps(handle, ids, n_scored)
        elif kind.startswith("rollout:"):
            composed[name] = kind.split(":", 1)[1]
            continue
        else:  # pragma: no cover - a registry entry naming no pass
            raise ValueError(f"metric {name!r}: unknown prepare pass {kind!r}")
        for layer, m in maps.items():
            out.setdefault(layer, {})[name] = m
    if composed:
        by_metric = rollouts(handle, ids, sorted(set(composed.values())))
        for name, metric in composed.items():
            for layer, m in by_metric[metric].items():
                out.setdefault(layer, {})[name] = m
    return out


def prepare_text(handle, ids: Sequence[int], names: Iterable[str]) -> dict[int, dict[str, torch.Tensor]]:
    """:func:`prepare` for one text analysed as given: its log-likelihood scores every prediction
    (``n_scored = T - 1``), as :func:`attngeom.traces.trace.analyze` and the explorer compute it."""
    return prepare(handle, ids, len(ids) - 1, names)
