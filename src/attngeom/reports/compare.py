"""Outputs of ``attngeom compare``: ``report.md`` and ``compare.html``, two explorers side by side.

``compare.html`` holds the two explorer pages (:mod:`attngeom.reports.explore`) as ``<iframe
srcdoc>`` documents under a header that shows the alignment (changed tokens marked) and the heads
whose target rows differ most; every string is escaped. Hovering or pinning a token in one explorer
shows its aligned counterpart in the other (the pages talk through ``postMessage``)."""

from __future__ import annotations

import html

from attngeom.reports import markdown as md

TOP = 10
"""Heads listed in the report and the page header."""


def top_heads(heads, measure: str = "contribution", top: int = TOP):
    """The ``top`` (layer, head) rows whose target rows differ most by ``measure`` (ties: layer, head)."""
    if not len(heads):
        return heads
    return heads.sort_values([f"{measure}_distance", "layer", "head"], ascending=[False, True, True],
                             kind="stable").head(top)


def report_markdown(summary: dict, diff) -> str:
    """``report.md`` of a comparison: what was compared, the alignment, per layer the distance of the
    target rows, the heads that changed most and the sources that changed most at the most
    different layer."""
    s, t = summary, md.text
    lines = [f"# attngeom compare — {t(s['model_a'])} vs {t(s['model_b'])}", "",
             f"- a: {t(s['source_a'])} ({s['tokens_a']} tokens, {t(s['model_a'])})",
             f"- b: {t(s['source_b'])} ({s['tokens_b']} tokens, {t(s['model_b'])})",
             f"- alignment: {s['aligned']} tokens aligned, {s['changed_a']} changed in a, {s['changed_b']} in b "
             "(longest matching blocks of the token strings; docs/explore.md#comparing-two-traces)",
             md.Raw(f"- target: {md.token(s['target']['token'])} at position {s['target']['position_a']} of a, "
                    f"{s['target']['position_b']} of b"), "",
             "Distance = ½ Σ_j |b − a| over the target rows' sources (a changed source counts against zero; for "
             "attention, which sums to 1, the total variation distance); changed share = the row's sum on the "
             "changed sources.", ""]
    lines += md.table(["layer", "measure", "distance", "changed share a", "changed share b"],
                      ([r.layer, r.measure, f"{r.distance:.4f}", f"{r.changed_share_a:.4f}", f"{r.changed_share_b:.4f}"]
                       for r in diff.layers.itertuples()), align="rlrrr")
    heads = top_heads(diff.heads)
    if len(heads):
        lines += ["", f"Heads whose contribution rows (C_ij^h) differ most at the target (top {len(heads)}):", ""]
        lines += md.table(["layer", "head", "contribution distance", "attention distance", "head share a",
                           "head share b", "sink rate a", "sink rate b"],
                          ([r.layer, r.head, f"{r.contribution_distance:.4f}", f"{r.attention_distance:.4f}",
                            f"{r.head_share_a:.4f}", f"{r.head_share_b:.4f}", f"{r.sink_rate_a:.4f}",
                            f"{r.sink_rate_b:.4f}"] for r in heads.itertuples()), align="rrrrrrrr")
    else:
        lines += ["", "The models have different numbers of heads: no per-head comparison."]
    lines += prediction_markdown(diff)
    worst = s["most_different_layer"]["contribution"]["layer"]
    src = diff.sources[diff.sources["layer"] == worst]
    src = src.reindex(src["contribution_diff"].abs().sort_values(ascending=False, kind="stable").index).head(TOP)
    lines += ["", f"Aligned sources whose contribution to the target changed most at layer {worst}:", ""]

    def cell(tok, pos):
        return md.Raw(f"{md.token(tok)} @{int(pos)}") if tok is not None and not (isinstance(tok, float)) else ""

    lines += md.table(["source a", "source b", "contribution a", "contribution b", "b − a"],
                      ([cell(r.token_a, r.position_a), cell(r.token_b, r.position_b), f"{r.contribution_a:.4f}",
                        f"{r.contribution_b:.4f}", f"{r.contribution_diff:+.4f}"]
                       for r in src[src["op"] == "equal"].itertuples()), align="llrrr")
    lines += ["", "## Files", ""]
    for f, note in FILES.items():
        lines.append(f"- {md.link(f, f)} — {md.text(note)}")
    return "\n".join(lines) + "\n"


