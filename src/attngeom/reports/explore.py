"""HTML of the explorer: one self-contained page (inline JS and CSS, no network) from an
:class:`attngeom.explorer.data.ExploreData` (the ``data`` every function here takes; this module does not
import the explorer, whose ``ExploreData.to_html`` calls :func:`write`).

The data travels as JSON in ``<script type="application/json">`` with ``<``, ``>``, ``&``, U+2028
and U+2029 escaped, so no token text can close the script element or be read as markup; the page
puts every token into the document with ``textContent`` only. The maps are one binary block
(float16 values; top-k source positions as uint16 gaps, :func:`encode_sources`; as low and high
byte planes), zlib-compressed and base64-encoded inside that
JSON; the page inflates it with the browser's ``DecompressionStream``.
"""

from __future__ import annotations

import base64
import html
import json
import zlib
from importlib import resources
from pathlib import Path

import numpy as np

from attngeom.explorer.settings import PAD

TEMPLATE = "explore_template.html"
PLACEHOLDER = "__EXPLORE_DATA__"
ZERO = 0xFFFE  # source code of position 0 in top-k rows


def _tri(x: np.ndarray) -> np.ndarray:
    """``[V, T, T]`` -> the lower triangles (``j <= i``) of each view, row by row: ``[V * T(T+1)/2]``."""
    V, T, _ = x.shape
    i, j = np.tril_indices(T)
    return x[:, i, j].reshape(-1)


def pack(data) -> tuple[bytes, dict]:
    """The binary block and, per metric and layer, the word offsets of its parts. The block holds
    ``N`` uint16 words as two byte planes (all low bytes, then all high bytes), which deflate
    compresses better than interleaved words."""
    parts: list[np.ndarray] = []
    blocks: dict[str, list[dict]] = {m: [] for m in data.rows}
    off = 0
    for m in blocks:
        for entry in data.rows[m]:
            where = {}
            if data.exact:
                arrs = {"val": _tri(entry).astype(np.float16).view(np.uint16)}
            else:
                idx, val = entry
                arrs = {"idx": encode_sources(idx), "val": val.astype(np.float16).view(np.uint16).reshape(-1)}
            for name, a in arrs.items():
                where[name] = off
                parts.append(a.astype("<u2"))
                off += a.size
            blocks[m].append(where)
    words = np.concatenate(parts) if parts else np.zeros(0, dtype="<u2")
    raw = (words & 0xFF).astype(np.uint8).tobytes() + (words >> 8).astype(np.uint8).tobytes()
    return raw, blocks


def encode_sources(idx: np.ndarray) -> np.ndarray:
    """Top-k source positions ``[V, T, k]`` (nearest first, ``PAD`` last) -> uint16 codes: the first
    is ``i - j``, each next one the gap to the previous source, position 0 is ``ZERO`` and ``PAD``
    stays; small numbers that deflate well."""
    pos = idx.astype(np.int64)
    V, T, k = pos.shape
    prev = np.concatenate([np.broadcast_to(np.arange(T)[None, :, None], (V, T, 1)), pos[..., :-1]], -1)
    code = np.where(pos == PAD, PAD, np.where(pos == 0, ZERO, prev - pos))
    return code.astype(np.uint16).reshape(-1)


def measure_entry(name: str | None) -> dict:
    """The page's ``measure`` entry (empty without one): the registry measure of the third list of
    sources, its label and formula, and whether it is defined on the layer only (no per-head view)."""
    if name is None:
        return {}
    from attngeom.metrics import registry

    m = registry.get(name)
    return {"measure": {"name": name, "label": registry.label(name), "formula": m.formula,
                        "layer_only": m.layer_only}}


def _escape_json(text: str) -> str:
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def payload(data, level: int = 9, initial_layer: int | None = None) -> dict:
    """The JSON object the page reads; ``initial_layer``: the layer the page opens at (default the last)."""
    from attngeom.heads.taxonomy import REGIMES

    raw, blocks = pack(data)
    L = data.meta.get("num_layers")
    contiguous = data.layers == list(range(data.layers[0], data.layers[-1] + 1))
    default_query = data.T - 1 if data.answer is None else data.answer["prompt_length"] - 1
    return {
        "format": "attngeom-explore-1",
        "model": data.model_name,
        "T": data.T,
        "H": data.num_heads,
        "layers": data.layers,
        "num_layers": L,
        "layers_contiguous": bool(contiguous),
        "sink": data.sink,
        "exact": data.exact,
        "k": data.top_k,
        **measure_entry(data.measure),
        "tokens": list(data.tokens),
        "special": [int(p) for p in data.special],
        "template": [int(p) for p in data.template],
        "initial_query": default_query,
        "initial_layer": initial_layer if initial_layer in data.layers else None,
        "regimes": list(REGIMES),
        "head_stats": {k: np.asarray(v).tolist() if k != "regime" else np.asarray(v).astype(int).tolist()
                       for k, v in data.head_stats.items()},
        "layer_sink": {k: [float(x) for x in v] for k, v in data.layer_sink.items()},
        "residual": None if data.residual_share is None else np.asarray(data.residual_share, dtype=np.float64).tolist(),
        "answer": None if data.answer is None else {
            "prompt_length": int(data.answer["prompt_length"]),
            "layers": {m: np.round(np.asarray(v, dtype=np.float64), 6).tolist() for m, v in data.answer["layers"].items()},
            "model": {m: np.round(np.asarray(v, dtype=np.float64), 6).tolist() for m, v in data.answer["model"].items()}},
        "blocks": blocks,
        "bin": base64.b64encode(zlib.compress(raw, level)).decode("ascii"),
    }


