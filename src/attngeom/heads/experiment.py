"""Head removal (SPEC §6): zeroing heads' slices of the output-projection input, removal orders,
perplexity against retention, individually critical heads.

**Removal.** Removing head ``h`` of layer ``l`` zeroes its slice of the ``o_proj`` input. Inside a
:class:`~attngeom.capture.session.Session` this is the intervention
:class:`~attngeom.capture.interventions.HeadRemoval` (re-exported here), which returns zero
mixing weights for the removed heads: the head's output ``Σ_j a_ij v_j`` becomes 0, which *is* its
slice of the ``o_proj`` input. Every query head has its own slice (under grouped-query attention
the value head is shared but the slices are not), so this is exact for GQA/MQA; the ``o_proj``
bias is kept (it belongs to no head).

**Orders** and **critical heads**: :mod:`attngeom.heads.orders` (the pure math); here they are
measured on the model.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from attngeom.model.arguments import takes_handle, takes_model
from attngeom.capture.session import Session
from attngeom.errors import InputError
from attngeom.runs.contract import (ExperimentResult, ModelHandleLike, RunLike, check_scorable, layer_order,
                                    one_window_each, per_window_array, perplexity, window_records)
from attngeom.capture.interventions import HeadRemoval
from attngeom.model.adapter import adapter_for
from attngeom.heads.orders import build_orders, critical_heads, removed_at, taxonomy_order
from attngeom.heads.settings import HeadsSettings
from attngeom.heads.taxonomy import REGIMES, share_of_each_regime
from attngeom.stats import resampling
from attngeom.streaming.passes import batch_nll, make_batches, scored_tokens, to_ids



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


@takes_model
def attention_modules(model) -> dict[int, torch.nn.Module]:
    """Attention modules by ``layer_idx`` (the architecture adapter's)."""
    return adapter_for(model).attention_modules


@takes_handle
def weight_norms(handle: ModelHandleLike) -> np.ndarray:
    """``‖W_O^h‖_F · ‖W_V^{g(h)}‖_F`` per layer and head: ``[L, H]`` (``W_V`` from ``v_proj`` or the
    value rows of a fused ``qkv_proj``, as the architecture adapter knows)."""
    adapter = handle.adapter
    out = np.zeros((adapter.num_layers, adapter.num_heads))
    kv_head = adapter.geometry.kv_head()
    for l in adapter.attention_modules:
        wo_h = adapter.w_o_heads(l).flatten(1).norm(dim=1)              # [H]
        wv_g = adapter.w_v_heads(l).flatten(1).norm(dim=1)              # [Hkv]
        out[l] = (wo_h * wv_g[kv_head.to(wv_g.device)]).cpu().numpy()        # one copy per layer (a GPU's weights)
    return out


# --------------------------------------------------------------------------------------------
# Perplexity under removal
# --------------------------------------------------------------------------------------------


@takes_handle
def window_nll(handle: ModelHandleLike, windows: Sequence, removed=(),
               batch_size: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Summed next-token NLL and token count of each window with ``removed`` heads zeroed:
    float64 ``[W]``, int ``[W]`` (per window, so that intervals can resample windows)."""
    session = Session(intervention=HeadRemoval(removed) if removed else None)
    nll, count = [], []
    for batch in make_batches(handle, windows, batch_size):
        nll += batch_nll(handle, batch, session).tolist()
        count += (batch.lengths - 1).clamp_min(0).tolist()
    return np.asarray(nll, dtype=np.float64), np.asarray(count, dtype=np.int64)


@takes_handle
def nll_sum(handle: ModelHandleLike, windows: Sequence, removed=(), batch_size: int = 4) -> tuple[float, int]:
    """Summed next-token NLL and token count of ``windows`` with ``removed`` heads zeroed."""
    nll, count = window_nll(handle, windows, removed, batch_size)
    return float(nll.sum()), int(count.sum())


@takes_handle
def removal_perplexity(handle: ModelHandleLike, windows: Sequence, removed=(), batch_size: int = 4) -> float:
    """Perplexity of ``windows`` with ``removed`` heads zeroed (one evaluation of the model; :func:`attngeom.runs.contract.perplexity` of :func:`nll_sum`)."""
    total, count = nll_sum(handle, windows, removed, batch_size)
    return perplexity(total, count)


@takes_handle
def removal_nll(handle: ModelHandleLike, run: RunLike | None, name: str, windows: Sequence,
                removals: Sequence[Sequence[tuple[int, int]]], batch_size: int = 4,
                desc: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Summed NLL of every window under each removal (a list of heads), as stage ``name`` of ``run``
    (one unit per removal; resumable): float64 ``[R, W]`` and the token count of each window
    ``[W]`` (the per-window sums a bootstrap over windows resamples)."""
    from attngeom.runs.run import fingerprint, run_or_in_memory

    def work(units: list[int]) -> dict:
        parts = [window_nll(handle, windows, removals[u], batch_size) for u in units]
        return {"nll": [p[0] for p in parts], "tokens": [p[1] for p in parts]}

    recs = run_or_in_memory(run).stage(name, len(removals), work, desc=desc or name, unit="removal",
                                   fingerprints=[fingerprint([x for lh in r for x in lh]) for r in removals])
    nll = np.zeros((len(removals), len(windows)))
    tokens = np.zeros(len(windows), dtype=np.int64)
    for key, d in recs.items():
        for u, x, t in zip(key, d["nll"], d["tokens"]):
            nll[u] = np.asarray(x, dtype=np.float64)
            tokens = np.asarray(t, dtype=np.int64)
    return nll, tokens


def _perplexities(nll: np.ndarray, tokens: np.ndarray) -> list[float]:
    """Perplexity of each row of per-window NLL sums ``[R, W]`` over all the windows."""
    count = int(np.sum(tokens))
    return [perplexity(float(np.sum(row)), count) for row in nll]


@takes_handle
def sensitivity_nll(handle: ModelHandleLike, windows: Sequence, batch_size: int = 4,
                    run: RunLike | None = None) -> np.ndarray:
    """Summed NLL of every window with each head removed alone: float64 ``[L·H, W]`` (row
    ``layer·H + head``), one unit per head of stage ``sensitivity`` of ``run`` (resumable).

    Several removals of the same layer share one forward pass: the batch holds one copy of the
    windows per removal (:class:`HeadRemoval` with one removal per row), about ``batch_size``
    windows per pass."""
    from attngeom.runs.run import run_or_in_memory

    L, H = handle.num_layers, handle.num_heads
    per_pass = max(1, batch_size // max(1, len(windows)))

    def work(units: list[int]) -> dict:
        group = [(u // H, u % H) for u in units]
        items = [w for _ in group for w in windows]
        assign = [lh for lh in group for _ in windows]
        session = Session(intervention=HeadRemoval(rows=[[lh] for lh in assign]))
        batch = next(make_batches(handle, items, len(items)))
        x = batch_nll(handle, batch, session).numpy()
        return {"nll": [x[k * len(windows):(k + 1) * len(windows)] for k in range(len(group))]}

    recs = run_or_in_memory(run).stage("sensitivity", L * H, work, group=per_pass, group_key=lambda u: u // H,
                                   desc="single-head removal", unit="head")
    out = np.zeros((L * H, len(windows)))
    for key, d in recs.items():
        for u, v in zip(key, d["nll"]):
            out[u] = np.asarray(v, dtype=np.float64)
    return out


@takes_handle
def single_head_sensitivity(handle: ModelHandleLike, windows: Sequence, batch_size: int = 4,
                            base_ppl: float | None = None, progress: bool = True,
                            run: RunLike | None = None) -> np.ndarray:
    """ΔPPL of removing each head alone on ``windows``: ``[L, H]`` (from :func:`sensitivity_nll`)."""
    if base_ppl is None:
        base_ppl = removal_perplexity(handle, windows, (), batch_size)
    return _sensitivity(handle, windows, sensitivity_nll(handle, windows, batch_size, run), base_ppl)


def _sensitivity(handle: ModelHandleLike, windows: Sequence, nll: np.ndarray, base_ppl: float) -> np.ndarray:
    """ΔPPL ``[L, H]`` from :func:`sensitivity_nll`'s ``[L·H, W]`` sums over ``windows``."""
    count = sum(max(0, len(to_ids(handle, w)) - 1) for w in windows)
    deltas = [perplexity(float(np.sum(row)), count) - base_ppl for row in nll]
    return np.array(deltas).reshape(handle.num_layers, handle.num_heads)


# --------------------------------------------------------------------------------------------
# Orders
# --------------------------------------------------------------------------------------------


@takes_handle
def choose_regime_order(handle: ModelHandleLike, calib: Sequence, tax: pd.DataFrame, retentions: Sequence[float],
                        batch_size: int = 4, progress: bool = True, run=None) -> tuple[list[str], pd.DataFrame]:
    """Try the six regime orders on the calibration split; return the best (lowest mean log-PPL over
    the retentions below 100 %) and the table of all tries (stage ``order_search`` of ``run``)."""
    levels = [r for r in retentions if r < 100] or list(retentions)
    perms = list(itertools.permutations(REGIMES))
    jobs = [(perm, r) for perm in perms for r in levels]
    ppl = _perplexities(*removal_nll(handle, run, "order_search", calib,
                                     [removed_at(taxonomy_order(tax, p), r) for p, r in jobs], batch_size,
                                     "taxonomy order search"))
    df = pd.DataFrame([{"regime_order": " > ".join(p), "retention": r, "ppl": x} for (p, r), x in zip(jobs, ppl)])
    score = df.assign(logppl=np.log(df["ppl"])).groupby("regime_order", sort=False)["logppl"].mean()
    best = score.idxmin()
    return best.split(" > "), df


@takes_handle
def heldout_removal_nll(handle: ModelHandleLike, heldout: Sequence, orders: dict[str, list[tuple[int, int]]],
                        retentions: Sequence[float], batch_size: int = 4, run: RunLike | None = None) -> dict:
    """Per-window NLL on the held-out windows for every order and retention below 100 %, and for
    the unedited model (stage ``removal`` of ``run``): ``{"keys": [(order, retention), ..., ("",
    100.0)], "nll": [K, W], "tokens": [W]}`` (:func:`removal_nll`)."""
    jobs = [(name, r) for name in orders for r in retentions if r < 100]
    removals = [removed_at(orders[name], r) for name, r in jobs] + [[]]
    nll, tokens = removal_nll(handle, run, "removal", heldout, removals, batch_size, "removal curves")
    return {"keys": jobs + [("", 100.0)], "nll": nll, "tokens": tokens}


def curves_table(orders: dict[str, list[tuple[int, int]]], retentions: Sequence[float], removal: dict) -> pd.DataFrame:
    """Held-out perplexity per order and retention from :func:`heldout_removal_nll` (100 % is the
    unedited model, shared by every order)."""
    ppl = dict(zip(removal["keys"], _perplexities(removal["nll"], removal["tokens"])))
    base = ppl[("", 100.0)]
    rows = []
    for name in orders:
        for r in retentions:
            full = r >= 100
            rows.append({"order": name, "retention": r, "heads_removed": 0 if full else len(removed_at(orders[name], r)),
                         "ppl": base if full else ppl[(name, r)]})
    df = pd.DataFrame(rows)
    df["delta_ppl"] = df["ppl"] - base
    return df


@takes_handle
def removal_curves(handle: ModelHandleLike, heldout: Sequence, orders: dict[str, list[tuple[int, int]]],
                   retentions: Sequence[float], batch_size: int = 4, progress: bool = True,
                   run: RunLike | None = None) -> pd.DataFrame:
    """Held-out perplexity for every order and retention (100 % evaluated once and shared; stage
    ``removal`` of ``run``)."""
    return curves_table(orders, retentions, heldout_removal_nll(handle, heldout, orders, retentions, batch_size, run))


# --------------------------------------------------------------------------------------------
# The whole experiment
# --------------------------------------------------------------------------------------------


@takes_handle
def taxonomy_stage(handle: ModelHandleLike, run: RunLike | None, name: str, windows: Sequence, *, sink: int = 0,
                   winner_norm: str = "raw", batch_size: int = 4, split: int = 0) -> dict[tuple[int, ...], dict]:
    """Records of :class:`~attngeom.heads.taxonomy.TaxonomyStats` and the unedited NLL, per window
    (stage ``name`` of ``run``): ``{units: {"tax": state, "nll": Σ NLL, "tokens": n}}``. Windows
    before and after ``split`` never share a record (the calibration / held-out boundary)."""
    from attngeom.capture.session import Session
    from attngeom.runs.run import fingerprint, run_or_in_memory
    from attngeom.heads.taxonomy import TaxonomyStats

    ids = [to_ids(handle, w) for w in windows]

    def work(units: list[int]) -> dict:
        tax = TaxonomyStats(sink=sink, winner_norm=winner_norm)
        session = Session(observers=[tax])
        nll, n = 0.0, 0
        for batch in make_batches(handle, [ids[u] for u in units], batch_size, index=units):
            tax.begin(batch)
            nll += float(batch_nll(handle, batch, session).sum())
            tax.end(batch)
            n += scored_tokens(batch)
        return {"tax": tax.state(), "nll": nll, "tokens": n}

    return run_or_in_memory(run).stage(name, len(ids), work, group=batch_size, group_key=lambda u: u < split,
                                   desc=f"taxonomy: {name}", unit="window", fingerprints=[fingerprint(w) for w in ids])


def taxonomy_of(records: dict, units, sink: int, winner_norm: str) -> tuple[pd.DataFrame, float]:
    """The taxonomy table and unedited perplexity of the records whose units are in ``units``."""
    from attngeom.runs.run import merge_sums
    from attngeom.heads.taxonomy import TaxonomyStats

    parts = [d for key, d in records.items() if key[0] in units]
    merged = merge_sums(parts)
    df = TaxonomyStats(sink=sink, winner_norm=winner_norm).load_state(merged["tax"]).result()
    return df, perplexity(merged["nll"], merged["tokens"])


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, corpora: Sequence[Sequence],
               settings: HeadsSettings = HeadsSettings(), *,
               names: Sequence[str] = ("corpus1", "corpus2")) -> ExperimentResult:
    """The head experiment of SPEC §6 (see :mod:`attngeom.commands.heads`) as stages of ``run``, with
    ``settings`` (:class:`~attngeom.heads.settings.HeadsSettings`): taxonomy of every window of the first
    corpus (calibration = its first ``calib_windows`` windows, the rest held out) and of the second
    corpus if given, single-head sensitivity and the regime order search on the calibration split,
    removal curves on the held-out split.

    Returns an :class:`~attngeom.runs.contract.ExperimentResult`: ``tables`` ``heads`` (one row per
    layer and head), ``removal``, ``order_search``, ``regimes_by_layer`` and
    ``taxonomy_calibration`` (the taxonomy of the calibration split, from which the orders are
    built); ``summary``; ``per_window``: ``sensitivity`` (:func:`sensitivity_nll` on the calibration
    windows), ``removal`` (:func:`heldout_removal_nll`) and, when every taxonomy record covers one
    window (``batch_size=1``), ``taxonomy`` (the records of :func:`taxonomy_stage` in window
    order)."""
    from attngeom.heads.taxonomy import corpus_agreement, regime_alignment, regime_shares, shares_by_depth, shares_by_layer

    calib_windows, retentions, winner_norm = settings.calib_windows, settings.retentions, settings.winner_norm
    sink, seed, critical_k, batch_size = settings.sink, settings.seed, settings.critical_k, settings.batch_size
    windows = corpora[0]
    if len(windows) <= calib_windows:
        raise InputError(f"{names[0]} gives {len(windows)} window(s){f' of {len(windows[0])} tokens' if windows else ''}: "
                         f"not enough for {calib_windows} calibration window(s) and at least one held-out window")
    calib, held = windows[:calib_windows], windows[calib_windows:]
    for split, what in ((calib, "the calibration split"), (held, "the held-out split")):   # ΔPPL on each, before any compute
        check_scorable(sum(max(0, len(to_ids(handle, w)) - 1) for w in split), f"{what} of {names[0]}")
    weights = weight_norms(handle)      # refuses up front (one line) where W_V does not exist (latent attention)
    L = handle.num_layers
    recs = taxonomy_stage(handle, run, "taxonomy", windows, sink=sink, winner_norm=winner_norm, batch_size=batch_size,
                          split=calib_windows)
    cal_df, base_cal = taxonomy_of(recs, range(calib_windows), sink, winner_norm)
    held_df, base_held = taxonomy_of(recs, range(calib_windows, len(windows)), sink, winner_norm)
    all_df, _ = taxonomy_of(recs, range(len(windows)), sink, winner_norm)
    second = None
    if len(corpora) > 1:
        recs2 = taxonomy_stage(handle, run, "taxonomy2", corpora[1], sink=sink, winner_norm=winner_norm,
                               batch_size=batch_size)
        second, _ = taxonomy_of(recs2, range(len(corpora[1])), sink, winner_norm)

    sens_nll = sensitivity_nll(handle, calib, batch_size, run)
    sens = _sensitivity(handle, calib, sens_nll, base_cal)
    regime_order, search = choose_regime_order(handle, calib, cal_df, retentions, batch_size, run=run)
    orders = build_orders(cal_df, weights, sens, regime_order, seed=seed)
    removal = heldout_removal_nll(handle, held, orders, retentions, batch_size, run)
    curves = curves_table(orders, retentions, removal)
    crit = critical_heads(sens, cal_df, k=critical_k)

    heads = _heads_table(all_df, cal_df, second, weights, sens, crit, orders)
    by_layer = _regimes_by_layer([all_df] + ([second] if second is not None else []), names)

    ppl = {name: {f"{r:g}": float(curves[(curves["order"] == name) & (curves["retention"] == r)]["ppl"].iloc[0])
                  for r in retentions} for name in orders}
    summary = {
        "windows": [len(c) for c in corpora],
        "calibration_windows": len(calib),
        "heldout_windows": len(held),
        "winner_norm": winner_norm,
        "sink_position": sink,
        "regime_share": {names[0]: regime_shares(all_df), **({names[1]: regime_shares(second)} if second is not None else {})},
        "regime_share_calibration": regime_shares(cal_df),
        "regime_share_by_depth": shares_by_depth(all_df, L),
        "regime_share_by_layer": {int(r.layer): {g: float(getattr(r, g)) for g in REGIMES}
                                  for r in shares_by_layer(all_df).itertuples()},
        "corpus_agreement": corpus_agreement(all_df, second) if second is not None else None,
        "calibration_heldout_agreement": corpus_agreement(cal_df, held_df),
        "regime_alignment": regime_alignment(all_df),
        "taxonomy_regime_order": regime_order,
        "perplexity_base": {"calibration": base_cal, "heldout": base_held},
        "perplexity": ppl,
        "retentions": list(retentions),
        "critical_rule": f"single-removal dPPL > mean + {critical_k:g} std of the other heads of the regime "
                         "(leave-one-out; calibration split)",
        "critical_heads": crit,
        "single_delta_ppl": {"mean": float(sens.mean()), "max": float(sens.max()),
                             "argmax": [int(x) for x in np.unravel_index(sens.argmax(), sens.shape)]},
    }
    per_window = {"sensitivity": sens_nll, "removal": removal}
    tax = window_records(recs)
    if tax is not None:
        per_window["taxonomy"] = tax
    return ExperimentResult(
        "heads", tables={"heads": heads, "removal": curves, "order_search": search, "regimes_by_layer": by_layer,
                         "taxonomy_calibration": cal_df},
        summary=summary, per_window=per_window,
        settings={**settings.record(), "names": list(names)})


def _heads_table(all_df: pd.DataFrame, cal_df: pd.DataFrame, second: pd.DataFrame | None, weights: np.ndarray,
                 sens: np.ndarray, crit: list[dict], orders: dict[str, list[tuple[int, int]]]) -> pd.DataFrame:
    """One row per layer and head: the taxonomy of all windows, the calibration split's regime and
    entropy, the second corpus's regime and winner shares, weight norm, single-removal ΔPPL, the
    critical flag and the rank in every removal order."""
    heads = all_df.copy()
    heads["regime_calibration"] = cal_df["regime"].to_numpy()
    heads["entropy_calibration"] = cal_df["entropy"].to_numpy()
    if second is not None:
        heads["regime_corpus2"] = second["regime"].to_numpy()
        for c in ("winner_self", "winner_sink", "winner_other"):
            heads[f"{c}_corpus2"] = second[c].to_numpy()
    lh = list(zip(heads["layer"].astype(int), heads["head"].astype(int)))
    heads["weight_norm"] = [weights[l, h] for l, h in lh]
    heads["single_delta_ppl"] = [sens[l, h] for l, h in lh]
    crit_set = {(c["layer"], c["head"]) for c in crit}
    heads["critical"] = [x in crit_set for x in lh]
    for name, order in orders.items():
        rank = {x: i for i, x in enumerate(order)}
        heads[f"removal_rank_{name}"] = [rank[x] for x in lh]
    return heads


def _regimes_by_layer(tables: Sequence[pd.DataFrame], names: Sequence[str]) -> pd.DataFrame:
    """Regime shares per layer of each corpus's taxonomy, with a ``corpus`` column."""
    from attngeom.heads.taxonomy import shares_by_layer

    parts = []
    for df, name in zip(tables, names):
        part = shares_by_layer(df)
        part.insert(0, "corpus", name)
        parts.append(part)
    return parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True)


# --------------------------------------------------------------------------------------------
# Summaries under resampling
# --------------------------------------------------------------------------------------------


def winner_sums(tax_records: Sequence[dict]) -> np.ndarray:
    """Per-window source-winner sums ``[W, L, H, 3]`` (self, sink, other) from the records of
    :func:`taxonomy_stage` (one window each)."""
    def get(r):
        sums = r["tax"]["sums"]
        return [np.stack([sums[l]["winner_self"], sums[l]["winner_sink"], sums[l]["winner_other"]], -1)
                for l in layer_order(sums)]
    return per_window_array(tax_records, get)


def _taxonomy_records(per_window: dict) -> list:
    return one_window_each(per_window, "taxonomy", "heads")


def resampled_sensitivity(per_window: dict, weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Single-head removal on the calibration windows under resampling ``weights`` (counts per
    calibration window ``[R, Wc]``; None: each once): ``base_ppl [R]`` (the unedited perplexity) and
    ``delta [R, L·H]`` (ΔPPL of removing each head alone, row ``layer·H + head``), from
    ``per_window["sensitivity"]`` and the calibration windows' taxonomy records."""
    nll_s = np.asarray(per_window["sensitivity"], dtype=np.float64)                 # [L*H, Wc]
    calib = _taxonomy_records(per_window)[:nll_s.shape[1]]
    base = per_window_array(calib, lambda t: t["nll"])
    tok = per_window_array(calib, lambda t: t["tokens"])
    counts = resampling.counts_or_once(weights, len(calib))
    ppl = resampling.resampled_perplexity(counts, np.concatenate([base[None], nll_s], 0).T, tok)
    return {"base_ppl": ppl[:, 0], "delta": ppl[:, 1:] - ppl[:, :1]}


def calibration_perplexity(per_window: dict) -> float:
    """The unedited perplexity of the calibration windows (from their taxonomy records)."""
    calib = _taxonomy_records(per_window)[:np.shape(per_window["sensitivity"])[1]]
    return perplexity(per_window_array(calib, lambda t: t["nll"]).sum(), per_window_array(calib, lambda t: t["tokens"]).sum())


def resampled(per_window: dict, weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The head experiment's regime shares under resampling ``weights`` (bootstrap counts per window
    ``[R, W]``, :func:`attngeom.stats.resampling.resample_counts`; None: every window once, ``R = 1``)
    over all windows of the first corpus, from its ``per_window["taxonomy"]`` records
    (``batch_size=1``): ``{"regime_shares": [R, 3]}`` in the order of
    :data:`~attngeom.heads.taxonomy.REGIMES`, plurality with ties to the first (as
    :func:`attngeom.heads.taxonomy.regimes_of`; tests/unit/test_claims.py checks both agree)."""
    X = winner_sums(_taxonomy_records(per_window))
    counts = resampling.counts_or_once(weights, len(X))
    s = resampling.resample_sums(counts, X)                                  # [R, L, H, 3]
    reg = s.argmax(-1).reshape(counts.shape[0], -1)                  # [R, L*H]
    return {"regime_shares": share_of_each_regime(reg)}


def resampled_removal(per_window: dict, weights: np.ndarray | None = None,
                    extra: dict | None = None) -> dict[tuple, np.ndarray]:
    """Held-out perplexity of every (order, retention) of ``per_window["removal"]``
    (:func:`heldout_removal_nll`; ``("", 100.0)`` the unedited model), and of the ``extra`` removals
    (key -> summed NLL per held-out window ``[Wh]``, e.g. from :func:`removal_nll`), under resampling
    ``weights`` (counts per held-out window ``[R, Wh]``; None: each once): key -> ``[R]``."""
    removal = per_window["removal"]
    keys, nll = list(removal["keys"]), np.asarray(removal["nll"], dtype=np.float64)
    if extra:
        keys += list(extra)
        nll = np.concatenate([nll, np.stack([np.asarray(x, dtype=np.float64) for x in extra.values()])], 0)
    tokens = np.asarray(removal["tokens"], dtype=np.float64)
    counts = resampling.counts_or_once(weights, len(tokens))
    ppl = resampling.resampled_perplexity(counts, nll.T, tokens)
    return {k: ppl[:, i] for i, k in enumerate(keys)}


# --------------------------------------------------------------------------------------------
# The command's summary.json: built here, and read back here for the report's headline
# --------------------------------------------------------------------------------------------


TABLES = ("heads", "removal", "order_search", "regimes_by_layer")
"""The tables ``attngeom heads`` writes, in this order (``<name>.parquet``)."""


def run_summary(result: ExperimentResult, *, model: str, data: Sequence[str], window: int, identity: dict) -> dict:
    """``summary.json`` of ``attngeom heads`` from :func:`experiment`'s ``result``: the corpora, the
    experiment's summary (regime shares, the calibrated regime order, critical heads, ...), the
    run's ``identity`` and the tables' files. :func:`headline` reads the report's numbers from it."""
    return {"command": "heads", "model": model, "data": list(data), "window": window, **result.summary,
            "settings": identity, "files": [f"{t}.parquet" for t in TABLES]}


def headline(summary: dict) -> list[tuple[str, str]]:
    """The headline numbers of ``attngeom heads``' report from its :func:`run_summary` (a missing
    field raises)."""
    share = resampling.format_share
    out = [(f"regime shares, {corpus}", ", ".join(f"{r} {share(v)}" for r, v in shares.items()))
           for corpus, shares in summary["regime_share"].items()]
    out.append(("regime order chosen on calibration (first removed first)", " > ".join(summary["taxonomy_regime_order"])))
    few = summary.get("calibration_windows", resampling.MIN_UNITS) < resampling.MIN_UNITS   # older summaries: none
    out.append(("individually critical heads", str(len(summary["critical_heads"])) + (
        f" (from {summary['calibration_windows']} calibration windows: fewer than {resampling.MIN_UNITS}, an example, "
        "not an estimate)" if few else "")))
    return out
