"""attngeom.claims: each analysis's resampled summary (``resampled(per_window, weights)``) against the
experiment's own code (full sample and one explicit resample through merge_sums), the verdict rules, the
catalogue against docs/claims.md, what claims/ may read of the other analyses, and the command end to end."""

import json

import numpy as np
import pandas as pd
import pytest

from attngeom import claims as CL
from attngeom import faithfulness as FA
from attngeom import heads as HD
from attngeom.selection import experiment as SE
from attngeom import sinks as SK
from attngeom.cli import main
from attngeom.runs.storage import decode_record, encode_record
from attngeom.reports.claims import escape
from attngeom.runs.run import InMemoryRun, merge_sums
from attngeom.selection.settings import SelectionSettings
from attngeom.heads.taxonomy import REGIMES, regime_shares, regimes_of


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    h = tiny_llama
    rng = np.random.default_rng(0)
    V = h.model.config.vocab_size
    ids = [[int(x) for x in rng.integers(1, V, 16)] for _ in range(4)]
    return h, ids


def test_histogram_quantile_over_many_histograms_equals_one_at_a_time():
    rng = np.random.default_rng(0)
    lo, hi, bins = -1.0, 1.0, 10
    c = rng.integers(0, 5, size=(50, bins + 2)).astype(float)
    c[0] = 0                      # empty
    c[1] = 0
    c[1, 0] = 3                   # all below lo
    c[2] = 0
    c[2, -1] = 2                  # all above hi
    c[3] = 0
    c[3, 4] = 1                   # one bin
    for q in (0.1, 0.5, 0.9):
        v = SK.histogram_quantile(c, lo, hi, q)
        for k in range(len(c)):
            ref = SK.histogram_quantile(c[k], lo, hi, q)
            if np.isnan(ref):
                assert np.isnan(v[k])
            else:
                assert v[k] == pytest.approx(ref, abs=1e-12)


def test_quadratic_fit_shape_equals_quadratic_fit():
    rng = np.random.default_rng(1)
    sums = []
    for k in range(60):
        n = int(rng.integers(1, 40))
        rho = rng.uniform(0, 1, n) if k % 7 else np.full(n, 0.3)
        a, b = rng.normal(), rng.normal()
        y = a * rho ** 2 + b * rho + 1 + 0.05 * rng.normal(size=n)
        sums.append([n, rho.sum(), (rho ** 2).sum(), (rho ** 3).sum(), (rho ** 4).sum(), y.sum(), (y * rho).sum(),
                     (y * rho ** 2).sum(), (y * y).sum()])
    sums = np.array(sums)
    convex, interior = SK.quadratic_fit_shape(sums)
    for k in range(len(sums)):
        ref = SK.quadratic_fit(sums[k])
        assert bool(convex[k]) == bool(ref["convex"])
        assert bool(interior[k]) == bool(ref["convex"] and 0 < ref["vertex"] < 1)


def _sink_reference(recs, weights=None):
    merged = merge_sums(recs, weights=weights)
    t = SK.results_from(merged)
    s = SK.summarize(t["heads"], t["hist"], t["ppl"], t["drift"])
    h = t["heads"]
    s["raw_ratio"] = float(h["raw_value_norm_ratio"].median())
    heavy = (h["cone_sink_heavy_removed"].mean() - h["cone_sink_heavy_base"].mean())
    return s, heavy


