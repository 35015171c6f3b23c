"""bf16 against float32: how far each metric of SPEC §2 moves when the model runs in bfloat16.

The comparison is end to end: the same checkpoint loaded twice, once in float32 and once in
bfloat16 (weights rounded to bf16, every matmul of the forward in bf16, softmax in float32 then
cast to bf16, as eager does), analysed on the same token ids. attngeom's metric math itself runs in
float32 in both cases (capture upcasts q/k/v pieces, the attention probabilities and W_O); what
differs is what the bf16 forward hands it. ``tests/models/test_precision.py`` checks the bounds written in
``docs/precision.md``; this module also prints the full report::

    .venv/bin/python tests/precision_check.py [--data CORPUS]  (default: the WikiText excerpt in tests/data)
        [--window 256] [--windows 4] [--faith-windows 4] [--json out/precision.json]

Measures, over every layer, head and query (the first ``MIN_QUERY`` queries are skipped for the
rank measures, which need a few sources to rank):

- ``max_abs``: the largest absolute deviation of any entry of the map;
- ``row_rel``: per (layer, head, query) row, ``Σ_j |x'_ij − x_ij| / Σ_j |x_ij|`` (the share of the
  row's mass that moved); reported as median, 99th percentile and max;
- ``top1``: share of rows whose top source is the same; ``top5``: mean overlap of the top-5 sets;
- for ``head_output_norm`` (``[H, T]``): ``|x' − x| / |x|`` per (head, query);
- ``contribution`` rows binned by the cancellation ratio ``κ_i^h = Σ_j a_ij ‖ṽ_j‖ / ‖o_i^h‖``
  (κ = 1 when all value vectors point the same way; large κ: the head output is a small remainder
  of large, cancelling terms, and its rounding error is amplified by κ);
- faithfulness: ``ΔPPL = PPL' − PPL_clean`` per variant and its relative deviation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

MAP_METRICS = ("attention", "value_weighted", "output_normalized", "contribution", "contribution_inter")
MIN_QUERY = 8
KAPPA_BINS = (1.0, 2.0, 5.0, 20.0, math.inf)

FAITH_VARIANTS = (
    ("contribution", "comprehensiveness", 0.1),
    ("contribution", "comprehensiveness", 0.5),
    ("contribution", "sufficiency", 0.5),
    ("attention", "comprehensiveness", 0.3),
    ("attention", "sufficiency", 0.5),
    ("value_weighted", "sufficiency", 0.3),
    ("output_normalized", "comprehensiveness", 0.3),
    ("random", "comprehensiveness", 0.5),
)


def sample_windows(handle, window: int, n: int, data: str | None = None) -> list[list[int]]:
    """``n`` windows of ``window`` tokens from ``data`` (a text file), or from the built-in sample
    text (repeated) when ``data`` is None or missing."""
    from attngeom.data.corpora import SAMPLE_TEXT, load_windows, windows

    if data and Path(data).exists():
        return load_windows(handle, data, window=window, max_windows=n)
    ids = handle.encode(SAMPLE_TEXT * (1 + (window * n) // 150))[1:]
    return windows(ids, window, bos=handle.tokenizer.bos_token_id, max_windows=n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def compare_traces(t32, t16, min_query: int = MIN_QUERY) -> dict:
    """Per-metric deviation arrays of two traces of the same ids (lists, concatenated later)."""
    out: dict[str, dict[str, list]] = {}

    def add(name, key, arr):
        out.setdefault(name, {}).setdefault(key, []).append(np.asarray(arr, dtype=np.float64).ravel())

    for l32, l16 in zip(t32.layers, t16.layers):
        for name in MAP_METRICS:
            x = torch.from_numpy(np.ascontiguousarray(l32.metric(name))).double()
            y = torch.from_numpy(np.ascontiguousarray(l16.metric(name))).double()
            d = (y - x).abs()
            add(name, "max_abs", [float(d.max())])
            rows_x, rows_d = _rows(x[:, min_query:]), _rows(d[:, min_query:])
            mass = rows_x.abs().sum(-1)
            add(name, "row_rel", (rows_d.sum(-1) / mass.clamp_min(1e-30)).numpy())
            rx, ry = _rows(x[:, min_query:]), _rows(y[:, min_query:])
            add(name, "top1", (rx.argmax(-1) == ry.argmax(-1)).double().numpy())
            k = 5
            tx, ty = rx.topk(k, -1).indices, ry.topk(k, -1).indices
            overlap = (tx[:, :, None] == ty[:, None, :]).any(-1).double().mean(-1)
            add(name, "top5", overlap.numpy())
            if name == "contribution":
                a = torch.from_numpy(l32.attention).double()
                vn = torch.from_numpy(l32.value_norm).double()            # [H, T]
                on = torch.from_numpy(l32.head_output_norm).double()      # [H, T]
                kappa = (a * vn[:, None, :]).sum(-1) / on.clamp_min(1e-30)  # [H, T]
                add(name, "kappa", kappa[:, min_query:].reshape(-1).numpy())
                add(name, "sink_share", a[:, min_query:, 0].reshape(-1).numpy())
                # the rest of the row (sources j >= 1): what a sink-dominated row says about the others
                rest_x, rest_d = _rows(x[:, min_query:, 1:]), _rows(d[:, min_query:, 1:])
                add(name, "rest_row_rel", (rest_d.sum(-1) / rest_x.abs().sum(-1).clamp_min(1e-30)).numpy())
                rx1, ry1 = _rows(x[:, min_query:, 1:]), _rows(y[:, min_query:, 1:])
                add(name, "rest_top1", (rx1.argmax(-1) == ry1.argmax(-1)).double().numpy())
                add(name, "layer_row_rel_median", [float(np.median(out[name]["row_rel"][-1]))])
                add(name, "layer_index", [l32.index])
                # entrywise relative error by magnitude (visible entries only)
                vis = torch.ones_like(x, dtype=torch.bool).tril()[:, min_query:]
                xe, de = x[:, min_query:][vis], d[:, min_query:][vis]
                add(name, "entry_abs", xe.abs().numpy())
                add(name, "entry_dev", de.numpy())
                # the cosine factor, per row: max |Δcos| over the row's sources, binned by κ later
                c32 = torch.from_numpy(l32.factors()["cosine"]).double()
                c16 = torch.from_numpy(l16.factors()["cosine"]).double()
                add(name, "cos_row_max_dev", ((c16 - c32).abs() * torch.ones_like(c32).tril())[:, min_query:]
                    .amax(-1).reshape(-1).numpy())
        x = torch.from_numpy(l32.head_output_norm).double()
        y = torch.from_numpy(l16.head_output_norm).double()
        add("head_output_norm", "max_abs", [float((y - x).abs().max())])
        add("head_output_norm", "rel", ((y - x).abs() / x.clamp_min(1e-30)).reshape(-1).numpy())
        # Σ_j c_ij^h = 1 in bf16 too (the invariant is exact given the captured pieces)
        c16 = torch.from_numpy(l16.contribution).double().sum(-1)
        add("invariants", "sum_c_dev", [float((c16 - 1).abs().max())])
        C16 = torch.from_numpy(l16.contribution_inter).double().sum((0, 2))
        add("invariants", "sum_C_dev", [float((C16 - 1).abs().max())])
    return out


def merge(parts: list[dict]) -> dict:
    merged: dict[str, dict[str, np.ndarray]] = {}
    for p in parts:
        for name, d in p.items():
            for key, arrs in d.items():
                merged.setdefault(name, {}).setdefault(key, []).extend(arrs)
    return {n: {k: np.concatenate(v) for k, v in d.items()} for n, d in merged.items()}


def summarize(merged: dict) -> dict:
    """Bounds per metric from merged deviation arrays."""
    s: dict[str, dict] = {}
    for name in MAP_METRICS:
        d = merged[name]
        r = d["row_rel"]
        s[name] = {
            "max_abs": float(d["max_abs"].max()),
            "row_rel_median": float(np.median(r)),
            "row_rel_p99": float(np.quantile(r, 0.99)),
            "row_rel_max": float(r.max()),
            "top1_agreement": float(d["top1"].mean()),
            "top5_overlap": float(d["top5"].mean()),
            "rows": int(r.size),
        }
    d = merged["contribution"]
    bins = []
    for lo, hi in zip(KAPPA_BINS[:-1], KAPPA_BINS[1:]):
        sel = (d["kappa"] >= lo) & (d["kappa"] < hi)
        if sel.any():
            r = d["row_rel"][sel]
            bins.append({"kappa": [lo, hi], "rows": int(sel.sum()), "row_rel_median": float(np.median(r)),
                         "row_rel_p99": float(np.quantile(r, 0.99)), "row_rel_max": float(r.max()),
                         "top1_agreement": float(d["top1"][sel].mean())})
    s["contribution_by_kappa"] = bins
    for b in bins:
        lo, hi = b["kappa"]
        sel = (d["kappa"] >= lo) & (d["kappa"] < hi)
        b["cosine_row_max_dev_median"] = float(np.median(d["cos_row_max_dev"][sel]))
        b["cosine_row_max_dev_p99"] = float(np.quantile(d["cos_row_max_dev"][sel], 0.99))
    mags = []
    edges = (0.0, 1e-3, 1e-2, 1e-1, math.inf)
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (d["entry_abs"] >= lo) & (d["entry_abs"] < hi)
        if sel.any():
            rel = d["entry_dev"][sel] / np.maximum(d["entry_abs"][sel], 1e-30)
            mags.append({"abs_c": [lo, hi], "entries": int(sel.sum()), "abs_dev_p99": float(np.quantile(d["entry_dev"][sel], 0.99)),
                         "rel_dev_median": float(np.median(rel)), "rel_dev_p99": float(np.quantile(rel, 0.99))})
    s["contribution_by_magnitude"] = mags
    s["contribution_row_rel_median_by_layer"] = {
        int(i): float(np.mean(d["layer_row_rel_median"][d["layer_index"] == i])) for i in np.unique(d["layer_index"])}
    sink = d["sink_share"] >= 0.9
    s["contribution_sink_rows"] = {
        "rows": int(sink.sum()),
        "row_rel_median": float(np.median(d["row_rel"][sink])) if sink.any() else None,
        "row_rel_p99": float(np.quantile(d["row_rel"][sink], 0.99)) if sink.any() else None,
        "top1_agreement": float(d["top1"][sink].mean()) if sink.any() else None,
        "rest_of_row_rel_median": float(np.median(d["rest_row_rel"][sink])) if sink.any() else None,
        "rest_of_row_rel_p99": float(np.quantile(d["rest_row_rel"][sink], 0.99)) if sink.any() else None,
        "rest_of_row_top1_agreement": float(d["rest_top1"][sink].mean()) if sink.any() else None,
        "other_rows_row_rel_median": float(np.median(d["row_rel"][~sink])),
        "other_rows_top1_agreement": float(d["top1"][~sink].mean()),
    }
    h = merged["head_output_norm"]
    s["head_output_norm"] = {"max_abs": float(h["max_abs"].max()), "rel_median": float(np.median(h["rel"])),
                             "rel_p99": float(np.quantile(h["rel"], 0.99)), "rel_max": float(h["rel"].max())}
    s["invariants_bf16"] = {"max_abs_sum_c_minus_1": float(merged["invariants"]["sum_c_dev"].max()),
                            "max_abs_sum_C_minus_1": float(merged["invariants"]["sum_C_dev"].max())}
    return s


def measure_metrics(h32, h16, wins) -> dict:
    from attngeom.traces.trace import analyze

    parts = []
    for w in wins:
        parts.append(compare_traces(analyze(h32, w), analyze(h16, w)))
    return summarize(merge(parts))


def measure_faithfulness(h32, h16, wins, variants=FAITH_VARIANTS) -> dict:
    """ΔPPL per variant in both precisions over ``wins`` (pooled PPL, as the experiment reports)."""
    from attngeom.faithfulness.experiment import run_units, window_units
    from attngeom.capture.interventions import CLEAN, Variant

    vs = [CLEAN] + [Variant(m, mode, r, 0) for m, mode, r in variants]
    units = window_units(wins)
    res = {}
    for tag, h in (("float32", h32), ("bfloat16", h16)):
        r = run_units(h, units, vs, progress=False, rows=len(vs))
        ppl = {}
        for v in vs:
            nll = sum(r[(u, v.key)]["nll"] for u in range(len(units)))
            tok = sum(r[(u, v.key)]["tokens"] for u in range(len(units)))
            ppl[v.key] = math.exp(nll / tok)
        res[tag] = ppl
    rows = {}
    for v in vs:
        a, b = res["float32"][v.key], res["bfloat16"][v.key]
        if v.key == "clean":
            rows[v.key] = {"ppl_f32": a, "ppl_bf16": b, "rel": abs(b - a) / a}
            continue
        da, db = a - res["float32"]["clean"], b - res["bfloat16"]["clean"]
        rows[v.key] = {"dppl_f32": da, "dppl_bf16": db, "rel": abs(db - da) / max(abs(da), 1e-12),
                       "ppl_rel": abs(b - a) / a,
                       "log_ratio_dev": abs(math.log(b / res["bfloat16"]["clean"]) - math.log(a / res["float32"]["clean"]))}
    return rows


def load_pair(spec: str = "smollm2-135m"):
    from attngeom.model import load_model

    return load_model(spec, dtype="float32", device="cpu"), load_model(spec, dtype="bfloat16", device="cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parent / "data" / "wikitext-2-raw-test-excerpt.txt"))
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--faith-windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    h32, h16 = load_pair(args.model)
    wins = sample_windows(h32, args.window, max(args.windows, args.faith_windows), args.data)
    source = args.data if Path(args.data).exists() else "built-in sample text"
    report = {"model": h32.name, "data": source, "window": args.window,
              "windows": len(wins[: args.windows]), "faith_windows": len(wins[: args.faith_windows])}
    report["metrics"] = measure_metrics(h32, h16, wins[: args.windows])
    if args.faith_windows:
        report["faithfulness"] = measure_faithfulness(h32, h16, wins[: args.faith_windows])
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
