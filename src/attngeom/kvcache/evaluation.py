"""Evaluation under a KV-cache budget (docs/kvcache.md): language modelling and answers read
with the compressed cache of :mod:`attngeom.kvcache.cache`, and their summaries.

**Reading under a budget** (:func:`read_under_budget`): a text is read token by token (``chunk = 1``,
the reference) or ``chunk`` tokens per forward with eviction between chunks, and the next-token NLL,
the peak cache bytes and the time are recorded. **Answers under a budget**
(:func:`answer_under_budget`): a prompt is read whole, then the reference continuation's NLL and
greedy tokens follow from the compressed cache. :func:`experiment` and :func:`answers` run every
(window or example, policy, budget) as a resumable unit of a :class:`~attngeom.runs.run.Run`;
:func:`summarize`, :func:`summarize_answers` and :func:`pairwise` give 95 % bootstrap intervals over
windows/examples.

What belongs here: the evaluations and their summaries. Not here: the cache (:mod:`attngeom.kvcache.cache`),
the policies (:mod:`attngeom.kvcache.policies`), figures (:mod:`attngeom.reports.kvcache`), argument
parsing (:mod:`attngeom.commands.kvcache`).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from attngeom.model.arguments import takes_handle
from attngeom.errors import InputError
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike, perplexity
from attngeom.kvcache.cache import cache_bytes, cached_forward, compressing, new_cache
from attngeom.kvcache.policies import Policy, get_policy, taxonomy_budgets
from attngeom.kvcache.settings import KVCacheSettings

# --------------------------------------------------------------------------------------------
# Language modelling under a budget
# --------------------------------------------------------------------------------------------


@takes_handle
@torch.no_grad()
def read_under_budget(handle: ModelHandleLike, ids: Sequence[int], policy: Policy | str, budget: int | None, chunk: int = 1,
         head_budgets: dict | None = None, streaming: dict | None = None) -> dict:
    """Read ``ids`` with a compressed cache, ``chunk`` tokens per forward pass: ``{"nll": Σ NLL of
    tokens 1..T−1, "tokens": T−1, "seconds", "peak_bytes": largest cache storage after a pass,
    "final_bytes"}``."""
    policy = reading_policy(policy)
    if budget is not None and policy.name != "full" and chunk >= min(
            [budget] + [min(b) for b in (head_budgets or {}).values()]):
        raise InputError(f"--chunk {chunk} must be smaller than every budget (got budget {budget})")
    x = torch.as_tensor(list(ids), dtype=torch.long)[None]
    T = x.shape[1]
    cache = new_cache(handle, policy, budget, head_budgets, streaming)
    nll, peak = 0.0, 0
    t0 = time.perf_counter()
    with compressing(handle.model, cache):
        for s in range(0, T - 1, chunk):
            e = min(s + chunk, T - 1)
            logits = cached_forward(handle, cache, x[:, s:e])
            nll += float(torch.nn.functional.cross_entropy(logits[0], x[0, s + 1 : e + 1].to(logits.device),
                                                           reduction="sum"))
            peak = max(peak, cache_bytes(cache))
    seconds = time.perf_counter() - t0
    return {"nll": nll, "tokens": T - 1, "seconds": seconds, "peak_bytes": peak, "final_bytes": cache_bytes(cache)}


def reading_policy(policy: Policy | str) -> Policy:
    """The policy, refused in one line when it is defined only for compression once after a prefill."""
    policy = get_policy(policy) if isinstance(policy, str) else policy
    if policy.prefill_only:
        raise InputError(f"the {policy.name} policy compresses once after a prefill (attngeom kvtasks), "
                         "not while a text is read")
    return policy


# --------------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------------


def configurations(policies: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, int | None]]:
    """(policy, budget) pairs to run: ``full`` once (budget None), every other policy per budget."""
    out: list[tuple[str, int | None]] = []
    for p in policies:
        reading_policy(p)
        out += [(p, None)] if p == "full" else [(p, int(b)) for b in budgets]
    return out


def _budgets_for(handle: ModelHandleLike, name: str, budget: int | None, regimes: pd.DataFrame | None,
                 chunk: int = 1) -> tuple[dict | None, dict | None]:
    """Per-head budgets and streaming flags of a policy with per-head budgets (else None, None)."""
    if budget is None or not get_policy(name).per_head_budgets:
        return None, None
    if regimes is None:
        raise InputError(f"the {name} policy needs head regimes (a taxonomy table)")
    return taxonomy_budgets(regimes, handle.num_heads, handle.num_kv_heads, budget, chunk=chunk)


def _config_stage(handle: ModelHandleLike, run: RunLike, name: str, items: Sequence[Sequence[int]], configs, one, column: str,
                  regimes: pd.DataFrame | None, chunk: int = 1) -> pd.DataFrame:
    """Rows of ``one(i, policy, budget, head_budgets, streaming) -> dict`` for every (item ``i``,
    configuration), each a unit of stage ``name`` of ``run`` (resumable); ``full`` rows repeated
    for every budget of the other configurations."""
    from attngeom.runs.run import fingerprint, run_or_in_memory

    n_cfg = len(configs)
    fps = [fingerprint(items[u // n_cfg]) for u in range(len(items) * n_cfg)]

    def work(units: list[int]) -> dict:
        rows = []
        for u in units:
            i, (policy, budget) = u // n_cfg, configs[u % n_cfg]
            hb, st = _budgets_for(handle, policy, budget, regimes, chunk)
            rows.append({column: i, "policy": policy, "budget": -1 if budget is None else budget,
                         **one(i, policy, budget, hb, st)})
        return {"rows": pd.DataFrame(rows)}

    recs = run_or_in_memory(run).stage(name, len(items) * n_cfg, work, fingerprints=fps, desc=f"kvcache {name}",
                                   unit="read")
    df = pd.concat([d["rows"] for d in recs.values()], ignore_index=True)
    budgets = sorted({b for _, b in configs if b is not None})
    full, rest = df[df["policy"] == "full"], df[df["policy"] != "full"]
    if len(full) and budgets:
        full = pd.concat([full.assign(budget=b) for b in budgets], ignore_index=True)
    return pd.concat([rest, full], ignore_index=True).sort_values(["policy", "budget", column]).reset_index(drop=True)


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, windows: Sequence[Sequence[int]],
               settings: KVCacheSettings = KVCacheSettings(), *, regimes: pd.DataFrame | None = None) -> ExperimentResult:
    """Language modelling under a budget, with ``settings`` (:class:`~attngeom.kvcache.settings.KVCacheSettings`).
    Each (window, configuration) is a unit of stage ``"read"`` of ``run`` (resumable); ``full`` is
    read once per window and its row repeated for every budget (``budget`` is then the budget it is
    compared at). ``regimes``: the taxonomy table the ``taxonomy`` policy's budgets come from.

    Returns an :class:`~attngeom.runs.contract.ExperimentResult` with tables ``reads`` (one row per
    (window, policy, budget): ``nll, tokens, ppl, seconds, seconds_per_token, peak_bytes,
    final_bytes``), ``summary`` (:func:`summarize`) and ``pairs`` (:func:`pairwise`); ``per_window``:
    ``nll [windows, configurations]`` (summed NLL, columns ``keys`` = (policy, budget)) and
    ``tokens [windows]``, in window order."""
    configs = configurations(settings.policies, settings.budgets)
    chunk = settings.chunk
    df = _config_stage(handle, run, "read", windows, configs,
                       lambda i, p, b, hb, st: read_under_budget(handle, windows[i], p, b, chunk, hb, st), "window", regimes,
                       chunk)
    df["ppl"] = perplexity(df["nll"].to_numpy(), df["tokens"].to_numpy())
    df["seconds_per_token"] = df["seconds"] / df["tokens"]
    summary_df = summarize(df, settings.n_resamples)
    tables = {"reads": df, "summary": summary_df, "pairs": pairwise(df, settings.n_resamples)}
    wide = df.pivot(index="window", columns=["policy", "budget"], values="nll").sort_index()
    per_window = {"keys": [(p, int(b)) for p, b in wide.columns], "nll": wide.to_numpy(),
                  "tokens": df.groupby("window")["tokens"].first().sort_index().to_numpy()}
    return ExperimentResult("kvcache", tables, {"results": summary_df.to_dict(orient="records")}, per_window,
                            settings.record())


# --------------------------------------------------------------------------------------------
# Answers under a budget
# --------------------------------------------------------------------------------------------


@takes_handle
@torch.no_grad()
def answer_under_budget(handle: ModelHandleLike, prompt: Sequence[int], reference: Sequence[int], policy: Policy | str, budget: int | None,
           new_tokens: int = 16, head_budgets: dict | None = None, streaming: dict | None = None) -> dict:
    """Read ``prompt`` in one forward pass (the compressed cache evicts it down to the budget at the
    next step, with the scores of the prompt's queries: SnapKV's setting), then (1) the reference
    continuation's summed NLL, token by token, and (2) ``new_tokens`` greedy tokens, each from a
    fresh read of the prompt: ``{"ref_nll", "ref_tokens", "generated": "id id ...", "seconds"}``."""
    policy = reading_policy(policy)
    t0 = time.perf_counter()

    nll = 0.0
    cache = new_cache(handle, policy, budget, head_budgets, streaming)
    with compressing(handle.model, cache):
        last = cached_forward(handle, cache, torch.as_tensor([list(prompt)]))[0, -1]
        for t, tok in enumerate(reference):
            nll -= float(torch.log_softmax(last, -1)[tok])
            if t + 1 < len(reference):
                last = cached_forward(handle, cache, torch.tensor([[tok]]))[0, -1]
    out: list[int] = []
    cache = new_cache(handle, policy, budget, head_budgets, streaming)
    with compressing(handle.model, cache):
        last = cached_forward(handle, cache, torch.as_tensor([list(prompt)]))[0, -1]
        for t in range(new_tokens):
            out.append(int(last.argmax()))
            if t + 1 < new_tokens:
                last = cached_forward(handle, cache, torch.tensor([[out[-1]]]))[0, -1]
    return {"ref_nll": nll, "ref_tokens": len(reference), "generated": " ".join(map(str, out)),
            "seconds": time.perf_counter() - t0}


@takes_handle
def answers(handle: ModelHandleLike, run: RunLike, examples: Sequence[tuple[Sequence[int], Sequence[int]]], policies: Sequence[str],
            budgets: Sequence[int], new_tokens: int = 16, regimes: pd.DataFrame | None = None) -> pd.DataFrame:
    """Answers under a budget: one row per (example, policy, budget) with the reference's ``ref_nll``
    and ``ref_tokens``, and the greedy tokens' agreement with the full cache's: ``match`` (share of
    the ``new_tokens`` positions with the same token) and ``first_divergence`` (index of the first
    different token; ``new_tokens`` when none). ``full`` is always run (it is the reference)."""
    configs = configurations(["full"] + [p for p in policies if p != "full"], budgets)
    items = [[len(p)] + list(p) + list(r) for p, r in examples]      # the fingerprint sees the split too
    df = _config_stage(handle, run, "answers", items, configs,
                       lambda i, p, b, hb, st: answer_under_budget(handle, examples[i][0], examples[i][1], p, b, new_tokens, hb, st),
                       "example", regimes)
    ref = df[df["policy"] == "full"].drop_duplicates("example").set_index("example")["generated"]
    match, first = [], []
    for ex, gen in zip(df["example"], df["generated"]):
        a, b = gen.split(), ref.loc[ex].split()
        same = [x == y for x, y in zip(a, b)]
        match.append(float(np.mean(same)) if same else 1.0)
        first.append(same.index(False) if False in same else len(same))
    df["match"], df["first_divergence"] = match, first
    return df


# --------------------------------------------------------------------------------------------
# Summaries with bootstrap intervals
# --------------------------------------------------------------------------------------------


def summarize(df: pd.DataFrame, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per (policy, budget): perplexity over windows (``exp(Σ NLL / Σ tokens)``) with its 95 %
    bootstrap interval (NaN below :data:`~attngeom.stats.resampling.MIN_UNITS` windows); when ``full`` was run, the difference to the full cache's perplexity on the
    same resamples (``delta_ppl``, ``delta_low``, ``delta_high``), ``memory_saved`` (1 − peak cache
    bytes / the full cache's) and ``time_ratio`` (time per token / the full cache's)."""
    from attngeom.stats.resampling import percentile_interval, resample_counts
    from attngeom.stats.resampling import resampled_perplexity as resampled

    windows = sorted(df["window"].unique())
    counts = resample_counts(len(windows), n_resamples, seed)
    pos = {w: i for i, w in enumerate(windows)}

    def per_window(g, col):
        out = np.full(len(windows), np.nan)
        out[[pos[w] for w in g["window"]]] = g[col].to_numpy()
        return out

    rows = []
    for (policy, budget), g in df.groupby(["policy", "budget"], sort=True):
        nll, tok = per_window(g, "nll"), per_window(g, "tokens")
        boot = resampled(counts, nll, tok)
        lo, hi = percentile_interval(boot, units=len(windows))
        row = {"policy": policy, "budget": int(budget), "windows": int(len(g)),
               "ppl": float(perplexity(np.nansum(nll), np.nansum(tok))), "ppl_low": float(lo), "ppl_high": float(hi),
               "peak_bytes": float(g["peak_bytes"].mean()), "seconds_per_token": float(g["seconds"].sum() / g["tokens"].sum())}
        f = df[(df["policy"] == "full") & (df["budget"] == budget)]
        if len(f):
            fb = resampled(counts, per_window(f, "nll"), per_window(f, "tokens"))
            dlo, dhi = percentile_interval(boot - fb, units=len(windows))
            row.update({"delta_ppl": row["ppl"] - perplexity(f["nll"].sum(), f["tokens"].sum()),
                        "delta_low": float(dlo), "delta_high": float(dhi),
                        "memory_saved": 1.0 - row["peak_bytes"] / float(f["peak_bytes"].mean()),
                        "time_ratio": row["seconds_per_token"] / float(f["seconds"].sum() / f["tokens"].sum())})
        rows.append(row)
    return pd.DataFrame(rows)


