"""A seeded bootstrap over windows (docs/claims.md): resample counts, percentile intervals, ratio-of-sums
statistics and pairwise "A beats B" shares. Pure numpy; no model, no pandas.

The experiments record additive sums per window (NLL and token counts, reducer sums, histogram
counts). A bootstrap resample draws ``W`` windows with replacement; it is fully described by the
**counts** ``c [W]`` (how often each window was drawn, ``Σ c = W``), and any additive record of the
resample is ``Σ_w c_w x_w`` — for a whole batch of resamples one matrix product
``C [R, W] @ X [W, K] -> [R, K]`` (:func:`resample_sums`). A statistic that is a function of sums
(a perplexity ``exp(Σ NLL / Σ tokens)``, a mean ``Σ x / Σ n``, a median over heads of per-head
ratios, ...) is then evaluated on every row. :func:`attngeom.runs.run.merge_sums` with
``weights=counts`` is the same resample for records of any shape (the slow, general path).

Conventions: ``n_resamples`` resamples (default 1000; shape letter ``R``), 95 % **percentile** intervals
(``[q_{2.5 %}, q_{97.5 %}]`` of the resampled statistic, numpy's linear interpolation), one
``numpy.random.default_rng(seed)`` stream per call so a seed fixes every resample.

**Sample size.** An interval needs at least :data:`MIN_UNITS` independent units (windows or
examples). ``n`` units have only ``C(2n-1, n)`` distinct resamples (3 for 2 windows, 35 for 4, 92,378
for 10): below 10 the percentile interval is made of a handful of values, often ends at the point
value itself and covers far less than 95 %. :func:`percentile_interval` and :func:`interval_dict`
given ``units`` below the minimum return no interval (NaN / None), and a verdict resting on them is
:data:`TOO_FEW` (:func:`enough_units` is the one test).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95
MIN_UNITS = 10
"""The fewest independent units (windows, examples) an interval is computed from."""
TOO_FEW = "too few windows"
"""The verdict of a claim whose interval would rest on fewer than :data:`MIN_UNITS` windows."""


def enough_units(n: int) -> bool:
    """Whether ``n`` independent units are enough for an interval (``n >= MIN_UNITS``)."""
    return int(n) >= MIN_UNITS


def resample_counts(n: int, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> np.ndarray:
    """Counts of ``n_resamples`` bootstrap resamples of ``n`` items: int64 ``[R, n]``, every row sums
    to ``n`` (row ``b`` is a multinomial draw with equal probabilities, i.e. ``n`` draws with
    replacement).
    ``n = 0`` gives ``[R, 0]``."""
    if n < 0 or n_resamples < 1:
        raise ValueError(f"need n >= 0 and n_resamples >= 1, got n={n}, n_resamples={n_resamples}")
    if n == 0:
        return np.zeros((n_resamples, 0), dtype=np.int64)
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_resamples).astype(np.int64)


def counts_or_once(weights: np.ndarray | None, n: int) -> np.ndarray:
    """Resampling ``weights`` (counts ``[R, n]``) as given, or ``[1, n]`` ones for None (every item
    once: the point estimate)."""
    return np.ones((1, n)) if weights is None else np.asarray(weights)


def resample_sums(counts: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sums of per-item records under each resample: ``counts [R, W]``, ``x [W, ...]`` ->
    float64 ``[R, ...]`` (``Σ_w counts[b, w] · x[w]``)."""
    x = np.asarray(x, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    if counts.shape[1] != x.shape[0]:
        raise ValueError(f"counts cover {counts.shape[1]} items, records {x.shape[0]}")
    flat = x.reshape(x.shape[0], -1)
    return (counts @ flat).reshape((counts.shape[0],) + x.shape[1:])


def ratio_of_sums(counts: np.ndarray, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``Σ c·num / Σ c·den`` per resample: ``num, den [W, ...]`` -> ``[R, ...]`` (NaN where the
    resampled denominator is 0)."""
    n = resample_sums(counts, num)
    d = resample_sums(counts, den)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d != 0, n / np.where(d != 0, d, 1.0), np.nan)


def resampled_perplexity(counts: np.ndarray, nll: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Perplexity ``exp(Σ c·NLL / Σ c·tokens)`` per resample: ``nll [W, ...]`` (summed NLL per
    window and variant), ``tokens [W]`` -> ``[R, ...]`` (NaN where a resample has no token:
    :func:`attngeom.runs.contract.perplexity`)."""
    from attngeom.runs.contract import perplexity as ppl

    nll = np.asarray(nll, dtype=np.float64)
    tok = np.asarray(tokens, dtype=np.float64).reshape((-1,) + (1,) * (nll.ndim - 1))
    return ppl(resample_sums(counts, nll), resample_sums(counts, np.broadcast_to(tok, nll.shape)))


def percentile_interval(samples: np.ndarray, level: float = DEFAULT_LEVEL,
                        units: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of bootstrap ``samples [R, ...]`` along axis 0: ``(low, high)`` each
    ``[...]``. NaN resamples are left out (all NaN -> NaN). ``units``: the number of independent
    units resampled; below :data:`MIN_UNITS` both ends are NaN."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    s = np.asarray(samples, dtype=np.float64)
    if units is not None and not enough_units(units):
        nan = np.full(s.shape[1:], np.nan)
        return nan, nan.copy()
    a = (1 - level) / 2
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lo = np.nanquantile(s, a, axis=0)
            hi = np.nanquantile(s, 1 - a, axis=0)
    return lo, hi


def beats_share(samples: np.ndarray, larger_is_better: bool = True) -> np.ndarray:
    """Pairwise "A beats B in x of the resamples": ``samples [R, M]`` (one column per contender)
    -> ``[M, M]`` with entry ``[i, j]`` the share of resamples where ``i`` is strictly better than
    ``j`` (ties count half; NaN rows are left out). The diagonal is 0.5."""
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s).all(axis=1)]
    if not larger_is_better:
        s = -s
    if len(s) == 0:
        return np.full((samples.shape[1], samples.shape[1]), np.nan)
    d = s[:, :, None] - s[:, None, :]
    return (d > 0).mean(0) + 0.5 * (d == 0).mean(0)


def bootstrap(n: int, statistic: Callable[[np.ndarray], np.ndarray], n_resamples: int = DEFAULT_RESAMPLES,
              seed: int = 0, batch: int | None = None) -> np.ndarray:
    """Resampled values of ``statistic``, which maps counts ``[b, n]`` to values ``[b, ...]``
    (vectorised over resamples): returns ``[R, ...]``. ``batch``: evaluate at most this many
    resamples per call (bounds memory); the counts are those of :func:`resample_counts` with
    ``seed`` whatever ``batch`` is."""
    counts = resample_counts(n, n_resamples, seed)
    if batch is None or batch >= n_resamples:
        return np.asarray(statistic(counts))
    parts = [np.asarray(statistic(counts[i:i + batch])) for i in range(0, n_resamples, batch)]
    return np.concatenate(parts, axis=0)


def bootstrap_loop(n: int, statistic: Callable[[np.ndarray], object], n_resamples: int = DEFAULT_RESAMPLES,
                   seed: int = 0) -> list:
    """The slow, general path: ``statistic(counts [n])`` once per resample (e.g.
    ``merge_sums(records, weights=counts)`` then a reducer's ``result()``); same counts as
    :func:`bootstrap` for the same ``seed``. Returns the ``n_resamples`` values in order."""
    return [statistic(c) for c in resample_counts(n, n_resamples, seed)]


def interval_dict(point, samples: np.ndarray, level: float = DEFAULT_LEVEL, units: int | None = None) -> dict:
    """``{"value", "low", "high"}`` of a scalar statistic (floats; NaN -> None; no interval below
    :data:`MIN_UNITS` ``units``)."""
    lo, hi = percentile_interval(np.asarray(samples, dtype=np.float64).reshape(len(samples), -1), level, units)
    return {"value": _num(point), "low": _num(lo[0]), "high": _num(hi[0])}


def side_of(low, high, threshold: float = 0.0) -> int:
    """+1 when the interval ``[low, high]`` lies strictly above ``threshold``, −1 strictly below,
    0 when it contains it (or is missing)."""
    if low is None or high is None or not (np.isfinite(low) and np.isfinite(high)):
        return 0
    if low > threshold:
        return 1
    if high < threshold:
        return -1
    return 0


def nanmedian_rows(x: np.ndarray) -> np.ndarray:
    """Median over axis 1 ignoring NaN (all NaN -> NaN), without warnings: ``[R, K] -> [R]``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(np.asarray(x, dtype=np.float64), axis=1)


def nanmean_rows(x: np.ndarray) -> np.ndarray:
    """Mean over axis 1 ignoring NaN (all NaN -> NaN), without warnings: ``[R, K] -> [R]``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.asarray(x, dtype=np.float64), axis=1)


def format_number(x, signed: bool = False) -> str:
    """The one way a statistic is written: 4 significant digits, thousands separated by commas
    and no exponent from 1,000 up (``72,390``), an exponent only below 0.001 (``1.2e-05``);
    ``"—"`` when missing."""
    x = _num(x)
    if x is None:
        return "—"
    sign = "+" if signed else ""
    a = abs(x)
    if a >= 1000:
        return format(round(x), sign + ",d")
    if a != 0 and a < 1e-3:
        return format(x, sign + ".2e")
    return format(x, sign + ".4g")


def format_share(x) -> str:
    """A share written as a percentage with one decimal (``42.5 %``); ``"—"`` when missing."""
    return "—" if x is None else f"{100 * x:.1f} %"


def _num(x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if np.isfinite(x) else None


__all__: Sequence[str] = (
    "DEFAULT_RESAMPLES", "DEFAULT_LEVEL", "MIN_UNITS", "TOO_FEW", "enough_units", "format_number", "resample_counts", "counts_or_once", "resample_sums", "ratio_of_sums", "resampled_perplexity",
    "percentile_interval", "beats_share", "bootstrap", "bootstrap_loop", "interval_dict", "side_of",
    "nanmedian_rows", "nanmean_rows")