def render(data, initial_layer: int | None = None) -> str:
    """The whole page as a string, opening at ``initial_layer`` (default the last analysed layer)."""
    template = resources.files("attngeom.reports").joinpath(TEMPLATE).read_text(encoding="utf-8")
    head, sep, tail = template.partition(PLACEHOLDER)
    if not sep:  # pragma: no cover - a broken install
        raise RuntimeError(f"{TEMPLATE} has no {PLACEHOLDER}")
    # ensure_ascii: non-ASCII text (and any lone surrogate a tokenizer leaves) as \u escapes
    body = json.dumps(payload(data, initial_layer=initial_layer), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return head + _escape_json(body) + tail


def summary(data, settings: dict, page_bytes: int, runtime_s: float) -> dict:
    """``summary.json`` of ``attngeom explore``: the run's settings, what the page holds (tokens,
    layers, exact maps or top-k sources, the answer's length, the measure when one is shown) and each
    analysed layer's sink attention and contribution (the page's sink chart);
    :func:`attngeom.reports.run_report.render` writes ``report.md`` from it."""
    P = None if data.answer is None else int(data.answer["prompt_length"])
    return {"command": "explore", "model": data.model_name, "settings": settings,
            "source": settings.get("source"), "tokens": data.T, "prompt_tokens": P,
            "answer_tokens": None if P is None else data.T - P, "layers": list(data.layers),
            "heads": data.num_heads, "sink": data.sink, "exact": bool(data.exact), "top_k": data.top_k,
            **({} if data.measure is None else {"measure": data.measure}),
            "layer_sink": {k: [float(x) for x in v] for k, v in data.layer_sink.items()},
            "page_bytes": int(page_bytes), "runtime_s": runtime_s}


def headline(summary: dict) -> list[tuple[str, str]]:
    """The headline numbers of ``attngeom explore``'s report from its :func:`summary` (a missing field
    raises)."""
    from attngeom.metrics import registry
    from attngeom.stats.resampling import format_number as f

    layers = summary["layers"]
    out = [("tokens", str(summary["tokens"])), ("layers analysed", _layer_list(layers)),
           ("heads per layer", str(summary["heads"])),
           ("maps", "exact" if summary["exact"] else f"top-{summary['top_k']} sources per (layer, head, query)")]
    if summary["answer_tokens"] is not None:
        out.append(("prompt + answer tokens", f"{summary['prompt_tokens']} + {summary['answer_tokens']}"))
    if summary.get("measure"):                       # in the summary only when the page shows one
        out.append(("third list of sources", registry.label(summary["measure"])))
    for key, what in (("sink_attention", "attention"), ("sink_contribution", "contribution")):
        v = summary["layer_sink"].get(key, [])
        if v:
            hi = max(range(len(v)), key=v.__getitem__)
            out.append((f"sink (position {summary['sink']}) {what}: mean over layers; highest (layer)",
                        f"{f(sum(v) / len(v))}; {f(v[hi])} (layer {layers[hi]})"))
    size = summary["page_bytes"]
    out.append(("page size", f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"))
    return out


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 12 else f"{layers[0]}–{layers[-1]} ({len(layers)} layers)"


def write(data, path: str | Path) -> Path:
    """Write the page to ``path`` (UTF-8). Returns the path."""
    path = Path(path)
    path.write_text(render(data), encoding="utf-8", newline="\n")
    return path


def iframe(data, height: int = 760) -> str:
    """The page inside an ``<iframe srcdoc>``, for Jupyter (scripts in notebook output run isolated)."""
    return (f'<iframe srcdoc="{html.escape(render(data), quote=True)}" '
            f'style="width:100%;height:{int(height)}px;border:1px solid #ddd" '
            'sandbox="allow-scripts"></iframe>')


SUMMARY_MAX_TOKENS = 400
"""Tokens shown by :func:`summary_html` (a trace's notebook display); the rest is elided."""


def summary_html(trace) -> str:
    """A trace's notebook display: one line of facts and its tokens (special and template tokens
    dashed, the answer underlined), every string escaped; a few kB, no maps."""
    T = len(trace)
    special, template = set(trace.special), set(trace.template)
    P = trace.prompt_length if trace.prompt_length is not None else T
    spans = []
    for p, tok in enumerate(trace.tokens[:SUMMARY_MAX_TOKENS]):
        style = ("border:1px dashed #6e7781;" if p in special or p in template else "") + \
                ("border-bottom:2px solid #2da44e;" if p >= P else "")
        shown = "".join(chr(0x2400 + ord(c)) if ord(c) < 32 else c for c in tok)
        spans.append(f'<span title="position {p}" style="{style}">{html.escape(shown)}</span>')
    more = f" … ({T - SUMMARY_MAX_TOKENS} more)" if T > SUMMARY_MAX_TOKENS else ""
    return ('<div style="font:13px system-ui,sans-serif">'
            f'<div><b>{html.escape(repr(trace))}</b></div>'
            f'<div style="font-family:ui-monospace,monospace;white-space:pre-wrap;margin:4px 0">{"".join(spans)}{more}</div>'
            '<div style="color:#656d76">dashed: special or chat-template tokens; underlined: the answer. '
            'The interactive explorer: <code>trace.to_html("explore.html")</code>, or <code>trace.explore()</code> '
            'inline.</div></div>')


class Inline:
    """HTML that Jupyter displays (:meth:`attngeom.traces.trace.Trace.explore`)."""

    def __init__(self, markup: str):
        self.markup = markup

    def _repr_html_(self) -> str:
        return self.markup

    def __repr__(self) -> str:
        return f"<attngeom explorer, {len(self.markup) // 1024} kB of HTML: display it in Jupyter>"