def test_sinks_summary_equals_summarize_on_the_sample_and_on_a_resample(tiny):
    h, ids = tiny
    work = SK.window_work(h, ids, batch_size=1)
    recs = [decode_record(encode_record(work([u]))) for u in range(len(ids))]   # as a Run stores them
    for counts in (np.ones(len(ids), dtype=int), np.array([2, 0, 1, 1])):
        got = {k: v[0] for k, v in SK.resampled({"records": recs}, counts[None]).items()}
        ref, heavy = _sink_reference(recs, list(counts))
        assert got["value_norm_ratio_raw"] == pytest.approx(ref["raw_ratio"], rel=1e-9)
        assert got["value_norm_ratio_projected"] == pytest.approx(ref["value_norm_ratio"], rel=1e-9)
        assert got["anti_aligned_share"] == pytest.approx(ref["anti_aligned_share"])
        assert got["fit_convex_share"] == pytest.approx(ref["fit_convex_share"])
        assert got["fit_vertex_interior_share"] == pytest.approx(ref["fit_vertex_interior_share"])
        assert got["cos_v0_m_pooled_median"] == pytest.approx(ref["cos_v0_m_median"], abs=1e-9)
        assert got["removal_output_norm_ratio"] == pytest.approx(ref["removal_output_norm_ratio"], rel=1e-9)
        assert got["cone_removed"] == pytest.approx(ref["cone_removed"], rel=1e-9)
        assert got["cone_base"] == pytest.approx(ref["cone_base"], rel=1e-9)
        if np.isfinite(heavy):
            assert got["cone_sink_heavy_change"] == pytest.approx(heavy, rel=1e-9)
        assert got["removal_delta_ppl"] == pytest.approx(ref["removal_delta_ppl"], rel=1e-9)
        assert got["control_delta_ppl"] == pytest.approx(ref["control_delta_ppl"], rel=1e-9)


def test_faithfulness_summary_equals_summarize(tiny):
    h, ids = tiny
    variants = FA.build_variants(["attention", "contribution", "random"], [0.3, 0.7], seeds=[0, 1])
    units = FA.window_units(ids)
    res = FA.run_units(h, units, variants, run=InMemoryRun(), progress=False)
    nll = np.array([[res[(u, v.key)]["nll"] for v in variants] for u in range(len(ids))])
    tok = np.array([u.n_scored for u in units], dtype=float)
    for counts in (np.ones(len(ids), dtype=int), np.array([0, 3, 1, 0])):
        got = FA.resampled({"nll": nll, "tokens": tok, "variants": variants}, counts[None])
        # the reference: the experiment's own table on the resample (window u repeated counts[u] times)
        rep = [u for u in range(len(ids)) for _ in range(counts[u])]
        fake = {(i, k): res[(u, k)] for i, u in enumerate(rep) for k in [v.key for v in variants]}
        ref = FA.summarize(FA.ppl_table(fake, list(range(len(rep))), variants))
        assert got["clean"][0] == pytest.approx(ref["clean"], rel=1e-9)
        for m in ("attention", "contribution", "random"):
            for mode in ("comprehensiveness", "sufficiency"):
                assert got["aoc"][(m, mode)][0] == pytest.approx(ref["metrics"][m][f"{mode}_aoc"], rel=1e-9)
                assert got["log_aoc"][(m, mode)][0] == pytest.approx(ref["metrics"][m][f"{mode}_log_aoc"], rel=1e-9)


def test_selection_summary_equals_summarize(tiny):
    h, ids = tiny
    res = SE.experiment(h, InMemoryRun(), ids, SelectionSettings(ns=(2, 4), repeats=2, distances=("euclidean",),
                                                           predict=False, batch_size=1))
    sel, summary = res.tables["selection"], res.summary
    point = SE.resampled(res.per_window)
    assert point["ns"] == [2, 4]
    got = point["mean_f"]
    for kind, key in (("topn", "with_sink"), ("topn_nosink", "without_sink")):
        for i, n in enumerate((2, 4)):
            assert got[kind][0, i] == pytest.approx(summary["euclidean"][key]["f_topn"][n], rel=1e-9)
    assert got["random"][0, 0] == pytest.approx(summary["euclidean"]["with_sink"]["f_random"][2], rel=1e-9)
    # a resample: window 0 twice, window 1 dropped
    c = np.array([[2, 0, 1, 1]])
    got = SE.resampled(res.per_window, c)["mean_f"]
    rows = pd.concat([sel[sel.window == w] for w in (0, 0, 2, 3)])
    ref = rows[(rows.kind == "topn") & (rows.N == 4)]["F"].mean()
    assert got["topn"][0, 1] == pytest.approx(ref, rel=1e-9)


def _taxonomy_records(X: np.ndarray) -> list[dict]:
    """Taxonomy records (as :func:`attngeom.heads.experiment.taxonomy_stage` writes them) of winner sums ``[W, L, H, 3]``."""
    return [{"tax": {"sums": {str(l): {"winner_self": x[l, :, 0], "winner_sink": x[l, :, 1], "winner_other": x[l, :, 2]}
                              for l in range(x.shape[0])}}} for x in X]