def summarize_answers(df: pd.DataFrame, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per (policy, budget): mean greedy agreement with the full cache (``match``) and mean first
    divergence, each with a 95 % bootstrap interval over examples, and the reference's perplexity
    (``exp(Σ NLL / Σ tokens)``) with its interval and its difference to the full cache's."""
    from attngeom.stats.resampling import percentile_interval, ratio_of_sums, resample_counts
    from attngeom.stats.resampling import resampled_perplexity as resampled

    examples = sorted(df["example"].unique())
    counts = resample_counts(len(examples), n_resamples, seed)
    rows = []
    for (policy, budget), g in df.groupby(["policy", "budget"], sort=True):
        g = g.set_index("example").loc[examples]
        ones = np.ones(len(g))
        row = {"policy": policy, "budget": int(budget), "examples": int(len(g))}
        for col in ("match", "first_divergence"):
            lo, hi = percentile_interval(ratio_of_sums(counts, g[col].to_numpy(float), ones), units=len(examples))
            row.update({col: float(g[col].mean()), f"{col}_low": float(lo), f"{col}_high": float(hi)})
        boot = resampled(counts, g["ref_nll"].to_numpy(), g["ref_tokens"].to_numpy())
        lo, hi = percentile_interval(boot, units=len(examples))
        row.update({"ref_ppl": perplexity(g["ref_nll"].sum(), g["ref_tokens"].sum()),
                    "ref_ppl_low": float(lo), "ref_ppl_high": float(hi)})
        f = df[(df["policy"] == "full") & (df["budget"] == budget)].set_index("example").loc[examples]
        fb = resampled(counts, f["ref_nll"].to_numpy(), f["ref_tokens"].to_numpy())
        dlo, dhi = percentile_interval(boot - fb, units=len(examples))
        row.update({"ref_delta_ppl": row["ref_ppl"] - perplexity(f["ref_nll"].sum(), f["ref_tokens"].sum()),
                    "ref_delta_low": float(dlo), "ref_delta_high": float(dhi)})
        rows.append(row)
    return pd.DataFrame(rows)


def pairwise(df: pd.DataFrame, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Every pair of policies at every budget, on the same bootstrap resamples of the windows:
    ``ppl_a − ppl_b`` (pooled perplexities) with its 95 % interval, and ``a_better``, the share of
    resamples where ``a`` has the lower perplexity (``full`` included)."""
    from attngeom.stats.resampling import percentile_interval, resample_counts
    from attngeom.stats.resampling import resampled_perplexity as resampled

    windows = sorted(df["window"].unique())
    counts = resample_counts(len(windows), n_resamples, seed)
    rows = []
    for budget, g in df.groupby("budget", sort=True):
        boots, ppl = {}, {}
        for policy, h in g.groupby("policy"):
            h = h.set_index("window").loc[windows]
            boots[policy] = resampled(counts, h["nll"].to_numpy(), h["tokens"].to_numpy())
            ppl[policy] = perplexity(h["nll"].sum(), h["tokens"].sum())
        for a in sorted(boots):
            for b in sorted(boots):
                if a != b:
                    lo, hi = percentile_interval(boots[a] - boots[b], units=len(windows))
                    rows.append({"budget": int(budget), "a": a, "b": b, "delta_ppl": ppl[a] - ppl[b],
                                 "delta_low": float(lo), "delta_high": float(hi),
                                 "a_better": float(np.mean(boots[a] < boots[b]))})
    return pd.DataFrame(rows)