def prediction_markdown(diff) -> list[str]:
    """Each side's prediction of the answer (and contrast) tokens and the heads whose patched output
    moves the metric most (:attr:`attngeom.traces.compare.TraceDiff.prediction`,
    :attr:`attngeom.traces.compare.TraceDiff.patching`); nothing without."""
    if diff.prediction is None:
        return []
    p = diff.prediction
    lines = ["", "Prediction at the last position of each text (m: the logit difference answer − contrast, or "
             "log P(answer)):", ""]
    lines += md.table(["side", "role", "token", "p", "logit", "m"],
                      ([r.side, r.role, md.Raw(md.token(r.token)), f"{r.p:.4f}", f"{r.logit:.3f}", f"{r.m:+.3f}"]
                       for r in p.itertuples()), align="lllrrr")
    if diff.patching is not None:
        q, a = diff.patching, diff.patching.attrs
        lines += ["", f"Activation patching: each head's output from b into a (m_a = {a['m_a']:+.3f}, m_b = "
                  f"{a['m_b']:+.3f}); the heads that move m most (effect = patched − m_a; share of the gap = "
                  "effect / (m_b − m_a)):", ""]
        lines += md.table(["patched at", "layer", "head", "patched m", "effect", "share of gap"],
                          ([r.at, r.layer, r.head, f"{r.patched:+.3f}", f"{r.effect:+.3f}", f"{r.share_of_gap:+.3f}"]
                           for r in q[q["rank"] < 5].itertuples()), align="lrrrrr")
    return lines


FILES = {
    "alignment.parquet": "one row per aligned pair or changed position: op, position_a/_b, token_a/_b",
    "layers.parquet": "per layer and measure at the target rows: distance, changed shares, output norms",
    "heads.parquet": "per layer and head at the target rows: attention and contribution distances, changed shares, "
                     "head share and sink rate in a and b",
    "sources.parquet": "per layer and source of the target rows: token-level attention and contribution in a and b, "
                       "and b − a",
    "compare.html": "the two explorers side by side (offline; hover a token in one to see it in the other)",
    "summary.json": "what was compared, the alignment counts, the target, the most different layers",
    "report.md": "this file",
}


SYNC = """<script>
(function () {
  // each explorer posts the position it shows; the other one shows the aligned position.
  // body data-ready="1": both explorers are ready (each posts its first position when it is);
  // data-synced-from="<0 or 1>:<position>": the last position received, data-synced: its counterpart.
  var A = %s, frames = [document.getElementById("fa"), document.getElementById("fb")], seen = [false, false];
  window.addEventListener("message", function (ev) {
    var d = ev.data; if (!d || d.attngeom !== "query") return;
    var from = frames[0].contentWindow === ev.source ? 0 : frames[1].contentWindow === ev.source ? 1 : -1;
    if (from < 0) return;
    var other = A[from][String(d.position)];
    document.body.dataset.synced = String(other === undefined ? -1 : other);
    document.body.dataset.syncedFrom = from + ":" + d.position;
    if (other !== undefined) frames[1 - from].contentWindow.postMessage({ attngeom: "show", position: other }, "*");
    seen[from] = true;
    if (seen[0] && seen[1]) document.body.dataset.ready = "1";
  });
})();
</script>"""