def test_regime_shares_and_critical_z_against_reference():
    rng = np.random.default_rng(2)
    X = rng.uniform(size=(5, 3, 4, 3))                      # [W, L, H, 3] winner sums
    got = HD.resampled({"taxonomy": _taxonomy_records(X)})["regime_shares"][0]
    s = X.sum(0).reshape(-1, 3)
    df = pd.DataFrame({"winner_self": s[:, 0], "winner_sink": s[:, 1], "winner_other": s[:, 2]})
    df["regime"] = regimes_of(df)
    ref = regime_shares(df)
    assert list(got) == pytest.approx([ref[r] for r in REGIMES])
    # critical z: the heads.critical_heads rule, leave-one-out, fallback to the whole model
    L, H = 3, 4
    delta = rng.normal(size=(L, H))
    delta[0, 2] = 25.0
    regimes = np.array(["Reset"] * 9 + ["Mixer"] * 3, dtype=object)
    tax = pd.DataFrame({"layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L), "regime": regimes})
    z = HD.critical_z(delta.reshape(1, -1), regimes)[0]
    crit = HD.critical_heads(delta, tax, k=3.0)
    by = {(c["layer"], c["head"]): c["z"] for c in crit}
    assert (0, 2) in by
    for (l, hh), zz in by.items():
        assert z[l * H + hh] == pytest.approx(zz, rel=1e-9)
    flagged = {(k // H, k % H) for k in range(L * H) if z[k] > 3 and delta.reshape(-1)[k] > 0}
    assert flagged == set(by)


def test_verdict_rules():
    assert CL.verdict_side(0.1, 0.3) == CL.HOLDS
    assert CL.verdict_side(-0.3, -0.1) == CL.REFUTED
    assert CL.verdict_side(-0.1, 0.3) == CL.INCONCLUSIVE
    assert CL.verdict_side(0.5, 0.9, threshold=1.0) == CL.REFUTED
    assert CL.verdict_side(0.5, 0.9, threshold=1.0, claim_above=False) == CL.HOLDS
    assert CL.verdict_range(4, 6, 3, 10) == CL.HOLDS
    assert CL.verdict_range(1, 2, 3, 10) == CL.REFUTED
    assert CL.verdict_range(11, 12, 3, 10) == CL.REFUTED
    assert CL.verdict_range(2, 4, 3, 10) == CL.INCONCLUSIVE
    assert CL.verdict_range(None, 4, 3, 10) == CL.INCONCLUSIVE
    assert CL.verdict_all([(0.1, 1), (0.2, 2)]) == CL.HOLDS
    assert CL.verdict_all([(0.1, 1), (-2, -1)]) == CL.REFUTED
    assert CL.verdict_all([(0.1, 1), (-1, 1)]) == CL.INCONCLUSIVE


def test_escape_markdown():
    assert escape("a | b") == "a \\| b"
    assert escape("*x*_y_") == "\\*x\\*\\_y\\_"
    assert "\n" not in escape("line\nbreak")
    assert escape(None) == ""


def test_per_ratio_verdicts_on_a_hand_made_case():
    """Two metrics, three ratios, sufficiency (smaller ΔPPL is better). Resamples are made so the
    intervals are known: at r=0.2 'contribution' is worse (its ΔPPL larger in every resample), at 0.5
    the two overlap, at 0.8 it is better. The verdicts are refuted, inconclusive, holds, with two
    crossovers, while the AOC (the mean over ratios) alone would hide the change."""
    R = 1000
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.01, R)
    delta = {("attention", "sufficiency", 0.2): 1.0 + noise, ("contribution", "sufficiency", 0.2): 2.0 + noise,
             ("attention", "sufficiency", 0.5): 5.0 + noise, ("contribution", "sufficiency", 0.5): 5.0 + rng.normal(0, 1, R),
             ("attention", "sufficiency", 0.8): 20.0 + noise, ("contribution", "sufficiency", 0.8): 10.0 + noise}
    point = {"delta": {k: np.array([float(np.mean(v))]) for k, v in delta.items()}}
    out = CL.per_ratio_verdicts(point, {"delta": delta}, "sufficiency", [("contribution", "attention")], [0.2, 0.5, 0.8])
    got = {r: d["verdict"] for r, d in out["ratios"].items()}
    assert got == {"0.2": CL.REFUTED, "0.5": CL.INCONCLUSIVE, "0.8": CL.HOLDS}
    d02 = out["ratios"]["0.2"]["numbers"]["contribution vs attention"]
    assert d02["value"] == pytest.approx(-1.0, abs=1e-3) and d02["high"] < 0      # attention − contribution
    assert out["crossover"] == [f"0.2–0.5: {CL.REFUTED} → {CL.INCONCLUSIVE}", f"0.5–0.8: {CL.INCONCLUSIVE} → {CL.HOLDS}"]
    # comprehensiveness reads the other way: larger ΔPPL is better
    comp = {(m, "comprehensiveness", r): v for (m, _, r), v in delta.items()}
    pc = {"delta": {k: np.array([float(np.mean(v))]) for k, v in comp.items()}}
    out = CL.per_ratio_verdicts(pc, {"delta": comp}, "comprehensiveness", [("contribution", "attention")], [0.2, 0.8])
    assert [d["verdict"] for d in out["ratios"].values()] == [CL.HOLDS, CL.REFUTED]


ANALYSES = ("faithfulness", "sinks", "selection", "heads", "kvcache")


def _record_keys() -> set[str]:
    """The string keys the analyses write into their stage records (what a ``work`` function returns
    or fills in) and into an experiment's ``per_window``."""
    import ast
    from pathlib import Path

    import attngeom

    keys: set[str] = set()

    def dict_keys(node):
        return {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant) and isinstance(k.value, str)}

    for part in ANALYSES:
        for path in (Path(attngeom.__file__).parent / part).glob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for f in ast.walk(tree):
                if not isinstance(f, ast.FunctionDef):
                    continue
                for n in ast.walk(f):
                    if f.name == "work" and isinstance(n, ast.Return) and isinstance(n.value, ast.Dict):
                        keys |= dict_keys(n.value)
                    if isinstance(n, (ast.Assign, ast.AugAssign)):
                        targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                        for t in targets:
                            name = t.id if isinstance(t, ast.Name) else (t.value.id if isinstance(t, ast.Subscript)
                                                                          and isinstance(t.value, ast.Name) else None)
                            if name in ("per_window", "rec", "record") or (f.name == "work" and name is not None):
                                keys |= dict_keys(n.value)
                                if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant):
                                    keys.add(t.slice.value)
                    if isinstance(n, ast.keyword) and n.arg == "per_window":
                        keys |= dict_keys(n.value)
    return keys


def test_claims_reads_other_analyses_only_through_their_public_functions():
    """claims/ imports no private name (``_x``) of another module, reaches none through a module
    attribute, never indexes another experiment's ``per_window`` and uses none of the key literals
    of the analyses' records: each analysis turns its own records into its summary."""
    import ast
    from pathlib import Path

    import attngeom

    record_keys = _record_keys()
    assert {"nll", "tokens", "records", "taxonomy", "sensitivity", "removal", "tax", "stats"} <= record_keys
    trees = {p.name: ast.parse(p.read_text(encoding="utf-8")) for p in sorted((Path(attngeom.__file__).parent / "claims").glob("*.py"))}
    own = {n.slice.value for t in trees.values() for n in ast.walk(t)                # keys claims writes itself
           if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.slice, ast.Constant)}
    record_keys -= own
    bad = []
    for name, tree in trees.items():
        path = Path(name)
        for n in ast.walk(tree):
            where = f"{path.name}:{getattr(n, 'lineno', '?')}"
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("attngeom"):
                bad += [f"{where} imports {a.name}" for a in n.names if a.name.startswith("_")]
            elif isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                bad.append(f"{where} reads .{n.attr}")
            elif isinstance(n, ast.Attribute) and n.attr in ("stage", "records"):
                bad.append(f"{where} reads .{n.attr}")
            elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "per_window":
                bad.append(f"{where} indexes per_window")
            elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value in record_keys:
                bad.append(f"{where} reads the record key {n.slice.value!r}")
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
                  and isinstance(n.args[0], ast.Constant) and n.args[0].value in record_keys):
                bad.append(f"{where} reads the record key {n.args[0].value!r}")
    assert not bad, bad


