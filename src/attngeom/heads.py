"""Head removal (SPEC §6): zeroing heads' slices of the output-projection input, removal orders,
perplexity against retention, individually critical heads.

**Removal.** Removing head ``h`` of layer ``l`` zeroes its slice of the ``o_proj`` input. Inside a
:class:`~attngeom.capture.Session` this is the intervention :class:`HeadRemoval`, which returns zero
mixing weights for the removed heads: the head's output ``Σ_j a_ij v_j`` becomes 0, which *is* its
slice of the ``o_proj`` input. Every query head has its own slice (under grouped-query attention
the value head is shared but the slices are not), so this is exact for GQA/MQA; the ``o_proj``
bias is kept (it belongs to no head).

**Orders** (each ranks all ``L·H`` heads from first-removed to last-removed; at retention ``r`` the
first ``L·H − round(r·L·H/100)`` heads of the order are removed):

- ``taxonomy``: heads grouped by regime (Retriever / Mixer / Reset, from the calibration split); the
  order in which the three regimes are removed is the permutation of the three with the lowest
  mean log-perplexity over the retentions below 100 % on the calibration split (all six are tried).
  Inside a regime, heads with the largest share of their regime's label go first (the most typical
  members of the regime), ties by (layer, head).
- ``weight``: ascending ``‖W_O^h‖_F · ‖W_V^{g(h)}‖_F`` (output-projection block of the head times the
  value projection of its key/value head) — smallest first.
- ``entropy``: descending mean attention entropy on the calibration split — most diffuse first.
- ``random``: a seeded permutation.
- ``sensitivity``: ascending single-head ΔPPL on the calibration split — least harmful first.

**Critical heads.** A head is *individually critical* when its single-removal ΔPPL on the
calibration split exceeds ``mean + 3·std`` of the single-removal ΔPPLs of the *other* heads of its
regime (leave-one-out, so that the outlier does not inflate its own threshold; regimes with fewer
than 8 other heads use all other heads of the model instead), and is positive.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from .capture import Block, Session
from .errors import InputError
from .taxonomy import REGIMES
from .trace import forward, make_batches, token_nll

RETENTIONS = (100.0, 90.0, 75.0, 50.0, 25.0)
ORDERS = ("taxonomy", "weight", "entropy", "random", "sensitivity")
REGIME_LABEL = {"Retriever": "winner_self", "Mixer": "winner_sink", "Reset": "winner_other"}


def check_retentions(values: Iterable[float]) -> list[float]:
    out = []
    for r in values:
        r = float(r)
        if not (0 < r <= 100) or math.isnan(r):
            raise InputError(f"retention must be in (0, 100] percent, got {r:g}")
        out.append(r)
    if not out:
        raise InputError("no retention level given")
    return sorted(set(out), reverse=True)


class HeadRemoval:
    """Intervention zeroing the mixing weights of removed heads. ``removed``: ``{layer: heads}``."""

    def __init__(self, removed: dict[int, Iterable[int]] | Iterable[tuple[int, int]]):
        if isinstance(removed, dict):
            pairs = [(int(l), int(h)) for l, hs in removed.items() for h in hs]
        else:
            pairs = [(int(l), int(h)) for l, h in removed]
        self.by_layer: dict[int, list[int]] = {}
        for l, h in pairs:
            self.by_layer.setdefault(l, []).append(h)

    def __call__(self, block: Block) -> torch.Tensor | None:
        heads = self.by_layer.get(block.layer)
        if not heads:
            return None
        w = block.a.clone()
        w[:, heads] = 0
        return w


class PerExampleHeadRemoval:
    """Intervention removing one head per batch element: ``assign[b] = (layer, head)`` or None. Used
    to measure several single-head removals in one batched forward pass (the batch holds copies of
    the same windows)."""

    def __init__(self, assign: Sequence[tuple[int, int] | None]):
        self.assign = list(assign)

    def __call__(self, block: Block) -> torch.Tensor | None:
        hits = [(b, lh[1]) for b, lh in enumerate(self.assign) if lh is not None and lh[0] == block.layer]
        if not hits:
            return None
        w = block.a.clone()
        for b, h in hits:
            w[b, h] = 0
        return w


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """Attention modules by ``layer_idx`` (those with an ``o_proj``)."""
    out = {}
    for m in model.modules():
        if hasattr(m, "o_proj") and hasattr(m, "layer_idx"):
            out[int(m.layer_idx)] = m
    return out


def weight_norms(handle) -> np.ndarray:
    """``‖W_O^h‖_F · ‖W_V^{g(h)}‖_F`` per layer and head: ``[L, H]``. For a fused ``qkv_proj`` the
    value rows are its last ``H_kv·d`` rows."""
    H, Hkv, d = handle.num_heads, handle.num_kv_heads, handle.head_dim
    mods = attention_modules(handle.model)
    out = np.zeros((handle.num_layers, H))
    for l, m in sorted(mods.items()):
        wo = m.o_proj.weight.detach().float()                          # [D, H*d]
        wo_h = wo.t().reshape(H, d, -1).flatten(1).norm(dim=1)          # [H]
        if hasattr(m, "v_proj"):
            wv = m.v_proj.weight.detach().float()
        elif hasattr(m, "qkv_proj"):
            wv = m.qkv_proj.weight.detach().float()[-Hkv * d:]
        else:
            wv = None
        if wv is None:
            wv_h = torch.ones(H)
        else:
            wv_g = wv.reshape(Hkv, d, -1).flatten(1).norm(dim=1)        # [Hkv]
            wv_h = wv_g[torch.arange(H) // (H // Hkv)]
        out[l] = (wo_h * wv_h).numpy()
    return out


# --------------------------------------------------------------------------------------------
# Perplexity under removal
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def nll_sum(handle, windows: Sequence, removed=(), batch_size: int = 4) -> tuple[float, int]:
    """Summed next-token NLL and token count of ``windows`` with ``removed`` heads zeroed."""
    session = Session(intervention=HeadRemoval(removed) if removed else None)
    total, count = 0.0, 0
    for batch in make_batches(handle, windows, batch_size):
        logits = forward(handle, batch, session, logits=True)
        nll = token_nll(logits, batch)
        total += float(nll.double().sum())
        count += int((batch.lengths - 1).clamp_min(0).sum())
    return total, count


def perplexity(handle, windows: Sequence, removed=(), batch_size: int = 4) -> float:
    total, count = nll_sum(handle, windows, removed, batch_size)
    return math.exp(total / max(1, count))


def decoder_layers(model) -> list[torch.nn.Module] | None:
    """The model's decoder layers in order (``model.model.layers`` and similar), or None."""
    for path in ("model.layers", "model.language_model.layers", "layers", "transformer.h"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj):
            return list(obj)
    return None


