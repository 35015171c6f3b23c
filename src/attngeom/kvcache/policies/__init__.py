"""KV-cache eviction policies (their scores: SPEC §9): one small class each (:class:`Policy`), one
module per family, one registry entry each (:data:`POLICIES`); a policy of your own is a
``module:Class`` (:func:`get_policy`).

A policy answers two questions for the compressed cache of :mod:`attngeom.kvcache.cache`:

1. **What to record while the model runs** (``step``): from each attention :class:`~attngeom.capture.Block`
   of a forward pass, a score per query head and cached entry ``[B, H, S]`` summed over the
   queries the policy reads (all of them, or the last few). ``needs`` says whether the forward
   must run through the exact capture at all (``None``: no scores, plain SDPA), and whether the
   scores are accumulated over forward passes (``accumulate``, H2O-style) or replaced by the
   latest one (TOVA, SnapKV).
2. **Which entries to keep** (``priority(ctx) -> (tier, score)``, both ``[B, H_kv, n]``): the
   cache keeps, per key/value head, the entries with the highest ``tier`` first and, inside a
   tier, the highest ``score`` (ties: the earlier entry). Protected entries (attention sinks, the
   recent window) get a higher tier, so they count against the budget like any other entry.

Query heads sharing a key/value head (grouped-query attention) are pooled before ``priority``:
``pool = "mean"`` (the default: the mean of the group's query-head scores), ``"max"``, or
``"layer"`` (the mean over all heads of the layer: the same choice in every head, as TOVA does).

Every policy's docstring names its source; ``docs/kvcache.md`` lists the scores side by side.
torch is imported inside the functions that use it, so that the registry's names (the settings'
and ``--help``'s default policies) need no torch.
The families: :mod:`.recency` (full, window, StreamingLLM), :mod:`.attention` (H2O, TOVA,
SnapKV), :mod:`.values` (VATP, CriticalKV), :mod:`.andpro` (AnDPro), :mod:`.laprox` (LaProx), :mod:`.simple` (random, knorm), :mod:`.budgets`
(PyramidKV, AdaKV), :mod:`.leave_one_out` (DropKV, ``loo_head``), :mod:`.kvzip` (KVzip, KVzip+,
KVzip by contribution), :mod:`.contribution` (the papers' geometry by contribution) and
:mod:`.taxonomy`; what they share is :mod:`.base`.
What belongs here: scores, protections, budgets and the registry. Not here: storage and eviction mechanics (:mod:`attngeom.kvcache.cache`),
evaluation (:mod:`attngeom.kvcache.evaluation`).
"""

from __future__ import annotations

from typing import Callable

from attngeom.errors import InputError
from attngeom.kvcache.policies.andpro import ANDPRO_CHUNK, ANDPRO_KERNEL, ANDPRO_WINDOW, AnDPro
from attngeom.kvcache.policies.attention import SNAP_KERNEL, SNAP_WINDOW, _avg_pool, h2o, snapkv, tova
from attngeom.kvcache.policies.base import RECENT, SINKS, POLICY_OPTIONS, EvictionContext, Policy, uniform_keep
from attngeom.kvcache.policies.budgets import ADAKV_FLOOR, PYRAMID_BETA, adakv, adakv_budgets, pyramid_budgets, pyramidkv
from attngeom.kvcache.policies.contribution import (SUPPRESSORS, contribution, global_contribution, snap_contribution,
                                                    suppressor)
from attngeom.kvcache.policies.laprox import LaProx
from attngeom.kvcache.policies.kvzip import (KVZIP_CHUNK, KVZIP_OVERLAP, KVZIP_PROMPT, KVZIP_PROMPT_NEXT, KVZIP_SINKS,
                                             RECONSTRUCTION_SCORES, global_budgets, kvzip, kvzip_contribution, kvzip_plus)
from attngeom.kvcache.policies.leave_one_out import dropkv
from attngeom.kvcache.policies.recency import full, streamingllm, window
from attngeom.kvcache.policies.simple import RANDOM_SEED, knorm, random_policy
from attngeom.kvcache.policies.taxonomy import taxonomy, taxonomy_budgets
from attngeom.kvcache.policies.values import CRITICAL_FIRST_STAGE, VALUE_L1_CHUNK, criticalkv, projected_value_l1, vatp