def page(page_a: str, page_b: str, summary: dict, diff) -> str:
    """``compare.html``: ``page_a`` and ``page_b`` (two explorer pages) side by side under the header."""
    import json

    import pandas as pd

    s = summary
    al = diff.alignment
    toks = []
    for r in al.itertuples():
        changed = r.op != "equal"
        in_a = not pd.isna(r.position_a)
        tok = r.token_a if in_a else r.token_b
        side = "" if not changed else (" a" if in_a else " b")
        toks.append(f'<span class="t{" ch" if changed else ""}{side}">{html.escape(_shown(str(tok)))}</span>')
    pred = ""
    if diff.prediction is not None:
        pred = "<table id=\"prediction\"><tr><th>side</th><th>token</th><th>p</th><th>m</th></tr>" + "".join(
            f"<tr><td>{html.escape(r.side)}</td><td>{html.escape(_shown(r.token))}</td><td>{r.p:.4f}</td>"
            f"<td>{r.m:+.3f}</td></tr>" for r in diff.prediction.itertuples()) + "</table>"
    heads = top_heads(diff.heads, top=5)
    head_rows = "".join(f"<tr><td>{int(r.layer)}</td><td>{int(r.head)}</td><td>{r.contribution_distance:.3f}</td>"
                        f"<td>{r.attention_distance:.3f}</td></tr>" for r in heads.itertuples())
    pairs = diff.pairs
    mapping = [{str(int(x)): int(y) for x, y in pairs}, {str(int(y)): int(x) for x, y in pairs}]
    body = json.dumps(mapping).replace("<", "\\u003c")
    esc = html.escape
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>attngeom compare</title>
<style>
 body {{ font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f6f8fa; color: #1f2328; }}
 header {{ background: #fff; border-bottom: 1px solid #d0d7de; padding: 8px 14px; }}
 h1 {{ font-size: 16px; margin: 0 0 4px; }} .meta {{ color: #656d76; font-size: 12px; }}
 .align {{ font-family: ui-monospace, monospace; white-space: pre-wrap; margin: 6px 0; }}
 .t.ch.a {{ background: #ffd7d5; }} .t.ch.b {{ background: #d2f4d3; }}
 table {{ border-collapse: collapse; font-size: 12px; }} td, th {{ padding: 1px 6px; text-align: right; }}
 .panes {{ display: grid; grid-template-columns: minmax(820px, 1fr) minmax(820px, 1fr); gap: 6px; padding: 6px; overflow-x: auto; }}
 .pane h2 {{ font-size: 13px; margin: 2px 4px; }}
 iframe {{ width: 100%; height: 1400px; border: 1px solid #d0d7de; background: #fff; }}
</style></head><body>
<header>
 <h1>attngeom compare: {esc(s['model_a'])} vs {esc(s['model_b'])}</h1>
 <div class="meta">{s['aligned']} tokens aligned; changed: <span class="t ch a">only in a</span>
 <span class="t ch b">only in b</span> (alignment by longest matching blocks of the tokens);
 target {esc(_shown(s['target']['token']))} at a:{s['target']['position_a']} / b:{s['target']['position_b']}.
 Hover or pin a token in one explorer to show its aligned token in the other.</div>
 <div class="align" id="alignment">{"".join(toks)}</div>
 {pred}
 <table id="topheads"><tr><th>layer</th><th>head</th><th>contribution distance</th><th>attention distance</th></tr>{head_rows}</table>
</header>
<div class="panes">
 <div class="pane"><h2>a: {esc(s['source_a'])} · {esc(s['model_a'])}</h2>
 <iframe id="fa" sandbox="allow-scripts" srcdoc="{html.escape(page_a, quote=True)}"></iframe></div>
 <div class="pane"><h2>b: {esc(s['source_b'])} · {esc(s['model_b'])}</h2>
 <iframe id="fb" sandbox="allow-scripts" srcdoc="{html.escape(page_b, quote=True)}"></iframe></div>
</div>
{SYNC % body}
</body></html>
"""


def _shown(tok: str) -> str:
    return "".join(chr(0x2400 + ord(c)) if ord(c) < 32 else c for c in tok)