def test_docs_claims_table_is_the_catalogue():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "claims.md").read_text(encoding="utf-8")
    assert CL.catalogue_table() in page
    table = [line for line in page.splitlines() if line.startswith("| ") and line.split("|")[2].strip().startswith("`")]
    assert len(table) == len(CL.CLAIMS)


def test_semantic_cone_term_is_specs_cone_measure():
    """claims.md's "semantic cone" term gives SPEC §4's cone measure κ (formula and wording), not the
    cosine with the semantic mean direction, which SPEC reports beside it but rejects as the measure."""
    import re
    from pathlib import Path

    from attngeom.reports.claims import TERMS

    spec = (Path(__file__).resolve().parents[2] / "docs" / "SPEC.md").read_text(encoding="utf-8")
    section = next(s for s in re.split(r"\n## ", spec) if s.startswith("4."))
    formula = re.search(r"^  `(κ_i = [^`]+)`$", section, re.M).group(1)
    words = "attention-weighted mean cosine of the output with each semantic value"
    assert words in " ".join(section.split())
    term = dict(TERMS)["semantic cone"]
    assert formula in term and words in term and "SPEC §4" in term
    assert "mean direction" not in term
    claim = next(c for c in CL.CLAIMS if c["id"] == "sink_removal_cone_collapse")
    assert "attention-weighted mean cosine" in claim["measure"]