@torch.no_grad()
def single_head_sensitivity(handle, windows: Sequence, batch_size: int = 4, base_ppl: float | None = None,
                            progress: bool = True, reuse_prefix: bool = True) -> np.ndarray:
    """ΔPPL of removing each head alone on ``windows``: ``[L, H]``.

    Several removals of the same layer share one forward pass: the batch holds one copy of the
    windows per removal (:class:`PerExampleHeadRemoval`), about ``batch_size`` windows per pass.
    With ``reuse_prefix`` the decoder layers below the removed layer are not recomputed: their
    outputs (identical to the unedited pass) are recorded once and replayed."""
    from tqdm.auto import tqdm

    L, H = handle.num_layers, handle.num_heads
    base_batch = next(make_batches(handle, windows, len(windows)))
    count = int((base_batch.lengths - 1).clamp_min(0).sum())
    layers = decoder_layers(handle.model) if reuse_prefix else None
    if layers is not None and len(layers) != L:
        layers = None
    cached: list[torch.Tensor] = []
    if layers is not None:
        hooks = [m.register_forward_hook(lambda mod, args, out: cached.append(
            (out[0] if isinstance(out, tuple) else out).detach())) for m in layers]
        try:
            logits = forward(handle, base_batch, Session(), logits=True)
        finally:
            for h in hooks:
                h.remove()
        if len(cached) != L:
            layers = None
    else:
        logits = forward(handle, base_batch, Session(), logits=True)
    if base_ppl is None:
        base_ppl = math.exp(float(token_nll(logits, base_batch).double().sum()) / max(1, count))
    per_pass = max(1, batch_size // max(1, len(windows)))
    nll = {}
    bar = tqdm(total=L * H, desc="single-head removal", disable=not progress)
    for l in range(L):
        for k in range(0, H, per_pass):
            group = [(l, h) for h in range(k, min(H, k + per_pass))]
            items = [w for _ in group for w in windows]
            assign = [lh for lh in group for _ in windows]
            session = Session(intervention=PerExampleHeadRemoval(assign))
            batch = next(make_batches(handle, items, len(items)))
            patched = []
            if layers is not None:
                for j in range(l):
                    rep = cached[j].repeat(len(group), 1, 1)
                    layers[j].forward = (lambda out: (lambda *a, **kw: out))(rep)
                    patched.append(layers[j])
            try:
                x = token_nll(forward(handle, batch, session, logits=True), batch).double().sum(-1)
            finally:
                for m in patched:
                    del m.forward
            for b, lh in enumerate(assign):
                nll[lh] = nll.get(lh, 0.0) + float(x[b])
            bar.update(len(group))
    bar.close()
    out = np.zeros((L, H))
    for (l, h), v in nll.items():
        out[l, h] = math.exp(v / max(1, count)) - base_ppl
    return out


# --------------------------------------------------------------------------------------------
# Orders
# --------------------------------------------------------------------------------------------


def _rank(values: np.ndarray, ascending: bool = True) -> list[tuple[int, int]]:
    L, H = values.shape
    flat = values.reshape(-1)
    keys = flat if ascending else -flat
    idx = np.lexsort((np.arange(L * H), keys))  # stable: ties by (layer, head)
    return [(int(i // H), int(i % H)) for i in idx]


def taxonomy_order(tax: pd.DataFrame, regime_order: Sequence[str]) -> list[tuple[int, int]]:
    """Heads regime by regime in ``regime_order``; inside a regime the largest label share first."""
    out = []
    for r in regime_order:
        sub = tax[tax["regime"] == r].copy()
        sub["_share"] = sub[REGIME_LABEL[r]]
        sub = sub.sort_values(["_share", "layer", "head"], ascending=[False, True, True], kind="mergesort")
        out.extend((int(a), int(b)) for a, b in zip(sub["layer"], sub["head"]))
    return out


def removed_at(order: Sequence[tuple[int, int]], retention: float) -> list[tuple[int, int]]:
    """The heads removed at ``retention`` percent: the first ``total − round(r·total/100)``."""
    total = len(order)
    keep = int(round(retention * total / 100.0))
    return list(order[: total - keep])


def build_orders(tax: pd.DataFrame, weights: np.ndarray, sensitivity: np.ndarray, regime_order: Sequence[str],
                 seed: int = 0) -> dict[str, list[tuple[int, int]]]:
    """All five removal orders (module docstring). ``tax`` must hold ``layer, head, regime, entropy``
    and the winner shares (calibration split)."""
    L, H = weights.shape
    ent = np.zeros((L, H))
    for row in tax.itertuples():
        ent[row.layer, row.head] = row.entropy
    rng = np.random.default_rng(seed)
    perm = rng.permutation(L * H)
    return {
        "taxonomy": taxonomy_order(tax, regime_order),
        "weight": _rank(weights, ascending=True),
        "entropy": _rank(ent, ascending=False),
        "random": [(int(i // H), int(i % H)) for i in perm],
        "sensitivity": _rank(sensitivity, ascending=True),
    }


def choose_regime_order(handle, calib: Sequence, tax: pd.DataFrame, retentions: Sequence[float],
                        batch_size: int = 4, progress: bool = True) -> tuple[list[str], pd.DataFrame]:
    """Try the six regime orders on the calibration split; return the best (lowest mean log-PPL over
    the retentions below 100 %) and the table of all tries."""
    from tqdm.auto import tqdm

    levels = [r for r in retentions if r < 100] or list(retentions)
    rows = []
    perms = list(itertools.permutations(REGIMES))
    bar = tqdm(total=len(perms) * len(levels), desc="taxonomy order search", disable=not progress)
    for perm in perms:
        order = taxonomy_order(tax, perm)
        for r in levels:
            ppl = perplexity(handle, calib, removed_at(order, r), batch_size)
            rows.append({"regime_order": " > ".join(perm), "retention": r, "ppl": ppl})
            bar.update(1)
    bar.close()
    df = pd.DataFrame(rows)
    score = df.assign(logppl=np.log(df["ppl"])).groupby("regime_order", sort=False)["logppl"].mean()
    best = score.idxmin()
    return best.split(" > "), df


def critical_heads(sensitivity: np.ndarray, tax: pd.DataFrame, k: float = 3.0, min_group: int = 8) -> list[dict]:
    """Heads whose single-removal ΔPPL exceeds ``mean + k·std`` of the other heads of their regime
    (leave-one-out; fewer than ``min_group`` others -> all other heads), and is positive."""
    regime = {(int(r.layer), int(r.head)): r.regime for r in tax.itertuples()}
    L, H = sensitivity.shape
    out = []
    for (l, h), reg in sorted(regime.items()):
        others = [sensitivity[a, b] for (a, b), rr in regime.items() if rr == reg and (a, b) != (l, h)]
        scope = "regime"
        if len(others) < min_group:
            others = [sensitivity[a, b] for a in range(L) for b in range(H) if (a, b) != (l, h)]
            scope = "model"
        if not others:
            continue
        mu, sd = float(np.mean(others)), float(np.std(others))
        x = float(sensitivity[l, h])
        if x > 0 and x > mu + k * sd:
            out.append({"layer": l, "head": h, "regime": reg, "delta_ppl": x, "group_mean": mu, "group_std": sd,
                        "z": (x - mu) / sd if sd > 0 else float("inf"), "scope": scope})
    return sorted(out, key=lambda d: -d["delta_ppl"])


def removal_curves(handle, heldout: Sequence, orders: dict[str, list[tuple[int, int]]],
                   retentions: Sequence[float], batch_size: int = 4, progress: bool = True) -> pd.DataFrame:
    """Held-out perplexity for every order and retention (100 % evaluated once and shared)."""
    from tqdm.auto import tqdm

    rows = []
    base = perplexity(handle, heldout, (), batch_size) if 100.0 in retentions else None
    jobs = [(name, r) for name in orders for r in retentions if r < 100]
    bar = tqdm(total=len(jobs), desc="removal curves", disable=not progress)
    for name in orders:
        for r in retentions:
            if r >= 100:
                rows.append({"order": name, "retention": r, "heads_removed": 0, "ppl": base})
                continue
            removed = removed_at(orders[name], r)
            rows.append({"order": name, "retention": r, "heads_removed": len(removed),
                         "ppl": perplexity(handle, heldout, removed, batch_size)})
            bar.update(1)
    bar.close()
    df = pd.DataFrame(rows)
    if base is not None:
        df["delta_ppl"] = df["ppl"] - base
    return df