__all__ = ["POLICIES", "READING_POLICIES", "Policy", "EvictionContext", "get_policy", "load_policy", "register",
           "needs_regimes", "uniform_keep", "global_budgets", "pyramid_budgets", "adakv_budgets", "taxonomy_budgets",
           "projected_value_l1", "POLICY_OPTIONS", "SINKS", "RECENT", "SNAP_WINDOW", "SNAP_KERNEL", "PYRAMID_BETA",
           "ADAKV_FLOOR", "CRITICAL_FIRST_STAGE", "VALUE_L1_CHUNK", "RANDOM_SEED", "SUPPRESSORS", "KVZIP_SINKS",
           "KVZIP_CHUNK", "KVZIP_OVERLAP", "KVZIP_PROMPT", "KVZIP_PROMPT_NEXT", "RECONSTRUCTION_SCORES",
           "full", "window", "streamingllm", "h2o", "tova", "snapkv", "vatp", "criticalkv", "knorm", "random_policy",
           "pyramidkv", "adakv", "dropkv", "kvzip", "kvzip_plus", "kvzip_contribution", "contribution",
           "snap_contribution", "suppressor", "global_contribution", "taxonomy", "_avg_pool",
           "AnDPro", "ANDPRO_WINDOW", "ANDPRO_KERNEL", "ANDPRO_CHUNK", "LaProx"]

POLICIES: dict[str, Callable[[], Policy]] = {
    "full": full,
    "window": window,
    "streamingllm": streamingllm,
    "h2o": h2o,
    "tova": tova,
    "snapkv": snapkv,
    "vatp": vatp,
    "contribution": contribution,
    "contribution_signed": lambda: contribution(signed=True),
    "taxonomy": taxonomy,
}
"""Every policy. The first ten also read with eviction (:data:`READING_POLICIES`); the rest are
baselines of compression once after the prefill."""

POLICIES.update({
    "random": random_policy,
    "knorm": knorm,
    "pyramidkv": pyramidkv,
    "criticalkv": criticalkv,
    "dropkv": dropkv,
    "adakv": adakv,
    "loo_head": lambda: dropkv(head_space=True),
    "kvzip": kvzip,
    "kvzip_plus": kvzip_plus,
    "snap_contribution": snap_contribution,
    "kvzip_contribution": kvzip_contribution,
    "adakv_contribution": lambda: adakv(snap_contribution(), "adakv_contribution"),
    "suppressor": suppressor,
    "global_contribution": global_contribution,
    "andpro": AnDPro,
    "laprox": LaProx,
})

READING_POLICIES = ("full", "window", "streamingllm", "h2o", "tova", "snapkv", "vatp", "contribution",
                    "contribution_signed", "taxonomy")
"""The policies of ``attngeom kvcache``'s reading with eviction (its default)."""


def get_policy(name: "str | Policy") -> Policy:
    """The policy ``name``: a name of :data:`POLICIES`, a :class:`Policy` itself, or
    ``"module:Class"`` (``"path/file.py:Class"``): a policy class (or a function returning a
    policy) of your own module, imported and registered under its ``name`` (so that the tables'
    rows find it again)."""
    if isinstance(name, Policy):
        return name
    if isinstance(name, str) and ":" in name:
        return register(load_policy(name))
    if name not in POLICIES:
        raise InputError(f"unknown KV-cache policy {name!r}; choose from {', '.join(POLICIES)}, or give module:Class")
    return POLICIES[name]()


def load_policy(spec: str) -> Policy:
    """The policy of ``"module:Class"`` or ``"path/file.py:Class"``: ``Class()`` (a class) or
    ``Class()``'s result (a function), checked to be a :class:`Policy`; refused in one line otherwise."""
    import importlib
    import importlib.util
    from pathlib import Path

    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise InputError(f"a policy of your own is module:Class, got {spec!r}")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise InputError(f"{spec}: no file {where}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except InputError:
        raise
    except Exception as e:                      # the user's module: its own error, in one line
        raise InputError(f"{spec}: cannot import {where}: {type(e).__name__}: {e}") from None
    made = getattr(module, attr, None)
    if made is None:
        raise InputError(f"{spec}: {where} has no {attr}")
    try:
        policy = made() if callable(made) else made
    except Exception as e:
        raise InputError(f"{spec}: {attr}() failed: {type(e).__name__}: {e}") from None
    if not isinstance(policy, Policy):
        raise InputError(f"{spec}: {attr} is not a KV-cache policy (subclass attngeom.kvcache.policies.Policy)")
    return policy


def register(policy: Policy) -> Policy:
    """Add ``policy`` to :data:`POLICIES` under its name (a name of the toolkit's own is refused)."""
    known = POLICIES.get(policy.name)
    if known is not None and getattr(known, "registered", None) is None:
        raise InputError(f"a policy of your own is named {policy.name!r}, a name the toolkit's own policy has")

    def again() -> Policy:
        return policy

    again.registered = policy
    POLICIES[policy.name] = again
    return policy


def needs_regimes(names) -> bool:
    """Whether any of the policies ``names`` takes per-head budgets from a head taxonomy."""
    return any(get_policy(n).per_head_budgets for n in names)