def test_rows_on_too_few_windows_get_no_interval_and_say_so():
    """Two windows: no interval anywhere in the rows or their detail, and the verdict says why."""
    row = CL.claim_row("sink_value_small", value="4×", low=3.9, high=4.1, verdict=CL.HOLDS,
                  numbers={"raw": {"value": 4.0, "low": 3.9, "high": 4.1}})
    detail = {"share": {"value": 0.5, "low": 0.4, "high": 0.6}, "nested": [{"value": 1, "low": 0, "high": 2}]}
    (out,) = CL.sized([row], detail, 2)
    assert (out["verdict"], out["interval"], out["low"], out["high"], out["windows"]) == (CL.TOO_FEW, "—", None, None, 2)
    assert out["numbers"]["raw"] == {"value": 4.0, "low": None, "high": None}
    assert detail["share"]["low"] is None and detail["nested"][0]["high"] is None
    assert "at least 10" in out["note"]
    (kept,) = CL.sized([CL.claim_row("sink_value_small", value="4×", low=3.9, high=4.1, verdict=CL.HOLDS)], {}, 10)
    assert (kept["verdict"], kept["low"]) == (CL.HOLDS, 3.9)


def test_stored_claims_render_again_in_one_number_format_with_terms():
    """claims.md of the runs kept in docs/claims-runs is their claims.json rendered again under the
    current rules: one number format in every cell, the terms defined, the claims numbered as the
    catalogue numbers them, a claim resting on fewer than 10 windows (claim 16 on 2 calibration
    windows) too few windows, every other verdict the stored one (nothing recomputed)."""
    import re
    from pathlib import Path

    from attngeom.claims.catalogue import claim_number
    from attngeom.reports.claims import one_number_format, rerender

    assert one_number_format("1.772e+04 [1.161e+04, 114286]; +2606 at layer 23, 0.5 %") == \
        "17,720 [11,610, 114,286]; +2,606 at layer 23, 0.5 %"
    assert one_number_format("142,437 [1.2e-05, 3.5]") == "142,437 [1.20e-05, 3.5]"
    runs = sorted((Path(__file__).resolve().parents[2] / "docs" / "claims-runs").glob("*/claims.json"))
    assert runs
    for p in runs:
        stored = json.loads(p.read_text())
        md = rerender(stored)
        assert (p.parent / "claims.md").read_text() == md, f"{p.parent.name}: claims.md is not claims.json rendered"
        assert "## Terms" in md and not re.search(r"\d\.?\d*e\+\d", md)
        assert not re.search(r"(?<![\d.,\w/])-?\d{4,}(?![\d,.\w])", md.split("Run time")[1].split("\n", 1)[1])
        verdicts = re.findall(r"\| ((?:\*\*)?[a-z ]+(?:\*\*)?) \|$", md, re.M)[1:len(stored["rows"]) + 1]
        info = stored["windows"]
        expected = ["too few windows" if r["id"] == "early_critical_head" and info["calibration_windows"] < 10
                    else r["verdict"] for r in stored["rows"]]
        assert [v.strip("*") for v in verdicts] == expected
        numbers = [int(n) for n in re.findall(r"^\| (\d+) \|", md, re.M)][:len(stored["rows"])]
        assert numbers == [claim_number(r["id"]) for r in stored["rows"]]


def test_the_calibration_claim_states_its_evidence_and_what_gives_a_verdict():
    from attngeom.claims.catalogue import calibration_evidence
    from attngeom.claims.settings import ClaimsSettings
    from attngeom.stats.resampling import MIN_UNITS

    default = ClaimsSettings().calib_windows
    assert default < MIN_UNITS          # a documented choice (docs/claims.md#sample-size): the row says so
    row = CL.claim_row("early_critical_head", value="z = 4", low=3.5, high=5.0, verdict=CL.HOLDS, note="early = layers 0–1")
    (out,) = calibration_evidence(CL.sized([row], {}, default), default)
    assert out["verdict"] == CL.TOO_FEW and out["windows"] == default
    assert out["note"].startswith(f"evidence: single-head removal on the {default} calibration window(s) only; "
                                  f"a verdict needs --calib-windows {MIN_UNITS} (and --max-windows {2 * MIN_UNITS}")
    assert "early = layers 0–1" in out["note"] and f"{default} window(s); intervals need at least" in out["note"]
    row = CL.claim_row("early_critical_head", value="z = 4", low=3.5, high=5.0, verdict=CL.HOLDS, note="")
    (enough,) = calibration_evidence(CL.sized([row], {}, MIN_UNITS), MIN_UNITS)
    assert enough["verdict"] == CL.HOLDS and "a verdict needs" not in enough["note"]
    assert enough["note"] == f"evidence: single-head removal on the {MIN_UNITS} calibration window(s) only"


def test_claims_help_says_what_gives_the_calibration_claim_a_verdict(capsys):
    import re

    with pytest.raises(SystemExit):
        main(["claims", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"below 10 of them \(the default 2\) its verdict is 'too few windows'", text)
    assert "--calib-windows 10 --max-windows 20 gives every claim a verdict" in text


def test_claims_skip_leaves_out_an_analysis_and_its_cost(tiny_llama_dir, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The sink collects attention but adds little to the output. " * 30)
    out = tmp_path / "claims"
    args = ["claims", "--model", str(tiny_llama_dir), "--data", str(corpus), "--window", "16", "--max-windows", "4",
            "--ns", "2", "--repeats", "1", "--bootstrap", "100", "--skip", "faithfulness,rivals,heads", "--no-progress"]
    assert main(args + ["--out", str(out)]) == 0
    res = json.loads((out / "claims.json").read_text())
    assert {r["id"] for r in res["rows"]} == {c["id"] for c in CL.CLAIMS[4:12]}          # sinks and selection
    assert all(r["verdict"] == CL.TOO_FEW for r in res["rows"])                          # on 4 windows
    assert (out / "report.md").is_file() and "too few windows" in (out / "report.md").read_text()
    from attngeom.reports.claims import rerender
    assert (out / "claims.md").read_text() == rerender(res)            # claims.md is claims.json rendered
    assert main(args[:-3] + ["--skip", "faithfulness,nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown analysis 'nope'" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_claims_per_head_and_rivals_choose_the_head_to_head(tiny_llama_dir, tmp_path, capsys):
    """``--rivals`` names the measures of the head-to-head rows, ``--per-head`` ranks per head and leaves
    out the measures defined on the layer only; both are recorded and said in the report."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("The sink collects attention but adds little to the output. " * 30)
    out = tmp_path / "claims"
    base = ["claims", "--model", str(tiny_llama_dir), "--data", str(corpus), "--window", "16", "--max-windows", "4",
            "--ns", "2", "--ratios", "0.5", "--bootstrap", "100", "--skip", "faithfulness,sinks,selection,heads",
            "--no-progress"]
    assert main(base + ["--per-head", "--rivals", "grad_attention,alti", "--out", str(out)]) == 0
    res = json.loads((out / "claims.json").read_text())
    assert [r["id"] for r in res["rows"]] == ["contribution_beats_grad_attention_comprehensiveness",
                                              "contribution_beats_grad_attention_sufficiency"]
    assert res["settings"]["per_head"] is True and res["settings"]["rivals"] == ["grad_attention", "alti"]
    assert "rankings: **per head**" in (out / "claims.md").read_text()
    # refusals before any compute, one line each
    for extra, says in ((["--rivals", "nope"], "unknown measure 'nope'"),
                        (["--rivals", "alti,alti"], "name each measure once"),
                        (["--per-head", "--rivals", "alti,rollout"], "defined on the layer only"),
                        (["--skip", "rivals,sinks", "--rivals", "alti"], "--skip rivals leaves out")):
        capsys.readouterr()
        args = [a for a in base] + extra + ["--out", str(tmp_path / "x")]
        if "--skip" in extra:
            i = args.index("--skip")
            del args[i:i + 2]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()


def test_a_row_of_several_margins_shows_the_one_its_verdict_comes_from():
    """The row used to show the smallest margin: an interval wholly above 0 beside 'inconclusive',
    because another margin with a larger value reached below 0. It now shows that other margin."""
    from attngeom.claims.catalogue import HOLDS, INCONCLUSIVE, REFUTED, deciding, verdict_all

    def iv(v, lo, hi):
        return {"value": v, "low": lo, "high": hi}

    cases = [({"a": iv(1.0, 0.5, 1.5), "b": iv(3.0, -1.0, 7.0)}, "b", INCONCLUSIVE),   # smallest value is 'a'
             ({"a": iv(1.0, 0.5, 1.5), "b": iv(3.0, 0.2, 7.0)}, "b", HOLDS),
             ({"a": iv(-2.0, -3.0, -1.0), "b": iv(-5.0, -9.0, 1.0)}, "a", REFUTED),
             ({"a": iv(2.0, None, None), "b": iv(1.0, None, None)}, "b", None)]
    for numbers, name, verdict in cases:
        assert deciding(numbers) is numbers[name]
        if verdict is not None:
            d = deciding(numbers)
            assert verdict_all([(x["low"], x["high"]) for x in numbers.values()]) == verdict
            # the row's own interval can never read 'holds' while the verdict says otherwise, nor the reverse
            assert (d["low"] > 0) == (verdict == HOLDS)


def test_claims_keep_their_numbers_when_some_are_skipped():
    from attngeom.claims.catalogue import CLAIMS, claim_number, claim_row
    from attngeom.reports.claims import render

    rows = [claim_row("sink_value_small", value="3.7×", verdict="holds", low=3.6, high=3.8),
            claim_row("early_critical_head", value="z = 5", verdict="too few windows")]
    md = render({"rows": rows, "detail": {}, "windows": {"windows": 12}, "settings": {}}, "m", "d")
    assert "\n| 5 | the sink token" in md and "\n| 16 | a single head" in md and "\n| 1 |" not in md
    assert [claim_number(c["id"]) for c in CLAIMS] == list(range(1, len(CLAIMS) + 1))


def test_a_stored_run_is_judged_by_the_current_rules():
    from attngeom.claims.catalogue import claim_row, under_current_rules

    z = claim_row("early_critical_head", value="z = 13", verdict="holds", low=11.0, high=13.0,
                  numbers={"largest early z": {"value": 13.0, "low": 11.0, "high": 13.0}})
    best = claim_row("contribution_best_comprehensiveness", value="1", verdict="inconclusive", low=0.5, high=1.5,
                     numbers={"contribution vs a": {"value": 1.0, "low": 0.5, "high": 1.5},
                              "contribution vs b": {"value": 3.0, "low": -1.0, "high": 7.0}},
                     note="value: the smallest AOC margin of contribution over another metric (ΔPPL units)")
    stored = {"rows": [best, z], "windows": {"windows": 12, "calibration_windows": 2, "heldout_windows": 10}}
    out = under_current_rules(stored)
    b, e = out["rows"]
    assert (b["value"], b["low"], b["high"], b["verdict"], b["windows"]) == ("3", -1.0, 7.0, "inconclusive", 12)
    assert "the smallest" not in b["note"] and "rests on" in b["note"]
    assert e["verdict"] == "too few windows" and e["low"] is None and e["windows"] == 2
    assert "--calib-windows 10" in e["note"]
    assert stored["rows"][1]["verdict"] == "holds"                          # the stored data is left as it was
